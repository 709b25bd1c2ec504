"""Decay branches of a WSD run (``branch_from`` / ``branch_step``; MiniCPM, arXiv 2404.06395 §4.1).

The warmup-stable-decay schedule keeps the learning rate constant until its decay phase, so one stable phase
can end in decays to several lengths: a branch restores another run's checkpoint (parameters, optimizer state,
step and data-iterator state) and continues with its own ``steps`` and decay. Up to the branch point the two
runs are the same run, so the branch equals a run trained from scratch with its settings (bitwise on the same
machine and mesh; ``tests/test_branch.py``).

:func:`resolve_branch` checks, before anything is written: the source folder and step exist and are not this
run's own; the configs differ only in :data:`BRANCH_MAY_CHANGE`; both learning-rate schedules agree at every
step before the branch point; a changed ``data.decay_weights`` only matters from the branch's decay on. The
source's folder is opened read-only (it may still be training: its in-progress saves are not touched).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minicpm4_jax.config import MTP_DRAFT_FIELDS, ConfigError, TrainConfig, diff_configs, same_sources
from minicpm4_jax.train.checkpoint import (RESUME_MAY_CHANGE, CheckpointSource, _field_of, checkpoint_dir_of,
                                           resolve_source)

__all__ = ["BranchSource", "BRANCH_MAY_CHANGE", "resolve_branch"]

#: Config fields a decay branch may set differently from its source: the run's length, the decay's shape, the
#: decay-phase data mixture, and what a resume may change anyway (logging, checkpoints, mesh, ...).
BRANCH_MAY_CHANGE = RESUME_MAY_CHANGE | frozenset({
    "steps", "optimizer.decay_steps", "optimizer.decay_fraction", "optimizer.decay_style", "optimizer.min_lr_ratio",
    "data.decay_weights",
})

#: A resolved ``branch_from``: the source's checkpoint folder, the step and the config it was saved with
#: (:class:`~minicpm4_jax.train.checkpoint.CheckpointSource`).
BranchSource = CheckpointSource


def resolve_branch(cfg: TrainConfig) -> CheckpointSource:
    """Find ``cfg.branch_from`` at ``cfg.branch_step`` (default: its latest step); check that ``cfg`` may branch there.

    Raises:
        ConfigError: (one line, with the fix) no such folder / checkpoint / step or an unreadable saved config
            (:func:`~minicpm4_jax.train.checkpoint.resolve_source`); this run's own folder; a config
            that differs outside :data:`BRANCH_MAY_CHANGE` (``data.sources`` naming the same files by another
            spelling do not differ); a QAT source; a branch point at or after ``steps``;
            learning rates that differ before the branch point (it lies inside a decay); a changed
            ``data.decay_weights`` whose source switch lies before the branch point.
    """
    import jax
    import jax.numpy as jnp

    from minicpm4_jax.train.step import decay_start_step, lr_schedule

    def not_own(directory: Path) -> None:
        if directory == checkpoint_dir_of(cfg):
            raise ConfigError(f"branch_from={cfg.branch_from!r} is this run's own checkpoint folder; a branch writes "
                              "its own checkpoints: give it another out_dir")

    src = resolve_source(cfg.branch_from, cfg.branch_step, path_option="branch_from", step_option="branch_step",
                         check_dir=not_own)
    directory, step, saved, steps = src.directory, src.step, src.cfg, src.saved_steps
    where = f"branch_from: checkpoint {directory}/{step}"
    diffs = diff_configs(saved, cfg)
    if not saved.model.mtp and not cfg.model.mtp:
        diffs = [d for d in diffs if _field_of(d) not in MTP_DRAFT_FIELDS]
    if same_sources(saved.data.sources, cfg.data.sources):  # the same files spelled otherwise, as for a resume
        diffs = [d for d in diffs if _field_of(d) != "data.sources"]
    refused = [d for d in diffs if _field_of(d) not in BRANCH_MAY_CHANGE | {"branch_from", "branch_step"}]
    if refused:
        raise ConfigError(f"{where} was trained with another config: " + "; ".join(refused)
                          + " (checkpoint value != current value); a decay branch keeps everything but steps, the "
                          "decay's shape (optimizer.decay_steps / decay_fraction / decay_style / min_lr_ratio) and "
                          "data.decay_weights")
    if saved.qat.enabled:
        raise ConfigError(f"{where} is a QAT run; branch from a high-precision run (a QAT run starts from another "
                          "with qat.init_from)")
    if step >= cfg.steps:
        raise ConfigError(f"{where}: the branch point is at or after this run's end (steps={cfg.steps}); raise steps "
                          "or pick an earlier branch_step")
    at = jnp.arange(step, dtype=jnp.int32)
    old = np.asarray(jax.jit(jax.vmap(lr_schedule(saved)))(at))
    new = np.asarray(jax.jit(jax.vmap(lr_schedule(cfg)))(at))
    differ = np.flatnonzero(old != new)
    if differ.size:
        first = int(differ[0])
        raise ConfigError(
            f"{where}: the learning rate of this run differs from the source's at step {first + 1} "
            f"({new[first]:.6g} != {old[first]:.6g}), before the branch point: the source decays from step "
            f"{decay_start_step(saved) + 1} and this run from step {decay_start_step(cfg) + 1}; branch at a step no "
            f"later than both (saved steps: {', '.join(map(str, steps))}) or keep the source's schedule")
    if saved.data.decay_weights != cfg.data.decay_weights and decay_start_step(saved) < step:
        # the mixture switches at the decay's first step: the source's order before the branch point was its own
        raise ConfigError(f"{where}: data.decay_weights differ, but the source's decay phase (and its mixture switch) "
                          f"began at step {decay_start_step(saved) + 1}, before the branch point; keep its "
                          "data.decay_weights or branch earlier")
    # a mixture switches to data.decay_weights at the first step of its decay, also where that step's learning
    # rate still equals the stable one (lr(N - D) = peak): the batches before the branch point must be the ones
    # this run's own schedule draws
    def switch_before_branch(c: TrainConfig) -> tuple[int, tuple[float, ...]] | None:
        if c.data.decay_weights is None or decay_start_step(c) >= step:
            return None
        return decay_start_step(c), tuple(c.data.decay_weights)

    if switch_before_branch(saved) != switch_before_branch(cfg):
        raise ConfigError(
            f"{where}: the data mixture switches to data.decay_weights at the first step of the decay (step "
            f"{decay_start_step(saved) + 1} in the source, step {decay_start_step(cfg) + 1} in this run), and the "
            f"batches before the branch point would differ from this run's; branch at a step no later than "
            f"{min(decay_start_step(saved), decay_start_step(cfg))} (saved steps: {', '.join(map(str, steps))})")
    return src
