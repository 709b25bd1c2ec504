"""Pure-XLA dense causal GQA attention: the oracle for every kernel and the CPU fallback.

Source: spec ``minicpm4_model.md`` §2 (causal softmax attention, scale 1/sqrt(d), query head j
reads KV head ``j // G`` with G = num_attention_heads / num_key_value_heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dense_attention", "check_qkv"]


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array | None = None,
              kv_positions: jax.Array | None = None,
              kv_valid: jax.Array | None = None) -> tuple[int, int, int, int, int, int]:
    """Validate ``q [batch, T, heads, d]``, ``k``/``v [batch, S, kv_heads, d]`` and, when given, ``q_positions
    [batch, T]``, ``kv_positions`` / ``kv_valid [batch, S]``; return ``(b, T, heads, d, S, kv_heads)``.

    Raises:
        ValueError: ``heads`` not a multiple of ``kv_heads`` or mismatched shapes (one line naming the array).
    """
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q {q.shape} must be [batch, T, heads, head_dim] and k {k.shape} [batch, S, kv_heads, "
                         "head_dim]")
    b, t, nq, d = q.shape
    _, s, nkv, _ = k.shape
    if nq % nkv:
        raise ValueError(f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    for name, x, want in (("q_positions", q_positions, (b, t)), ("kv_positions", kv_positions, (b, s)),
                          ("kv_valid", kv_valid, (b, s))):
        if x is not None and tuple(x.shape) != want:
            raise ValueError(f"{name} shape {tuple(x.shape)} must be {list(want)} (batch, "
                             f"{'T' if name == 'q_positions' else 'kv_len'}) for q {q.shape}, k {k.shape}")
    return b, t, nq, d, s, nkv


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    kv_valid: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal grouped-query attention with fp32 softmax.

    Args:
        q: ``[batch, q_len, num_heads, head_dim]`` queries (post-RoPE), any float dtype.
        k: ``[batch, kv_len, num_kv_heads, head_dim]`` keys (post-RoPE).
        v: ``[batch, kv_len, num_kv_heads, head_dim]`` values.
        q_positions: ``[batch, q_len]`` int32 absolute positions of the queries.
        kv_positions: ``[batch, kv_len]`` int32 absolute positions of the keys.
        kv_valid: optional ``[batch, kv_len]`` bool, False for padding / unwritten cache slots.
        scale: softmax scale, default ``1/sqrt(head_dim)``.

    Returns:
        ``[batch, q_len, num_heads, head_dim]`` in ``q.dtype``. Key ``s`` is visible to query ``t``
        iff ``kv_positions[s] <= q_positions[t]`` (and ``kv_valid[s]``). A query with no visible key
        returns zeros.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads`` or mismatched shapes.
    """
    b, t, nq, d, s, nkv = check_qkv(q, k, v, q_positions, kv_positions, kv_valid)
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    # explicit 3-D batched dots over (batch, kv head) with the group's heads x queries as rows: the 5-D
    # einsum form made XLA:CPU transpose operands inside the products (3.7x slower fwd+bwd at T=1536)
    qr = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * nkv, g * t, d)
    kr = k.transpose(0, 2, 1, 3).reshape(b * nkv, s, d)
    vr = v.transpose(0, 2, 1, 3).reshape(b * nkv, s, d)
    logits = jax.lax.dot_general(qr, kr, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    logits = logits.reshape(b, nkv, g, t, s) * scale
    mask = kv_positions[:, None, :] <= q_positions[:, :, None]  # [b, t, s]
    if kv_valid is not None:
        mask = mask & kv_valid[:, None, :]
    mask = mask[:, None, None, :, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jax.lax.dot_general(p.astype(v.dtype).reshape(b * nkv, g * t, s), vr, (((2,), (1,)), ((0,), (0,))),
                              preferred_element_type=jnp.float32)
    return out.reshape(b, nkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, nq, d).astype(q.dtype)
