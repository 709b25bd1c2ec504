"""Pallas Triton-lowering kernels (NVIDIA GPU) of the block-sparse attention (forward, dq, dk/dv); use through
:func:`minicpm4_jax.ops.pallas.sparse_attention.block_sparse_attention` (``backend="triton"``).

The Triton lowering has no scalar prefetch and no scratch, and its grid programs run in parallel, so:

* forward / dq: grid ``(b, h, tile)``; each program keeps its tile's ``[rows, d]`` queries and its fp32
  state in registers and walks its block list in a ``lax.fori_loop`` of dynamic length ``count``, loading
  each K/V block with a dynamic slice of the whole ``[NB * bs, d]`` K/V of its head;
* dk/dv: grid ``(b, h, kv_block)``; each program owns one KV block and loops over the CSR range
  ``inv_offsets[j] .. inv_offsets[j + 1]`` of the inverse list (the tiles that selected it), loading
  those tiles' queries, dO, lse and delta; a block no tile selected writes zeros.

Every loaded array has power-of-two sizes: ``rows = tokens_per_tile * G`` (``G`` padded), ``bs`` and the
head dim (padded by the caller). Layouts as in :mod:`minicpm4_jax.ops.pallas.sparse_attention`:
``q``-like ``[b, h, n*rows, d]``, ``k``-like ``[b, h, NB*bs, d]``, ``qpos [b, n*rows]``, ``kvpos [b, NB*bs]``,
``lse``/``delta [b, h, n*rows]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minicpm4_jax.ops.pallas import sparse_attention as cm

__all__ = ["fwd", "dq", "dkv"]


def _params(cfg):
    from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415 (not imported at package import)

    return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _fwd_kernel(blocks_ref, counts_ref, words_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, o_ref, lse_ref, *,
                scale, bs, log2g):
    count = counts_ref[pl.program_id(2)]
    q = q_ref[...]
    rows, d = q.shape
    qpos = qpos_ref[...][:, None]

    def body(j, carry):
        blk = blocks_ref[j]
        kv_slice = pl.ds(pl.multiple_of(blk * bs, bs), bs)
        mask = cm.row_mask(qpos, kvpos_ref[kv_slice][None, :], words_ref[j], log2g)
        return cm.online_update(q, k_ref[kv_slice, :], v_ref[kv_slice, :], mask, scale, *carry)

    init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    m, l, acc = lax.fori_loop(0, count, body, init)
    o, lse = cm.finalize(m, l, acc)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


def _dq_kernel(blocks_ref, counts_ref, words_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, scale, bs, log2g):
    count = counts_ref[pl.program_id(2)]
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    qpos = qpos_ref[...][:, None]

    def body(j, dq):
        blk = blocks_ref[j]
        kv_slice = pl.ds(pl.multiple_of(blk * bs, bs), bs)
        mask = cm.row_mask(qpos, kvpos_ref[kv_slice][None, :], words_ref[j], log2g)
        k = k_ref[kv_slice, :]
        _, ds = cm.probs_and_ds(q, k, v_ref[kv_slice, :], do, lse, delta, mask, scale)
        return dq + cm._dot(ds.astype(k.dtype), k, 1, 0) * scale

    dq = lax.fori_loop(0, count, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(itile_ref, iword_ref, ioff_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, scale, rows, log2g):
    j = pl.program_id(2)
    start, stop = ioff_ref[j], ioff_ref[j + 1]
    k, v = k_ref[...], v_ref[...]
    kvpos = kvpos_ref[...][None, :]

    def body(e, carry):
        dk, dv = carry
        tile = itile_ref[e]
        rs = pl.ds(pl.multiple_of(tile * rows, rows), rows)
        q, do = q_ref[rs, :], do_ref[rs, :]
        mask = cm.row_mask(qpos_ref[rs][:, None], kvpos, iword_ref[e], log2g)
        p, ds = cm.probs_and_ds(q, k, v, do, lse_ref[rs][:, None], delta_ref[rs][:, None], mask, scale)
        dv = dv + cm._dot(p.astype(do.dtype), do, 0, 0)
        dk = dk + cm._dot(ds.astype(q.dtype), q, 0, 0) * scale
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(start, stop, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(cfg, d, nt, m):
    rows = cfg.rows
    lst = pl.BlockSpec((None, None, None, m), lambda b, h, i: (b, h, i, 0))
    cnt = pl.BlockSpec((None, None, nt), lambda b, h, i: (b, h, 0))
    q_spec = pl.BlockSpec((None, None, rows, d), lambda b, h, i: (b, h, i, 0))
    stat = pl.BlockSpec((None, None, rows), lambda b, h, i: (b, h, i))
    qpos = pl.BlockSpec((None, rows), lambda b, h, i: (b, i))
    return lst, cnt, q_spec, stat, qpos


def fwd(q, k, v, qpos, kvpos, lists, *, cfg, interpret):
    """Forward: ``(o [b, h, n*rows, d] q.dtype, lse [b, h, n*rows] f32)``."""
    b, nkv, tr, d = q.shape
    sp = k.shape[2]
    nt, m = cfg.n_tiles, cfg.max_blocks
    lst, cnt, q_spec, stat, qpos_spec = _specs(cfg, d, nt, m)
    kv_spec = pl.BlockSpec((None, None, sp, d), lambda b_, h, i: (b_, h, 0, 0))
    kvpos_spec = pl.BlockSpec((None, sp), lambda b_, h, i: (b_, 0))
    kernel = functools.partial(_fwd_kernel, scale=cfg.scale, bs=cfg.block_size, log2g=cfg.log2g)
    return pl.pallas_call(
        kernel, grid=(b, nkv, nt),
        in_specs=[lst, cnt, lst, q_spec, kv_spec, kv_spec, qpos_spec, kvpos_spec],
        out_specs=[q_spec, stat],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, nkv, tr), jnp.float32)],
        compiler_params=_params(cfg), interpret=interpret, name="infllmv2_sparse_fwd_triton",
    )(lists.blocks, lists.counts, lists.words, q, k, v, qpos, kvpos)


def dq(q, k, v, qpos, kvpos, do, lse, delta, lists, *, cfg, interpret):
    """dq ``[b, h, n*rows, d]`` in q.dtype."""
    b, nkv, tr, d = q.shape
    sp = k.shape[2]
    nt, m = cfg.n_tiles, cfg.max_blocks
    lst, cnt, q_spec, stat, qpos_spec = _specs(cfg, d, nt, m)
    kv_spec = pl.BlockSpec((None, None, sp, d), lambda b_, h, i: (b_, h, 0, 0))
    kvpos_spec = pl.BlockSpec((None, sp), lambda b_, h, i: (b_, 0))
    kernel = functools.partial(_dq_kernel, scale=cfg.scale, bs=cfg.block_size, log2g=cfg.log2g)
    return pl.pallas_call(
        kernel, grid=(b, nkv, nt),
        in_specs=[lst, cnt, lst, q_spec, kv_spec, kv_spec, qpos_spec, kvpos_spec, q_spec, stat, stat],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg), interpret=interpret, name="infllmv2_sparse_dq_triton",
    )(lists.blocks, lists.counts, lists.words, q, k, v, qpos, kvpos, do, lse, delta)


def dkv(q, k, v, qpos, kvpos, do, lse, delta, lists, *, cfg, interpret):
    """``(dk, dv)`` ``[b, h, NB*bs, d]`` in k.dtype (zero for blocks no tile selected)."""
    b, nkv, tr, d = q.shape
    sp = k.shape[2]
    bs = cfg.block_size
    nb = sp // bs
    ne = lists.inv_tiles.shape[-1]
    inv = pl.BlockSpec((None, None, ne), lambda b_, h, j: (b_, h, 0))
    off = pl.BlockSpec((None, None, nb + 1), lambda b_, h, j: (b_, h, 0))
    q_all = pl.BlockSpec((None, None, tr, d), lambda b_, h, j: (b_, h, 0, 0))
    stat_all = pl.BlockSpec((None, None, tr), lambda b_, h, j: (b_, h, 0))
    qpos_all = pl.BlockSpec((None, tr), lambda b_, h, j: (b_, 0))
    kv_blk = pl.BlockSpec((None, None, bs, d), lambda b_, h, j: (b_, h, j, 0))
    kvpos_blk = pl.BlockSpec((None, bs), lambda b_, h, j: (b_, j))
    kernel = functools.partial(_dkv_kernel, scale=cfg.scale, rows=cfg.rows, log2g=cfg.log2g)
    return pl.pallas_call(
        kernel, grid=(b, nkv, nb),
        in_specs=[inv, inv, off, q_all, kv_blk, kv_blk, qpos_all, kvpos_blk, q_all, stat_all, stat_all],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(cfg), interpret=interpret, name="infllmv2_sparse_dkv_triton",
    )(lists.inv_tiles, lists.inv_words, lists.inv_offsets, q, k, v, qpos, kvpos, do, lse, delta)
