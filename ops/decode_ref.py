"""Single-token decode attention over a KV cache in pure JAX/XLA: dense and InfLLM v2 block-sparse.

Spec ``minicpm4_model.md`` §5.5 (stage 2 ``..._with_kvcache``: one new query token per sequence, the
selected blocks only, ``causal=False`` which equals causality for the last token) and §5.7 (cache layout).
The reference the Pallas decode kernel is tested against, and the fallback on any backend.

Cache layout (KV-head major, the layout a block gather wants): ``k_cache``/``v_cache``
``[batch, num_kv_heads, capacity, head_dim]``, slot index = token position, a sequence's keys in slots
``[0, length)``; slots at or beyond its length may hold anything (they are masked). A block ``j`` of KV head
``h`` is the contiguous slab ``[j * block_size, (j + 1) * block_size)`` of row ``(b, h)``, so the sparse path
gathers whole ``[block_size * head_dim]`` rows of the cache reshaped (free) to
``[batch * num_kv_heads * num_blocks, block_size * head_dim]``: each step reads only the selected blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.infllm_ref import _merge, compact_topk  # one online-softmax merge for every stage 2

__all__ = ["dense_decode_attention", "sparse_decode_attention"]


def _check(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> tuple[int, int, int, int, int]:
    b, nq, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"shape mismatch: q {q.shape} [batch, heads, head_dim], k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape} [batch, kv_heads, capacity, head_dim]")
    nkv, s = k_cache.shape[1], k_cache.shape[2]
    if nq % nkv:
        raise ValueError(f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    return b, nq, d, nkv, s


def _softmax_state(q: jax.Array, kg: jax.Array, vg: jax.Array, ok: jax.Array, scale: float):
    """``(max, sum, unnormalised output)`` of q ``[rows, g, d]`` over keys/values ``[rows, n, d]``, mask ``[rows, n]``."""
    logits = jax.lax.dot_general(q, kg, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32) * scale
    logits = jnp.where(ok[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    ms = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - ms)
    acc = jax.lax.dot_general(p.astype(vg.dtype), vg, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1, keepdims=True), acc


def _attend_rows(q: jax.Array, kg: jax.Array, vg: jax.Array, ok: jax.Array, scale: float) -> jax.Array:
    """q ``[rows, g, d]``, keys/values ``[rows, n, d]``, mask ``[rows, n]`` -> ``[rows, g, d]`` float32."""
    _, l, acc = _softmax_state(q, kg, vg, ok, scale)
    return acc / jnp.where(l == 0.0, 1.0, l)


def dense_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, q_positions: jax.Array,
                           scale: float | None = None) -> jax.Array:
    """Dense GQA attention of one new token per sequence over its cached keys.

    Args:
        q: ``[batch, num_heads, head_dim]`` post-RoPE query of the token at ``q_positions``.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]`` (the new token already written).
        q_positions: int ``[batch]``; keys in slots ``0 .. q_position`` are attended; ``-1`` = an inactive row
            (zeros out).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[batch, num_heads, head_dim]`` in ``q.dtype`` (fp32 softmax).

    Raises:
        ValueError: mismatched shapes or heads not a multiple of kv heads.
    """
    b, nq, d, nkv, s = _check(q, k_cache, v_cache)
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    ok = jnp.arange(s, dtype=jnp.int32)[None, :] <= q_positions.astype(jnp.int32)[:, None]  # [b, s]
    ok = jnp.broadcast_to(ok[:, None, :], (b, nkv, s)).reshape(b * nkv, s)
    out = _attend_rows(q.reshape(b * nkv, g, d), k_cache.reshape(b * nkv, s, d), v_cache.reshape(b * nkv, s, d),
                       ok, scale)
    return out.reshape(b, nq, d).astype(q.dtype)


def sparse_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, topk_idx: jax.Array, *,
                            q_positions: jax.Array, block_size: int, window_blocks: int = 0, init_blocks: int = 0,
                            gather_width: int | None = None, scale: float | None = None) -> jax.Array:
    """InfLLM v2 stage 2 for one new token per sequence: attend only the selected cache blocks (§5.5).

    Each query head attends, over the keys of its KV head at positions ``<= q_position``, the union of the
    group's ``topk_idx`` blocks, the blocks ``0 .. init_blocks - 1`` and the window
    ``max(0, q_blk - window_blocks + 1) .. q_blk`` (``q_blk = q_position // block_size``): the same set as
    :func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2` with the same arguments. Gen-1 passes its in-kernel
    window; gen-2 may pass its forced blocks (already in ``topk_idx``) as ``init_blocks`` / ``window_blocks``
    (:func:`~minicpm4_jax.infllm.attention.stage2_forced_split`), which does not change the result.

    The window and init blocks are read as contiguous slices of the cache; only the other picks (compacted
    into ``gather_width`` columns) are gathered, as whole ``[block_size * head_dim]`` rows.

    Args:
        q: ``[batch, num_heads, head_dim]`` post-RoPE query.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]``; ``capacity`` a multiple of
            ``block_size`` and at least ``(window_blocks + init_blocks) * block_size``.
        topk_idx: int ``[batch, num_kv_heads, K]`` block ids, ``-1`` unused, no id repeated
            (:class:`~minicpm4_jax.infllm.select.Selection` format with ``T`` squeezed).
        q_positions: int ``[batch]`` (``-1`` = inactive row -> zeros).
        block_size: KV block size.
        window_blocks, init_blocks: forced blocks (see above); 0 = none.
        gather_width: columns kept for the picks outside the forced blocks; default ``K`` (never drops one).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[batch, num_heads, head_dim]`` in ``q.dtype`` (fp32 softmax). Reads
        ``(gather_width + window_blocks + init_blocks) * block_size`` keys and values per (sequence, KV head).

    Raises:
        ValueError: mismatched shapes, a capacity that is not a multiple of ``block_size`` or too small.
    """
    b, nq, d, nkv, s = _check(q, k_cache, v_cache)
    if s % block_size:
        raise ValueError(f"cache capacity {s} is not a multiple of block_size={block_size}")
    if topk_idx.ndim != 3 or topk_idx.shape[:2] != (b, nkv):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, K]")
    nb = s // block_size
    if window_blocks + init_blocks > nb:
        raise ValueError(f"window_blocks={window_blocks} + init_blocks={init_blocks} exceed the cache's {nb} blocks")
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    pos = q_positions.astype(jnp.int32)
    qb = jnp.floor_divide(pos, block_size)  # [b]
    width = topk_idx.shape[-1] if gather_width is None else gather_width
    idx = topk_idx.astype(jnp.int32)
    if window_blocks or init_blocks or width < idx.shape[-1]:
        idx = compact_topk(idx[:, :, None], pos[:, None], block_size=block_size, init_blocks=init_blocks,
                           window_blocks=window_blocks, width=width)[:, :, 0]
    parts_k, parts_v, parts_ok = [], [], []
    if init_blocks:
        n = init_blocks * block_size
        kp = jnp.arange(n, dtype=jnp.int32)
        parts_k.append(k_cache[:, :, :n])
        parts_v.append(v_cache[:, :, :n])
        parts_ok.append(jnp.broadcast_to((kp[None, :] <= pos[:, None])[:, None], (b, nkv, n)))
    if window_blocks:
        n = window_blocks * block_size
        start = jnp.clip((qb - window_blocks + 1) * block_size, 0, s - n)  # [b]
        parts_k.append(jax.vmap(lambda x, st: jax.lax.dynamic_slice_in_dim(x, st, n, axis=1))(k_cache, start))
        parts_v.append(jax.vmap(lambda x, st: jax.lax.dynamic_slice_in_dim(x, st, n, axis=1))(v_cache, start))
        kp = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]  # [b, n]
        kb = jnp.floor_divide(kp, block_size)
        ok = (kb > qb[:, None] - window_blocks) & (kp <= pos[:, None]) & (kb >= init_blocks)
        parts_ok.append(jnp.broadcast_to(ok[:, None], (b, nkv, n)))
    if width:
        safe = jnp.clip(idx, 0, nb - 1)
        base = (jnp.arange(b)[:, None] * nkv + jnp.arange(nkv)[None, :]) * nb  # [b, kv]
        rows = (base[:, :, None] + safe).reshape(-1)
        kf = k_cache.reshape(b * nkv * nb, block_size * d)
        vf = v_cache.reshape(b * nkv * nb, block_size * d)
        parts_k.append(jnp.take(kf, rows, axis=0, mode="clip").reshape(b, nkv, width * block_size, d))
        parts_v.append(jnp.take(vf, rows, axis=0, mode="clip").reshape(b, nkv, width * block_size, d))
        key_pos = safe[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)  # [b, kv, w, block]
        ok = (idx >= 0)[..., None] & (key_pos <= pos[:, None, None, None])
        parts_ok.append(ok.reshape(b, nkv, width * block_size))
    if not parts_k:
        return jnp.zeros_like(q)
    # one softmax state per part, merged (no concatenation: it would copy every key and value once more)
    qr = q.reshape(b * nkv, g, d)
    state = None
    for kp_, vp_, okp in zip(parts_k, parts_v, parts_ok):
        n = kp_.shape[2]
        st = _softmax_state(qr, kp_.reshape(b * nkv, n, d), vp_.reshape(b * nkv, n, d), okp.reshape(b * nkv, n), scale)
        state = st if state is None else _merge(state, st)
    _, l, acc = state
    out = acc / jnp.where(l == 0.0, 1.0, l)
    return out.reshape(b, nq, d).astype(q.dtype)
