"""Mosaic TPU kernels of the block-sparse attention (forward, dq, dk/dv); use through
:func:`minicpm4_jax.ops.pallas.sparse_attention.block_sparse_attention` (``backend="tpu"``).

Layouts (``rows = tokens_per_tile * G``, ``G`` the padded group; a *unit* is one (batch, KV head) pair,
``U = b * h``; the caller passes ``q``-like ``[b, h, n*rows, d]``, ``k``-like ``[b, h, NB*bs, d]``,
``qpos [b, n*rows]``, ``kvpos [b, NB*bs]``, ``lse``/``delta [b, h, n*rows]``, reshaped here for free):

* ``q``, ``do``, ``o``, ``dq``: ``[U, n_tiles * rows, d]``, row ``r`` of tile ``i`` is token ``r // G``,
  query head ``r % G``; ``k``, ``v``, ``dk``, ``dv``: ``[U, NB * bs, d]``;
* forward / dq: ``qpos`` ``[b, n_tiles * rows, 1]`` int32 (``-1`` = dead row), ``kvpos`` ``[b, NB, 1, bs]``
  int32 (invisible keys = int32 max), ``lse``/``delta`` ``[U, n_tiles * rows, 1]`` f32 (columns, like paged
  attention's ``m``/``l``);
* dk/dv works transposed (logits ``[bs, rows]``, as splash's dkv kernel, so every matmul is NN or NT):
  ``qpos`` ``[b, n_tiles, 1, rows]``, ``kvpos`` ``[b, NB * bs, 1]``, ``lse``/``delta`` ``[U, n_tiles, 1, rows]``.

Forward and dq run on the grid ``(unit, tile, slot)``, the slot axis "arbitrary": the K/V block of a slot
comes from the scalar-prefetched forward list (unused slots repeat the last valid id, so no new DMA, and
their compute is skipped with ``pl.when``); the softmax state / dq accumulator lives in VMEM scratch. dk/dv
runs on ``(unit, entry)`` over the inverse (CSR) list: the entries of one KV block are consecutive, so its
output block is revisited on consecutive steps; per-entry flags mark the first / last step of a run of
equal block ids (load / store the accumulator) and the valid entries (compute).

SMEM bound: scalar-prefetched arrays live in SMEM, so each ``pallas_call`` gets at most
``cfg.prefetch_entries`` list entries per array; larger problems are cut into chunks (units x tiles for
forward / dq, units x entries for dk/dv) run by ``lax.map`` / ``lax.scan``. Forward / dq chunks write
their own output slices; dk/dv chunks accumulate into float32 ``dk``/``dv`` buffers passed through
``input_output_aliases`` (each visited output block is loaded at the first step of its run and stored at
the last one, so blocks a chunk does not visit keep their value, and a block split over two chunks adds
up). Block shapes: ``rows`` and ``bs`` multiples of 16, ``d`` the full head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minicpm4_jax.ops.pallas import sparse_attention as cm

__all__ = ["fwd", "dq", "dkv", "FIRST", "LAST", "VALID"]

FIRST, LAST, VALID = 1, 2, 4


def _tpu():
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415 (not imported at package import)

    return pltpu


def _bidx(u, nkv: int):
    """Batch index of unit ``u`` (non-negative: truncating division; ``//`` lowers through ``sign``)."""
    return lax.div(u, jnp.int32(nkv))


def _largest_divisor(n: int, cap: int) -> int:
    cap = max(1, min(n, cap))
    return next(c for c in range(cap, 0, -1) if n % c == 0)


# ----------------------------------------------------------------------------------------------- kernels
def _fwd_kernel(off_ref, blocks_ref, counts_ref, words_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, o_ref,
                lse_ref, m_sc, l_sc, acc_sc, *, scale, ct, m, log2g):
    ul, il, ji = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = ul * ct + il

    @pl.when(ji == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(ji < counts_ref[row])
    def _step():
        mask = cm.row_mask(qpos_ref[...], kvpos_ref[...], words_ref[row * m + ji], log2g)
        m_new, l_new, acc_new = cm.online_update(q_ref[...], k_ref[...], v_ref[...], mask, scale,
                                                 m_sc[...], l_sc[...], acc_sc[...])
        m_sc[...] = m_new
        l_sc[...] = l_new
        acc_sc[...] = acc_new

    @pl.when(ji == m - 1)
    def _fin():
        o, lse = cm.finalize(m_sc[...], l_sc[...], acc_sc[...])
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse


def _dq_kernel(off_ref, blocks_ref, counts_ref, words_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, do_ref,
               lse_ref, delta_ref, dq_ref, dq_sc, *, scale, ct, m, log2g):
    ul, il, ji = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = ul * ct + il

    @pl.when(ji == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(ji < counts_ref[row])
    def _step():
        mask = cm.row_mask(qpos_ref[...], kvpos_ref[...], words_ref[row * m + ji], log2g)
        k = k_ref[...]
        _, ds = cm.probs_and_ds(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask, scale)
        dq_sc[...] += lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32) * scale

    @pl.when(ji == m - 1)
    def _fin():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(off_ref, iblk_ref, itile_ref, iword_ref, iflag_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref,
                do_ref, lse_ref, delta_ref, dk_in_ref, dv_in_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, scale, ce,
                log2g):
    ul, ei = pl.program_id(0), pl.program_id(1)
    at = ul * ce + ei
    flag = iflag_ref[at]

    @pl.when((flag & FIRST) != 0)
    def _load():
        dk_sc[...] = dk_in_ref[...]
        dv_sc[...] = dv_in_ref[...]

    @pl.when((flag & VALID) != 0)
    def _step():
        mask_t = cm.col_mask(kvpos_ref[...], qpos_ref[...], iword_ref[at], log2g)
        q, do = q_ref[...], do_ref[...]
        p_t, ds_t = cm.probs_and_ds_t(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask_t, scale)
        nn = (((1,), (0,)), ((), ()))
        dv_sc[...] += lax.dot_general(p_t.astype(do.dtype), do, nn, preferred_element_type=jnp.float32)
        dk_sc[...] += lax.dot_general(ds_t.astype(q.dtype), q, nn, preferred_element_type=jnp.float32) * scale

    @pl.when((flag & LAST) != 0)
    def _store():
        dk_ref[...] = dk_sc[...]
        dv_ref[...] = dv_sc[...]


# ----------------------------------------------------------------------------------------------- callers
def _params(sem):
    return _tpu().CompilerParams(dimension_semantics=sem)


def _row_chunks(cfg, nu):
    """``(cu, ct)``: units and tiles per forward/dq call with ``cu * ct * m <= prefetch_entries``."""
    nt, m, budget = cfg.n_tiles, cfg.max_blocks, cfg.prefetch_entries
    if nt * m <= budget:
        return _largest_divisor(nu, budget // (nt * m)), nt
    return 1, _largest_divisor(nt, budget // m)


def _row_call(kernel_fn, extra_in, out_defs, scratch, q, k, v, qpos, kvpos, lists, cfg, interpret, name):
    """Run a forward-like kernel over chunks of (unit, tile); returns outputs as ``[U, n*rows, *]``."""
    pltpu = _tpu()
    b, nkv, tr, d = q.shape
    nu, nt, m, rows, bs = b * nkv, cfg.n_tiles, cfg.max_blocks, cfg.rows, cfg.block_size
    cu, ct = _row_chunks(cfg, nu)
    nuc, ntc = nu // cu, nt // ct
    q3, k3, v3 = q.reshape(nu, tr, d), k.reshape(nu, -1, d), v.reshape(nu, -1, d)
    qpos3, kvpos4 = qpos.reshape(b, tr, 1), kvpos.reshape(b, -1, 1, bs)

    def chunked(x, per):  # [U, nt, per] -> [n_chunks, cu * ct * per]
        x = x.reshape(nuc, cu, ntc, ct, per).transpose(0, 2, 1, 3, 4)
        return x.reshape(nuc * ntc, cu * ct * per)

    blocks = chunked(lists.blocks.reshape(nu, nt, m), m)
    counts = chunked(lists.counts.reshape(nu, nt, 1), 1)
    words = chunked(lists.words.reshape(nu, nt, m), m)
    uo, to = jnp.meshgrid(jnp.arange(nuc, dtype=jnp.int32) * cu, jnp.arange(ntc, dtype=jnp.int32) * ct,
                          indexing="ij")
    offs = jnp.stack([uo.reshape(-1), to.reshape(-1)], axis=-1)  # [n_chunks, 2]

    def unit(ul, off):
        return off[0] + ul

    def tile(il, off):
        return off[1] + il

    def blk(ul, il, j, off, blocks_, *_):
        return blocks_[(ul * ct + il) * m + j]

    def qmap(ul, il, j, off, *r):
        return (unit(ul, off), tile(il, off), 0)

    q_spec = pl.BlockSpec((None, rows, d), qmap)
    kv_spec = pl.BlockSpec((None, bs, d), lambda ul, il, j, off, *r: (unit(ul, off), blk(ul, il, j, off, *r), 0))
    qpos_spec = pl.BlockSpec((None, rows, 1),
                             lambda ul, il, j, off, *r: (_bidx(unit(ul, off), nkv), tile(il, off), 0))
    kvpos_spec = pl.BlockSpec((None, None, 1, bs),
                              lambda ul, il, j, off, *r: (_bidx(unit(ul, off), nkv), blk(ul, il, j, off, *r), 0, 0))
    stat_spec = pl.BlockSpec((None, rows, 1), qmap)
    extra_specs = [q_spec if x.shape[-1] == d else stat_spec for x in extra_in]
    out_specs = [pl.BlockSpec((None, rows, w), lambda ul, il, j, off, *r: (ul, il, 0)) for w, _ in out_defs]
    out_shape = [jax.ShapeDtypeStruct((cu, ct * rows, w), dt) for w, dt in out_defs]
    kernel = functools.partial(kernel_fn, scale=cfg.scale, ct=ct, m=m, log2g=cfg.log2g)
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(cu, ct, m),
            in_specs=[q_spec, kv_spec, kv_spec, qpos_spec, kvpos_spec, *extra_specs],
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret, name=name)

    def one(xs):
        off, bl, cn, wd = xs
        return tuple(call(off, bl, cn, wd, q3, k3, v3, qpos3, kvpos4, *extra_in))

    xs = (offs, blocks, counts, words)
    if nuc * ntc == 1:  # one call: no loop
        outs = tuple(o[None] for o in one(tuple(x[0] for x in xs)))
    else:
        outs = lax.map(one, xs)
    res = []
    for o, (w, _) in zip(outs, out_defs):  # [n_chunks, cu, ct*rows, w] -> [U, nt*rows, w]
        o = o.reshape(nuc, ntc, cu, ct * rows, w).transpose(0, 2, 1, 3, 4)
        res.append(o.reshape(nu, nt * rows, w))
    return res


def fwd(q, k, v, qpos, kvpos, lists, *, cfg, interpret):
    """Forward: ``(o [b, h, n*rows, d] q.dtype, lse [b, h, n*rows] f32)``."""
    pltpu = _tpu()
    b, nkv, tr, d = q.shape
    rows = cfg.rows
    scratch = [pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
               pltpu.VMEM((rows, d), jnp.float32)]
    o, lse = _row_call(_fwd_kernel, [], [(d, q.dtype), (1, jnp.float32)], scratch, q, k, v, qpos, kvpos, lists,
                       cfg, interpret, "infllmv2_sparse_fwd_tpu")
    return o.reshape(q.shape), lse.reshape(b, nkv, tr)


def dq(q, k, v, qpos, kvpos, do, lse, delta, lists, *, cfg, interpret):
    """dq ``[b, h, n*rows, d]`` in q.dtype over the forward lists."""
    pltpu = _tpu()
    b, nkv, tr, d = q.shape
    nu = b * nkv
    extra = [do.reshape(nu, tr, d), lse.reshape(nu, tr, 1), delta.reshape(nu, tr, 1)]
    (dq_,) = _row_call(_dq_kernel, extra, [(d, q.dtype)], [pltpu.VMEM((cfg.rows, d), jnp.float32)], q, k, v,
                       qpos, kvpos, lists, cfg, interpret, "infllmv2_sparse_dq_tpu")
    return dq_.reshape(q.shape)


def dkv(q, k, v, qpos, kvpos, do, lse, delta, lists, *, cfg, interpret):
    """``(dk, dv)`` ``[b, h, NB*bs, d]`` in k.dtype over the inverse lists (zero for unselected blocks)."""
    pltpu = _tpu()
    b, nkv, tr, d = q.shape
    s = k.shape[2]
    nu, nt, rows, bs = b * nkv, cfg.n_tiles, cfg.rows, cfg.block_size
    ne = lists.inv_blocks.shape[-1]
    budget = cfg.prefetch_entries
    if ne <= budget:
        cu, ce = _largest_divisor(nu, budget // ne), ne
    else:
        cu, ce = 1, min(ne, budget)
    nep = -(-ne // ce) * ce
    nuc, nec = nu // cu, nep // ce

    iblk = lists.inv_blocks.reshape(nu, ne)
    itile = lists.inv_tiles.reshape(nu, ne)
    iword = lists.inv_words.reshape(nu, ne)
    total = lists.inv_offsets.reshape(nu, -1)[:, -1:]
    if nep > ne:  # pad entries with repeats of the last one (same output block: no extra run)
        iblk, itile = (jnp.pad(x, ((0, 0), (0, nep - ne)), mode="edge") for x in (iblk, itile))
        iword = jnp.pad(iword, ((0, 0), (0, nep - ne)))
    e = jnp.arange(nep, dtype=jnp.int32)
    el = e % ce  # position inside its chunk
    valid = e < total
    first = (el == 0) | (iblk != jnp.roll(iblk, 1, axis=-1))
    last = (el == ce - 1) | (iblk != jnp.roll(iblk, -1, axis=-1))
    flags = (jnp.where(first, FIRST, 0) | jnp.where(last, LAST, 0) | jnp.where(valid, VALID, 0)).astype(jnp.int32)

    def chunked(x):  # [U, nep] -> [n_chunks, cu * ce]
        return x.reshape(nuc, cu, nec, ce).transpose(0, 2, 1, 3).reshape(nuc * nec, cu * ce)

    xs_lists = tuple(chunked(x) for x in (iblk, itile, iword, flags))
    offs = jnp.repeat(jnp.arange(nuc, dtype=jnp.int32) * cu, nec)[:, None]  # [n_chunks, 1]

    q3, do3 = q.reshape(nu, tr, d), do.reshape(nu, tr, d)
    k3, v3 = k.reshape(nu, s, d), v.reshape(nu, s, d)
    qpos4, kvpos3 = qpos.reshape(b, nt, 1, rows), kvpos.reshape(b, s, 1)
    lse4, delta4 = lse.reshape(nu, nt, 1, rows), delta.reshape(nu, nt, 1, rows)

    def unit(ul, off):
        return off[0] + ul

    def blk(ul, e_, iblk_):
        return iblk_[ul * ce + e_]

    def tile(ul, e_, itile_):
        return itile_[ul * ce + e_]

    q_spec = pl.BlockSpec((None, rows, d), lambda ul, e_, off, ib, it, *r: (unit(ul, off), tile(ul, e_, it), 0))
    kv_spec = pl.BlockSpec((None, bs, d), lambda ul, e_, off, ib, *r: (unit(ul, off), blk(ul, e_, ib), 0))
    qpos_spec = pl.BlockSpec((None, None, 1, rows),
                             lambda ul, e_, off, ib, it, *r: (_bidx(unit(ul, off), nkv), tile(ul, e_, it), 0, 0))
    kvpos_spec = pl.BlockSpec((None, bs, 1),
                              lambda ul, e_, off, ib, *r: (_bidx(unit(ul, off), nkv), blk(ul, e_, ib), 0))
    stat_spec = pl.BlockSpec((None, None, 1, rows),
                             lambda ul, e_, off, ib, it, *r: (unit(ul, off), tile(ul, e_, it), 0, 0))
    kernel = functools.partial(_dkv_kernel, scale=cfg.scale, ce=ce, log2g=cfg.log2g)
    n_pref = 5
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_pref, grid=(cu, ce),
            in_specs=[q_spec, kv_spec, kv_spec, qpos_spec, kvpos_spec, q_spec, stat_spec, stat_spec, kv_spec,
                      kv_spec],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bs, d), jnp.float32), pltpu.VMEM((bs, d), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((nu, s, d), jnp.float32)] * 2,
        input_output_aliases={n_pref + 8: 0, n_pref + 9: 1},  # dk_in -> dk, dv_in -> dv (operand indices)
        compiler_params=_params(("parallel", "arbitrary")),
        interpret=interpret, name="infllmv2_sparse_dkv_tpu")

    def step(carry, xs):
        off, ib, it, iw, fl = xs
        dk_acc, dv_acc = carry
        return tuple(call(off, ib, it, iw, fl, q3, k3, v3, qpos4, kvpos3, do3, lse4, delta4, dk_acc, dv_acc)), None

    zeros = jnp.zeros((nu, s, d), jnp.float32)
    xs = (offs, *xs_lists)
    if nuc * nec == 1:
        dk_, dv_ = step((zeros, zeros), tuple(x[0] for x in xs))[0]
    else:
        (dk_, dv_), _ = lax.scan(step, (zeros, zeros), xs)
    return dk_.reshape(k.shape).astype(k.dtype), dv_.reshape(v.shape).astype(v.dtype)
