"""The MiniCPM4 decoder (Flax NNX, used functionally).

Dense forward exactly as spec ``minicpm4_model.md`` §2:

1. ``x = embed_tokens[ids] * scale_emb``
2. per layer: ``x += attn(RMSNorm(x)) * scale_depth/sqrt(L)``; ``x += mlp(RMSNorm(x)) * scale_depth/sqrt(L)``
   (pre-RMSNorm, GQA, LongRoPE, SwiGLU, no biases)
3. ``x = RMSNorm_final(x)``
4. ``logits = lm_head(x / (hidden_size / dim_model_base))`` in float32 (tied: the embedding table).

Parameters are float32 with logical axis names; activations run in ``cfg.dtype``. The decoder
layers are one stacked module (leading ``layers`` axis) run with ``jax.lax.scan`` (or a Python
loop over the same stacked parameters when ``scan_layers`` is false), with an optional
rematerialisation policy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm4_jax.config import ModelConfig
from minicpm4_jax.nn.attention import attend
from minicpm4_jax.nn.layers import dtype_of, hidden_init_std, param, rms_norm, swiglu
from minicpm4_jax.nn.rope import apply_rope, rope_tables
from minicpm4_jax.sharding import embedding_lookup

__all__ = ["Embedder", "DecoderLayer", "MiniCPM4", "head_logits", "remat_policy"]


def _dense(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``x`` ``[..., in]`` @ ``w`` ``[in, out]`` as one 2-D matmul over the flattened tokens.

    Flattening the leading axes keeps every matmul (and its weight gradient) a plain 2-D GEMM; a
    contraction over two batch axes runs several times slower in XLA's CPU backward.
    """
    lead = x.shape[:-1]
    y = jnp.dot(x.reshape(-1, x.shape[-1]), w, preferred_element_type=out_dtype)
    return y.reshape(*lead, w.shape[-1])


def dense_rows(x: jax.Array, rows: jax.Array, out_dtype=None) -> jax.Array:
    """``x`` ``[..., in]`` against a row-major weight ``rows`` ``[out, in]`` (e.g. the tied embedding): ``[..., out]``.

    One ``dot_general`` contracting both ``in`` axes: ``x @ rows.T`` made XLA:CPU copy the transposed weight on
    every call (the 8 MiB cpu_tiny embedding: 1.4 ms of a ~3 ms decode step, 0.34 ms without the copy).
    """
    lead = x.shape[:-1]
    y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), rows, (((1,), (1,)), ((), ())),
                            preferred_element_type=out_dtype)
    return y.reshape(*lead, rows.shape[0])


def zero_vocab_padding(p: nnx.Param, cfg: ModelConfig, axis: int) -> None:
    """Set the vocabulary-padding rows (``axis``) of an embedding/head parameter to zero, in place."""
    if cfg.padded_vocab_size > cfg.vocab_size:
        idx = [slice(None)] * p[...].ndim
        idx[axis] = slice(cfg.vocab_size, None)
        p[...] = p[...].at[tuple(idx)].set(0)


class Embedder(nnx.Module):
    """Token embedding ``[padded_vocab, hidden]`` with ``encode`` (lookup) and ``attend`` (logits).

    One table serves both directions when the head is tied (no shared Variables).
    Init N(0, initializer_range) (μP: embeddings at the plain init_std, spec §3.2).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = param(rngs, (cfg.padded_vocab_size, cfg.hidden_size), cfg.initializer_range,
                               ("vocab", "embed"), dtype_of(cfg.param_dtype))
        zero_vocab_padding(self.embedding, cfg, axis=0)

    def encode(self, ids: jax.Array, dtype, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
        """``ids`` int ``[batch, seq]`` -> ``[batch, seq, hidden]`` in ``dtype`` (unscaled).

        ``mesh``: the training mesh; the lookup then runs as :func:`minicpm4_jax.sharding.embedding_lookup`
        (explicit collectives, output batch-sharded over ``(data, fsdp)``).
        """
        if mesh is not None:
            return embedding_lookup(self.embedding[...], ids, mesh, dtype)
        return jnp.take(self.embedding[...], ids, axis=0).astype(dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """``x`` ``[batch, seq, hidden]`` -> float32 logits ``[batch, seq, vocab]``."""
        return dense_rows(x, self.embedding[...], out_dtype=jnp.float32)


class DecoderLayer(nnx.Module):
    """One pre-RMSNorm decoder layer: GQA attention with LongRoPE, then a SwiGLU MLP.

    Weights (Flax layout, ``y = x @ W``): ``q_proj`` ``[hidden, heads, head_dim]``, ``k_proj``/``v_proj``
    ``[hidden, kv_heads, head_dim]``, ``o_proj`` ``[heads, head_dim, hidden]``, ``gate_proj``/``up_proj``
    ``[hidden, intermediate]``, ``down_proj`` ``[intermediate, hidden]``, norms ``[hidden]``.
    Hidden matrices init N(0, initializer_range/sqrt(width_mult)) (μP, spec §3.2).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, d, f = cfg.hidden_size, cfg.resolved_head_dim, cfg.intermediate_size
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        std = hidden_init_std(cfg)
        pd = dtype_of(cfg.param_dtype)
        self.input_layernorm = param(None, (h,), None, ("norm",), pd)
        self.q_proj = param(rngs, (h, nq, d), std, ("embed", "q_heads", "head_dim"), pd)
        self.k_proj = param(rngs, (h, nkv, d), std, ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = param(rngs, (h, nkv, d), std, ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = param(rngs, (nq, d, h), std, ("q_heads", "head_dim", "embed"), pd)
        self.post_attention_layernorm = param(None, (h,), None, ("norm",), pd)
        self.gate_proj = param(rngs, (h, f), std, ("embed", "mlp"), pd)
        self.up_proj = param(rngs, (h, f), std, ("embed", "mlp"), pd)
        self.down_proj = param(rngs, (f, h), std, ("mlp", "embed"), pd)

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
        """Attention inputs of this layer from the residual stream ``x`` ``[batch, seq, hidden]``.

        Returns:
            ``(q, k, v, q_nope, k_nope)``: ``q`` ``[batch, seq, heads, head_dim]`` and ``k``/``v``
            ``[batch, seq, kv_heads, head_dim]`` (q, k after RoPE), and q/k before RoPE.
        """
        dt = x.dtype
        b, t, _ = x.shape
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim
        hs = rms_norm(x, self.input_layernorm[...], cfg.rms_norm_eps)
        q = _dense(hs, self.q_proj[...].reshape(-1, nq * d).astype(dt)).reshape(b, t, nq, d)
        k = _dense(hs, self.k_proj[...].reshape(-1, nkv * d).astype(dt)).reshape(b, t, nkv, d)
        v = _dense(hs, self.v_proj[...].reshape(-1, nkv * d).astype(dt)).reshape(b, t, nkv, d)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, q, k

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                 cfg: ModelConfig, return_stats: bool = False) -> jax.Array | tuple[jax.Array, dict]:
        """``x`` ``[batch, seq, hidden]`` (compute dtype) -> same shape (and the attention stats if asked)."""
        q, k, v, q_nope, k_nope = self.qkv(x, cos, sin, cfg)
        a = attend(q, k, v, q_positions=positions, kv_positions=positions, cfg=cfg, q_nope=q_nope, k_nope=k_nope,
                   return_stats=return_stats)
        stats = None
        if return_stats:
            a, stats = a
        x = self.finish(x, a, cfg)
        return (x, stats) if return_stats else x

    def finish(self, x: jax.Array, a: jax.Array, cfg: ModelConfig) -> jax.Array:
        """The rest of the layer after attention: ``o_proj`` + scaled residual, then the SwiGLU MLP block.

        Args:
            x: residual stream ``[batch, seq, hidden]`` (compute dtype) that entered the layer.
            a: attention output ``[batch, seq, heads, head_dim]``.

        Returns:
            ``[batch, seq, hidden]``, the layer's output.
        """
        dt = x.dtype
        b, t, _ = x.shape
        nq, d = cfg.num_attention_heads, cfg.resolved_head_dim
        res = jnp.asarray(cfg.residual_scale, dt)
        a = _dense(a.reshape(b, t, nq * d), self.o_proj[...].reshape(nq * d, -1).astype(dt))
        x = x + a * res
        hs = rms_norm(x, self.post_attention_layernorm[...], cfg.rms_norm_eps)
        g = _dense(hs, self.gate_proj[...].astype(dt))
        u = _dense(hs, self.up_proj[...].astype(dt))
        m = _dense(swiglu(g, u), self.down_proj[...].astype(dt))
        return x + m * res


def head_logits(hidden: jax.Array, cfg: ModelConfig, embed_tokens: Embedder, lm_head: jax.Array | None) -> jax.Array:
    """float32 logits ``[..., vocab]`` of final-norm hidden states ``[..., hidden]`` (spec §2 step 4).

    ``hidden / (hidden_size / dim_model_base)``, then the tied embedding (``lm_head`` ``None``) or
    ``lm_head`` ``[hidden, vocab]``. With vocabulary padding (``vocab_pad_multiple``) the last axis is
    ``padded_vocab_size`` and the padding columns are ``-inf``.
    """
    x = hidden / jnp.asarray(cfg.width_mult, hidden.dtype)
    if lm_head is None:
        logits = embed_tokens.attend(x)
    else:
        logits = _dense(x, lm_head.astype(x.dtype), out_dtype=jnp.float32)
    if cfg.padded_vocab_size > cfg.vocab_size:  # vocabulary padding: never predicted, out of every softmax
        logits = jnp.where(jnp.arange(logits.shape[-1]) < cfg.vocab_size, logits, -jnp.inf)
    return logits


def remat_policy(name: str):
    """``none`` -> no remat; ``full`` -> save nothing; ``dots`` -> save matmul outputs without batch dims."""
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return None


class MiniCPM4(nnx.Module):
    """MiniCPM4 causal LM.

    Attributes:
        embed_tokens: :class:`Embedder` ``[vocab, hidden]``.
        layers: stacked :class:`DecoderLayer` (every Param has a leading ``[num_hidden_layers]`` axis).
        norm: final RMSNorm weight ``[hidden]``.
        lm_head: ``[hidden, vocab]`` when ``tie_word_embeddings`` is false (else absent).
        mtp: :class:`~minicpm4_jax.nn.mtp.MTPHead` when ``cfg.mtp`` (else absent).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = Embedder(cfg, rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(r: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, rngs=r)

        self.layers = make_layers(rngs)
        self.norm = param(None, (cfg.hidden_size,), None, ("norm",), dtype_of(cfg.param_dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.padded_vocab_size), cfg.initializer_range,
                                 ("embed", "vocab"), dtype_of(cfg.param_dtype))
            zero_vocab_padding(self.lm_head, cfg, axis=1)
        if cfg.mtp:
            from minicpm4_jax.nn.mtp import MTPHead

            self.mtp = MTPHead(cfg, rngs=rngs)

    def _embed(self, input_ids: jax.Array, positions: jax.Array | None,
               activation_sharding: jax.sharding.NamedSharding | None = None) -> tuple[jax.Array, ...]:
        """Scaled embeddings ``[batch, seq, hidden]``, positions (default ``arange``) and RoPE tables.

        ``activation_sharding``: under a training mesh, the residual stream's sharding; the lookup then runs as
        :func:`minicpm4_jax.sharding.embedding_lookup` on its mesh."""
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mesh = None if activation_sharding is None else activation_sharding.mesh
        x = self.embed_tokens.encode(input_ids, dt, mesh) * jnp.asarray(cfg.scale_emb, dt)
        cos, sin = rope_tables(positions, cfg)
        return x, positions, cos, sin

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                      return_stats: bool = False, activation_sharding: jax.sharding.NamedSharding | None = None
                      ) -> jax.Array | tuple[jax.Array, dict]:
        """Final-norm output ``[batch, seq, hidden]`` (compute dtype), before the ÷width_mult.

        Args:
            input_ids: int32 ``[batch, seq]``.
            positions: int32 ``[batch, seq]``; default ``arange(seq)`` per row. They drive RoPE **and** the
                causal mask (a key is visible when its position is <= the query's), so they must increase along
                each row: positions that restart inside a row (documents packed with their own positions) let a
                token see later tokens of the row (helper 68; HF masks by index). There is no per-document mask:
                this project packs documents with EOS separators and ``arange`` positions. With ``attention: infllmv2``
                they must be the token index (``arange``; right padding may follow): InfLLM v2 compresses and
                selects the keys by index (spec §5; ``infllm.attention.infllmv2_attention``'s contract), so
                positions starting elsewhere let the selection of a token depend on later tokens (the XLA and
                native paths alike). Continue a sequence through the inference engine's KV cache instead.
            return_stats: also return ``{"attended_fraction": float32 scalar}``, the mean over layers of
                attended / causal keys per query (InfLLM v2; 1 for dense attention).
            activation_sharding: under a training mesh, the residual stream's sharding
                (``train.step.activation_sharding``): the embedding lookup runs on its mesh with explicit
                collectives (:func:`minicpm4_jax.sharding.embedding_lookup`).
        """
        cfg = self.cfg
        x, positions, cos, sin = self._embed(input_ids, positions, activation_sharding)
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry: jax.Array, state) -> tuple[jax.Array, Any]:
            layer = nnx.merge(graphdef, state)
            if return_stats:
                return layer(carry, cos, sin, positions, cfg, return_stats=True)
            return layer(carry, cos, sin, positions, cfg), None

        policy = remat_policy(cfg.remat)
        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=policy)
        if cfg.scan_layers:
            x, per_layer = jax.lax.scan(body, x, layer_state)
        else:
            outs = []
            for i in range(cfg.num_hidden_layers):
                x, st = body(x, jax.tree.map(lambda a, i=i: a[i], layer_state))
                outs.append(st)
            per_layer = jax.tree.map(lambda *a: jnp.stack(a), *outs) if return_stats else None
        h = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
        if return_stats:
            return h, jax.tree.map(lambda a: jnp.mean(a.astype(jnp.float32)), per_layer)
        return h

    def layer_attention_inputs(self, input_ids: jax.Array, layer: int,
                               positions: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """``(q, k, v, q_nope, k_nope)`` of decoder layer ``layer`` (0-based) for ``input_ids`` ``[batch, seq]``.

        Runs layers ``0 .. layer-1`` and returns what :meth:`DecoderLayer.qkv` gives layer ``layer``
        (e.g. to look at its InfLLM v2 selection).

        Raises:
            ValueError: ``layer`` outside ``[0, num_hidden_layers)``.
        """
        cfg = self.cfg
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"layer={layer} is outside [0, {cfg.num_hidden_layers}) for this model")
        x, positions, cos, sin = self._embed(input_ids, positions)
        graphdef, layer_state = nnx.split(self.layers)
        for i in range(layer + 1):
            one = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], layer_state))
            if i == layer:
                return one.qkv(x, cos, sin, cfg)
            x = one(x, cos, sin, positions, cfg)
        raise AssertionError("unreachable")

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits ``[batch, seq, vocab]`` from final-norm hidden states (÷ width_mult first)."""
        return head_logits(hidden, self.cfg, self.embed_tokens, None if self.cfg.tie_word_embeddings else self.lm_head[...])

    def mtp_logits(self, hidden: jax.Array, next_ids: jax.Array, positions: jax.Array | None = None,
                   activation_sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        """float32 MTP logits ``[batch, seq, vocab]``: position ``i`` predicts ``x_{i+2}`` (spec §3.4).

        The base model's head applied to :meth:`mtp_features` (same arguments and errors).
        """
        return self.logits(self.mtp_features(hidden, next_ids, positions, activation_sharding))

    def mtp_features(self, hidden: jax.Array, next_ids: jax.Array, positions: jax.Array | None = None,
                     activation_sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        """The MTP layer output ``o`` ``[batch, seq, hidden]`` (before the head; spec §3.4/§7).

        Args:
            hidden: :meth:`hidden_states` output ``[batch, seq, hidden]``.
            next_ids: int ``[batch, seq]`` the tokens ``x_{i+1}`` (the next-token targets).
            positions: int32 ``[batch, seq]``; default ``arange(seq)``.
            activation_sharding: under a mesh, the residual stream's sharding
                (``train.step.activation_sharding``): the MTP module's embedding lookup is constrained to it.
                Without it XLA gives the lookup's output the table's ``embed``-on-``fsdp`` sharding and later
                replicates the whole ``[batch, seq, hidden]`` tensor to reshard it ("involuntary full
                rematerialization").

        Raises:
            ValueError: the model was built without ``mtp``.
        """
        emb, positions = self._mtp_inputs(hidden, next_ids, positions, activation_sharding)
        return self.mtp(hidden, emb, positions, self.cfg)

    def mtp_unrolled(self, hidden: jax.Array, next_ids: jax.Array, depth: int, positions: jax.Array | None = None,
                     activation_sharding: jax.sharding.Sharding | None = None) -> list[jax.Array]:
        """The MTP layer outputs of chain depths ``1 .. depth`` (:meth:`~minicpm4_jax.nn.mtp.MTPHead.unrolled`).

        Arguments and errors as :meth:`mtp_features`; depth ``d``'s output is ``[batch, seq - d + 1, hidden]``
        (positions ``d - 1 ..``). Also raises ValueError for ``depth`` outside ``[1, seq)``.
        """
        emb, positions = self._mtp_inputs(hidden, next_ids, positions, activation_sharding)
        return self.mtp.unrolled(hidden, emb, positions, self.cfg, depth, activation_sharding)

    def _mtp_inputs(self, hidden, next_ids, positions, activation_sharding):
        cfg = self.cfg
        if not cfg.mtp:
            raise ValueError("this model has no MTP module; set model.mtp=true")
        b, t = next_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        dt = hidden.dtype
        mesh = None if activation_sharding is None else activation_sharding.mesh
        emb = self.embed_tokens.encode(next_ids, dt, mesh) * jnp.asarray(cfg.scale_emb, dt)
        if activation_sharding is not None:
            emb = jax.lax.with_sharding_constraint(emb, activation_sharding)
        return emb, positions

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``input_ids`` int32 ``[batch, seq]`` -> float32 logits ``[batch, seq, vocab]``."""
        return self.logits(self.hidden_states(input_ids, positions))
