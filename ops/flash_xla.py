"""Dense causal GQA attention by blocks, in pure XLA, with its own backward: the memory-efficient dense path.

:func:`~minicpm4_jax.ops.attention_ref.dense_attention` (the oracle) materialises the ``[batch, heads, q_len,
kv_len]`` float32 scores, and reverse-mode keeps them (and the probabilities) for the backward: 2 GiB per layer
and sequence for the MiniCPM4-8B layout at 4096 tokens, 128 GiB at 32K. :func:`flash_attention` computes the
same function the FlashAttention-2 way (Dao 2023, Algorithms 1-2) with XLA loops instead of a kernel:

* forward: for each query block (``block_q`` tokens x the ``G`` heads of a KV group as rows of one matmul),
  an online softmax over the key blocks (``block_k`` keys) in float32; returns the output and the
  logsumexp ``[batch, kv_heads, G, q_len]``;
* backward (``jax.custom_vjp``): one pass over the key blocks, each walking the query blocks, recomputing the
  probabilities from the saved logsumexp: ``dV += P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``,
  ``dK += dS^T Q``, ``dQ += dS K`` (scaled);
* block pairs with no visible key (every key position after every query position, or padding) are skipped
  with ``lax.cond``, so causal attention does about half the work of the dense product.

Peak memory is ``O(batch * heads * block_q * block_k)`` for the scores plus the inputs, outputs and the
logsumexp, independent of the sequence length squared. Visibility and results are the oracle's: key ``s`` is
seen by query ``t`` iff ``kv_positions[s] <= q_positions[t]`` and ``kv_valid[s]``; a query that sees no key
returns zeros (and gets zero gradients). Derivatives are reverse-mode (``grad``, ``vjp``, and ``jax.hessian``'s
forward-over-reverse); ``jax.jvp`` / ``jax.linearize`` of a ``custom_vjp`` function raise, so forward-mode users
pick ``attention_impl: xla``. Source: spec ``minicpm4_model.md`` §2 (causal GQA, scale
``1/sqrt(head_dim)``); the InfLLM v2 kernels of :mod:`minicpm4_jax.ops.pallas` use the same online softmax.
"""

from __future__ import annotations

import numbers
from functools import partial

import jax
import jax.numpy as jnp

from minicpm4_jax.ops.attention_ref import check_qkv
from minicpm4_jax.ops.tiling import pad_axis

__all__ = ["default_blocks", "flash_attention"]

_BIG = jnp.iinfo(jnp.int32).max


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    kv_valid: jax.Array | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention by blocks with an online softmax (module docstring), differentiable.

    Args:
        q: ``[batch, q_len, num_heads, head_dim]`` queries (post-RoPE), any float dtype.
        k, v: ``[batch, kv_len, num_kv_heads, head_dim]`` keys (post-RoPE) and values.
        q_positions: int ``[batch, q_len]`` absolute positions of the queries (any order).
        kv_positions: int ``[batch, kv_len]`` absolute positions of the keys (any order).
        kv_valid: optional bool ``[batch, kv_len]``, False for padding / unwritten cache slots.
        scale: softmax scale (a Python number), default ``1/sqrt(head_dim)``.
        block_q: query tokens per block (the rows of a product are ``block_q * num_heads / num_kv_heads``);
            default :func:`default_blocks`.
        block_k: keys per block; default :func:`default_blocks`.

    Returns:
        ``[batch, q_len, num_heads, head_dim]`` in ``q.dtype``: equal to
        :func:`~minicpm4_jax.ops.attention_ref.dense_attention` up to float32 rounding (softmax statistics and
        accumulation are float32; in bf16 the probabilities enter the value product in bf16, as in the oracle).

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, mismatched shapes, a block size < 1, or a
            ``scale`` that is not a Python number.
    """
    b, t, nq, d, s, nkv = check_qkv(q, k, v)
    dq_, dk_ = default_blocks()
    block_q = dq_ if block_q is None else block_q
    block_k = dk_ if block_k is None else block_k
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1 for x in (block_q, block_k)):
        raise ValueError(f"block_q={block_q!r} and block_k={block_k!r} must be integers >= 1")
    block_q, block_k = int(block_q), int(block_k)
    if scale is not None and not isinstance(scale, numbers.Real):
        raise ValueError(f"scale={scale!r} must be a Python number or None (it is static here); pass a traced scale to "
                         "ops.attention_ref.dense_attention instead")
    scale = d**-0.5 if scale is None else float(scale)
    bq, bk = min(block_q, t), min(block_k, s)
    if kv_valid is None:
        kv_valid = jnp.ones((b, s), bool)
    return _flash(q, k, v, q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32), kv_valid.astype(bool),
                  scale, bq, bk)


def default_blocks(backend: str | None = None) -> tuple[int, int]:
    """``(block_q, block_k)`` for ``backend`` (default: JAX's default backend).

    CPU: 64 x 128, the fastest of the sizes timed on the 2-core CPU (``docs/benchmarks.md``, "Dense attention by
    blocks"). GPU / TPU: 512 x 1024, chosen without a measurement so that each loop iteration is a large product
    (8192 rows x 1024 keys for the 8B layout) and a 32K sequence ~1000 live block pairs instead of ~65000;
    ``scripts/gpu_check.sh --tune`` times it against the reference and cuDNN on an NVIDIA GPU.
    """
    backend = jax.default_backend() if backend is None else backend
    return (64, 128) if backend == "cpu" else (512, 1024)


# -- layout helpers ----------------------------------------------------------------------------------------------
def _q_blocks(x: jax.Array, nkv: int, bq: int) -> jax.Array:
    """``[b, t, nq, e]`` -> ``[nQ, b * nkv, G * bq, e]`` (rows: the group's heads x the block's tokens)."""
    b, t, nq, e = x.shape
    g = nq // nkv
    x = pad_axis(x, bq, 1, 0)
    n = x.shape[1] // bq
    x = x.reshape(b, n, bq, nkv, g, e).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(n, b * nkv, g * bq, e)


def _q_unblock(x: jax.Array, b: int, t: int, nkv: int, bq: int) -> jax.Array:
    """Inverse of :func:`_q_blocks` (drops the padding)."""
    n, _, rows, e = x.shape
    g = rows // bq
    x = x.reshape(n, b, nkv, g, bq, e).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(b, n * bq, nkv * g, e)[:, :t]


def _kv_blocks(x: jax.Array, bk: int) -> jax.Array:
    """``[b, s, nkv, d]`` -> ``[nK, b * nkv, bk, d]``."""
    b, s, nkv, d = x.shape
    x = pad_axis(x, bk, 1, 0)
    n = x.shape[1] // bk
    return x.reshape(b, n, bk, nkv, d).transpose(1, 0, 3, 2, 4).reshape(n, b * nkv, bk, d)


def _kv_unblock(x: jax.Array, b: int, s: int, nkv: int) -> jax.Array:
    n, _, bk, d = x.shape
    return x.reshape(n, b, nkv, bk, d).transpose(1, 0, 3, 2, 4).reshape(b, n * bk, nkv, d)[:, :s]


def _layout(q, k, v, q_positions, kv_positions, kv_valid, bq, bk):
    """Blocked operands, positions and the ``[nQ, nK]`` table of block pairs that may have a visible key."""
    b = q.shape[0]
    nkv = k.shape[2]
    qb, kb, vb = _q_blocks(q, nkv, bq), _kv_blocks(k, bk), _kv_blocks(v, bk)
    # padding: query rows at position -1 (their outputs are dropped, their output gradients are 0); keys invalid
    qpos = pad_axis(q_positions, bq, 1, -1)
    kpos = pad_axis(kv_positions, bk, 1, 0)
    kval = pad_axis(kv_valid, bk, 1, False)
    n_q, n_k = qpos.shape[1] // bq, kpos.shape[1] // bk
    qpos = qpos.reshape(b, n_q, bq).swapaxes(0, 1)  # [nQ, b, bq]
    kpos = kpos.reshape(b, n_k, bk).swapaxes(0, 1)  # [nK, b, bk]
    kval = kval.reshape(b, n_k, bk).swapaxes(0, 1)
    qmax = qpos.max(axis=-1)  # [nQ, b]
    kmin = jnp.where(kval, kpos, _BIG).min(axis=-1)  # [nK, b]: the earliest valid key of the block
    live = jnp.any(kmin[None, :, :] <= qmax[:, None, :], axis=-1)  # [nQ, nK]
    return qb, kb, vb, qpos, kpos, kval, live


def _mask(qpos_i, kpos_j, kval_j, nkv: int, g: int):
    """``[b * nkv, G * bq, bk]`` visibility of block pair (i, j)."""
    m = (kpos_j[:, None, :] <= qpos_i[:, :, None]) & kval_j[:, None, :]  # [b, bq, bk]
    b, bq, bk = m.shape
    return jnp.broadcast_to(m[:, None, None], (b, nkv, g, bq, bk)).reshape(b * nkv, g * bq, bk)


def _dot(a, b_, contract):
    """Batched product over the leading axis, float32 accumulation."""
    return jax.lax.dot_general(a, b_, ((contract[0], contract[1]), ((0,), (0,))),
                               preferred_element_type=jnp.float32)


# -- forward / backward -----------------------------------------------------------------------------------------
def _tie_positions(q, q_positions, kv_positions, kv_valid):
    """The positions and validity as outputs of one ``optimization_barrier`` with ``q`` (no computation).

    Under ``grad`` of a ``lax.scan`` (the layer scan) JAX's partial evaluation hoists out of the loop whatever
    depends only on loop-invariant inputs, the positions here: the per-pair visibility masks of the block loops
    below were hoisted and stacked for every (query block, key block) pair, a ``[nQ, nK, rows, bk]`` array
    (``T^2 x group`` per KV head: 512 MiB per device in MiniCPM4-0.5B's train step at 4K), the very
    materialisation this module exists to avoid. Tied to ``q`` (which depends on the layer's input) they are no
    longer loop-invariant, and each mask lives for one block pair again.
    """
    return jax.lax.optimization_barrier((q, q_positions, kv_positions, kv_valid))


def _forward(q, k, v, q_positions, kv_positions, kv_valid, scale, bq, bk):
    q, q_positions, kv_positions, kv_valid = _tie_positions(q, q_positions, kv_positions, kv_valid)
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    qb, kb, vb, qpos, kpos, kval, live = _layout(q, k, v, q_positions, kv_positions, kv_valid, bq, bk)
    n_k = kb.shape[0]
    rows = g * bq

    def q_block(args):
        qi, qpos_i, live_i = args

        def step(j, carry):
            def attend(c):
                m, l, acc = c
                s_ij = _dot(qi, kb[j], ((2,), (2,))) * scale  # [B', rows, bk]
                vis = _mask(qpos_i, kpos[j], kval[j], nkv, g)
                s_ij = jnp.where(vis, s_ij, -jnp.inf)
                m_new = jnp.maximum(m, s_ij.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.where(vis, jnp.exp(s_ij - m_safe[..., None]), 0.0)
                alpha = jnp.exp(m - m_safe)  # m = -inf -> 0
                l = alpha * l + p.sum(axis=-1)
                acc = alpha[..., None] * acc + _dot(p.astype(vb.dtype), vb[j], ((2,), (1,)))
                return m_new, l, acc

            return jax.lax.cond(live_i[j], attend, lambda c: c, carry)

        init = (jnp.full((b * nkv, rows), -jnp.inf, jnp.float32), jnp.zeros((b * nkv, rows), jnp.float32),
                jnp.zeros((b * nkv, rows, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, n_k, step, init)
        out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
        lse = jnp.where(l > 0.0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)
        return out, lse

    out_b, lse_b = jax.lax.map(q_block, (qb, qpos, live))  # [nQ, B', rows, d], [nQ, B', rows]
    out = _q_unblock(out_b, b, t, nkv, bq).astype(q.dtype)
    return out, lse_b


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_positions, kv_positions, kv_valid, scale, bq, bk):
    return _forward(q, k, v, q_positions, kv_positions, kv_valid, scale, bq, bk)[0]


def _flash_fwd(q, k, v, q_positions, kv_positions, kv_valid, scale, bq, bk):
    out, lse_b = _forward(q, k, v, q_positions, kv_positions, kv_valid, scale, bq, bk)
    return out, (q, k, v, q_positions, kv_positions, kv_valid, out, lse_b)


def _flash_bwd(scale, bq, bk, res, d_out):
    q, k, v, q_positions, kv_positions, kv_valid, out, lse_b = res
    q, q_positions, kv_positions, kv_valid = _tie_positions(q, q_positions, kv_positions, kv_valid)
    b, t, nq, d = q.shape
    s = k.shape[1]
    nkv = k.shape[2]
    g = nq // nkv
    qb, kb, vb, qpos, kpos, kval, live = _layout(q, k, v, q_positions, kv_positions, kv_valid, bq, bk)
    dob = _q_blocks(d_out, nkv, bq)  # [nQ, B', rows, d]
    delta = jnp.sum(dob.astype(jnp.float32) * _q_blocks(out, nkv, bq).astype(jnp.float32), axis=-1)  # [nQ, B', rows]
    lse_safe = jnp.where(jnp.isfinite(lse_b), lse_b, 0.0)
    n_q = qb.shape[0]
    cdt = q.dtype

    def kv_block(dq, args):
        kj, vj, kpos_j, kval_j, live_j = args

        def step(i, carry):
            def attend(c):
                dk, dv, dq_all = c
                qi, doi = qb[i], dob[i]
                s_ij = _dot(qi, kj, ((2,), (2,))) * scale
                vis = _mask(qpos[i], kpos_j, kval_j, nkv, g)  # a row that sees no key has lse = -inf: all False
                p = jnp.where(vis, jnp.exp(s_ij - lse_safe[i][..., None]), 0.0)  # [B', rows, bk]
                dv = dv + _dot(p.astype(cdt), doi, ((1,), (1,)))  # [B', bk, d]
                dp = _dot(doi, vj, ((2,), (2,)))  # [B', rows, bk]
                ds = (p * (dp - delta[i][..., None]) * scale).astype(cdt)
                dk = dk + _dot(ds, qi, ((1,), (1,)))  # [B', bk, d]
                dq_i = dq_all[i] + _dot(ds, kj, ((2,), (1,)))  # [B', rows, d]
                return dk, dv, jax.lax.dynamic_update_index_in_dim(dq_all, dq_i, i, 0)

            return jax.lax.cond(live_j[i], attend, lambda c: c, carry)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(0, n_q, step, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq_b, (dk_b, dv_b) = jax.lax.scan(kv_block, dq0, (kb, vb, kpos, kval, live.T))
    dq = _q_unblock(dq_b, b, t, nkv, bq).astype(q.dtype)
    dk = _kv_unblock(dk_b, b, s, nkv).astype(k.dtype)
    dv = _kv_unblock(dv_b, b, s, nkv).astype(v.dtype)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
