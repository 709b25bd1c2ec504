"""The native CPU decode kernel (ops/native) against the XLA references it replaces under ``attention_impl=auto``."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from minicpm4_jax.ops import native
from minicpm4_jax.ops.decode_ref import dense_decode_attention, sparse_decode_attention
from minicpm4_jax.ops.dispatch import native_decode

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.build_error()}")


def _case(rng, b, nkv, g, d, bs, nb, t, k):
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32)
    kc = jnp.asarray(2 * rng.standard_normal((b, nkv, nb * bs, d)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((b, nkv, nb * bs, d)), jnp.float32)
    base = rng.integers(-1, nb * bs - t, size=b)
    pos = np.stack([base + i for i in range(t)], 1)
    pos[pos < 0] = -1
    pos[rng.random(b) < 0.25] = -1  # inactive sequences
    # raw picks: distinct ids in [-1, nb], so unused slots, out-of-range ids and forced blocks all occur
    idx = np.stack([np.stack([np.stack([rng.choice(np.arange(-1, nb + 1), size=k, replace=False)
                                        for _ in range(t)]) for _ in range(nkv)]) for _ in range(b)])
    return q, kc, vc, jnp.asarray(idx, jnp.int32).reshape(b, nkv, t, k), jnp.asarray(pos, jnp.int32)


# (batch, kv heads, group, head_dim, block, blocks, tokens, picks, init, window, gather_width)
CASES = [
    (1, 2, 2, 64, 64, 12, 1, 8, 1, 3, 4),     # cpu_tiny layout, gen-2 split (width bounds the other picks)
    (2, 2, 16, 128, 16, 9, 1, 6, 1, 2, 6),    # MiniCPM4-8B group (scores vectorised over heads)
    (3, 1, 8, 64, 32, 7, 2, 5, 2, 1, 2),      # group of 8, two tokens, width drops picks
    (2, 4, 1, 16, 16, 10, 4, 11, 0, 2, 11),   # MHA, generic head_dim, four tokens (a verify chunk)
    (1, 2, 3, 64, 32, 8, 1, 9, 0, 0, 9),      # gen-1 style: no forced blocks, every pick gathered
    (2, 1, 2, 128, 64, 6, 3, 0, 1, 2, 0),     # no picks at all: init + window only
    (2, 2, 4, 64, 32, 9, 1, 7, 1, 2, 5),      # group of 4 (two head pairs over each value row)
    (1, 3, 1, 128, 16, 11, 2, 6, 1, 1, 6),    # MHA at head_dim 128 (one head per value row)
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_native_sparse_decode_matches_reference(case):
    b, nkv, g, d, bs, nb, t, k, init, win, width = CASES[case]
    q, kc, vc, idx, pos = _case(np.random.default_rng(case), b, nkv, g, d, bs, nb, t, k)
    kw = dict(q_positions=pos, block_size=bs, window_blocks=win, init_blocks=init, gather_width=width)
    for single in (False, True) if t == 1 else (False,):
        args = (q[:, 0], kc, vc, idx[:, :, 0]) if single else (q, kc, vc, idx)
        kws = dict(kw, q_positions=pos[:, 0]) if single else kw
        ref = sparse_decode_attention(*args, **kws)
        got = native.decode_attention(*args, **kws)
        assert got.shape == ref.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)
        if not single:  # inactive rows are exactly zero
            assert np.all(np.asarray(got)[np.asarray(pos) < 0] == 0.0)


@pytest.mark.parametrize("case", [0, 1, 3])
def test_native_dense_decode_matches_reference(case):
    b, nkv, g, d, bs, nb, t, k, *_ = CASES[case]
    q, kc, vc, _, pos = _case(np.random.default_rng(100 + case), b, nkv, g, d, bs, nb, t, k)
    ref = dense_decode_attention(q, kc, vc, q_positions=pos)
    for blk in (bs, 3):  # 3 does not divide the capacity: walked one slot at a time, same result
        got = native.dense_decode_attention(q, kc, vc, q_positions=pos, block_size=blk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)
    if t == 1:  # the sliding window of the speculative draft layer: windows inside a block, across blocks, all
        for window in (1, 5, bs, 2 * bs + 7, nb * bs):
            ref = dense_decode_attention(q[:, 0], kc, vc, q_positions=pos[:, 0], window=window)
            got = native.dense_decode_attention(q[:, 0], kc, vc, q_positions=pos[:, 0], window=window, block_size=bs)
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5, err_msg=f"{window}")


@pytest.mark.parametrize("g,d,t", [(2, 64, 4), (2, 64, 8), (4, 128, 4), (16, 128, 2), (3, 32, 5), (1, 16, 3),
                                   (2, 64, 2), (1, 128, 2)])
def test_native_dense_decode_of_several_tokens_matches_reference(g, d, t):
    """Several tokens per sequence (a verify chunk) attend as one group of token x head rows, each masked after
    its own position: vectorised (8 / 16 rows over the heads, 2 / 4 over the keys) and generic groups, positions
    in any order, repeated, in other blocks, inactive tokens between active ones, a sequence with none active."""
    rng = np.random.default_rng(1000 + g * t + d)
    b, nkv, bs, nb = 3, 2, 16, 6
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32)
    kc = jnp.asarray(2 * rng.standard_normal((b, nkv, nb * bs, d)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((b, nkv, nb * bs, d)), jnp.float32)
    pos = np.stack([rng.permutation(rng.choice(nb * bs, size=t, replace=t > nb * bs)) for _ in range(b)])
    pos[0] = 40 + np.arange(t)  # consecutive: the verify chunk's layout, across the block boundary at 48
    pos[1, ::2] = -1  # inactive tokens between active ones
    pos[1, 1] = pos[1, -1] if t > 2 else pos[1, 1]  # a repeated position
    pos[2] = -1
    pos = jnp.asarray(pos, jnp.int32)
    ref = dense_decode_attention(q, kc, vc, q_positions=pos)
    for blk in (bs, 3, 1):
        got = np.asarray(native.dense_decode_attention(q, kc, vc, q_positions=pos, block_size=blk))
        np.testing.assert_allclose(got, np.asarray(ref), atol=2e-6, rtol=1e-5, err_msg=f"block {blk}")
        assert np.all(got[np.asarray(pos) < 0] == 0.0)
        one = [np.asarray(native.dense_decode_attention(q[:, i], kc, vc, q_positions=pos[:, i], block_size=blk))
               for i in range(t)]  # token by token: the per-token path
        np.testing.assert_allclose(got, np.stack(one, 1), atol=2e-6, rtol=1e-5)


def test_native_decode_bad_input_is_one_line_error():
    q, kc, vc, idx, pos = _case(np.random.default_rng(0), 1, 2, 2, 64, 64, 4, 1, 3)
    kw = dict(q_positions=pos, block_size=64)
    with pytest.raises(ValueError, match="float32 only"):
        native.decode_attention(q.astype(jnp.bfloat16), kc, vc, idx, **kw)
    with pytest.raises(ValueError, match="not a multiple of block_size=48"):
        native.decode_attention(q, kc, vc, idx, q_positions=pos, block_size=48)
    with pytest.raises(ValueError, match="topk_idx shape"):
        native.decode_attention(q, kc, vc, idx[:, :1], **kw)
    with pytest.raises(ValueError, match="shape mismatch"):
        native.decode_attention(q, kc[..., :32], vc, idx, **kw)


def test_native_decode_dispatch_rule():
    assert native_decode("auto", jnp.float32)  # this CPU builds the kernel (the module is skipped otherwise)
    assert not native_decode("xla", jnp.float32)  # the reference when asked for
    assert not native_decode("auto", jnp.bfloat16)  # float32 caches only


# (variant, block, stride, kernel, window, topk, init, kv heads, group, head_dim, blocks, tokens, nope, first
# positions (one sequence each; None = the last T slots; -1 = inactive), keys: "random" | "constant")
SELECT_CASES = [
    ("gen2", 64, 16, 32, 128, 3, 1, 2, 2, 64, 20, 1, False, (None,), "random"),  # MiniCPM4.1 geometry, cpu_tiny
    ("gen1", 64, 16, 32, 128, 3, 1, 1, 16, 64, 17, 1, False, (None, 197, 10), "random"),  # MiniCPM4, 8B group
    ("gen2", 32, 16, 16, 0, 4, 0, 2, 3, 16, 23, 3, True, (None, 101), "random"),  # no window/init, chunk, nope
    ("gen1", 16, 8, 16, 32, 2, 2, 2, 1, 32, 19, 3, False, (None, 20), "random"),  # a query in an init block
    ("gen2", 16, 8, 8, 16, 5, 1, 1, 8, 16, 9, 1, False, (None, 0, -1), "random"),  # first token, inactive row
    # equal keys: every kernel scores the same, so the top-k is decided by the tie rule (lower block first)
    ("gen2", 32, 16, 32, 32, 3, 1, 2, 2, 16, 16, 1, False, (None, 300), "constant"),
    ("gen1", 32, 16, 32, 32, 3, 0, 1, 4, 16, 16, 2, False, (None,), "constant"),
    ("gen2", 64, 16, 32, 64, 3, 1, 2, 2, 64, 24, 1, False, (None, 700), "constant"),  # ties, 16-row dot products
    ("gen2", 32, 16, 32, 64, 4, 1, 1, 4, 128, 22, 2, False, (None, 150), "random"),  # head_dim 128, group of 4
    # B03: the slots past each row's queries hold keys that every query would score highest (a cache's stale
    # tail): the causal mask must come before the top-k, so no pick lies past a query's own block
    ("gen2", 32, 16, 32, 64, 5, 1, 2, 2, 32, 16, 2, False, (300, 130), "future"),
    ("gen1", 32, 16, 32, 64, 4, 1, 2, 2, 32, 16, 1, False, (250, 99), "future"),
]


@pytest.mark.parametrize("case", range(len(SELECT_CASES)))
def test_native_selection_equals_reference(case):
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.attention import stage2_forced_split
    from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
    from minicpm4_jax.infllm.select import select_blocks_compressed, select_params

    variant, bs, st, ks, win, topk, init, nkv, g, d, nb, t, nope, firsts, keys = SELECT_CASES[case]
    b = len(firsts)
    rng = np.random.default_rng(200 + case)
    p = select_params(SparseConfig(kernel_size=ks, kernel_stride=st, block_size=bs, window_size=win, topk=topk,
                                   init_blocks=init, variant=variant, dense_len=-1))
    cap = nb * bs
    shape = (b, cap, nkv, d) if keys == "random" else (b, 1, nkv, d)
    k = jnp.broadcast_to(jnp.asarray(rng.standard_normal(shape), jnp.float32), (b, cap, nkv, d))
    vc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32)
    base = np.array([cap - t if f is None else f for f in firsts])
    if keys == "future":
        u = jnp.ones((d,), jnp.float32) / np.sqrt(d)
        q = q + 3.0 * u
        k = k + 40.0 * jnp.where(jnp.arange(cap)[None, :] >= base[:, None] + t, 1.0, 0.0)[..., None, None] * u
    ck1 = compress_keys(k, ks, st)
    ck2 = compress_keys(k, *coarse_geometry(ks, st)) if variant == "gen2" else None
    q_sel = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32) if nope else q
    pos = np.stack([base + i for i in range(t)], 1)
    pos[base < 0] = -1
    pos = jnp.asarray(pos, jnp.int32)
    k_used = min(p.topk_cfg, nb)
    init_b, win_b, width = stage2_forced_split(p, k_used)
    sel = select_blocks_compressed(q_sel, ck1, ck2, q_positions=pos, params=p, num_blocks=nb,
                                   kv_len=jnp.max(pos, axis=1) + 1, q_tile=t)
    ref = sparse_decode_attention(q, k.transpose(0, 2, 1, 3), vc, sel.topk_idx[..., :k_used], q_positions=pos,
                                  block_size=bs, window_blocks=win_b, init_blocks=init_b, gather_width=width)
    out, idx = native.select_decode_attention(q, k.transpose(0, 2, 1, 3), vc, ck1, ck2, q_positions=pos, params=p,
                                              init_blocks=init_b, window_blocks=win_b, gather_width=width,
                                              q_sel=q_sel if nope else None)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(sel.topk_idx))
    assert np.sum(np.asarray(sel.counts)) > 0  # something was selected
    if keys == "future":
        own = np.asarray(pos)[:, None, :, None] // bs  # [b, 1, t, 1]
        assert np.all(np.where(np.asarray(idx) >= 0, np.asarray(idx), 0) <= own)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gen2", "gen1"])
@pytest.mark.parametrize("q_scale", [1.0, 30.0, 1000.0])
def test_native_selection_with_extreme_scores_equals_reference(variant, q_scale):
    """Queries scaled up so that most kernel weights exp(z - lse) underflow (and the gen-2 fine logits exceed the
    coarse log-sum-exp): the kernel's vectorised exp must hand those lanes to the library exp, or blocks of
    underflowed weights stop tying at 0 and the top-k differs from the reference (mutant checked)."""
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.attention import stage2_forced_split
    from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
    from minicpm4_jax.infllm.select import select_blocks_compressed, select_params

    bs, st, ks, nb, nkv, g, d, b = 32, 16, 32, 24, 2, 2, 16, 2
    p = select_params(SparseConfig(kernel_size=ks, kernel_stride=st, block_size=bs, window_size=64, topk=4,
                                   init_blocks=1, variant=variant, dense_len=-1))
    cap = nb * bs
    k_used = min(p.topk_cfg, nb)
    init_b, win_b, width = stage2_forced_split(p, k_used)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        k = jnp.asarray(rng.standard_normal((b, cap, nkv, d)), jnp.float32)
        vc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
        ck1 = compress_keys(k, ks, st)
        ck2 = compress_keys(k, *coarse_geometry(ks, st)) if variant == "gen2" else None
        q = jnp.asarray(q_scale * rng.standard_normal((b, 1, nkv * g, d)), jnp.float32)
        pos = jnp.asarray([[cap - 1], [int(rng.integers(40, cap - 1))]], jnp.int32)
        sel = select_blocks_compressed(q, ck1, ck2, q_positions=pos, params=p, num_blocks=nb,
                                       kv_len=jnp.max(pos, axis=1) + 1, q_tile=1)
        _, idx = native.select_decode_attention(q, k.transpose(0, 2, 1, 3), vc, ck1, ck2, q_positions=pos,
                                                params=p, init_blocks=init_b, window_blocks=win_b,
                                                gather_width=width)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(sel.topk_idx), err_msg=f"seed {seed}")


def test_native_selection_refuses_what_it_does_not_compute():
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.select import select_params

    q, kc, vc, _, pos = _case(np.random.default_rng(0), 1, 2, 2, 64, 64, 4, 1, 3)
    ck = jnp.zeros((1, 15, 2, 64), jnp.float32)
    p = select_params(SparseConfig())
    kw = dict(q_positions=pos, init_blocks=1, window_blocks=2, gather_width=1)
    for bad, msg in ((select_params(SparseConfig(), kernel_offby1_quirk=True), "kernel_offby1_quirk=True"),
                     (select_params(SparseConfig(), score_dtype="bfloat16"), "score_dtype='bfloat16'")):
        assert not native.supports_selection(bad)
        with pytest.raises(ValueError, match=msg):
            native.select_decode_attention(q, kc, vc, ck, ck, params=bad, **kw)
    with pytest.raises(ValueError, match="needs the coarse compressed keys"):
        native.select_decode_attention(q, kc, vc, ck, None, params=p, **kw)
    with pytest.raises(ValueError, match="ck1 shape"):
        native.select_decode_attention(q, kc, vc, ck[:, :, :1], ck, params=p, **kw)
    assert native.supports_selection(p)


def test_native_rejects_negative_and_malformed_arguments():
    import dataclasses

    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.select import select_params

    q, kc, vc, idx, pos = _case(np.random.default_rng(1), 1, 2, 2, 64, 64, 4, 1, 3)
    ck = jnp.zeros((1, 15, 2, 64), jnp.float32)
    p = select_params(SparseConfig(window_size=64, topk=3))
    for kw in (dict(window_blocks=-5), dict(gather_width=-1), dict(init_blocks=-10)):  # once a segfault
        args = dict(init_blocks=1, window_blocks=2, gather_width=1) | kw
        with pytest.raises(ValueError, match="must be >= 0"):
            native.select_decode_attention(q, kc, vc, ck, ck, q_positions=pos, params=p, **args)
        with pytest.raises(ValueError, match="must be >= 0"):
            native.decode_attention(q, kc, vc, idx, q_positions=pos, block_size=64, **args)
    with pytest.raises(ValueError, match="bad selection geometry"):
        native.select_decode_attention(q, kc, vc, ck, ck, q_positions=pos, params=dataclasses.replace(p, variant="gen3"),
                                       init_blocks=1, window_blocks=2, gather_width=1)
    with pytest.raises(ValueError, match=r"q shape \(4, 64\)"):
        native.decode_attention(q[0, 0], kc, vc, idx, q_positions=pos, block_size=64)
    with pytest.raises(ValueError, match="takes one token per sequence"):
        native.dense_decode_attention(q, kc, vc, q_positions=pos, window=5)
    with pytest.raises(ValueError, match="must be a Python number"):
        native.decode_attention(q, kc, vc, idx, q_positions=pos, block_size=64, scale=jnp.float32(0.1))


def test_damaged_library_is_rebuilt_not_loaded(tmp_path):
    """A truncated library in the cache killed the process in dlopen (SIGBUS): it is now rebuilt."""
    import subprocess
    import sys

    code = ("from minicpm4_jax.ops import native; p = native.library_path(); "
            "print(native.available(), p.stat().st_mode & 0o777, p.stat().st_size)")
    env = {**os.environ, "MINICPM4_JAX_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and first.stdout.split()[:2] == ["True", str(0o755)], first.stderr[-2000:]
    size = int(first.stdout.split()[2])
    lib = next((tmp_path / "native").glob("*.so"))
    lib.write_bytes(lib.read_bytes()[: size // 3])  # damaged after it was built
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.split() == ["True", str(0o755), str(size)], again.stderr[-2000:]


def test_kernel_built_with_the_pre_gcc12_shuffle_equals_reference(tmp_path):
    """GCC < 12 (Ubuntu 22.04's 11) has no __builtin_shufflevector: the kernel's transposed reductions then use
    __builtin_shuffle. That branch, forced with -DMINICPM4_GCC_SHUFFLE in a process of its own (the FFI targets
    register once per process), passes the pool-sized test below: selection, sparse, dense, windowed, lse."""
    import subprocess
    import sys

    code = f"""
import sys
from minicpm4_jax.ops import native
native._FLAGS.append("-DMINICPM4_GCC_SHUFFLE")
assert native.available(), native.build_error()
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_native_decode as t
for b in (1, 2):
    t.test_calls_large_enough_for_the_thread_pool_equal_reference(b)
print("ok", native.library_path().name)
"""
    env = {**os.environ, "MINICPM4_JAX_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]
    assert proc.stdout.split()[1] != native.library_path().name  # a library of its own, not this process's


def test_old_compiled_kernels_are_pruned(tmp_path):
    """Every source/compiler/jaxlib change builds a library under a new name: the cache keeps the current one and
    the most recently built or loaded others, and removes the rest with their digests."""
    d = tmp_path / "native"
    d.mkdir()
    libs = []
    for i in range(12):
        lib = d / f"infllm_cpu_{i:020d}.so"
        lib.write_bytes(b"x")
        lib.with_suffix(".sha256").write_text("y")
        os.utime(lib, (1_000_000 + i, 1_000_000 + i))  # lib 11 is the newest
        libs.append(lib)
    (d / "unrelated.so").write_bytes(b"z")
    current = libs[0]  # the oldest file, but the one this process uses
    removed = native._prune(current, keep=4)
    assert sorted(removed) == sorted(libs[1:9])
    assert sorted(p.name for p in d.glob("infllm_cpu_*.so")) == sorted(p.name for p in [current, *libs[9:]])
    assert not any(p.with_suffix(".sha256").exists() for p in removed)
    assert (d / "unrelated.so").exists() and current.with_suffix(".sha256").exists()
    assert native._prune(current, keep=4) == []


@pytest.mark.parametrize("t", [1, 3])
def test_short_cache_and_wide_gather_match_between_kernel_and_reference(t):
    """A cache of fewer blocks than the window (the 4.1 window of 33 blocks over 2 blocks): the reference
    refused it, so every non-native decode of a short sparse cache failed; and a gather wider than the picks."""
    q, kc, vc, idx, pos = _case(np.random.default_rng(7 + t), 2, 2, 2, 16, 64, 2, t, 2)
    for kw in (dict(window_blocks=33, init_blocks=1, gather_width=0), dict(window_blocks=3, init_blocks=4),
               dict(gather_width=5)):  # gather_width > K without forced blocks: a reshape error before
        ref = sparse_decode_attention(q, kc, vc, idx, q_positions=pos, block_size=64, **kw)
        got = native.decode_attention(q, kc, vc, idx, q_positions=pos, block_size=64, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5, err_msg=str(kw))
    # the 33-block window covers both blocks: dense attention over every slot <= position
    win = sparse_decode_attention(q, kc, vc, idx, q_positions=pos, block_size=64, window_blocks=33, init_blocks=1)
    np.testing.assert_allclose(np.asarray(win), np.asarray(dense_decode_attention(q, kc, vc, q_positions=pos)),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("b", [1, 2])
def test_calls_large_enough_for_the_thread_pool_equal_reference(b):
    """A cache large enough that the calls run on the pool's threads (the other tests' caches stay under the
    single-thread threshold): selection, sparse stage 2, dense and windowed decode and the logsumexp all equal
    the references, and an inactive sequence stays zero."""
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.attention import stage2_forced_split
    from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
    from minicpm4_jax.infllm.select import select_blocks_compressed, select_params

    rng = np.random.default_rng(40 + b)
    nkv, g, d, bs, cap = 2, 2, 64, 64, 4096  # 2 x 64 x 4096 values per sequence: above the single-thread threshold
    p = select_params(SparseConfig(kernel_size=32, kernel_stride=16, block_size=bs, window_size=512, topk=24,
                                   init_blocks=1, variant="gen2", dense_len=-1))
    init_b, win_b, width = stage2_forced_split(p, p.topk_cfg)
    k = jnp.asarray(rng.standard_normal((b, cap, nkv, d)), jnp.float32)
    kc, vc = k.transpose(0, 2, 1, 3), jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    ck1, ck2 = compress_keys(k, 32, 16), compress_keys(k, *coarse_geometry(32, 16))
    q = jnp.asarray(rng.standard_normal((b, 1, nkv * g, d)), jnp.float32)
    pos = jnp.asarray([[cap - 1], [-1]][:b], jnp.int32)  # the second sequence inactive
    sel = select_blocks_compressed(q, ck1, ck2, q_positions=pos, params=p, num_blocks=cap // bs,
                                   kv_len=jnp.max(pos, axis=1) + 1, q_tile=1)
    kw = dict(q_positions=pos, block_size=bs, window_blocks=win_b, init_blocks=init_b, gather_width=width)
    ref = sparse_decode_attention(q, kc, vc, sel.topk_idx, **kw)
    out, idx = native.select_decode_attention(q, kc, vc, ck1, ck2, q_positions=pos, params=p, init_blocks=init_b,
                                              window_blocks=win_b, gather_width=width)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(sel.topk_idx))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)
    got = native.decode_attention(q, kc, vc, sel.topk_idx, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)
    got, lse = native.decode_attention(q, kc, vc, sel.topk_idx, return_lse=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(lse)[0])) and (b == 1 or np.all(np.asarray(lse)[1] == -np.inf))
    dense = dense_decode_attention(q, kc, vc, q_positions=pos)
    np.testing.assert_allclose(np.asarray(native.dense_decode_attention(q, kc, vc, q_positions=pos, block_size=bs)),
                               np.asarray(dense), atol=2e-6, rtol=1e-5)
    for window in (100, 2048):
        ref_w = dense_decode_attention(q[:, 0], kc, vc, q_positions=pos[:, 0], window=window)
        got_w = native.dense_decode_attention(q[:, 0], kc, vc, q_positions=pos[:, 0], window=window, block_size=bs)
        np.testing.assert_allclose(np.asarray(got_w), np.asarray(ref_w), atol=2e-6, rtol=1e-5)
    if b == 2:
        assert np.all(np.asarray(out)[1] == 0.0)


@pytest.mark.parametrize("variant", ["gen2", "gen1"])
def test_native_selection_keeps_future_kernels_out_of_each_heads_normaliser(variant):
    """field_faults B02/B03 for the native selection: a kernel that ends after the query stays out of each head's
    softmax normaliser (gen-1's fine, gen-2's coarse), not only out of the top-k. Query head 0 of the group peaks on
    block P = 3, head 1 (a little less) on block Q = 5, and the keys after each query score far higher for head 0:
    with one more fine and coarse kernel counted visible (``floor((p + 1 - ks) / st) + 2``), or one more coarse
    kernel only, head 0's weight left P and Q took the pick, while test_native_selection_equals_reference still
    passed (its rows' kernel counts are clipped by the cache, or its future keys favour every head alike; mutation
    testing, helper 105)."""
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.attention import stage2_forced_split
    from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
    from minicpm4_jax.infllm.select import select_blocks_compressed, select_params

    bs, st, ks, nb, nkv, g, d = 32, 16, 32, 16, 1, 2, 32
    p = select_params(SparseConfig(kernel_size=ks, kernel_stride=st, block_size=bs, window_size=64,
                                   topk=3 if variant == "gen2" else 2, init_blocks=1, variant=variant, dense_len=-1))
    cap = nb * bs
    rng = np.random.default_rng(7)
    firsts = np.array([300, 311, 319])  # one query each; its cache holds keys after it (a chunk, a stale tail)
    b = len(firsts)
    u = np.ones(d, np.float32) / np.sqrt(d)
    w = np.tile([1.0, -1.0], d // 2).astype(np.float32) / np.sqrt(d)  # orthogonal to u
    slot = np.arange(cap)[None, :, None, None]
    k = rng.standard_normal((b, cap, nkv, d)).astype(np.float32)
    k = k + 8.0 * u * ((slot >= 96) & (slot < 128)) + 6.0 * w * ((slot >= 160) & (slot < 192))  # blocks P, Q
    k = k + 200.0 * u * (slot > firsts[:, None, None, None])  # after each query
    k = jnp.asarray(k)
    q = rng.standard_normal((b, 1, nkv * g, d)).astype(np.float32) * 0.01
    q[:, :, 0] += 4.0 * u  # head 0 of the group peaks on P (outside the forced init and window blocks)
    q[:, :, 1] += 4.0 * w  # head 1 on Q
    q = jnp.asarray(q)
    vc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    ck1 = compress_keys(k, ks, st)
    ck2 = compress_keys(k, *coarse_geometry(ks, st)) if variant == "gen2" else None
    pos = jnp.asarray(firsts[:, None], jnp.int32)
    init_b, win_b, width = stage2_forced_split(p, min(p.topk_cfg, nb))
    sel = select_blocks_compressed(q, ck1, ck2, q_positions=pos, params=p, num_blocks=nb, kv_len=pos[:, 0] + 1,
                                   q_tile=1)
    _, idx = native.select_decode_attention(q, k.transpose(0, 2, 1, 3), vc, ck1, ck2, q_positions=pos, params=p,
                                            init_blocks=init_b, window_blocks=win_b, gather_width=width)
    ref_idx = np.asarray(sel.topk_idx)
    assert np.all(np.any(ref_idx == 3, axis=-1)) and not np.any(ref_idx == 5)  # the reference picks P, never Q
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(sel.topk_idx))


def test_concurrent_pool_sized_calls_equal_their_serial_results():
    """Several pool-sized calls in flight at once (three Python threads dispatching different shapes): the helper
    that lingers after one call takes the items of whichever call was posted last, and a caller whose helper is
    busy elsewhere finishes alone. Every output must equal, bit for bit, the same call made alone."""
    import threading

    import jax

    rng = np.random.default_rng(77)
    jobs = []
    for j, (b, nkv, g, cap) in enumerate([(1, 2, 2, 4096), (2, 2, 4, 2048), (1, 4, 1, 4096)]):
        d, bs = 64, 64
        q = jnp.asarray(rng.standard_normal((b, 1, nkv * g, d)), jnp.float32)
        kc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
        vc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
        pos = jnp.asarray(rng.integers(cap // 2, cap, size=(b, 1)), jnp.int32)
        idx = jnp.asarray(np.sort(rng.choice(cap // bs, size=(b, nkv, 1, 6)), axis=-1), jnp.int32)
        if j % 2:
            fn = jax.jit(lambda q, kc, vc, idx, pos: native.dense_decode_attention(q, kc, vc, q_positions=pos,
                                                                                   block_size=64))
        else:
            fn = jax.jit(lambda q, kc, vc, idx, pos: native.decode_attention(
                q, kc, vc, idx, q_positions=pos, block_size=64, window_blocks=4, init_blocks=1, gather_width=6))
        args = (q, kc, vc, idx, pos)
        jobs.append((fn, args, np.asarray(fn(*args))))
    failures = []

    def hammer(fn, args, want):
        for _ in range(40):
            got = np.asarray(fn(*args))
            if not np.array_equal(got, want):
                failures.append(float(np.max(np.abs(got - want))))

    threads = [threading.Thread(target=hammer, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, f"{len(failures)} concurrent outputs differ from the serial ones (max |diff| {max(failures)})"


def test_calls_without_a_lingering_helper_equal_reference(tmp_path):
    """MINICPM4_JAX_NATIVE_LINGER_US=0 (every call wakes a pool thread, none stays): the pool-sized test passes in
    a process of its own (the setting is read once per process)."""
    import subprocess
    import sys

    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_native_decode as t
for b in (1, 2):
    t.test_calls_large_enough_for_the_thread_pool_equal_reference(b)
t.test_concurrent_pool_sized_calls_equal_their_serial_results()
print("ok")
"""
    env = {**os.environ, "MINICPM4_JAX_NATIVE_LINGER_US": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("nope", [False, True])
def test_verify_chunk_rows_attend_only_their_own_tokens_blocks(nope):
    """A verify chunk (T = 4 tokens of one sequence, plus an inactive sequence) goes through the grouped path: one
    pass over the union of the tokens' blocks, each row masked to its own token's blocks and slots. The tokens'
    selections must differ (else the masks are never exercised), and every row must equal the reference, which
    attends each token's own blocks."""
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.attention import stage2_forced_split
    from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
    from minicpm4_jax.infllm.select import select_blocks_compressed, select_params

    rng = np.random.default_rng(91)
    b, t, nkv, g, d, bs, cap = 2, 4, 2, 2, 64, 64, 4096
    p = select_params(SparseConfig(kernel_size=32, kernel_stride=16, block_size=bs, window_size=256, topk=12,
                                   init_blocks=1, variant="gen2", dense_len=-1))
    init_b, win_b, width = stage2_forced_split(p, p.topk_cfg)
    k = jnp.asarray(rng.standard_normal((b, cap, nkv, d)), jnp.float32)
    kc, vc = k.transpose(0, 2, 1, 3), jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    ck1, ck2 = compress_keys(k, 32, 16), compress_keys(k, *coarse_geometry(32, 16))
    q = jnp.asarray(3 * rng.standard_normal((b, t, nkv * g, d)), jnp.float32)  # sharp, token-specific selections
    q_sel = jnp.asarray(3 * rng.standard_normal((b, t, nkv * g, d)), jnp.float32) if nope else q
    pos = jnp.asarray([[cap - 70 + i for i in range(t)], [-1] * t], jnp.int32)  # the chunk crosses a block edge
    sel = select_blocks_compressed(q_sel, ck1, ck2, q_positions=pos, params=p, num_blocks=cap // bs,
                                   kv_len=jnp.max(pos, axis=1) + 1, q_tile=t)
    out, idx = native.select_decode_attention(q, kc, vc, ck1, ck2, q_positions=pos, params=p, init_blocks=init_b,
                                              window_blocks=win_b, gather_width=width, q_sel=q_sel if nope else None)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(sel.topk_idx))
    picks = [{tuple(np.asarray(idx)[0, h, i]) for i in range(t)} for h in range(nkv)]
    assert all(len(s) > 1 for s in picks), "the tokens' selections should differ"
    ref = sparse_decode_attention(q, kc, vc, sel.topk_idx, q_positions=pos, block_size=bs, window_blocks=win_b,
                                  init_blocks=init_b, gather_width=width)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(out)[1] == 0.0)


@pytest.mark.parametrize("raw", ["abc", "-5", "1e3", "2000000", "0.5"])
def test_bad_linger_setting_is_one_line_error(monkeypatch, raw):
    """A MINICPM4_JAX_NATIVE_LINGER_US the kernel would misread (atoll: 'abc' -> 0, '1e3' -> 1) is refused by name."""
    from minicpm4_jax.config import ConfigError

    monkeypatch.setenv("MINICPM4_JAX_NATIVE_LINGER_US", raw)
    with pytest.raises(ConfigError, match=r"MINICPM4_JAX_NATIVE_LINGER_US=.*whole number of microseconds") as e:
        native.available()
    assert "\n" not in str(e.value) and repr(raw) in str(e.value)
    for ok in ("0", " 250 ", ""):
        monkeypatch.setenv("MINICPM4_JAX_NATIVE_LINGER_US", ok)
        assert native.available()


def test_grouped_verify_rows_equal_reference_over_random_layouts():
    """The grouped path (T > 1) over random layouts: chunks of 2-6 consecutive positions anywhere in the cache (the
    reference's contract for several tokens), inactive tokens anywhere in the chunk, both selection variants, NoPE
    queries, groups of 1-4 heads, narrow gather widths. Selections equal the reference's and every row equals the reference's attention."""
    from minicpm4_jax.config import SparseConfig
    from minicpm4_jax.infllm.attention import stage2_forced_split
    from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys
    from minicpm4_jax.infllm.select import select_blocks_compressed, select_params

    rng = np.random.default_rng(123)
    for trial in range(8):
        variant = ("gen1", "gen2")[trial % 2]
        b, t, nkv, g = int(rng.integers(1, 3)), int(rng.integers(2, 7)), int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
        d, bs, nb = 64, 32, int(rng.integers(8, 20))
        cap = nb * bs
        p = select_params(SparseConfig(kernel_size=32, kernel_stride=16, block_size=bs, window_size=64,
                                       topk=int(rng.integers(3, 7)), init_blocks=int(rng.integers(0, 2)),
                                       variant=variant, dense_len=-1))
        init_b, win_b, width = stage2_forced_split(p, min(p.topk_cfg, nb))
        width = int(rng.integers(0, width + 1))  # narrower gathers drop picks (compact_topk keeps the smallest)
        k = jnp.asarray(rng.standard_normal((b, cap, nkv, d)), jnp.float32)
        kc, vc = k.transpose(0, 2, 1, 3), jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
        ck1 = compress_keys(k, 32, 16)
        ck2 = compress_keys(k, *coarse_geometry(32, 16)) if variant == "gen2" else None
        q = jnp.asarray(2 * rng.standard_normal((b, t, nkv * g, d)), jnp.float32)
        nope = bool(trial % 3 == 0)
        q_sel = jnp.asarray(2 * rng.standard_normal((b, t, nkv * g, d)), jnp.float32) if nope else q
        pos = rng.integers(0, cap - t + 1, size=(b, 1)) + np.arange(t)[None]  # consecutive, as a verify chunk
        pos[rng.random((b, t)) < 0.25] = -1
        pos = jnp.asarray(pos, jnp.int32)
        sel = select_blocks_compressed(q_sel, ck1, ck2, q_positions=pos, params=p, num_blocks=nb,
                                       kv_len=jnp.maximum(jnp.max(pos, axis=1) + 1, 1), q_tile=t)
        out, idx = native.select_decode_attention(q, kc, vc, ck1, ck2, q_positions=pos, params=p, init_blocks=init_b,
                                                  window_blocks=win_b, gather_width=width,
                                                  q_sel=q_sel if nope else None)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(sel.topk_idx), err_msg=f"trial {trial}")
        ref = sparse_decode_attention(q, kc, vc, sel.topk_idx, q_positions=pos, block_size=bs, window_blocks=win_b,
                                      init_blocks=init_b, gather_width=width)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5, err_msg=f"trial {trial}")
