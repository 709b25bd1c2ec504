"""InfLLM v2 stage 2 in pure JAX/XLA (spec ``minicpm4_model.md`` §5.5), and a query-tiled dense attention.

The reference every InfLLM v2 kernel is tested against, and the fallback on any backend.

* :func:`infllmv2_stage2` (§5.5): one softmax attention of each query head over the union of the
  blocks its KV group selected (``topk_idx``, plus gen-1's in-kernel window), with token-level
  causality (``kv_position <= q_position``). Gradients flow to q, k, v.
* :func:`tiled_dense_attention`: the dense fallback computed by query tiles.

The full entry (dispatch, selection, stage 2) is :func:`minicpm4_jax.infllm.attention.infllmv2_attention`;
this module knows arrays only.

Design of stage 2 ("forced blocks dense, top-k picks gathered"). The attended set of a query is the union
of ``topk_idx``, the ``init_blocks`` first blocks and the ``window_blocks`` blocks ending at its own block
(gen-2 forces both into the selection; gen-1 adds the window in the kernel). The two parts are computed
differently and merged with their log-sum-exp statistics (online softmax, fp32):

* **Forced part, dense**: queries run in tiles of ``q_tile`` tokens (64 = one block by default); every
  token of a tile has (nearly) the same forced blocks, so the tile takes one contiguous slice of K/V
  (its window, ``window_blocks + span - 1`` blocks, plus the init blocks) and computes one
  ``[q_tile * G, d] x [d, slice]`` product per KV head with a token-level mask (the block window,
  causality, validity). No gather; GEMM-sized.
* **Top-k picks, gathered**: the ``topk_idx`` entries outside the forced set are compacted into
  ``gather_width`` columns (``62`` of ``96`` for the MiniCPM4.1 defaults) and each sub-tile of
  ``gather_tile`` tokens fetches its picks with a single 1-D ``jnp.take`` of block-major K/V rows (one
  row per (batch, KV head, block) holding the contiguous ``[block_size * head_dim]`` slab). The ``G``
  query heads of a group share the selection, so per (token, KV head) the logits are one
  ``[G, d] x [d, gather_width * block_size]`` product, written as explicit 3-D ``dot_general``s with
  the (batch, KV head, token) rows as the batch dimension (a 5-D einsum made XLA:CPU transpose every
  gathered K into ``[d, n]`` first, 2.2x slower at 8K). 2-token sub-tiles keep the gathered K/V near
  the cache (1-, 4- and 8-token sub-tiles measured 5%, 5% and 50% slower at 8K).

A per-tile *union* of top-k picks was rejected: neighbouring tokens pick different blocks, so the union
of a tile is bounded only by ``NB`` and degenerates to dense. Tiles and sub-tiles are ``jax.checkpoint``-ed
so the backward pass re-gathers instead of saving gathered K/V (residuals stay ``O(T * heads * head_dim)``).
Peak memory is one tile's ``[q_tile * heads, slice]`` logits plus one sub-tile's gathered K/V; nothing is
``[T, T]``. ``scripts/bench_attention.py`` measures it against a tiled causal dense attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.attention_ref import check_qkv, dense_attention
from minicpm4_jax.ops.tiling import pad_axis, query_tiles

__all__ = ["infllmv2_stage2", "tiled_dense_attention", "compact_topk"]

_BIG = jnp.iinfo(jnp.int32).max


def forced_blocks(blk: jax.Array, q_blk: jax.Array, *, init_blocks: int, window_blocks: int) -> jax.Array:
    """Whether block ids ``blk`` are forced for a query in block ``q_blk`` (broadcasting): one of the first
    ``init_blocks`` or of the window ``q_blk - window_blocks + 1 .. q_blk`` (spec §5.4)."""
    return (blk < init_blocks) | ((blk > q_blk - window_blocks) & (blk <= q_blk))


def compact_topk(topk_idx: jax.Array, q_positions: jax.Array, *, block_size: int, init_blocks: int,
                 window_blocks: int, width: int) -> jax.Array:
    """Drop the forced blocks from a selection and keep the first ``width`` remaining picks.

    Args:
        topk_idx: int ``[batch, kv_heads, T, K]`` block ids, ``-1`` unused.
        q_positions: int ``[batch, T]``.
        block_size, init_blocks, window_blocks: the forced set ``[0, init_blocks)`` and
            ``[q_blk - window_blocks + 1, q_blk]`` with ``q_blk = position // block_size``.
        width: static output columns.

    Returns:
        int32 ``[batch, kv_heads, T, width]``: the non-forced picks ascending, then ``-1``. Picks beyond
        ``width`` are dropped, so ``width`` must bound the non-forced picks of every row (it does for
        :func:`~minicpm4_jax.infllm.select.select_blocks` output with the widths
        :func:`~minicpm4_jax.infllm.attention.infllmv2_attention` passes).
    """
    idx = topk_idx.astype(jnp.int32)
    qb = jnp.floor_divide(q_positions.astype(jnp.int32), block_size)[:, None, :, None]
    forced = forced_blocks(idx, qb, init_blocks=init_blocks, window_blocks=window_blocks)
    keep = jnp.sort(jnp.where((idx >= 0) & ~forced, idx, _BIG), axis=-1)
    if keep.shape[-1] < width:
        keep = jnp.pad(keep, [(0, 0)] * 3 + [(0, width - keep.shape[-1])], constant_values=_BIG)
    keep = keep[..., :width]
    return jnp.where(keep == _BIG, -1, keep)


def _merge(a, b):
    """Merge two partial softmax states ``(m, l, acc)`` (fp32; ``m = -inf`` = empty)."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    ms = jnp.where(jnp.isfinite(m), m, 0.0)
    c1, c2 = jnp.exp(m1 - ms), jnp.exp(m2 - ms)
    return m, l1 * c1 + l2 * c2, o1 * c1 + o2 * c2


def _softmax_state(logits, ok, vv, v_dtype):
    """``(m, l, acc)`` of masked logits ``[rows, g, n]`` against values ``[rows, n, d]``."""
    logits = jnp.where(ok, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    ms = jnp.where(jnp.isfinite(m), m, 0.0)
    pr = jnp.exp(logits - ms)
    acc = jax.lax.dot_general(pr.astype(v_dtype), vv, (((2,), (1,)), ((0,), (0,))),
                              preferred_element_type=jnp.float32)
    return m, jnp.sum(pr, axis=-1, keepdims=True), acc


def infllmv2_stage2(q: jax.Array, k: jax.Array, v: jax.Array, topk_idx: jax.Array, *, q_positions: jax.Array,
                    kv_positions: jax.Array, block_size: int, window_blocks: int = 0, init_blocks: int = 0,
                    gather_width: int | None = None, kv_valid: jax.Array | None = None,
                    scale: float | None = None, q_tile: int = 64, gather_tile: int | None = None,
                    remat: bool = True, gathered_fn=None) -> jax.Array:
    """Block-sparse attention over a given selection (§5.5), differentiable in q, k, v.

    Each query attends, with token-level causality, the union of its KV group's ``topk_idx`` blocks, the
    blocks ``max(0, q_blk - window_blocks + 1) .. q_blk`` and the blocks ``0 .. init_blocks - 1``
    (``q_blk = q_position // block_size``). Gen-1: ``window_blocks = L`` (the in-kernel window). Gen-2:
    the forced blocks are already in ``topk_idx``; passing them here as ``init_blocks`` /
    ``window_blocks = L + 1`` does not change the result and lets them run as dense slices.

    Args:
        q: ``[batch, T, num_heads, head_dim]`` (post-RoPE), any float dtype. Positions of a sequence must be
            contiguous (``cache_len + arange``), padding rows ``-1``.
        k, v: ``[batch, kv_len, num_kv_heads, head_dim]``; the kv index must equal the token position
            (block ``b`` = kv indices ``[b*block_size, (b+1)*block_size)``).
        topk_idx: int ``[batch, num_kv_heads, T, K]`` block ids, ``-1`` = unused (so is any id outside
            ``[0, NB)``, as in the Pallas kernels); no id repeated in a row
            (:class:`~minicpm4_jax.infllm.select.Selection` format). Not differentiated.
        q_positions: int ``[batch, T]`` (``-1`` = padding row -> zero output).
        kv_positions: int ``[batch, kv_len]``; key ``s`` is visible iff ``kv_positions[s] <= q_position``.
        block_size: KV block size (64 for MiniCPM4).
        window_blocks: forced local window (blocks ending at the query's block); 0 = none.
        init_blocks: forced first blocks; 0 = none.
        gather_width: columns kept for the non-forced picks (:func:`compact_topk`); default ``K`` (never
            drops a pick). A smaller value must bound every row's non-forced picks.
        kv_valid: optional bool ``[batch, kv_len]`` (False = padding / unwritten cache slot).
        scale: softmax scale, default ``head_dim ** -0.5``.
        q_tile: query tokens per tile of the forced (dense) part (clamped to T).
        gather_tile: query tokens per sub-tile of the gathered part (``q_tile`` is rounded up to a multiple).
            Default: as many as keep a sub-tile's gathered K and V within 16 MiB (2 tokens for the 8B
            layout, the whole tile for small models).
        remat: ``jax.checkpoint`` tiles and sub-tiles so the backward re-gathers K/V instead of storing
            them (default). ``False`` only for tools that cannot trace ``checkpoint``.
        gathered_fn: another implementation of the non-forced picks' part (the native CPU kernel,
            :func:`minicpm4_jax.infllm.attention.native_stage2`), called per query tile as
            ``gathered_fn(q_t, pos_t, idx_t, kc, vc, offset)``: ``q_t`` ``[batch, tile, num_heads, head_dim]``,
            ``pos_t`` ``[batch, tile]``, the compacted picks ``idx_t`` ``[batch, kv_heads, tile, gather_width]``
            (:func:`compact_topk`), and K/V KV-major ``[batch, kv_heads, slots, head_dim]`` where position ``p``
            is slot ``p + offset * block_size``. Returns each head's output over its picks and the logsumexp,
            ``([batch, tile, num_heads, head_dim], [batch, tile, num_heads])`` (zeros and ``-inf`` for a head
            without picks). ``None``: gathered here in XLA.

    Returns:
        ``[batch, T, num_heads, head_dim]`` in ``q.dtype``; fp32 logits/softmax; a row with no visible
        attended key returns zeros.

    Raises:
        ValueError: heads not a multiple of kv heads, mismatched shapes, negative window/init/width.
    """
    b, t, nq, d, s, nkv = check_qkv(q, k, v, q_positions, kv_positions, kv_valid)
    if topk_idx.ndim != 4 or topk_idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, T={t}, K]")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    kk = topk_idx.shape[-1]
    width = kk if gather_width is None else gather_width
    if min(window_blocks, init_blocks, width) < 0:
        raise ValueError(f"window_blocks={window_blocks}, init_blocks={init_blocks}, gather_width={width} "
                         "must be >= 0")
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    tile = max(1, min(q_tile, t))
    if gather_tile is None:
        per_token = 2 * b * nkv * width * block_size * d * jnp.dtype(k.dtype).itemsize
        gather_tile = (16 * 2**20) // max(per_token, 1)
    sub = max(1, min(gather_tile, tile))
    tile = -(-tile // sub) * sub
    nb = -(-s // block_size)
    forced = window_blocks > 0 or init_blocks > 0
    init_blocks = min(init_blocks, nb)

    kvp = kv_positions.astype(jnp.int32)
    if kv_valid is not None:
        kvp = jnp.where(kv_valid.astype(bool), kvp, _BIG)  # never visible
    kvp = pad_axis(kvp, block_size, 1, _BIG)  # [b, nb * block]
    idx = jax.lax.stop_gradient(topk_idx.astype(jnp.int32))
    if forced or width < kk:
        idx = compact_topk(idx, q_positions, block_size=block_size, init_blocks=init_blocks,
                           window_blocks=window_blocks, width=width)
    qp, pp = query_tiles(q, q_positions, tile)  # [n, b, tile, heads, d]: no copy of q for b=1
    n_tiles = qp.shape[0]
    ip = pad_axis(idx, tile, 2, -1).reshape(b, nkv, n_tiles, tile, width).transpose(2, 0, 1, 3, 4)

    # --- gathered part: block-major 2-D K/V, row (batch, kv head, block) = one [block * d] slab
    def slabs(x):
        x = pad_axis(x, block_size, 1, 0).reshape(b, nb, block_size, nkv, d).transpose(0, 3, 1, 2, 4)
        return x.reshape(b * nkv * nb, block_size * d)

    kf, vf = (slabs(k), slabs(v)) if width else (None, None)
    kvp_blocks = kvp.reshape(b * nb, block_size)
    base_kv = (jnp.arange(b)[:, None] * nkv + jnp.arange(nkv)[None, :]) * nb  # [b, kv]
    base_pos = jnp.arange(b) * nb

    def gathered(q_s, pos_s, idx_s):
        """One sub-tile: q ``[b, sub, kv, g, d]``, idx ``[b, kv, sub, W]`` -> state ``[b, kv, sub, g, *]``."""
        rows = b * nkv * sub
        bidx = jnp.clip(idx_s, 0, nb - 1)
        flat = (base_kv[:, :, None, None] + bidx).reshape(-1)
        kg = jnp.take(kf, flat, axis=0).reshape(rows, width * block_size, d)
        vg = jnp.take(vf, flat, axis=0).reshape(rows, width * block_size, d)
        kpos = jnp.take(kvp_blocks, (base_pos[:, None, None, None] + bidx).reshape(-1), axis=0)
        kpos = kpos.reshape(b, nkv, sub, width, block_size)
        ok = ((idx_s >= 0) & (idx_s < nb))[..., None] & (kpos <= pos_s[:, None, :, None, None])
        qr = q_s.transpose(0, 2, 1, 3, 4).reshape(rows, g, d)  # one small sub-tile of queries
        logits = jax.lax.dot_general(qr, kg, (((2,), (2,)), ((0,), (0,))),
                                     preferred_element_type=jnp.float32) * scale  # [rows, g, n]
        m, l, acc = _softmax_state(logits, ok.reshape(rows, 1, width * block_size), vg, v.dtype)
        return tuple(x.reshape(b, nkv, sub, g, x.shape[-1]) for x in (m, l, acc))

    # --- forced part: one contiguous K/V slice per tile, [b, kv, S, d] with S padded at the front
    span = -(-(tile - 1) // block_size) + 1  # query blocks one tile can touch (contiguous positions)
    n_win = window_blocks + span - 1 if window_blocks else 0
    if forced or gathered_fn is not None:
        front = n_win * block_size

        def kv_major(x):
            return jnp.pad(pad_axis(x, block_size, 1, 0), [(0, 0), (front, 0), (0, 0), (0, 0)]).transpose(0, 2, 1, 3)

        kd, vd = kv_major(k), kv_major(v)  # [b, kv, front + nb * block, d]
        kvp_d = jnp.pad(kvp, [(0, 0), (front, 0)], constant_values=_BIG)
        blk_d = jnp.arange(front + nb * block_size, dtype=jnp.int32) // block_size - n_win  # block id, <0 = pad

    def dense_forced(q_t, pos_t):
        """One tile: q ``[b, tile, kv, g, d]`` -> state ``[b, kv, tile, g, *]`` over init + window keys."""
        qb = jnp.floor_divide(pos_t, block_size)  # [b, tile]
        parts_k, parts_v, parts_p, parts_b = [], [], [], []
        if init_blocks:
            lo = front
            parts_k.append(kd[:, :, lo:lo + init_blocks * block_size])
            parts_v.append(vd[:, :, lo:lo + init_blocks * block_size])
            parts_p.append(kvp_d[:, lo:lo + init_blocks * block_size])
            parts_b.append(jnp.broadcast_to(blk_d[lo:lo + init_blocks * block_size], (b, init_blocks * block_size)))
        if n_win:
            top = jnp.max(qb, axis=1)  # [b] last query block of the tile
            start = (jnp.maximum(top, 0) + 1) * block_size  # padded index of the slice start (front shift)
            ln = n_win * block_size

            def sl(x, st, axis):
                return jax.lax.dynamic_slice_in_dim(x, st, ln, axis=axis)

            parts_k.append(jax.vmap(lambda x, st: sl(x, st, 1))(kd, start))
            parts_v.append(jax.vmap(lambda x, st: sl(x, st, 1))(vd, start))
            parts_p.append(jax.vmap(lambda x, st: sl(x, st, 0))(kvp_d, start))
            parts_b.append(jax.vmap(lambda st: sl(blk_d, st, 0))(start))
        kt = jnp.concatenate(parts_k, axis=2)  # [b, kv, n, d]
        vt = jnp.concatenate(parts_v, axis=2)
        kpos = jnp.concatenate(parts_p, axis=1)  # [b, n]
        kblk = jnp.concatenate(parts_b, axis=1)
        n = kt.shape[2]
        in_init = (kblk < init_blocks)[:, None, :]
        in_win = (kblk[:, None, :] > qb[:, :, None] - window_blocks) & (kblk[:, None, :] <= qb[:, :, None])
        ok = (kblk[:, None, :] >= 0) & (in_init | in_win) & (kpos[:, None, :] <= pos_t[:, :, None])  # [b, tile, n]
        if init_blocks and n_win:  # an init block inside the window slice is counted once, in the init part
            ok = ok & ~((kblk[:, None, :] < init_blocks) & (jnp.arange(n) >= init_blocks * block_size))
        qr = q_t.transpose(0, 2, 1, 3, 4).reshape(b * nkv, tile * g, d)  # [b*kv, tile*g, d]
        logits = jax.lax.dot_general(qr, kt.reshape(b * nkv, n, d), (((2,), (2,)), ((0,), (0,))),
                                     preferred_element_type=jnp.float32) * scale
        okr = jnp.broadcast_to(ok[:, None, :, None, :], (b, nkv, tile, g, n)).reshape(b * nkv, tile * g, n)
        m, l, acc = _softmax_state(logits, okr, vt.reshape(b * nkv, n, d), v.dtype)
        return tuple(x.reshape(b, nkv, tile, g, x.shape[-1]) for x in (m, l, acc))

    gbody = jax.checkpoint(gathered) if remat else gathered

    def one(q_t, pos_t, idx_t):
        q_in = q_t
        q_t = q_t.reshape(b, tile, nkv, g, d)
        state = None
        if forced:
            state = dense_forced(q_t, pos_t)
        if width and gathered_fn is not None:
            o_g, lse_g = gathered_fn(q_in, pos_t, idx_t, kd, vd, n_win)
            lse_g = lse_g.reshape(b, tile, nkv, g, 1).transpose(0, 2, 1, 3, 4)
            o_g = o_g.astype(jnp.float32).reshape(b, tile, nkv, g, d).transpose(0, 2, 1, 3, 4)
            gs = (lse_g, jnp.isfinite(lse_g).astype(jnp.float32), o_g)  # (lse, 1, out): one softmax state
            state = gs if state is None else _merge(state, gs)
        elif width:
            n_sub = tile // sub
            qs = q_t.reshape(b, n_sub, sub, nkv, g, d).swapaxes(0, 1)
            ps = pos_t.reshape(b, n_sub, sub).swapaxes(0, 1)
            isub = idx_t.reshape(b, nkv, n_sub, sub, width).transpose(2, 0, 1, 3, 4)
            gs = jax.lax.map(lambda a: gbody(*a), (qs, ps, isub))  # leaves [n_sub, b, kv, sub, g, *]
            gs = tuple(x.transpose(1, 2, 0, 3, 4, 5).reshape(b, nkv, tile, g, x.shape[-1]) for x in gs)
            state = gs if state is None else _merge(state, gs)
        if state is None:
            return jnp.zeros((b, tile, nkv, g, d), q.dtype)
        _, l, acc = state
        o = acc / jnp.where(l == 0.0, 1.0, l)  # normalise the [g, d] output, not the weights
        return o.astype(q.dtype).transpose(0, 2, 1, 3, 4)  # [b, tile, kv, g, d]

    body = jax.checkpoint(one) if remat else one
    out = jax.lax.map(lambda a: body(*a), (qp, pp, ip))  # [n_tiles, b, tile, kv, g, d]
    return out.swapaxes(0, 1).reshape(b, n_tiles * tile, nq, d)[:, :t]  # no copy for b=1


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
