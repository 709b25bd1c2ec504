"""Lowering contracts (issue 5): the full 8B train step lowers for pod-sized meshes without compiling.

The train step of the MiniCPM4.1-8B preset with InfLLM v2 sparse attention and the MTP head is traced with
abstract sharded inputs (``jax.ShapeDtypeStruct`` with the rules' ``NamedSharding`` s; nothing is allocated)
and lowered for meshes of 256 and 1024 fake CPU devices, and for TPU on the 256-device mesh, so a sharding
mistake (an indivisible dimension, a spec naming a missing axis, a rule mapping one mesh axis twice) fails
in CI, not on a pod. Fake devices need ``JAX_NUM_CPU_DEVICES`` before jax starts, so the work runs in one
subprocess that reports JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# multi-device programs (fake CPU devices, one thread each) run one module at a time, on one xdist worker
# (scripts/run_tests.sh: --dist loadgroup), never beside another multi-device module
pytestmark = pytest.mark.xdist_group("multidevice")

_WORKER = r'''
import dataclasses, json, sys
import jax, jax.numpy as jnp
from minicpm4_jax.config import MeshConfig, load_config
from minicpm4_jax.sharding import batch_sharding, make_mesh
from minicpm4_jax.train.step import _graphdef, abstract_train_state, make_train_step, train_state_shardings

assert jax.device_count() == 1024, jax.device_count()
BASE = ["model.attention=infllmv2", "model.sparse_config={variant: gen2}", "model.mtp=true"]

def lower(preset, sizes, batch=None, platforms=None):
    n = sizes[0] * sizes[1] * sizes[2]
    cfg = load_config(preset, BASE + [f"data.batch_size={batch or sizes[0] * sizes[1]}"])
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(*sizes))
    mesh = make_mesh(cfg.mesh, jax.devices()[:n])
    step = make_train_step(cfg, _graphdef(cfg), mesh)
    sh = train_state_shardings(cfg, mesh)
    # the shardings tree is a prefix of the state (optax's MaskedNode subtrees hold no arrays)
    state = jax.tree.map(lambda s, sub: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub), sh, abstract_train_state(cfg))
    b = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32, sharding=batch_sharding(mesh))
    text = step.trace(state, b).lower(**({"lowering_platforms": platforms} if platforms else {})).as_text()
    specs = {jax.tree_util.keystr(p): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(sh.params)}
    return {"devices_in_module": f"num_partitions = {n}" in text, "specs": specs, "n_params": len(specs)}

out = {}
out["8b_256"] = lower("minicpm41_8b", (4, 32, 2))
out["8b_1024"] = lower("minicpm41_8b", (8, 64, 2))
out["8b_256_tp4"] = lower("minicpm41_8b", (4, 16, 4))
out["8b_256_tpu"] = lower("minicpm41_8b", (4, 32, 2), platforms=("tpu",))
try:  # a global batch that the (data, fsdp) = 128-way batch sharding cannot split must fail at lowering
    lower("minicpm41_8b", (4, 32, 2), batch=100)
    out["bad_batch"] = "lowered"
except Exception as e:
    out["bad_batch"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
print("JSON" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def lowered():
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1024", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _WORKER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return json.loads(line[4:])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["8b_256", "8b_1024", "8b_256_tp4", "8b_256_tpu"])
def test_8b_sparse_mtp_train_step_lowers_on_pod_meshes(lowered, case):
    r = lowered[case]
    assert r["devices_in_module"], "the lowered module is not partitioned over the whole mesh"
    specs = r["specs"]
    # FSDP + tensor parallel where the rules say: query heads and the MLP over tensor, FSDP on the other
    # dimension; the 2 KV heads are split over tensor=2 and replicated on tensor=4 (not divisible).
    def spec(name):
        return next(v for k, v in specs.items() if k.startswith("['layers']") and k.endswith(f"['{name}'].value"))

    assert "fsdp" in spec("q_proj") and "tensor" in spec("q_proj"), spec("q_proj")
    assert "fsdp" in spec("gate_proj") and "tensor" in spec("gate_proj"), spec("gate_proj")
    assert ("tensor" in spec("k_proj")) == (case != "8b_256_tp4"), spec("k_proj")
    assert any("mtp" in k for k in specs), "the MTP head is part of the lowered train state"


@pytest.mark.slow
def test_indivisible_batch_fails_at_lowering(lowered):
    assert lowered["bad_batch"] != "lowered"
    assert "100" in lowered["bad_batch"] and "divisible" in lowered["bad_batch"], lowered["bad_batch"]
