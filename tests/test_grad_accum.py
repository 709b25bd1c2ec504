"""Gradient accumulation (``gradient_accumulation_steps``, ``train.step.split_microbatches``).

``data.batch_size`` stays the global batch of one update; the step runs A microbatches of ``batch_size / A``
sequences through the forward and backward one at a time and averages their gradients before one optimizer
update. Every sequence has ``seq_len`` targets, so the averaged loss and gradient must equal the whole batch's
(float32 summation order aside): the metrics, the updated parameters after several steps, the eval NLL, with
MTP (distillation, chained depths, the feature loss), with InfLLM v2, on a sharded mesh and through the training
loop (a resume may change A). The compiled step must hold less memory, and bad values are one-line errors.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env
from test_train import _params, _restore, corpus, cache_dir, tiny_cfg  # noqa: F401 - module fixtures

from minicpm4_jax.config import ConfigError, MeshConfig, load_config
from minicpm4_jax.sharding import check_batch_size, make_mesh
from minicpm4_jax.train.loop import run_training
from minicpm4_jax.train.step import (_graphdef, abstract_train_state, init_train_state, make_eval_step,
                                     make_train_step, split_microbatches)

ROOT = Path(__file__).resolve().parents[1]
# optimizer.eps=1e-5: Adam's first updates are ~lr * sign(g), which turns a 1e-9 summation-order difference of a
# near-zero gradient entry into a visible parameter difference; a larger eps measures the accumulation instead
TINY = ["model.num_hidden_layers=2", "model.vocab_size=512", "data.tokenizer_vocab_size=512", "data.seq_len=40",
        "data.batch_size=8", "optimizer.eps=1e-5"]
SPARSE = ["model.attention=infllmv2", "model.sparse_config.block_size=16", "model.sparse_config.kernel_size=16",
          "model.sparse_config.kernel_stride=8", "model.sparse_config.window_size=16", "model.sparse_config.topk=2",
          "model.sparse_config.dense_len=32", "data.seq_len=96"]


def _steps(accum: int, extra: list[str], n_steps: int = 3):
    cfg = load_config("cpu_tiny", TINY + extra + [f"gradient_accumulation_steps={accum}"])
    gd, st = init_train_state(cfg, 0)
    step = make_train_step(cfg, gd)
    rng = np.random.default_rng(0)
    metrics = []
    for _ in range(n_steps):
        batch = rng.integers(0, cfg.model.vocab_size, (8, cfg.data.seq_len + 1)).astype(np.int32)
        st, m = step(st, batch)
        metrics.append({k: float(v) for k, v in m.items()})
    nll, count = make_eval_step(gd, None, 0, accum)(st.params, batch)
    return metrics, _params(st.params), float(nll), int(count)


@functools.lru_cache(maxsize=None)
def _reference(extra: tuple[str, ...]):
    """``_steps(1, extra)``: the whole-batch run, deterministic, so computed once for both ``accum`` cases."""
    return _steps(1, list(extra))


@pytest.mark.parametrize("extra", [
    ["model.mtp=false"],
    ["model.mtp=true", "mtp_distill=0.5", "mtp_train_depth=2", "mtp_feature_weight=1.0", "mtp_detach=false"],
    ["model.mtp=false"] + SPARSE,
], ids=["ntp", "mtp_distill_depth2", "infllmv2"])
@pytest.mark.parametrize("accum", [2, 8])
def test_accumulated_steps_equal_the_whole_batch(extra, accum):
    m1, p1, nll1, n1 = _reference(tuple(extra))
    ma, pa, nlla, na = _steps(accum, extra)
    assert [set(m) for m in ma] == [set(m) for m in m1]
    if "model.mtp=true" in extra:
        assert {"mtp_loss", "mtp_loss_depth2", "mtp_kl", "mtp_feature_loss"} <= set(m1[0])
    if SPARSE[0] in extra:
        assert 0 < m1[0]["attended_fraction"] < 1
    for step, (a, b) in enumerate(zip(ma, m1)):
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=3e-6, atol=1e-7, err_msg=f"step {step}: {k}")
    for k in p1:  # three updates apart from the initial parameters
        scale = float(np.max(np.abs(p1[k])))
        np.testing.assert_allclose(pa[k], p1[k], rtol=0, atol=2e-5 * scale, err_msg=k)
    assert na == n1 == 8 * int(load_config("cpu_tiny", TINY + extra).data.seq_len)
    np.testing.assert_allclose(nlla, nll1, rtol=2e-6)


def test_split_microbatches_rows_and_errors():
    x = jnp.arange(12 * 3).reshape(12, 3)
    out = np.asarray(split_microbatches(x, 4))
    assert out.shape == (4, 3, 3)
    for a in range(4):  # microbatch a holds rows a, a + 4, a + 8
        np.testing.assert_array_equal(out[a], np.asarray(x)[a::4])
    np.testing.assert_array_equal(np.sort(out.reshape(12, 3), axis=0), np.asarray(x))
    with pytest.raises(ValueError, match=r"a batch of 12 sequences does not split into 5 equal microbatches"):
        split_microbatches(x, 5)


def test_accumulated_step_holds_less_memory():
    """cpu_tiny cut to 2 layers, batch 16 x 256, logits chunked: the activations kept for the backward scale with the
    sequences in flight. Measured (jax 0.12 CPU): 450 -> 164 MiB of temporaries with 4 microbatches."""
    temps = {}
    for accum in (1, 4):
        cfg = load_config("cpu_tiny", ["model.num_hidden_layers=2", "data.seq_len=256", "data.batch_size=16",
                                       "model.mtp=false", "logits_chunk_size=32", f"gradient_accumulation_steps={accum}"])
        tokens = jax.ShapeDtypeStruct((16, 257), jnp.int32)
        compiled = make_train_step(cfg, _graphdef(cfg)).trace(abstract_train_state(cfg), tokens).lower().compile()
        temps[accum] = compiled.memory_analysis().temp_size_in_bytes
    # the float32 gradient accumulator costs one copy of the parameters (2.4M: ~9 MiB)
    assert temps[4] < 0.5 * temps[1], {k: v / 2**20 for k, v in temps.items()}


@pytest.mark.parametrize("value,match", [
    (0, r"gradient_accumulation_steps=0 must be >= 1 and divide data.batch_size=8"),
    (3, r"gradient_accumulation_steps=3 must be >= 1 and divide data.batch_size=8"),
])
def test_bad_accumulation_is_refused(value, match):
    with pytest.raises(ConfigError, match=match):
        load_config("cpu_tiny", TINY + [f"gradient_accumulation_steps={value}"])


def test_microbatches_must_split_over_the_batch_devices():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=1), devices=jax.devices()[:4])
    check_batch_size(16, mesh, 4)
    with pytest.raises(ConfigError, match=r"data.batch_size=8 does not split into gradient_accumulation_steps=4 "
                                           r"microbatches over mesh data\*fsdp=4; use a multiple of 16"):
        check_batch_size(8, mesh, 4)


def test_training_loop_with_accumulation_and_a_resume_that_changes_it(corpus, cache_dir, tmp_path):  # noqa: F811
    """8 steps with A = 1 against 4 steps with A = 2 resumed for 4 with A = 4: the same run up to summation order
    (the loop's eval batches are split too)."""
    full = tiny_cfg(corpus, cache_dir, tmp_path / "full", **{"optimizer.eps": 1e-5})
    s_full = run_training(full, log=lambda _m: None, progress=False)
    _, ref = _restore(full)

    acc = dict(out_dir=tmp_path / "acc", **{"optimizer.eps": 1e-5})

    class StopAt:
        def __call__(self, step, state):
            if step == 3:  # flag set during update 4; the loop stops before update 5
                os.kill(os.getpid(), signal.SIGTERM)
            return state

    s1 = run_training(tiny_cfg(corpus, cache_dir, gradient_accumulation_steps=2, **acc), log=lambda _m: None,
                      progress=False, step_hook=StopAt())
    assert s1["stop_reason"] == "signal" and s1["step"] == 4
    said = []
    s2 = run_training(tiny_cfg(corpus, cache_dir, gradient_accumulation_steps=4, **acc), resume=True,
                      log=said.append, progress=False)
    assert any("gradient_accumulation_steps" in m and "allowed" in m for m in said), said[:10]
    assert s2["step"] == 8
    _, got = _restore(tiny_cfg(corpus, cache_dir, **acc))
    a, b = _params(ref), _params(got)
    for k in a:
        scale = float(np.max(np.abs(a[k])))
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=5e-5 * scale, err_msg=k)
    assert s2["val_loss"] == pytest.approx(s_full["val_loss"], rel=1e-5)


_WORKER = r'''
import dataclasses, json
import jax, numpy as np
from minicpm4_jax.config import MeshConfig, load_config
from minicpm4_jax.sharding import batch_sharding, make_mesh
from minicpm4_jax.train.step import init_train_state, make_eval_step, make_train_step

assert jax.device_count() == 8, jax.devices()
base = load_config("cpu_tiny", [
    "model.vocab_size=256", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=64", "model.dim_model_base=32",
    "data.tokenizer_vocab_size=256", "data.batch_size=8", "data.seq_len=32", "steps=10", "optimizer.eps=1e-5",
    "optimizer.warmup_steps=1", "optimizer.decay_fraction=0.1", "logits_chunk_size=8"])
rng = np.random.default_rng(0)
batches = [rng.integers(0, 256, (8, 33)).astype(np.int32) for _ in range(3)]

def run(sizes, accum):
    c = dataclasses.replace(base, mesh=MeshConfig(*sizes), gradient_accumulation_steps=accum)
    mesh = make_mesh(c.mesh)
    graphdef, state = init_train_state(c, 0, mesh)
    step = make_train_step(c, graphdef, mesh)
    losses = []
    for b in batches:
        state, m = step(state, jax.device_put(b, batch_sharding(mesh)))
        losses.append(float(m["loss"]))
    nll = float(jax.jit(make_eval_step(graphdef, mesh, 8, accum))(state.params, jax.device_put(batches[0], batch_sharding(mesh)))[0])
    spec = str(jax.tree.leaves(state.params)[0].sharding.spec)
    return losses, [np.asarray(x) for x in jax.tree.leaves(state.params)], nll, spec

ref_losses, ref_params, ref_nll, _ = run((1, 1, 1), 1)
out = {}
for sizes, accum in [((2, 2, 2), 2), ((1, 4, 2), 2), ((2, 1, 4), 4)]:
    losses, params, nll, spec = run(sizes, accum)
    out[f"{sizes}/{accum}"] = {"losses": losses, "ref_losses": ref_losses, "nll": nll, "ref_nll": ref_nll,
                               "param_diff": max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                                                 for a, b in zip(params, ref_params))}
print("RESULT " + json.dumps(out))
'''


@pytest.mark.xdist_group("multidevice")
def test_accumulation_on_a_sharded_mesh_equals_one_device():
    env = subprocess_env(JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu",
                         XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    r = subprocess.run([sys.executable, "-c", _WORKER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"worker failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert len(out) == 3
    for name, res in out.items():
        np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=5e-6, err_msg=name)
        np.testing.assert_allclose(res["nll"], res["ref_nll"], rtol=5e-6, err_msg=name)
        assert res["param_diff"] < 2e-5, (name, res["param_diff"])
