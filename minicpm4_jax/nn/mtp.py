"""The multi-token-prediction (MTP) module, laid out like the released EAGLE draft heads.

Spec ``minicpm4_model.md`` §3.4 (MTP objective) and §7 (EAGLE-1 head of MiniCPM4): for position ``i``

1. ``e = embed_tokens[x_{i+1}] * scale_emb`` (the base model's embedding, shared);
2. ``u = fc([RMSNorm_1(e) ; RMSNorm_2(h_i)])`` with ``h_i`` the base model's final-norm output at ``i``
   (before the ÷ width_mult), embedding first (the released order), ``fc``: ``[2 * hidden, hidden]``, no bias;
3. one MiniCPM decoder layer (causal attention over the ``u`` of earlier positions, position ids ``i``)
   whose residual branches are scaled by ``scale_depth / sqrt(num_hidden_layers + 1)``;
4. no final norm; ÷ ``hidden_size / dim_model_base``, then the base model's output head -> logits for
   ``x_{i+2}``.

As a speculative draft (the inference engine) the layer output ``o_i`` also stands in for the unknown base
hidden state of the next position when more than one token is drafted (EAGLE-style chaining).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm4_jax.config import ModelConfig
from minicpm4_jax.nn.layers import dtype_of, hidden_init_std, param, rms_norm
from minicpm4_jax.nn.attention import attend
from minicpm4_jax.nn.model import DecoderLayer, _dense

__all__ = ["MTPHead", "chained_attention", "distill_kl", "mtp_distill_loss", "mtp_feature_loss", "mtp_layer_config", "mtp_loss"]


def mtp_layer_config(cfg: ModelConfig) -> ModelConfig:
    """The config the MTP decoder layer runs with.

    Residual scale ``scale_depth / sqrt(L + 1)`` (spec §3.4, the re-implementation mirroring OpenBMB's MTP
    layer and CPM.cu's draft) and dense attention: the draft layer attends its own short-lived inputs densely,
    in training and in the inference engine alike (the released EAGLE heads have no sparse attention).
    """
    return dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1, attention="dense",
                               attention_impl="auto", sparse_config=None)


class MTPHead(nnx.Module):
    """MTP / draft module (module docstring).

    Attributes:
        input_norm1: RMSNorm weight ``[hidden]`` applied to the next token's scaled embedding.
        input_norm2: RMSNorm weight ``[hidden]`` applied to the base hidden state.
        fc: ``[2 * hidden, hidden]`` (rows ``[:hidden]`` act on the embedding, ``[hidden:]`` on the hidden state).
        layer: one :class:`~minicpm4_jax.nn.model.DecoderLayer`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h = cfg.hidden_size
        pd = dtype_of(cfg.param_dtype)
        self.input_norm1 = param(None, (h,), None, ("norm",), pd)
        self.input_norm2 = param(None, (h,), None, ("norm",), pd)
        self.fc = param(rngs, (2 * h, h), hidden_init_std(cfg), ("mlp", "embed"), pd)
        self.layer = DecoderLayer(cfg, rngs=rngs)

    def inputs(self, emb_next: jax.Array, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
        """``u`` ``[batch, seq, hidden]`` from ``emb_next`` (scaled embeddings of ``x_{i+1}``) and ``hidden`` (``h_i``)."""
        dt = hidden.dtype
        e = rms_norm(emb_next.astype(dt), self.input_norm1[...], cfg.rms_norm_eps)
        hh = rms_norm(hidden, self.input_norm2[...], cfg.rms_norm_eps)
        return _dense(jnp.concatenate([e, hh], axis=-1), self.fc[...].astype(dt))

    def __call__(self, hidden: jax.Array, next_emb: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
        """Layer output ``o`` ``[batch, seq, hidden]`` (before the head) for every position.

        Args:
            hidden: base final-norm hidden states ``h_i`` ``[batch, seq, hidden]``.
            next_emb: scaled embeddings of ``x_{i+1}`` ``[batch, seq, hidden]``.
            positions: int32 ``[batch, seq]`` (position ids of the ``h_i``).
            cfg: the base model's config.
        """
        from minicpm4_jax.nn.rope import rope_tables

        cfg_m = mtp_layer_config(cfg)
        u = self.inputs(next_emb, hidden, cfg)
        cos, sin = rope_tables(positions, cfg_m)
        return self.layer(u, cos, sin, positions, cfg_m)

    def unrolled(self, hidden: jax.Array, next_emb: jax.Array, positions: jax.Array, cfg: ModelConfig,
                 depth: int, activation_sharding: jax.sharding.Sharding | None = None) -> list[jax.Array]:
        """Layer outputs of chain depths ``1 .. depth`` on a whole sequence (training-time test of the chain).

        Depth 1 is :meth:`__call__`. Depth ``d + 1`` at position ``p`` takes the depth-``d`` output of
        position ``p - 1`` in place of the base state ``h_p`` and the true token ``x_{p+1}`` as the drafted one,
        and attends what a chained draft attends at inference (:func:`chained_attention`): so a loss on it
        trains the draft on its own stand-in states, the inputs it sees from its second draft on (the idea of
        HASS / EAGLE-3's training-time test, with this head's EAGLE-1 layout).

        Args:
            hidden, next_emb, positions, cfg: as :meth:`__call__` (``[batch, seq, ...]``).
            depth: number of chain depths, ``1 <= depth < seq``.
            activation_sharding: under a mesh, the batch sharding of ``[batch, seq, hidden]`` activations, applied
                to every depth's inputs (left to propagation, XLA swapped the rows of two batch shards of the
                depth-1 input on a (2, 2, 2) mesh with chained depths and a short window).

        Returns:
            ``depth`` arrays; depth ``d``'s is ``[batch, seq - d + 1, hidden]`` for positions ``d - 1 .. seq - 1``,
            predicting ``x_{p+2}``, so its labels (and next-token ids, base states) are the same arrays sliced
            ``[:, d - 1:]``.
        """
        from minicpm4_jax.nn.rope import rope_tables

        cfg_m = mtp_layer_config(cfg)
        t = hidden.shape[1]
        if not 1 <= depth < t:
            raise ValueError(f"depth={depth} must be in [1, seq={t})")
        outs: list[jax.Array] = []
        ks: list[jax.Array] = []
        vs: list[jax.Array] = []
        def constrain(x: jax.Array) -> jax.Array:
            return x if activation_sharding is None else jax.lax.with_sharding_constraint(x, activation_sharding)

        h_in = hidden
        for d in range(1, depth + 1):
            n = t - d + 1
            u = constrain(self.inputs(constrain(next_emb[:, d - 1:]), constrain(h_in), cfg))
            cos, sin = rope_tables(positions[:, d - 1:], cfg_m)
            if d == 1:  # the layer's own call, keeping its keys and values for the later depths
                q, k1, v1, q_nope, k_nope = self.layer.qkv(u, cos, sin, cfg_m)
                a = attend(q, k1, v1, q_positions=positions, kv_positions=positions, cfg=cfg_m, q_nope=q_nope,
                           k_nope=k_nope)
                o = self.layer.finish(u, a, cfg_m)
            else:
                q, k, v, _, _ = self.layer.qkv(u, cos, sin, cfg_m)
                ks, vs = [x[:, :n] for x in ks] + [k], [x[:, :n] for x in vs] + [v]
                a = chained_attention(q, k1[:, :n], v1[:, :n], ks, vs)
                o = self.layer.finish(u, a, cfg_m)
            outs.append(o)
            h_in = o[:, :-1]
        return outs


def chained_attention(q: jax.Array, k1: jax.Array, v1: jax.Array, k_chain: list[jax.Array],
                      v_chain: list[jax.Array]) -> jax.Array:
    """The draft layer's attention at chain depth ``d = len(k_chain)`` (≥ 1), as the inference engine runs it.

    A depth-``d`` draft of position ``p`` sees the draft cache: the depth-1 entries (computed from true base
    states) at positions ``<= p - d + 1`` and one entry per later depth ``m = 2 .. d`` at ``p - d + m`` (the
    round's own chain, ending with itself). Indexed by ``r = p - d + 1`` (so every depth's arrays start at 0),
    query ``r`` attends ``k1[j]`` for ``j <= r`` and ``k_chain[m][r]`` for each ``m``.

    Args:
        q: post-RoPE queries of depth ``d`` ``[batch, n, heads, head_dim]``.
        k1, v1: the depth-1 keys (post-RoPE) / values ``[batch, n, kv_heads, head_dim]``.
        k_chain, v_chain: the keys / values of depths ``2 .. d`` at the same indices, each
            ``[batch, n, kv_heads, head_dim]`` (the last one the query's own).

    Returns:
        ``[batch, n, heads, head_dim]`` in ``q.dtype``; fp32 softmax over ``r + 1 + len(k_chain)`` keys.
    """
    b, n, nq, d = q.shape
    nkv = k1.shape[2]
    g = nq // nkv
    f32 = jnp.float32
    qg = q.reshape(b, n, nkv, g, d).astype(f32) * d**-0.5
    s1 = jnp.einsum("brkgd,bjkd->bkgrj", qg, k1.astype(f32))
    s1 = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(n)[:, None], s1, -jnp.inf)
    kc = jnp.stack(k_chain, axis=1).astype(f32)  # [b, m, n, kv, d]
    sc = jnp.einsum("brkgd,bmrkd->bkgrm", qg, kc)
    p = jax.nn.softmax(jnp.concatenate([s1, sc], axis=-1), axis=-1)
    out = jnp.einsum("bkgrj,bjkd->brkgd", p[..., :n], v1.astype(f32))
    out = out + jnp.einsum("bkgrm,bmrkd->brkgd", p[..., n:], jnp.stack(v_chain, axis=1).astype(f32))
    return out.reshape(b, n, nq, d).astype(q.dtype)


def mtp_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """MTP cross-entropy (nats): position ``i``'s logits ``[batch, seq, vocab]`` against ``x_{i+2}``.

    ``targets`` int ``[batch, seq]`` are the next-token targets (``targets[:, i] = x_{i+1}``), so the MTP label
    of position ``i`` is ``targets[:, i + 1]``; the last position has none and is left out (no double shift:
    the same ``targets`` array feeds the next-token loss). Mean over ``batch * (seq - 1)`` positions.
    """
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), targets[:, 1:]).mean()


def mtp_distill_loss(logits: jax.Array, base_logits: jax.Array) -> jax.Array:
    """Self-distillation loss of the draft (nats): ``KL(p_{i+1} || q_i)`` averaged over ``batch * (seq - 1)``.

    ``logits`` ``[batch, seq, vocab]`` are the MTP logits (position ``i`` predicts ``x_{i+2}``), ``base_logits``
    ``[batch, seq, vocab]`` the base model's (position ``i + 1`` predicts the same ``x_{i+2}``). The target
    ``p_{i+1} = softmax(base_logits[:, i + 1])`` is held fixed (``stop_gradient``): the draft learns to agree
    with the model it drafts for, which is what speculative acceptance measures (DistillSpec, Zhou et al.
    2024; Medusa-2's self-distillation), instead of only with the corpus. Padding rows (``-inf`` logits in
    both) contribute nothing. The last position has no target and is left out.
    """
    return distill_kl(logits[:, :-1], base_logits[:, 1:]).mean()


def distill_kl(logits: jax.Array, base_logits: jax.Array) -> jax.Array:
    """Per-position ``KL(softmax(base_logits) || softmax(logits))`` (nats), float32 ``[...]``.

    The two logit arrays ``[..., vocab]`` are already aligned (row ``j`` of ``base_logits`` is the target of row
    ``j`` of ``logits``; :func:`mtp_distill_loss` does the shift); ``base_logits`` is held fixed
    (``stop_gradient``). Where the target probability is 0 (padding columns, underflow) the term is 0.
    """
    p_log = jax.nn.log_softmax(jax.lax.stop_gradient(base_logits).astype(jnp.float32), axis=-1)
    q_log = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(p_log)
    # where p == 0 (padding rows, underflow) the term is 0, even if q_log is -inf there
    live = p > 0
    return jnp.where(live, p * (jnp.where(live, p_log, 0.0) - jnp.where(live, q_log, 0.0)), 0.0).sum(-1)


def mtp_feature_loss(features: jax.Array, hidden: jax.Array) -> jax.Array:
    """EAGLE-1's feature regression: smooth-L1 between the MTP layer output ``o_i`` and ``h_{i+1}``.

    ``features`` ``[batch, seq, hidden]`` (:meth:`~minicpm4_jax.nn.model.MiniCPM4.mtp_features`), ``hidden``
    ``[batch, seq, hidden]`` the base final-norm states (held fixed, ``stop_gradient``). Chained drafting feeds
    ``o_i`` where the base would give ``h_{i+1}`` (module docstring), so this trains the stand-in to be one (Li et
    al. 2024, EAGLE §4.2: ``L_reg`` with Smooth L1, weight 1 against 0.1 for the token loss). Mean over elements
    of ``batch * (seq - 1)`` positions, float32.
    """
    import optax

    target = jax.lax.stop_gradient(hidden[:, 1:]).astype(jnp.float32)
    return optax.huber_loss(features[:, :-1].astype(jnp.float32), target, delta=1.0).mean()
