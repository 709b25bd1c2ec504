"""Pallas stage-1 scoring kernel (``ops/pallas/stage1.py``) against ``infllm.select.stage1_scores``.

Interpret mode for both backends (TPU Mosaic, GPU Triton), gen-1 and gen-2 (rows without a visible kernel,
gen-2 rows without a visible coarse kernel -> ``+inf``), the off-by-one quirk, decode (T = 1), the TPU
interpret mode with race detection, and cross-lowering for TPU and CUDA (issue 4, item 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for

from minicpm4_jax.config import SparseConfig
from minicpm4_jax.infllm.compress import compress_keys
from minicpm4_jax.infllm.select import select_params, stage1_scores
from minicpm4_jax.ops.pallas import stage1 as stage1_mod
from minicpm4_jax.ops.pallas.stage1 import stage1_scores_pallas

BACKENDS = ("tpu", "triton")
# jax >= 0.11 warns on every Triton lowering; the GPU path is Triton-lowered Pallas on purpose (issue 4)
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
# small geometry: fine kernels (8, 4), coarse (32, 16), 16-token blocks
SMALL = dict(kernel_size=8, kernel_stride=4, block_size=16, window_size=32, topk=4)


def _case(variant, *, g, d, t, n=200, b=2, nkv=2, quirk=False, dtype=jnp.float32, score_dtype="float32", seed=0):
    p = select_params(SparseConfig(variant=variant, **SMALL), kernel_offby1_quirk=quirk, score_dtype=score_dtype)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    k = jax.random.normal(k1, (b, n, nkv, d)).astype(dtype)
    q = jax.random.normal(k2, (b, t, nkv * g, d)).astype(dtype)
    ck1 = compress_keys(k, p.kernel_size, p.kernel_stride)
    ck2 = compress_keys(k, p.coarse_size, p.coarse_stride) if variant == "gen2" else None
    if t == 1:  # decode: one token per sequence at the end of its cache / mid-cache
        pos = jnp.array([[n - 1], [150]], jnp.int32)[:b]
    else:  # sequence 0: early rows (no visible fine / coarse kernel) to late; sequence 1: tail + padding rows
        tail = jnp.concatenate([jnp.arange(n - t + 2, n), jnp.array([-1, -1])])
        pos = jnp.stack([jnp.arange(t) * (n // t) + 3, tail]).astype(jnp.int32)[:b]
    kv_len = jnp.full((b,), n, jnp.int32)
    return p, q, ck1, ck2, pos, kv_len


def _ref(q, ck1, ck2, **kw):
    """The XLA reference, jitted (eager dispatch of its ~50 ops costs seconds on CPU)."""
    return jax.jit(lambda a, b, c: stage1_scores(a, b, c, **kw))(q, ck1, ck2)


def assert_scores_match(out, ref, tol):
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(np.isposinf(o), np.isposinf(r))
    np.testing.assert_array_equal(o == 0, r == 0)  # exactly 0 on invisible kernels
    fin = np.isfinite(r)
    np.testing.assert_allclose(o[fin], r[fin], atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant,g,d,t,quirk", [
    pytest.param("gen1", 8, 64, 24, False, id="gen1-g8-d64"),
    pytest.param("gen2", 16, 128, 24, True, id="gen2-g16-d128-quirk"),
    pytest.param("gen2", 8, 64, 1, False, id="gen2-decode"),
])
def test_stage1_matches_reference(backend, variant, g, d, t, quirk):
    p, q, ck1, ck2, pos, kv_len = _case(variant, g=g, d=d, t=t, quirk=quirk)
    num_q = 200 if quirk else None  # the quirk needs the call's full T (prefill T = N)
    ref = _ref(q, ck1, ck2, q_positions=pos, kv_len=kv_len, params=p, num_q=num_q)
    f = jax.jit(lambda *a: stage1_scores_pallas(*a, q_positions=pos, kv_len=kv_len, params=p, num_q=num_q,
                                                backend=backend, interpret=True))
    out = f(q, ck1, ck2)
    assert_scores_match(out, ref, 1e-5)
    if variant == "gen2" and t > 1:
        assert np.isposinf(np.asarray(out)).any()  # early rows: no visible coarse kernel
    if t > 1:
        assert np.all(np.asarray(out)[1, :, -2:] == 0)  # padding rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_stage1_bf16_smoke(backend):
    p, q, ck1, ck2, pos, kv_len = _case("gen2", g=16, d=64, t=8, b=1, dtype=jnp.bfloat16, score_dtype="bfloat16",
                                        seed=1)
    ref = _ref(q, ck1, ck2, q_positions=pos, kv_len=kv_len, params=p)
    out = jax.jit(lambda *a: stage1_scores_pallas(*a, q_positions=pos, kv_len=kv_len, params=p, backend=backend,
                                                  interpret=True))(q, ck1, ck2)
    assert_scores_match(out, ref, 2e-2)


def test_stage1_small_chunks_and_tiles():
    """Several query tiles and kernel chunks per program (chunks past the visible range are skipped)."""
    p, q, ck1, ck2, pos, kv_len = _case("gen1", g=8, d=64, t=24, b=1, seed=2)
    ref = _ref(q, ck1, ck2, q_positions=pos, kv_len=kv_len, params=p)
    out = jax.jit(lambda *a: stage1_scores_pallas(*a, q_positions=pos, kv_len=kv_len, params=p, backend="triton",
                                                  interpret=True, q_tile=4, kernel_chunk=16))(q, ck1, ck2)
    assert_scores_match(out, ref, 1e-5)


def test_tpu_interpret_mode_race_detection():
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # races.races_found

    p, q, ck1, ck2, pos, kv_len = _case("gen2", g=8, d=64, t=4, n=160, b=1, nkv=1, seed=3)
    ref = _ref(q, ck1, ck2, q_positions=pos, kv_len=kv_len, params=p)
    try:
        params = pltpu.InterpretParams(detect_races=True)
        out = jax.jit(lambda *a: stage1_scores_pallas(*a, q_positions=pos, kv_len=kv_len, params=p, backend="tpu",
                                                      q_tile=2, interpret=params))(q, ck1, ck2)
        assert_scores_match(out, ref, 1e-5)
        assert ipc.races is not None and not ipc.races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_cross_lowering_8b_layout(backend, variant):
    """The 8B layout (G = 16, head_dim 128, default kernels) lowers for prefill tiles and decode, bf16."""
    S = jax.ShapeDtypeStruct
    p = select_params(SparseConfig(variant=variant), score_dtype="bfloat16")
    b, nkv, g, d, n = 1, 2, 16, 128, 4096
    for t in (1, 300):
        args = (S((b, t, nkv * g, d), jnp.bfloat16), S((b, n // 16 - 1, nkv, d), jnp.bfloat16),
                S((b, n // 64 - 1, nkv, d), jnp.bfloat16), S((b, t), jnp.int32), S((b,), jnp.int32))

        def f(q, c1, c2, pos, kl):
            return stage1_scores_pallas(q, c1, c2, q_positions=pos, kv_len=kl, params=p, backend=backend)

        assert ("tpu_custom_call" if backend == "tpu" else "triton") in lower_for(f, args, backend)


def test_bad_inputs_raise():
    p, q, ck1, ck2, pos, kv_len = _case("gen2", g=8, d=64, t=1, b=1)
    kw = dict(q_positions=pos, kv_len=kv_len, params=p, interpret=True)
    with pytest.raises(ValueError, match="backend"):
        stage1_scores_pallas(q, ck1, ck2, q_positions=pos, kv_len=kv_len, params=p, backend="gpu")
    with pytest.raises(ValueError, match="needs the coarse"):
        stage1_scores_pallas(q, ck1, None, **kw)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        stage1_scores_pallas(q[:, :, :15], ck1, ck2, **kw)
    with pytest.raises(ValueError, match="shape mismatch"):
        stage1_scores_pallas(q[..., :32], ck1, ck2, **kw)
    with pytest.raises(ValueError, match="q_positions"):
        stage1_scores_pallas(q, ck1, ck2, q_positions=pos[:, 0], kv_len=kv_len, params=p, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        stage1_scores_pallas(q, ck1, ck2, backend="triton", q_tile=3, **kw)
    with pytest.raises(ValueError, match="multiple of 128"):
        stage1_scores_pallas(q, ck1, ck2, backend="tpu", kernel_chunk=64, **kw)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=rf"split_chunks={bad!r}.*pass None"):
            stage1_scores_pallas(q, ck1, ck2, backend="triton", split_chunks=bad, **kw)


# --- Triton chunk split (decode: a grid of b * kv_heads * tiles programs too small to fill the GPU) ---------
_SPLIT_NAME = "infllmv2_stage1_triton_score_split"


def _split_case(variant, t, quirk):
    """b = 2, n = 600 keys, chunks of 16 kernels: 10 fine-key chunks (not divisible by 3 or 8) and 3 coarse
    (gen-2 LSE) chunks (not divisible by 2 or 8). Rows: late, mid and early (position 20: fine kernels visible,
    no coarse kernel -> gen-2 ``+inf``) and, for T = 3, a padding row (-1: all zeros)."""
    p, q, ck1, ck2, _, kv_len = _case(variant, g=8, d=32, t=t, n=600, quirk=quirk, seed=4)
    pos = jnp.array([[599], [20]] if t == 1 else [[20, 300, 599], [597, 598, -1]], jnp.int32)
    return p, q, ck1, ck2, pos, kv_len


@pytest.mark.parametrize("variant,t,split,quirk", [
    pytest.param("gen1", 1, 2, False, id="gen1-decode-split2"),
    pytest.param("gen1", 3, 3, True, id="gen1-t3-split3-quirk"),
    pytest.param("gen2", 1, None, False, id="gen2-decode-auto"),
    pytest.param("gen2", 1, 8, False, id="gen2-decode-split8"),
    pytest.param("gen2", 3, 2, False, id="gen2-t3-split2"),
    pytest.param("gen2", 3, 3, True, id="gen2-t3-split3-quirk"),
    pytest.param("gen2", 3, 8, False, id="gen2-t3-split8"),
])
def test_stage1_triton_split_matches_reference(variant, t, split, quirk, monkeypatch):
    """The split-over-chunks Triton path (LSE partials + XLA combine + score pass) against the XLA reference
    and against the single-kernel path (``split_chunks=0``). The automatic case lowers the minimum chunk count
    (these 13 chunks are below the production minimum of 16) so that it really takes the split."""
    monkeypatch.setattr(stage1_mod, "_SPLIT_MIN_CHUNKS", 2)
    p, q, ck1, ck2, pos, kv_len = _split_case(variant, t, quirk)
    ref = _ref(q, ck1, ck2, q_positions=pos, kv_len=kv_len, params=p)

    def run(sc):
        f = jax.jit(lambda *a: stage1_scores_pallas(*a, q_positions=pos, kv_len=kv_len, params=p, backend="triton",
                                                    interpret=True, kernel_chunk=16, split_chunks=sc))
        return f(q, ck1, ck2), str(f.trace(q, ck1, ck2).jaxpr)

    out, jaxpr = run(split)
    assert _SPLIT_NAME in jaxpr  # the split path ran (automatic rule: 4 programs < 128)
    assert_scores_match(out, ref, 1e-5)
    single, jaxpr0 = run(0)
    assert _SPLIT_NAME not in jaxpr0
    assert_scores_match(out, single, 1e-5)
    o = np.asarray(out)
    if variant == "gen2":  # the early row: no visible coarse kernel -> +inf on its visible fine kernels
        assert np.isposinf(o[:, :, 0] if t == 3 else o[1]).any()
    if t == 3:
        assert np.all(o[1, :, 2] == 0)  # padding row
    assert not np.isposinf(o[0, :, -1] if t == 3 else o[0]).any()  # the last row of sequence 0 sees every kernel


def test_stage1_triton_split_auto_rule(monkeypatch):
    """Automatic: a large grid (here 8 query tiles x 2 KV heads x 8 sequences = 128 programs) keeps the single
    kernel; a small one splits when it has enough chunks (the minimum, 16 in production, is lowered to 2 here
    and then restored: 4 + 4 chunks stay in one kernel); the TPU backend ignores ``split_chunks``."""
    p, q, ck1, ck2, _, kv_len = _case("gen1", g=8, d=32, t=16, b=8, seed=5)  # 49 fine kernels: 4 chunks
    pos = jnp.broadcast_to(jnp.arange(184, 200, dtype=jnp.int32), (8, 16))

    def jaxpr(backend="triton", **kw):
        f = lambda *a: stage1_scores_pallas(*a, q_positions=pos, kv_len=kv_len, params=p, backend=backend,
                                            interpret=True, kernel_chunk=16 if backend == "triton" else None, **kw)
        return str(jax.jit(f).trace(q, ck1, ck2).jaxpr)

    assert _SPLIT_NAME not in jaxpr(q_tile=4)  # 64 programs but only 8 chunks: the measured 8K-cache case
    monkeypatch.setattr(stage1_mod, "_SPLIT_MIN_CHUNKS", 2)
    assert _SPLIT_NAME not in jaxpr(q_tile=2)  # 128 programs
    assert _SPLIT_NAME in jaxpr(q_tile=4)  # 64 programs
    assert _SPLIT_NAME in jaxpr(q_tile=2, split_chunks=2)  # forced
    assert _SPLIT_NAME not in jaxpr(q_tile=4, split_chunks=1)  # never
    assert "infllmv2_stage1_tpu" in jaxpr("tpu", split_chunks=4)


def test_cross_lowering_triton_split(monkeypatch):
    """The split path lowers for CUDA (8B layout, bf16 decode; chunk counts not powers of two: 186 fine kernels
    -> 3 chunks of 64), forced and automatic; ``split_chunks=0`` keeps the single kernel."""
    S = jax.ShapeDtypeStruct
    b, nkv, g, d, n = 1, 2, 16, 128, 3000
    monkeypatch.setattr(stage1_mod, "_SPLIT_MIN_CHUNKS", 2)  # 3000 keys: 4 chunks, below the production 16
    for variant in ("gen1", "gen2"):
        p = select_params(SparseConfig(variant=variant), score_dtype="bfloat16")
        for t, split in ((1, None), (1, 0), (2, 2)):
            args = (S((b, t, nkv * g, d), jnp.bfloat16), S((b, n // 16 - 1, nkv, d), jnp.bfloat16),
                    S((b, n // 64 - 1, nkv, d), jnp.bfloat16), S((b, t), jnp.int32), S((b,), jnp.int32))

            def f(q, c1, c2, pos, kl):
                return stage1_scores_pallas(q, c1, c2, q_positions=pos, kv_len=kl, params=p, backend="triton",
                                            split_chunks=split)

            text = lower_for(f, args, "cuda")
            assert ("infllmv2_stage1_triton_lse_split" in text) == (split != 0)
            assert (_SPLIT_NAME in text) == (split != 0)


@pytest.mark.parametrize("n,split", [(8192, False), (32768, True), (131072, True)])
def test_auto_split_by_cache_length(n, split):
    """The production rule on the H200 benchmark's decode shapes (8B layout, batch 1, MiniCPM4.1 geometry):
    single kernel at an 8K cache (10 chunks, where the split measured slower), split at 32K and 128K."""
    S = jax.ShapeDtypeStruct
    p = select_params(SparseConfig(), score_dtype="bfloat16")
    args = (S((1, 1, 32, 128), jnp.bfloat16), S((1, n // 16 - 1, 2, 128), jnp.bfloat16),
            S((1, n // 64 - 1, 2, 128), jnp.bfloat16), S((1, 1), jnp.int32), S((1,), jnp.int32))

    def f(q, c1, c2, pos, kl):
        return stage1_scores_pallas(q, c1, c2, q_positions=pos, kv_len=kl, params=p, backend="triton")

    assert (_SPLIT_NAME in lower_for(f, args, "cuda")) == split
