"""Block-sparse flash attention for InfLLM v2 stage 2 in Pallas (forward + backward), TPU and GPU (Triton).

Spec ``minicpm4_model.md`` §5.5 (the math), ``jax_stack.md`` §2.1 (the design: scalar-prefetched per-tile
block lists, query tile = a few tokens x all query heads of a KV group), issue 4. The result equals
:func:`minicpm4_jax.ops.infllm_ref.infllmv2_stage2` (the XLA reference and fallback): each query head
attends, with token-level causality ``kv_position <= q_position``, the keys of its KV head in the union
of the group's ``topk_idx`` blocks, the ``init_blocks`` first blocks and the ``window_blocks`` blocks
ending at its own block; ``kv_valid`` masks keys; a row with no visible key (and a padding row,
``q_position = -1``) returns zeros.

Pipeline (:func:`block_sparse_attention`):

1. :func:`~minicpm4_jax.ops.pallas.block_lists.build_block_lists` (XLA) turns the per-token selection
   into per-(batch, KV head, query tile) sorted block lists + membership bit words, and their inverse
   (CSR by KV block) for dk/dv.
2. Queries are laid out as ``[b, kv_heads, n_tiles * rows, d]`` with ``rows = tokens_per_tile * G``
   (row = token-major, head-minor; the group is padded to a power of two with zero heads whose rows are
   masked), keys/values as ``[b, kv_heads, NB * block_size, d]``.
3. Forward kernel (``sparse_tpu.fwd`` / ``sparse_triton.fwd``): per tile, online softmax (fp32) over the
   tile's listed blocks with the per-row mask ``token attends block & kv_pos <= q_pos & q_pos >= 0``;
   returns the output and the row logsumexp.
4. Backward (``jax.custom_vjp``): ``delta = rowsum(dO * O)`` in XLA, a dq kernel over the same lists and
   a dk/dv kernel over the inverse lists (each program owns one KV block and visits the tiles that
   selected it; blocks no tile selected get zero gradients).

Backends: ``"tpu"`` (Mosaic TPU: ``PrefetchScalarGridSpec``, VMEM scratch, grid ``(b, h, tile, slot)``
with the slot axis "arbitrary") and ``"triton"`` (Pallas Triton lowering for NVIDIA GPUs: grid
``(b, h, tile)``, the slot loop is an in-kernel ``lax.fori_loop`` of dynamic length; head_dim padded to
a power of two). Both run on CPU with ``interpret=True`` (and the TPU one under
``pltpu.InterpretParams``). Nothing TPU/GPU-specific is imported by this module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from minicpm4_jax.ops.attention_ref import check_qkv
from minicpm4_jax.ops.pallas.block_lists import BlockLists, build_block_lists, max_blocks_bound

__all__ = ["block_sparse_attention", "SparseConfig", "default_tokens_per_tile", "BACKENDS"]

BACKENDS = ("tpu", "triton")
_BIG = jnp.iinfo(jnp.int32).max


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Static kernel configuration (hashable; a ``custom_vjp`` non-differentiable argument)."""

    backend: str
    scale: float
    block_size: int
    rows: int  # tokens_per_tile * padded group
    n_tiles: int
    max_blocks: int
    log2g: int  # log2 of the padded group
    interpret: Any = False
    num_warps: int = 4
    num_stages: int = 2
    prefetch_entries: int = 8192  # TPU: max list entries per scalar-prefetch (SMEM) array per pallas_call


# --------------------------------------------------------------------------- kernel math shared by backends
def row_mask(qpos, kvpos, word, log2g: int):
    """Visibility ``[rows, bs]``: token ``row >> log2g`` attends the block (bit of ``word``), causality, live row.

    ``qpos`` int32 ``[rows, 1]``, ``kvpos`` int32 ``[1, bs]`` (int32 max = invisible), ``word`` int32 scalar.
    """
    rows = qpos.shape[0]
    tok = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) >> log2g
    bit = (jnp.full((rows, 1), word, jnp.int32) >> tok) & 1  # arithmetic shift: bit 31 reads right too
    return (kvpos <= qpos) & (bit != 0) & (qpos >= 0)


def col_mask(kvpos, qpos, word, log2g: int):
    """Transposed :func:`row_mask`: ``[bs, rows]`` from ``kvpos [bs, 1]`` and ``qpos [1, rows]`` (dk/dv on TPU)."""
    rows = qpos.shape[1]
    tok = lax.broadcasted_iota(jnp.int32, (1, rows), 1) >> log2g
    bit = (jnp.full((1, rows), word, jnp.int32) >> tok) & 1
    return (kvpos <= qpos) & (bit != 0) & (qpos >= 0)


def _dot(a, b, ca: int, cb: int):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=jnp.float32)


def online_update(q, k, v, mask, scale: float, m_prev, l_prev, acc_prev):
    """One online-softmax step over a KV block; state ``m, l [rows, 1]``, ``acc [rows, d]`` (fp32)."""
    s = jnp.where(mask, _dot(q, k, 1, 1) * scale, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    corr = jnp.exp(m_prev - m_safe)
    l_new = corr * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_new = corr * acc_prev + _dot(p.astype(v.dtype), v, 1, 0)
    return m_new, l_new, acc_new


def finalize(m, l, acc):
    """``(o [rows, d] f32, lse [rows, 1])``; empty rows: ``o = 0``, ``lse = +inf`` (so ``exp(s - lse) = 0``)."""
    empty = l == 0.0
    o = acc / jnp.where(empty, 1.0, l)
    lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
    return o, lse


def probs_and_ds(q, k, v, do, lse, delta, mask, scale: float):
    """Backward pieces of one (tile, block) pair: ``p`` and ``ds = p * (dO v^T - delta)`` ``[rows, bs]`` fp32."""
    s = _dot(q, k, 1, 1) * scale
    p = jnp.where(mask, jnp.exp(s - lse), 0.0)
    dp = _dot(do, v, 1, 1)
    return p, p * (dp - delta)


def probs_and_ds_t(q, k, v, do, lse, delta, mask_t, scale: float):
    """Transposed :func:`probs_and_ds` (``[bs, rows]``; ``lse``/``delta`` ``[1, rows]``): no transposed matmul
    operand is needed for ``dv = p^T dO`` and ``dk = ds^T q``."""
    s_t = _dot(k, q, 1, 1) * scale
    p_t = jnp.where(mask_t, jnp.exp(s_t - lse), 0.0)
    dp_t = _dot(v, do, 1, 1)
    return p_t, p_t * (dp_t - delta)


# --------------------------------------------------------------------------- custom_vjp core
def _backend(cfg: SparseConfig):
    if cfg.backend == "tpu":
        from minicpm4_jax.ops.pallas import sparse_tpu as mod  # noqa: PLC0415
    else:
        from minicpm4_jax.ops.pallas import sparse_triton as mod  # noqa: PLC0415
    return mod


def _fwd_impl(cfg: SparseConfig, q, k, v, qpos, kvpos, lists: BlockLists):
    o, lse = _backend(cfg).fwd(q, k, v, qpos, kvpos, lists, cfg=cfg, interpret=cfg.interpret)
    return o, lse.reshape(q.shape[:3])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, qpos, kvpos, lists):
    return _fwd_impl(cfg, q, k, v, qpos, kvpos, lists)[0]


def _core_fwd(cfg, q, k, v, qpos, kvpos, lists):
    o, lse = _fwd_impl(cfg, q, k, v, qpos, kvpos, lists)
    return o, (q, k, v, qpos, kvpos, lists, o, lse)


def _core_bwd(cfg, res, do):
    q, k, v, qpos, kvpos, lists, o, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [b, h, rows_total]
    mod = _backend(cfg)
    dq = mod.dq(q, k, v, qpos, kvpos, do, lse, delta, lists, cfg=cfg, interpret=cfg.interpret)
    dk, dv = mod.dkv(q, k, v, qpos, kvpos, do, lse, delta, lists, cfg=cfg, interpret=cfg.interpret)
    return dq, dk, dv, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------- public entry
def default_tokens_per_tile(num_tokens: int, group: int, backend: str = "tpu") -> int:
    """Tokens per query tile: ``rows // G`` (``G`` padded to a power of two), at most 32, at least enough for 16
    rows, and no more than ``T`` needs (powers of two). ``rows`` is 128 on TPU (one MXU tile) and 64 on Triton:
    the H200 sweep of 2026-11-29 (MiniCPM4-8B layout, G = 16, d = 128, bf16, T = 32K; docs/benchmarks.md) timed
    4 tokens per tile at 21.8 ms forward / 76 ms forward + backward against 24.3 / 152 ms with 8 (a smaller tile
    also walks a smaller union of its tokens' selected blocks)."""
    gp = _next_pow2(group)
    lo = max(1, 16 // gp)
    tq = min(32, max(lo, (64 if backend == "triton" else 128) // gp))
    return max(lo, min(tq, _next_pow2(num_tokens)))


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, topk_idx: jax.Array, *,
                           q_positions: jax.Array, kv_positions: jax.Array, block_size: int,
                           window_blocks: int = 0, init_blocks: int = 0, kv_valid: jax.Array | None = None,
                           scale: float | None = None, backend: str = "tpu", interpret: Any = False,
                           tokens_per_tile: int | None = None, max_blocks: int | None = None,
                           num_warps: int = 4, num_stages: int = 2, tpu_prefetch_entries: int = 8192) -> jax.Array:
    """InfLLM v2 stage-2 block-sparse attention as Pallas kernels (§5.5), differentiable in q, k, v.

    Same layout, semantics and result as :func:`minicpm4_jax.ops.infllm_ref.infllmv2_stage2` (module
    docstring). ``topk_idx`` and the positions are never differentiated.

    Args:
        q: ``[batch, T, num_heads, head_dim]`` post-RoPE queries (float32 or bfloat16).
        k, v: ``[batch, kv_len, num_kv_heads, head_dim]``; kv index = token position (block ``j`` = kv
            indices ``[j * block_size, (j + 1) * block_size)``).
        topk_idx: int ``[batch, num_kv_heads, T, K]`` block ids, ``-1`` unused
            (:class:`~minicpm4_jax.infllm.select.Selection` format); ids ``>= ceil(kv_len / block_size)``
            are ignored.
        q_positions: int ``[batch, T]`` (``-1`` = padding row -> zeros).
        kv_positions: int ``[batch, kv_len]``; key ``s`` is visible iff ``kv_positions[s] <= q_position``.
        block_size: KV block size, a power of two ``>= 16`` (64 for MiniCPM4).
        window_blocks: forced window ``q_blk - window_blocks + 1 .. q_blk`` (0 = none).
        init_blocks: forced first blocks (0 = none).
        kv_valid: optional bool ``[batch, kv_len]`` (False = invisible key).
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: ``"tpu"`` (Mosaic TPU) or ``"triton"`` (Pallas Triton lowering, NVIDIA GPU).
        interpret: ``False`` (compile for the backend), ``True`` (Pallas HLO interpreter, any host), or for
            ``"tpu"`` a ``pltpu.InterpretParams`` (TPU interpret mode, e.g. with race detection).
        tokens_per_tile: query tokens per tile, a power of two in ``[1, 32]`` with
            ``tokens_per_tile * next_pow2(G) >= 16``; default :func:`default_tokens_per_tile`.
        max_blocks: static per-tile list length; default the exact bound
            :func:`~minicpm4_jax.ops.pallas.block_lists.max_blocks_bound` ``min(NB, tq * (K + window) + init)``.
            A smaller value only shortens the TPU grid; it must bound the real per-tile union (blocks past
            it are dropped), e.g. ``jnp.max(build_block_lists(...).counts)`` measured on concrete data.
        num_warps, num_stages: Triton compiler parameters.
        tpu_prefetch_entries: TPU only: the most list entries one ``pallas_call`` scalar-prefetches into SMEM
            per array (4 arrays of int32); larger problems run as several calls (``sparse_tpu`` docstring).

    Returns:
        ``[batch, T, num_heads, head_dim]`` in ``q.dtype`` (fp32 softmax and accumulation).

    Raises:
        ValueError: unknown backend, mismatched shapes, ``block_size`` not a power of two ``>= 16``, bad
            ``tokens_per_tile`` / ``max_blocks`` / negative forced blocks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
    b, t, nq, d, s, nkv = check_qkv(q, k, v, q_positions, kv_positions, kv_valid)
    if topk_idx.ndim != 4 or topk_idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, T={t}, K]")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two >= 16")
    if min(window_blocks, init_blocks) < 0:
        raise ValueError(f"window_blocks={window_blocks}, init_blocks={init_blocks} must be >= 0")
    if t == 0 or s == 0:
        raise ValueError(f"empty input: T={t}, kv_len={s}")
    g = nq // nkv
    gp = _next_pow2(g)
    tq = default_tokens_per_tile(t, g, backend) if tokens_per_tile is None else int(tokens_per_tile)
    if not 1 <= tq <= 32 or tq & (tq - 1) or tq * gp < 16:
        raise ValueError(f"tokens_per_tile={tokens_per_tile} must be a power of two in [1, 32] with "
                         f"tokens_per_tile * {gp} (padded group) >= 16")
    nb = -(-s // block_size)
    kk = topk_idx.shape[-1]
    m = max_blocks_bound(tq, kk, nb, init_blocks=init_blocks, window_blocks=window_blocks) \
        if max_blocks is None else int(max_blocks)
    if m < 1:
        raise ValueError(f"max_blocks={max_blocks} must be >= 1")
    if tpu_prefetch_entries < 1:
        raise ValueError(f"tpu_prefetch_entries={tpu_prefetch_entries} must be >= 1")
    scale = d**-0.5 if scale is None else float(scale)
    nt = -(-t // tq)
    tp, sp = nt * tq, nb * block_size
    dp = _next_pow2(d) if backend == "triton" else d

    lists = build_block_lists(lax.stop_gradient(topk_idx), q_positions, block_size=block_size, num_blocks=nb,
                              tokens_per_tile=tq, init_blocks=init_blocks, window_blocks=window_blocks,
                              max_blocks=m)
    lists = lists._replace(counts=jnp.minimum(lists.counts, m))

    # layouts: q rows [b, h, tp * gp, dp]; k/v [b, h, sp, dp]
    qr = jnp.pad(q.reshape(b, t, nkv, g, d), ((0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, dp - d)))
    qr = qr.transpose(0, 2, 1, 3, 4).reshape(b, nkv, tp * gp, dp)

    def kv_layout(x):
        return jnp.pad(x, ((0, 0), (0, sp - s), (0, 0), (0, dp - d))).transpose(0, 2, 1, 3)

    kr, vr = kv_layout(k), kv_layout(v)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
    qpos = jnp.where(jnp.arange(gp) < g, pos[:, :, None], -1).reshape(b, tp * gp)  # padded heads: dead rows
    kvp = kv_positions.astype(jnp.int32)
    if kv_valid is not None:
        kvp = jnp.where(kv_valid.astype(bool), kvp, _BIG)
    kvpos = jnp.pad(kvp, ((0, 0), (0, sp - s)), constant_values=_BIG)

    cfg = SparseConfig(backend=backend, scale=scale, block_size=block_size, rows=tq * gp, n_tiles=nt,
                       max_blocks=m, log2g=gp.bit_length() - 1, interpret=interpret, num_warps=num_warps,
                       num_stages=num_stages, prefetch_entries=int(tpu_prefetch_entries))
    o = _core(cfg, qr, kr, vr, qpos, kvpos, lists)  # [b, h, tp * gp, dp]
    o = o.reshape(b, nkv, tp, gp, dp)[:, :, :t, :g, :d].transpose(0, 2, 1, 3, 4)
    return o.reshape(b, t, nq, d).astype(q.dtype)
