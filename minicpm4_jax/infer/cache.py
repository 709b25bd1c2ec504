"""The KV cache of the inference engine: preallocated, static shapes, one slot per token position.

Spec ``minicpm4_model.md`` §5.7. Per decoder layer the cache holds

* ``k``, ``v``: ``[batch, num_kv_heads, capacity, head_dim]`` in the compute dtype, KV-head major (a block
  of a KV head is one contiguous slab, which is what the sparse decode gather reads). Slot ``s`` holds
  the token at position ``s`` of that sequence; slots at or beyond the sequence's length hold stale
  values that every reader masks.
* InfLLM v2 only: ``ck1`` ``[batch, Nc1, num_kv_heads, head_dim]`` fine compressed keys and (gen-2)
  ``ck2`` ``[batch, Nc2, num_kv_heads, head_dim]`` coarse ones, with ``Nc = num_kernels(capacity)``;
  row ``j`` is valid once its window ``[stride*j, stride*j + kernel_size)`` is complete. They are
  updated incrementally as tokens arrive (each new complete window becomes one row), which equals
  recomputing :func:`~minicpm4_jax.infllm.compress.compress_keys` over the cached keys at every step, and
  makes the dense-to-sparse switch free (the official gen-2 code bootstraps them from the full keys
  instead).
* ``k_sel``: the pre-RoPE keys ``[batch, num_kv_heads, capacity, head_dim]`` when
  ``sparse_config.use_nope`` (the compressed keys are built from them), else ``None``.

``lengths`` int32 ``[batch]`` counts the tokens cached per sequence.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from minicpm4_jax.config import ModelConfig
from minicpm4_jax.infllm.compress import coarse_geometry, num_kernels

__all__ = ["LayerCache", "KVCache", "init_cache", "cache_capacity", "write_tokens", "update_compressed"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    """One decoder layer's cache (module docstring for shapes); ``None`` fields are absent."""

    k: jax.Array
    v: jax.Array
    ck1: jax.Array | None = None
    ck2: jax.Array | None = None
    k_sel: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """All layers' caches (a tuple of :class:`LayerCache`) and the cached length of each sequence."""

    layers: tuple[LayerCache, ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        """Token slots per sequence (static)."""
        return self.layers[0].k.shape[2]

    @property
    def batch_size(self) -> int:
        """Sequences in the cache (static)."""
        return self.layers[0].k.shape[0]


def _geometry_multiple(cfg: ModelConfig) -> int:
    m = 128
    if cfg.attention == "infllmv2" and cfg.sparse_config is not None:
        sc = cfg.sparse_config
        m = math.lcm(m, sc.block_size, coarse_geometry(sc.kernel_size, sc.kernel_stride)[1])
    return m


def cache_capacity(cfg: ModelConfig, tokens: int) -> int:
    """Slots for ``tokens`` positions, rounded up to a multiple of 128, ``block_size`` and the coarse stride.

    The rounding keeps the number of distinct compiled shapes small and the blocks whole. The extra slots are
    never attended (positions stay below ``tokens``), so the capacity may exceed ``max_position_embeddings``.
    """
    m = _geometry_multiple(cfg)
    return max(m, -(-tokens // m) * m)


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache (zeros, ``lengths = 0``) for ``batch_size`` sequences of up to ``capacity`` tokens.

    Raises:
        ValueError: ``capacity`` not a multiple of :func:`cache_capacity`'s rounding, or ``batch_size < 1``.
    """
    m = _geometry_multiple(cfg)
    if capacity <= 0 or capacity % m:
        raise ValueError(f"capacity={capacity} must be a positive multiple of {m}; use cache_capacity(cfg, n)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    dt = jnp.dtype(cfg.dtype) if dtype is None else jnp.dtype(dtype)
    nkv, d = cfg.num_key_value_heads, cfg.resolved_head_dim
    sparse = cfg.attention == "infllmv2"
    layers = []
    for _ in range(cfg.num_hidden_layers):
        kv = jnp.zeros((batch_size, nkv, capacity, d), dt)
        lc = LayerCache(k=kv, v=jnp.zeros_like(kv))
        if sparse:
            sc = cfg.sparse_config
            lc.ck1 = jnp.zeros((batch_size, num_kernels(capacity, sc.kernel_size, sc.kernel_stride), nkv, d), dt)
            if sc.variant == "gen2":
                cks, cst = coarse_geometry(sc.kernel_size, sc.kernel_stride)
                lc.ck2 = jnp.zeros((batch_size, num_kernels(capacity, cks, cst), nkv, d), dt)
            if sc.use_nope:
                lc.k_sel = jnp.zeros_like(kv)
        layers.append(lc)
    return KVCache(layers=tuple(layers), lengths=jnp.zeros((batch_size,), jnp.int32))


def write_tokens(lc: LayerCache, k: jax.Array, v: jax.Array, k_sel: jax.Array | None,
                 positions: jax.Array) -> LayerCache:
    """Write new keys/values ``[batch, T, num_kv_heads, head_dim]`` into their position slots.

    ``positions`` int ``[batch, T]``; rows at ``-1`` (padding, inactive sequences) are dropped. In place under
    ``jax.jit`` with the cache donated.
    """
    b, t = positions.shape
    cap = lc.k.shape[2]
    slot = jnp.where(positions >= 0, positions, cap).astype(jnp.int32)  # cap = out of range -> dropped
    bi = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))

    def put(cache, new):
        return cache.at[bi, :, slot].set(new.astype(cache.dtype), mode="drop")

    out = dataclasses.replace(lc, k=put(lc.k, k), v=put(lc.v, v))
    if lc.k_sel is not None:
        out.k_sel = put(lc.k_sel, k_sel)
    return out


def _new_kernel_rows(keys: jax.Array, ck: jax.Array, old_len: jax.Array, new_len: jax.Array, *,
                     kernel_size: int, kernel_stride: int, n_new: int) -> jax.Array:
    """One sequence: rows ``[num_kernels(old_len), num_kernels(new_len))`` of ``ck`` from ``keys [kv, cap, d]``.

    Same arithmetic as :func:`~minicpm4_jax.infllm.compress.compress_keys` (float32 sums of ``stride``-token
    chunks added in order, divided by ``kernel_size``, one cast).
    """
    nkv, cap, d = keys.shape
    nc = ck.shape[0]
    m = kernel_size // kernel_stride

    def count(n):
        return jnp.where(n >= kernel_size, (n - kernel_size) // kernel_stride + 1, 0)

    first, last = count(old_len), count(new_len)
    js = first + jnp.arange(n_new, dtype=jnp.int32)

    def row(j):
        start = jnp.clip(j * kernel_stride, 0, cap - kernel_size)
        win = jax.lax.dynamic_slice_in_dim(keys, start, kernel_size, axis=1).astype(jnp.float32)
        sums = win.reshape(nkv, m, kernel_stride, d).sum(axis=2)
        acc = sums[:, 0]
        for i in range(1, m):
            acc = acc + sums[:, i]
        return (acc / kernel_size).astype(ck.dtype)

    rows = jax.vmap(row)(js)  # [n_new, kv, d]
    dst = jnp.where(js < last, js, nc)
    return ck.at[dst].set(rows, mode="drop")


def update_compressed(lc: LayerCache, cfg: ModelConfig, old_len: jax.Array, new_len: jax.Array,
                      max_new: int) -> LayerCache:
    """Add the compressed-key rows completed by growing each sequence from ``old_len`` to ``new_len`` tokens.

    Args:
        lc: the layer cache with the new keys already written (:func:`write_tokens`).
        cfg: model config (``sparse_config`` geometry).
        old_len, new_len: int ``[batch]`` cached tokens before / after the write.
        max_new: static bound on ``new_len - old_len`` (the chunk length).
    """
    sc = cfg.sparse_config
    keys = lc.k if lc.k_sel is None else lc.k_sel
    out = dataclasses.replace(lc)
    geoms = [("ck1", sc.kernel_size, sc.kernel_stride)]
    if lc.ck2 is not None:
        geoms.append(("ck2", *coarse_geometry(sc.kernel_size, sc.kernel_stride)))
    for name, ks, st in geoms:
        if getattr(lc, name).shape[1] == 0:  # capacity below one kernel: no rows ever
            continue
        n_new = -(-max_new // st)
        fn = jax.vmap(lambda kk, cc, o, n, ks=ks, st=st, n_new=n_new: _new_kernel_rows(
            kk, cc, o, n, kernel_size=ks, kernel_stride=st, n_new=n_new))
        setattr(out, name, fn(keys, getattr(lc, name), old_len, new_len))
    return out
