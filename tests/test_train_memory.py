"""Per-device memory of the sharded train step (issue 5): compile-only, nothing is run.

Regression for the FSDP activation blow-up: without a batch-sharding constraint on the residual
stream, XLA's sharding propagation gives the embedding gather's output the table's ``embed``-on-
``fsdp`` sharding, so every activation of the sharded step held ``data``-only batch shards (``fsdp``
times a device's share). The check compares XLA's compiled memory analysis of the sharded step with
single-device programs of the same small model:

* from two single-device compiles (batch ``b`` and ``B``) a linear fit splits the single-device
  temporaries into a per-sequence activation part ``a`` and a batch-independent, parameter-sized
  part ``p`` (gradients, optimizer updates);
* on a ``(1, 8, 1)`` mesh with global batch ``B`` (``b = B / 8`` sequences per device) the per-device
  temporaries must stay below ``p / 8 + a * b + slack``, the slack covering FSDP's gather-before-use
  of the largest weight and its unreduced gradient (``2 x`` the largest parameter). Measured with
  jax 0.12 on CPU: 79 MiB with the fix, 519 MiB before it, bound 90 MiB. With the MTP module on: 120 MiB,
  bound 132 MiB (its second use of the tied table adds one more largest-parameter slack).

Fake CPU devices need ``JAX_NUM_CPU_DEVICES`` before jax starts, so the compiles run in one
subprocess that reports JSON (as in ``tests/test_sharding.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

# multi-device programs (fake CPU devices, one thread each) run one module at a time, on one xdist worker
# (scripts/run_tests.sh: --dist loadgroup), never beside another multi-device module
pytestmark = pytest.mark.xdist_group("multidevice")

ROOT = Path(__file__).resolve().parents[1]

_WORKER = r'''
import dataclasses, json, math
import jax, jax.numpy as jnp
from minicpm4_jax.config import MeshConfig, load_config
from minicpm4_jax.sharding import batch_sharding, make_mesh
from minicpm4_jax.train.step import _graphdef, abstract_train_state, make_train_step, train_state_shardings

assert jax.device_count() == 8, jax.device_count()
OVR = ["model.num_hidden_layers=2", "data.seq_len=256"]

def compile_step(sizes, batch, overrides):
    """The train step of cpu_tiny (2 layers, seq 256) on a ``sizes`` mesh, compiled (nothing runs); and its config."""
    cfg = load_config("cpu_tiny", OVR + [f"data.batch_size={batch}", *overrides])
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(*sizes))
    mesh = make_mesh(cfg.mesh, jax.devices()[:math.prod(sizes)])
    state = jax.tree.map(lambda s, sub: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub),
        train_state_shardings(cfg, mesh), abstract_train_state(cfg))
    tokens = jax.ShapeDtypeStruct((batch, cfg.data.seq_len + 1), jnp.int32, sharding=batch_sharding(mesh))
    return make_train_step(cfg, _graphdef(cfg), mesh).trace(state, tokens).lower().compile(), cfg

def analyse(sizes, batch, mtp):
    compiled, cfg = compile_step(sizes, batch, [f"model.mtp={str(mtp).lower()}"])
    ma = compiled.memory_analysis()
    largest = max(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(abstract_train_state(cfg).params))
    return {"argument": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes, "largest_param": largest}

out = {f"{name}_{mtp}": analyse(sizes, batch, mtp) for mtp in (False, True)
       for name, sizes, batch in (("single_2", (1, 1, 1), 2), ("single_16", (1, 1, 1), 16), ("fsdp8_16", (1, 8, 1), 16))}
out["mixed_16_True"] = analyse((2, 2, 2), 16, True)  # data x fsdp x tensor: the partitioner's resharding warnings
out["data1_16_True"] = analyse((1, 4, 2), 16, True)  # data = 1: the embedding lookup's backward (embedding_lookup)

def loop_carried(sizes, batch, accum):
    """Shapes of the arrays every while loop of the compiled step carries (bf16 compute, gradient accumulation)."""
    import re
    compiled, cfg = compile_step(sizes, batch, ["model.mtp=false", "model.dtype=bfloat16",
                                                f"gradient_accumulation_steps={accum}"])
    loops = [re.findall(r"\b(?:f32|bf16)\[([0-9,]+)\]", m.group(1))
             for m in re.finditer(r"= \((.*?)\) while\(", compiled.as_text())]
    return {"loops": loops, "table": [cfg.model.vocab_size, cfg.model.hidden_size]}

out["accum_loops"] = loop_carried((1, 8, 1), 16, 2)
print("JSON" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def analyses():
    env = subprocess_env(JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _WORKER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return {**json.loads(line[4:]), "stderr": proc.stderr}


@pytest.mark.parametrize("mtp", [False, True], ids=["ntp", "with_mtp"])
def test_sharded_step_temp_memory_is_a_devices_share(analyses, mtp):
    s2, s16, f8 = (analyses[f"{k}_{mtp}"] for k in ("single_2", "single_16", "fsdp8_16"))
    print(f"mtp={mtp}: (1, 8, 1) temp {f8['temp'] / 2**20:.1f} MiB, one device x16 {s16['temp'] / 2**20:.1f} MiB")
    per_seq = (s16["temp"] - s2["temp"]) / (16 - 2)  # activation temporaries per sequence (one device)
    fixed = max(0.0, s2["temp"] - 2 * per_seq)  # the batch-independent (parameter-sized) part
    assert per_seq > 4 * fixed / 8, "test model too small: activations do not dominate the sharded bound"
    # the MTP module uses the (tied) embedding table a second time, for its lookup and its head: one more
    # gathered copy and unreduced gradient of the largest parameter per use
    slack = 2 * s2["largest_param"] * (2 if mtp else 1)
    bound = fixed / 8 + per_seq * (16 // 8) + slack
    mib = 2**20
    assert f8["temp"] <= bound, (
        f"(1, 8, 1) mesh: {f8['temp'] / mib:.1f} MiB of temporaries per device > bound {bound / mib:.1f} MiB "
        f"(= param-sized {fixed / mib:.1f}/8 + activations {per_seq / mib:.1f} x 2 sequences + slack {slack / mib:.1f}); "
        f"one device with the whole batch: {s16['temp'] / mib:.1f} MiB. Activations are not batch-sharded over fsdp?")
    # the state itself is split 8 ways (FSDP), up to the replicated norms and scalars
    assert f8["argument"] <= s2["argument"] / 8 * 1.05 + mib, (f8["argument"], s2["argument"])


def test_sharded_mtp_step_needs_no_full_rematerialization(analyses):
    """No compile of the worker makes XLA's partitioner replicate a tensor to reshard it ("Involuntary full
    rematerialization"). Two causes fixed: (1) on a ``(2, 2, 2)`` mesh the MTP module's embedding lookup took
    the table's ``embed``-on-``fsdp`` sharding (now constrained to the residual-stream sharding; MiniCPM4-8B with
    MTP on 256 devices: 10.139 -> 10.104 GiB of temporaries per device); (2) on ``data = 1`` meshes (``(1, 4,
    2)`` here) Shardy could not move the lookups' cotangent onto the table's ``hidden``-on-``fsdp`` sharding (now
    ``sharding.embedding_lookup``, explicit collectives; MiniCPM4-8B with MTP on (1, 128, 2): 5.186 -> 4.082
    GiB)."""
    assert analyses["mixed_16_True"]["temp"] > 0 and analyses["data1_16_True"]["temp"] > 0
    bad = [ln for ln in analyses["stderr"].splitlines() if "Involuntary full rematerialization" in ln]
    assert not bad, bad[0][:400]


def test_microbatch_loop_does_not_keep_a_gathered_table(analyses):
    """Gradient accumulation on an FSDP mesh: no loop of the step carries the all-gathered embedding table.

    XLA hoists what depends on the parameters alone out of the microbatch ``lax.scan``; before the parameters were
    tied to each microbatch (``optimization_barrier`` in ``make_train_step``), the table's all-gather (and its
    compute-dtype cast) ran once and stayed live across every microbatch: MiniCPM4-8B on the (4, 32, 2) mesh,
    one sequence per device per microbatch, 3.872 GiB of temporaries instead of 3.557 (docs/benchmarks.md)."""
    info = analyses["accum_loops"]
    full = ",".join(map(str, info["table"]))
    assert info["loops"], "no while loop found in the compiled step (the HLO text format changed?)"
    vocab, hidden = info["table"]
    shard = f"{vocab},{hidden // 8}"  # the table's (1, 8, 1) shard: the loop does carry the parameters, sharded
    assert any(shard in loop for loop in info["loops"]), info["loops"]
    bad = [loop for loop in info["loops"] if full in loop]
    assert not bad, f"a loop carries the unsharded table [{full}]: {bad[0]}"
