"""The training main job: ``run_training(cfg, resume=...)``.

Order of work: acceptance checks before anything is written into ``out_dir`` (output and
checkpoint folders writable with enough free disk; existing checkpoints refused without
``--resume``; with ``--resume`` a checkpoint must exist and its saved config must match, see
:meth:`~minicpm4_jax.train.checkpoint.Checkpointer.check_compatible`) → prepare the data (tokenizer
+ token memmap, cached) → write ``out_dir/tokenizer`` and ``out_dir/config.json`` → build the
state (or restore it, with the data iterator, for ``--resume``) → compile the train step ahead of
time and print its memory analysis → train with a progress bar, logging loss / grad norm / LR /
tokens/s / MFU every ``log_every`` steps, validating every ``eval_every`` steps, checkpointing
every ``checkpoint.save_every`` steps → final validation, checkpoint, comparison table against
n-gram baselines, a generated sample and ``summary.json``.

Stopping:

* ``steps`` reached (the normal end) or ``max_train_minutes`` elapsed (at a step boundary; the
  run is then not step-for-step reproducible by a resumed run, which only holds for step-count
  runs);
* SIGTERM / SIGINT (and, with ``distributed.mode`` on, JAX's preemption notice): checked once per
  step; the state at the current step is checkpointed and :func:`run_training` returns with
  ``stop_reason = "signal"``. With several processes all of them stop and save at the same step
  (:class:`~minicpm4_jax.train.distributed.StopWatch`); the CLI then exits with 128 + the signal
  number (143 for SIGTERM) after one line ``SIGTERM received: saving a checkpoint at step N and exiting``.
  A second SIGINT aborts without the announced save: a save already under way is awaited, and
  :class:`~minicpm4_jax.train.distributed.SecondInterrupt` (a ``KeyboardInterrupt``) names the step not
  saved and the last complete checkpoint; the CLI prints it as one ``error:`` line and exits 130.
  Once the last step's checkpoint is saved (the finishing phase: final evaluation, statistics, sample), a
  signal to a one-process run stops it at once with
  :class:`~minicpm4_jax.train.distributed.FinishInterrupt`: one ``error:`` line naming the complete
  checkpoint, no ``summary.json``, exit 128 + the signal number; a multi-process run finishes that phase;
* a non-finite loss or gradient norm: :class:`TrainingDiverged` names the step and which value was
  non-finite; nothing after the last good checkpoint is saved (parameters are also checked finite
  before every save);
* a failed checkpoint write (disk full, I/O error): :class:`CheckpointWriteError` names the step, the
  cause and the last complete checkpoint, which stays intact;
* a failed write of the run folder's own files (``tokenizer/``, ``config.json``, ``data.json`` at the start,
  ``summary.json`` at the end): :class:`RunFileWriteError` names the file, the cause and what the checkpoints hold
  (``summary.json`` is written after the last checkpoint, which a full disk there leaves complete).

tokens/s and MFU are measured over pure training time: evaluation and checkpoint saves between two
log lines are excluded (:class:`_Throughput`).

A resumed run restores params, optimizer state, step and the grain iterator state, so N steps in
one go and N/2 + restart + N/2 give bitwise identical parameters (same compiled step, same data).
The restore reads each array straight into its sharding on the current mesh (abstract sharded
targets), so a run may resume on another mesh, device count or process count (then equal up to
float summation order).

Multi-host (``cfg.distributed``, :mod:`minicpm4_jax.train.distributed`): ``jax.distributed.initialize``
runs first; each process reads only its rows of every global batch
(:func:`~minicpm4_jax.sharding.process_batch_rows`) and the global batch is assembled with
``jax.make_array_from_process_local_data``; process 0 alone prints, shows the progress bar and
writes TensorBoard, ``config.json``, ``tokenizer/`` and ``summary.json``; every process takes part
in the (orbax) checkpoint writes and saves its data-iterator state. The generated sample at the end
is skipped with several processes (the parameters span hosts).

Ternary QAT (``cfg.qat``, BitCPM4 paper §3.3; helpers in :mod:`minicpm4_jax.train.qat`): with
``qat.init_from`` the run starts from that checkpoint's latent weights (checked before anything is
written; fresh optimizer, so the learning rate re-warms) and, with ``qat.continue_data``, its data
order; once the model is ternary (past ``cfg.qat_start_step``) evaluation, the sample and the final
loss use the fake-quantized weights, and every log line adds the fraction of zero codes and the
mean scale (per layer and matrix in TensorBoard under ``qat/`` and in the terminal at each
evaluation).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from minicpm4_jax.config import (ConfigError, TrainConfig, check_training_selection, config_to_dict,
                                 inactive_draft_options, inactive_qat_options, qat_warmup_warning, validate)
from minicpm4_jax.quant import checkpoint_is_ternary, ternarize, ternary_spec, ternary_stats
from minicpm4_jax.train.checkpoint import (Checkpointer, CheckpointWriteError, checkpoint_dir_of,
                                           checkpoint_write_error, holds_checkpoint_steps, is_checkpoint_step,
                                           params_all_finite, recorded_checkpoint_directory, sharded_abstract_state)
from minicpm4_jax.train.metrics import (MetricsWriter, measure_matmul_peak_flops, mfu, mfu_above_peak_causes,
                                        model_flops_per_second, peak_devices, ternary_scalars)
from minicpm4_jax.sharding import (batch_sharding, check_batch_size, check_vocab_size, make_global_batch, make_mesh,
                                   process_batch_rows, replicated)
from minicpm4_jax.train.step import (TrainState, decay_start_step, init_model, init_train_state,
                                     kernels_under_mesh, make_eval_step, make_train_step, print_memory_analysis,
                                     train_state_shardings)

__all__ = ["run_training", "TrainingDiverged", "CheckpointWriteError", "RunFileWriteError", "check_output_dir",
           "required_free_bytes"]

#: Minimum free disk space at start on top of the checkpoint estimate.
MIN_FREE_MB = 64


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became non-finite; the message names the step and the last good checkpoint."""


class RunFileWriteError(RuntimeError):
    """Writing one of the run folder's own files failed (a full disk, an I/O error): one line naming the file, the
    cause and what the run's checkpoints hold. Checkpoint writes raise :class:`CheckpointWriteError` instead."""


@contextmanager
def _writing(what: Path, then: Callable[[], str], doing: str = "writing") -> Iterator[None]:
    """Turn an ``OSError`` raised while writing (``doing``: or removing) the run file(s) ``what`` into a
    :class:`RunFileWriteError` whose message ends with ``then()`` (what was saved and how to go on)."""
    try:
        yield
    except OSError as e:
        raise RunFileWriteError(f"{doing} {what} failed ({e.strerror or e}); {then()}") from e


def divergence_message(step_no: int, loss: float, grad_norm: float, where: str) -> str:
    """The :class:`TrainingDiverged` message: which of loss / grad norm is non-finite, with its value."""
    bad = [f"{name} ({v})" for name, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v)]
    good = [f"{name} {v:.6g}" for name, v in (("loss", loss), ("grad norm", grad_norm)) if math.isfinite(v)]
    msg = f"non-finite {' and '.join(bad)} at step {step_no}"
    if good:
        msg += f" ({good[0]} is finite)"
    return f"{msg}; training stopped and this state was not saved; {where}"


def interrupted_message(step: int | None, saved: int | None, ckpt_dir: Path) -> str:
    """The one-line report of a run stopped by a second SIGINT: whether ``step`` (the completed updates) was saved,
    else the last complete checkpoint ``saved`` in ``ckpt_dir`` to resume from."""
    if step is not None and saved == step:
        return f"second interrupt: stopped; checkpoint step {step} in {ckpt_dir} is complete (resume with --resume)"
    what = f"stopped without saving step {step}" if step is not None else "stopped before the first step"
    last = (f"the last complete checkpoint is step {saved} in {ckpt_dir} (resume with --resume)" if saved is not None
            else f"no checkpoint was saved in {ckpt_dir} (train again without --resume)")
    return f"second interrupt: {what}; {last}"


def finish_interrupted_message(signum: int, step: int, saved: int | None, ckpt_dir: Path) -> str:
    """The one-line report of a one-process run stopped by signal ``signum`` after its last step's checkpoint was
    saved (during the final evaluation, statistics or sample); ``saved`` is the latest complete checkpoint."""
    name = signal.Signals(signum).name
    if saved == step:
        where = f"checkpoint step {step} in {ckpt_dir} is complete"
    else:  # the final save failed to complete
        where = (f"the last complete checkpoint is step {saved} in {ckpt_dir}" if saved is not None
                 else f"no checkpoint was saved in {ckpt_dir}")
    return f"{name} after the last step: stopped; {where}; the final evaluation, sample and summary.json were skipped"


class _Throughput:
    """Training tokens/s between two log lines, over pure step time.

    :meth:`step` counts a timed step; time spent inside :meth:`paused` (evaluation, checkpoint
    saves) is excluded; :meth:`take` returns tokens/s of the window and starts a new one. Steps and
    time always cover the same window, whatever the mix of log, eval and save steps.
    """

    def __init__(self, tokens_per_step: int, clock: Callable[[], float] = time.perf_counter):
        self.tokens_per_step = tokens_per_step
        self.clock = clock
        self._reset()

    def _reset(self) -> None:
        self.t0 = self.clock()
        self.steps = 0
        self.excluded = 0.0

    def step(self) -> None:
        self.steps += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        t = self.clock()
        try:
            yield
        finally:
            self.excluded += self.clock() - t

    def take(self) -> float:
        """tokens/s of the steps since the last :meth:`take` (eval/save time excluded); resets."""
        elapsed = self.clock() - self.t0 - self.excluded
        tps = self.steps * self.tokens_per_step / max(elapsed, 1e-9)
        self._reset()
        return tps


def _data_api() -> Any:
    """The data pipeline module (``minicpm4_jax.train.data``); a seam that tests may replace."""
    from minicpm4_jax.train import data

    return data


def trained_params(cfg: TrainConfig) -> int:
    """Parameters a run trains and checkpoints: the model's and, with ``model.mtp``, its MTP draft head's."""
    return cfg.model.num_params() + cfg.model.mtp_params()


def required_free_bytes(cfg: TrainConfig, *, resuming: bool = False, reclaimable: int = 0) -> int:
    """Free disk needed at start: ``MIN_FREE_MB`` + two checkpoints (params + 2 Adam moments, fp32) for a new run,
    one for a resume (its saved steps already hold the other; helper 69: a resume after a full disk was refused on
    a disk the fresh run had been allowed), less ``reclaimable`` bytes (temporary folders of interrupted saves,
    removed when the checkpoints are opened), never below ``MIN_FREE_MB``. The params include the MTP draft head
    when the run trains it (``model.mtp``)."""
    ckpt = 3 * 4 * trained_params(cfg)
    return MIN_FREE_MB * 2**20 + max(0, (1 if resuming else 2) * ckpt - reclaimable)


def _interrupted_save_bytes(ckpt_dir: Path) -> int:
    """Bytes held by ``<step>.orbax-checkpoint-tmp`` folders in ``ckpt_dir`` (an interrupted or failed save)."""
    total = 0
    try:
        tmps = [p for p in ckpt_dir.iterdir() if p.name.endswith(".orbax-checkpoint-tmp")]
    except OSError:
        return 0
    for tmp in tmps:
        for f in tmp.rglob("*"):
            try:
                if f.is_file() and not f.is_symlink():
                    total += f.stat().st_size
            except OSError:
                pass
    return total


def check_output_dir(path: Path, need_bytes: int, what: str = "out_dir") -> None:
    """Create ``path`` if needed and check it is writable with ``need_bytes`` free.

    Raises:
        ConfigError: not creatable / not writable / not enough free space (one line, with the fix).
    """
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} exists and is a file, not a folder; choose another {what}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        import socket

        probe = path / f".write_probe.{socket.gethostname()}.{os.getpid()}"  # processes may share the folder
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{what} {str(path)!r} is not writable ({e.strerror or e.__class__.__name__}); choose another {what}"
        ) from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ConfigError(
            f"{what} {str(path)!r} has {free / 2**20:.0f} MiB free but this run needs about "
            f"{need_bytes / 2**20:.0f} MiB (checkpoints + logs); free some disk or choose another {what}"
        )


def _is_training_config(path: Path) -> bool:
    """Whether ``path`` is a file holding a training config (a JSON object with model, optimizer and data)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and {"model", "optimizer", "data"} <= raw.keys()


def _damaged_run_config(folder: Path) -> bool:
    """Whether ``folder/config.json`` is not JSON (empty or cut short: written before writes were atomic, or
    damaged since) while ``folder/checkpoints`` holds checkpoint steps: the run's own file, which the run rewrites
    (each step stores its own config), not another program's."""
    try:
        json.loads((folder / "config.json").read_text())
        return False
    except (OSError, ValueError):
        return holds_checkpoint_steps(folder / "checkpoints")


def eval_coverage_note(eval_batches: int, name: str | None, batches: Sequence[np.ndarray]) -> str | None:
    """The line saying what each evaluation covers when the validation split holds fewer than ``eval_batches``
    batches (``None`` otherwise). ``batches``: ``data.val_batches``'s int32 ``[rows, seq_len + 1]`` arrays, all of
    one shape: full batches, or one smaller batch of every window when the split holds fewer than ``batch_size``
    (break test 85: that case was reported as a full batch, ``64 x 128`` for 11 windows)."""
    if len(batches) >= eval_batches:
        return None
    rows, width = batches[0].shape
    return (f"eval_batches={eval_batches}: the validation split{f' of {name}' if name else ''} holds {len(batches)} "
            f"batch(es) of {rows} x {width - 1} tokens; evaluating on those")


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`~minicpm4_jax.convert.io.atomic_write`)."""
    from minicpm4_jax.convert.io import atomic_write

    atomic_write(path, json.dumps(obj, indent=1).encode())


def _run_part(folder: Path) -> str | None:
    """What ``folder`` is to a training run, or ``None``: ``"run folder"`` (``config.json``, a training config or
    one beside ``checkpoints/``), ``"checkpoints folder"`` (it holds orbax step folders) or ``"checkpoint step
    folder"`` (``<checkpoints>/<step>``)."""
    try:
        if is_checkpoint_step(folder):
            return "checkpoint step folder"
        if holds_checkpoint_steps(folder):
            return "checkpoints folder"
        cfg_file = folder / "config.json"
        if cfg_file.is_file() and ((folder / "checkpoints").is_dir() or _is_training_config(cfg_file)):
            return "run folder"
    except OSError:  # an unreadable folder is not known to be a run
        pass
    return None


def _a(what: str) -> str:
    """``what`` with its indefinite article (``an out_dir``, ``a checkpoint.directory``)."""
    return f"{'an' if what[0] in 'aeiou' else 'a'} {what}"


def _refuse_inside_run(path: Path, what: str, *, own: Path | None = None) -> None:
    """Refuse a run's output folder ``path`` (option ``what``) inside another run: a folder above it is a run folder,
    a checkpoints folder or one checkpoint step, or ``path`` itself is a checkpoints or step folder that is not
    ``own`` (this run's own checkpoint folder). The run's ``config.json``, ``tokenizer/`` and ``checkpoints/`` there
    would mix into the other run, and ``find_checkpoint_dir`` of the other run could resolve to this run's.

    Raises:
        ConfigError: naming the enclosing run folder (the innermost one) and the fix.
    """
    hits: list[tuple[Path, str]] = []  # innermost first
    if path != own:
        kind = _run_part(path)
        if kind in ("checkpoints folder", "checkpoint step folder"):
            hits.append((path, kind))
    hits += [(a, k) for a in path.parents if (k := _run_part(a)) is not None]
    if not hits:
        return
    folder, kind = next((h for h in hits if h[1] == "run folder"), hits[0])
    how = "is" if folder == path else "is inside"
    raise ConfigError(f"{what} {str(path)!r} {how} the {kind} {folder} of another run; a run there would mix its "
                      "config.json, tokenizer/ and checkpoints into that run's (and 'generate --checkpoint' of it "
                      f"could load the wrong model): choose {_a(what)} outside {folder}")


def _refuse_over_source(path: Path, what: str, sources: Sequence[tuple[str, str | Path]]) -> None:
    """Refuse a run's output folder ``path`` (option ``what``) that is, lies inside or holds a folder this run reads
    from (``sources``: ``[(config key, folder)]``, e.g. ``branch_from``), as ``export`` / ``import`` refuse an
    ``--out`` over their source (:func:`minicpm4_jax.convert.io.refuse_output_over_source`).

    Raises:
        ConfigError: naming the source and the fix.
    """
    for key, src in sources:
        s = Path(src).expanduser().resolve()
        how = ("is" if path == s else "is inside" if s in path.parents else "holds" if path in s.parents else None)
        if how is not None:
            where = "that does not hold it" if how == "holds" else f"outside {s}"
            why = ("the run's own files (checkpoints' commit_success.txt, ...) would be read as training text and "
                   "--resume would find the corpus changed" if key == "data.sources" else
                   "its files would mix with that run's")
            raise ConfigError(f"{what} {str(path)!r} {how} the {key} source {s}, which this run reads: {why}; "
                              f"choose {_a(what)} {where}")


#: what a run writes into its ``out_dir``, with the record a sweep writes for a run that diverged (a folder holding
#: only these, e.g. a run stopped before its first checkpoint, may start a run)
RUN_FOLDER_ENTRIES = ("config.json", "data.json", "summary.json", "metrics.jsonl", "tokenizer", "checkpoints",
                      "tensorboard", "profile", "diverged.json")


def check_run_folder(out_dir: Path, resume: bool, ckpt_dir: Path | None = None, *,
                     sources: Sequence[tuple[str, str | Path]] = ()) -> None:
    """Refuse an ``out_dir`` that is not (or cannot become) this kind of run folder.

    A run writes ``config.json`` and ``tokenizer/`` into ``out_dir``: an export folder
    (``minicpm4_manifest.json`` without ``checkpoints/``) or another program's ``config.json`` would lose
    its own. An ``import hf`` folder is a run folder (checkpoints and a training config). A folder inside
    another run (its run folder, checkpoints folder, a step or ``tokenizer/``) would mix the two runs, and the
    other run's checkpoint folder would then resolve to this one's (:func:`_refuse_inside_run`); the same for
    ``ckpt_dir`` when it lies outside ``out_dir``. ``sources`` (``[(config key, folder)]``: ``branch_from``,
    ``qat.init_from``, ``data.sources`` folders) are the folders this run reads: neither output folder may be, lie
    inside or hold one.

    Raises:
        ConfigError: ``--resume`` without the folder (nor ``ckpt_dir``); a folder inside another run or
            overlapping a source; an export folder or a ``config.json`` that is not a training config; a new run in
            a non-empty folder holding anything but :data:`RUN_FOLDER_ENTRIES`; a new run in the folder of a run whose
            checkpoints (``out_dir/checkpoints`` or the ``checkpoint.directory`` its ``config.json`` records) lie in
            another folder than ``ckpt_dir`` (one line, with the fix).
    """
    if resume and not out_dir.is_dir() and not (ckpt_dir is not None and ckpt_dir.is_dir()):
        raise ConfigError(f"--resume: no checkpoint found: out_dir {str(out_dir)!r} does not exist; give the folder "
                          "of the run to continue, or train without --resume")
    _refuse_over_source(out_dir, "out_dir", sources)
    _refuse_inside_run(out_dir, "out_dir", own=ckpt_dir)
    if ckpt_dir is not None and ckpt_dir != out_dir and out_dir not in ckpt_dir.parents:
        _refuse_over_source(ckpt_dir, "checkpoint.directory", sources)
        if _run_part(ckpt_dir) == "run folder":
            raise ConfigError(f"checkpoint.directory {str(ckpt_dir)!r} is the run folder of another run; its "
                              "checkpoint steps would mix into that run: choose another checkpoint.directory")
        _refuse_inside_run(ckpt_dir, "checkpoint.directory", own=ckpt_dir)
    if not out_dir.is_dir():
        return
    if not resume and _run_part(out_dir) is None:
        # a new run in a folder of runs (out_dir=runs instead of runs/NAME) would put them all inside it
        inner = next((c for c in sorted(out_dir.iterdir()) if c.is_dir() and _run_part(c) == "run folder"), None)
        if inner is not None:
            raise ConfigError(f"out_dir {str(out_dir)!r} holds the run folder {inner} of another run; a run there "
                              f"would enclose it (it could then no longer be resumed): choose a new folder, e.g. "
                              f"out_dir={out_dir / 'NAME'}")
    if (out_dir / "minicpm4_manifest.json").is_file() and not (out_dir / "checkpoints").is_dir():
        raise ConfigError(f"out_dir {str(out_dir)!r} holds an export (minicpm4_manifest.json); a run would write "
                          "its config.json and tokenizer/ into it: choose another out_dir")
    cfg_file = out_dir / "config.json"
    if cfg_file.is_file() and not _is_training_config(cfg_file) and not _damaged_run_config(out_dir):
        raise ConfigError(f"out_dir {str(out_dir)!r} holds a config.json that is not a training config (a "
                          "Hugging Face model folder?); a run would overwrite it: choose another out_dir")
    if not resume and ckpt_dir is not None:
        # break test 85: a new run (or an --auto-resume that found nothing) with another checkpoint.directory
        # overwrote the summary.json, metrics.jsonl and config.json of the run whose checkpoints out_dir holds
        for other in _recorded_checkpoint_dirs(out_dir):
            if other != ckpt_dir and holds_checkpoint_steps(other):
                raise ConfigError(
                    f"out_dir {str(out_dir)!r} is the folder of a run with checkpoints in {other}, but this run's "
                    f"checkpoint.directory is {str(ckpt_dir)!r}: a new run there would overwrite that run's "
                    "summary.json and metrics.jsonl; continue it with --resume and its checkpoint.directory, or "
                    "choose another out_dir")
    if not resume and _run_part(out_dir) is None:
        # a folder that is not a run's (out_dir=~ or .): the run's files would spread among the user's, and every
        # later out_dir below it would be refused as inside this run
        own = set(RUN_FOLDER_ENTRIES)
        if ckpt_dir is not None and out_dir in ckpt_dir.parents:
            own.add(ckpt_dir.relative_to(out_dir).parts[0])
        try:
            other = sorted(e.name for e in out_dir.iterdir() if e.name not in own and not e.name.startswith("."))
        except OSError:
            other = []  # unreadable: check_output_dir names it
        if other:
            raise ConfigError(f"out_dir {str(out_dir)!r} is not empty ({len(other)} entries that are not a run's, "
                              f"e.g. {other[0]!r}) and is not a run folder: a run would mix its files into it; choose "
                              f"a new or empty folder, e.g. out_dir={out_dir / 'NAME'}")


def recorded_config(cfg: TrainConfig) -> dict[str, Any]:
    """The dict a run writes to ``out_dir/config.json``: :func:`~minicpm4_jax.config.config_to_dict` of ``cfg`` with a
    ``checkpoint.directory`` resolved (the folder the Checkpointer writes to, whatever the working directory of a
    later run or sweep reading it)."""
    saved = config_to_dict(cfg)
    if cfg.checkpoint.directory:
        saved["checkpoint"]["directory"] = str(checkpoint_dir_of(cfg))
    return saved


def _recorded_checkpoint_dirs(out_dir: Path) -> list[Path]:
    """The checkpoint folders of the run whose folder ``out_dir`` is: ``out_dir/checkpoints`` and the
    ``checkpoint.directory`` its ``config.json`` records (absolute: a run records the folder its Checkpointer
    resolved against its working directory; a relative one, from a run before that, is read against the current
    working directory), resolved; nothing unreadable is an error here."""
    recorded = recorded_checkpoint_directory(out_dir)
    return [(out_dir / "checkpoints").resolve()] + ([recorded] if recorded is not None else [])


def _missing_folders(*paths: Path) -> list[Path]:
    """The folders among ``paths`` and their parents that do not exist yet, deepest first."""
    out: list[Path] = []
    for p in paths:
        while not p.exists() and p not in out and p != p.parent:
            out.append(p)
            p = p.parent
    return sorted(out, key=lambda q: len(q.parts), reverse=True)


def _remove_empty_folders(folders: list[Path]) -> None:
    """Remove those of ``folders`` (deepest first) that are still empty: what a refused run created for its checks
    (``out_dir``, ``checkpoints/``) is not left behind; anything holding a file stays."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            pass


RUN_LOCK_NAME = ".minicpm4-train.lock"


class RunLock:
    """An exclusive lock on a run folder, held by the run's process 0 from its checks to its end.

    A second training process started on the same ``out_dir`` (a ``--resume`` in another shell, a requeued job
    while the first still runs) would open the checkpoint manager, which deletes the first process's checkpoint
    save in progress (break test 85: the first died at its next save, the second went on from an older step).
    :meth:`acquire` takes ``fcntl.flock`` on ``out_dir/.minicpm4-train.lock`` (released by the kernel when the
    process dies, also by ``kill -9``; held across hosts on filesystems with locks, e.g. NFSv4); the file names
    the holder (pid, host, start time) and is removed by :meth:`release`. A filesystem without locks gets no
    lock and a warning. A ``checkpoint.directory`` outside ``out_dir`` is locked the same way (``what``), since a
    run with another ``out_dir`` and that checkpoint folder would clear the same saves.
    """

    def __init__(self, out_dir: Path, what: str = "out_dir"):
        self.path = out_dir / RUN_LOCK_NAME
        self.what = what  # the config key naming the folder, for the messages
        self.fd: int | None = None

    def acquire(self, warn: Callable[[str], None]) -> None:
        """Take the lock or raise.

        Raises:
            ConfigError: another process holds it (named, with the fix); the lock file cannot be opened (another
                user's, left by a killed run).
        """
        import errno
        import fcntl
        import socket

        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # e.g. the file of another user's run killed in a shared folder
                raise ConfigError(f"cannot open the run lock {str(self.path)!r} ({e.strerror}); if no training "
                                  f"process uses this {self.what}, remove that file, else choose another "
                                  f"{self.what}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    try:
                        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
                    finally:
                        os.close(fd)
                    raise ConfigError(f"{self.what} {str(self.path.parent)!r} is in use by another training "
                                      f"process ({holder}); a second one would delete its checkpoint in progress: "
                                      f"wait for it to end or stop it, or choose another {self.what}") from None
                os.close(fd)
                warn(f"warning: cannot lock {self.path} ({e.strerror}); make sure no other process trains in this "
                     "folder")
                return
            # the holder may have released (unlinked the file) between our open and flock: then this lock is on
            # a file no one else opens, and the next process would create a new one and lock that too; retry
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()}, since "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n").encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _acquire_run_locks(locks: list[RunLock], is_main: bool, say: Callable[[str], None]) -> None:
    """Process 0 takes ``locks`` (:class:`RunLock`); with several processes every one learns whether it could, so
    that all are refused together (the others would otherwise wait for process 0 at the checkpoint manager's
    barrier until it times out).

    Raises:
        ConfigError: a lock is held by another run (process 0: the holder named; the others: pointing at it).
    """
    err: ConfigError | None = None
    if is_main:
        try:
            for lock in locks:
                lock.acquire(say)
        except ConfigError as e:
            err = e
    if jax.process_count() > 1:
        from minicpm4_jax.train.distributed import broadcast_from_process_0

        refused = bool(broadcast_from_process_0(np.int32(err is not None)))
        if refused and err is None:
            raise ConfigError(f"process 0 could not lock {locks[0].path.parent} (another training process uses the "
                              "run's folders; process 0's error names it): stop that process or choose another out_dir")
    if err is not None:
        raise err


class _StepTracer:
    """``jax.profiler`` trace of the steps ``cfg.profile_start_step ..`` (``cfg.profile_steps`` of them) into
    ``<out_dir>/profile/process_<i>``; does nothing without ``profile_start_step`` or when the run resumes past
    the window."""

    def __init__(self, cfg: TrainConfig, out_dir: Path, say: Callable[[str], None], start: int = 0):
        """``start``: the steps done before this run (a resume); a window it cut is traced from ``start + 1``.

        Raises:
            ConfigError: the trace folder cannot be created (before any step runs).
        """
        self.first = cfg.profile_start_step
        self.last = None if self.first is None else min(self.first + cfg.profile_steps - 1, cfg.steps)
        self.dir = out_dir / "profile" / f"process_{jax.process_index()}"
        self.say, self.active = say, False
        if self.first is None:
            return
        if start >= self.last:
            say(f"profile: steps {self.first}..{self.last} were run before the resumed step {start}; nothing traced")
            self.first = self.last = None
            return
        if start >= self.first:
            say(f"profile: resumed at step {start}: tracing steps {start + 1}..{self.last} of the window "
                f"{self.first}..{self.last}")
            self.first = start + 1
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"profile folder {self.dir} cannot be created ({e.strerror or e}); free that path or "
                              "unset profile_start_step") from None

    def before(self, step_no: int) -> None:
        """Called before step ``step_no`` (from 1) runs."""
        if step_no == self.first:
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def after(self, step_no: int, metrics: Any) -> None:
        """Called after step ``step_no`` was dispatched: the trace stops once its device work has finished."""
        if self.active and step_no == self.last:
            self.finish(step_no, metrics)

    def finish(self, step_no: int, metrics: Any) -> None:
        """Stop a running trace after step ``step_no``'s device work (``metrics``: its outputs, or ``None``) and say
        where it is; called when the window ends and when the training loop stops (time limit, signal)."""
        if not self.active:
            return
        if metrics is not None:
            jax.block_until_ready(metrics)
        self.close()
        self.say(f"profile: steps {self.first}..{step_no} traced into {self.dir} (tensorboard --logdir "
                 f"{self.dir}, or XProf / ui.perfetto.dev on plugins/profile/*/*.xplane.pb / *.trace.json.gz)")

    def close(self) -> None:
        """Stop a running trace (the run ended inside the window)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


_DATA_RECORD = "data.json"  # the corpus and tokenizer a run was started with (checked on --resume)


def check_run_data(out_dir: Path, manifest: dict, *, resume: bool, say: Callable[[str], Any],
                   label: str = "--resume") -> None:
    """On ``--resume``, refuse data that differs from what the run was started with.

    The data config may not change on resume (:meth:`Checkpointer.check_compatible`), but the files
    under ``data.sources`` may: a changed corpus means another token stream and, with
    ``data.tokenizer=train``, a retrained tokenizer whose ids mean other pieces than the checkpoint's
    embedding rows. Compares the hashes recorded in ``out_dir/data.json`` when the run started (runs
    started before this record existed are not checked). The corpus hash covers the resolved paths: a relative and
    an absolute spelling of the same files agree (a record from before that matches ``corpus_hash_as_spelled``).

    ``label``: the option the messages name (``branch_from`` checks a decay branch against its source run).

    Raises:
        ConfigError: the corpus or the tokenizer differs (one line, with the fix).
    """
    rec = out_dir / _DATA_RECORD
    if not resume:
        return
    if not rec.is_file():
        say(f"{label.lstrip('-')}: {rec} is missing (a run started before the record existed, or the file was "
            "removed); the corpus and tokenizer are not checked against the run's (and the record is not re-created)")
        return
    try:
        saved = json.loads(rec.read_text())
    except (OSError, ValueError):
        saved = None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k, ""), str)
                                              for k in ("tokenizer_hash", "corpus_hash")):
        say(f"{label.lstrip('-')}: {rec} is unreadable; the corpus is not checked against the run's")
        return
    for key, what in (("tokenizer_hash", "tokenizer"), ("corpus_hash", "corpus under data.sources")):
        old, new = saved.get(key), manifest.get(key)
        if key == "corpus_hash" and old == manifest.get("corpus_hash_as_spelled"):
            continue  # recorded before the corpus hash was spelling-independent, over the same paths spelled as now
        if old and new and old != new:
            which = "this run" if label == "--resume" else f"the {label} run ({out_dir})"
            fix = ("restore those files, or start a new out_dir" if label == "--resume"
                   else "restore the files that run was trained on")
            raise ConfigError(
                f"{label}: the {what} differs from the one {which} was started with ({key} {old[:12]} != "
                f"{new[:12]}): the files under data.sources changed. Continuing would train on other data"
                + (" with a retrained tokenizer" if key == "tokenizer_hash" else "")
                + f"; {fix}")


def write_run_data(out_dir: Path, manifest: dict, origin: dict | None = None) -> None:
    """Record the corpus and tokenizer hashes of a fresh run (``out_dir/data.json``), and ``origin``: the checkpoint
    a branch or a QAT-from-checkpoint run started from (``branch_from`` / ``branch_step``, ``init_from`` /
    ``init_step`` / ``init_tokens``), which a ``--resume`` no longer resolves but its summary reports."""
    keep = ("corpus_hash", "tokenizer_hash", "key", "num_train_tokens", "num_val_tokens", "sources")
    rec = {k: manifest[k] for k in keep if k in manifest}
    if origin:
        rec["origin"] = origin
    write_json_atomic(out_dir / _DATA_RECORD, rec)


def read_run_origin(out_dir: Path) -> dict:
    """The ``origin`` :func:`write_run_data` recorded for a run (``{}`` when it has none, or the record is missing
    or unreadable: the summary then leaves those fields out, as it did before the record existed)."""
    try:
        saved = json.loads((out_dir / _DATA_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    origin = saved.get("origin") if isinstance(saved, dict) else None
    if not isinstance(origin, dict):
        return {}
    out: dict = {}  # each source kept only with its fields well typed (a hand-edited record crashed the summary)
    for name, step_key, extra in (("branch_from", "branch_step", None), ("init_from", "init_step", "init_tokens")):
        keys = [name, step_key] + ([extra] if extra else [])
        vals = [origin.get(k) for k in keys]
        if isinstance(vals[0], str) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                            for v in vals[1:]):
            out.update(zip(keys, vals))
    return out


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool | str = False,
    log: Callable[[str], None] = print,
    step_hook: Callable[[int, TrainState], TrainState] | None = None,
    handle_signals: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``cfg`` (see the module docstring) and return the summary dict also written to ``summary.json``.

    Args:
        cfg: the run's :class:`TrainConfig`; checked with :func:`~minicpm4_jax.config.validate` first, so a config
            built in Python (``dataclasses.replace`` of a loaded one) gets the same one-line errors as
            :func:`~minicpm4_jax.config.load_config` gives.
        resume: continue from the latest checkpoint in the checkpoint directory (train state and
            data iterator); without it, an existing checkpoint there is an error (nothing is
            overwritten). ``"auto"`` (``--auto-resume``): resume when the checkpoint directory holds a
            complete step, else start the run (a requeued job runs the same command every time).
        log: line printer (process 0 prints; others are silent).
        step_hook: ``(step, state) -> state`` called before each update (research / fault
            injection in tests).
        handle_signals: install the SIGTERM/SIGINT handlers (main thread only).
        progress: show a tqdm progress bar with ETA.

    Returns:
        The summary: ``step``, ``stop_reason`` (``steps`` | ``time`` | ``signal``), ``val_loss``,
        the n-gram baselines, ``tokens_per_second`` and ``mfu`` (the median over every logged row of the whole
        run, a resumed run's earlier segments included; MFU against ``peak_flops``, the fp32 matmul peak of every
        training device: ``peak_flops_per_device`` x :func:`~minicpm4_jax.train.metrics.peak_devices` of the mesh),
        ``wall_seconds`` (this call only: a resumed run's last
        segment, not the whole run), ``train_loss`` / ``attended_fraction`` / ``mtp_*`` (the last logged row's: its
        window's means) and ``last_step_loss``, ``sample`` and paths.

    Raises:
        ConfigError: an invalid ``cfg`` (:func:`~minicpm4_jax.config.validate`) / unwritable output directory /
            too little disk / data problems / checkpoints present without ``--resume`` / ``--resume`` without a checkpoint / ``--resume`` with a
            config that differs from the checkpoint's outside the fields a resume may change /
            ``--resume`` when the files under ``data.sources`` changed since the run started
            (:func:`check_run_data`) / a damaged checkpoint step / an ``out_dir`` that is a file, an
            export folder, holds another program's ``config.json``, lies inside another run or overlaps the
            ``branch_from`` / ``qat.init_from`` source (:func:`check_run_folder`).
            Raised before anything is written into ``out_dir``; the folders the checks created
            (``out_dir``, the checkpoint folder) are removed again while empty.
        TrainingDiverged: a non-finite loss or gradient norm (the step is named).
        CheckpointWriteError: a checkpoint write failed (e.g. disk full); earlier checkpoints are intact.
        RunFileWriteError: writing ``tokenizer/``, ``config.json`` or ``data.json`` (before training) or
            ``summary.json`` (after the final checkpoint) failed; the message says what the checkpoints hold.
    """
    # (was: only load_config validated, and a replaced steps=0 "trained" into a step-0 checkpoint)
    validate(cfg)
    t_start = time.perf_counter()
    from minicpm4_jax.train import distributed as dist

    dist.initialize(cfg.distributed, log=log)  # before any device use
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda _m: None)
    out_dir = Path(cfg.out_dir).expanduser().resolve()
    ckpt_dir = checkpoint_dir_of(cfg)
    if resume == "auto":  # every process reads the same (shared) checkpoint folder: the same answer everywhere
        resume = holds_checkpoint_steps(ckpt_dir)
        say(f"--auto-resume: {'resuming from' if resume else 'no checkpoint yet in'} {ckpt_dir}"
            + ("" if resume else "; starting the run"))
    elif not isinstance(resume, bool):
        raise ValueError(f"resume={resume!r}; use True, False or 'auto'")
    need = required_free_bytes(cfg, resuming=bool(resume), reclaimable=_interrupted_save_bytes(ckpt_dir))
    created = _missing_folders(out_dir, ckpt_dir)  # made by the checks below; removed again if the run is refused
    run_locks = [RunLock(out_dir)]
    if ckpt_dir != out_dir and out_dir not in ckpt_dir.parents:
        run_locks.append(RunLock(ckpt_dir, "checkpoint.directory"))
    try:
        sources = [(k, v) for k, v in (("branch_from", cfg.branch_from),
                                       ("qat.init_from", cfg.qat.init_from if cfg.qat.enabled else None)) if v]
        # corpus folders are scanned recursively: a run inside one would train on (and resume against) its own files
        sources += [("data.sources", p) for p in (Path(src).expanduser() for src in cfg.data.sources
                                                  if src != "stdlib") if p.is_dir()]
        check_run_folder(out_dir, resume, ckpt_dir, sources=sources)
        check_output_dir(out_dir, need)
        check_output_dir(ckpt_dir, need, what="checkpoint.directory")
        _acquire_run_locks(run_locks, is_main, say)  # before the checkpoint manager, which clears unfinished saves
        ckpt = Checkpointer(cfg, ckpt_dir)
    except BaseException:
        for lock in run_locks:
            lock.release()
        _remove_empty_folders(created)
        raise
    writer: MetricsWriter | None = None
    tracer: _StepTracer | None = None
    stop = dist.StopWatch()
    failed = refused = False
    pbar = None
    step: int | None = None  # completed updates (set once the training loop starts)
    try:
        # acceptance checks: all before data preparation and before any write into out_dir
        check_training_selection(cfg)
        mesh = make_mesh(cfg.mesh)
        check_batch_size(cfg.data.batch_size, mesh, cfg.gradient_accumulation_steps)
        check_vocab_size(cfg.model.padded_vocab_size, mesh)
        latest = ckpt.latest_step()
        if resume:
            if latest is None:
                # the run in out_dir has its checkpoints elsewhere (checkpoint.directory changed): name them, since a
                # new run there is refused (check_run_folder)
                found = next((d for d in _recorded_checkpoint_dirs(out_dir) if d != ckpt_dir
                              and holds_checkpoint_steps(d)), None)
                if found is not None:
                    raise ConfigError(f"--resume: no checkpoint found in {ckpt_dir}, but the run in {out_dir} has its "
                                      f"checkpoints in {found}; resume with checkpoint.directory={found} (or without "
                                      "checkpoint.directory when that is out_dir/checkpoints)")
                raise ConfigError(f"--resume: no checkpoint found in {ckpt_dir}; train without --resume first")
            for d in ckpt.check_compatible(latest):
                say(f"resume: {d} (checkpoint != current; allowed)")
        elif latest is not None:
            other = "checkpoint.directory" if cfg.checkpoint.directory else "out_dir"  # the one that names it
            raise ConfigError(
                f"{ckpt_dir} already holds checkpoints (latest step {latest}); pass --resume to continue, "
                f"or choose another {other}"
            )
        branch_src = None
        if cfg.branch_from is not None and not resume:
            from minicpm4_jax.train.branch import resolve_branch

            branch_src = resolve_branch(cfg)
        init_src = None
        if cfg.qat.enabled and cfg.qat.init_from is not None and not resume:
            from minicpm4_jax.train.qat import resolve_init

            init_src = resolve_init(cfg)

        # where the weights came from: resolved now, or (on --resume, which no longer resolves the sources) read
        # back from the record the run's first segment wrote, so that every segment's summary names them
        if resume:
            origin = read_run_origin(out_dir)
        else:
            origin = {}
            if branch_src is not None:
                origin.update(branch_from=str(branch_src.directory), branch_step=branch_src.step)
            if init_src is not None:
                origin.update(init_from=str(init_src.directory), init_step=init_src.step,
                              init_tokens=init_src.step * init_src.cfg.data.batch_size * init_src.cfg.data.seq_len)
        # the schedule's final decay: with qat.enabled the QAT stage's own (decay_fraction of the QAT steps; helper
        # 99: the run's length was used, which warned about a decay of 0 steps and missed one of 1)
        if cfg.steps - decay_start_step(cfg) == 1:
            of = " of the QAT steps" if cfg.qat_start_step is not None and cfg.optimizer.decay_steps is None else ""
            say("warning: a decay of 1 step changes nothing: its one update runs at the peak learning rate (the "
                "schedule reaches min_lr_ratio x peak after the last update, spec B12); use 2 or more decay steps "
                f"(optimizer.decay_steps / decay_fraction{of}), or 0 for none")
        warning = qat_warmup_warning(cfg)
        if warning:
            say(warning)
        d_cfg = cfg.data
        if (d_cfg.decay_weights is not None and d_cfg.weights is not None
                and list(d_cfg.decay_weights) != list(d_cfg.weights) and decay_start_step(cfg) >= cfg.steps):
            # the mixture switches at the decay's first step, which a schedule without a decay never reaches
            say(f"warning: data.decay_weights={list(d_cfg.decay_weights)} never apply: the learning-rate schedule has no "
                "decay phase (decay length 0), so the mixture stays data.weights; set optimizer.decay_steps / "
                "decay_fraction, or drop data.decay_weights")
        inactive = inactive_draft_options(cfg)
        if inactive:
            say(f"model.mtp=false: {', '.join(inactive)} shape the MTP draft head, which this run does not have; "
                "they have no effect")
        inactive = inactive_qat_options(cfg)
        if inactive:
            say(f"qat.enabled=false, so without effect: {', '.join(inactive)} (the run trains in high precision; "
                "qat.enabled=true turns QAT on)")
        data_api = _data_api()
        data = data_api.prepare_data(cfg.data, log=say)
        tok = data.tokenizer
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"tokenizer has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
                "raise model.vocab_size"
            )
        from minicpm4_jax.tokenizer import special_id_mismatches

        mismatch = special_id_mismatches(tok, cfg.model)
        if mismatch:  # an export would write the model's ids: a runtime would start / stop on other tokens
            fix = ([f"model.bos_token_id={tok.bos_id}"] if tok.bos_id is not None else []) + \
                  ([f"model.eos_token_id=[{tok.eos_id}]"] if tok.eos_id is not None else [])
            raise ConfigError(f"{'; '.join(mismatch)}: the model's special ids must be the tokenizer's (exports "
                              f"write them for runtimes); set {' '.join(fix)}")
        check_run_data(out_dir, data.manifest, resume=resume, say=say)
        if branch_src is not None:  # the corpus and tokenizer the source run started with (its data.json)
            check_run_data(branch_src.run_folder, data.manifest, resume=True, say=say, label="branch_from")
        if init_src is not None:
            from minicpm4_jax.train.qat import check_init_tokenizer

            check_init_tokenizer(init_src, tok, say)

        def nothing_trained() -> str:
            kept = (f"the checkpoints in {ckpt_dir} are intact; " if latest is not None else "")
            return f"nothing was trained; {kept}free disk space and run the same command again"

        write_err: RunFileWriteError | None = None
        if is_main:
            try:
                with _writing(out_dir / "tokenizer", nothing_trained):
                    tok.save(out_dir / "tokenizer")
                with _writing(out_dir / "config.json", nothing_trained):
                    write_json_atomic(out_dir / "config.json", recorded_config(cfg))
                # an earlier segment's summary would describe a run that goes on now (and stay, stale, if this one
                # is stopped by a signal); this run writes its own when it finishes, and metrics.jsonl keeps the rows
                with _writing(out_dir / "summary.json", nothing_trained, "removing the earlier"):
                    (out_dir / "summary.json").unlink(missing_ok=True)
                    (out_dir / "diverged.json").unlink(missing_ok=True)  # a sweep's record of an earlier attempt
                if not resume:  # the record of what the run started with: never rewritten on a resume
                    with _writing(out_dir / "data.json", nothing_trained):
                        write_run_data(out_dir, data.manifest, origin)
            except RunFileWriteError as e:
                write_err = e
        if jax.process_count() > 1:  # all stop together (the others would wait in the first step's collectives)
            from minicpm4_jax.train.distributed import broadcast_from_process_0

            failed_main = bool(broadcast_from_process_0(np.int32(write_err is not None)))
            if failed_main and write_err is None:
                raise RunFileWriteError(f"process 0 could not write the run's files into {out_dir} (its error names "
                                        f"the file and the cause); {nothing_trained()}")
        if write_err is not None:
            raise write_err

        if mesh.size > 1:
            say(f"mesh: {dict(mesh.shape)} over {mesh.size} {jax.default_backend()} devices (axis types Auto)")
        batch_sh = batch_sharding(mesh)
        # this process reads only the rows of each global batch that its devices hold
        # a mixture's decay_weights apply from the first step of the schedule's (final) decay phase
        def data_iterator(first_batch: int = 0) -> Any:
            return data_api.train_iterator(data, cfg.data, process_index=jax.process_index(),
                                           process_count=jax.process_count(),
                                           rows=process_batch_rows(batch_sh, cfg.data.batch_size),
                                           decay_start_batch=first_batch + decay_start_step(cfg))

        it = data_iterator()
        if resume:
            # abstract targets carry the current mesh's shardings: each array is read straight into its
            # shards (any saved mesh / device / process count), no full copy on one device
            start, state = ckpt.restore(sharded_abstract_state(cfg, mesh), step=latest, data_iterator=it, check=False)
            start = int(start)
            from flax import nnx

            graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(cfg.model, 0)))
            say(f"resumed from {ckpt_dir}/{start}")
        elif branch_src is not None:
            src_ck = Checkpointer(branch_src.cfg, branch_src.directory, read_only=True)
            try:
                start, state = src_ck.restore(sharded_abstract_state(cfg, mesh), step=branch_src.step,
                                              data_iterator=it, check=False)
            finally:
                src_ck.close(quiet=True)
            start = int(start)
            from flax import nnx

            graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(cfg.model, 0)))
            say(f"branch: continuing {branch_src.directory}/{start} (train state, optimizer state and data order); "
                f"this run decays from step {decay_start_step(cfg) + 1} to step {cfg.steps}")
        else:
            start = 0
            graphdef, state = init_train_state(cfg, jax.random.key(cfg.seed), mesh)
            if init_src is not None:
                from minicpm4_jax.train.qat import continue_data_order, load_init_params

                params = load_init_params(init_src, train_state_shardings(cfg, mesh).params, like=state.params)
                state = TrainState(step=state.step, params=params, opt_state=state.opt_state)
                say(f"qat: starting from the latent weights of {init_src.directory}/{init_src.step} "
                    "(fresh optimizer state; the learning rate re-warms)")
                continue_data_order(cfg, init_src, it, say)
        # a run that continues another run's data order (qat.continue_data, and the resumes of such a run) reads
        # global batch `first + step` at its step `step`: its mixture switches at its own decay, `first` batches on
        first = int(it.get_state()["next_index"]) - start
        if data.components and first:
            at = it.get_state()
            it = data_iterator(first)
            it.set_state(at)
        qat_start = cfg.qat_start_step
        qat_spec = ternary_spec(cfg.qat) if qat_start is not None else None
        if qat_start is not None:
            q = cfg.qat
            say(f"qat: ternary weights ({q.granularity}{f', group {q.group_size}' if q.granularity == 'per_group' else ''}"
                f", STE {q.ste}) for steps {qat_start + 1}..{cfg.steps} ({cfg.qat_steps} of {cfg.steps} steps, numbered "
                "as in the log)"
                + (f", high precision before, learning rate re-warmed at step {qat_start + 1}" if qat_start else ""))

        def is_ternary(step_no: int) -> bool:
            return checkpoint_is_ternary(cfg, step_no)

        def model_params(params: Any, step_no: int) -> Any:
            """The weights of the model at ``step_no``: fake-quantized once QAT has started."""
            return ternarize(params, cfg.model, qat_spec) if is_ternary(step_no) else params

        n_split = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
        # every process holds the (small) validation batches; as global arrays split like training batches
        # a mixture: every component's own validation batches, its loss reported on its own
        val_sets = ([(m.name, data_api.val_batches(m.data, cfg.data, cfg.eval_batches)) for m in data.components]
                    if data.components else [(None, data_api.val_batches(data, cfg.data, cfg.eval_batches))])
        for name, vbs in val_sets:
            note = eval_coverage_note(cfg.eval_batches, name, vbs)
            if note:
                say(note)
        val_names = [name for name, vbs in val_sets for _ in vbs]
        val = [make_global_batch(vb, batch_sh if vb.shape[0] % n_split == 0 else replicated(mesh), vb.shape)
               for _, vbs in val_sets for vb in vbs]
        train_step = make_train_step(cfg, graphdef, mesh)
        # batch-sharded activations (train/step.py activation_sharding) when every validation batch is split
        eval_mesh = mesh if all(vb.shape[0] % n_split == 0 for vb in val) else None
        # the kernels of attention_impl=pallas run per device as in the train step (whole arrays otherwise)
        eval_step = kernels_under_mesh(jax.jit(make_eval_step(graphdef, eval_mesh, cfg.logits_chunk_size,
                                                              cfg.gradient_accumulation_steps),
                                               out_shardings=replicated(mesh)), cfg.model.attention_impl, mesh)
        b, t = cfg.data.batch_size, cfg.data.seq_len
        global_batch = b  # data.batch_size is the global batch; each process feeds its rows of it
        # abstract, with its sharding: lowering a numpy batch would fail with several processes
        sample_batch = jax.ShapeDtypeStruct((b, t + 1), np.int32, sharding=batch_sh)
        n_params = trained_params(cfg)
        draft = {"mtp_depth": cfg.mtp_train_depth, "mtp_distill": cfg.mtp_distill > 0}  # the MTP head's FLOPs count
        drafted = f" ({cfg.model.mtp_params() / 1e6:.2f}M of them the MTP draft head)" if cfg.model.mtp else ""
        say(f"model: {n_params / 1e6:.2f}M params{drafted}, {cfg.model.flops_per_token(t, **draft) / 1e6:.1f} MFLOP/token (train"
            f"{', draft head included' if cfg.model.mtp else ''}); "
            f"batch {global_batch} x {t} tokens; {cfg.steps} steps")
        compiled = print_memory_analysis(train_step, state, sample_batch, log=say)
        step_fn = compiled if compiled is not None else train_step
        device_peak = measure_matmul_peak_flops()  # one device's; MFU's denominator is every training device's
        n_peak = peak_devices(mesh.devices.flat)
        peak = device_peak * n_peak
        say(f"measured fp32 matmul peak on {jax.default_backend()}: {device_peak / 1e9:.1f} GFLOP/s"
            + (f" per device; MFU against the {n_peak} devices' {peak / 1e9:.1f} GFLOP/s" if n_peak > 1 else ""))

        # steps after `start` in earlier event files (a killed attempt, rows past the checkpoint) are purged
        writer = MetricsWriter(out_dir / "tensorboard", enabled=cfg.tensorboard, log=say, purge_step=start + 1)
        if handle_signals:
            stop.install()

        def evaluate(params: Any) -> tuple[float, dict[str, float]]:
            """Mean NLL per token over all validation batches, and per mixture component (empty otherwise)."""
            sums: dict[str | None, list[float]] = {}
            for name, vb in zip(val_names, val):
                s, c = eval_step(params, vb)
                acc = sums.setdefault(name, [0.0, 0])
                acc[0] += float(s)
                acc[1] += int(c)
            total = sum(v[0] for v in sums.values()) / max(sum(v[1] for v in sums.values()), 1)
            return total, {k: v[0] / max(v[1], 1) for k, v in sums.items() if k is not None}

        def val_scalars(vl: float, parts: dict[str, float]) -> dict[str, float]:
            return {"loss": vl, **{f"loss_{k}": v for k, v in parts.items()}}

        def val_text(vl: float, parts: dict[str, float]) -> str:
            return f"val_loss {vl:.4f}" + (" (" + ", ".join(f"{k} {v:.4f}" for k, v in parts.items()) + ")"
                                           if parts else "")

        def last_good() -> str:
            """The last complete checkpoint, for a divergence message (a save under way is awaited first)."""
            wait_ckpt()
            last = ckpt.latest_step()
            return f"last good checkpoint: step {last} in {ckpt_dir}" if last is not None else "no checkpoint was saved"

        def check(step_no: int, m: dict) -> dict[str, float]:
            vals = {k: float(v) for k, v in m.items()}
            if not (math.isfinite(vals["loss"]) and math.isfinite(vals["grad_norm"])):
                raise TrainingDiverged(divergence_message(step_no, vals["loss"], vals["grad_norm"], last_good()))
            return vals

        def save(step_no: int) -> None:
            if not params_all_finite(state.params):
                # (helper 91: with no checkpoint yet this said "last good checkpoint: step None")
                raise TrainingDiverged(f"non-finite parameters after step {step_no}; not saved; {last_good()}")
            try:
                with stop.starting_save():
                    ckpt.save(step_no, state, it)
            except CheckpointWriteError:
                raise
            except Exception as e:  # e.g. a replaced/wrapped checkpointer raising the raw OSError
                try:  # settle the previous (async) save so the message names the last complete step
                    ckpt.wait()
                except Exception:
                    pass
                raise checkpoint_write_error(step_no, ckpt_dir, e, ckpt.last_complete_step()) from e

        def wait_ckpt() -> None:
            try:
                ckpt.wait()
            except CheckpointWriteError:
                raise
            except Exception as e:
                raise checkpoint_write_error(None, ckpt_dir, e, ckpt.last_complete_step()) from e

        pbar = None
        if progress and is_main:
            from tqdm.auto import tqdm

            pbar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        deadline = None if cfg.max_train_minutes is None else time.monotonic() + 60.0 * cfg.max_train_minutes
        step = start
        stop_reason = "steps"
        pending: tuple[int, dict] | None = None
        last_vals: dict[str, float] = {}
        from minicpm4_jax.train.metrics import METRICS_FILE, RunHistory

        # the whole run's logged rows and evaluations, carried across resumes (metrics.jsonl); a branch starts with
        # its source's up to the branch point, which it shares
        seed = (RunHistory.read(branch_src.run_folder / METRICS_FILE, upto=start)
                if branch_src is not None else None)
        hist = RunHistory(out_dir / METRICS_FILE, start=start, write=is_main, seed=seed, log=say)
        if hist.skipped:
            say(f"warning: {hist.skipped} unreadable line(s) of {hist.path} skipped (cut by a kill?)")
        if resume and start >= cfg.steps:
            say(f"resume: step {start} is the run's last step (steps={cfg.steps}); nothing to train: the final "
                "evaluation, sample and summary.json again")
        meter = _Throughput(global_batch * t)
        # per-step values since the last log line: a row logs their means (the learning rate: the row's step's)
        window_vals: list[dict[str, float]] = []
        multi = jax.process_count() > 1
        tracer = _StepTracer(cfg, out_dir, say, start)
        mfu_warned: list[int] = []  # the step of the one warning that MFU passed 100% (mfu_above_peak_causes)

        def log_row(step: int) -> None:
            """One logged row: each value the mean over the steps since the previous row (losses, gradient norm,
            attended fraction, draft losses; helper 69: only the loss was, the rest were the last step's), the
            learning rate the row's step's, this window's tokens/s."""
            tps = meter.take()
            util = mfu(cfg.model, t, tps, peak, **draft)
            if util > 1 and not mfu_warned:
                mfu_warned.append(step)  # once per run: the peak is measured once, at the start
                causes = mfu_above_peak_causes(cfg.model, t)  # (helper 95: the busy machine was the only one named)
                why = ("; ".join(causes) + "; or the machine was busier then (other jobs on its cores)" if causes
                       else "so the machine was busier then (other jobs on its cores)")
                say(f"warning: MFU {100 * util:.0f}% at step {step}: the model computes "
                    f"{model_flops_per_second(cfg.model, t, tps, **draft) / 1e9:.1f} GFLOP/s, more than the matmul "
                    f"peak measured at the start ({peak / 1e9:.1f} GFLOP/s): {why}; this run's MFU figures are too "
                    "high, compare runs by tokens/s")
            means = {k_: float(np.mean([v_[k_] for v_ in window_vals if k_ in v_]))
                     for k_ in set().union(*window_vals) if k_ != "lr"}
            window_vals.clear()
            vals = {**last_vals, **means}
            mean_loss = vals["loss"]
            row = {**vals, "tokens_per_second": tps, "mfu": util, "step_time_s": global_batch * t / tps}
            qstats = None
            if is_ternary(step):
                with meter.paused():
                    qstats = ternary_stats(state.params, cfg.model, qat_spec)
                qs = ternary_scalars(qstats)
                row["ternary_zero_fraction"], row["ternary_scale"] = qs["zero_fraction"], qs["scale"]
                if writer is not None:
                    writer.scalars(step, qs, prefix="qat")
            # (the file also keeps the last step's own loss: a resume with nothing left to train reports it)
            hist.log({"step": step, **row, "last_step_loss": last_vals["loss"]})
            if writer is not None:
                writer.scalars(step, row, prefix="train")
            msg = (f"step {step:>6d}  loss {mean_loss:.4f}  grad_norm {vals['grad_norm']:.3f}  "
                   f"lr {vals['lr']:.3e}  tok/s {_fmt_rate(tps)}  step {1e3 * global_batch * t / tps:.0f} ms  "
                   f"MFU {100 * util:.1f}%")
            if "attended_fraction" in vals:
                msg += f"  attended {vals['attended_fraction']:.3f}"
            if "mtp_loss" in vals:
                msg += f"  mtp {vals['mtp_loss']:.4f}"
            for k_ in sorted(k_ for k_ in vals if k_.startswith("mtp_loss_depth")):
                msg += f"  mtp@{k_[len('mtp_loss_depth'):]} {vals[k_]:.4f}"
            if "mtp_kl" in vals:
                msg += f"  mtp_kl {vals['mtp_kl']:.4f}"
            if "mtp_feature_loss" in vals:
                msg += f"  mtp_feat {vals['mtp_feature_loss']:.4f}"
            if qstats is not None:
                msg += f"  ternary zeros {100 * row['ternary_zero_fraction']:.1f}% scale {row['ternary_scale']:.2e}"
            if pbar is not None:
                pbar.write(msg)
                pbar.set_postfix(loss=f"{mean_loss:.3f}")
            else:
                say(msg)

        while step < cfg.steps:
            if stop.should_stop(step):  # every process, every step: the same answer everywhere
                stop_reason = "signal"
                break
            if deadline is not None and (not multi or step % cfg.log_every == 0):
                late = time.monotonic() > deadline
                if multi:  # process 0's clock decides for all
                    from minicpm4_jax.train.distributed import broadcast_from_process_0

                    late = bool(broadcast_from_process_0(np.bool_(late)))
                if late:
                    stop_reason = "time"
                    break
            batch = make_global_batch(next(it)["input_ids"], batch_sh, (b, t + 1))
            if step_hook is not None:
                state = step_hook(step, state)
            tracer.before(step + 1)
            state, metrics = step_fn(state, batch)
            step += 1
            tracer.after(step, metrics)
            meter.step()
            if not multi:  # a background checkpoint write that failed stops the run now (settling is collective)
                ckpt.poll()
            if pending is not None:  # checked one step late, so the host never stalls the device
                last_vals = check(*pending)
                window_vals.append(last_vals)
            pending = (step, metrics)
            if pbar is not None:
                pbar.update(1)
            do_log = step % cfg.log_every == 0 or step == cfg.steps
            do_eval = step % cfg.eval_every == 0 and step != cfg.steps
            do_save = step % cfg.checkpoint.save_every == 0
            if do_log or do_eval or do_save:
                last_vals = check(*pending)
                window_vals.append(last_vals)
                pending = None
            if do_log:
                log_row(step)
            if do_eval:
                with meter.paused():  # do not charge evaluation to tokens/s
                    vl, vparts = evaluate(model_params(state.params, step))
                    hist.evaluation(step, vl)
                    if writer is not None:
                        writer.scalars(step, val_scalars(vl, vparts), prefix="val")
                    (pbar.write if pbar is not None else say)(f"step {step:>6d}  {val_text(vl, vparts)}"
                                                              + ("  (ternary)" if is_ternary(step) else ""))
                    if is_ternary(step):
                        from minicpm4_jax.train.qat import stats_lines

                        for line in stats_lines(ternary_stats(state.params, cfg.model, qat_spec), cfg.model):
                            (pbar.write if pbar is not None else say)(line)
            if do_save:
                with meter.paused():
                    save(step)
        if pending is not None:
            last_vals = check(*pending)
            window_vals.append(last_vals)
        if window_vals and step > start:  # stopped (signal, time) inside a log window: its steps get their row
            log_row(step)
        tracer.finish(step, metrics if step > start else None)  # before the final save, eval and sample
        if pbar is not None:
            pbar.close()
            pbar = None

        if stop_reason != "signal":
            if step not in ckpt.all_steps():
                save(step)  # the last step's checkpoint comes first: nothing after it can lose it
            if stop.finishing():  # a signal after the last step boundary: the run is saved, stop as for it
                stop_reason = "signal"
        if stop_reason == "signal":
            name = signal.Signals(stop.signum).name
            say(f"{name} received: saving a checkpoint at step {step} and exiting"
                + (f" (all {jax.process_count()} processes stop at this step)" if multi else ""))
            if step not in ckpt.all_steps():
                save(step)
            wait_ckpt()
            summary = {"step": step, "stop_reason": "signal", "signal": name, "checkpoint_dir": str(ckpt_dir),
                       "checkpoint_step": ckpt.latest_step(), "history": hist.history}
            return summary
        if stop_reason == "time":
            say(f"max_train_minutes={cfg.max_train_minutes} reached at step {step}; finishing")

        final_val, final_parts = evaluate(model_params(state.params, step))
        hist.evaluation(step, final_val)
        if writer is not None:
            writer.scalars(step, val_scalars(final_val, final_parts), prefix="val")
        if final_parts:
            say(f"step {step:>6d}  {val_text(final_val, final_parts)}")

        # (each split read through data.ngram_sample: at most NGRAM_MAX_TOKENS of it, bounded memory on any corpus)
        ent = data_api.corpus_entropies(data.train_tokens, tok.vocab_size)
        held = data_api.heldout_ngram_xent(data.train_tokens, data.val_tokens, tok.vocab_size)
        qat_summary = None
        if qat_start is not None:
            from minicpm4_jax.train.qat import stats_lines, stats_summary

            qstats = ternary_stats(state.params, cfg.model, qat_spec)
            zf, sm = stats_summary(qstats)
            qat_summary = {**qat_spec.describe(), "ste": cfg.qat.ste, "start_step": qat_start,
                           "qat_steps": cfg.qat_steps, "ternary_at_end": is_ternary(step),
                           "zero_fraction": zf, "scale_mean": sm,
                           "per_layer": {k: {n: np.asarray(v).tolist() for n, v in d.items()} for k, d in qstats.items()}}
            if "init_from" in origin:
                src_tokens = int(origin.get("init_tokens", 0))
                qat_tokens = cfg.qat_steps * global_batch * t
                qat_summary.update(init_from=origin["init_from"], init_step=origin.get("init_step"),
                                   init_tokens=src_tokens, qat_tokens=qat_tokens,
                                   token_share=qat_tokens / max(1, qat_tokens + src_tokens))
            else:
                qat_summary["token_share"] = cfg.qat_steps / cfg.steps
            if is_ternary(step):
                say(f"ternary model at step {step}: {100 * zf:.1f}% zeros, mean scale {sm:.3e}")
                for line in stats_lines(qstats, cfg.model):
                    say(line)
        rows = [
            (f"model (step {step}{', ternary' if is_ternary(step) else ''}), held-out", final_val),
            ("unigram entropy, plug-in", ent["unigram"]),
            ("bigram entropy, plug-in", ent["bigram"]),
            ("unigram cross-entropy, held-out", held["unigram"]),
            ("bigram cross-entropy, held-out", held["bigram"]),
        ]
        from minicpm4_jax.train.data import NGRAM_MAX_TOKENS

        sampled = [f"{name} {int(a.shape[0]):,}" for name, a in (("train", data.train_tokens), ("val", data.val_tokens))
                   if a.shape[0] > NGRAM_MAX_TOKENS]
        say("loss per token (nats) on the tokenized corpus" + (
            f" (n-gram rows from {NGRAM_MAX_TOKENS:,} evenly spread tokens of the {' / '.join(sampled)}-token "
            "split(s))" if sampled else "") + ":")
        for name, v in rows:
            say(f"  {name:<34s} {v:8.4f}")

        sample = ""
        if cfg.sample_prompt and cfg.sample_tokens > 0 and multi:
            say("sample: skipped (the parameters span several processes)")
        elif cfg.sample_prompt and cfg.sample_tokens > 0:
            from flax import nnx

            from minicpm4_jax.generate import generate

            from minicpm4_jax.infer.engine import without_prefill_quirk

            model, note = without_prefill_quirk(nnx.merge(graphdef, model_params(state.params, step)))
            if note:
                say(f"sample: {note}")
            # the data pipeline separates documents with EOS, so a new document follows an EOS
            prefix = [tok.eos_id] if tok.eos_id is not None else []
            n_new = min(cfg.sample_tokens,
                        cfg.model.max_position_embeddings - len(tok.encode(cfg.sample_prompt)) - len(prefix))
            if n_new > 0:
                from minicpm4_jax.infer.engine import NonFiniteLogitsError

                try:
                    sample = generate(model, tok, cfg.sample_prompt, n_new, temperature=cfg.sample_temperature,
                                      top_p=cfg.sample_top_p, seed=cfg.seed, prefix_ids=prefix)
                except NonFiniteLogitsError as e:  # the sample is no reason to end the run without its summary
                    say(f"sample: none ({e})")
                else:
                    how = "greedy" if cfg.sample_temperature == 0 else (
                        f"temperature {cfg.sample_temperature}, top-p {cfg.sample_top_p}, seed {cfg.seed}")
                    say(f"sample ({how}) from {cfg.sample_prompt!r}:\n{cfg.sample_prompt}{sample}")
                    if writer is not None:
                        writer.text(step, "sample", cfg.sample_prompt + sample)
        wait_ckpt()
        # the whole run's median (a resumed run's rows before the resume included)
        tokens_per_second = hist.median_rate()
        # the train values of the last logged row (its window's means; the run always logs its last step), as the
        # log and metrics.jsonl show them; a resume with nothing to train has that row from its file
        last = {**hist.history[-1]} if hist.history else dict(last_vals)
        summary = {
            "step": step,
            "stop_reason": stop_reason,
            "val_loss": final_val,
            **({"val_loss_components": final_parts} if final_parts else {}),
            **({k_: origin[k_] for k_ in ("branch_from", "branch_step") if k_ in origin}),
            "val_history": hist.val_history,
            "train_loss": last.get("loss"),
            "last_step_loss": last.get("last_step_loss", last.get("loss")),
            "attended_fraction": last.get("attended_fraction"),
            "mtp_loss": last.get("mtp_loss"),
            **{k_: v_ for k_, v_ in last.items()
               if k_ in ("mtp_kl", "mtp_feature_loss") or k_.startswith("mtp_loss_depth")},
            "unigram_entropy": ent["unigram"],
            "bigram_entropy": ent["bigram"],
            "unigram_heldout_xent": held["unigram"],
            "bigram_heldout_xent": held["bigram"],
            "tokens_per_second": tokens_per_second,
            "step_time_s": global_batch * t / tokens_per_second if tokens_per_second > 0 else float("nan"),
            "mfu": mfu(cfg.model, t, tokens_per_second, peak, **draft),
            "peak_flops": peak,
            "peak_flops_per_device": device_peak,
            "num_params": n_params,
            "sample_prompt": cfg.sample_prompt,
            "sample": sample,
            "wall_seconds": time.perf_counter() - t_start,
            "checkpoint_dir": str(ckpt_dir),
            "checkpoint_step": ckpt.latest_step(),
            "history": hist.history,
        }
        if qat_summary is not None:
            summary["qat"] = qat_summary
        if is_main:
            # a full disk here (the run's checkpoints filled it) leaves the final checkpoint complete: say so in one line
            with _writing(out_dir / "summary.json", lambda: (
                    f"the run finished: checkpoint step {summary['checkpoint_step']} in {ckpt_dir} is complete; free "
                    "disk space and run again with --resume to redo the final evaluation and write summary.json")):
                write_json_atomic(out_dir / "summary.json", summary)
            say(f"wrote {out_dir / 'summary.json'}; checkpoint step {summary['checkpoint_step']} in {ckpt_dir}")
        return summary
    except dist.SecondInterrupt as e:  # Ctrl-C twice, or a signal once the run was saved: stop now
        failed = True
        # every save under way completes (it is not lost) before the message names the newest step on disk: an
        # interrupt inside a wait can leave the manager's own list behind a save that finalizes later
        ckpt.close(quiet=True)
        on_disk = ckpt.steps_on_disk()
        saved = on_disk[-1] if on_disk else None
        if isinstance(e, dist.FinishInterrupt):
            raise dist.FinishInterrupt(finish_interrupted_message(e.signum, step, saved, ckpt_dir), e.signum) from None
        raise dist.SecondInterrupt(interrupted_message(step, saved, ckpt_dir)) from None
    except BaseException as e:
        failed, refused = True, isinstance(e, ConfigError)
        raise
    finally:
        if pbar is not None:  # an error ends the run mid-bar: the CLI's "error:" line starts on a line of its own
            pbar.close()
        if tracer is not None:
            tracer.close()
        stop.restore()
        if writer is not None:
            writer.close()
        try:
            if failed:
                ckpt.close(quiet=True)  # do not mask the error in flight
            else:
                ckpt.close()
        finally:
            for lock in run_locks:  # after the last save completed
                lock.release()
        if refused:
            _remove_empty_folders(created)
