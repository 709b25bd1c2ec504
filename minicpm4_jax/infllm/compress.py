"""InfLLM v2 compressed keys ("semantic kernels"), spec ``minicpm4_model.md`` §5.1.

A kernel of size ``ks`` and stride ``st`` is the mean of the keys ``[st*j, st*j + ks - 1]``. Only
complete windows exist: ``num_kernels(N) = max(0, (N - ks) // st + 1)``. MiniCPM4 uses fine kernels
32/16 (both generations) and, in gen-2 only, coarse kernels 128/64 (``4*ks`` / ``4*st``) for the
LSE approximation. Values are never compressed. Keys are post-RoPE unless ``use_nope`` (the caller
then passes the pre-RoPE keys).

Computed the cheap way the spec suggests: ``S_st[i] = sum(k[st*i : st*i + st])`` in float32, then
``ck[j] = sum_{m < ks/st} S_st[j + m] / ks``; the result is cast once to ``k.dtype`` (one bf16
rounding for bf16 keys, like the official ``torch.mean``).

Kernel ``j`` *ends* at token ``st*j + ks - 1``; the clean causal rule of stage 1 makes it visible to a
query at position ``p`` iff ``st*j + ks - 1 <= p`` (see :mod:`minicpm4_jax.infllm.select`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["num_kernels", "compress_keys", "coarse_geometry"]


def num_kernels(n: int, kernel_size: int, kernel_stride: int) -> int:
    """Number of complete kernels over ``n`` keys: ``max(0, (n - kernel_size) // kernel_stride + 1)``.

    Example (spec §5.1): ``n = 10000`` gives 624 fine (32/16) and 155 coarse (128/64) kernels.
    """
    if n < kernel_size:
        return 0
    return (n - kernel_size) // kernel_stride + 1


def coarse_geometry(kernel_size: int, kernel_stride: int) -> tuple[int, int]:
    """Gen-2 coarse kernel ``(4*kernel_size, 4*kernel_stride)`` (``compress_k2`` in the official code)."""
    return 4 * kernel_size, 4 * kernel_stride


def compress_keys(k: jax.Array, kernel_size: int, kernel_stride: int) -> jax.Array:
    """Mean-pooled compressed keys over complete windows.

    Args:
        k: ``[batch, kv_len, num_kv_heads, head_dim]`` keys, any float dtype. The kv axis index must
            equal the token position (a contiguous cache starting at position 0); windows that reach
            into padding / unwritten slots are computed but are never causally visible to a query
            of that sequence.
        kernel_size: window length ``ks`` (a multiple of ``kernel_stride``).
        kernel_stride: stride ``st`` between window starts.

    Returns:
        ``[batch, num_kernels(kv_len), num_kv_heads, head_dim]`` in ``k.dtype`` (accumulated in float32);
        ``ck[:, j] = mean(k[:, st*j : st*j + ks])``. Zero kernels (``kv_len < ks``) gives a size-0 axis.

    Raises:
        ValueError: ``kernel_size`` not a positive multiple of ``kernel_stride``.
    """
    if kernel_stride <= 0 or kernel_size <= 0 or kernel_size % kernel_stride:
        raise ValueError(f"kernel_size={kernel_size} must be a positive multiple of kernel_stride={kernel_stride}")
    b, n, h, d = k.shape
    nc = num_kernels(n, kernel_size, kernel_stride)
    if nc == 0:
        return jnp.zeros((b, 0, h, d), k.dtype)
    m = kernel_size // kernel_stride
    n_chunks = nc + m - 1  # chunks of `st` tokens touched by the kernels; n_chunks * st <= n
    chunks = k[:, : n_chunks * kernel_stride].astype(jnp.float32)
    sums = chunks.reshape(b, n_chunks, kernel_stride, h, d).sum(axis=2)  # [b, n_chunks, h, d]
    acc = sums[:, 0:nc]
    for i in range(1, m):
        acc = acc + sums[:, i : i + nc]
    return (acc / kernel_size).astype(k.dtype)
