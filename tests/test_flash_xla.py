"""Dense attention by blocks with its own backward (``ops/flash_xla.py``) against the materialising reference.

Forward <= 1e-5 (float32) / 2e-2 (bfloat16); gradients of q, k, v <= 1e-4 of their largest magnitude (float32);
lengths that are not multiples of the blocks, one token, GQA groups of 1, 2, 8 and 16, head_dim 64 and 128,
padding keys, queries that see no key, queries at arbitrary (permuted) positions and a query chunk that starts
after the keys (chunked prefill). Also: fully masked block pairs are skipped without changing anything, the
compiled forward + backward holds far less memory than the reference's, and the model's ``attention_impl:
auto`` (which runs it) equals ``xla`` (the reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minicpm4_jax.ops.attention_ref import dense_attention
from minicpm4_jax.ops.flash_xla import flash_attention


def _inputs(b, t, s, nq, nkv, d, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, nq, d), dtype)
    k = jax.random.normal(ks[1], (b, s, nkv, d), dtype)
    v = jax.random.normal(ks[2], (b, s, nkv, d), dtype)
    return q, k, v


def _loss(fn, kw, w):
    return lambda q, k, v: jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) * w)


def _assert_close_to_reference(q, k, v, kw, *, block_q, block_k, fwd_tol=1e-5, grad_tol=1e-4):
    out = flash_attention(q, k, v, block_q=block_q, block_k=block_k, **kw)
    ref = dense_attention(q, k, v, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=fwd_tol, rtol=0)
    w = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32) * 0.7)  # a non-uniform output cotangent
    flash = lambda q, k, v, **a: flash_attention(q, k, v, block_q=block_q, block_k=block_k, **a)  # noqa: E731
    got = jax.grad(_loss(flash, kw, w), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss(dense_attention, kw, w), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        # floor: with one key the true dq, dk are 0 (the reference's softmax backward gives exact zeros) and
        # ours keeps ~1e-7 of float32 rounding from dO . v - rowsum(dO * O), computed in two orders
        scale = max(float(np.max(np.abs(r))), 1e-2)
        np.testing.assert_allclose(g, r, atol=grad_tol * scale, rtol=0, err_msg=f"d{name}")
    return out


def _pos(b, n, offset=0):
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + offset, (b, n))


@pytest.mark.parametrize("b,t,nq,nkv,d,block_q,block_k", [
    (2, 37, 8, 2, 16, 8, 16),      # ragged: neither length a multiple of its block
    (1, 1, 4, 2, 64, 64, 128),     # one token
    (2, 50, 4, 4, 32, 16, 16),     # G = 1
    (1, 70, 16, 2, 64, 16, 32),    # G = 8, head_dim 64
    (1, 45, 16, 1, 128, 8, 16),    # G = 16, head_dim 128
    (2, 64, 4, 2, 64, 64, 64),     # one block each way
])
def test_causal_matches_reference(b, t, nq, nkv, d, block_q, block_k):
    q, k, v = _inputs(b, t, t, nq, nkv, d)
    _assert_close_to_reference(q, k, v, dict(q_positions=_pos(b, t), kv_positions=_pos(b, t)), block_q=block_q,
                               block_k=block_k)


def test_padding_keys_and_queries_that_see_nothing():
    b, t, nq, nkv, d = 2, 40, 8, 2, 16
    q, k, v = _inputs(b, t, t, nq, nkv, d, seed=1)
    valid = jnp.arange(t)[None, :] < jnp.asarray([[t], [13]])  # the second sequence has 13 keys
    valid = valid & (jnp.arange(t)[None, :] >= jnp.asarray([[0], [5]]))  # ... from position 5 on
    kw = dict(q_positions=_pos(b, t), kv_positions=_pos(b, t), kv_valid=valid)
    out = _assert_close_to_reference(q, k, v, kw, block_q=8, block_k=8)
    # its queries at positions 0..4 see no key: zeros, and no gradient reaches them
    np.testing.assert_array_equal(np.asarray(out[1, :5]), 0.0)
    dq = jax.grad(lambda q_: jnp.sum(flash_attention(q_, k, v, block_q=8, block_k=8, **kw)))(q)
    np.testing.assert_array_equal(np.asarray(dq[1, :5]), 0.0)
    assert np.all(np.isfinite(np.asarray(dq)))


def test_permuted_query_positions_and_a_later_chunk():
    b, nq, nkv, d = 2, 8, 2, 32
    # queries in any order (a packed or shuffled batch): visibility follows the positions, not the index
    q, k, v = _inputs(b, 33, 33, nq, nkv, d, seed=2)
    perm = jax.random.permutation(jax.random.key(5), _pos(b, 33), axis=1, independent=True)
    _assert_close_to_reference(q, k, v, dict(q_positions=perm, kv_positions=_pos(b, 33)), block_q=8, block_k=8)
    # a chunk of 20 queries at positions 30..49 over 50 keys (chunked prefill over a cache)
    q, k, v = _inputs(b, 20, 50, nq, nkv, d, seed=3)
    _assert_close_to_reference(q, k, v, dict(q_positions=_pos(b, 20, 30), kv_positions=_pos(b, 50)), block_q=8,
                               block_k=16)


def test_bfloat16_within_tolerance():
    q, k, v = _inputs(2, 100, 100, 16, 2, 128, dtype=jnp.bfloat16, seed=4)
    kw = dict(q_positions=_pos(2, 100), kv_positions=_pos(2, 100))
    out = flash_attention(q, k, v, block_q=32, block_k=32, **kw)
    assert out.dtype == jnp.bfloat16
    # against the float32 reference of the same (bf16-valued) inputs
    ref = dense_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=0)


def test_skipped_blocks_change_nothing():
    """Causal block pairs above the diagonal are skipped; with every key visible none is, and the result is the
    same attention as the reference's with the mask off."""
    q, k, v = _inputs(1, 48, 48, 4, 2, 16, seed=6)
    causal = flash_attention(q, k, v, q_positions=_pos(1, 48), kv_positions=_pos(1, 48), block_q=8, block_k=8)
    late = jnp.full((1, 48), 10**6, jnp.int32)  # every query after every key: nothing skipped, nothing masked
    full = flash_attention(q, k, v, q_positions=late, kv_positions=_pos(1, 48), block_q=8, block_k=8)
    ref_full = dense_attention(q, k, v, q_positions=late, kv_positions=_pos(1, 48))
    np.testing.assert_allclose(np.asarray(full), np.asarray(ref_full), atol=1e-5)
    assert float(jnp.max(jnp.abs(full - causal))) > 1e-2  # the two are different functions


def test_bad_block_size():
    q, k, v = _inputs(1, 4, 4, 2, 1, 8)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"block_q={bad!r} and block_k=128 must be integers >= 1"):
            flash_attention(q, k, v, q_positions=_pos(1, 4), kv_positions=_pos(1, 4), block_q=bad)
    with pytest.raises(ValueError, match="must be a Python number"):
        flash_attention(q, k, v, q_positions=_pos(1, 4), kv_positions=_pos(1, 4), scale=jnp.float32(0.5))
    # a numpy scalar is a number: the same result as the float
    np.testing.assert_array_equal(
        np.asarray(flash_attention(q, k, v, q_positions=_pos(1, 4), kv_positions=_pos(1, 4), scale=np.float32(0.5))),
        np.asarray(flash_attention(q, k, v, q_positions=_pos(1, 4), kv_positions=_pos(1, 4), scale=0.5)))


def test_compiled_memory_is_linear_in_length():
    """fwd + bwd at T = 2048, 4 heads: the reference keeps [4, 2048, 2048] float32 scores and probabilities
    (64 MiB each); by blocks of 64 x 128 the temporaries are a few MiB (measured, jax 0.12 CPU: ~260 vs ~9 MiB)."""
    t = 2048
    q, k, v = _inputs(1, t, t, 4, 2, 64)
    kw = dict(q_positions=_pos(1, t), kv_positions=_pos(1, t))
    temps = {}
    for name, fn in (("ref", dense_attention), ("flash", flash_attention)):
        f = jax.jit(jax.grad(_loss(fn, kw, 1.0), argnums=(0, 1, 2)))
        temps[name] = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    scores = 4 * t * t * 4
    assert temps["ref"] >= scores, temps
    assert temps["flash"] <= scores / 4, temps


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "remat_scan"])
def test_memory_stays_linear_inside_a_differentiated_layer_scan(remat):
    """The model calls the attention inside its layer scan (and ``jax.checkpoint`` with ``remat``). Under ``grad``
    JAX's scan partial evaluation hoists out of the loop what depends only on loop-invariant inputs: the positions'
    per-block-pair masks were hoisted and stacked for all pairs, ``[nQ, nK, rows, bk]`` float32 and bool arrays
    (T^2 per head: the train step of MiniCPM4-0.5B at 4K held 512 MiB of them per device). Measured (jax 0.12 CPU,
    T = 2048, 2 layers): 196-200 MiB with the masks hoisted, 20-22 MiB without."""
    t = 2048
    q, k, v = _inputs(1, t, t, 4, 2, 64)
    kw = dict(q_positions=_pos(1, t), kv_positions=_pos(1, t))
    attn = lambda q, k, v: flash_attention(q, k, v, **kw)  # noqa: E731
    attn = jax.checkpoint(attn) if remat else attn

    def loss(q, k, v):
        def layer(x, _):
            return x + attn(x, k + x[:, :, :2], v), None  # every layer's q and k depend on its input

        out, _ = jax.lax.scan(layer, q, None, length=2)
        return jnp.sum(out)

    temp = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    scores = 4 * t * t * 4  # one layer's [heads, T, T] float32 scores
    assert temp <= scores / 2, temp / 2**20


def test_model_auto_equals_xla_reference():
    from flax import nnx

    from minicpm4_jax.config import load_config
    from minicpm4_jax.nn.model import MiniCPM4

    ids = jax.random.randint(jax.random.key(0), (2, 96), 0, 512)
    outs = {}
    for impl in ("auto", "xla"):
        cfg = load_config("cpu_tiny", ["model.num_hidden_layers=2", "model.vocab_size=512",
                                       "data.tokenizer_vocab_size=512", f"model.attention_impl={impl}"]).model
        model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
        gd, params = nnx.split(model)
        loss = lambda p: jnp.mean(nnx.merge(gd, p)(ids) ** 2)  # noqa: E731
        outs[impl] = (model(ids), jax.grad(loss)(params))
    np.testing.assert_allclose(np.asarray(outs["auto"][0]), np.asarray(outs["xla"][0]), atol=1e-4, rtol=1e-5)
    for a, r in zip(jax.tree.leaves(outs["auto"][1]), jax.tree.leaves(outs["xla"][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-4 * float(np.max(np.abs(r))) + 1e-9)
