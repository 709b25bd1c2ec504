"""InfLLM v2 stage 2 in pure JAX/XLA (spec ``minicpm4_model.md`` §5.5), and a query-tiled dense attention.

The reference every InfLLM v2 kernel is tested against, and the fallback on any backend.

* :func:`infllmv2_stage2` (§5.5): one softmax attention of each query head over the union of the
  blocks its KV group selected (``topk_idx``, plus gen-1's in-kernel window), with token-level
  causality (``kv_position <= q_position``). Gradients flow to q, k, v.
* :func:`tiled_dense_attention`: the dense fallback computed by query tiles.

The full entry (dispatch, selection, stage 2) is :func:`minicpm4_jax.infllm.attention.infllmv2_attention`;
this module knows arrays only.

Memory design of stage 2 ("per-token block gather"): queries are processed in tiles of ``q_tile``
tokens under ``jax.lax.map``; for each (token, KV head) the ``K`` selected blocks are gathered as whole
``[block_size, head_dim]`` slabs from a block-major copy of K/V into ``[batch, kv_heads, q_tile, K,
block_size, head_dim]`` and the ``G`` query heads of the group attend them (``[batch, kv_heads, G,
q_tile, K, block_size]`` fp32 logits, one softmax over all selected keys). Peak memory is therefore
``O(q_tile * K * block_size * (kv_heads * head_dim + heads))`` per tile and the total gather traffic
``O(T * K * block_size * kv_heads * head_dim)``; nothing is ``[T, T]``. A per-tile *union* of
selections was rejected: neighbouring tokens pick different top-k blocks, so the union of a tile is
bounded only by NB and degenerates to dense. Each tile body is ``jax.checkpoint``-ed so the backward
pass re-gathers instead of saving every tile's gathered K/V (residuals stay ``O(T * heads * head_dim)``).
Measured (compiled memory analysis, 8B layout, T = 32768, fp32, gen-2 defaults, ``dense_len=-1``):
0.19 GiB temporaries for the forward (0.25 GiB forward+backward) vs 256 GiB (641 GiB) for :func:`dense_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.attention_ref import dense_attention

__all__ = ["infllmv2_stage2", "tiled_dense_attention"]


def _pad_axis(x: jax.Array, multiple: int, axis: int, value) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def _stage2_blocks(idx_t: jax.Array, pos_t: jax.Array, block_size: int, window_blocks: int) -> jax.Array:
    """Blocks one tile attends: ``[b, kv, tile, K (+ W)]`` int32, ``-1`` = none; no duplicates."""
    if not window_blocks:
        return idx_t
    qb = jnp.floor_divide(pos_t, block_size)  # [b, tile]
    win = qb[:, :, None] - window_blocks + 1 + jnp.arange(window_blocks, dtype=jnp.int32)  # [b, tile, W]
    win = jnp.where((win >= 0) & (pos_t >= 0)[:, :, None], win, -1)[:, None]  # [b, 1, tile, W]
    dup = jnp.any(idx_t[..., :, None] == win[..., None, :], axis=-2)  # [b, kv, tile, W]
    win = jnp.where(dup, -1, jnp.broadcast_to(win, dup.shape))
    return jnp.concatenate([idx_t, win], axis=-1)


def infllmv2_stage2(q: jax.Array, k: jax.Array, v: jax.Array, topk_idx: jax.Array, *, q_positions: jax.Array,
                    kv_positions: jax.Array, block_size: int, window_blocks: int = 0,
                    kv_valid: jax.Array | None = None, scale: float | None = None, q_tile: int = 8,
                    remat: bool = True) -> jax.Array:
    """Block-sparse attention over a given selection (§5.5), differentiable in q, k, v.

    Args:
        q: ``[batch, T, num_heads, head_dim]`` (post-RoPE), any float dtype.
        k, v: ``[batch, kv_len, num_kv_heads, head_dim]``; the kv index must equal the token position
            (block ``b`` = kv indices ``[b*block_size, (b+1)*block_size)``).
        topk_idx: int ``[batch, num_kv_heads, T, K]`` block ids, ``-1`` = unused; no id repeated in a row
            (:class:`~minicpm4_jax.infllm.select.Selection` format). Not differentiated.
        q_positions: int ``[batch, T]`` (``-1`` = padding row -> zero output).
        kv_positions: int ``[batch, kv_len]``; key ``s`` is visible iff ``kv_positions[s] <= q_position``.
        block_size: KV block size (64 for MiniCPM4).
        window_blocks: gen-1 in-kernel local window ``L``: also attend blocks
            ``max(0, q_blk - L + 1) .. q_blk`` not already in ``topk_idx``; 0 for gen-2.
        kv_valid: optional bool ``[batch, kv_len]`` (False = padding / unwritten cache slot).
        scale: softmax scale, default ``head_dim ** -0.5``.
        q_tile: query tokens per tile (clamped to T).
        remat: ``jax.checkpoint`` each tile so the backward re-gathers K/V instead of storing every
            tile's gathered copy (default). ``False`` only for tools that cannot trace ``checkpoint``
            (``checkify`` in jax 0.12 fails on it).

    Returns:
        ``[batch, T, num_heads, head_dim]`` in ``q.dtype``; fp32 logits/softmax; a row with no visible
        selected key returns zeros.

    Raises:
        ValueError: heads not a multiple of kv heads, or mismatched shapes.
    """
    b, t, nq, d = q.shape
    _, s, nkv, _ = k.shape
    if nq % nkv:
        raise ValueError(f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if topk_idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, T={t}, K]")
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    tile = max(1, min(q_tile, t))
    nb = -(-s // block_size)
    # block-major layout: one gather index fetches a whole [block_size, head_dim] slab
    kb = _pad_axis(k, block_size, 1, 0).reshape(b, nb, block_size, nkv, d).transpose(0, 3, 1, 2, 4)
    vb = _pad_axis(v, block_size, 1, 0).reshape(b, nb, block_size, nkv, d).transpose(0, 3, 1, 2, 4)
    valid_kv = jnp.ones((b, s), bool) if kv_valid is None else kv_valid.astype(bool)
    valid_kv = _pad_axis(valid_kv, block_size, 1, False).reshape(b, nb, block_size)
    kvpos = _pad_axis(kv_positions.astype(jnp.int32), block_size, 1, 0).reshape(b, nb, block_size)
    topk_idx = jax.lax.stop_gradient(topk_idx.astype(jnp.int32))

    qp = _pad_axis(q, tile, 1, 0)
    pp = _pad_axis(q_positions.astype(jnp.int32), tile, 1, -1)
    ip = _pad_axis(topk_idx, tile, 2, -1)
    n_tiles = qp.shape[1] // tile
    qp = qp.reshape(b, n_tiles, tile, nkv, g, d).swapaxes(0, 1)
    pp = pp.reshape(b, n_tiles, tile).swapaxes(0, 1)
    ip = ip.reshape(b, nkv, n_tiles, tile, -1).transpose(2, 0, 1, 3, 4)
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(nkv)[None, :, None, None]

    def one(kb, vb, q_t, pos_t, idx_t):
        blocks = _stage2_blocks(idx_t, pos_t, block_size, window_blocks)  # [b, nkv, tile, Kt]
        bidx = jnp.clip(blocks, 0, nb - 1)
        kg = kb[bi, hi, bidx]  # [b, nkv, tile, Kt, block, d]
        vg = vb[bi, hi, bidx]
        ok = ((blocks >= 0)[..., None] & valid_kv[bi, bidx]
              & (kvpos[bi, bidx] <= pos_t[:, None, :, None, None]))  # [b, nkv, tile, Kt, block]
        logits = jnp.einsum("btkgd,bktnjd->bkgtnj", q_t, kg, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(ok[:, :, None], logits, -jnp.inf)
        m = jnp.max(logits, axis=(-2, -1), keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        pr = jnp.exp(logits - m)
        den = jnp.sum(pr, axis=(-2, -1), keepdims=True)
        pr = pr / jnp.where(den == 0.0, 1.0, den)
        o = jnp.einsum("bkgtnj,bktnjd->btkgd", pr.astype(v.dtype), vg, preferred_element_type=jnp.float32)
        return o.astype(q.dtype)

    body = jax.checkpoint(one) if remat else one
    out = jax.lax.map(lambda a: body(kb, vb, *a), (qp, pp, ip))  # [n_tiles, b, tile, nkv, g, d]
    out = out.swapaxes(0, 1).reshape(b, n_tiles * tile, nq, d)[:, :t]
    return out


def tiled_dense_attention(q, k, v, *, q_positions, kv_positions, kv_valid=None, scale=None, q_tile=128):
    """``dense_attention`` run per query tile under ``lax.map`` (peak ``O(q_tile * kv_len * heads)``).

    Same arguments and result as :func:`~minicpm4_jax.ops.attention_ref.dense_attention` plus ``q_tile``.
    """
    b, t, nq, d = q.shape
    tile = max(1, min(q_tile, t))
    qp = _pad_axis(q, tile, 1, 0)
    pp = _pad_axis(q_positions.astype(jnp.int32), tile, 1, -1)
    n = qp.shape[1] // tile
    qp = qp.reshape(b, n, tile, nq, d).swapaxes(0, 1)
    pp = pp.reshape(b, n, tile).swapaxes(0, 1)
    out = jax.lax.map(lambda a: dense_attention(a[0], k, v, q_positions=a[1], kv_positions=kv_positions,
                                                kv_valid=kv_valid, scale=scale), (qp, pp))
    return out.swapaxes(0, 1).reshape(b, n * tile, nq, d)[:, :t]
