"""Checkpoints at scale (issue 5): restore onto another mesh / device count, and a save killed with SIGKILL.

* A run on 8 devices (mesh ``(1, 4, 2)``) checkpoints at steps 4 and 8. Fresh processes with 2 devices
  (mesh ``(1, 2, 1)``: the FSDP axis resharded 4 -> 2, the tensor axis gone) and with 1 device restore step 4 into abstract targets carrying *their*
  shardings (field fault B21: the saved sharding is never replayed): every array equals the saved
  one bit for bit and has exactly the target sharding; ``--resume`` then trains steps 5-8 with the
  losses of the uninterrupted 8-device run (fp32, float summation order differs between meshes).
* A process killed with SIGKILL in the middle of writing its second checkpoint leaves the first one
  intact (only an orbax temporary folder of the second); the next ``--resume`` starts from the first
  and ends with the parameters of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS, subprocess_env

from minicpm4_jax.config import load_config
from minicpm4_jax.sharding import make_mesh
from minicpm4_jax.train.checkpoint import Checkpointer, sharded_abstract_state
from minicpm4_jax.train.loop import run_training
from test_distributed import corpus_docs, tiny_overrides  # the same tiny model and corpus

# multi-device programs (fake CPU devices, one thread each) run one module at a time, on one xdist worker
# (scripts/run_tests.sh: --dist loadgroup), never beside another multi-device module
pytestmark = pytest.mark.xdist_group("multidevice")

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

# Restore a checkpoint on this process's devices with abstract sharded targets, dump it, then --resume.
_RESTORE_WORKER = r'''
import json, sys
import jax, numpy as np
from flax import nnx
from minicpm4_jax.config import load_config
from minicpm4_jax.sharding import make_mesh
from minicpm4_jax.train.checkpoint import Checkpointer, sharded_abstract_state
from minicpm4_jax.train.loop import run_training
args = json.loads(sys.argv[1])
assert jax.device_count() == args["devices"], jax.devices()
cfg = load_config(None, args["overrides"])
mesh = make_mesh(cfg.mesh)
target = sharded_abstract_state(cfg, mesh)
ck = Checkpointer(cfg)
step, state = ck.restore(target, step=4)   # the saved 8-device sharding is not replayed
ck.close()
bad = [jax.tree_util.keystr(p) for (p, x), t in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(target))
       if x.sharding != t.sharding]
np.savez(args["out"] + ".npz", **{jax.tree_util.keystr(p): np.asarray(x)
                                  for p, x in jax.tree_util.tree_flatten_with_path(state)[0]})
s = run_training(cfg, resume=True, log=print, progress=False)
json.dump({"step": int(step), "bad_shardings": bad, "mesh": dict(mesh.shape), "devices": len(mesh.devices.flat),
           "losses": {h["step"]: h["loss"] for h in s["history"]}}, open(args["out"] + ".json", "w"))
'''

# Train; SIGKILL this process in the middle of writing checkpoint ``kill_step`` (after the save has
# started and written the data item into orbax's temporary folder, before the folder is committed).
_KILL_WORKER = r'''
import json, os, signal, sys
import grain._src.python.checkpoint.handler as gh
from minicpm4_jax.config import load_config
from minicpm4_jax.train.loop import run_training
args = json.loads(sys.argv[1])
orig = gh.CheckpointHandler.save
def save(self, directory, *a, **kw):
    out = orig(self, directory, *a, **kw)
    if str(directory.parent.name).startswith(str(args["kill_step"]) + "."):
        print("killing during save of", directory.parent.name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return out
gh.CheckpointHandler.save = save
run_training(load_config(None, args["overrides"]), log=print, progress=False)
'''


def _run(code: str, args: dict, devices: int, timeout: float = 240.0) -> subprocess.Popen:
    env = subprocess_env(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), XLA_FLAGS=SUBPROCESS_XLA_FLAGS,
                         PYTHONUNBUFFERED="1")
    return subprocess.Popen([PY, "-c", code, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO)


def _params(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(corpus_docs()):
        (d / f"doc{i:03d}.txt").write_text(doc)
    return d


def _restore(cfg, mesh, step):
    ck = Checkpointer(cfg)
    try:
        return ck.restore(sharded_abstract_state(cfg, mesh), step=step, check=False)[1]
    finally:
        ck.close()


def test_restore_on_fewer_devices_bitwise_and_same_losses(corpus, tmp_path):
    cache = tmp_path / "cache"
    kw = {"steps": 8, "checkpoint.save_every": 4, "mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}
    ref_cfg = load_config(None, tiny_overrides(corpus, cache, tmp_path / "ref", **kw))
    ref = run_training(ref_cfg, log=lambda _m: None, progress=False)  # 8 devices, uninterrupted
    ref_losses = {h["step"]: h["loss"] for h in ref["history"]}
    ck = Checkpointer(ref_cfg)
    assert ck.all_steps() == [4, 8]
    ck.close()
    saved4 = _params(_restore(ref_cfg, make_mesh(ref_cfg.mesh), 4))

    runs = {}
    # field_faults B21's minimal input: mesh (fsdp=4, tp=2) restored on 2 devices (fsdp=2, tp=1) and on 1
    for name, devices, mesh in (("two", 2, {"mesh.fsdp": 2, "mesh.tensor": 1}),
                                ("one", 1, {"mesh.fsdp": 1, "mesh.tensor": 1})):
        out = tmp_path / name
        shutil.copytree(tmp_path / "ref" / "checkpoints" / "4", out / "checkpoints" / "4")  # step 4 only
        ov = tiny_overrides(corpus, cache, out, **{**kw, **mesh})
        runs[name] = (_run(_RESTORE_WORKER, {"overrides": ov, "out": str(tmp_path / name), "devices": devices},
                           devices), out)
    for name, (p, out) in runs.items():
        text, _ = p.communicate(timeout=240)
        assert p.returncode == 0, text[-3000:]
        got = json.loads((tmp_path / f"{name}.json").read_text())
        assert got["step"] == 4 and got["bad_shardings"] == [], got
        assert got["devices"] == (2 if name == "two" else 1)
        assert f"resumed from {out / 'checkpoints'}/4" in text
        assert "(checkpoint != current; allowed)" in text  # the mesh changed
        dumped = dict(np.load(tmp_path / f"{name}.npz"))
        assert dumped.keys() == saved4.keys()
        differ = [k for k in saved4 if not np.array_equal(dumped[k], saved4[k])]
        assert not differ, f"{name}: restored arrays differ from the saved ones: {differ[:4]}"
        losses = {int(k): v for k, v in got["losses"].items()}
        assert sorted(losses) == [5, 6, 7, 8]
        diff = max(abs(losses[k] - ref_losses[k]) for k in losses)
        assert diff <= 1e-5, (name, diff, losses, ref_losses)
        print(f"restored on {got['devices']} device(s), mesh {got['mesh']}: bitwise equal; "
              f"max |loss diff| steps 5-8 vs 8 devices {diff:.2e}")


def test_sigkill_during_save_keeps_previous_checkpoint_and_resume_is_bitwise(corpus, tmp_path):
    cache = tmp_path / "cache"
    kw = {"steps": 12, "checkpoint.save_every": 4, "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}
    ref_cfg = load_config(None, tiny_overrides(corpus, cache, tmp_path / "ref", **kw))
    run_training(ref_cfg, log=lambda _m: None, progress=False)  # uninterrupted (and warms the data cache)
    want = _params(_restore(ref_cfg, make_mesh(ref_cfg.mesh), 12).params)

    out = tmp_path / "killed"
    ov = tiny_overrides(corpus, cache, out, **kw)
    p = _run(_KILL_WORKER, {"overrides": ov, "kill_step": 8}, 1)
    text, _ = p.communicate(timeout=240)
    assert p.returncode == -9, text[-3000:]
    assert "killing during save of 8." in text
    ck_dir = out / "checkpoints"
    assert any(".orbax-checkpoint-tmp" in c.name for c in ck_dir.iterdir()), sorted(os.listdir(ck_dir))
    cfg = load_config(None, ov)
    ck = Checkpointer(cfg)  # its start-up removes the temporary folder of the killed save, before it returns
    assert not any(".orbax-checkpoint-tmp" in c.name for c in ck_dir.iterdir()), sorted(os.listdir(ck_dir))
    assert ck.all_steps() == [4]
    ck.close()
    logs: list[str] = []
    s = run_training(cfg, resume=True, log=logs.append, progress=False)
    assert s["step"] == 12 and f"resumed from {ck_dir}/4" in logs
    ck = Checkpointer(cfg)
    assert ck.all_steps() == [4, 8, 12]  # the interrupted save of step 8 was redone; no temporary folder left
    assert not any(".orbax-checkpoint-tmp" in c.name for c in ck_dir.iterdir())
    ck.close()
    got = _params(_restore(cfg, make_mesh(cfg.mesh), 12).params)
    assert got.keys() == want.keys()
    differ = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ[:4]}"


# A 1-device process reads a checkpoint written on a (1, 4, 2) mesh of 8 devices the way generate/eval/export do.
_INFERENCE_WORKER = r'''
import json, sys
import jax, numpy as np
from minicpm4_jax.convert import flat_params
from minicpm4_jax.train.checkpoint import Checkpointer, load_params_for_inference
args = json.loads(sys.argv[1])
assert jax.device_count() == 1, jax.devices()
cfg, model = load_params_for_inference(args["dir"], 1)
params = flat_params(model)
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
from flax import nnx
bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
       if x.sharding != one]
ck = Checkpointer(cfg, read_only=True)  # metadata and config of the 8-device checkpoint on this 1-device host
steps, saved_mesh = ck.all_steps(), ck.saved_config(1).mesh
ck.close()
np.savez(args["out"] + ".npz", **params)
json.dump({"bad_shardings": bad, "steps": steps, "saved_mesh": [saved_mesh.data, saved_mesh.fsdp, saved_mesh.tensor]},
          open(args["out"] + ".json", "w"))
'''


def test_inference_load_of_a_sharded_checkpoint_on_one_device(corpus, tmp_path):
    """field_faults B21 for ``load_params_for_inference`` (generate, eval, export, qat.init_from): a train state
    saved on a (1, 4, 2) mesh of 8 devices loads in a 1-device process onto that device, bit for bit, and its
    metadata (steps, stored config) reads there. The resume test above covers ``Checkpointer.restore`` only."""
    from minicpm4_jax.convert import flat_params
    from minicpm4_jax.train.step import init_train_state

    assert jax.device_count() == 8
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", tmp_path / "run",
                                           **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}))
    mesh = make_mesh(cfg.mesh)
    _, state = init_train_state(cfg, jax.random.key(0), mesh)
    sharded = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
               if len(x.sharding.device_set) > 1]
    assert sharded  # the checkpoint really holds arrays split over several devices
    ck = Checkpointer(cfg)
    ck.save(1, state)
    ck.close()
    want = flat_params(state.params)
    p = _run(_INFERENCE_WORKER, {"dir": str(tmp_path / "run"), "out": str(tmp_path / "one")}, 1)
    text, _ = p.communicate(timeout=240)
    assert p.returncode == 0, text[-3000:]
    got = json.loads((tmp_path / "one.json").read_text())
    assert got == {"bad_shardings": [], "steps": [1], "saved_mesh": [1, 4, 2]}, got
    dumped = dict(np.load(tmp_path / "one.npz"))
    assert dumped.keys() == want.keys()
    differ = [k for k in want if not np.array_equal(dumped[k], np.asarray(want[k]))]
    assert not differ, f"loaded arrays differ from the saved ones: {differ[:4]}"
