"""The pure train and eval steps (Flax NNX used functionally).

The model is split once (:func:`init_train_state`) into a static ``graphdef`` and an ``nnx.State``
of Params; the jitted steps ``nnx.merge`` them inside, so every step is a pure function of arrays:

* ``train_step(state, batch) -> (state, metrics)``, jitted with the state donated;
* ``eval_step(params, batch) -> (sum_nll, n_tokens)``.

``batch`` is int32 ``[batch, seq_len + 1]``: inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``.

Ternary QAT (``cfg.qat``, BitCPM4 paper §3.3): the loss merges the *fake-quantized* state
(``minicpm4_jax.quant.fake_quant_params`` with the straight-through gradient) instead of the latent
one, from step ``cfg.qat_start_step`` on; the optimizer updates the latent float weights, and the
learning rate follows :func:`lr_schedule`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minicpm4_jax.config import ModelConfig, TrainConfig
from minicpm4_jax.nn.model import MiniCPM4
from minicpm4_jax.nn.mtp import distill_kl, mtp_feature_loss
from minicpm4_jax.ops.dispatch import resolve_impl
from minicpm4_jax.quant import fake_quant_params, ternary_spec
from minicpm4_jax.sharding import batch_sharding, make_mesh, replicated, state_shardings
from minicpm4_jax.train.optim import decay_steps_of, make_optimizer, two_stage_schedule, wsd_schedule

__all__ = ["TrainState", "init_model", "init_train_state", "abstract_train_state", "make_optimizer_for",
           "train_state_shardings", "make_train_step", "make_eval_step", "split_microbatches", "next_token_loss",
           "token_sums", "make_loss_fn", "activation_sharding", "print_memory_analysis", "lr_schedule",
           "decay_start_step",
           "qat_params_for_loss"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes during training (a pytree).

    Attributes:
        step: int32 scalar, number of updates applied.
        params: ``nnx.State`` of the model's Params (float32).
        opt_state: the optax state of :func:`make_optimizer_for`.
    """

    step: jax.Array
    params: Any
    opt_state: Any


def init_model(model_cfg: ModelConfig, rng: jax.Array | int) -> MiniCPM4:
    """A freshly initialised :class:`MiniCPM4` (μP init, spec §3.2) from a key or an int seed."""
    return MiniCPM4(model_cfg, rngs=nnx.Rngs(params=rng))


def lr_schedule(cfg: TrainConfig) -> Callable[[jax.Array | int], jax.Array]:
    """The run's base learning rate ``step -> lr``: WSD over ``cfg.steps``, or with ``qat.enabled`` the
    two-stage schedule (high precision, then QAT re-warmed from ``cfg.qat_start_step``; see
    :func:`~minicpm4_jax.train.optim.two_stage_schedule`)."""
    start = cfg.qat_start_step
    if start is None:
        return wsd_schedule(cfg.optimizer, cfg.steps)
    return two_stage_schedule(cfg.optimizer, cfg.steps, start, warmup_steps=cfg.qat.warmup_steps,
                              learning_rate=cfg.qat.learning_rate)


def decay_start_step(cfg: TrainConfig) -> int:
    """The first step of the final decay phase of :func:`lr_schedule` (where a mixture's ``data.decay_weights``
    apply): ``steps - D`` of the run's WSD, or with ``qat.enabled`` that of the QAT stage's own WSD (its decay
    ``decay_steps`` or ``decay_fraction`` of the QAT steps, counted from ``qat_start_step``)."""
    start = cfg.qat_start_step
    if start is None:
        return cfg.steps - decay_steps_of(cfg.optimizer, cfg.steps)
    return cfg.steps - decay_steps_of(cfg.optimizer, cfg.steps - start)


def make_optimizer_for(cfg: TrainConfig) -> optax.GradientTransformation:
    """The run's optimizer (μP AdamW on :func:`lr_schedule`)."""
    return make_optimizer(cfg.model, cfg.optimizer, cfg.steps, schedule=lr_schedule(cfg))


def qat_params_for_loss(cfg: TrainConfig, params: Any, step: jax.Array) -> Any:
    """The parameters the loss sees at ``step``: ``params`` itself without QAT or before
    ``cfg.qat_start_step``, else the fake-quantized tree with the straight-through gradient
    (``lax.cond`` on the traced step, so no quantization is computed in the high-precision steps)."""
    start = cfg.qat_start_step
    if start is None:
        return params
    spec = ternary_spec(cfg.qat)

    def quantized(p: Any) -> Any:
        return fake_quant_params(p, cfg.model, spec, ste=True)

    if start == 0:
        return quantized(params)
    return jax.lax.cond(step >= start, quantized, lambda p: p, params)


def _init_fn(cfg: TrainConfig, tx: optax.GradientTransformation) -> Callable[[jax.Array], TrainState]:
    """The pure ``key -> TrainState`` initialiser (jitted by :func:`init_train_state`)."""

    def init(key: jax.Array) -> TrainState:
        _, params, _ = nnx.split(init_model(cfg.model, key), nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return init


def _key(rng: jax.Array | int) -> jax.Array:
    return jax.random.key(int(rng)) if isinstance(rng, (int, np.integer)) else rng


def _graphdef(cfg: TrainConfig) -> nnx.GraphDef:
    graphdef, _, rest = nnx.split(nnx.eval_shape(lambda: init_model(cfg.model, 0)), nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("MiniCPM4 holds non-Param state; train/step.py must carry it explicitly")
    return graphdef


def train_state_shardings(cfg: TrainConfig, mesh: Mesh) -> TrainState:
    """``NamedSharding`` tree of the :class:`TrainState` on ``mesh`` (rules of :mod:`minicpm4_jax.sharding`)."""
    return state_shardings(abstract_train_state(cfg), mesh)


def init_train_state(cfg: TrainConfig, rng: jax.Array | int, mesh: Mesh | None = None) -> tuple[nnx.GraphDef, TrainState]:
    """Initialise the model and the optimizer state, already sharded on ``mesh``.

    The initialiser is one ``jax.jit`` with ``out_shardings`` from the logical-axis rules, so each
    device materialises only its shards (no full copy on one device).

    Args:
        cfg: the run.
        rng: a key or an int seed.
        mesh: default ``make_mesh(cfg.mesh)`` (one device for the default mesh config).

    Returns:
        ``(graphdef, state)``: the static model structure and the :class:`TrainState` at step 0.

    Raises:
        ValueError: the model holds state other than Params (the functional split assumes none).
    """
    graphdef = _graphdef(cfg)
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    init = _init_fn(cfg, make_optimizer_for(cfg))
    state = jax.jit(init, out_shardings=train_state_shardings(cfg, mesh))(_key(rng))
    return graphdef, state


def abstract_train_state(cfg: TrainConfig) -> TrainState:
    """``ShapeDtypeStruct`` tree of :func:`init_train_state`'s state (a restore target; no compute, no sharding)."""
    return jax.eval_shape(_init_fn(cfg, make_optimizer_for(cfg)), jax.random.key(0))


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of the residual stream ``[batch, seq, hidden]``: batch over ``(data, fsdp)`` like the
    token batch, sequence and hidden replicated (tensor parallelism splits heads/MLP inside a layer).

    :func:`make_train_step` constrains the final hidden states to it. Without that constraint, XLA's
    sharding propagation (Shardy and GSPMD alike) takes the sharding of the embedding gather's
    output from the table, ``[vocab (tensor), embed (fsdp)]``, whose ``embed``-on-``fsdp`` leaves no
    ``fsdp`` for the batch: the residual stream, every layer's activations (attention scores
    included) and the logits then hold ``data``-only batch shards, i.e. ``fsdp`` times the device's
    share (MiniCPM4-8B cut to 2 layers on a (4, 32, 2) mesh, seq 1024, one sequence per device: 32
    sequences per device, 23.6 GiB of temporaries instead of 1.6 GiB). The constraint on the scan's
    output propagates back through the layer scan's carry to the embedding.
    """
    spec = batch_sharding(mesh).spec
    return NamedSharding(mesh, PartitionSpec(spec[0] if len(spec) else None, None, None))


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of float32 ``logits [b, t, v]`` vs int ``targets [b, t]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def token_sums(fn: Callable[..., tuple[jax.Array, ...]], arrays: tuple[jax.Array, ...], chunk: int,
               sharding: NamedSharding | None = None) -> tuple[jax.Array, ...]:
    """Sums over all ``[batch, n]`` positions of the per-position values ``fn(*arrays)``, ``chunk`` positions at a time.

    ``arrays``: each ``[batch, n, ...]`` (the same ``batch`` and ``n``); ``fn`` maps such arrays (or their
    ``[batch, chunk, ...]`` slices) to a tuple of float32 ``[batch, n]`` (``[batch, chunk]``) values, e.g. the
    output head and a cross-entropy. With ``0 < chunk < n`` the sequence axis is cut into ``ceil(n / chunk)``
    chunks (the last one padded and masked) walked by a ``lax.scan`` whose body is rematerialised
    (``jax.checkpoint``): only one chunk's ``[batch, chunk, vocab]`` logits exist at a time, in the forward and
    in the backward, instead of the whole ``[batch, n, vocab]`` and its gradient (the blockwise loss of
    Levanter / MaxText's vocabulary tiling). ``chunk <= 0`` or ``>= n``: one call on the whole arrays. Sums are
    float32; the chunked sums equal the whole-array sums up to summation order.

    ``sharding``: under a mesh, the batch sharding of the 3-D float inputs (:func:`activation_sharding`),
    re-applied to each chunk.
    """
    b, n = arrays[0].shape[:2]
    if chunk <= 0 or chunk >= n:
        return tuple(jnp.sum(v) for v in fn(*arrays))
    nc = -(-n // chunk)
    pad = nc * chunk - n

    def cut(a: jax.Array) -> jax.Array:  # [b, n, ...] -> [nc, b, chunk, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, nc, chunk, *a.shape[2:]), 1, 0)

    def constrain(a: jax.Array) -> jax.Array:
        if sharding is None or a.ndim != 3 or not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        return jax.lax.with_sharding_constraint(a, sharding)

    valid = (jnp.arange(nc * chunk, dtype=jnp.int32) < n).reshape(nc, chunk)
    one = jax.checkpoint(lambda *xs: fn(*(constrain(x) for x in xs)))

    def body(acc, inp):
        ok, xs = inp[0], inp[1:]
        vals = one(*xs)
        return tuple(s + jnp.sum(jnp.where(ok[None, :], v, 0.0)) for s, v in zip(acc, vals)), None

    n_out = len(jax.eval_shape(fn, *(a[:, :1] for a in arrays)))
    sums, _ = jax.lax.scan(body, tuple(jnp.zeros((), jnp.float32) for _ in range(n_out)),
                           (valid, *(cut(a) for a in arrays)))
    return sums


def make_loss_fn(cfg: TrainConfig, graphdef: nnx.GraphDef, act_sh: NamedSharding | None = None
                 ) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, dict]]:
    """The objective ``loss_fn(params, batch, step) -> (loss, aux)`` that :func:`make_train_step` differentiates.

    ``params``: the model's ``nnx.State``; ``batch`` int32 ``[batch, seq_len + 1]``; ``step`` int32 scalar (the QAT
    switch). ``loss`` float32 is ``L_NTP`` (+ ``mtp_loss_weight * L_MTP`` and the draft objectives with
    ``model.mtp``); ``aux`` holds the per-term float32 metrics (``loss`` = the next-token loss, ``mtp_loss``, ...,
    ``attended_fraction`` for InfLLM v2). ``act_sh``: the residual stream's sharding under a mesh
    (:func:`activation_sharding`). The logits are computed ``cfg.logits_chunk_size`` positions at a time
    (:func:`token_sums`).
    """
    sparse = cfg.model.attention == "infllmv2"
    mtp = cfg.model.mtp

    def loss_fn(params: Any, batch: jax.Array, step: jax.Array) -> tuple[jax.Array, dict]:
        model = nnx.merge(graphdef, qat_params_for_loss(cfg, params, step))
        if sparse:
            hidden, stats = model.hidden_states(batch[:, :-1], return_stats=True, activation_sharding=act_sh)
        else:
            hidden, stats = model.hidden_states(batch[:, :-1], activation_sharding=act_sh), {}
        # the residual stream keeps the batch sharding (see activation_sharding)
        if act_sh is not None:
            hidden = jax.lax.with_sharding_constraint(hidden, act_sh)
        targets = batch[:, 1:]
        chunk = cfg.logits_chunk_size

        def ce(h: jax.Array, y: jax.Array) -> jax.Array:  # per position, float32 [b, n]
            return optax.softmax_cross_entropy_with_integer_labels(model.logits(h), y)

        ntp = token_sums(lambda h, y: (ce(h, y),), (hidden, targets), chunk, act_sh)[0] / targets.size
        if not mtp:
            return ntp, stats
        # L = L_NTP + λ·L_MTP (spec §3.4), L_MTP averaged over the trained chain depths; the reported "loss" stays
        # the next-token loss and "mtp_loss" the depth-1 MTP token loss (the paper's) whatever the objective
        depth = cfg.mtp_train_depth
        # mtp_detach: the draft reads the base's states without training them (EAGLE's frozen-base draft)
        h_mtp = jax.lax.stop_gradient(hidden) if cfg.mtp_detach else hidden
        if depth == 1:
            feats_by_depth = [model.mtp_features(h_mtp, targets, activation_sharding=act_sh)]
        else:  # the chain's later drafts too, each on its own stand-in states (MTPHead.unrolled)
            feats_by_depth = model.mtp_unrolled(h_mtp, targets, depth, activation_sharding=act_sh)
        aux = {**stats, "loss": ntp}
        m_obj = kl = feat = 0.0

        def draft_terms(f: jax.Array, y: jax.Array, *h_next: jax.Array) -> tuple[jax.Array, ...]:
            # position i of depth d: the draft's logits vs x_{i+d+1}, and (mtp_distill) vs the base's own
            # distribution at the position that predicts the same token (mtp_loss / mtp_distill_loss, per position)
            lg = model.logits(f)
            terms = (optax.softmax_cross_entropy_with_integer_labels(lg, y),)
            return terms + tuple(distill_kl(lg, model.logits(h)) for h in h_next)

        for d, feats in enumerate(feats_by_depth, start=1):
            # feats [b, t - d + 1, h]: its last position has no label inside the window
            args = (feats[:, :-1], targets[:, d:]) + ((hidden[:, d:],) if cfg.mtp_distill > 0 else ())
            sums = token_sums(draft_terms, args, chunk, act_sh)
            n_pos = targets[:, d:].size
            m = sums[0] / n_pos
            aux["mtp_loss" if d == 1 else f"mtp_loss_depth{d}"] = m
            m_d = m
            if cfg.mtp_distill > 0:
                kl_d = sums[1] / n_pos
                kl = kl + kl_d / depth
                m_d = (1.0 - cfg.mtp_distill) * m + cfg.mtp_distill * kl_d
            m_obj = m_obj + m_d / depth
            if cfg.mtp_feature_weight > 0:
                feat = feat + mtp_feature_loss(feats, hidden[:, d - 1:]) / depth
        total = ntp + cfg.mtp_loss_weight * m_obj
        if cfg.mtp_distill > 0:
            aux["mtp_kl"] = kl
        if cfg.mtp_feature_weight > 0:
            aux["mtp_feature_loss"] = feat
            total = total + cfg.mtp_feature_weight * feat
        return total, aux

    return loss_fn


def split_microbatches(batch: jax.Array, microbatches: int, mesh: Mesh | None = None) -> jax.Array:
    """``batch [B, ...]`` -> ``[microbatches, B / microbatches, ...]``: microbatch ``a`` holds rows ``a, a + A, ...``.

    Strided rather than contiguous rows so that, with the batch split over ``(data, fsdp)`` in contiguous
    blocks of ``B / n`` rows, every microbatch keeps ``B / (n A)`` rows on each device: the split moves no
    data between devices (``mesh``: the result is constrained to that layout, batch sharding on axis 1).

    Raises:
        ValueError: ``B`` is not a multiple of ``microbatches``.
    """
    b = batch.shape[0]
    if microbatches < 1 or b % microbatches:
        raise ValueError(f"a batch of {b} sequences does not split into {microbatches} equal microbatches; "
                         "use a batch size that is a multiple of gradient_accumulation_steps")
    out = jnp.swapaxes(batch.reshape(b // microbatches, microbatches, *batch.shape[1:]), 0, 1)
    if mesh is not None:
        spec = batch_sharding(mesh).spec
        out = jax.lax.with_sharding_constraint(
            out, NamedSharding(mesh, PartitionSpec(None, spec[0] if len(spec) else None)))
    return out


def make_train_step(cfg: TrainConfig, graphdef: nnx.GraphDef,
                    mesh: Mesh | None = None) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """The jitted pure ``train_step(state, batch) -> (state, metrics)`` (``state`` is donated).

    Jitted with ``in_shardings``/``out_shardings`` on ``mesh`` (default ``make_mesh(cfg.mesh)``):
    the state keeps the shardings of :func:`train_state_shardings`, the batch is split over
    ``(data, fsdp)`` and the metrics are replicated.

    ``batch``: int32 ``[batch, seq_len + 1]``. Metrics (float32 scalars): ``loss`` (mean next-token
    CE on the params *before* the update), ``grad_norm`` (global L2 norm before clipping), ``lr``
    (the base-group LR used for this update; hidden matrices use ``lr / width_mult`` under μP) and, for
    ``attention: infllmv2``, ``attended_fraction`` (mean attended / causal keys per query over layers,
    sequences, KV heads and tokens; 1 where the dense fallback ran).

    With ``cfg.qat.enabled`` the loss is computed on :func:`qat_params_for_loss` (ternary weights from
    ``cfg.qat_start_step`` on; ``loss`` is then the loss of the ternary model) and the gradient
    reaches the latent weights through the straight-through estimator.

    With ``cfg.gradient_accumulation_steps = A > 1`` the batch is split into A microbatches
    (:func:`split_microbatches`) walked by a ``lax.scan``: each one's loss and gradient (forward and backward of
    ``batch / A`` sequences) are summed into float32 accumulators sharded like the parameters, and their means
    (the whole batch's loss and gradient up to summation order: every sequence has ``seq_len`` targets) feed one
    optimizer update. The metrics are the means over the microbatches.
    """
    tx = make_optimizer_for(cfg)
    schedule = lr_schedule(cfg)

    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    state_sh = train_state_shardings(cfg, mesh)
    loss_fn = make_loss_fn(cfg, graphdef, activation_sharding(mesh))
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    accum = cfg.gradient_accumulation_steps

    def accumulated(params: Any, batch: jax.Array, step: jax.Array) -> tuple[tuple[jax.Array, dict], Any]:
        # sum over microbatches in float32 accumulators laid out like the parameters, then the means
        def constrain(tree: Any) -> Any:
            return jax.lax.with_sharding_constraint(tree, state_sh.params)

        def body(carry, mb):
            # tie the parameters to the microbatch: otherwise XLA hoists whatever depends on the parameters
            # alone (the all-gathered embedding table and its compute-dtype cast) out of the loop and keeps it
            # live across all microbatches; here it is gathered again per microbatch, as FSDP does
            p, mb = jax.lax.optimization_barrier((params, mb))
            (loss, stats), grads = grad_fn(p, mb, step)
            acc_loss, acc_stats, acc_grads = carry
            acc_grads = constrain(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads))
            acc_stats = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), acc_stats, stats)
            return (acc_loss + loss, acc_stats, acc_grads), None

        micro = split_microbatches(batch, accum, mesh)
        stats_shape = jax.eval_shape(lambda: grad_fn(params, micro[0], step)[0][1])
        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), stats_shape),
                 constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)))
        (loss, stats, grads), _ = jax.lax.scan(body, zeros, micro)
        grads = jax.tree.map(lambda g, p: (g / accum).astype(p.dtype), grads, params)
        return (loss / accum, jax.tree.map(lambda v: v / accum, stats)), grads

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        if accum == 1:
            (loss, stats), grads = grad_fn(state.params, batch, state.step)
        else:
            (loss, stats), grads = accumulated(state.params, batch, state.step)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads), "lr": schedule(state.step), **stats}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    jitted = jax.jit(train_step, in_shardings=(state_sh, batch_sharding(mesh)),
                     out_shardings=(state_sh, replicated(mesh)), donate_argnums=0)
    return kernels_under_mesh(jitted, cfg.model.attention_impl, mesh)


def kernels_under_mesh(jitted: Any, attention_impl: str, mesh: Mesh | None) -> Any:
    """``jitted`` traced, lowered and called under ``jax.set_mesh(mesh)`` when it runs Pallas kernels on a mesh.

    The Pallas kernels are single-device programs: traced under the mesh, they run per device (``jax.shard_map``
    over batch and heads, :func:`minicpm4_jax.ops.dispatch.on_mesh`); traced without it, each kernel runs on
    whole (gathered) arrays. With ``attention_impl`` resolving to ``"xla"``, no mesh or one device: ``jitted``.
    """
    if mesh is not None and mesh.size > 1 and resolve_impl(attention_impl) == "pallas":
        return _UnderMesh(jitted, mesh)
    return jitted


class _UnderMesh:
    """A jitted function traced, lowered and called with ``jax.set_mesh(mesh)`` in effect."""

    def __init__(self, jitted: Any, mesh: Mesh):
        self._jitted, self._mesh = jitted, mesh

    def __call__(self, *args: Any) -> Any:
        with jax.set_mesh(self._mesh):
            return self._jitted(*args)

    def lower(self, *args: Any) -> Any:
        with jax.set_mesh(self._mesh):
            return self._jitted.lower(*args)

    def trace(self, *args: Any) -> Any:
        with jax.set_mesh(self._mesh):
            return self._jitted.trace(*args)


def _global_norm(tree: Any) -> jax.Array:
    """Global L2 norm of a gradient tree (float32 scalar)."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_eval_step(graphdef: nnx.GraphDef, mesh: Mesh | None = None, logits_chunk_size: int = 0,
                   microbatches: int = 1) -> Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]:
    """The jitted ``eval_step(params, batch) -> (sum_nll, n_tokens)``.

    ``batch`` int32 ``[batch, seq_len + 1]``; ``sum_nll`` float32 is the summed next-token negative
    log-likelihood (nats) over the ``n_tokens = batch * seq_len`` targets (int32). A ternary model is
    evaluated by passing ``minicpm4_jax.quant.ternarize(params, ...)``. With ``mesh`` (FSDP-sharded
    params), the hidden states are constrained to :func:`activation_sharding` as in the train step.
    ``logits_chunk_size``: sequence positions whose logits exist at once (:func:`token_sums`; 0 = all).
    ``microbatches``: a batch whose size is a multiple of it is evaluated in that many slices of sequences, one at
    a time (:func:`split_microbatches`, a ``lax.scan``; ``gradient_accumulation_steps``); other batches in one
    piece.
    """
    act_sh = None if mesh is None else activation_sharding(mesh)

    def eval_step(params: Any, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        if microbatches > 1 and batch.shape[0] % microbatches == 0:
            def body(acc, mb):
                return acc + one_batch(params, mb)[0], None

            total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), split_microbatches(batch, microbatches, mesh))
            return total, jnp.asarray(batch.shape[0] * (batch.shape[1] - 1), jnp.int32)
        return one_batch(params, batch)

    def one_batch(params: Any, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, params)
        hidden = model.hidden_states(batch[:, :-1], activation_sharding=act_sh)
        if act_sh is not None:
            hidden = jax.lax.with_sharding_constraint(hidden, act_sh)
        targets = batch[:, 1:]

        def nll(h: jax.Array, y: jax.Array) -> tuple[jax.Array]:
            return (optax.softmax_cross_entropy_with_integer_labels(model.logits(h), y),)

        return token_sums(nll, (hidden, targets), logits_chunk_size, act_sh)[0], jnp.asarray(targets.size, jnp.int32)

    return jax.jit(eval_step)


def print_memory_analysis(jitted: Any, *args: Any, log: Callable[[str], None] = print) -> Any:
    """Compile ``jitted`` ahead of time for ``args`` and print its memory analysis once, if available.

    Returns the compiled executable (or ``None`` when lowering fails); never raises.
    """
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        log(f"memory analysis unavailable ({e.__class__.__name__})")
        return None
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        ma = None
    if ma is None:
        log("memory analysis: not provided by this backend")
        return compiled
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes")
    parts = []
    for f in fields:
        v = getattr(ma, f, None)
        if v is not None:
            parts.append(f"{f.replace('_size_in_bytes', '')}={v / 2**20:.1f} MiB")
    log("train_step memory: " + ", ".join(parts))
    return compiled
