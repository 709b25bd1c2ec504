"""Single-token decode attention over a KV cache in pure JAX/XLA: dense and InfLLM v2 block-sparse.

Spec ``minicpm4_model.md`` §5.5 (stage 2 ``..._with_kvcache``: one new query token per sequence, the
selected blocks only, ``causal=False`` which equals causality for the last token) and §5.7 (cache layout).
The reference the Pallas decode kernel is tested against, and the fallback on any backend.

Cache layout (KV-head major, the layout a block gather wants): ``k_cache``/``v_cache``
``[batch, num_kv_heads, capacity, head_dim]``, slot index = token position, a sequence's keys in slots
``[0, length)``; slots at or beyond its length may hold anything (they are masked). A block ``j`` of KV head
``h`` is the contiguous slab ``[j * block_size, (j + 1) * block_size)`` of row ``(b, h)``, so the sparse path
gathers whole ``[block_size * head_dim]`` rows of the cache reshaped (free) to
``[batch * num_kv_heads * num_blocks, block_size * head_dim]``: each step reads only the selected blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.infllm_ref import _merge, compact_topk  # one online-softmax merge for every stage 2

__all__ = ["decode_shapes", "dense_decode_attention", "sparse_decode_attention"]


def decode_shapes(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_positions: jax.Array | None = None) -> tuple:
    """Checks of a decode call's operands (and, when given, of ``q_positions``: ``[batch]`` for the one-token
    ``q``, else ``[batch, T]``), shared by the reference and the kernels.

    Returns:
        ``(single, q4, batch, T, num_heads, head_dim, num_kv_heads, capacity)``: ``single`` when ``q`` is the
        one-token ``[batch, heads, head_dim]`` form, ``q4`` the ``[batch, T, heads, head_dim]`` view.

    Raises:
        ValueError: ``q`` not 3-D/4-D, caches not ``[batch, num_kv_heads, capacity, head_dim]`` matching ``q``,
            heads not a multiple of KV heads, or ``q_positions`` of another shape.
    """
    if q.ndim not in (3, 4):
        raise ValueError(f"q shape {q.shape}: expected [batch, heads, head_dim] or [batch, T, heads, head_dim]")
    single = q.ndim == 3
    q4 = q[:, None] if single else q
    b, t, nq, d = q4.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"shape mismatch: q {q.shape} [batch, (T,) heads, head_dim], k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape} [batch, kv_heads, capacity, head_dim]")
    nkv, cap = k_cache.shape[1], k_cache.shape[2]
    if nkv < 1 or nq % nkv:
        raise ValueError(f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    want = (b,) if single else (b, t)
    if q_positions is not None and tuple(q_positions.shape) != want:
        raise ValueError(f"q_positions shape {tuple(q_positions.shape)} must be {list(want)} for q {q.shape}")
    return single, q4, b, t, nq, d, nkv, cap


def _check(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> tuple[int, int, int, int, int]:
    """:func:`decode_shapes` of a one-token ``q [batch, heads, head_dim]`` -> ``(batch, heads, head_dim,
    kv_heads, capacity)``."""
    _, _, b, _, nq, d, nkv, s = decode_shapes(q, k_cache, v_cache)
    return b, nq, d, nkv, s


def _softmax_state(q: jax.Array, kg: jax.Array, vg: jax.Array, ok: jax.Array, scale: float):
    """``(max, sum, unnormalised output)`` of q ``[rows, g, d]`` over keys/values ``[rows, n, d]``.

    ``ok``: bool mask ``[rows, n]`` (shared by the ``g`` query rows) or ``[rows, g, n]``.
    """
    logits = jax.lax.dot_general(q, kg, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32) * scale
    logits = jnp.where(ok[:, None, :] if ok.ndim == 2 else ok, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    ms = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - ms)
    acc = jax.lax.dot_general(p.astype(vg.dtype), vg, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1, keepdims=True), acc


def _attend_rows(q: jax.Array, kg: jax.Array, vg: jax.Array, ok: jax.Array, scale: float) -> jax.Array:
    """q ``[rows, g, d]``, keys/values ``[rows, n, d]``, mask ``[rows, n]`` -> ``[rows, g, d]`` float32."""
    _, l, acc = _softmax_state(q, kg, vg, ok, scale)
    return acc / jnp.where(l == 0.0, 1.0, l)


def dense_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, q_positions: jax.Array,
                           scale: float | None = None, window: int | None = None) -> jax.Array:
    """Dense GQA attention of new tokens over their sequence's cached keys (a decode step or a verify chunk).

    With ``window = W`` (one token per sequence only) a query at position ``p`` attends the last ``W`` positions
    ``p - W + 1 .. p``, read as one ``W``-slot slice per sequence (a sliding-window decode, e.g. the draft
    layer of speculative decoding at long contexts, as CPM.cu's ``spec_window_size``).

    Args:
        q: ``[batch, num_heads, head_dim]`` (one token per sequence) or ``[batch, T, num_heads, head_dim]``
            (a few tokens per sequence), post-RoPE.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]`` (the new tokens already written).
        q_positions: int ``[batch]`` / ``[batch, T]``; a query attends the slots ``0 .. q_position``; ``-1`` = an
            inactive row (zeros out).
        scale: softmax scale, default ``head_dim ** -0.5``.
        window: attend only the last ``window`` positions (``q`` must be the 3-D one-token form); ``None`` or a
            window of at least the capacity = all positions.

    Returns:
        the shape of ``q``, in ``q.dtype`` (fp32 softmax).

    Raises:
        ValueError: mismatched shapes or heads not a multiple of kv heads, or ``window`` with a 4-D ``q`` or
            ``window < 1``.
    """
    decode_shapes(q, k_cache, v_cache, q_positions)
    if window is not None:
        if q.ndim != 3:
            raise ValueError(f"window={window} takes one token per sequence (q [batch, heads, head_dim]), "
                             f"got q {q.shape}")
        if window < 1:
            raise ValueError(f"window={window} must be >= 1 (positions attended, the query's own included)")
        if window < k_cache.shape[2]:
            return _window_decode(q, k_cache, v_cache, q_positions.astype(jnp.int32), window, scale)
    single = q.ndim == 3
    q4 = q[:, None] if single else q
    pos = (q_positions[:, None] if single else q_positions).astype(jnp.int32)
    b, t = q4.shape[:2]
    _, nq, d, nkv, s = _check(q4[:, 0], k_cache, v_cache)
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    ok = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [b, t, s]
    ok = jnp.broadcast_to(ok[:, None, :, None, :], (b, nkv, t, g, s)).reshape(b * nkv, t * g, s)
    qr = q4.reshape(b, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b * nkv, t * g, d)
    _, l, acc = _softmax_state(qr, k_cache.reshape(b * nkv, s, d), v_cache.reshape(b * nkv, s, d), ok, scale)
    out = (acc / jnp.where(l == 0.0, 1.0, l)).reshape(b, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, nq, d)
    return (out[:, 0] if single else out).astype(q.dtype)


def _row_slices(cache: jax.Array, start: jax.Array, n: int) -> jax.Array:
    """``cache [batch, kv_heads, capacity, d]`` -> slots ``start[i] .. start[i] + n - 1`` of each sequence
    ``[batch, kv_heads, n, d]`` (per-row dynamic slices: a vmapped one lowers to a slower gather on XLA:CPU)."""
    b = cache.shape[0]
    if b <= 16:
        return jnp.stack([jax.lax.dynamic_slice_in_dim(cache[i], start[i], n, axis=1) for i in range(b)])
    return jax.vmap(lambda xr, st: jax.lax.dynamic_slice_in_dim(xr, st, n, axis=1))(cache, start)


def _window_decode(q, k_cache, v_cache, pos, window, scale):
    """:func:`dense_decode_attention` of one token per sequence over its last ``window`` positions only."""
    b, nq, d, nkv, s = _check(q, k_cache, v_cache)
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    start = jnp.clip(pos - window + 1, 0, s - window)  # [b]

    kp = start[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]  # [b, window]
    ok = (kp <= pos[:, None]) & (kp > pos[:, None] - window)
    ok = jnp.broadcast_to(ok[:, None], (b, nkv, window)).reshape(b * nkv, window)
    kw, vw = (_row_slices(x, start, window) for x in (k_cache, v_cache))
    _, l, acc = _softmax_state(q.reshape(b * nkv, g, d), kw.reshape(b * nkv, window, d),
                               vw.reshape(b * nkv, window, d), ok, scale)
    return (acc / jnp.where(l == 0.0, 1.0, l)).reshape(b, nq, d).astype(q.dtype)


def sparse_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, topk_idx: jax.Array, *,
                            q_positions: jax.Array, block_size: int, window_blocks: int = 0, init_blocks: int = 0,
                            gather_width: int | None = None, scale: float | None = None) -> jax.Array:
    """InfLLM v2 stage 2 for new tokens over a KV cache: attend only the selected cache blocks (§5.5).

    Each query head attends, over the keys of its KV head at positions ``<= q_position``, the union of the
    group's ``topk_idx`` blocks, the blocks ``0 .. init_blocks - 1`` and the window
    ``max(0, q_blk - window_blocks + 1) .. q_blk`` (``q_blk = q_position // block_size``): the same set as
    :func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2` with the same arguments. Gen-1 passes its in-kernel
    window; gen-2 may pass its forced blocks (already in ``topk_idx``) as ``init_blocks`` / ``window_blocks``
    (:func:`~minicpm4_jax.infllm.attention.stage2_forced_split`), which does not change the result.

    The init blocks and the windows (one slice covering the windows of all new tokens of a sequence) are read
    as contiguous slices of the cache; only the other picks (compacted into ``gather_width`` columns) are
    gathered, as whole ``[block_size * head_dim]`` rows, in one gather for all tokens.

    Args:
        q: ``[batch, num_heads, head_dim]`` (one new token per sequence) or ``[batch, T, num_heads, head_dim]``
            (a few, e.g. a speculative verify chunk), post-RoPE.
        k_cache, v_cache: ``[batch, num_kv_heads, capacity, head_dim]``; ``capacity`` a multiple of
            ``block_size`` (any number of blocks, also fewer than the window).
        topk_idx: int ``[batch, num_kv_heads, K]`` (or ``[batch, num_kv_heads, T, K]``) block ids, ``-1`` unused
            (so is any id outside ``[0, capacity / block_size)``, as in the Pallas kernels), no id repeated in a
            row (:class:`~minicpm4_jax.infllm.select.Selection` format).
        q_positions: int ``[batch]`` (or ``[batch, T]``); ``-1`` = inactive row (zeros out). Several tokens of a
            sequence must sit at consecutive positions (a verify chunk, as the engine passes them): the one
            window slice they share is sized for that, and tokens spread further apart lose window blocks
            (a fresh-eyes check found up to 1.5 off for ``[54, 55, 55, 0, 0]``); call once per token otherwise.
        block_size: KV block size.
        window_blocks, init_blocks: forced blocks (see above); 0 = none.
        gather_width: columns kept for the picks outside the forced blocks; default ``K`` (never drops one).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        the shape of ``q``, in ``q.dtype`` (fp32 softmax). Reads ``(gather_width + window_blocks + init_blocks)
        * block_size`` keys and values per (new token, KV head) (the window slice is shared by the tokens).

    Raises:
        ValueError: mismatched shapes, a capacity that is not a multiple of ``block_size``, negative
            ``window_blocks`` / ``init_blocks`` / ``gather_width``.
    """
    single, q4, b, t, nq, d, nkv, s = decode_shapes(q, k_cache, v_cache, q_positions)
    pos = (q_positions[:, None] if single else q_positions).astype(jnp.int32)  # [b, t]
    idx = (topk_idx[:, :, None] if single else topk_idx).astype(jnp.int32)  # [b, kv, t, K]
    if block_size < 1 or s % block_size:
        raise ValueError(f"cache capacity {s} is not a multiple of block_size={block_size}")
    if idx.ndim != 4 or idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, (T={t},) K]")
    nb = s // block_size
    if min(window_blocks, init_blocks) < 0 or (gather_width is not None and gather_width < 0):
        raise ValueError(f"window_blocks={window_blocks}, init_blocks={init_blocks}, gather_width={gather_width} "
                         "must be >= 0")
    init_blocks = min(init_blocks, nb)
    span = -(-(t - 1) // block_size) + 1  # query blocks the new tokens of one sequence can touch
    # the window slice: every window block of the tokens, never more than the blocks after the init ones (a
    # short cache, e.g. 2 blocks against a 33-block window, is then read whole)
    n_win = min(window_blocks + span - 1, nb - init_blocks) if window_blocks else 0
    g = nq // nkv
    rows = b * nkv
    scale = d**-0.5 if scale is None else scale
    qb = jnp.floor_divide(pos, block_size)  # [b, t]
    width = idx.shape[-1] if gather_width is None else gather_width
    if window_blocks or init_blocks or width != idx.shape[-1]:
        idx = compact_topk(idx, pos, block_size=block_size, init_blocks=init_blocks, window_blocks=window_blocks,
                           width=width)
    qr = q4.reshape(b, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(rows, t * g, d)  # rows of (token, head)

    def per_query(ok):  # [b, t, n] -> [rows, t * g, n]
        n = ok.shape[-1]
        return jnp.broadcast_to(ok[:, None, :, None, :], (b, nkv, t, g, n)).reshape(rows, t * g, n)

    state = None
    if init_blocks:
        n = init_blocks * block_size
        kp = jnp.arange(n, dtype=jnp.int32)
        ok = per_query(kp[None, None, :] <= pos[:, :, None])
        state = _softmax_state(qr, k_cache[:, :, :n].reshape(rows, n, d), v_cache[:, :, :n].reshape(rows, n, d), ok,
                               scale)
    if n_win:
        n = n_win * block_size
        lo_blk = jnp.min(jnp.where(pos >= 0, qb, nb), axis=1)  # [b] first query block of the sequence's tokens
        # blocks below init_blocks are never window blocks: starting at them still covers the window
        start = jnp.clip((lo_blk - window_blocks + 1) * block_size, init_blocks * block_size, s - n)

        kp = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]  # [b, n]
        kblk = jnp.floor_divide(kp, block_size)[:, None, :]
        ok = ((kblk > qb[:, :, None] - window_blocks) & (kp[:, None, :] <= pos[:, :, None])
              & (kblk >= init_blocks))  # [b, t, n]
        st = _softmax_state(qr, _row_slices(k_cache, start, n).reshape(rows, n, d),
                            _row_slices(v_cache, start, n).reshape(rows, n, d),
                            per_query(ok), scale)
        state = st if state is None else _merge(state, st)
    if width:
        # the other picks of every token: one gather of whole [block_size * head_dim] rows of the block-major
        # view of the cache (a fori_loop reading one block column per step measured 1.2x slower at 32K)
        blk = jnp.clip(idx, 0, nb - 1)  # [b, kv, t, width]
        flat = ((jnp.arange(rows) * nb).reshape(b, nkv, 1, 1) + blk).reshape(-1)
        n = width * block_size
        kg = jnp.take(k_cache.reshape(rows * nb, block_size * d), flat, axis=0, mode="clip").reshape(rows * t, n, d)
        vg = jnp.take(v_cache.reshape(rows * nb, block_size * d), flat, axis=0, mode="clip").reshape(rows * t, n, d)
        kpos = blk[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)  # [b, kv, t, width, block]
        ok = ((idx >= 0) & (idx < nb))[..., None] & (kpos <= pos[:, None, :, None, None])
        qt = q4.reshape(b, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(rows * t, g, d)
        m, l, acc = _softmax_state(qt, kg, vg, ok.reshape(rows * t, n), scale)
        st = tuple(x.reshape(rows, t * g, x.shape[-1]) for x in (m, l, acc))
        state = st if state is None else _merge(state, st)
    if state is None:
        return jnp.zeros_like(q)
    _, l, acc = state
    out = (acc / jnp.where(l == 0.0, 1.0, l)).reshape(b, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, nq, d)
    return (out[:, 0] if single else out).astype(q.dtype)
