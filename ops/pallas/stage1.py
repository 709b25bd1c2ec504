"""InfLLM v2 stage-1 scoring in Pallas: TPU (Mosaic) and GPU (Triton lowering).

Spec ``minicpm4_model.md`` §5.2; issue 4 item 4. The reference, matched exactly (same arguments, same result
up to fp32 summation order), is :func:`minicpm4_jax.infllm.select.stage1_scores`: logits ``z = scale * q .
ck1[j]`` of every query head against its KV head's fine compressed keys, the variant's log-sum-exp (gen-1:
exact, over the visible fine kernels; gen-2: over the visible *coarse* kernels ``ck2``), ``exp(z - lse)`` on
the visible kernels (exactly 0 elsewhere; ``+inf`` on the visible fine kernels of a gen-2 row without a
visible coarse kernel; never NaN), summed in fp32 over the ``G`` query heads of each KV group and written
once as ``[batch, num_kv_heads, T, Nc1]`` in ``params.score_dtype``. Per-head scores never reach HBM.
Pooling and top-k stay in XLA (:func:`~minicpm4_jax.infllm.select.pool_block_scores`,
:func:`~minicpm4_jax.infllm.select.topk_blocks`).

One program per (sequence, KV head, query tile) holds ``tq`` tokens x all ``G`` heads of the group as rows
(row ``t * Gp + g``; ``G`` padded to ``Gp`` with rows that see nothing) and makes one pass over the
compressed keys in chunks: first the LSE keys (``ck1`` for gen-1, ``ck2`` for gen-2) with an fp32 online
log-sum-exp, then ``ck1`` again for the scores, each chunk's ``[tq * Gp, chunk]`` probabilities reduced over
the heads in registers/VMEM and stored as ``[tq, chunk]`` (TPU: fp32, cast to ``score_dtype`` in XLA, the
same single rounding as the reference). Chunks past the tile's last visible kernel are
not computed (zeros are stored; on TPU their DMA is skipped too). The visibility counts come from
:func:`~minicpm4_jax.infllm.select.visible_kernel_count` (clean rule or the opt-in off-by-one quirk).

Backends: ``backend="tpu"`` (grid ``(batch, kv_heads, tiles, LSE chunks + score chunks)`` with the chunk axis
``"arbitrary"``, the tiles' last needed chunk indices scalar-prefetched so the index maps stop fetching past
them, VMEM scratch for the running max/sum) and ``backend="triton"`` (grid ``(batch, kv_heads, tiles)``, or
split over the chunks for small grids, below; in-kernel loops over the chunks; all in-kernel arrays powers of
two: ``Gp = next_pow2(G)``, ``tq`` a power of two with ``tq * Gp >= 16``, ``head_dim`` zero-padded to a power
of two). ``interpret=True`` runs on CPU;
``interpret`` may be a ``pltpu.InterpretParams`` for the TPU backend.

Triton chunk split (``split_chunks``): with few programs the Triton grid cannot fill the GPU, and each program
walks every chunk in sequence. Decode (T = 1, batch 1, 2 KV heads) is 2 programs on a 132-SM H200, each
looping over 32 LSE + 128 score chunks at a 128K-token cache: 0.163 ms per layer against 0.061 ms at 32K,
latency-bound. So when ``batch * kv_heads * tiles < 128`` (with more than one score chunk and at least 16 LSE +
score chunks: at an 8K cache, 10 chunks, the split measured 4% slower) the Triton
backend splits the chunk loops over ``S`` programs per (sequence, KV head, tile), two ``pallas_call`` s and an
XLA combine: (1) grid ``(batch, kv_heads, tiles, S_l)``, each program the online log-sum-exp over its
contiguous range of LSE-key chunks -> partial ``(m, l)`` ``[batch, kv_heads, tiles, S_l, tq * Gp, 1]`` fp32;
(2) XLA merges the partials into the tile's ``lse`` rows, ``-inf`` where no partial saw a visible kernel
(exactly what the single kernel's ``_lse(m, l)`` gives, so 0 / ``+inf`` / never NaN hold as above);
(3) grid ``(batch, kv_heads, tiles, S_1)``, each program writes its contiguous range of fine-key chunks from
the ``lse`` rows (chunks past the tile's last visible kernel: zeros, not computed). Automatic ``S`` aims at
about 256 programs in all (``min(chunks, ceil(256 / (batch * kv_heads * tiles)))``), clamped per pass to its
chunk count with no empty program. Prefill grids are large and keep the single kernel.

Layout cost outside the kernel: ``q`` and the compressed keys are transposed to KV-head-major tiles (the
compressed keys are ``1/stride`` of the keys).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["stage1_scores_pallas"]

_BACKENDS = ("tpu", "triton")
_LANES = 128
# Triton chunk split (see stage1_scores_pallas): automatic when the grid has fewer cells than this ...
_SPLIT_MAX_CELLS = 128
# ... aiming at about this many programs in all (two per SM of a 132-SM H100 / H200)
_SPLIT_TARGET_PROGRAMS = 256
# ... and only with at least this many chunks (LSE + score) per program: decode on the H200 (2026-11-29, 8 layers
# per call) timed 10 chunks (8K cache) at 0.0528 ms per layer unsplit vs 0.0551 split, 40 chunks (32K) at 0.0795
# vs 0.0526, 160 (128K) at 0.1991 vs 0.0769: two launches and a combine only pay off over a long loop
_SPLIT_MIN_CHUNKS = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _lse_update(z, vis, m_prev, l_prev):
    """Online log-sum-exp step over masked logits ``z [R, n]``; ``m/l [R, 1]``."""
    z = jnp.where(vis, z, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    l_new = jnp.exp(m_prev - m_safe) * l_prev + jnp.sum(jnp.exp(z - m_safe), axis=1, keepdims=True)
    return m_new, l_new


def _lse(m, l):
    """``m + log(l)``; ``-inf`` for an empty set (``l == 0``), never NaN."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def _logits(q, ck, scale, cdt):
    return jax.lax.dot_general(q.astype(cdt), ck.astype(cdt), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32) * scale


def _tpu_kernel(need_ref, cntl_ref, cnt1_ref, q_ref, ckl_ref, ck1_ref, out_ref, m_scr, l_scr, *, n_lse, kcl, kc1,
                tq, gp, n_tiles, scale, cdt):
    from jax.experimental import pallas as pl

    bi, ti, c = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    tile = bi * n_tiles + ti

    @pl.when(c == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)

    @pl.when(c < need_ref[2 * tile])
    def _lse_step():
        z = _logits(q_ref[...], ckl_ref[...], scale, cdt)
        vis = c * kcl + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) < cntl_ref[...]
        m_new, l_new = _lse_update(z, vis, m_scr[...][:, :1], l_scr[...][:, :1])
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

    c1 = c - n_lse

    @pl.when((c1 >= 0) & (c1 < need_ref[2 * tile + 1]))
    def _score_step():
        z = _logits(q_ref[...], ck1_ref[...], scale, cdt)
        vis = c1 * kc1 + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) < cnt1_ref[...]
        p = jnp.where(vis, jnp.exp(z - _lse(m_scr[...][:, :1], l_scr[...][:, :1])), 0.0)
        for tt in range(tq):  # sum over the group's heads: aligned row slabs of Gp (a multiple of 8) rows
            out_ref[tt:tt + 1, :] = jnp.sum(p[tt * gp:(tt + 1) * gp], axis=0, keepdims=True).astype(out_ref.dtype)

    @pl.when((c1 >= 0) & (c1 >= need_ref[2 * tile + 1]))
    def _zero_step():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _triton_lse_loop(q, ckl_ref, cntl, lo, hi, *, kcl, scale, cdt):
    """fp32 online log-sum-exp of ``q``'s rows over the LSE-key chunks ``[lo, hi)``: ``(m, l)``, ``[rows, 1]``."""
    from jax.experimental import pallas as pl

    def body(c, carry):
        z = _logits(q, ckl_ref[pl.ds(c * kcl, kcl), :], scale, cdt)
        vis = c * kcl + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) < cntl
        return _lse_update(z, vis, *carry)

    rows = q.shape[0]
    return jax.lax.fori_loop(lo, hi, body, (jnp.full((rows, 1), -jnp.inf, jnp.float32),
                                            jnp.zeros((rows, 1), jnp.float32)))


def _triton_score_loops(q, ck1_ref, cnt1, lse, out_ref, first, n_here, n_out, *, kc1, tq, gp, scale, cdt):
    """Fine-key chunks ``first + j`` for ``j < n_here`` into ``out_ref[:, j * kc1 ...]``; zeros for ``j`` in
    ``[n_here, n_out)`` (past the last visible kernel: not computed)."""
    from jax.experimental import pallas as pl

    def score_body(j, carry):
        c = first + j
        z = _logits(q, ck1_ref[pl.ds(c * kc1, kc1), :], scale, cdt)
        vis = c * kc1 + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) < cnt1
        p = jnp.where(vis, jnp.exp(z - lse), 0.0)
        out_ref[:, pl.ds(j * kc1, kc1)] = jnp.sum(p.reshape(tq, gp, kc1), axis=1).astype(out_ref.dtype)
        return carry

    def zero_body(j, carry):
        out_ref[:, pl.ds(j * kc1, kc1)] = jnp.zeros((tq, kc1), out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, n_here, score_body, 0)
    jax.lax.fori_loop(n_here, n_out, zero_body, 0)


def _triton_kernel(cntl_ref, cnt1_ref, q_ref, ckl_ref, ck1_ref, out_ref, *, kcl, kc1, tq, gp, scale, cdt):
    q = q_ref[...]
    cntl = cntl_ref[...]
    cnt1 = cnt1_ref[...]
    n_lse = (jnp.max(cntl) + kcl - 1) // kcl
    n_sc = (jnp.max(cnt1) + kc1 - 1) // kc1
    m, l = _triton_lse_loop(q, ckl_ref, cntl, 0, n_lse, kcl=kcl, scale=scale, cdt=cdt)
    _triton_score_loops(q, ck1_ref, cnt1, _lse(m, l), out_ref, 0, n_sc, out_ref.shape[1] // kc1, kc1=kc1, tq=tq,
                        gp=gp, scale=scale, cdt=cdt)


def _triton_lse_split_kernel(cntl_ref, q_ref, ckl_ref, m_ref, l_ref, *, kcl, per, scale, cdt):
    """Split pass 1: program ``s`` (grid axis 3) runs the online LSE over LSE-key chunks ``[s*per, (s+1)*per)``
    that hold a visible kernel of the tile and writes its partial ``(m, l)``."""
    from jax.experimental import pallas as pl

    cntl = cntl_ref[...]
    lo = pl.program_id(3) * per
    hi = jnp.minimum(lo + per, (jnp.max(cntl) + kcl - 1) // kcl)
    m, l = _triton_lse_loop(q_ref[...], ckl_ref, cntl, lo, jnp.maximum(hi, lo), kcl=kcl, scale=scale, cdt=cdt)
    m_ref[...] = m
    l_ref[...] = l


def _triton_score_split_kernel(cnt1_ref, lse_ref, q_ref, ck1_ref, out_ref, *, kc1, per, tq, gp, scale, cdt):
    """Split pass 2: program ``s`` (grid axis 3) writes fine-key chunks ``[s*per, (s+1)*per)`` (its output block),
    computing those up to the tile's last visible kernel, from the combined ``lse`` rows."""
    from jax.experimental import pallas as pl

    cnt1 = cnt1_ref[...]
    first = pl.program_id(3) * per
    n_here = jnp.clip((jnp.max(cnt1) + kc1 - 1) // kc1 - first, 0, per)
    _triton_score_loops(q_ref[...], ck1_ref, cnt1, lse_ref[...], out_ref, first, n_here, per, kc1=kc1, tq=tq, gp=gp,
                        scale=scale, cdt=cdt)


def _combine_lse(m, l):
    """``lse`` of partial ``(m, l)`` ``[..., S, rows, 1]`` over ``S``: :func:`_lse` of the whole set (``-inf`` when
    every partial is empty), never NaN."""
    mx = jnp.max(m, axis=-3)
    ms = jnp.where(mx == -jnp.inf, 0.0, mx)
    return _lse(mx, jnp.sum(jnp.exp(m - ms[..., None, :, :]) * l, axis=-3))


def _chunk_keys(ck: jax.Array, kc: int, dp: int) -> jax.Array:
    """``[b, Nc, kv, d]`` -> KV-head-major ``[b, kv, round_up(max(Nc, 1), kc), dp]`` (zero padding)."""
    x = ck.transpose(0, 2, 1, 3)
    n = x.shape[2]
    return jnp.pad(x, ((0, 0), (0, 0), (0, _round_up(max(n, 1), kc) - n), (0, dp - x.shape[3])))


def _triton_split(rcl, rc1, qr, kl, k1, *, split, kcl, kc1, tq, gp, scale, cdt, out_dtype, cparams, interpret):
    """The chunk loops split over up to ``split`` programs per (sequence, KV head, tile): LSE partials, their
    XLA combine, then the scores. Returns ``[b, kv, tiles, tq, >= n1 * kc1]`` in ``out_dtype``."""
    from jax.experimental import pallas as pl

    b, nkv, n_tiles, rows, dp = qr.shape
    nl, n1 = kl.shape[2] // kcl, k1.shape[2] // kc1
    per_l = _cdiv(nl, min(split, nl))  # chunks per program; no program without a chunk
    per_1 = _cdiv(n1, min(split, n1))
    s_l, s_1 = _cdiv(nl, per_l), _cdiv(n1, per_1)

    cnt_spec = pl.BlockSpec((None, None, rows, 1), lambda bi, hi, ti, s: (bi, ti, 0, 0))
    q_spec = pl.BlockSpec((None, None, None, rows, dp), lambda bi, hi, ti, s: (bi, hi, ti, 0, 0))
    part_spec = pl.BlockSpec((None, None, None, None, rows, 1), lambda bi, hi, ti, s: (bi, hi, ti, s, 0, 0))
    part_shape = jax.ShapeDtypeStruct((b, nkv, n_tiles, s_l, rows, 1), jnp.float32)
    m, l = pl.pallas_call(
        functools.partial(_triton_lse_split_kernel, kcl=kcl, per=per_l, scale=scale, cdt=cdt),
        grid=(b, nkv, n_tiles, s_l),
        in_specs=[cnt_spec, q_spec, pl.BlockSpec((None, None, nl * kcl, dp), lambda bi, hi, ti, s: (bi, hi, 0, 0))],
        out_specs=[part_spec, part_spec],
        out_shape=[part_shape, part_shape],
        compiler_params=cparams,
        interpret=interpret,
        name="infllmv2_stage1_triton_lse_split",
    )(rcl, qr, kl)
    lse = _combine_lse(m, l)  # [b, kv, tiles, rows, 1]
    return pl.pallas_call(
        functools.partial(_triton_score_split_kernel, kc1=kc1, per=per_1, tq=tq, gp=gp, scale=scale, cdt=cdt),
        grid=(b, nkv, n_tiles, s_1),
        in_specs=[cnt_spec, pl.BlockSpec((None, None, None, rows, 1), lambda bi, hi, ti, s: (bi, hi, ti, 0, 0)),
                  q_spec, pl.BlockSpec((None, None, n1 * kc1, dp), lambda bi, hi, ti, s: (bi, hi, 0, 0))],
        out_specs=pl.BlockSpec((None, None, None, tq, per_1 * kc1), lambda bi, hi, ti, s: (bi, hi, ti, 0, s)),
        out_shape=jax.ShapeDtypeStruct((b, nkv, n_tiles, tq, s_1 * per_1 * kc1), out_dtype),
        compiler_params=cparams,
        interpret=interpret,
        name="infllmv2_stage1_triton_score_split",
    )(rc1, lse, qr, k1)


def stage1_scores_pallas(q: jax.Array, ck1: jax.Array, ck2: jax.Array | None, *, q_positions: jax.Array,
                         kv_len: jax.Array, params, scale: float | None = None, num_q: int | None = None,
                         backend: str = "tpu", interpret=False, q_tile: int | None = None,
                         kernel_chunk: int | None = None, split_chunks: int | None = None, num_warps: int = 4,
                         num_stages: int = 2) -> jax.Array:
    """Stage-1 query->kernel scores summed over each KV group's query heads, as one Pallas kernel (§5.2).

    Same arguments and result as :func:`minicpm4_jax.infllm.select.stage1_scores` plus the kernel options.

    Args:
        q: ``[batch, T, num_heads, head_dim]`` selection queries (post-RoPE unless use_nope).
        ck1: ``[batch, Nc1, num_kv_heads, head_dim]`` fine compressed keys; rows at or beyond a sequence's
            visible count may hold anything (never read into a result).
        ck2: ``[batch, Nc2, num_kv_heads, head_dim]`` coarse compressed keys (gen-2; ignored by gen-1).
        q_positions: int ``[batch, T]`` absolute positions (``-1`` = padding row: all zeros).
        kv_len: int ``[batch]`` keys per sequence (quirk only).
        params: :class:`~minicpm4_jax.infllm.select.SelectParams` (``variant``, kernel geometry,
            ``kernel_offby1_quirk``, ``score_dtype``).
        scale: logit scale, default ``head_dim ** -0.5``.
        num_q: query rows of the whole call when ``q`` is a tile of it (quirk only): ``T``, or int ``[batch]``
            per sequence (:func:`~minicpm4_jax.infllm.select.query_rows`); default ``q.shape[1]``.
        backend: ``"tpu"`` (Mosaic TPU) or ``"triton"`` (NVIDIA GPU via Pallas's Triton lowering).
        interpret: ``True`` runs the kernel in Pallas interpret mode (CPU); a ``pltpu.InterpretParams`` selects
            the TPU interpret mode (TPU backend only).
        q_tile: query tokens per program (default: 128 rows on TPU, 64 on Triton; a power of two on Triton).
        kernel_chunk: compressed keys per step (default: up to 512 on TPU, a multiple of 128; 64 on Triton, a
            power of two).
        split_chunks: Triton only (validated, otherwise ignored on TPU): split the per-program chunk loops
            over several programs (module docstring; for decode, where ``batch * kv_heads * tiles`` programs
            leave the GPU idle: 2 programs of 160 chunks each took 0.163 ms at a 128K cache on an H200).
            ``None`` (default): automatic, split when ``batch * kv_heads * tiles < 128``, there is more than
            one score chunk and at least 16 LSE + score chunks, over ``min(chunks, ceil(256 / (batch * kv_heads * tiles)))`` programs; ``0`` or
            ``1``: never (one kernel, a sequential loop over all chunks); ``N >= 2``: over up to ``N`` programs
            per (sequence, KV head, tile), each pass clamped to its number of chunks (the single kernel when
            both the LSE and the score keys fit one chunk). Same result up to fp32 summation order.
        num_warps, num_stages: Triton compiler parameters.

    Returns:
        ``[batch, num_kv_heads, T, Nc1]`` in ``params.score_dtype``; exactly 0 on invisible kernels, ``+inf``
        on visible kernels of gen-2 rows without a visible coarse kernel, never NaN.

    Raises:
        ValueError: unknown backend / variant / score_dtype, mismatched shapes, heads not a multiple of kv
            heads, gen-2 without ``ck2``, an illegal ``q_tile`` / ``kernel_chunk``, ``split_chunks`` not
            ``None`` or an int ``>= 0``.
    """
    from minicpm4_jax.infllm.select import visible_kernel_count  # lazy: select.py may import this module

    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {_BACKENDS}")
    if split_chunks is not None and (isinstance(split_chunks, bool) or not isinstance(split_chunks, int)
                                     or split_chunks < 0):
        raise ValueError(f"split_chunks={split_chunks!r}; pass None (automatic), 0 or 1 (never split) or an int "
                         f"N >= 2 (split the chunk loops over up to N programs)")
    p = params
    if p.variant not in ("gen1", "gen2"):
        raise ValueError(f"params.variant={p.variant!r}; use 'gen1' or 'gen2'")
    if p.score_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"params.score_dtype={p.score_dtype!r}; use 'float32' or 'bfloat16'")
    if q.ndim != 4 or ck1.ndim != 4 or ck1.shape[0] != q.shape[0] or ck1.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape} [batch, T, heads, head_dim], ck1 {ck1.shape} "
                         f"[batch, Nc1, kv_heads, head_dim]")
    b, t, nq, d = q.shape
    nc1, nkv = ck1.shape[1], ck1.shape[2]
    if nq % nkv:
        raise ValueError(f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    if tuple(q_positions.shape) != (b, t) or tuple(kv_len.shape) != (b,):
        raise ValueError(f"q_positions {q_positions.shape} must be [batch, T] = {(b, t)} and kv_len {kv_len.shape} "
                         f"[batch] = {(b,)}")
    if p.variant == "gen2":
        if ck2 is None:
            raise ValueError("gen2 stage 1 needs the coarse compressed keys ck2")
        if ck2.ndim != 4 or ck2.shape[0] != b or ck2.shape[2] != nkv or ck2.shape[3] != d:
            raise ValueError(f"ck2 shape {ck2.shape} does not match [batch={b}, Nc2, kv_heads={nkv}, head_dim={d}]")
    g = nq // nkv
    scale = d**-0.5 if scale is None else float(scale)
    num_q = t if num_q is None else num_q
    out_dtype = jnp.dtype(p.score_dtype)
    if nc1 == 0 or t == 0:
        return jnp.zeros((b, nkv, t, nc1), out_dtype)

    cnt1 = visible_kernel_count(q_positions, kv_len, num_q, nc1, p.kernel_size, p.kernel_stride,
                                p.kernel_offby1_quirk)
    if p.variant == "gen2":
        ckl = ck2
        cntl = visible_kernel_count(q_positions, kv_len, num_q, ck2.shape[1], p.coarse_size, p.coarse_stride,
                                    p.kernel_offby1_quirk)
    else:
        ckl, cntl = ck1, cnt1
    ncl = ckl.shape[1]
    cdt = jnp.result_type(q.dtype, ck1.dtype, ckl.dtype)

    triton = backend == "triton"
    if triton:
        gp, dp = _next_pow2(g), _next_pow2(d)
        tq = q_tile if q_tile is not None else _next_pow2(min(t, max(1, 64 // gp)))
        tq = max(tq, _cdiv(16, gp))
        if tq != _next_pow2(tq):
            raise ValueError(f"q_tile={q_tile} must be a power of two on triton")
        kc1 = kernel_chunk if kernel_chunk is not None else max(16, min(64, _next_pow2(nc1)))
        kcl = kernel_chunk if kernel_chunk is not None else max(16, min(64, _next_pow2(max(ncl, 1))))
        if kc1 < 16 or kc1 != _next_pow2(kc1):
            raise ValueError(f"kernel_chunk={kernel_chunk} must be a power of two >= 16 on triton")
    else:
        gp, dp = _round_up(g, 8), d
        tq = q_tile if q_tile is not None else min(t, max(1, 128 // gp))
        kc1 = kernel_chunk if kernel_chunk is not None else min(512, _round_up(nc1, _LANES))
        kcl = kernel_chunk if kernel_chunk is not None else min(512, _round_up(max(ncl, 1), _LANES))
        if kc1 % _LANES:
            raise ValueError(f"kernel_chunk={kernel_chunk} must be a multiple of {_LANES} on tpu")
    if tq < 1:
        raise ValueError(f"q_tile={q_tile} must be positive")
    n_tiles = _cdiv(t, tq)
    tp = n_tiles * tq
    rows = tq * gp

    # per-row visible counts [b, tiles, rows, 1]; padded tokens and padded heads see nothing
    def per_row(cnt):
        c = jnp.pad(cnt.astype(jnp.int32), ((0, 0), (0, tp - t)))
        c = jnp.broadcast_to(c.reshape(b, n_tiles, tq, 1), (b, n_tiles, tq, gp))
        c = jnp.where(jnp.arange(gp) < g, c, 0)
        return c.reshape(b, n_tiles, rows, 1)

    rc1, rcl = per_row(cnt1), per_row(cntl)
    qr = jnp.pad(q.reshape(b, t, nkv, g, d), ((0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, dp - d)))
    qr = qr.transpose(0, 2, 1, 3, 4).reshape(b, nkv, n_tiles, rows, dp)
    k1 = _chunk_keys(ck1, kc1, dp)
    kl = k1 if (p.variant == "gen1" and kcl == kc1) else _chunk_keys(ckl, kcl, dp)
    n1, nl = k1.shape[2] // kc1, kl.shape[2] // kcl
    # TPU: fp32 kernel output (single-row stores of a packed bf16 tile are avoided), one cast in XLA
    out_shape = jax.ShapeDtypeStruct((b, nkv, n_tiles, tq, n1 * kc1), out_dtype if triton else jnp.float32)

    from jax.experimental import pallas as pl

    if triton:
        from jax.experimental.pallas import triton as pltriton

        cparams = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
        cells = b * nkv * n_tiles
        if split_chunks is None:  # automatic: split only a grid too small to fill the GPU (decode)
            small = cells < _SPLIT_MAX_CELLS and n1 > 1 and n1 + nl >= _SPLIT_MIN_CHUNKS
            split = min(n1, _cdiv(_SPLIT_TARGET_PROGRAMS, cells)) if small else 0
        else:
            split = split_chunks
        if split >= 2 and max(n1, nl) >= 2:
            out = _triton_split(rcl, rc1, qr, kl, k1, split=split, kcl=kcl, kc1=kc1, tq=tq, gp=gp, scale=scale,
                                cdt=cdt, out_dtype=out_dtype, cparams=cparams, interpret=interpret)
            return out.reshape(b, nkv, tp, out.shape[-1])[:, :, :t, :nc1]
        kernel = functools.partial(_triton_kernel, kcl=kcl, kc1=kc1, tq=tq, gp=gp, scale=scale, cdt=cdt)
        cnt_spec = pl.BlockSpec((None, None, rows, 1), lambda bi, hi, ti: (bi, ti, 0, 0))
        out = pl.pallas_call(
            kernel,
            grid=(b, nkv, n_tiles),
            in_specs=[cnt_spec, cnt_spec,
                      pl.BlockSpec((None, None, None, rows, dp), lambda bi, hi, ti: (bi, hi, ti, 0, 0)),
                      pl.BlockSpec((None, None, nl * kcl, dp), lambda bi, hi, ti: (bi, hi, 0, 0)),
                      pl.BlockSpec((None, None, n1 * kc1, dp), lambda bi, hi, ti: (bi, hi, 0, 0))],
            out_specs=pl.BlockSpec((None, None, None, tq, n1 * kc1), lambda bi, hi, ti: (bi, hi, ti, 0, 0)),
            out_shape=out_shape,
            compiler_params=cparams,
            interpret=interpret,
            name="infllmv2_stage1_triton",
        )(rcl, rc1, qr, kl, k1)
    else:
        from jax.experimental.pallas import tpu as pltpu

        # chunks each tile needs: [b, tiles, 2] (LSE keys, fine keys), flattened for SMEM
        need = jnp.stack([(jnp.max(rcl[..., 0], axis=-1) + kcl - 1) // kcl,
                          (jnp.max(rc1[..., 0], axis=-1) + kc1 - 1) // kc1], axis=-1).astype(jnp.int32)

        def kl_map(bi, hi, ti, c, need_ref):
            last = jnp.maximum(need_ref[2 * (bi * n_tiles + ti)] - 1, 0)
            return bi, hi, jnp.minimum(c, last), 0

        def k1_map(bi, hi, ti, c, need_ref):
            last = jnp.maximum(need_ref[2 * (bi * n_tiles + ti) + 1] - 1, 0)
            return bi, hi, jnp.clip(c - nl, 0, last), 0

        cnt_spec = pl.BlockSpec((None, None, rows, 1), lambda bi, hi, ti, c, *_: (bi, ti, 0, 0))
        kernel = functools.partial(_tpu_kernel, n_lse=nl, kcl=kcl, kc1=kc1, tq=tq, gp=gp, n_tiles=n_tiles,
                                   scale=scale, cdt=cdt)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, nkv, n_tiles, nl + n1),
            in_specs=[cnt_spec, cnt_spec,
                      pl.BlockSpec((None, None, None, rows, dp), lambda bi, hi, ti, c, *_: (bi, hi, ti, 0, 0)),
                      pl.BlockSpec((None, None, kcl, dp), kl_map),
                      pl.BlockSpec((None, None, kc1, dp), k1_map)],
            out_specs=pl.BlockSpec((None, None, None, tq, kc1),
                                   lambda bi, hi, ti, c, *_: (bi, hi, ti, 0, jnp.maximum(c - nl, 0))),
            scratch_shapes=[pltpu.VMEM((rows, _LANES), jnp.float32), pltpu.VMEM((rows, _LANES), jnp.float32)],
        )
        out = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret,
            name="infllmv2_stage1_tpu",
        )(need.reshape(-1), rcl, rc1, qr, kl, k1)
    return out.reshape(b, nkv, tp, n1 * kc1)[:, :, :t, :nc1].astype(out_dtype)
