"""Checksums of checkpoint arrays (``train/checksums.py``): damaged array data is refused on every load.

Found by a tester: 64 bytes XOR-ed in the middle of a checkpoint's OCDBT data file were accepted silently by
``generate``, ``train --resume`` and ``export hf`` (orbax/TensorStore keep no checksum of array data; one
parameter then held values up to 4e20). Each step now carries a ``checksums`` item, verified on resume and
in ``load_params_for_inference``:

* the checksum formula against a numpy re-implementation, per dtype, and that any one-bit change is seen;
* the same arrays give the same checksums on any mesh / sharding (8 fake devices, in a subprocess without
  the persistent compilation cache), and a step saved on one mesh verifies when restored on others;
* a step with flipped bytes or with another step's array files is refused on resume and on load with the
  one-line damaged-step error; an untouched step loads; a step saved before the checksums existed loads
  unverified with a warning; a step whose checksum item was removed is refused.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from conftest import SUBPROCESS_XLA_FLAGS, subprocess_env

from minicpm4_jax.config import ConfigError, load_config
from minicpm4_jax.train.checkpoint import CHECKSUM_ITEM, load_params_for_inference, state_save_args
from minicpm4_jax.train.checksums import leaf_name, tree_checksums
from minicpm4_jax.train.loop import run_training
from test_train import _train_error, cache_dir, corpus, tiny_overrides  # noqa: F401 - fixtures: the same tiny run

REPO = Path(__file__).resolve().parent.parent


# ---- the formula ------------------------------------------------------------------------------------

def _np_hash(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def _np_checksum(a: np.ndarray) -> str:
    """The module docs' formula in numpy, on the host: an independent reference."""
    if a.dtype == np.bool_:
        w = a.astype(np.uint32)
    else:
        w = a.view(np.dtype(f"uint{a.dtype.itemsize * 8}")).astype(np.uint32)
    w = w.reshape(-1)
    with np.errstate(over="ignore"):
        m = _np_hash(np.arange(w.size, dtype=np.uint32)) | np.uint32(1)
        a_sum = int((w * m).sum(dtype=np.uint64) % 2**32)
        b_sum = int(_np_hash(w ^ m).astype(np.uint64).sum() % 2**32)
    return f"{a_sum:08x}{b_sum:08x}"


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((16, 24, 8)).astype(np.float32),
        "bf16": rng.standard_normal((16, 24)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((40,)).astype(np.float16),
        "i8": rng.integers(-128, 127, (8, 40)).astype(np.int8),
        "u8": rng.integers(0, 255, (8, 40)).astype(np.uint8),
        "i32": rng.integers(-2**31, 2**31 - 1, (24, 8)).astype(np.int32),
        "mask": rng.random((8, 8)) > 0.5,
        "step": np.int32(7),
    }


def test_checksum_matches_a_numpy_reference_for_every_dtype():
    arrays = _arrays()
    got = tree_checksums({k: jnp.asarray(v) for k, v in arrays.items()})
    assert got == {k: _np_checksum(np.asarray(v)) for k, v in arrays.items()}


def test_any_one_bit_change_or_swap_changes_the_checksum():
    arrays = _arrays()
    ref = tree_checksums(arrays)
    rng = np.random.default_rng(1)
    for name, a in arrays.items():
        a = np.asarray(a).reshape(-1)  # the checksum sees the values in row-major order, not the shape
        for _ in range(4):
            b = a.copy()
            if a.dtype == np.bool_:
                b[rng.integers(b.size)] ^= True
            else:
                b.view(np.uint8)[rng.integers(b.nbytes)] ^= np.uint8(1 << int(rng.integers(8)))
            assert tree_checksums({name: b})[name] != ref[name], name
        assert tree_checksums({name: a})[name] == ref[name]
    w = arrays["f32"].copy()
    w[0, 0, 0], w[5, 3, 1] = w[5, 3, 1], w[0, 0, 0]  # the same values, two of them moved
    assert tree_checksums({"f32": w})["f32"] != ref["f32"]
    assert tree_checksums({"f32": arrays["f32"].reshape(24, 16, 8)})["f32"] == ref["f32"]  # values, not shape


def test_leaf_names_are_dotted_paths_without_the_variable_value():
    state = {"params": nnx.State({"layers": {"up_proj": nnx.Param(jnp.zeros(2))}}), "step": jnp.int32(0)}
    assert list(tree_checksums(state)) == ["params.layers.up_proj", "step"]
    path = jax.tree_util.tree_flatten_with_path({"opt": (0, {"mu": 1})})[0][1][0]
    assert leaf_name(path) == "opt.1.mu"


# ---- sharding independence (8 fake devices) -----------------------------------------------------------

_SHARDED_WORKER = r'''
import dataclasses, json, sys
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from minicpm4_jax.config import MeshConfig, load_config
from minicpm4_jax.sharding import make_mesh
from minicpm4_jax.train.checkpoint import Checkpointer, load_params_for_inference, sharded_abstract_state
from minicpm4_jax.train.checksums import tree_checksums
from minicpm4_jax.train.step import init_train_state
assert jax.device_count() == 8, jax.devices()
args = json.loads(sys.argv[1])
out = {}
# the same arrays on one device, then on 4 meshes x 5 partition specs (cut to each array's rank)
arrays = {k: np.asarray(v) for k, v in np.load(args["arrays"]).items()}
arrays["bf16"] = arrays.pop("bf16_bits").view(ml_dtypes.bfloat16)
out["one_device"] = tree_checksums({k: jnp.asarray(v) for k, v in arrays.items()})
devs = np.array(jax.devices())
for shape, names in (((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y")), ((2, 2, 2), ("x", "y", "z"))):
    mesh = Mesh(devs.reshape(shape), names)
    for i, spec in enumerate((P(), P(names[0]), P(None, names[-1]), P(names[:2] if len(names) > 1 else names[0]),
                              P(names[-1], names[0]) if len(names) > 1 else P(None, "x"))):
        got = tree_checksums({k: jax.device_put(v, NamedSharding(mesh, P(*tuple(spec)[:v.ndim])))
                              for k, v in arrays.items()})
        out[f"{shape} {i} {spec}"] = got
# a train state saved on one mesh verifies when restored on others, and on one device
cfg = load_config(None, args["overrides"])
saved_on = dataclasses.replace(cfg, mesh=MeshConfig(2, 2, 2))
mesh = make_mesh(saved_on.mesh)
_, state = init_train_state(saved_on, jax.random.key(0), mesh)
ck = Checkpointer(saved_on, args["dir"])
ck.save(1, state)
ck.close()
restored = {}
for sizes in ((1, 8, 1), (1, 2, 4), (8, 1, 1)):
    c = dataclasses.replace(cfg, mesh=MeshConfig(*sizes))
    ck = Checkpointer(c, args["dir"])
    step, st = ck.restore(sharded_abstract_state(c, make_mesh(c.mesh)), check=False)
    ck.close()
    restored[str(sizes)] = tree_checksums({"params": st.params}) == tree_checksums({"params": state.params})
load_params_for_inference(args["dir"])  # one device, verified
out["restored"] = restored
print("RESULT " + json.dumps(out))
'''


@pytest.mark.xdist_group("multidevice")
def test_checksums_do_not_depend_on_the_sharding(corpus, cache_dir, tmp_path):
    ov = tiny_overrides(corpus, cache_dir, tmp_path / "run")
    arrays = {k: v for k, v in _arrays().items() if k in ("f32", "bf16", "f16", "i8", "mask")}
    np.savez(tmp_path / "arrays.npz", bf16_bits=arrays["bf16"].view(np.uint16),  # npz keeps no bfloat16
             **{k: v for k, v in arrays.items() if k != "bf16"})
    env = subprocess_env(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    r = subprocess.run([sys.executable, "-c", _SHARDED_WORKER,
                        json.dumps({"overrides": ov, "dir": str(tmp_path / "ckpt"),
                                    "arrays": str(tmp_path / "arrays.npz")})],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"worker failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    ref = out.pop("one_device")
    assert ref == {k: _np_checksum(v) for k, v in arrays.items()}
    restored = out.pop("restored")
    assert len(out) == 20
    differ = {k: v for k, v in out.items() if v != ref}
    assert not differ, differ
    assert restored == {"(1, 8, 1)": True, "(1, 2, 4)": True, "(8, 1, 1)": True}, restored


# ---- damaged checkpoints ------------------------------------------------------------------------------

def _flip_middle(step_dir: Path, n: int = 64) -> Path:
    """XOR ``n`` bytes in the middle of the largest array data file of ``step_dir`` (the tester's repro)."""
    f = max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
            key=lambda p: p.stat().st_size)
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    for i in range(mid, mid + n):
        b[i] ^= 0xFF
    f.write_bytes(bytes(b))
    return f


def _load_error(out: Path, step: int | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_params_for_inference(out, step)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _params(model) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


def test_damaged_array_data_is_refused_on_resume_and_load(corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    ov = tiny_overrides(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 2})
    run_training(load_config(None, ov), log=lambda _m: None, progress=False)
    step4 = out / "checkpoints" / "4"
    assert (step4 / CHECKSUM_ITEM).is_dir()
    backup = tmp_path / "step4"
    shutil.copytree(step4, backup)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an untouched step loads, verified, without a warning
        _cfg, model = load_params_for_inference(out)
    good = _params(model)

    def restore_backup() -> None:
        shutil.rmtree(step4)
        shutil.copytree(backup, step4)

    # the array files of another step: valid files, other values; only the checksums can tell
    shutil.rmtree(step4 / "state")
    shutil.copytree(out / "checkpoints" / "2" / "state", step4 / "state")
    err = _train_error(ov, resume=True)
    assert err.startswith(f"checkpoint step 4 in {out / 'checkpoints'} is incomplete or corrupt (ChecksumMismatch: ")
    assert "does not match the checksum saved with it" in err and "saved steps: 2" in err, err
    err = _load_error(out)
    assert "checkpoint step 4" in err and "ChecksumMismatch: params.embed_tokens.embedding does not match" in err, err
    assert "pass --step N for another saved step" in err and "(saved steps: 2)" in err, err
    load_params_for_inference(out, 2)  # the other step is intact
    restore_backup()

    # a whole step folder copied over another (arrays and checksums agree with each other): the step recorded with
    # the checksums names it
    shutil.rmtree(step4)
    shutil.copytree(out / "checkpoints" / "2", step4)
    for err in (_train_error(ov, resume=True), _load_error(out)):
        assert "checkpoint step 4" in err and "holds the checkpoint saved as step 2 (a moved or copied step" in err, err
    restore_backup()

    # the tester's repro: 64 bytes XOR-ed in the middle of the largest data file (resume reads every array)
    _flip_middle(step4)
    err = _train_error(ov, resume=True)
    assert "checkpoint step 4" in err and "incomplete or corrupt" in err and "saved steps: 2" in err, err
    # read as another run's source (branch_from, qat.init_from: read-only): the fix is another step, not moving
    # that run's folders (twelfth-session break test)
    from minicpm4_jax.sharding import make_mesh
    from minicpm4_jax.train.checkpoint import Checkpointer, sharded_abstract_state

    cfg = load_config(None, ov)
    src = Checkpointer(cfg, out / "checkpoints", read_only=True)
    try:
        with pytest.raises(ConfigError, match=r"is incomplete or corrupt \(.*; start from another of its saved steps "
                                              r"\(2\)$"):
            src.restore(sharded_abstract_state(cfg, make_mesh(cfg.mesh)), step=4, check=False)
    finally:
        src.close(quiet=True)
    restore_backup()
    # the same in a step holding only parameters (as `import hf` writes; the data files hold the optimizer
    # state too, in an order that varies, so a flip in a run's step need not hit a parameter)
    only = tmp_path / "params_only" / "checkpoints"
    cfg = load_config(None, ov)
    mngr = ocp.CheckpointManager(only, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    mngr.save(0, args=ocp.args.Composite(**state_save_args(
        {"step": jnp.asarray(0, jnp.int32), "params": nnx.state(model, nnx.Param)}, cfg, 0)))
    mngr.close()
    assert {k: v.tobytes() for k, v in _params(load_params_for_inference(only)[1]).items()} == {
        k: v.tobytes() for k, v in good.items()}
    _flip_middle(only / "0")
    err = _load_error(only)
    assert f"checkpoint step 0 in {only} is incomplete or corrupt (" in err, err

    # the checksum item removed (the step's metadata still names it) or unreadable: refused, not unverified
    shutil.rmtree(step4 / CHECKSUM_ITEM)
    assert "checkpoint step 4" in _train_error(ov, resume=True)
    assert "checkpoint step 4" in _load_error(out)
    restore_backup()
    (step4 / CHECKSUM_ITEM / "metadata").write_text("{not json")
    assert "checkpoint step 4" in _load_error(out)
    restore_backup()

    # intact again: loads, and the same values as before
    assert {k: v.tobytes() for k, v in _params(load_params_for_inference(out)[1]).items()} == {
        k: v.tobytes() for k, v in good.items()}


def test_a_step_saved_before_the_checksums_loads_unverified(corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    ov = tiny_overrides(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 4})
    run_training(load_config(None, ov), log=lambda _m: None, progress=False)
    step4 = out / "checkpoints" / "4"
    # what orbax wrote before this change: no checksum item, and none named in the step's metadata
    shutil.rmtree(step4 / CHECKSUM_ITEM)
    meta = json.loads((step4 / "_CHECKPOINT_METADATA").read_text())
    del meta["item_handlers"][CHECKSUM_ITEM]
    (step4 / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="checkpoint step 4 .* has no checksums .*loaded unverified"):
        load_params_for_inference(out)
    with pytest.warns(UserWarning, match="has no checksums"):
        s = run_training(load_config(None, ov), resume=True, log=lambda _m: None, progress=False)
    assert s["step"] == 4
