"""Pallas decode kernels (``ops/pallas/decode.py``) against the XLA references in ``ops/decode_ref.py``.

Interpret mode for both backends (TPU Mosaic, GPU Triton), the TPU interpret mode with race detection, and
cross-lowering for TPU and CUDA on this CPU host so that illegal block shapes fail here (issue 4, item 3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for

from minicpm4_jax.ops.decode_ref import dense_decode_attention, sparse_decode_attention
from minicpm4_jax.ops.infllm_ref import compact_topk
from minicpm4_jax.ops.pallas.decode import (decode_block_lists, dense_decode_attention_pallas,
                                            single_token_lists, sparse_decode_attention_pallas)

BACKENDS = ("tpu", "triton")
# jax >= 0.11 warns on every Triton lowering; the GPU path is Triton-lowered Pallas on purpose (issue 4)
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _inputs(b, t, nkv, g, d, cap, dtype=jnp.float32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape_q = (b, nkv * g, d) if t is None else (b, t, nkv * g, d)
    q = jax.random.normal(k1, shape_q).astype(dtype)
    kc = jax.random.normal(k2, (b, nkv, cap, d)).astype(dtype)
    vc = jax.random.normal(k3, (b, nkv, cap, d)).astype(dtype)
    return q, kc, vc


def _picks(rng, b, nkv, t, k, max_blk):
    """Distinct ascending picks per row, padded with -1 (some rows short)."""
    idx = np.full((b, nkv, t, k), -1, np.int32)
    for i in np.ndindex(b, nkv, t):
        n = rng.integers(1, k + 1)
        idx[i][:n] = np.sort(rng.choice(max_blk + 1, size=min(n, max_blk + 1), replace=False))
    return jnp.asarray(idx)


# (T, group, head_dim, block_size, init, window, gather_width): T=None is the [batch, heads, head_dim] form
CASES = [
    pytest.param(None, 8, 64, 16, 1, 2, None, id="T1-g8-d64-forced"),
    pytest.param(4, 16, 128, 16, 0, 0, 3, id="T4-g16-d128-width3"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,g,d,bs,init,win,width", CASES)
def test_sparse_decode_matches_reference(backend, t, g, d, bs, init, win, width):
    b, nkv, cap = 2, 2, 176
    q, kc, vc = _inputs(b, t, nkv, g, d, cap)
    rng = np.random.default_rng(1)
    if t is None:
        pos = jnp.array([150, -1], jnp.int32)  # lengths 151 (not a multiple of 16) and an inactive row
        idx = _picks(rng, b, nkv, 1, 5, 150 // bs)[:, :, 0]
    else:  # consecutive verify tokens; the second sequence has inactive rows around its live tokens
        pos = jnp.array([[97, 98, 99, 100], [-1, 30, 31, -1]], jnp.int32)
        idx = _picks(rng, b, nkv, t, 5, 100 // bs)
    kw = dict(q_positions=pos, block_size=bs, init_blocks=init, window_blocks=win, gather_width=width)
    ref = jax.jit(lambda *a: sparse_decode_attention(*a, **kw))(q, kc, vc, idx)
    out = jax.jit(lambda *a: sparse_decode_attention_pallas(*a, backend=backend, interpret=True, num_splits=2,
                                                            **kw))(q, kc, vc, idx)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    inactive = np.asarray(pos if t is not None else pos[:, None]) < 0
    assert np.all(np.asarray(out if t is not None else out[:, None])[inactive] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_decode_matches_reference(backend):
    q, kc, vc = _inputs(2, 3, 1, 8, 64, 96, seed=2)
    pos = jnp.array([[40, 41, 42], [90, 91, -1]], jnp.int32)
    ref = jax.jit(lambda *a: dense_decode_attention(*a, q_positions=pos))(q, kc, vc)
    out = jax.jit(lambda *a: dense_decode_attention_pallas(*a, q_positions=pos, block_size=32, backend=backend,
                                                           interpret=True))(q, kc, vc)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_decode_bf16_smoke(backend):
    b, nkv, g, d, bs, cap = 1, 2, 16, 64, 16, 128
    q, kc, vc = _inputs(b, None, nkv, g, d, cap, dtype=jnp.bfloat16, seed=3)
    pos = jnp.array([101], jnp.int32)
    idx = jnp.array([[[0, 2, 5, 6], [1, 3, 6, -1]]], jnp.int32)  # picks include forced blocks (gen-2 style)
    kw = dict(q_positions=pos, block_size=bs, init_blocks=1, window_blocks=2)
    ref = jax.jit(lambda *a: sparse_decode_attention(*a, **kw))(q, kc, vc, idx)
    out = jax.jit(lambda *a: sparse_decode_attention_pallas(*a, backend=backend, interpret=True, **kw))(q, kc, vc, idx)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


def test_tpu_interpret_mode_race_detection():
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # races.races_found

    q, kc, vc = _inputs(1, None, 2, 8, 64, 96, seed=4)
    pos = jnp.array([70], jnp.int32)
    idx = jnp.array([[[1, 3, -1], [2, -1, -1]]], jnp.int32)
    kw = dict(q_positions=pos, block_size=16, init_blocks=1, window_blocks=1)
    ref = jax.jit(lambda *a: sparse_decode_attention(*a, **kw))(q, kc, vc, idx)
    try:
        params = pltpu.InterpretParams(detect_races=True)
        out = jax.jit(lambda *a: sparse_decode_attention_pallas(*a, backend="tpu", num_splits=2, interpret=params,
                                                                **kw))(q, kc, vc, idx)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
        assert ipc.races is not None and not ipc.races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [None, 4])
def test_cross_lowering_8b_layout(backend, t):
    """The 8B head layout (16 heads per KV head, head_dim 128, 64-token blocks) lowers for the real target."""
    S = jax.ShapeDtypeStruct
    b, nkv, g, d, cap, k = 2, 2, 16, 128, 8192, 96
    qs = (b, nkv * g, d) if t is None else (b, t, nkv * g, d)
    ids = (b, nkv, k) if t is None else (b, nkv, t, k)
    poss = (b,) if t is None else (b, t)
    args = (S(qs, jnp.bfloat16), S((b, nkv, cap, d), jnp.bfloat16), S((b, nkv, cap, d), jnp.bfloat16),
            S(ids, jnp.int32), S(poss, jnp.int32))

    def sparse(q, kc, vc, idx, pos):
        return sparse_decode_attention_pallas(q, kc, vc, idx, q_positions=pos, block_size=64, init_blocks=1,
                                              window_blocks=33, gather_width=62, backend=backend)

    def dense(q, kc, vc, idx, pos):
        return dense_decode_attention_pallas(q, kc, vc, q_positions=pos, block_size=64, backend=backend)

    marker = "tpu_custom_call" if backend == "tpu" else "triton"
    assert marker in lower_for(sparse, args, backend)
    assert marker in lower_for(dense, args, backend)


def test_cross_lowering_triton_rejects_illegal_block():
    """The CUDA cross-lowering really runs the Triton lowering: a non-power-of-two block fails at lowering."""
    from jax.experimental import pallas as pl

    def f(x):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2), out_shape=x,
                              interpret=False)(x)

    with pytest.raises(Exception, match="power of 2"):
        lower_for(f, (jax.ShapeDtypeStruct((24, 128), jnp.float32),), "triton")


def test_bad_inputs_raise():
    q, kc, vc = _inputs(1, None, 2, 8, 64, 64)
    idx = jnp.zeros((1, 2, 3), jnp.int32)
    pos = jnp.array([10], jnp.int32)
    with pytest.raises(ValueError, match="backend"):
        sparse_decode_attention_pallas(q, kc, vc, idx, q_positions=pos, block_size=16, backend="cuda")
    with pytest.raises(ValueError, match="multiple of block_size"):
        sparse_decode_attention_pallas(q, kc, vc, idx, q_positions=pos, block_size=24, interpret=True)
    with pytest.raises(ValueError, match="topk_idx shape"):
        sparse_decode_attention_pallas(q, kc, vc, idx[:, :1], q_positions=pos, block_size=16, interpret=True)
    with pytest.raises(ValueError, match="must be >= 0"):
        sparse_decode_attention_pallas(q, kc, vc, idx, q_positions=pos, block_size=16, window_blocks=-1,
                                       init_blocks=1, interpret=True)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        sparse_decode_attention_pallas(q[:, :15], kc, vc, idx, q_positions=pos, block_size=16, interpret=True)
    with pytest.raises(ValueError, match="q_positions"):
        dense_decode_attention_pallas(q, kc, vc, q_positions=pos[:, None], block_size=16, interpret=True)
    kc12, vc12 = kc[:, :, :48], vc[:, :, :48]
    with pytest.raises(ValueError, match="power-of-two block_size"):
        sparse_decode_attention_pallas(q, kc12, vc12, idx, q_positions=pos, block_size=12, backend="triton",
                                       interpret=True)


def test_decode_block_lists():
    """Union of picks, init and windows per (sequence, KV head), ascending, token bits, padded with the last id."""
    lists = jax.jit(decode_block_lists, static_argnames=("num_kv_heads", "num_blocks", "block_size",
                                                        "window_blocks", "init_blocks", "length"))
    idx = jnp.array([[[[5, -1], [7, 5]], [[-1, -1], [-1, -1]]]], jnp.int32)  # [b=1, kv=2, T=2, W=2]
    pos = jnp.array([[40, 41]], jnp.int32)  # block 2 (block_size 16) for both tokens
    blocks, bits, count = lists(idx, pos, num_kv_heads=2, num_blocks=10, block_size=16, window_blocks=2,
                                init_blocks=1, length=7)
    np.testing.assert_array_equal(count, [[5, 3]])
    np.testing.assert_array_equal(blocks, [[[0, 1, 2, 5, 7, 7, 7], [0, 1, 2, 2, 2, 2, 2]]])
    np.testing.assert_array_equal(bits, [[[3, 3, 3, 3, 2, 0, 0], [3, 3, 3, 0, 0, 0, 0]]])
    inactive = lists(idx, jnp.array([[-1, -1]], jnp.int32), num_kv_heads=2, num_blocks=10, block_size=16,
                     window_blocks=2, init_blocks=1)
    np.testing.assert_array_equal(inactive[2], [[0, 0]])
    dense = lists(None, jnp.array([[17, 40]], jnp.int32), num_kv_heads=1, num_blocks=4, block_size=16)
    np.testing.assert_array_equal(dense[0], [[[0, 1, 2, 2]]])
    np.testing.assert_array_equal(dense[1], [[[3, 3, 2, 0]]])
    np.testing.assert_array_equal(dense[2], [[3]])


def _fuzz_case(rng, bs=16):
    """A random single-token decode case: raw picks that include forced blocks, short rows, an inactive row."""
    cap = bs * int(rng.integers(3, 14))
    nb, k = cap // bs, int(rng.integers(1, 9))
    init, win = int(rng.integers(0, 3)), int(rng.integers(0, 4))
    if init + win > nb:
        init, win = 0, min(win, nb)
    width = None if rng.random() < 0.3 else int(rng.integers(0, k + 1))
    pos = np.array([rng.integers(0, cap), rng.integers(0, cap), -1], np.int32)
    idx = np.full((3, 2, k), -1, np.int32)
    for i, h in np.ndindex(3, 2):
        qb = max(int(pos[i]), 0) // bs
        n = int(rng.integers(0, min(k, qb + 1) + 1))
        idx[i, h, :n] = rng.permutation(rng.choice(qb + 1, size=n, replace=False))  # any order, forced ones too
    return cap, nb, init, win, width, jnp.asarray(pos), jnp.asarray(idx)


def test_single_token_lists_match_sorted_lists():
    """The elementwise T=1 lists name exactly the blocks of the sorted lists (after the reference compaction)."""
    rng = np.random.default_rng(7)
    for _ in range(24):
        cap, nb, init, win, width, pos, idx = _fuzz_case(rng)
        blocks, bits, count = single_token_lists(idx, pos, num_blocks=nb, block_size=16, window_blocks=win,
                                                 init_blocks=init, gather_width=width)
        assert blocks.shape == bits.shape == (3, 2, init + win + idx.shape[-1])
        assert np.all(np.asarray(count) == blocks.shape[-1]) and np.all((blocks >= 0) & (blocks < nb))
        w = idx.shape[-1] if width is None else width
        comp = compact_topk(idx[:, :, None], pos[:, None], block_size=16, init_blocks=init, window_blocks=win, width=w)
        sb, sbits, scount = decode_block_lists(comp, pos[:, None], num_kv_heads=2, num_blocks=nb, block_size=16,
                                               window_blocks=win, init_blocks=init)
        for i, h in np.ndindex(3, 2):
            got = np.asarray(blocks[i, h])[np.asarray(bits[i, h]) == 1]
            want = np.asarray(sb[i, h])[: int(scount[i, h])]
            want = want[np.asarray(sbits[i, h])[: int(scount[i, h])] != 0]
            assert len(got) == len(set(got.tolist())), (got, i, h)  # no block attended twice
            # the same blocks holding a causal key (the sorted lists also name init blocks past the token's own)
            got, want = (sorted(x for x in a.tolist() if x * 16 <= int(pos[i])) for a in (got, want))
            assert got == want, (got, want, init, win, width, pos, idx[i, h])


def test_single_token_triton_path_matches_reference():
    """The Triton decode step (unsorted lists, skipped slots) equals the XLA reference on random cases."""
    rng = np.random.default_rng(11)
    for case in range(6):
        cap, nb, init, win, width, pos, idx = _fuzz_case(rng)
        width = 1 if case % 2 else width  # half the cases drop picks beyond a narrow width, as the reference does
        g = int(rng.choice([1, 4, 16]))
        q, kc, vc = _inputs(3, None, 2, g, 32, cap, seed=20 + case)
        kw = dict(q_positions=pos, block_size=16, init_blocks=init, window_blocks=win, gather_width=width)
        ref = sparse_decode_attention(q, kc, vc, idx, **kw)
        out = sparse_decode_attention_pallas(q, kc, vc, idx, backend="triton", interpret=True,
                                             num_splits=int(rng.integers(1, 4)), **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5,
                                   err_msg=f"case {case}: init {init} win {win} width {width} pos {pos}")
        assert np.all(np.asarray(out[2]) == 0)  # the inactive row


def test_out_of_range_picks_are_unused_in_reference_and_kernels():
    """A pick at or beyond the cache's block count counts as unused everywhere (it used to be clipped onto the
    last block by the references and dropped by the kernels)."""
    q, kc, vc = _inputs(1, None, 2, 4, 32, 64, seed=9)
    pos = jnp.array([60], jnp.int32)  # 4 blocks of 16
    bad = jnp.array([[[1, 4, 9], [0, 2, 7]]], jnp.int32)
    good = jnp.array([[[1, -1, -1], [0, 2, -1]]], jnp.int32)
    ref_bad = sparse_decode_attention(q, kc, vc, bad, q_positions=pos, block_size=16)
    ref_good = sparse_decode_attention(q, kc, vc, good, q_positions=pos, block_size=16)
    np.testing.assert_array_equal(np.asarray(ref_bad), np.asarray(ref_good))
    for backend in BACKENDS:
        out = sparse_decode_attention_pallas(q, kc, vc, bad, q_positions=pos, block_size=16, backend=backend,
                                             interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_good), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [1, 3])
def test_sparse_decode_cache_shorter_than_forced_blocks(backend, t):
    """A 2-block cache under a 33-block window (the MiniCPM4.1 geometry early in a generation), or fewer blocks
    than init_blocks: refused before, now attended whole, as the reference."""
    q, kc, vc = _inputs(2, t, 2, 2, 16, 128, seed=t)
    pos = jnp.asarray([[100 + i for i in range(t)], [5 + i for i in range(t)]], jnp.int32)
    idx = _picks(np.random.default_rng(t), 2, 2, t, 2, 1)
    for kw in (dict(window_blocks=33, init_blocks=1, gather_width=0), dict(window_blocks=3, init_blocks=4)):
        ref = sparse_decode_attention(q, kc, vc, idx, q_positions=pos, block_size=64, **kw)
        got = sparse_decode_attention_pallas(q, kc, vc, idx, q_positions=pos, block_size=64, backend=backend,
                                             interpret=True, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5, err_msg=str(kw))
