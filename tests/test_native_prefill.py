"""InfLLM v2 stage 2 with the native CPU kernel (``impl="native"``, what ``attention_impl=auto`` runs on CPU in
float32) against the XLA reference: forward, gradients, the kernel's logsumexp, and the dispatch rule."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minicpm4_jax.config import SparseConfig
from minicpm4_jax.infllm.attention import infllmv2_attention, native_stage2, stage2_forced_split
from minicpm4_jax.infllm.select import select_blocks, select_params
from minicpm4_jax.ops import native
from minicpm4_jax.ops.dispatch import sparse_impl
from minicpm4_jax.ops.infllm_ref import infllmv2_stage2

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.build_error()}")


def _qkv(rng, b, t, nq, nkv, d):
    q = jnp.asarray(rng.standard_normal((b, t, nq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, nkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, nkv, d)), jnp.float32)
    return q, k, v


# (batch, T, q heads, kv heads, head_dim, sparse config, padded rows in sequence 0)
SMALL = dict(kernel_size=8, kernel_stride=4, block_size=8, init_blocks=1, window_size=16, topk=5, dense_len=-1)
CASES = [
    (1, 203, 32, 2, 128, SMALL, 0),                      # 8B head layout (group 16, d 128): vectorised path
    (2, 157, 4, 2, 64, dict(SMALL, variant="gen1"), 9),  # cpu_tiny layout, gen-1 split, padding rows
    (1, 130, 8, 1, 64, dict(SMALL, topk=7), 0),          # group 8, wider top-k
    (2, 96, 6, 2, 32, SMALL, 5),                         # group 3, generic head_dim
]


def _case(i):
    b, t, nq, nkv, d, sc, pad = CASES[i]
    rng = np.random.default_rng(i)
    q, k, v = _qkv(rng, b, t, nq, nkv, d)
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    if pad:
        pos[0, t - pad:] = -1  # right padding of the shorter sequence
    cfg = dataclasses.replace(SparseConfig(), **sc)
    return q, k, v, jnp.asarray(pos), cfg


@pytest.mark.parametrize("case", range(len(CASES)))
def test_native_stage2_matches_reference_forward_and_gradients(case):
    q, k, v, pos, cfg = _case(case)
    p = select_params(cfg)
    t = q.shape[1]
    nb = -(-t // p.block_size)
    k_used = min(p.topk_cfg, nb)
    idx = select_blocks(q, k, q_positions=pos, params=p).topk_idx[..., :k_used]
    init, window, width = stage2_forced_split(p, k_used)
    assert width > 0  # the case exercises the kernel
    kvp = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), pos.shape)

    def ref(q, k, v):
        return infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_positions=kvp, block_size=p.block_size,
                               window_blocks=window, init_blocks=init, gather_width=width, q_tile=16)

    def nat(q, k, v):
        return native_stage2(q, k, v, idx, pos, kvp, (p.block_size, window, init, width, None, 16))

    np.testing.assert_allclose(np.asarray(jax.jit(nat)(q, k, v)), np.asarray(jax.jit(ref)(q, k, v)), atol=2e-6,
                               rtol=1e-5)
    w = jnp.asarray(np.random.default_rng(100 + case).standard_normal(q.shape), jnp.float32)
    gr = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    gn = jax.jit(jax.grad(lambda *a: jnp.sum(nat(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    for a, b_ in zip(gn, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-5 * float(jnp.max(jnp.abs(b_))), rtol=1e-4)


def test_infllmv2_attention_native_equals_xla_and_falls_back_with_kv_valid():
    q, k, v, pos, cfg = _case(1)
    kvp = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), pos.shape)  # kv index = position (contract)
    kw = dict(q_positions=pos, kv_positions=kvp, sparse_cfg=cfg)
    x = infllmv2_attention(q, k, v, impl="xla", **kw)
    n = infllmv2_attention(q, k, v, impl="native", **kw)
    np.testing.assert_allclose(np.asarray(n), np.asarray(x), atol=2e-6, rtol=1e-5)
    valid = pos >= 0  # kv_valid: the native path does not take it, the reference runs
    np.testing.assert_array_equal(np.asarray(infllmv2_attention(q, k, v, impl="native", kv_valid=valid, **kw)),
                                  np.asarray(infllmv2_attention(q, k, v, impl="xla", kv_valid=valid, **kw)))
    with pytest.raises(ValueError, match="impl="):
        infllmv2_attention(q, k, v, impl="cuda", **kw)


def test_kernel_logsumexp_matches_numpy():
    rng = np.random.default_rng(7)
    b, t, nq, nkv, d, cap, bs = 2, 3, 8, 2, 64, 96, 16
    q = rng.standard_normal((b, t, nq, d)).astype(np.float32)
    kc = rng.standard_normal((b, nkv, cap, d)).astype(np.float32)
    vc = rng.standard_normal((b, nkv, cap, d)).astype(np.float32)
    pos = np.array([[5, 40, 95], [17, -1, 60]], np.int32)
    idx = np.array([[[[0, 2, -1], [1, 3, 5], [0, 4, 5]], [[-1, -1, -1], [2, 0, -1], [5, 1, 3]]],
                    [[[1, 0, -1], [2, -1, -1], [3, 1, 2]], [[0, 1, -1], [0, -1, -1], [3, -1, -1]]]], np.int32)
    out, lse = native.decode_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(idx),
                                       q_positions=jnp.asarray(pos), block_size=bs, return_lse=True)
    g = nq // nkv
    for bi in range(b):
        for ti in range(t):
            for h in range(nq):
                keys = [s for j in set(idx[bi, h // g, ti].tolist()) if j >= 0
                        for s in range(j * bs, (j + 1) * bs) if s <= pos[bi, ti]] if pos[bi, ti] >= 0 else []
                if not keys:
                    assert lse[bi, ti, h] == -np.inf and np.all(np.asarray(out)[bi, ti, h] == 0)
                    continue
                z = kc[bi, h // g, keys].astype(np.float64) @ q[bi, ti, h] / np.sqrt(d)
                want = np.log(np.sum(np.exp(z - z.max()))) + z.max()
                np.testing.assert_allclose(float(lse[bi, ti, h]), want, rtol=1e-5, atol=1e-5)


def test_sparse_impl_rule():
    assert sparse_impl("auto", jnp.float32) == "native"  # CPU backend, float32, the kernel builds
    assert sparse_impl("xla", jnp.float32) == "xla"
    assert sparse_impl("auto", jnp.bfloat16) == "xla"
    assert sparse_impl("pallas", jnp.float32) == "pallas"


def test_native_equals_reference_for_positions_with_an_offset():
    """Keys at positions first + slot (outside InfLLM v2's contract, which wants the token index: the selection
    then depends on later tokens in both paths): the native path masks by slot shifted by the first key's
    position, so it still computes exactly what the reference computes, never something else."""
    q, k, v, _, cfg = _case(2)
    b, t = q.shape[:2]
    pos = jnp.broadcast_to(200 + jnp.arange(t, dtype=jnp.int32), (b, t))
    kw = dict(q_positions=pos, kv_positions=pos, sparse_cfg=cfg)
    np.testing.assert_allclose(np.asarray(infllmv2_attention(q, k, v, impl="native", **kw)),
                               np.asarray(infllmv2_attention(q, k, v, impl="xla", **kw)), atol=2e-6, rtol=1e-5)


def test_native_falls_back_for_an_array_scale_and_checks_its_geometry():
    q, k, v, pos, cfg = _case(1)
    kvp = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), pos.shape)
    kw = dict(q_positions=pos, kv_positions=kvp, sparse_cfg=cfg, scale=jnp.float32(0.2))
    np.testing.assert_array_equal(np.asarray(infllmv2_attention(q, k, v, impl="native", **kw)),
                                  np.asarray(infllmv2_attention(q, k, v, impl="xla", **kw)))
    idx = jnp.full((q.shape[0], k.shape[2], q.shape[1], 3), -1, jnp.int32)
    for geometry in ((0, 0, 0, 3, None, 16), (8, 0, 0, 3, None), (8, 0, -1, 3, None, 16), (8, 0, 0, 3, q, 16)):
        with pytest.raises(ValueError, match="geometry|scale"):
            native_stage2(q, k, v, idx, pos, kvp, geometry)


def test_impl_native_without_the_kernel_runs_the_reference(tmp_path):
    """MINICPM4_JAX_NATIVE=0: sparse_impl picks xla, and an explicit impl="native" runs the reference too."""
    code = """
import dataclasses, jax.numpy as jnp, numpy as np
from minicpm4_jax.config import SparseConfig
from minicpm4_jax.infllm.attention import infllmv2_attention
from minicpm4_jax.ops.dispatch import sparse_impl
cfg = dataclasses.replace(SparseConfig(), kernel_size=8, kernel_stride=4, block_size=8, init_blocks=1,
                          window_size=16, topk=5, dense_len=-1)
r = np.random.default_rng(0)
q, k, v = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((1, 150, 4, 32), (1, 150, 2, 32), (1, 150, 2, 32)))
pos = jnp.arange(150, dtype=jnp.int32)[None]
kw = dict(q_positions=pos, kv_positions=pos, sparse_cfg=cfg)
assert sparse_impl("auto", jnp.float32) == "xla"
np.testing.assert_array_equal(np.asarray(infllmv2_attention(q, k, v, impl="native", **kw)),
                              np.asarray(infllmv2_attention(q, k, v, impl="xla", **kw)))
print("ok")
"""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MINICPM4_JAX_NATIVE="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
