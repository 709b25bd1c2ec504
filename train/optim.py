"""AdamW with MiniCPM's μP learning-rate rules and the WSD schedule (spec ``minicpm4_model.md`` §3.2-§3.3).

Parameter groups (derived from the parameter *path*, never from shapes):

* ``hidden``: the 2-D hidden matrices ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
  ``up_proj``, ``down_proj`` (stacked with a leading layer axis, and q/k/v/o kept per head, so a shape
  rule would misfire). Learning rate ``lr / width_mult`` when ``OptimizerConfig.mup`` is on; decayed.
* ``embedding``: the token embedding and the untied ``lm_head``. Base learning rate; decayed.
* ``norm``: RMSNorm weights. Base learning rate; **no** weight decay.

Weight decay is decoupled (optax ``adamw``: ``p <- p - lr_group * (adam_update + wd * p)``), so a hidden
matrix's decay scales with its own (μP-reduced) learning rate. One WSD schedule drives every group;
the ``lr`` reported in metrics is the base-group value ``wsd_schedule(cfg, steps)(step)``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from minicpm4_jax.config import ModelConfig, OptimizerConfig

__all__ = ["HIDDEN_MATRICES", "NORM_WEIGHTS", "param_group", "param_labels", "decay_steps_of",
           "wsd_schedule", "two_stage_schedule", "make_optimizer", "group_lr_multipliers"]

#: Parameter names (last path element) of the μP hidden matrices (``fc``: the MTP module's 2H -> H input).
HIDDEN_MATRICES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"})
#: Parameter names of RMSNorm weights (``input_norm1/2``: the MTP module's input norms).
NORM_WEIGHTS = frozenset({"input_layernorm", "post_attention_layernorm", "norm", "input_norm1", "input_norm2"})
_EMBEDDING = frozenset({"embedding", "lm_head"})


def _key_name(k: Any) -> str | None:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return None


def param_group(path: tuple[Any, ...]) -> str:
    """The optimizer group (``hidden`` | ``embedding`` | ``norm``) of a parameter from its tree path.

    ``path`` is a JAX key path (``jax.tree_util`` keys); the trailing ``.value`` of an NNX Variable is
    ignored. Raises ``ValueError`` for a parameter name this table does not know (a new parameter must
    be given a group explicitly rather than silently getting the wrong learning rate).
    """
    names = [n for n in (_key_name(k) for k in path) if n is not None and n != "value"]
    name = names[-1] if names else ""
    if name in HIDDEN_MATRICES:
        return "hidden"
    if name in NORM_WEIGHTS:
        return "norm"
    if name in _EMBEDDING:
        return "embedding"
    raise ValueError(f"parameter {'.'.join(names)!r} has no μP group; add it to train/optim.py")


def param_labels(params: Any) -> Any:
    """A tree of group labels with the structure of ``params`` (an ``nnx.State`` or any pytree)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_group(path), params)


def group_lr_multipliers(model_cfg: ModelConfig, opt_cfg: OptimizerConfig) -> dict[str, float]:
    """Learning-rate multiplier of each group relative to the base schedule (μP, spec §3.2)."""
    hidden = 1.0 / model_cfg.width_mult if opt_cfg.mup else 1.0
    return {"hidden": hidden, "embedding": 1.0, "norm": 1.0}


def decay_steps_of(opt_cfg: OptimizerConfig, total_steps: int) -> int:
    """Decay length: ``decay_steps`` or ``round(decay_fraction * total_steps)``."""
    if opt_cfg.decay_steps is not None:
        return int(opt_cfg.decay_steps)
    return int(round(opt_cfg.decay_fraction * total_steps))


def wsd_schedule(opt_cfg: OptimizerConfig, total_steps: int) -> Callable[[jax.Array | int], jax.Array]:
    """The warmup-stable-decay schedule ``step -> lr`` (float32, jittable; spec §3.3, fault B12).

    With peak ``P = learning_rate``, warmup ``W``, decay length ``D`` (``decay_steps_of``), run
    length ``N = total_steps`` and ``r = min_lr_ratio``; ``s`` is the number of updates already
    applied (optax's count: the first update uses ``s = 0``):

    * warmup ``s < W``: ``P * (s + 1) / W``. **The warmup starts at ``P / W``** (not 0, so the first
      update is not wasted) and reaches ``P`` at ``s = W - 1``.
    * stable ``W <= s < N - D``: ``P``.
    * decay ``N - D <= s <= N``: with ``progress = (s - (N - D)) / D`` (normalised by the decay
      length, not the run length), ``P * r ** progress`` (``exponential``) or
      ``P * (1 - (1 - r) * progress)`` (``linear``); ``lr(N - D) = P`` and ``lr(N) = r * P`` exactly.
    * after ``N``: constant ``r * P`` (no roll-over back to the peak).

    The ``D`` decay updates use ``s = N - D .. N - 1``: the last one runs at ``P * r ** ((D - 1) / D)``
    (exponential), and ``D = 1`` decays nothing (``run_training`` warns).

    The value depends on ``s`` only, so a resumed run gets exactly the uninterrupted values.
    """
    peak = float(opt_cfg.learning_rate)
    warmup = int(opt_cfg.warmup_steps)
    decay = decay_steps_of(opt_cfg, total_steps)
    start = total_steps - decay
    ratio = float(opt_cfg.min_lr_ratio)
    style = opt_cfg.decay_style
    if style not in ("exponential", "linear"):
        raise ValueError(f"decay_style={style!r}; use 'exponential' or 'linear'")

    def schedule(step: jax.Array | int) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (s + 1.0) / warmup) if warmup > 0 else jnp.ones_like(s)
        if decay > 0:
            progress = jnp.clip((s - start) / decay, 0.0, 1.0)
        else:
            progress = (s >= start).astype(jnp.float32)
        if style == "exponential":
            factor = jnp.power(jnp.float32(ratio), progress)
        else:
            factor = 1.0 - (1.0 - ratio) * progress
        # Exact end points: r**1 through exp/log is not always bit-exact.
        factor = jnp.where(progress >= 1.0, jnp.float32(ratio), factor)
        factor = jnp.where(progress <= 0.0, jnp.float32(1.0), factor)
        return jnp.where(s < start, peak * warm, peak * factor).astype(jnp.float32)

    return schedule


def two_stage_schedule(opt_cfg: OptimizerConfig, total_steps: int, switch_step: int, *,
                       warmup_steps: int | None = None, learning_rate: float | None = None
                       ) -> Callable[[jax.Array | int], jax.Array]:
    """High precision, then QAT with the learning rate re-warmed (BitCPM4, paper §3.3).

    ``s < switch_step``: ``wsd_schedule(opt_cfg, total_steps)(s)`` (the run's WSD, cut off at the
    switch). ``s >= switch_step``: a fresh WSD over the ``total_steps - switch_step`` QAT steps,
    ``wsd_schedule(opt_cfg', total_steps - switch_step)(s - switch_step)``, where ``opt_cfg'`` takes
    ``warmup_steps`` / ``learning_rate`` when given (the re-warmup length and the QAT peak) and
    decays over ``decay_steps`` or ``decay_fraction`` of the QAT steps. ``switch_step == 0`` gives
    the QAT schedule alone. float32, jittable, a function of ``s`` only (a resumed run gets the same
    values).
    """
    import dataclasses

    n_qat = total_steps - switch_step
    if not 0 <= switch_step < total_steps:
        raise ValueError(f"switch_step={switch_step} must be in [0, total_steps={total_steps})")
    q_cfg = dataclasses.replace(
        opt_cfg,
        warmup_steps=opt_cfg.warmup_steps if warmup_steps is None else int(warmup_steps),
        learning_rate=opt_cfg.learning_rate if learning_rate is None else float(learning_rate),
    )
    qat = wsd_schedule(q_cfg, n_qat)
    if switch_step == 0:
        return qat
    hp = wsd_schedule(opt_cfg, total_steps)

    def schedule(step: jax.Array | int) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        return jnp.where(s < switch_step, hp(s), qat(s - switch_step)).astype(jnp.float32)

    return schedule


def make_optimizer(model_cfg: ModelConfig, opt_cfg: OptimizerConfig, total_steps: int,
                   schedule: Callable[[jax.Array | int], jax.Array] | None = None) -> optax.GradientTransformation:
    """Global grad-norm clipping, then per-group AdamW (μP LRs, no decay on norms) on one schedule.

    ``schedule`` is the base-group ``step -> lr`` (default ``wsd_schedule(opt_cfg, total_steps)``;
    a QAT run passes :func:`two_stage_schedule`). The returned transformation expects
    gradients/params with the structure of the model's ``nnx.State`` of Params (labels come from
    :func:`param_labels` on that tree).
    """
    base = wsd_schedule(opt_cfg, total_steps) if schedule is None else schedule
    mult = group_lr_multipliers(model_cfg, opt_cfg)

    def group(name: str, weight_decay: float) -> optax.GradientTransformation:
        m = mult[name]
        lr = base if m == 1.0 else (lambda s, m=m: base(s) * m)
        return optax.adamw(lr, b1=opt_cfg.beta1, b2=opt_cfg.beta2, eps=opt_cfg.eps, weight_decay=weight_decay)

    transforms = {
        "hidden": group("hidden", opt_cfg.weight_decay),
        "embedding": group("embedding", opt_cfg.weight_decay),
        "norm": group("norm", 0.0),
    }
    parts = []
    if opt_cfg.grad_clip and opt_cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(opt_cfg.grad_clip))
    parts.append(optax.multi_transform(transforms, param_labels))
    return optax.chain(*parts)
