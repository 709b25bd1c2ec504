"""Block-sparse (InfLLM v2 stage 2) and dense flash-decoding in Pallas: TPU (Mosaic) and GPU (Triton lowering).

Spec ``minicpm4_model.md`` §5.5 (stage 2 with a KV cache) and §5.7 (cache layout); issue 4 item 3. The
references, matched exactly (same arguments, same result up to fp32 summation order), are
:func:`minicpm4_jax.ops.decode_ref.sparse_decode_attention` and
:func:`minicpm4_jax.ops.decode_ref.dense_decode_attention`.

How it works:

1. **Block lists (XLA, small):** per (sequence, KV head) the union of the blocks any of the ``T`` new tokens
   attends (the non-forced picks of ``topk_idx`` after the reference's own
   :func:`~minicpm4_jax.ops.infllm_ref.compact_topk`, the init blocks, each token's window), ascending and
   de-duplicated, with a per-block bitmask of the tokens that attend it (bit ``t`` = token ``t``), and the count
   of valid entries. Unused slots repeat the last valid block (no new DMA on TPU) and are skipped. The dense
   list (every block up to the latest token's) is built without a sort. On Triton a single new token (a plain
   decode step) takes :func:`single_token_lists` instead: ``[init | window | raw picks]`` slots with a 0/1 bit
   from elementwise ops only (no sort, no scatter, fewer XLA launches per layer); the kernel skips 0-bit slots
   without loading their blocks.
2. **Kernel:** one program per (sequence, KV head, split) holds the ``T * G`` query rows of the KV group (the
   shared selection is read once, the matmul has ``T * G`` rows) and streams only the listed ``[block_size,
   head_dim]`` K/V blocks of the KV-head-major cache with an fp32 online softmax. Row ``(t, g)`` keeps a key of
   a listed block iff the block's bit ``t`` is set and ``key position <= q_positions[t]`` (token-level
   causality; inactive rows, position ``-1``, keep nothing).
3. **Flash-decoding split:** the block list is cut into ``num_splits`` contiguous partitions processed in
   parallel; each returns its partial ``(max, sum, unnormalised output)`` and XLA merges them (a few
   ``[splits, T * G, head_dim]`` elementwise ops).

Backends: ``backend="tpu"`` (``pltpu.PrefetchScalarGridSpec``: the block ids, token bits, counts and positions
are scalar-prefetched into SMEM; grid ``(batch, kv_heads, splits, slots)`` with the slot axis ``"arbitrary"``
and the K/V ``index_map`` returning the listed block; VMEM scratch accumulators) and ``backend="triton"``
(grid ``(batch, kv_heads, splits)``, programs in parallel; each loops over its slots with dynamic block
loads from the flat cache; every in-kernel array has power-of-two sizes: rows padded to
``max(16, next_pow2(T * G))``, ``head_dim`` padded to a power of two when it is not one (a copy of the
cache, a slow path no MiniCPM4 config takes); ``block_size`` must be a power of two). ``interpret=True``
runs either kernel on CPU (``pallas_call(interpret=True)``); ``interpret`` may also be a
``pltpu.InterpretParams`` (TPU interpret mode, e.g. with race detection) for the TPU backend.

Limits: tokens of one sequence must sit at consecutive positions (inactive ``-1`` rows anywhere), as the
reference's shared window slice assumes; the TPU backend keeps ``2 * batch * kv_heads * list_length`` int32
block ids/bits in SMEM (the dense variant lists every cache block, so very large batch x cache products
should use the XLA dense path); one K/V block per TPU grid step (``block_size`` keys), not yet tuned on
hardware.

Nothing here imports a GPU- or TPU-only module at import time (the Pallas backend modules are imported when a
kernel is built). Works on jax 0.11.2 and 0.12.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.decode_ref import decode_shapes
from minicpm4_jax.ops.infllm_ref import compact_topk, forced_blocks

__all__ = ["sparse_decode_attention_pallas", "dense_decode_attention_pallas", "decode_block_lists",
           "single_token_lists"]

_BACKENDS = ("tpu", "triton")
_LANES = 128
_MAX_T = 30  # token bits live in an int32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------- validation


def _normalise(q, k_cache, v_cache, q_positions, backend):
    """Shared checks; returns ``(single, q4 [b, T, nq, d], pos [b, T] int32)``."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {_BACKENDS}")
    single, q4, b, t, *_ = decode_shapes(q, k_cache, v_cache, q_positions)
    if t > _MAX_T:
        raise ValueError(f"T={t} new tokens per sequence; the decode kernel takes at most {_MAX_T}")
    pos = (q_positions[:, None] if single else q_positions).astype(jnp.int32)
    return single, q4, pos


def _check_block_size(block_size: int, capacity: int, backend: str) -> None:
    if block_size <= 0 or capacity % block_size:
        raise ValueError(f"cache capacity {capacity} is not a multiple of block_size={block_size}")
    if backend == "triton" and block_size != _next_pow2(block_size):
        raise ValueError(f"the triton decode kernel needs a power-of-two block_size, got {block_size}")


# ----------------------------------------------------------------------------------------------- block lists


def _compact_lists(bits: jax.Array, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dense per-block token bits ``[b, h, nb]`` -> ``(blocks, bits, count)`` of ``length`` ascending slots."""
    nb = bits.shape[-1]
    blk = jnp.arange(nb, dtype=jnp.int32)
    nz = bits != 0
    count = jnp.sum(nz, axis=-1).astype(jnp.int32)
    _, order = jax.lax.top_k(-jnp.where(nz, blk, nb + blk), length)  # the `length` smallest keys, ascending
    blocks = order.astype(jnp.int32)
    sbits = jnp.take_along_axis(bits, blocks, axis=-1)
    slot = jnp.arange(length, dtype=jnp.int32)
    last = jnp.take_along_axis(blocks, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    valid = slot < count[..., None]
    return jnp.where(valid, blocks, last), jnp.where(valid, sbits, 0), count


def decode_block_lists(topk_idx: jax.Array | None, q_positions: jax.Array, *, num_kv_heads: int, num_blocks: int,
                       block_size: int, window_blocks: int = 0, init_blocks: int = 0,
                       length: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per (sequence, KV head) sorted, de-duplicated block lists with per-block token bitmasks.

    Args:
        topk_idx: int ``[batch, num_kv_heads, T, W]`` picks (``-1`` unused; compacted by the caller when forced
            blocks are given), or ``None`` for the dense list (every block up to each token's own).
        q_positions: int ``[batch, T]``; ``-1`` = inactive token (attends nothing).
        num_kv_heads, num_blocks: static KV heads and cache blocks.
        block_size, window_blocks, init_blocks: as in the reference.
        length: static list length (default: the most blocks the inputs can name, at most ``num_blocks``).

    Returns:
        ``(blocks, bits, count)``: int32 ``[batch, num_kv_heads, length]`` block ids ascending (unused slots
        repeat the last valid id), int32 ``[batch, num_kv_heads, length]`` token bitmasks (0 in unused slots),
        int32 ``[batch, num_kv_heads]`` valid slots. Blocks beyond ``length`` are dropped (the default never
        drops one for tokens at consecutive positions, the reference's own assumption).
    """
    pos = q_positions.astype(jnp.int32)
    b, t = pos.shape
    nb = num_blocks
    blk = jnp.arange(nb, dtype=jnp.int32)
    active = (pos >= 0)[:, :, None]
    qb = jnp.floor_divide(pos, block_size)[:, :, None]  # [b, t, 1]
    tbit = jnp.left_shift(jnp.int32(1), jnp.arange(t, dtype=jnp.int32))[None, :, None]  # [1, t, 1]
    if topk_idx is None:  # every block up to the latest active token's: already ascending, no sort needed
        n = nb if length is None else max(1, min(length, nb))
        member = active & (blk <= qb)
        bits = jnp.sum(jnp.where(member, tbit, 0), axis=1)[:, :n]  # [b, n]; token bits are distinct -> sum = or
        count = jnp.minimum(jnp.max(jnp.where(active[..., 0], qb[..., 0] + 1, 0), axis=1), n)  # [b]
        slot = jnp.arange(n, dtype=jnp.int32)
        blocks = jnp.minimum(slot[None, :], jnp.maximum(count - 1, 0)[:, None])
        bits = jnp.where(slot[None, :] < count[:, None], bits, 0)

        def per_head(x):
            return jnp.broadcast_to(x[:, None], (b, num_kv_heads) + x.shape[1:]).astype(jnp.int32)
        return per_head(blocks), per_head(bits), per_head(count)
    forced = forced_blocks(blk, qb, init_blocks=init_blocks, window_blocks=window_blocks) & active  # [b, t, nb]
    bits = jnp.sum(jnp.where(forced, tbit, 0), axis=1)[:, None]  # [b, 1, nb]; token bits are distinct -> sum = or
    idx = topk_idx.astype(jnp.int32)
    w = idx.shape[-1]
    if w:
        ok = (idx >= 0) & (idx < nb) & active[:, None]
        tgt = jnp.where(ok, idx, nb).reshape(b * num_kv_heads * t, w)
        rows = jnp.arange(b * num_kv_heads * t, dtype=jnp.int32)[:, None]
        pick = jnp.zeros((b * num_kv_heads * t, nb + 1), jnp.int32).at[rows, tgt].set(1)[:, :nb]
        pick = pick.reshape(b, num_kv_heads, t, nb)
        pbits = jnp.sum(pick * tbit[:, None], axis=2)  # [b, kv, nb]
        bits = jnp.bitwise_or(bits, pbits)
    bits = jnp.broadcast_to(bits, (b, num_kv_heads, nb))
    if length is None:
        span = -(-(t - 1) // block_size) + 1
        n_win = window_blocks + span - 1 if window_blocks else 0
        length = init_blocks + n_win + t * w
    return _compact_lists(bits, max(1, min(length, nb)))


def single_token_lists(topk_idx: jax.Array, q_positions: jax.Array, *, num_blocks: int, block_size: int,
                       window_blocks: int = 0, init_blocks: int = 0,
                       gather_width: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unsorted block lists of one new token per sequence, built with elementwise ops only (no sort, no scatter).

    The Triton decode path for ``T = 1`` (a plain decode step): slots ``[init blocks | window blocks | picks]``
    in that order, each slot's token bit set iff the reference attends that block, so the kernel skips the
    others without loading them. The same block set as :func:`decode_block_lists` after
    :func:`~minicpm4_jax.ops.infllm_ref.compact_topk`: init blocks up to the token's own block, window blocks at
    or above ``init_blocks``, and the picks that are valid (``0 <= id < num_blocks``), not forced, and among
    the ``gather_width`` smallest such ids (the reference's compaction keeps those).

    Args:
        topk_idx: int ``[batch, num_kv_heads, K]`` raw picks (forced blocks may appear; ``-1`` unused; no id
            repeated in a row).
        q_positions: int ``[batch]``; ``-1`` = inactive (every bit 0).
        num_blocks, block_size, window_blocks, init_blocks: as in :func:`decode_block_lists`.
        gather_width: keep at most this many non-forced picks (default ``K``: all).

    Returns:
        ``(blocks, bits, count)``: int32 ``[batch, num_kv_heads, L]`` block ids in ``[0, num_blocks)`` (skipped
        slots hold a valid id, never read), int32 ``[batch, num_kv_heads, L]`` bits (1 = attended, 0 = skip),
        int32 ``[batch, num_kv_heads]`` equal to ``L = init_blocks + window_blocks + K`` (every slot is walked).
    """
    idx = topk_idx.astype(jnp.int32)  # [b, kv, K]
    pos = q_positions.astype(jnp.int32)
    b, nkv, k = idx.shape
    active = (pos >= 0)[:, None, None]
    qb = jnp.floor_divide(pos, block_size)[:, None, None]  # [b, 1, 1]
    parts, oks = [], []
    if init_blocks:
        ib = jnp.broadcast_to(jnp.arange(init_blocks, dtype=jnp.int32)[None, None], (b, nkv, init_blocks))
        parts.append(ib)
        oks.append(ib <= qb)
    if window_blocks:
        wb = jnp.broadcast_to(qb - window_blocks + 1 + jnp.arange(window_blocks, dtype=jnp.int32)[None, None],
                              (b, nkv, window_blocks))
        parts.append(wb)
        oks.append((wb >= init_blocks) & (wb >= 0))
    forced = forced_blocks(idx, qb, init_blocks=init_blocks, window_blocks=window_blocks)
    ok = (idx >= 0) & (idx < num_blocks) & ~forced
    width = k if gather_width is None else gather_width
    if width < k:  # the reference keeps the `width` smallest non-forced ids: rank each among the valid ones
        rank = jnp.sum(ok[:, :, None, :] & (idx[:, :, None, :] < idx[:, :, :, None]), axis=-1)
        ok = ok & (rank < width)
    parts.append(idx)
    oks.append(ok)
    blocks = jnp.clip(jnp.concatenate(parts, axis=-1), 0, num_blocks - 1)
    bits = (jnp.concatenate(oks, axis=-1) & active).astype(jnp.int32)
    return blocks, bits, jnp.full((b, nkv), blocks.shape[-1], jnp.int32)


# ----------------------------------------------------------------------------------------------- kernels


def _online_update(s, ok, v, m_prev, l_prev, acc_prev):
    """One online-softmax step on logits ``s [R, n]`` (fp32) masked by ``ok``; ``m/l [R, 1]``, ``acc [R, d]``."""
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l_new, alpha * acc_prev + pv


def _row_limits(rows: int, t: int, g: int, tbits, pos_of):
    """int32 ``[rows, 1]``: row ``(tt, gg)`` (row ``tt * g + gg``) may see keys at positions ``<= limit``."""
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    lim = jnp.full((rows, 1), -1, jnp.int32)
    for tt in range(t):
        on = jnp.bitwise_and(jnp.right_shift(tbits, tt), 1) == 1
        p_t = jnp.where(on, pos_of(tt), -1)
        lim = jnp.where((row >= tt * g) & (row < (tt + 1) * g), p_t, lim)
    return lim


def _tpu_kernel(blocks_ref, bits_ref, count_ref, pos_ref, q_ref, k_ref, v_ref, m_out, l_out, acc_out,
                m_scr, l_scr, acc_scr, *, t, g, nkv, block_size, scale, per_split, slots, cdt):
    bi, hi, si, ji = _program_ids(4)
    rows = q_ref.shape[0]

    @_pl().when(ji == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    base = bi * nkv + hi
    slot = si * per_split + ji

    @_pl().when(slot < count_ref[base])
    def _step():
        blk = blocks_ref[base * slots + slot]
        tbits = bits_ref[base * slots + slot]
        q = q_ref[...].astype(cdt)
        k = k_ref[...].astype(cdt)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        lim = _row_limits(rows, t, g, tbits, lambda tt: pos_ref[bi * t + tt])
        kpos = blk * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
        m_prev, l_prev = m_scr[...][:, :1], l_scr[...][:, :1]
        m_new, l_new, acc = _online_update(s, kpos <= lim, v_ref[...], m_prev, l_prev, acc_scr[...])
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)
        acc_scr[...] = acc

    @_pl().when(ji == per_split - 1)
    def _write():
        m_out[...] = m_scr[...]
        l_out[...] = l_scr[...]
        acc_out[...] = acc_scr[...]


def _triton_kernel(blocks_ref, bits_ref, count_ref, pos_ref, q_ref, k_ref, v_ref, m_out, l_out, acc_out, *, t, g,
                   nkv, capacity, block_size, scale, per_split, slots, cdt):
    pl = _pl()
    bi, hi, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, dp = q_ref.shape
    base = bi * nkv + hi
    start = si * per_split
    n = jnp.clip(count_ref[base] - start, 0, per_split)
    q = q_ref[...].astype(cdt)
    pos_t = [pos_ref[bi * t + tt] for tt in range(t)]

    def body(i, carry):
        slot = base * slots + start + i
        blk = blocks_ref[slot]
        tbits = bits_ref[slot]

        def attend(carry):
            m, l, acc = carry
            off = base * capacity + blk * block_size
            k = k_ref[pl.ds(off, block_size), :].astype(cdt)
            v = v_ref[pl.ds(off, block_size), :]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
            lim = _row_limits(rows, t, g, tbits, lambda tt: pos_t[tt])
            kpos = blk * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
            return _online_update(s, kpos <= lim, v, m, l, acc)

        # a slot no token attends (the unsorted single-token lists) is skipped without loading its block
        return jax.lax.cond(tbits != 0, attend, lambda c: c, carry)

    init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, dp), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n, body, init)
    m_out[...] = m
    l_out[...] = l
    acc_out[...] = acc


def _pl():
    from jax.experimental import pallas as pl

    return pl


def _program_ids(n: int):
    pl = _pl()
    return tuple(pl.program_id(i) for i in range(n))


def _run_tpu(qr, k_cache, v_cache, blocks, bits, count, pos, *, t, g, block_size, scale, splits, per_split,
             interpret):
    pl = _pl()
    from jax.experimental.pallas import tpu as pltpu

    b, nkv, rows, d = qr.shape
    slots = splits * per_split
    cdt = jnp.result_type(qr.dtype, k_cache.dtype)
    kernel = functools.partial(_tpu_kernel, t=t, g=g, nkv=nkv, block_size=block_size, scale=scale,
                               per_split=per_split, slots=slots, cdt=cdt)

    def kv_map(bi, hi, si, ji, blocks_ref, *_):
        return bi, hi, blocks_ref[(bi * nkv + hi) * slots + si * per_split + ji], 0

    stat_spec = pl.BlockSpec((None, None, None, rows, _LANES), lambda bi, hi, si, ji, *_: (bi, hi, si, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(b, nkv, splits, per_split),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda bi, hi, si, ji, *_: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, block_size, d), kv_map),
            pl.BlockSpec((None, None, block_size, d), kv_map),
        ],
        out_specs=[stat_spec, stat_spec,
                   pl.BlockSpec((None, None, None, rows, d), lambda bi, hi, si, ji, *_: (bi, hi, si, 0, 0))],
        scratch_shapes=[pltpu.VMEM((rows, _LANES), jnp.float32), pltpu.VMEM((rows, _LANES), jnp.float32),
                        pltpu.VMEM((rows, d), jnp.float32)],
    )
    f32 = jnp.float32
    m, l, acc = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, nkv, splits, rows, _LANES), f32),
                   jax.ShapeDtypeStruct((b, nkv, splits, rows, _LANES), f32),
                   jax.ShapeDtypeStruct((b, nkv, splits, rows, d), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="infllmv2_decode_tpu",
    )(blocks.reshape(-1), bits.reshape(-1), count.reshape(-1), pos.reshape(-1), qr, k_cache, v_cache)
    return m[..., 0], l[..., 0], acc


def _run_triton(qr, k_cache, v_cache, blocks, bits, count, pos, *, t, g, block_size, scale, splits, per_split,
                interpret, num_warps, num_stages):
    pl = _pl()
    from jax.experimental.pallas import triton as pltriton

    b, nkv, rows, d = qr.shape
    cap = k_cache.shape[2]
    rp, dp = max(16, _next_pow2(rows)), _next_pow2(d)
    qp = jnp.pad(qr, ((0, 0), (0, 0), (0, rp - rows), (0, dp - d)))
    if dp != d:  # slow path (copies the cache); every MiniCPM4 head_dim is a power of two
        k_cache = jnp.pad(k_cache, ((0, 0), (0, 0), (0, 0), (0, dp - d)))
        v_cache = jnp.pad(v_cache, ((0, 0), (0, 0), (0, 0), (0, dp - d)))
    slots = splits * per_split
    cdt = jnp.result_type(qr.dtype, k_cache.dtype)
    kernel = functools.partial(_triton_kernel, t=t, g=g, nkv=nkv, capacity=cap, block_size=block_size, scale=scale,
                               per_split=per_split, slots=slots, cdt=cdt)
    stat_spec = pl.BlockSpec((None, None, None, rp, 1), lambda bi, hi, si: (bi, hi, si, 0, 0))
    f32 = jnp.float32
    m, l, acc = pl.pallas_call(
        kernel,
        grid=(b, nkv, splits),
        in_specs=[pl.no_block_spec] * 4 + [
            pl.BlockSpec((None, None, rp, dp), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.no_block_spec, pl.no_block_spec],
        out_specs=[stat_spec, stat_spec,
                   pl.BlockSpec((None, None, None, rp, dp), lambda bi, hi, si: (bi, hi, si, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, nkv, splits, rp, 1), f32),
                   jax.ShapeDtypeStruct((b, nkv, splits, rp, 1), f32),
                   jax.ShapeDtypeStruct((b, nkv, splits, rp, dp), f32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="infllmv2_decode_triton",
    )(blocks.reshape(-1), bits.reshape(-1), count.reshape(-1), pos.reshape(-1), qp,
      k_cache.reshape(b * nkv * cap, dp), v_cache.reshape(b * nkv * cap, dp))
    return m[..., :rows, 0], l[..., :rows, 0], acc[..., :rows, :d]


def _decode_core(q4, k_cache, v_cache, blocks, bits, count, pos, *, block_size, scale, num_splits, backend,
                 interpret, num_warps, num_stages):
    b, t, nq, d = q4.shape
    nkv = k_cache.shape[1]
    g = nq // nkv
    scale = d**-0.5 if scale is None else float(scale)
    length = blocks.shape[-1]
    if num_splits is None:
        num_splits = _cdiv(length, 8 if backend == "triton" else 32)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be positive")
    splits = min(int(num_splits), length)
    per_split = _cdiv(length, splits)
    extra = splits * per_split - length
    if extra:
        blocks = jnp.concatenate([blocks, jnp.broadcast_to(blocks[..., -1:], blocks.shape[:-1] + (extra,))], -1)
        bits = jnp.pad(bits, ((0, 0), (0, 0), (0, extra)))
    qr = q4.reshape(b, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, nkv, t * g, d)  # rows (token, head)
    kw = dict(t=t, g=g, block_size=block_size, scale=scale, splits=splits, per_split=per_split, interpret=interpret)
    if backend == "tpu":
        m, l, acc = _run_tpu(qr, k_cache, v_cache, blocks, bits, count, pos, **kw)
    else:
        m, l, acc = _run_triton(qr, k_cache, v_cache, blocks, bits, count, pos, num_warps=num_warps,
                                num_stages=num_stages, **kw)
    # merge the splits (flash-decoding): m, l [b, kv, S, R]; acc [b, kv, S, R, d]
    mx = jnp.max(m, axis=2, keepdims=True)
    ms = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(m - ms)
    l_tot = jnp.sum(w * l, axis=2)
    acc_tot = jnp.sum(w[..., None] * acc, axis=2)
    out = acc_tot / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None]
    return out.reshape(b, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, nq, d)


# ----------------------------------------------------------------------------------------------- public entries


def sparse_decode_attention_pallas(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, topk_idx: jax.Array, *,
                                   q_positions: jax.Array, block_size: int, window_blocks: int = 0,
                                   init_blocks: int = 0, gather_width: int | None = None,
                                   scale: float | None = None, backend: str = "tpu", interpret=False,
                                   num_splits: int | None = None, num_warps: int = 4,
                                   num_stages: int = 2) -> jax.Array:
    """InfLLM v2 stage 2 for new tokens over a KV cache as a block-sparse flash-decoding kernel (§5.5, §5.7).

    Same arguments and result as :func:`minicpm4_jax.ops.decode_ref.sparse_decode_attention`: each query head
    attends, over the keys of its KV head at positions ``<= q_position``, the union of its group's ``topk_idx``
    blocks, the blocks ``0 .. init_blocks - 1`` and the window ``max(0, q_blk - window_blocks + 1) .. q_blk``
    (``q_blk = q_position // block_size``); only those ``[block_size, head_dim]`` blocks of the cache are read.

    Args:
        q: ``[batch, num_heads, head_dim]`` or ``[batch, T, num_heads, head_dim]`` (``T <= 30``, e.g. a
            speculative verify chunk; tokens of a sequence at consecutive positions), post-RoPE.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]`` (KV-head major, slot = position);
            ``capacity`` a multiple of ``block_size``.
        topk_idx: int ``[batch, num_kv_heads, K]`` (or ``[batch, num_kv_heads, T, K]``) block ids, ``-1``
            unused, no id repeated in a row.
        q_positions: int ``[batch]`` (or ``[batch, T]``); ``-1`` = inactive row (zeros out).
        block_size: KV block size (a power of two for ``backend="triton"``).
        window_blocks, init_blocks: forced blocks; 0 = none.
        gather_width: as in the reference (picks outside the forced blocks beyond it are dropped); default
            ``K``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: ``"tpu"`` (Mosaic TPU) or ``"triton"`` (NVIDIA GPU via Pallas's Triton lowering).
        interpret: ``True`` runs the kernel in Pallas interpret mode (CPU); a ``pltpu.InterpretParams`` selects
            the TPU interpret mode (TPU backend only).
        num_splits: flash-decoding partitions of the block list (default ``ceil(list / 8)`` on Triton,
            ``ceil(list / 32)`` on TPU).
        num_warps, num_stages: Triton compiler parameters.

    Returns:
        the shape of ``q``, in ``q.dtype`` (fp32 online softmax).

    Raises:
        ValueError: unknown backend, mismatched shapes, heads not a multiple of kv heads, ``T > 30``, a capacity
            that is not a multiple of ``block_size``, negative forced blocks, a non-power-of-two ``block_size``
            on Triton.
    """
    single, q4, pos = _normalise(q, k_cache, v_cache, q_positions, backend)
    b, t = q4.shape[:2]
    nkv, cap = k_cache.shape[1], k_cache.shape[2]
    _check_block_size(block_size, cap, backend)
    idx = (topk_idx[:, :, None] if single else topk_idx).astype(jnp.int32)
    if idx.ndim != 4 or idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, (T={t},) K]")
    nb = cap // block_size
    if min(window_blocks, init_blocks) < 0:
        raise ValueError(f"window_blocks={window_blocks}, init_blocks={init_blocks} must be >= 0")
    # a cache of fewer blocks than the window (or the init blocks) is attended whole: the lists mask block ids
    window_blocks, init_blocks = min(window_blocks, nb), min(init_blocks, nb)
    width = idx.shape[-1] if gather_width is None else gather_width
    if t == 1 and backend == "triton":  # a decode step: elementwise lists, no sort (fewer launches per layer)
        blocks, bits, count = single_token_lists(idx[:, :, 0], pos[:, 0], num_blocks=nb, block_size=block_size,
                                                 window_blocks=window_blocks, init_blocks=init_blocks,
                                                 gather_width=width)
    else:
        if window_blocks or init_blocks or width < idx.shape[-1]:
            idx = compact_topk(idx, pos, block_size=block_size, init_blocks=init_blocks,
                               window_blocks=window_blocks, width=width)
        blocks, bits, count = decode_block_lists(idx, pos, num_kv_heads=nkv, num_blocks=nb, block_size=block_size,
                                                 window_blocks=window_blocks, init_blocks=init_blocks)
    out = _decode_core(q4, k_cache, v_cache, blocks, bits, count, pos, block_size=block_size, scale=scale,
                       num_splits=num_splits, backend=backend, interpret=interpret, num_warps=num_warps,
                       num_stages=num_stages)
    return (out[:, 0] if single else out).astype(q.dtype)


def dense_decode_attention_pallas(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, q_positions: jax.Array,
                                  scale: float | None = None, block_size: int = 64, backend: str = "tpu",
                                  interpret=False, num_splits: int | None = None, num_warps: int = 4,
                                  num_stages: int = 2) -> jax.Array:
    """Dense GQA flash-decoding of new tokens over their sequence's cached keys (the dense decode path).

    Same arguments and result as :func:`minicpm4_jax.ops.decode_ref.dense_decode_attention` plus the kernel
    options: every cache block up to the latest active token's is listed (the same kernel as
    :func:`sparse_decode_attention_pallas`), keys at positions ``<= q_position`` are kept.

    Args:
        q: ``[batch, num_heads, head_dim]`` or ``[batch, T, num_heads, head_dim]`` (``T <= 30``), post-RoPE.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]``; ``capacity`` a multiple of
            ``block_size``.
        q_positions: int ``[batch]`` / ``[batch, T]``; ``-1`` = inactive row (zeros out).
        scale: softmax scale, default ``head_dim ** -0.5``.
        block_size: keys per kernel step (a power of two for ``backend="triton"``).
        backend, interpret, num_splits, num_warps, num_stages: as in :func:`sparse_decode_attention_pallas`.

    Returns:
        the shape of ``q``, in ``q.dtype`` (fp32 online softmax).

    Raises:
        ValueError: unknown backend, mismatched shapes, heads not a multiple of kv heads, ``T > 30``, a capacity
            that is not a multiple of ``block_size``.
    """
    single, q4, pos = _normalise(q, k_cache, v_cache, q_positions, backend)
    nkv, cap = k_cache.shape[1], k_cache.shape[2]
    _check_block_size(block_size, cap, backend)
    blocks, bits, count = decode_block_lists(None, pos, num_kv_heads=nkv, num_blocks=cap // block_size,
                                             block_size=block_size)
    out = _decode_core(q4, k_cache, v_cache, blocks, bits, count, pos, block_size=block_size, scale=scale,
                       num_splits=num_splits, backend=backend, interpret=interpret, num_warps=num_warps,
                       num_stages=num_stages)
    return (out[:, 0] if single else out).astype(q.dtype)
