"""Per-query-tile KV block lists for the block-sparse attention kernels (pure XLA, jit-able, static shapes).

Spec ``minicpm4_model.md`` §5.5 and ``jax_stack.md`` §2.1 ("what this means for InfLLM v2"). The kernels in
:mod:`minicpm4_jax.ops.pallas.sparse_attention` process a *query tile* of ``tokens_per_tile`` consecutive
tokens (times all query heads of a KV group) and walk the union of the KV blocks its tokens attend:

* the token's ``topk_idx`` picks (``-1`` = unused, ids outside ``[0, num_blocks)`` are ignored),
* the ``init_blocks`` first blocks,
* the ``window_blocks`` blocks ``q_blk - window_blocks + 1 .. q_blk`` ending at the token's block
  (``q_blk = q_position // block_size``),

for every token with ``q_position >= 0`` (padding tokens attend nothing). This module turns the per-token
selection into

* forward lists: per (batch, KV head, tile) the sorted, de-duplicated block ids ``blocks`` with their
  number ``counts``; unused slots repeat the last valid id (so a pipelined kernel issues no new DMA there;
  ``0`` when the tile attends nothing); and ``words``: bit ``t`` of ``words[..., slot]`` is set iff token
  ``t`` of the tile attends block ``blocks[..., slot]`` (the in-kernel row mask; causality is applied
  separately, token by token);
* inverse lists (dk/dv): the ``(tile, slot)`` entries of the forward lists sorted by block id (CSR form),
  ``inv_blocks`` / ``inv_tiles`` / ``inv_words`` of length ``n_tiles * max_blocks`` with
  ``inv_offsets[j] .. inv_offsets[j + 1]`` the entries of block ``j``; entries past ``inv_offsets[-1]``
  (the total) repeat the last valid entry with word ``0``.

Static bound on the list length (exact, nothing is ever dropped): a tile of ``tq`` tokens attends at
most ``tq * K`` top-k blocks, ``tq * window_blocks`` window blocks (no assumption that positions are
contiguous) and ``init_blocks`` init blocks shared by all tokens, and never more than ``num_blocks``
distinct blocks: ``max_blocks = min(num_blocks, tq * (K + window_blocks) + init_blocks)``
(:func:`max_blocks_bound`). A smaller ``max_blocks`` may be passed when the caller knows a tighter
bound (e.g. ``jnp.max(counts)`` measured on concrete data); then blocks beyond it would be lost, so
:func:`build_block_lists` reports the true counts and callers can check ``counts <= max_blocks``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["BlockLists", "build_block_lists", "max_blocks_bound"]

_BIG = jnp.iinfo(jnp.int32).max


class BlockLists(NamedTuple):
    """Forward and inverse block lists (int32; ``b`` batch, ``h`` KV heads, ``n`` tiles, ``m`` max_blocks).

    Attributes:
        blocks: ``[b, h, n, m]`` sorted distinct block ids, then repeats of the last valid one.
        counts: ``[b, h, n]`` valid entries of ``blocks`` (``<= m`` unless ``max_blocks`` was too small).
        words: ``[b, h, n, m]`` token membership bits (bit ``t`` = token ``t`` of the tile); ``0`` on unused slots.
        inv_blocks: ``[b, h, n * m]`` block id of each entry sorted by block (stable: ascending tile).
        inv_tiles: ``[b, h, n * m]`` tile of each entry.
        inv_words: ``[b, h, n * m]`` membership word of each entry (``0`` past the total).
        inv_offsets: ``[b, h, num_blocks + 1]`` CSR offsets; ``inv_offsets[..., -1]`` is the total.
    """

    blocks: jax.Array
    counts: jax.Array
    words: jax.Array
    inv_blocks: jax.Array
    inv_tiles: jax.Array
    inv_words: jax.Array
    inv_offsets: jax.Array


def max_blocks_bound(tokens_per_tile: int, k: int, num_blocks: int, *, init_blocks: int = 0,
                     window_blocks: int = 0) -> int:
    """Exact static bound on the distinct blocks one tile attends: ``min(NB, tq * (K + window) + init)`` (>= 1)."""
    return max(1, min(num_blocks, tokens_per_tile * (k + window_blocks) + min(init_blocks, num_blocks)))


def build_block_lists(topk_idx: jax.Array, q_positions: jax.Array, *, block_size: int, num_blocks: int,
                      tokens_per_tile: int, init_blocks: int = 0, window_blocks: int = 0,
                      max_blocks: int | None = None) -> BlockLists:
    """Build the per-tile block lists and their inverse (module docstring) from a per-token selection.

    Args:
        topk_idx: int ``[batch, kv_heads, T, K]`` block ids, ``-1`` unused
            (:class:`~minicpm4_jax.infllm.select.Selection` format; repeats are allowed).
        q_positions: int ``[batch, T]`` absolute positions, ``-1`` = padding token (attends nothing).
        block_size: KV block size (``q_blk = position // block_size``).
        num_blocks: number of KV blocks ``NB`` (ids ``>= NB`` are ignored).
        tokens_per_tile: tokens per query tile ``tq`` (1..32: a membership word holds 32 bits); ``T`` is
            padded to a multiple with padding tokens.
        init_blocks, window_blocks: forced blocks (>= 0).
        max_blocks: static list length; default :func:`max_blocks_bound` (exact).

    Returns:
        :class:`BlockLists`.

    Raises:
        ValueError: bad shapes or arguments.
    """
    if topk_idx.ndim != 4 or q_positions.ndim != 2 or topk_idx.shape[0] != q_positions.shape[0] \
            or topk_idx.shape[2] != q_positions.shape[1]:
        raise ValueError(f"topk_idx {topk_idx.shape} must be [batch, kv_heads, T, K] with q_positions "
                         f"{q_positions.shape} = [batch, T]")
    if not 1 <= tokens_per_tile <= 32:
        raise ValueError(f"tokens_per_tile={tokens_per_tile} must be in [1, 32]")
    if min(init_blocks, window_blocks) < 0 or block_size <= 0 or num_blocks <= 0:
        raise ValueError(f"block_size={block_size}, num_blocks={num_blocks} must be > 0 and init_blocks="
                         f"{init_blocks}, window_blocks={window_blocks} >= 0")
    b, nkv, t, kk = topk_idx.shape
    tq = tokens_per_tile
    nt = -(-t // tq)
    tp = nt * tq
    m = max_blocks_bound(tq, kk, num_blocks, init_blocks=init_blocks, window_blocks=window_blocks) \
        if max_blocks is None else int(max_blocks)
    if m < 1:
        raise ValueError(f"max_blocks={max_blocks} must be >= 1")
    init = min(init_blocks, num_blocks)

    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)  # [b, Tp]
    idx = jnp.pad(topk_idx.astype(jnp.int32), ((0, 0), (0, 0), (0, tp - t), (0, 0)), constant_values=-1)
    live = (pos >= 0)[:, None, :, None]  # [b, 1, Tp, 1]
    parts = [idx]
    if window_blocks:
        qb = jnp.floor_divide(pos, block_size)[:, None, :, None]
        win = qb - jnp.arange(window_blocks, dtype=jnp.int32)  # [b, 1, Tp, w]
        parts.append(jnp.broadcast_to(win, (b, nkv, tp, window_blocks)))
    if init:
        parts.append(jnp.broadcast_to(jnp.arange(init, dtype=jnp.int32), (b, nkv, tp, init)))
    ent = jnp.concatenate(parts, axis=-1)  # [b, h, Tp, E]
    ent = jnp.where(live & (ent >= 0) & (ent < num_blocks), ent, _BIG)
    e = ent.shape[-1]

    # --- sorted distinct blocks per tile
    tile_ent = ent.reshape(b, nkv, nt, tq * e)
    srt = jnp.sort(tile_ent, axis=-1)
    prev = jnp.concatenate([jnp.full(srt.shape[:-1] + (1,), -1, jnp.int32), srt[..., :-1]], axis=-1)
    uniq = (srt != prev) & (srt < _BIG)
    counts = jnp.sum(uniq, axis=-1, dtype=jnp.int32)  # [b, h, n]
    lst = jnp.sort(jnp.where(uniq, srt, _BIG), axis=-1)
    if lst.shape[-1] < m:
        lst = jnp.pad(lst, ((0, 0), (0, 0), (0, 0), (0, m - lst.shape[-1])), constant_values=_BIG)
    lst = lst[..., :m]
    last = jnp.take_along_axis(lst, jnp.clip(jnp.minimum(counts, m) - 1, 0, m - 1)[..., None], axis=-1)
    last = jnp.where(counts[..., None] > 0, last, 0)
    blocks = jnp.where(lst == _BIG, last, lst)  # sorted (non-decreasing), padded with the last valid id

    # --- membership words: bit t of words[slot] = token t attends blocks[slot]
    rows = b * nkv * nt
    lst_r = lst.reshape(rows, m)  # _BIG-padded: searchsorted finds the true slot of a valid entry
    ent_t = ent.reshape(rows, tq, e)
    slots = jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="left"))(lst_r, ent_t.reshape(rows, tq * e))
    slots = slots.reshape(rows, tq, e).astype(jnp.int32)
    slots = jnp.where(ent_t < _BIG, slots, m)  # invalid entries (and any beyond max_blocks) -> the spare slot m
    r_idx = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, e))
    # every index in bounds (slot m is a spare column, dropped below), so checkify's index checks stay quiet
    words = jnp.zeros((rows, m + 1), jnp.uint32)
    for tok in range(tq):  # the same bit may be set twice (window and top-k overlap): max is idempotent
        bit = jnp.uint32(1 << tok)
        words = words | jnp.zeros((rows, m + 1), jnp.uint32).at[r_idx, slots[:, tok]].max(bit)
    words = jax.lax.bitcast_convert_type(words[:, :m], jnp.int32).reshape(b, nkv, nt, m)

    # --- inverse lists (CSR by block)
    slot_ok = jnp.arange(m, dtype=jnp.int32) < counts[..., None]  # [b, h, n, m]
    key = jnp.where(slot_ok, blocks, num_blocks).reshape(b, nkv, nt * m)
    order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    inv_key = jnp.take_along_axis(key, order, axis=-1)
    inv_tiles = order // m
    inv_words = jnp.take_along_axis(words.reshape(b, nkv, nt * m), order, axis=-1)
    total = jnp.sum(jnp.minimum(counts, m), axis=-1, dtype=jnp.int32)  # [b, h]
    at = jnp.clip(total - 1, 0, nt * m - 1)[..., None]
    last_blk = jnp.where(total[..., None] > 0, jnp.take_along_axis(inv_key, at, axis=-1), 0)
    last_tile = jnp.where(total[..., None] > 0, jnp.take_along_axis(inv_tiles, at, axis=-1), 0)
    pad = jnp.arange(nt * m, dtype=jnp.int32) >= total[..., None]
    inv_blocks = jnp.where(pad, last_blk, inv_key)
    inv_tiles = jnp.where(pad, last_tile, inv_tiles)
    inv_words = jnp.where(pad, 0, inv_words)
    bounds = jnp.arange(num_blocks + 1, dtype=jnp.int32)
    offs = jax.vmap(lambda a: jnp.searchsorted(a, bounds, side="left"))(inv_key.reshape(b * nkv, nt * m))
    inv_offsets = offs.reshape(b, nkv, num_blocks + 1).astype(jnp.int32)
    return BlockLists(blocks.astype(jnp.int32), counts, words, inv_blocks.astype(jnp.int32),
                      inv_tiles.astype(jnp.int32), inv_words, inv_offsets)
