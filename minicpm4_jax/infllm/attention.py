"""InfLLM v2 attention entry point: dense fallback, stage-1 selection, stage-2 sparse attention.

Spec ``minicpm4_model.md`` §5.0 (dispatch), §5.1-5.4 (selection, :mod:`minicpm4_jax.infllm.select`)
and §5.5 (stage 2, :func:`minicpm4_jax.ops.infllm_ref.infllmv2_stage2`, the kernels' reference).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from minicpm4_jax.config import SparseConfig
from minicpm4_jax.infllm.select import (SelectParams, Selection, select_blocks, select_blocks_compressed,
                                        select_params)
from minicpm4_jax.ops.attention_ref import check_qkv, dense_attention
from minicpm4_jax.ops.flash_xla import flash_attention
from minicpm4_jax.ops.infllm_ref import compact_topk, infllmv2_stage2, tiled_dense_attention

__all__ = ["attended_keys", "default_select_q_tile", "infllmv2_attention", "native_stage2", "stage2_forced_split"]


def stage2_forced_split(params: SelectParams, k_used: int) -> tuple[int, int, int]:
    """``(init_blocks, window_blocks, gather_width)`` for stage 2 given the selection guarantees.

    Stage 2 runs the forced blocks as dense slices and gathers only the other picks, in ``gather_width``
    columns that must bound every row's non-forced picks. What :func:`select_blocks` guarantees:

    * gen-2: the forced ``init`` and ``q_blk - L .. q_blk`` blocks (+inf scores) are all in the top
      ``K = k_used`` whenever they fit (``topk_cfg >= init + L + 1``), so at most ``K - init - L - 1`` picks
      are outside them (forced blocks win every tie, :func:`~minicpm4_jax.infllm.select.pool_block_scores`);
      stage 2 gets window ``L + 1``.
    * gen-1: the init blocks are in the top ``K`` (``topk_cfg >= init``), the window ``q_blk - L + 1 ..
      q_blk`` is never in it and is added by stage 2 (window ``L``): at most ``K - init`` other picks.

    When the forced blocks do not fit in ``topk_cfg`` the split is off (``init = 0``; gen-2 window 0), which
    keeps the attended set exactly the selection (gen-2: only a hand-built :class:`SelectParams`;
    :func:`~minicpm4_jax.infllm.select.select_params` refuses ``topk < init_blocks + 1``).
    """
    p = params
    if p.variant == "gen2":
        if p.topk_cfg < p.init_blocks + p.local_blocks + 1:
            return 0, 0, k_used
        return p.init_blocks, p.local_blocks + 1, max(0, k_used - p.init_blocks - p.local_blocks - 1)
    if p.topk_cfg < p.init_blocks:
        return 0, p.local_blocks, k_used
    return p.init_blocks, p.local_blocks, max(0, k_used - p.init_blocks)


def _native_picks(q_t, pos_t, idx_t, kc, vc, offset: int, *, first_pos, block_size: int, scale):
    """One query tile's non-forced picks by the native CPU kernel: ``(out, lse)`` (the ``gathered_fn`` of
    :func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2`), reading each picked block of the KV-major ``kc``/``vc``
    (key slot ``s`` at ``s + offset * block_size``) in place instead of gathering copies of them.

    The kernel sees key slots, not positions: a query at position ``p`` of a sequence whose keys hold the
    positions ``first_pos + s`` (``[batch]``; 0 for a prefill from scratch) sees the slots ``<= p - first_pos``,
    which is the reference's ``kv_position <= p`` for such contiguous keys."""
    from minicpm4_jax.ops import native  # noqa: PLC0415 (compiled at first use)

    rel = pos_t - first_pos[:, None]
    idx = jnp.where(idx_t >= 0, idx_t + offset, -1)
    pos = jnp.where((pos_t >= 0) & (rel >= 0), rel + offset * block_size, -1)
    return native.decode_attention(q_t, kc, vc, idx, q_positions=pos, block_size=block_size, window_blocks=0,
                                   init_blocks=0, gather_width=idx.shape[-1], scale=scale, return_lse=True)


def _check_geometry(geometry) -> dict:
    if not isinstance(geometry, tuple) or len(geometry) != 6:
        raise ValueError(f"geometry={geometry!r} must be (block_size, window_blocks, init_blocks, gather_width, "
                         "scale, q_tile)")
    block_size, window_blocks, init_blocks, gather_width, scale, q_tile = geometry
    if block_size < 1 or q_tile < 1 or min(window_blocks, init_blocks, gather_width) < 0:
        raise ValueError(f"geometry={geometry!r}: block_size and q_tile must be >= 1, the block counts >= 0")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale={scale!r} must be a Python number or None for the native stage 2; use impl='xla'")
    return dict(block_size=block_size, window_blocks=window_blocks, init_blocks=init_blocks,
                gather_width=gather_width, scale=scale, q_tile=q_tile)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def native_stage2(q, k, v, topk_idx, q_positions, kv_positions, geometry: tuple) -> jax.Array:
    """:func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2` with the non-forced picks attended by the native
    CPU kernel (the forced init/window blocks stay dense XLA slices); the backward is the reference's.

    On the 2-core CPU of ``docs/benchmarks.md`` the XLA reference gathered a copy of every token's 62 picked
    blocks before its products; the kernel reads them in place (~2.5 us per token, KV head and picked block
    in the 8B layout). Float32 on the CPU backend, every key slot valid (no ``kv_valid``), and, as for the
    reference, each sequence's keys at contiguous positions (``kv_positions[b, s] = kv_positions[b, 0] + s``;
    the kernel masks by slot). Reverse-mode first derivatives only (``jax.grad``/``vjp``): forward mode and
    higher orders need ``impl="xla"``.

    Args:
        q, k, v, topk_idx, q_positions, kv_positions: as :func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2`
            (float32).
        geometry: ``(block_size, window_blocks, init_blocks, gather_width, scale, q_tile)``, static; ``scale``
            a Python number or ``None``.

    Returns:
        ``[batch, T, num_heads, head_dim]`` float32.

    Raises:
        ValueError: a malformed ``geometry`` or an array ``scale``; the reference's errors for bad shapes.
    """
    return _native_stage2_fwd(q, k, v, topk_idx, q_positions, kv_positions, geometry)[0]


def _native_stage2_fwd(q, k, v, topk_idx, q_positions, kv_positions, geometry):
    kw = _check_geometry(geometry)
    kvp = kv_positions.astype(jnp.int32)
    picks = partial(_native_picks, first_pos=kvp[:, 0], block_size=kw["block_size"], scale=kw["scale"])
    out = infllmv2_stage2(q, k, v, topk_idx, q_positions=q_positions, kv_positions=kvp, remat=False,
                          gathered_fn=picks, **kw)
    return out, (q, k, v, topk_idx, q_positions, kv_positions)


def _native_stage2_bwd(geometry, res, g):
    q, k, v, topk_idx, q_positions, kv_positions = res
    kw = _check_geometry(geometry)
    _, vjp = jax.vjp(lambda q_, k_, v_: infllmv2_stage2(q_, k_, v_, topk_idx, q_positions=q_positions,
                                                        kv_positions=kv_positions, **kw), q, k, v)
    return (*vjp(g), None, None, None)


native_stage2.defvjp(_native_stage2_fwd, _native_stage2_bwd)


def _native_applies(q, k, v, kv_valid, scale) -> bool:
    """Whether ``impl="native"`` runs :func:`native_stage2` (else the reference does)."""
    if kv_valid is not None or any(x.dtype != jnp.float32 for x in (q, k, v)):
        return False
    if scale is not None and not isinstance(scale, (int, float)):
        return False
    from minicpm4_jax.ops import native  # noqa: PLC0415

    return native.available()


def default_select_q_tile(impl: str) -> int:
    """Query tile of the selection when none is given: 2048 for ``impl="pallas"`` on an NVIDIA GPU (Triton
    kernels; each tile is one stage-1 grid: an H200 timed the selection at T = 128K at 67.9 ms with tile 512,
    55.9 ms with 2048, docs/benchmarks.md), else 128 (a tile's stage-1 scores are ``[batch, kv_heads, tile,
    T / kernel_stride]`` fp32, which the CPU and XLA paths keep small)."""
    if impl == "pallas":
        from minicpm4_jax.ops.dispatch import pallas_target  # noqa: PLC0415 (no kernels imported otherwise)

        if pallas_target()[0] == "triton":
            return 2048
    return 128


def infllmv2_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    sparse_cfg: SparseConfig,
    kv_valid: jax.Array | None = None,
    kv_len: jax.Array | None = None,
    q_sel: jax.Array | None = None,
    k_sel: jax.Array | None = None,
    compressed: tuple[jax.Array, jax.Array | None] | None = None,
    scale: float | None = None,
    kernel_offby1_quirk: bool = False,
    score_dtype: str = "float32",
    select_q_tile: int | None = None,
    attn_q_tile: int = 64,
    gather_tile: int | None = None,
    remat: bool = True,
    impl: str = "xla",
    flash_dense: bool = False,
    return_selection: bool = False,
    return_stats: bool = False,
) -> jax.Array | tuple:
    """InfLLM v2 causal GQA attention: dense fallback, or stage-1 selection + stage-2 sparse attention.

    Args:
        q: ``[batch, T, num_heads, head_dim]`` post-RoPE queries (T = 1 for decode).
        k, v: ``[batch, kv_len_axis, num_kv_heads, head_dim]``, the whole sequence incl. cache; kv index
            = token position (contiguous from 0, right-padded).
        q_positions: int ``[batch, T]`` absolute positions (``cache_len .. cache_len + T - 1``).
        kv_positions: int ``[batch, kv_len_axis]``.
        sparse_cfg: :class:`~minicpm4_jax.config.SparseConfig` (variant, geometry, topk, dense_len).
        kv_valid: optional bool ``[batch, kv_len_axis]``.
        kv_len: optional int ``[batch]`` total keys per sequence; default ``max(q_positions) + 1``
            (gen-2's ``max(position_ids) + 1``; equals gen-1's cache + current length).
        q_sel, k_sel: selection inputs when ``sparse_cfg.use_nope`` (pre-RoPE q/k); default q, k.
        compressed: ``(ck1, ck2)`` already compressed selection keys (a KV cache's incremental rows,
            ``[batch, Nc_axis, num_kv_heads, head_dim]``; ``ck2`` ``None`` for gen-1); then ``k_sel`` is unused.
        scale: softmax scale for both stages, default ``head_dim ** -0.5``.
        kernel_offby1_quirk: reproduce the official stage-1 off-by-one (select module docstring).
        score_dtype: ``"float32"`` | ``"bfloat16"`` storage of the stage-1 group sums (bf16 = official).
        select_q_tile, attn_q_tile, gather_tile: query tile sizes of selection, of stage 2's dense forced
            part and of its gathered top-k part (:func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2`).
            ``select_q_tile=None``: :func:`default_select_q_tile` (2048 with the Pallas kernels on an NVIDIA
            GPU, else 128).
        remat: checkpoint each stage-2 tile (see :func:`infllmv2_stage2`).
        flash_dense: compute the dense fallback by blocks with its own backward
            (:func:`~minicpm4_jax.ops.flash_xla.flash_attention`, what ``attention_impl: auto`` and ``pallas``
            run) instead of the materialising reference (``xla``).
        impl: ``"xla"`` (the references), ``"native"`` (the XLA selection, then :func:`native_stage2`: the
            non-forced picks by the native CPU kernel, the backward the reference's, reverse-mode first
            derivatives only; it runs for float32 inputs without ``kv_valid``, with ``scale`` ``None`` or a
            Python number, when the kernel builds; otherwise the reference runs) or ``"pallas"`` (stage-1
            scoring by
            :func:`~minicpm4_jax.ops.pallas.stage1.stage1_scores_pallas`, stage 2 by
            :func:`~minicpm4_jax.ops.pallas.sparse_attention.block_sparse_attention`, on the backend of
            :func:`~minicpm4_jax.ops.dispatch.pallas_target`); pooling, top-k and the dense fallback are XLA.
        return_selection: also return the :class:`Selection` (``None`` when the dense path is static).
        return_stats: also return ``{"attended_fraction": float32 scalar}``, the mean over (sequence,
            KV head, query) of attended visible keys / causal keys (:func:`attended_keys`; 1 on the dense
            path).

    Returns:
        ``out`` ``[batch, T, num_heads, head_dim]`` in ``q.dtype``; ``(out, selection)``, ``(out, stats)`` or
        ``(out, selection, stats)`` when asked.

    Dispatch (§5.0, strict ``<``): ``dense_len <= 0`` (``-1`` or ``0``) -> always sparse; a kv axis
    shorter than ``dense_len`` -> statically dense (``dense_attention``); otherwise per sequence:
    ``kv_len < dense_len`` -> dense (computed by query tiles on keys ``[:dense_len]``, skipped by
    ``lax.cond`` when no sequence needs it), else sparse. Selection never receives gradients.

    Raises:
        ValueError: ``use_nope`` without ``q_sel``/``k_sel``, bad config, or mismatched shapes.
    """
    if impl not in ("xla", "pallas", "native"):
        raise ValueError(f"impl={impl!r}; use 'xla', 'native' or 'pallas'")
    use_native = impl == "native"
    impl = "xla" if use_native else impl  # the selection of the native path is the XLA one
    params = select_params(sparse_cfg, kernel_offby1_quirk=kernel_offby1_quirk, score_dtype=score_dtype)
    b, t, nq, d, s, _ = check_qkv(q, k, v, q_positions, kv_positions, kv_valid)
    dl = sparse_cfg.dense_len
    if dl > 0 and s < dl:
        dense_fn = flash_attention if flash_dense else dense_attention
        out = dense_fn(q, k, v, q_positions=q_positions, kv_positions=kv_positions, kv_valid=kv_valid, scale=scale)
        return _result(out, None, jnp.float32(1.0), return_selection, return_stats)
    if select_q_tile is None:  # after the static dense shortcut, which needs no selection (nor a kernel target)
        select_q_tile = default_select_q_tile(impl)
    if sparse_cfg.use_nope and (q_sel is None or (k_sel is None and compressed is None)):
        raise ValueError("sparse_config.use_nope=True needs the pre-RoPE q_sel and k_sel for selection")
    q_sel = q if q_sel is None else q_sel
    k_sel = k if k_sel is None else k_sel
    kv_len = (jnp.max(q_positions, axis=1) + 1).astype(jnp.int32) if kv_len is None else kv_len.astype(jnp.int32)
    if compressed is not None:
        ck1, ck2 = (None if c is None else jax.lax.stop_gradient(c) for c in compressed)
        sel = select_blocks_compressed(jax.lax.stop_gradient(q_sel), ck1, ck2, q_positions=q_positions,
                                       params=params, num_blocks=-(-s // params.block_size), kv_len=kv_len,
                                       scale=scale, q_tile=select_q_tile, impl=impl)
    else:
        sel = select_blocks(jax.lax.stop_gradient(q_sel), jax.lax.stop_gradient(k_sel), q_positions=q_positions,
                            params=params, kv_len=kv_len, scale=scale, q_tile=select_q_tile, impl=impl)
    k_used = min(params.topk_cfg, -(-s // params.block_size))
    if impl == "pallas":
        from minicpm4_jax.ops.dispatch import on_mesh, pallas_target
        from minicpm4_jax.ops.pallas.sparse_attention import block_sparse_attention

        backend, interpret = pallas_target()
        # the same forced blocks as the reference (stage2_forced_split): its attended set, exactly
        init, window, _ = stage2_forced_split(params, k_used)

        def kernel(q_, k_, v_, idx_, qpos_, kvpos_, valid_):
            return block_sparse_attention(q_, k_, v_, idx_, q_positions=qpos_, kv_positions=kvpos_,
                                          block_size=params.block_size, window_blocks=window, init_blocks=init,
                                          kv_valid=valid_, scale=scale, backend=backend, interpret=interpret)

        # a pallas_call is a single-device program: under a mesh each device runs its shard (on_mesh)
        out = on_mesh(kernel, (q, k, v, sel.topk_idx[..., :k_used], q_positions, kv_positions, kv_valid),
                      ("b.h.", "b.h.", "b.h.", "bh..", "b.", "b.", "b."), "b.h.")
    elif use_native and _native_applies(q, k, v, kv_valid, scale):
        from minicpm4_jax.ops.dispatch import on_mesh  # noqa: PLC0415

        init, window, width = stage2_forced_split(params, k_used)
        geometry = (params.block_size, window, init, width, scale, attn_q_tile)
        # a custom call is a single-device program: under a mesh each device runs its shard (on_mesh)
        out = on_mesh(lambda q_, k_, v_, i_, p_, kp_: native_stage2(q_, k_, v_, i_, p_, kp_, geometry),
                      (q, k, v, sel.topk_idx[..., :k_used], q_positions, kv_positions),
                      ("b.h.", "b.h.", "b.h.", "bh..", "b.", "b."), "b.h.")
    else:
        init, window, width = stage2_forced_split(params, k_used)
        out = infllmv2_stage2(q, k, v, sel.topk_idx[..., :k_used], q_positions=q_positions,
                              kv_positions=kv_positions, block_size=params.block_size, window_blocks=window,
                              init_blocks=init, gather_width=width, kv_valid=kv_valid, scale=scale,
                              q_tile=attn_q_tile, gather_tile=gather_tile, remat=remat)
    if dl > 0:
        use_dense = kv_len < dl  # [b]
        kd, vd = k[:, :dl], v[:, :dl]
        kvp_d = kv_positions[:, :dl]
        kvv_d = None if kv_valid is None else kv_valid[:, :dl]

        def dense_branch(_):
            if flash_dense:
                return flash_attention(q, kd, vd, q_positions=q_positions, kv_positions=kvp_d, kv_valid=kvv_d,
                                       scale=scale)
            return tiled_dense_attention(q, kd, vd, q_positions=q_positions, kv_positions=kvp_d, kv_valid=kvv_d,
                                scale=scale, q_tile=max(1, select_q_tile // 4))

        dense = jax.lax.cond(jnp.any(use_dense), dense_branch, lambda _: jnp.zeros_like(out), None)
        out = jnp.where(use_dense[:, None, None, None], dense, out)
    else:
        use_dense = jnp.zeros((b,), bool)
    frac = None
    if return_stats:
        keys = attended_keys(sel.topk_idx[..., :k_used], q_positions, block_size=params.block_size,
                             window_blocks=params.local_blocks if params.variant == "gen1" else 0)
        causal = (q_positions.astype(jnp.float32) + 1.0)[:, None, :]
        per_row = jnp.where(use_dense[:, None, None], 1.0, keys.astype(jnp.float32) / jnp.maximum(causal, 1.0))
        valid = jnp.broadcast_to((q_positions >= 0)[:, None, :], per_row.shape)
        frac = jnp.sum(jnp.where(valid, per_row, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    return _result(out, sel, frac, return_selection, return_stats)


def _result(out, sel, frac, return_selection: bool, return_stats: bool):
    extra = ((sel,) if return_selection else ()) + (({"attended_fraction": frac},) if return_stats else ())
    return (out, *extra) if extra else out


def attended_keys(topk_idx: jax.Array, q_positions: jax.Array, *, block_size: int, window_blocks: int = 0) -> jax.Array:
    """Visible keys each query attends: ``[batch, kv_heads, T]`` int32.

    Counts the union of the ``topk_idx`` blocks and (gen-1) the stage-2 window
    ``max(0, q_blk - window_blocks + 1) .. q_blk`` with token-level causality, assuming kv index = position
    (block ``j`` holds ``min(block_size, max(0, p - j * block_size + 1))`` keys visible to position ``p``).
    Rows at position ``-1`` count 0.
    """
    pos = q_positions.astype(jnp.int32)[:, None, :]  # [b, 1, T]
    idx = compact_topk(topk_idx, q_positions, block_size=block_size, init_blocks=0, window_blocks=window_blocks,
                       width=topk_idx.shape[-1]) if window_blocks else topk_idx.astype(jnp.int32)
    vis = jnp.clip(pos[..., None] - idx * block_size + 1, 0, block_size)
    keys = jnp.sum(jnp.where(idx >= 0, vis, 0), axis=-1)
    if window_blocks:
        lo = jnp.maximum(jnp.floor_divide(pos, block_size) - window_blocks + 1, 0) * block_size
        keys = keys + jnp.maximum(pos + 1 - lo, 0)
    return jnp.where(pos >= 0, keys, 0).astype(jnp.int32)
