"""InfLLM v2 stage 2 in pure JAX/XLA (spec ``minicpm4_model.md`` §5.5), and a query-tiled dense attention.

The reference every InfLLM v2 kernel is tested against, and the fallback on any backend.

* :func:`infllmv2_stage2` (§5.5): one softmax attention of each query head over the union of the
  blocks its KV group selected (``topk_idx``, plus gen-1's in-kernel window), with token-level
  causality (``kv_position <= q_position``). Gradients flow to q, k, v.
* :func:`tiled_dense_attention`: the dense fallback computed by query tiles.

The full entry (dispatch, selection, stage 2) is :func:`minicpm4_jax.infllm.attention.infllmv2_attention`;
this module knows arrays only.

Memory design of stage 2 ("per-token block gather"): queries are processed in tiles of ``q_tile`` tokens
under ``jax.lax.map``. K and V are laid out once as a 2-D block-major array, one row per (batch, KV
head, block) holding the contiguous ``[block_size * head_dim]`` slab, so each tile fetches its ``K``
selected blocks per (token, KV head) with a single 1-D ``jnp.take`` along rows (the fastest gather form
on XLA:CPU; a 3-D ``take`` of ``[block, d]`` slabs ran at half its speed in a micro-benchmark) into
``[batch, kv_heads, q_tile, K * block_size, head_dim]``. The ``G`` query heads of a group share the
selection, so per (token, KV head) the logits are one ``[G, d] x [d, K * block_size]`` product; all
products of a tile are a single batched dot with the batch dims (batch, kv head, token) leading in the
gathered K/V and the logits (only the tile's small q and output are transposed; q itself is never copied
for batch 1). Validity and causality come from one gathered int per key (its position, or ``int32 max``
when invalid); the softmax is normalised on the ``[G, d]`` output instead of the ``[G, K * block_size]``
weights. Peak memory is ``O(q_tile * K * block_size * (kv_heads * head_dim + heads))`` per tile and the
gather traffic ``O(T * K * block_size * kv_heads * head_dim)``; nothing is ``[T, T]``. Small tiles keep
a tile's gathered K/V near the cache: at 8K (8B layout, fp32) stage 2 took 26.5 s with 2-token tiles vs
32.2 s with 8. A per-tile *union* of selections was rejected: neighbouring tokens pick different top-k
blocks, so the union of a tile is bounded only by NB and degenerates to dense. Each tile body is
``jax.checkpoint``-ed so the backward pass re-gathers instead of saving every tile's gathered K/V
(residuals stay ``O(T * heads * head_dim)``). On CPU this design is bound by the gather (memory
bandwidth: ~64 KiB of fp32 K/V copied per (token, KV head, block)); ``scripts/bench_attention.py``
measures it against a tiled causal dense attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.attention_ref import check_qkv, dense_attention
from minicpm4_jax.ops.tiling import pad_axis, query_tiles

__all__ = ["infllmv2_stage2", "tiled_dense_attention"]


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
                    kv_valid: jax.Array | None = None, scale: float | None = None, q_tile: int = 2,
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
        q_tile: query tokens per tile (clamped to T). Small tiles keep each tile's gathered K/V
            (``2 * q_tile * kv_heads * K * block_size * head_dim`` elements) near the cache (2-token tiles
            beat 8-token tiles by ~20% at 8K on the 2-core CPU).
        remat: ``jax.checkpoint`` each tile so the backward re-gathers K/V instead of storing every
            tile's gathered copy (default). ``False`` only for tools that cannot trace ``checkpoint``
            (``checkify`` in jax 0.12 fails on it).

    Returns:
        ``[batch, T, num_heads, head_dim]`` in ``q.dtype``; fp32 logits/softmax; a row with no visible
        selected key returns zeros.

    Raises:
        ValueError: heads not a multiple of kv heads, or mismatched shapes.
    """
    b, t, nq, d, s, nkv = check_qkv(q, k, v)
    if topk_idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, T={t}, K]")
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    tile = max(1, min(q_tile, t))
    nb = -(-s // block_size)
    rows = block_size * d

    # Block-major 2-D layout, row (batch, kv head, block) = one contiguous [block_size * head_dim] slab:
    # a 1-D ``jnp.take`` along axis 0 (the fastest XLA:CPU gather form) fetches a whole block.
    def slabs(x):
        x = pad_axis(x, block_size, 1, 0).reshape(b, nb, block_size, nkv, d).transpose(0, 3, 1, 2, 4)
        return x.reshape(b * nkv * nb, rows)

    kf, vf = slabs(k), slabs(v)
    # one int per key: its position, or a huge value if the key is padding / invalid (never visible)
    big = jnp.iinfo(jnp.int32).max
    kvp = kv_positions.astype(jnp.int32)
    if kv_valid is not None:
        kvp = jnp.where(kv_valid.astype(bool), kvp, big)
    kvp = pad_axis(kvp, block_size, 1, big).reshape(b * nb, block_size)
    topk_idx = jax.lax.stop_gradient(topk_idx.astype(jnp.int32))

    qp, pp = query_tiles(q, q_positions, tile)  # [n, b, tile, heads, d]: no copy of q for b=1
    n_tiles = qp.shape[0]
    qp = qp.reshape(n_tiles, b, tile, nkv, g, d)
    ip = pad_axis(topk_idx, tile, 2, -1).reshape(b, nkv, n_tiles, tile, -1).transpose(2, 0, 1, 3, 4)  # [n, b, kv, tile, K]
    base_kv = (jnp.arange(b)[:, None] * nkv + jnp.arange(nkv)[None, :]) * nb  # [b, kv]
    base_pos = jnp.arange(b) * nb

    def one(kf, vf, q_t, pos_t, idx_t):
        blocks = _stage2_blocks(idx_t, pos_t, block_size, window_blocks)  # [b, kv, tile, Kt]
        kt = blocks.shape[-1]
        bidx = jnp.clip(blocks, 0, nb - 1)
        flat = (base_kv[:, :, None, None] + bidx).reshape(-1)
        kg = jnp.take(kf, flat, axis=0).reshape(b, nkv, tile, kt * block_size, d)
        vg = jnp.take(vf, flat, axis=0).reshape(b, nkv, tile, kt * block_size, d)
        kpos = jnp.take(kvp, (base_pos[:, None, None, None] + bidx).reshape(-1), axis=0)
        kpos = kpos.reshape(b, nkv, tile, kt, block_size)
        ok = (blocks >= 0)[..., None] & (kpos <= pos_t[:, None, :, None, None])
        ok = ok.reshape(b, nkv, tile, 1, kt * block_size)
        # batch dims (b, kv, tile) lead every operand: one batched dot of [g, d] x [d, Kt * block] per row
        logits = jnp.einsum("btkgd,bktnd->bktgn", q_t, kg, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(ok, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        pr = jnp.exp(logits - m)
        den = jnp.sum(pr, axis=-1, keepdims=True)
        o = jnp.einsum("bktgn,bktnd->bktgd", pr.astype(v.dtype), vg, preferred_element_type=jnp.float32)
        o = o / jnp.where(den == 0.0, 1.0, den)  # normalise the [g, d] output, not the [g, Kt*block] weights
        return o.astype(q.dtype).transpose(0, 2, 1, 3, 4)  # [b, tile, kv, g, d] (one small tile)

    body = jax.checkpoint(one) if remat else one
    out = jax.lax.map(lambda a: body(kf, vf, *a), (qp, pp, ip))  # [n_tiles, b, tile, kv, g, d]
    out = out.swapaxes(0, 1).reshape(b, n_tiles * tile, nq, d)[:, :t]  # no copy for b=1
    return out


def tiled_dense_attention(q, k, v, *, q_positions, kv_positions, kv_valid=None, scale=None, q_tile=128):
    """``dense_attention`` run per query tile under ``lax.map`` (peak ``O(q_tile * kv_len * heads)``).

    Same arguments and result as :func:`~minicpm4_jax.ops.attention_ref.dense_attention` plus ``q_tile``.
    """
    b, t, nq, d = q.shape
    tile = max(1, min(q_tile, t))
    qp, pp = query_tiles(q, q_positions, tile)
    n = qp.shape[0]
    out = jax.lax.map(lambda a: dense_attention(a[0], k, v, q_positions=a[1], kv_positions=kv_positions,
                                                kv_valid=kv_valid, scale=scale), (qp, pp))
    return out.swapaxes(0, 1).reshape(b, n * tile, nq, d)[:, :t]
