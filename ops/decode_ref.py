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


def _attend_rows(q: jax.Array, kg: jax.Array, vg: jax.Array, ok: jax.Array, scale: float) -> jax.Array:
    """q ``[rows, g, d]``, keys/values ``[rows, n, d]``, mask ``[rows, n]`` -> ``[rows, g, d]`` float32."""
    logits = jax.lax.dot_general(q, kg, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32) * scale
    logits = jnp.where(ok[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    den = jnp.sum(p, axis=-1, keepdims=True)
    acc = jax.lax.dot_general(p.astype(vg.dtype), vg, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return acc / jnp.where(den == 0.0, 1.0, den)


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
                            q_positions: jax.Array, block_size: int, window_blocks: int = 0,
                            scale: float | None = None) -> jax.Array:
    """InfLLM v2 stage 2 for one new token per sequence: attend only the selected cache blocks (§5.5).

    Each query head attends, over the keys of its KV head at positions ``<= q_position``, the union of the
    group's ``topk_idx`` blocks and (gen-1) the window ``max(0, q_blk - window_blocks + 1) .. q_blk``,
    ``q_blk = q_position // block_size``. Gen-2 passes ``window_blocks = 0`` (its window is in ``topk_idx``).

    Args:
        q: ``[batch, num_heads, head_dim]`` post-RoPE query.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]``; ``capacity`` a multiple of
            ``block_size``.
        topk_idx: int ``[batch, num_kv_heads, K]`` block ids, ``-1`` unused, no id repeated
            (:class:`~minicpm4_jax.infllm.select.Selection` format with ``T`` squeezed).
        q_positions: int ``[batch]`` (``-1`` = inactive row -> zeros).
        block_size: KV block size.
        window_blocks: gen-1 in-kernel local window in blocks; 0 for gen-2.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[batch, num_heads, head_dim]`` in ``q.dtype``: equal (fp32 softmax, up to summation order) to
        :func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2` on the same selection. Reads
        ``(K + window_blocks) * block_size`` keys and values per (sequence, KV head).

    Raises:
        ValueError: mismatched shapes, a capacity that is not a multiple of ``block_size``.
    """
    b, nq, d, nkv, s = _check(q, k_cache, v_cache)
    if s % block_size:
        raise ValueError(f"cache capacity {s} is not a multiple of block_size={block_size}")
    if topk_idx.ndim != 3 or topk_idx.shape[:2] != (b, nkv):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, K]")
    g = nq // nkv
    nb = s // block_size
    scale = d**-0.5 if scale is None else scale
    pos = q_positions.astype(jnp.int32)
    idx = topk_idx.astype(jnp.int32)
    if window_blocks:
        qb = jnp.floor_divide(pos, block_size)[:, None, None]
        in_win = (idx > qb - window_blocks) & (idx <= qb)
        idx = jnp.where(in_win, -1, idx)  # counted once, in the window columns
        win = qb - window_blocks + 1 + jnp.arange(window_blocks, dtype=jnp.int32)[None, None, :]
        win = jnp.broadcast_to(jnp.where(win >= 0, win, -1), (b, nkv, window_blocks))
        idx = jnp.concatenate([idx, win], axis=-1)
    w = idx.shape[-1]
    safe = jnp.clip(idx, 0, nb - 1)
    base = (jnp.arange(b)[:, None] * nkv + jnp.arange(nkv)[None, :]) * nb  # [b, kv]
    rows = (base[:, :, None] + safe).reshape(-1)
    kg = jnp.take(k_cache.reshape(b * nkv * nb, block_size * d), rows, axis=0).reshape(b * nkv, w * block_size, d)
    vg = jnp.take(v_cache.reshape(b * nkv * nb, block_size * d), rows, axis=0).reshape(b * nkv, w * block_size, d)
    key_pos = safe[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)  # [b, kv, w, block]
    ok = (idx >= 0)[..., None] & (key_pos <= pos[:, None, None, None])
    out = _attend_rows(q.reshape(b * nkv, g, d), kg, vg, ok.reshape(b * nkv, w * block_size), scale)
    return out.reshape(b, nq, d).astype(q.dtype)
