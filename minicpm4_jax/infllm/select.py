"""InfLLM v2 block selection (stage 1, pooling, top-k), spec ``minicpm4_model.md`` §5.2-§5.4.

Pure functions of arrays; everything here runs without gradient (callers wrap the inputs in
``jax.lax.stop_gradient``; the outputs are integer indices). Per (sequence, KV head, query token) the
pipeline is:

1. **Stage-1 scores** (§5.2). Logits ``z = scale * q . ck1[j]`` against the fine compressed keys of the
   query head's KV head. Kernel ``j`` is visible to a query at position ``p`` iff it ends at or before
   ``p``: ``st*j + ks - 1 <= p`` (clean rule, default). ``p[j] = exp(z_j - lse)`` on visible kernels,
   exactly ``0`` elsewhere, with ``lse`` the log-sum-exp of

   * gen-1: the visible *fine* logits (an exact softmax over kernels);
   * gen-2: the visible *coarse* (``4*ks``/``4*st``) logits (the "LSE approximation"; not normalised
     over ``j``). A row with no visible coarse kernel has ``lse = -inf`` and so ``+inf`` on its visible
     fine kernels (the official kernel divides by a zero sum); with the official geometry such rows
     (``p < 4*ks - 1``) only touch forced blocks. No NaN is ever produced (field fault B23).

   The scores of the ``G`` query heads of a KV group are summed in float32 ->
   ``S[b, h, t, j]``, then cast to ``score_dtype`` (float32 by default; ``bfloat16`` reproduces the
   official storage, whose rounding creates ties).
2. **Max-pooling onto blocks** (§5.3): block ``b`` takes the max over every kernel overlapping it,
   ``j in [ (Bk*b - ks + 1)/st , (Bk*b + Bk - 1)/st ]`` (``[4b-1, 4b+3]`` for 32/16/64, the official
   ``max_pool(kernel 5, stride 4, padding 1)``), ``-inf`` if none exists. Forcing with
   ``q_blk = p // Bk`` and ``L = window_size // block_size``:

   * gen-2: ``+inf`` for ``b < init_blocks`` or ``q_blk - L <= b <= q_blk``;
   * gen-1: ``+inf`` for ``b < init_blocks``, else ``-inf`` for ``q_blk - L < b <= q_blk`` (those blocks
     come from the stage-2 window).

   Other blocks keep their pooled score clamped to the largest finite value of ``score_dtype``, so a
   forced block wins every tie: a ``+inf`` pooled score (step 1's rows without a coarse kernel, reachable
   outside the official geometry, e.g. small blocks with ``dense_len`` below the coarse kernel) would
   otherwise tie with the forced ``+inf`` and the lower-index rule could push a forced block (even the
   query's own) out of the top-k, where the official kernel's tie order is unspecified.
3. **Top-k** (§5.4) over the ``NB = ceil(kv_len / Bk)`` blocks with ``K = min(K_cfg, NB)`` (gen-2
   ``K_cfg = topk + L``, gen-1 ``K_cfg = topk``); ties go to the lower block index (``lax.top_k``).
   A pick is invalid if (gen-2) ``b > q_blk`` / (gen-1) ``b >= q_blk``, or if its pooled score is
   ``-inf`` (a block without kernels or a gen-1 window block; the official tensor keeps the latter,
   which only duplicates a window block, so the attended set is the same).

**Selection format** (consumed by stage 2, the Pallas kernels and the decode path):
``topk_idx`` int32 ``[batch, num_kv_heads, T, K_cfg]``: per row the valid block indices in ascending
order, then the single sentinel ``-1`` in every unused slot (``K_cfg - K`` columns are always ``-1``);
``counts`` int32 ``[batch, num_kv_heads, T]`` = number of valid entries. Gen-1's stage 2 additionally
attends the window blocks ``max(0, q_blk - L + 1) .. q_blk`` that are not already in ``topk_idx``
(:func:`selection_block_mask` builds the full attended-block mask).

Kernel off-by-one quirk (§5.2, §8.5): with ``kernel_offby1_quirk=True`` and ``T > 1`` the visible
kernel count of a row follows the official ``infllmv2_attn_stage1`` mask,
``count = floor((r + 1 - ks)/st) + Nk - floor((T + 1 - ks)/st)`` clipped to ``[0, Nk]`` (``r`` the row
index bottom-right aligned to the sequence's ``kv_len``, ``Nk`` its kernel count), for fine and coarse
kernels alike. For ``T = N`` this drops the last visible kernel of every row exactly when
``N = 15 mod 16`` (fine) / ``N = 63 mod 64`` (coarse). ``T = 1`` (decode) is non-causal in the official
code, which equals the clean rule. Default off: the clean rule keeps cached decoding equal to a full
forward.

Positions: query rows carry absolute positions (``cache_len .. cache_len + T - 1`` with a cache); the kv
axis index must equal the token position (contiguous, right-padded). Padding query rows may use
position ``-1`` (they select nothing).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from minicpm4_jax.config import SparseConfig, gen2_topk_reason
from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
from minicpm4_jax.ops.tiling import query_tiles

__all__ = [
    "SelectParams",
    "Selection",
    "select_params",
    "visible_kernel_count",
    "query_rows",
    "stage1_scores",
    "stage1_scores_causal",
    "pool_block_scores",
    "topk_blocks",
    "select_blocks",
    "select_blocks_compressed",
    "selection_scores",
    "selection_block_mask",
    "SENTINEL",
]

#: The one sentinel for unused ``topk_idx`` slots.
SENTINEL = -1


@dataclasses.dataclass(frozen=True)
class SelectParams:
    """Static, resolved selection geometry (hashable; safe as a ``jit`` static argument).

    ``topk_cfg`` is the column count of ``topk_idx`` (gen-2: ``topk + window//block``; gen-1:
    ``topk``); ``local_blocks = window_size // block_size``; ``score_dtype``: ``"float32"`` |
    ``"bfloat16"``.
    """

    kernel_size: int
    kernel_stride: int
    coarse_size: int
    coarse_stride: int
    block_size: int
    init_blocks: int
    local_blocks: int
    topk_cfg: int
    variant: str
    kernel_offby1_quirk: bool = False
    score_dtype: str = "float32"


def select_params(cfg: SparseConfig, *, kernel_offby1_quirk: bool = False,
                  score_dtype: str = "float32") -> SelectParams:
    """Resolve a :class:`~minicpm4_jax.config.SparseConfig` into :class:`SelectParams`.

    Raises:
        ValueError: unknown ``variant`` / ``score_dtype``, or a geometry the algorithm cannot express
            (block_size or kernel_size not a multiple of kernel_stride, window not a multiple of
            block_size, no window with gen-1, non-positive sizes, a gen-2 ``topk`` below ``init_blocks + 1``:
            its forced blocks would not fit, and top-k would drop the query's own block).
    """
    if cfg.variant not in ("gen1", "gen2"):
        raise ValueError(f"sparse_config.variant={cfg.variant!r}; use 'gen1' or 'gen2'")
    if score_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"score_dtype={score_dtype!r}; use 'float32' or 'bfloat16'")
    for nm in ("kernel_size", "kernel_stride", "block_size", "topk"):
        if getattr(cfg, nm) <= 0:
            raise ValueError(f"sparse_config.{nm}={getattr(cfg, nm)} must be positive")
    if cfg.block_size % cfg.kernel_stride or cfg.kernel_size % cfg.kernel_stride:
        raise ValueError(f"block_size={cfg.block_size} and kernel_size={cfg.kernel_size} must be multiples "
                         f"of kernel_stride={cfg.kernel_stride}")
    if cfg.window_size < 0 or cfg.window_size % cfg.block_size:
        raise ValueError(f"window_size={cfg.window_size} must be a non-negative multiple of "
                         f"block_size={cfg.block_size}")
    if cfg.window_size == 0 and cfg.variant == "gen1":
        # gen-1 invalidates a query's own block, so block-0 queries would select nothing while stage 2 still
        # forces the init block (gen-2 without a window is consistent)
        raise ValueError(f"window_size=0 with variant='gen1': gen-1 needs a local window of at least "
                         f"block_size={cfg.block_size} (its own block)")
    if cfg.variant == "gen2" and cfg.topk < cfg.init_blocks + 1:
        raise ValueError(f"sparse_config.topk={cfg.topk} with init_blocks={cfg.init_blocks}: {gen2_topk_reason(cfg)}")
    local = cfg.window_size // cfg.block_size
    k_cfg = cfg.topk + local if cfg.variant == "gen2" else cfg.topk
    cks, cst = coarse_geometry(cfg.kernel_size, cfg.kernel_stride)
    return SelectParams(cfg.kernel_size, cfg.kernel_stride, cks, cst, cfg.block_size, cfg.init_blocks,
                        local, k_cfg, cfg.variant, bool(kernel_offby1_quirk), score_dtype)


class Selection(NamedTuple):
    """Per-token block selection (see the module docstring for the exact format).

    Attributes:
        topk_idx: int32 ``[batch, num_kv_heads, T, topk_cfg]``; valid block ids ascending, then ``-1``.
        counts: int32 ``[batch, num_kv_heads, T]``; number of valid entries per row.
    """

    topk_idx: jax.Array
    counts: jax.Array


def _floordiv(a, b: int):
    return jnp.floor_divide(a, b)


def query_rows(q_positions: jax.Array) -> jax.Array:
    """The quirk's ``num_q`` of each sequence: its query rows (``q_positions >= 0``), int32 ``[batch]``.

    The official kernel runs each sequence of a varlen batch with its own ``Nq`` (spec §5.2), so a right-padded
    sequence counts its live rows, not the padded ``T`` of the call.
    """
    return jnp.sum(q_positions >= 0, axis=1, dtype=jnp.int32)


def visible_kernel_count(q_positions: jax.Array, kv_len: jax.Array, num_q: int | jax.Array, num_k: int,
                         kernel_size: int, kernel_stride: int, quirk: bool = False) -> jax.Array:
    """Number of kernels visible to each query row (kernel ``j`` is visible iff ``j < count``).

    Args:
        q_positions: int ``[batch, T]`` absolute query positions (``-1`` = padding row).
        kv_len: int ``[batch]`` keys per sequence (cache + new), used by the quirk only.
        num_q: query rows of the call (quirk only): a static ``T`` shared by every sequence, or int ``[batch]``
            per sequence (:func:`query_rows`, what the selection passes: a right-padded sequence's own rows).
        num_k: static number of kernels over the kv axis (upper clip).
        kernel_size, kernel_stride: kernel geometry.
        quirk: reproduce the official off-by-one (module docstring); ignored for a sequence with ``num_q == 1``
            (decode is non-causal in the official code, which is the clean rule).

    Returns:
        int32 ``[batch, T]`` in ``[0, num_k]``. Clean rule: ``#{j : st*j + ks - 1 <= p}``.
    """
    p = q_positions.astype(jnp.int32)
    clean = _floordiv(p + 1 - kernel_size, kernel_stride) + 1
    static_one = isinstance(num_q, int) and num_q <= 1
    if quirk and not static_one:
        nq = jnp.asarray(num_q, jnp.int32)
        nq = nq[:, None] if nq.ndim else nq
        kv_len = kv_len.astype(jnp.int32)[:, None]
        nk_seq = jnp.maximum(_floordiv(kv_len - kernel_size, kernel_stride) + 1, 0)
        r = p - (kv_len - nq)  # row index, bottom-right aligned
        cnt = (_floordiv(r + 1 - kernel_size, kernel_stride) + nk_seq
               - _floordiv(nq + 1 - kernel_size, kernel_stride))
        cnt = jnp.minimum(cnt, nk_seq)
        cnt = jnp.where(p < 0, 0, jnp.where(nq > 1, cnt, clean))
    else:
        cnt = clean
    return jnp.clip(cnt, 0, num_k).astype(jnp.int32)


def _masked_lse(z: jax.Array, vis: jax.Array) -> jax.Array:
    """log-sum-exp over the last axis restricted to ``vis``; ``-inf`` for an empty set (never NaN)."""
    zm = jnp.where(vis, z, -jnp.inf)
    m = jnp.max(zm, axis=-1, keepdims=True) if z.shape[-1] else jnp.full(z.shape[:-1] + (1,), -jnp.inf, z.dtype)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.sum(jnp.exp(zm - m_safe), axis=-1, keepdims=True)
    return jnp.where(s > 0, jnp.log(jnp.where(s > 0, s, 1.0)) + m_safe, -jnp.inf)


def _grouped_queries(q: jax.Array, ck1: jax.Array, scale: float | None, num_q: int | None):
    """``(q [b, t, kv_heads, group, d], logit scale, num_q)`` with stage 1's defaults and head-count check."""
    b, t, nq, d = q.shape
    nkv = ck1.shape[2]
    if nq % nkv:
        raise ValueError(f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    return q.reshape(b, t, nkv, nq // nkv, d), d**-0.5 if scale is None else scale, t if num_q is None else num_q


def _scores(qg: jax.Array, ck: jax.Array, scale) -> jax.Array:
    """fp32 scaled query-to-kernel logits ``[b, kv, t, group, kernels]`` of grouped queries ``qg``."""
    return jnp.einsum("btkgd,bjkd->bktgj", qg, ck, preferred_element_type=jnp.float32) * scale


def _coarse_lse(qg, ck2, q_positions, kv_len, num_q: int, p: SelectParams, scale) -> jax.Array:
    """Gen-2's softmax normaliser ``[b, kv, t, group, 1]``: the logsumexp over the visible coarse kernels
    (``-inf`` for a row without one)."""
    nc2 = ck2.shape[1]
    cnt2 = visible_kernel_count(q_positions, kv_len, num_q, nc2, p.coarse_size, p.coarse_stride,
                                p.kernel_offby1_quirk)
    vis2 = (jnp.arange(nc2, dtype=jnp.int32)[None, None, :] < cnt2[:, :, None])[:, None, :, None, :]
    return _masked_lse(_scores(qg, ck2, scale), vis2)


def stage1_scores(q: jax.Array, ck1: jax.Array, ck2: jax.Array | None, *, q_positions: jax.Array,
                  kv_len: jax.Array, params: SelectParams, scale: float | None = None,
                  num_q: int | None = None) -> jax.Array:
    """Stage-1 query->kernel scores summed over each KV group's query heads (§5.2).

    Args:
        q: ``[batch, T, num_heads, head_dim]`` selection queries (post-RoPE unless use_nope).
        ck1: ``[batch, Nc1, num_kv_heads, head_dim]`` fine compressed keys (:func:`compress_keys`).
        ck2: ``[batch, Nc2, num_kv_heads, head_dim]`` coarse compressed keys (gen-2; ignored by gen-1).
        q_positions: int ``[batch, T]``.
        kv_len: int ``[batch]`` keys per sequence (quirk only).
        params: :class:`SelectParams`.
        scale: logit scale, default ``head_dim ** -0.5``.
        num_q: query rows of the whole call when ``q`` is a tile of it (quirk only): ``T``, or int ``[batch]``
            per sequence (:func:`query_rows`); default ``q.shape[1]``.

    Returns:
        ``[batch, num_kv_heads, T, Nc1]`` in ``params.score_dtype``; exactly 0 on invisible kernels,
        ``+inf`` on visible kernels of gen-2 rows without a visible coarse kernel, never NaN.
    """
    qg, scale, num_q = _grouped_queries(q, ck1, scale, num_q)
    p = params
    nc1 = ck1.shape[1]
    # Scores are laid out [b, kv, t, head, kernel]: the head sum then adds contiguous rows, and the visibility
    # mask (the same for every head of a token) is applied once, to the sum. With [b, kv, head, t, kernel] and
    # the mask on every exp, XLA:CPU's fusion of the exp and the head sum ran ~4.5x slower (a 128-query tile
    # against 2047 kernels: 53 ms against 12 ms) and dominated the selection at long lengths.
    z1 = _scores(qg, ck1, scale)
    cnt1 = visible_kernel_count(q_positions, kv_len, num_q, nc1, p.kernel_size, p.kernel_stride,
                                p.kernel_offby1_quirk)
    vis1 = jnp.arange(nc1, dtype=jnp.int32)[None, None, :] < cnt1[:, :, None]  # [b, t, j]
    if p.variant == "gen1":
        lse = _masked_lse(z1, vis1[:, None, :, None, :])
    else:
        if ck2 is None:
            raise ValueError("gen2 stage 1 needs the coarse compressed keys ck2")
        lse = _coarse_lse(qg, ck2, q_positions, kv_len, num_q, p, scale)
    # z1 is finite and lse is finite or -inf, so z1 - lse is never NaN: an overflow to +inf on an invisible kernel
    # is masked below, on a visible one it is the documented +inf of a row without coarse kernels.
    s = jnp.sum(jnp.exp(z1 - lse), axis=3)  # [b, nkv, t, nc1], fp32 sum over the group's heads
    s = jnp.where(vis1[:, None], s, 0.0)
    return s.astype(jnp.dtype(p.score_dtype))


def stage1_scores_causal(q: jax.Array, ck1: jax.Array, ck2: jax.Array | None, *, q_positions: jax.Array,
                         kv_len: jax.Array, params: SelectParams, scale: float | None = None,
                         num_q: int | None = None, chunk: int = 256) -> jax.Array:
    """:func:`stage1_scores` computing only the fine kernels the rows can see, in chunks of ``chunk``
    kernels: a ``lax.fori_loop`` over ``ceil(max visible / chunk)`` chunks; the others stay 0 (invisible).

    Same arguments and result as :func:`stage1_scores` (gen-2 only: gen-1's softmax normaliser is over the
    fine kernels themselves). A query tile at position ``p`` of a ``T``-token prefill sees about ``p /
    kernel_stride`` of the ``T / kernel_stride`` kernels, so a whole prefill does about half the products and
    exponentials of the untiled rule (the 8B layout at 32K, 2-core CPU: ``docs/benchmarks.md``).

    Raises:
        ValueError: a gen-1 ``params``, missing ``ck2``, or ``num_heads`` not a multiple of the KV heads.
    """
    if params.variant != "gen2" or ck2 is None:
        raise ValueError("stage1_scores_causal is for gen-2 selection (with ck2); use stage1_scores")
    qg, scale, num_q = _grouped_queries(q, ck1, scale, num_q)
    p = params
    b, t, nkv = q.shape[0], q.shape[1], ck1.shape[2]
    nc1 = ck1.shape[1]
    lse = _coarse_lse(qg, ck2, q_positions, kv_len, num_q, p, scale)
    cnt1 = visible_kernel_count(q_positions, kv_len, num_q, nc1, p.kernel_size, p.kernel_stride,
                                p.kernel_offby1_quirk)  # [b, t]
    c = max(1, min(chunk, nc1))
    n_chunks = -(-nc1 // c)
    ck1p = jnp.pad(ck1, [(0, 0), (0, n_chunks * c - nc1), (0, 0), (0, 0)])

    def body(i, s):
        ckc = jax.lax.dynamic_slice_in_dim(ck1p, i * c, c, axis=1)  # [b, c, kv, d]
        e = jnp.sum(jnp.exp(_scores(qg, ckc, scale) - lse), axis=3)  # [b, kv, t, c], never NaN
        vis = (i * c + jnp.arange(c, dtype=jnp.int32))[None, None, :] < cnt1[:, :, None]  # [b, t, c]
        return jax.lax.dynamic_update_slice_in_dim(s, jnp.where(vis[:, None], e, 0.0), i * c, axis=3)

    need = (jnp.max(cnt1) + c - 1) // c  # chunks holding a visible kernel of some row
    s = jax.lax.fori_loop(0, need, body, jnp.zeros((b, nkv, t, n_chunks * c), jnp.float32))
    return s[..., :nc1].astype(jnp.dtype(p.score_dtype))


def pool_block_scores(scores: jax.Array, *, q_positions: jax.Array, num_blocks: int,
                      params: SelectParams) -> jax.Array:
    """Max-pool kernel scores onto KV blocks and apply the variant's forcing (§5.3).

    Args:
        scores: ``[batch, num_kv_heads, T, Nc1]`` from :func:`stage1_scores`.
        q_positions: int ``[batch, T]``.
        num_blocks: static ``NB = ceil(kv_axis_len / block_size)``.
        params: :class:`SelectParams`.

    Returns:
        ``[batch, num_kv_heads, T, NB]`` in ``scores.dtype``: ``+inf`` forced, ``-inf`` for blocks
        without kernels (and gen-1 window blocks), else the max over the overlapping kernels.
    """
    p = params
    nc1 = scores.shape[-1]
    r = p.block_size // p.kernel_stride
    lo = (p.kernel_size - 1) // p.kernel_stride  # kernels starting before the block that overlap it
    width = r * num_blocks
    neg = jnp.array(-jnp.inf, scores.dtype)
    pad_right = lo + max(nc1, width) - (lo + nc1)
    padded = jnp.pad(scores, [(0, 0)] * 3 + [(lo, pad_right)], constant_values=neg)
    pooled = None
    for o in range(-lo, r):
        sl = jax.lax.slice_in_dim(padded, lo + o, lo + o + width - (r - 1), stride=r, axis=3)
        pooled = sl if pooled is None else jnp.maximum(pooled, sl)
    blk = jnp.arange(num_blocks, dtype=jnp.int32)[None, None, None, :]
    qb = _floordiv(q_positions.astype(jnp.int32), p.block_size)[:, None, :, None]
    init = blk < p.init_blocks
    inf = jnp.array(jnp.inf, scores.dtype)
    pooled = jnp.minimum(pooled, jnp.array(jnp.finfo(scores.dtype).max, scores.dtype))  # forced blocks win ties
    if p.variant == "gen2":
        forced = init | ((blk >= qb - p.local_blocks) & (blk <= qb))
        return jnp.where(forced, inf, pooled)
    window = (blk > qb - p.local_blocks) & (blk <= qb)
    return jnp.where(init, inf, jnp.where(window, neg, pooled))


def topk_blocks(block_scores: jax.Array, *, q_positions: jax.Array, params: SelectParams) -> Selection:
    """Top-k of the pooled block scores with K clamped, invalidation and the ``-1`` sentinel (§5.4).

    Args:
        block_scores: ``[batch, num_kv_heads, T, NB]`` from :func:`pool_block_scores` (no NaN).
        q_positions: int ``[batch, T]``.
        params: :class:`SelectParams`.

    Returns:
        :class:`Selection` with ``topk_idx`` ``[batch, num_kv_heads, T, params.topk_cfg]``.
    """
    p = params
    nb = block_scores.shape[-1]
    k_sel = min(p.topk_cfg, nb)
    qb = _floordiv(q_positions.astype(jnp.int32), p.block_size)[:, None, :, None]
    vals, idx = jax.lax.top_k(block_scores, k_sel)
    idx = idx.astype(jnp.int32)
    late = (idx > qb) if p.variant == "gen2" else (idx >= qb)
    invalid = late | (vals == -jnp.inf)
    big = jnp.int32(2**30)
    srt = jnp.sort(jnp.where(invalid, big, idx), axis=-1)
    out = jnp.where(srt == big, SENTINEL, srt)
    counts = jnp.sum(~invalid, axis=-1).astype(jnp.int32)
    if k_sel < p.topk_cfg:
        out = jnp.pad(out, [(0, 0)] * 3 + [(0, p.topk_cfg - k_sel)], constant_values=SENTINEL)
    return Selection(out, counts)


def _compressed(k_sel: jax.Array, params: SelectParams):
    ck1 = compress_keys(k_sel, params.kernel_size, params.kernel_stride)
    ck2 = compress_keys(k_sel, params.coarse_size, params.coarse_stride) if params.variant == "gen2" else None
    return ck1, ck2


def _stage1(impl: str, q, ck1, ck2, **kw) -> jax.Array:
    """:func:`stage1_scores` (``impl="xla"``) or its Pallas kernel (``"pallas"``, :mod:`minicpm4_jax.ops.dispatch`)."""
    if impl == "xla":
        if kw["params"].variant == "gen2" and ck2 is not None and ck1.shape[1] > 256:
            return stage1_scores_causal(q, ck1, ck2, **kw)  # only the kernels the tile can see
        return stage1_scores(q, ck1, ck2, **kw)
    if impl != "pallas":
        raise ValueError(f"impl={impl!r}; use 'xla' or 'pallas'")
    from minicpm4_jax.ops.dispatch import on_mesh, pallas_target
    from minicpm4_jax.ops.pallas.stage1 import stage1_scores_pallas

    backend, interpret = pallas_target()
    qpos, kv_len = kw.pop("q_positions"), kw.pop("kv_len")
    num_q = kw.pop("num_q", None)
    rows = None if num_q is None or isinstance(num_q, int) else num_q  # per sequence: sharded with the batch

    def kernel(q_, ck1_, ck2_, qpos_, kv_len_, rows_):
        return stage1_scores_pallas(q_, ck1_, ck2_, q_positions=qpos_, kv_len=kv_len_, backend=backend,
                                    interpret=interpret, num_q=num_q if rows_ is None else rows_, **kw)

    return on_mesh(kernel, (q, ck1, ck2, qpos, kv_len, rows), ("b.h.", "b.h.", "b.h.", "b.", "b", "b"), "bh..")


def _default_kv_len(q_positions: jax.Array) -> jax.Array:
    return (jnp.max(q_positions, axis=1) + 1).astype(jnp.int32)


def selection_scores(q: jax.Array, k: jax.Array, *, q_positions: jax.Array, params: SelectParams,
                     kv_len: jax.Array | None = None, scale: float | None = None) -> dict[str, jax.Array]:
    """Untiled stage-1 -> pooling -> top-k, returning every intermediate (tests, plots; small T only).

    Args:
        q: ``[batch, T, num_heads, head_dim]``; k: ``[batch, kv_len_axis, num_kv_heads, head_dim]``.
        q_positions: int ``[batch, T]``; kv_len: int ``[batch]`` (default ``max(q_positions) + 1``).

    Returns:
        dict with ``ck1``, ``ck2`` (gen-2), ``scores`` ``[b, nkv, T, Nc1]``, ``block_scores``
        ``[b, nkv, T, NB]``, ``topk_idx``, ``counts``. Memory ``O(T * Nc1 * heads)``.
    """
    kv_len = _default_kv_len(q_positions) if kv_len is None else kv_len
    ck1, ck2 = _compressed(k, params)
    nb = -(-k.shape[1] // params.block_size)
    s = stage1_scores(q, ck1, ck2, q_positions=q_positions, kv_len=kv_len, params=params, scale=scale)
    bs = pool_block_scores(s, q_positions=q_positions, num_blocks=nb, params=params)
    sel = topk_blocks(bs, q_positions=q_positions, params=params)
    out = dict(ck1=ck1, scores=s, block_scores=bs, topk_idx=sel.topk_idx, counts=sel.counts)
    if ck2 is not None:
        out["ck2"] = ck2
    return out


def select_blocks(q: jax.Array, k: jax.Array, *, q_positions: jax.Array, params: SelectParams,
                  kv_len: jax.Array | None = None, scale: float | None = None, q_tile: int = 128,
                  impl: str = "xla") -> Selection:
    """Stage 1 + pooling + top-k fused per query tile (the memory-bounded production path).

    Never materialises more than one tile's ``[batch, num_heads, q_tile, Nc1]`` scores: the tiles run
    sequentially under ``jax.lax.map`` and only ``topk_idx`` (``O(T * K)``) is kept, so the peak is
    ``O(q_tile * heads * T / stride)`` and the total work ``O(T * T / stride)``.

    Args:
        q: ``[batch, T, num_heads, head_dim]`` selection queries; k: ``[batch, kv_axis, num_kv_heads,
            head_dim]`` selection keys (post-RoPE, or pre-RoPE when use_nope). Call under
            ``jax.lax.stop_gradient`` (the output is integer anyway).
        q_positions: int ``[batch, T]`` absolute positions (a per-sequence cache offset is fine; T = 1
            decode works).
        params: :class:`SelectParams`.
        kv_len: int ``[batch]`` keys per sequence, default ``max(q_positions) + 1`` (quirk only).
        scale: stage-1 logit scale, default ``head_dim ** -0.5``.
        q_tile: query rows per tile (clamped to T; T is padded with position ``-1`` rows).
        impl: stage-1 scoring by the XLA reference (``"xla"``) or the Pallas kernel (``"pallas"``, which keeps
            the per-head scores out of HBM; pooling and top-k stay XLA).

    Returns:
        :class:`Selection` (``topk_idx`` int32 ``[batch, num_kv_heads, T, topk_cfg]``, ``counts``).
    """
    ck1, ck2 = _compressed(k, params)
    nb = -(-k.shape[1] // params.block_size)
    return select_blocks_compressed(q, ck1, ck2, q_positions=q_positions, params=params, num_blocks=nb,
                                    kv_len=kv_len, scale=scale, q_tile=q_tile, impl=impl)


def select_blocks_compressed(q: jax.Array, ck1: jax.Array, ck2: jax.Array | None, *, q_positions: jax.Array,
                             params: SelectParams, num_blocks: int, kv_len: jax.Array | None = None,
                             scale: float | None = None, q_tile: int = 128, impl: str = "xla") -> Selection:
    """:func:`select_blocks` from already compressed keys (a KV cache's incremental ``ck1``/``ck2``).

    Args:
        q: ``[batch, T, num_heads, head_dim]`` selection queries.
        ck1: ``[batch, Nc1_axis, num_kv_heads, head_dim]`` fine compressed keys; rows at or beyond a
            sequence's kernel count may hold anything (they are never visible, spec §5.2 causal rule).
        ck2: ``[batch, Nc2_axis, num_kv_heads, head_dim]`` coarse compressed keys (gen-2), else ``None``.
        q_positions: int ``[batch, T]`` absolute positions (``-1`` = padding row).
        params: :class:`SelectParams`.
        num_blocks: static ``NB`` of the kv axis (``ceil(kv_axis / block_size)``).
        kv_len, scale, q_tile, impl: as in :func:`select_blocks`.

    Returns:
        :class:`Selection` (``topk_idx`` int32 ``[batch, num_kv_heads, T, topk_cfg]``, ``counts``).
    """
    b, t, nq, d = q.shape
    kv_len = _default_kv_len(q_positions) if kv_len is None else kv_len.astype(jnp.int32)
    nb = num_blocks
    # the quirk's row count: each sequence's own rows (a right-padded one has fewer than T)
    num_q = query_rows(q_positions) if params.kernel_offby1_quirk and t > 1 else t
    tile = max(1, min(q_tile, t))
    qp, pp = query_tiles(q, q_positions, tile)
    n_tiles = qp.shape[0]

    def one(args):
        q_t, pos_t = args
        s = _stage1(impl, q_t, ck1, ck2, q_positions=pos_t, kv_len=kv_len, params=params, scale=scale, num_q=num_q)
        bs = pool_block_scores(s, q_positions=pos_t, num_blocks=nb, params=params)
        return topk_blocks(bs, q_positions=pos_t, params=params)

    sel = jax.lax.map(one, (qp, pp))  # leaves [n_tiles, b, nkv, tile, ...]
    nkv = ck1.shape[2]
    idx = sel.topk_idx.transpose(1, 2, 0, 3, 4).reshape(b, nkv, n_tiles * tile, -1)[:, :, :t]
    cnt = sel.counts.transpose(1, 2, 0, 3).reshape(b, nkv, n_tiles * tile)[:, :, :t]
    return Selection(idx, cnt)


def selection_block_mask(topk_idx: jax.Array, *, q_positions: jax.Array, num_blocks: int, block_size: int,
                         window_blocks: int = 0) -> jax.Array:
    """Dense ``[batch, num_kv_heads, T, num_blocks]`` bool mask of the blocks stage 2 attends.

    ``topk_idx`` entries (``-1`` ignored) plus, for gen-1 (``window_blocks = L > 0``), the window
    ``max(0, q_blk - L + 1) .. q_blk`` with ``q_blk = q_positions // block_size``. Rows at position
    ``-1`` get no window. For tests and plots (``O(T * NB)`` memory).
    """
    blk = jnp.arange(num_blocks, dtype=jnp.int32)
    m = jnp.any(topk_idx[..., None] == blk, axis=-2)
    if window_blocks:
        pos = q_positions.astype(jnp.int32)
        qb = _floordiv(pos, block_size)[:, None, :, None]
        win = (blk > qb - window_blocks) & (blk <= qb) & (pos >= 0)[:, None, :, None]
        m = m | win
    return m
