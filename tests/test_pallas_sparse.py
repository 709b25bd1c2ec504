"""Block-sparse attention Pallas kernels (issue 4) against the XLA reference ``infllmv2_stage2``.

Interpret mode on CPU (the Pallas HLO interpreter, and TPU interpret mode with race detection for one
case), plus cross-lowering for TPU (Mosaic) and CUDA (Triton) so that illegal block shapes fail here.
Shapes are small: interpret mode is slow (see ``jax_stack.md`` §2.3).
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minicpm4_jax.ops.attention_ref import dense_attention
from minicpm4_jax.ops.infllm_ref import infllmv2_stage2
from minicpm4_jax.ops.pallas.block_lists import build_block_lists, max_blocks_bound
from minicpm4_jax.ops.pallas.sparse_attention import block_sparse_attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _random_selection(rng, b, nkv, t, k, positions, bs, exclude=()):
    """Valid ``topk_idx``: per token up to ``k`` distinct causal blocks ascending, ``-1`` padded."""
    idx = np.full((b, nkv, t, k), -1, np.int32)
    for bi in range(b):
        for h in range(nkv):
            for i in range(t):
                p = int(positions[bi, i])
                if p < 0:
                    continue
                cand = [x for x in range(p // bs + 1) if x not in exclude]
                pick = np.sort(rng.choice(cand, size=min(k, len(cand)), replace=False)) if cand else []
                idx[bi, h, i, :len(pick)] = pick
    return jnp.asarray(idx)


def _inputs(rng, b, t, s, nkv, g, d, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, nkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, nkv, d)), dtype)
    return q, k, v


def _fwd_and_grads(fn, q, k, v):
    """``(out, (dq, dk, dv))`` of a fixed random projection of the output, in one jit."""
    w = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32) * 0.37)

    def loss(q_, k_, v_):
        o = fn(q_, k_, v_)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _check(got, want, fwd_tol=1e-5, grad_tol=1e-4):
    (o1, g1), (o2, g2) = got, want
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), atol=fwd_tol, rtol=0)
    for name, a, r in zip("qkv", g1, g2):
        err = float(jnp.max(jnp.abs(a - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))
        assert err <= grad_tol, f"d{name} relative error {err}"


# ----------------------------------------------------------------------------------------------- block lists
def test_block_lists_match_brute_force():
    rng = np.random.default_rng(0)
    b, nkv, t, k, bs, tq, init, win = 2, 2, 21, 3, 16, 4, 1, 2
    pos = np.stack([np.arange(t), np.where(np.arange(t) < 15, np.arange(t) + 40, -1)])
    nb = 5
    idx = np.array(_random_selection(rng, b, nkv, t, k, pos, bs))
    idx[0, 0, 3, 0] = 99  # out of range: ignored
    build = jax.jit(build_block_lists, static_argnames=("block_size", "num_blocks", "tokens_per_tile", "init_blocks",
                                                         "window_blocks"))
    lists = build(jnp.asarray(idx), jnp.asarray(pos), block_size=bs, num_blocks=nb, tokens_per_tile=tq,
                  init_blocks=init, window_blocks=win)
    m = max_blocks_bound(tq, k, nb, init_blocks=init, window_blocks=win)
    nt = -(-t // tq)
    lists = type(lists)(*(np.asarray(x) for x in lists))
    assert lists.blocks.shape == (b, nkv, nt, m)
    entries = {}
    for bi in range(b):
        for h in range(nkv):
            for i in range(nt):
                sets = []
                for tok in range(tq):
                    r = i * tq + tok
                    if r >= t or pos[bi, r] < 0:
                        sets.append(set())
                        continue
                    qb = pos[bi, r] // bs
                    s_ = {int(x) for x in idx[bi, h, r] if 0 <= x < nb} | set(range(min(init, nb)))
                    s_ |= {x for x in range(qb - win + 1, qb + 1) if 0 <= x < nb}
                    sets.append(s_)
                union = sorted(set().union(*sets))
                c = int(lists.counts[bi, h, i])
                assert c == len(union) <= m
                got = [int(x) for x in lists.blocks[bi, h, i]]
                assert got[:c] == union
                assert got[c:] == [union[-1] if union else 0] * (m - c)  # repeats: no new DMA
                for slot, blk in enumerate(union):
                    word = int(lists.words[bi, h, i, slot]) & 0xFFFFFFFF
                    assert word == sum(1 << tok for tok in range(tq) if blk in sets[tok])
                    entries.setdefault((bi, h, blk), []).append((i, word))
            # inverse (CSR by block)
            off = np.asarray(lists.inv_offsets[bi, h])
            for blk in range(nb):
                got = [(int(lists.inv_tiles[bi, h, e]), int(lists.inv_words[bi, h, e]) & 0xFFFFFFFF)
                       for e in range(off[blk], off[blk + 1])]
                assert got == entries.get((bi, h, blk), [])
                assert all(int(x) == blk for x in lists.inv_blocks[bi, h, off[blk]:off[blk + 1]])


# ----------------------------------------------------------------------------------------------- vs reference
@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_sparse_padding_forced_blocks(backend):
    """G=8, head_dim 64, block 16; lengths not multiples of the block; batch 2 with padding rows and
    kv_valid; random sparse selection plus init/window blocks; block 2 of KV head 0 is picked by no
    top-k (only by the window of its own tokens) and block 0 is shared by every tile (init)."""
    rng = np.random.default_rng(1)
    b, t, nkv, g, d, bs, kk = 2, 70, 2, 8, 64, 16, 3
    q, k, v = _inputs(rng, b, t, t, nkv, g, d)
    n2 = 45
    qpos = np.stack([np.arange(t), np.where(np.arange(t) < n2, np.arange(t), -1)]).astype(np.int32)
    idx = _random_selection(rng, b, nkv, t, kk, qpos, bs, exclude=(2,))
    kvp = jnp.asarray(np.tile(np.arange(t), (b, 1)), jnp.int32)
    valid = jnp.asarray(np.stack([np.arange(t) != 5, np.arange(t) < n2]))
    kw = dict(q_positions=jnp.asarray(qpos), kv_positions=kvp, block_size=bs, window_blocks=1, init_blocks=1,
              kv_valid=valid)
    # TPU: a tiny SMEM budget cuts the calls into chunks (forward/dq: one tile per call; dk/dv: 10 entries
    # per call, so some blocks' entries straddle two calls and accumulate through the aliased buffers)
    extra = {"tpu_prefetch_entries": 10} if backend == "tpu" else {}
    got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, backend=backend, interpret=True, **kw, **extra),
                         q, k, v)
    want = _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), q, k, v)
    _check(got, want)
    assert float(jnp.max(jnp.abs(got[0][1, n2:]))) == 0.0  # padding rows are zero
    assert float(jnp.max(jnp.abs(got[1][1][1, n2:]))) == 0.0  # invalid keys get no gradient


def test_t1_decode_unselected_blocks_tpu():
    """T=1 (decode), G=16, block 32: most KV blocks are selected by no tile -> dk/dv exactly zero there."""
    rng = np.random.default_rng(2)
    b, s, nkv, g, d, bs = 1, 150, 1, 16, 64, 32
    q, k, v = _inputs(rng, b, 1, s, nkv, g, d)
    idx = jnp.asarray([[[[1, -1, -1]]]], jnp.int32)
    kw = dict(q_positions=jnp.asarray([[s - 1]], jnp.int32), kv_positions=jnp.arange(s, dtype=jnp.int32)[None],
              block_size=bs, window_blocks=1, init_blocks=0)
    got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, backend="tpu", interpret=True, **kw), q, k, v)
    want = _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), q, k, v)
    _check(got, want)
    dk = got[1][1]
    assert float(jnp.max(jnp.abs(dk[:, :bs]))) == 0.0 and float(jnp.max(jnp.abs(dk[:, 2 * bs:4 * bs]))) == 0.0
    assert float(jnp.max(jnp.abs(dk[:, bs:2 * bs]))) > 0.0


def test_full_selection_equals_dense_block64_triton():
    """G=16, head_dim 128, block 64 (MiniCPM4): every causal block selected == dense causal attention."""
    rng = np.random.default_rng(3)
    b, t, nkv, g, d, bs = 1, 80, 1, 16, 128, 64
    q, k, v = _inputs(rng, b, t, t, nkv, g, d)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    qb = np.arange(t) // bs
    idx = jnp.asarray(np.where(np.arange(2)[None] <= qb[:, None], np.arange(2)[None], -1)[None, None], jnp.int32)
    kw = dict(q_positions=pos, kv_positions=pos)
    got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, block_size=bs, backend="triton", interpret=True,
                                                           **kw), q, k, v)
    want = _fwd_and_grads(lambda *a: dense_attention(*a, **kw), q, k, v)
    _check(got, want)
    ref = infllmv2_stage2(q, k, v, idx, block_size=bs, **kw)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref), atol=1e-5, rtol=0)


def _bf16_case(seed, t, g, d, picks, bs=16):
    """bf16 ``q, k, v`` (batch 1, one KV group of ``g`` heads), a random causal selection of ``picks`` blocks per
    token, and the keyword arguments both the kernel and the reference take."""
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 1, t, t, 1, g, d, jnp.bfloat16)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    idx = _random_selection(rng, 1, 1, t, picks, np.asarray(pos), bs)
    return q, k, v, idx, dict(q_positions=pos, kv_positions=pos, block_size=bs, window_blocks=1)


def test_bf16_smoke():
    q, k, v, idx, kw = _bf16_case(4, 48, 8, 64, 2)
    out = jax.jit(lambda *a: block_sparse_attention(*a, idx, backend="triton", interpret=True, **kw))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = infllmv2_stage2(*(x.astype(jnp.float32) for x in (q, k, v)), idx, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=0)


def test_bf16_gradients():
    """bf16 gradients of q, k, v (group 16, head_dim 128, 3 selected blocks): against the float32 reference on the
    same bf16-rounded inputs, the kernel's error is within 2e-2 of the largest gradient entry and within twice the
    XLA reference's own bf16 error plus one bf16 ulp (measured: kernel 0.27-0.47%, XLA in bf16 0.41-0.98%)."""
    q, k, v, idx, kw = _bf16_case(11, 80, 16, 128, 3)
    _, got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, backend="triton", interpret=True, **kw), q, k, v)
    _, xla16 = _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), q, k, v)
    _, want = _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, r, w in zip("qkv", got, xla16, want):
        assert a.dtype == jnp.bfloat16, (name, a.dtype)
        a, r, w = (np.asarray(x, np.float32) for x in (a, r, w))
        scale = float(np.abs(w).max())
        err, ref_err = float(np.abs(a - w).max()) / scale, float(np.abs(r - w).max()) / scale
        assert err <= 2e-2 and err <= 2 * ref_err + 2.0**-8, f"d{name}: kernel {err:.4f}, XLA in bf16 {ref_err:.4f}"


def test_tpu_interpret_mode_no_races():
    """TPU interpret mode (simulated VMEM/SMEM/DMA) with race detection, NaN-filled uninitialised memory;
    a tiny SMEM budget makes forward/dq and dk/dv run as 3 chunked calls each (aliased dk/dv accumulation)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.default_rng(5)
    b, t, nkv, g, d, bs = 1, 40, 1, 8, 64, 16
    q, k, v = _inputs(rng, b, t, t, nkv, g, d)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    idx = _random_selection(rng, b, nkv, t, 1, np.asarray(pos), bs)
    kw = dict(q_positions=pos, kv_positions=pos, block_size=bs, window_blocks=1)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")
    try:
        got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, backend="tpu", interpret=params,
                                                               tpu_prefetch_entries=4, **kw), q, k, v)
        assert ipc.races is not None and not ipc.races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    _check(got, _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), q, k, v))


# ----------------------------------------------------------------------------------------------- lowering
def _lower(backend, dtype, platform, **extra):
    b, t, nkv, g, d, bs, kk = 1, 330, 2, 16, 128, 64, 4  # 42 tiles, 6 blocks: list sizes not powers of 2

    def f(q, k, v, idx, pos):
        kw = dict(q_positions=pos, kv_positions=pos, block_size=bs, window_blocks=2, init_blocks=1, backend=backend,
                  **extra)
        return jax.grad(lambda *a: jnp.sum(block_sparse_attention(*a, idx, **kw).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)

    avals = (jax.ShapeDtypeStruct((b, t, nkv * g, d), dtype), jax.ShapeDtypeStruct((b, t, nkv, d), dtype),
             jax.ShapeDtypeStruct((b, t, nkv, d), dtype), jax.ShapeDtypeStruct((b, nkv, t, kk), jnp.int32),
             jax.ShapeDtypeStruct((b, t), jnp.int32))
    return jax.jit(f).trace(*avals).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype,prefetch", [(jnp.float32, 8192), (jnp.bfloat16, 64)])
def test_lowers_for_tpu(dtype, prefetch):
    """Pallas -> Mosaic TPU lowering on CPU (raises on illegal block shapes): fwd, dq and dk/dv kernels, in one
    call each or (small SMEM budget) chunked under ``lax.map`` / ``lax.scan`` with aliased dk/dv."""
    assert _lower("tpu", dtype, "tpu", tpu_prefetch_entries=prefetch).count("tpu_custom_call") == 3


def test_lowers_for_cuda_triton():
    """Pallas -> Triton lowering for CUDA on CPU via an abstract GPU mesh (raises on non-power-of-two loads)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu",
                                                               num_cores=132))
    with jax.sharding.use_abstract_mesh(mesh):
        txt = _lower("triton", jnp.bfloat16, "cuda")
    assert txt.count("xla.gpu.triton") == 3


# ----------------------------------------------------------------------------------------------- API
def test_bad_arguments():
    q, k, v = (jnp.zeros(s, jnp.float32) for s in ((1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64)))
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    idx = jnp.zeros((1, 2, 8, 1), jnp.int32)
    kw = dict(q_positions=pos, kv_positions=pos, block_size=16)
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(q, k, v, idx, backend="cuda", **kw)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attention(q, k, v, idx, **{**kw, "block_size": 24})
    with pytest.raises(ValueError, match="tokens_per_tile"):
        block_sparse_attention(q, k, v, idx, tokens_per_tile=3, **kw)
    with pytest.raises(ValueError, match="topk_idx"):
        block_sparse_attention(q, k, v, idx[:, :1], **kw)
    with pytest.raises(ValueError, match="num_heads"):
        block_sparse_attention(q[:, :, :3], k, v, idx, **kw)


def test_import_is_backend_free():
    """Importing the package and the entry module pulls in neither the TPU nor the Triton Pallas modules."""
    code = ("import sys; import minicpm4_jax.ops.pallas, minicpm4_jax.ops.pallas.sparse_attention, "
            "minicpm4_jax.ops.pallas.block_lists; "
            "bad = [m for m in ('jax.experimental.pallas.tpu', 'jax.experimental.pallas.triton') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})


def test_default_tokens_per_tile_per_backend():
    """Triton tiles hold 64 rows (the H200 sweep, docs/benchmarks.md), TPU tiles 128; never fewer than 16 rows and
    never more tokens than T needs."""
    from minicpm4_jax.ops.pallas.sparse_attention import default_tokens_per_tile

    assert default_tokens_per_tile(32768, 16, "triton") == 4
    assert default_tokens_per_tile(32768, 16, "tpu") == 8
    assert default_tokens_per_tile(32768, 8, "triton") == 8
    assert default_tokens_per_tile(32768, 2, "triton") == 32  # capped at 32 tokens
    assert default_tokens_per_tile(3, 16, "triton") == 4 and default_tokens_per_tile(1, 16, "triton") == 1
    assert default_tokens_per_tile(1, 4, "triton") == 4  # 16 rows at least: 4 tokens x 4 heads


def test_default_select_q_tile_per_target(monkeypatch):
    """The selection tile is 2048 only for the Triton (NVIDIA) kernels (the H200 sweep); 128 on the XLA path, and on
    the TPU / CPU-interpret kernels."""
    import minicpm4_jax.ops.dispatch as dispatch
    from minicpm4_jax.infllm.attention import default_select_q_tile

    assert default_select_q_tile("xla") == 128
    assert default_select_q_tile("pallas") == 128  # CPU: the TPU kernels in the interpreter
    monkeypatch.setattr(dispatch, "pallas_target", lambda: ("triton", False))
    assert default_select_q_tile("pallas") == 2048
    assert default_select_q_tile("xla") == 128


def _drop_two_blocks(rng, nkv, t, bs):
    """``topk_idx [1, nkv, t, nb]``: every causal block of each query except two earlier ones (random per query and
    head), the query's own block always kept."""
    nb = -(-t // bs)
    idx = np.full((1, nkv, t, nb), -1, np.int32)
    for h in range(nkv):
        for i in range(t):
            qb = i // bs
            keep = list(range(qb))
            for x in (rng.choice(qb, size=min(2, qb), replace=False) if qb else []):
                keep.remove(x)
            keep = sorted(keep + [qb])
            idx[0, h, i, :len(keep)] = keep
    return jnp.asarray(idx)


@pytest.mark.parametrize("backend", ["triton", "tpu"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_b05_backward_for_every_head_dim(backend, d):
    """field_faults B05 on the Pallas kernels: forward and dq/dk/dv against the XLA reference for head_dim 32, 64
    and 128 (the backward's tiles must not assume one head_dim), block 64, a selection that drops two blocks per
    query (stop_gradient indices), GQA group 4; and gradient norms within 1% of the reference's."""
    rng = np.random.default_rng(40 + d)
    b, t, nkv, g, bs = 1, 256, 2, 4, 64
    q, k, v = _inputs(rng, b, t, t, nkv, g, d)
    idx = jax.lax.stop_gradient(_drop_two_blocks(rng, nkv, t, bs))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    kw = dict(q_positions=pos, kv_positions=pos, block_size=bs)
    got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, backend=backend, interpret=True, **kw), q, k, v)
    want = _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), q, k, v)
    _check(got, want)
    for a, w in zip(got[1], want[1]):
        assert abs(float(jnp.linalg.norm(a)) / float(jnp.linalg.norm(w)) - 1) < 0.01
