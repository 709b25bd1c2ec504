"""Multi-host training (issue 5): ``jax.distributed`` from the config, per-process data, agreed preemption stop.

The real test starts two CPU processes on localhost (``jax.distributed.initialize`` with a free port,
4 fake CPU devices each, gloo collectives) that train the tiny model on the ``(2, 2, 2)`` mesh; one
of them gets SIGTERM, both must save at the same step and exit 143; two fresh processes resume.
Their per-step losses and final parameters must equal a single process on 8 devices with the same
global batch (the in-process reference; ``conftest.py`` gives this process 8 CPU devices).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS, subprocess_env

from minicpm4_jax.config import ConfigError, DistributedConfig, load_config
from minicpm4_jax.sharding import batch_sharding, make_global_batch, make_mesh, process_batch_rows

# multi-device programs (fake CPU devices, one thread each) run one module at a time, on one xdist worker
# (scripts/run_tests.sh: --dist loadgroup), never beside another multi-device module
pytestmark = pytest.mark.xdist_group("multidevice")

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

# One training process: run_training with the JSON args; writes its losses to <out>.<pid>.json.
_WORKER = r'''
import json, os, signal, sys, time
args = json.loads(sys.argv[1])
from minicpm4_jax.config import load_config
from minicpm4_jax.train.loop import run_training
ov = list(args["overrides"])
if args.get("auto"):
    ov += ["distributed.mode=auto"]   # everything from the (SLURM) environment
elif args.get("nproc", 1) > 1:
    ov += ["distributed.mode=explicit", f"distributed.coordinator_address=localhost:{args['port']}",
           f"distributed.num_processes={args['nproc']}", f"distributed.process_id={args['pid']}"]
cfg = load_config(None, ov)
if args.get("full_disk") and args.get("pid", 0) == 0:  # this file cannot be written on process 0 (a full disk)
    import minicpm4_jax.convert.io as cio
    real = cio.atomic_write
    def full(path, data):
        if os.path.basename(path) == args["full_disk"]:
            raise OSError(28, "No space left on device")
        return real(path, data)
    cio.atomic_write = full
def hook(step, state):
    time.sleep(args.get("sleep", 0.0))
    if step == args.get("term_at") and args.get("term_pid") == args.get("pid", 0):
        os.kill(os.getpid(), signal.SIGTERM)   # the notice reaches this process only
    return state
s = run_training(cfg, resume=args.get("resume", False), log=print, progress=False, step_hook=hook)
with open(args["out"] + f".{args.get('pid', 0)}.json", "w") as f:
    json.dump({"step": s["step"], "stop_reason": s["stop_reason"], "checkpoint_step": s.get("checkpoint_step"),
               "losses": {h["step"]: h["loss"] for h in s.get("history", [])}}, f)
sys.exit(128 + signal.SIGTERM if s["stop_reason"] == "signal" else 0)
'''


def corpus_docs(seed: int = 0, n_docs: int = 60) -> list[str]:
    """Small structured 'source code' documents (as in ``test_train.py``)."""
    rng = np.random.default_rng(seed)
    names = ["alpha", "beta", "gamma", "delta", "value", "items", "result", "count", "index", "total"]
    docs = []
    for d in range(n_docs):
        lines = [f"# module {d}", "import os", ""]
        for _ in range(int(rng.integers(3, 7))):
            a, b = rng.choice(names, 2, replace=False)
            lines += [f"def {a}_{b}({a}, {b}):", f"    return {a} + {b} * {int(rng.integers(2, 9))}", ""]
        docs.append("\n".join(lines))
    return docs


def tiny_overrides(corpus: Path, cache: Path, out: Path, **kw) -> list[str]:
    ov = {
        "model.vocab_size": 512, "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
        "model.max_position_embeddings": 128, "model.dim_model_base": 16, "model.rope_scaling": "null",
        "model.mtp": "false", "data.sources": f"[{corpus}]", "data.tokenizer_vocab_size": 384, "data.seq_len": 32,
        "data.batch_size": 8, "data.val_fraction": 0.1, "data.cache_dir": str(cache), "steps": 12,
        "optimizer.warmup_steps": 2, "optimizer.decay_steps": 2, "optimizer.learning_rate": 0.02,
        "optimizer.eps": 1e-5, "log_every": 1, "eval_every": 1000, "eval_batches": 1,
        "checkpoint.save_every": 1000, "sample_tokens": 0, "tensorboard": "false", "max_train_minutes": "null",
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "out_dir": str(out),
    }
    ov.update(kw)
    return [f"{k}={v}" for k, v in ov.items()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(corpus_docs()):
        (d / f"doc{i:03d}.txt").write_text(doc)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _slurm_env(n: int) -> Callable[[int], dict[str, str]]:
    """The variables ``srun`` gives task ``p`` of an ``n``-task job step on this host (JAX's SLURM cluster
    detection reads them; the coordinator port is derived from the job id, so pick one that maps to a free port)."""
    for _ in range(50):
        port = _free_port()
        if port >= 65536 - 2**12:
            break
    else:  # the OS hands out ports below JAX's range: probe the range directly
        port = next(p for p in range(65535, 65536 - 2**12, -1) if _port_is_free(p))
    job_id = 4096 * 123 + (port - (65536 - 2**12))  # JAX: port = job_id % 4096 + 61440
    return lambda p: {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": str(n),
                      "SLURM_PROCID": str(p), "SLURM_LOCALID": str(p), "SLURM_STEP_NUM_NODES": "1"}


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
        return True


def _launch(args: dict, n: int, devices_each: int, timeout: float = 300.0,
            env_for: Callable[[int], dict[str, str]] | None = None) -> list[tuple[int, str]]:
    """Run ``n`` worker processes (one coordinator port) to the end: ``[(returncode, output)]``.

    ``env_for(p)``: extra environment of process ``p`` (e.g. :func:`_slurm_env`)."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("SLURM_")}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_each),
                "XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "PYTHONUNBUFFERED": "1"})
    port = _free_port()
    procs = [subprocess.Popen([PY, "-c", _WORKER, json.dumps({**args, "nproc": n, "pid": p, "port": port})],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, **(env_for(p) if env_for else {})}, cwd=REPO)
             for p in range(n)]
    out = []
    t_end = time.monotonic() + timeout
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, t_end - time.monotonic()))
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _params(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# -------------------------------------------------------------------------------------------------
# config and start-up
# -------------------------------------------------------------------------------------------------


def test_distributed_config_errors_are_one_line():
    cases = {
        "distributed.mode=foo": "distributed.mode='foo'",
        "distributed.process_id=1": "mode='off' ignores it",
        "distributed.mode=explicit": "needs distributed.num_processes",
    }
    for ov, want in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [ov])
        assert want in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"process_id=2 must be in \[0, distributed.num_processes=2\)"):
        load_config(None, ["distributed.mode=explicit", "distributed.num_processes=2", "distributed.process_id=2"])
    with pytest.raises(ConfigError, match="must be host:port"):
        load_config(None, ["distributed.mode=explicit", "distributed.num_processes=2", "distributed.process_id=0",
                           "distributed.coordinator_address=localhost"])
    from minicpm4_jax.train import distributed as dist

    jax.devices()  # this process has used its devices: too late to start the runtime
    assert dist.initialize(DistributedConfig()) is False
    with pytest.raises(ConfigError, match="must run before any device is used"):
        dist.initialize(DistributedConfig(mode="explicit", coordinator_address="localhost:1", num_processes=2,
                                          process_id=0))


def test_process_rows_and_global_batch_on_meshes():
    """One process holds all rows; the global array equals the numpy batch on every mesh."""
    batch = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    for sizes in [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 4, 2)]:
        mesh = make_mesh(load_config(None, [f"mesh.data={sizes[0]}", f"mesh.fsdp={sizes[1]}",
                                            f"mesh.tensor={sizes[2]}"]).mesh)
        sh = batch_sharding(mesh)
        assert process_batch_rows(sh, 8) == list(range(8))
        g = make_global_batch(batch, sh, batch.shape)
        assert g.sharding == sh and np.array_equal(np.asarray(g), batch)
    with pytest.raises(ValueError, match="local batch has shape"):
        make_global_batch(batch[:3], sh, batch.shape)


# -------------------------------------------------------------------------------------------------
# two real processes
# -------------------------------------------------------------------------------------------------


def test_process_allgather_rows_in_one_process():
    from minicpm4_jax.train.distributed import broadcast_from_process_0, process_allgather

    got = process_allgather(np.arange(3, dtype=np.int32))
    assert got.shape == (1, 3) and got.tolist() == [[0, 1, 2]]
    assert broadcast_from_process_0(np.bool_(True)) == np.True_


def test_train_agrees_through_the_helper_that_awaits_every_device():
    """``multihost_utils.process_allgather`` / ``broadcast_one_to_all`` return when the first local device has the
    result; a process that then exits left its peer hanging in teardown (3 of 40 runs on a loaded machine)."""
    import ast

    for f in sorted((REPO / "train").glob("*.py")) + [REPO / "minicpm4_jax" / "sharding.py"]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("process_allgather", "broadcast_one_to_all") and \
                    isinstance(node.value, ast.Name) and node.value.id == "multihost_utils":
                pytest.fail(f"{f.name}:{node.lineno} calls multihost_utils.{node.attr}; use "
                            "minicpm4_jax.train.distributed.process_allgather / broadcast_from_process_0")


_GATHER_THEN_EXIT = r'''
import json, sys
args = json.loads(sys.argv[1])
import jax, numpy as np
jax.distributed.initialize(f"localhost:{args['port']}", args["nproc"], args["pid"])
from minicpm4_jax.train.distributed import broadcast_from_process_0, process_allgather
rows = process_allgather(np.array([args["pid"], 10 + args["pid"]], np.int32))
print("rows", rows.tolist(), "first", int(broadcast_from_process_0(np.int32(7 + args["pid"]))), flush=True)
raise SystemExit(3)   # at once, as a refused start does
'''


def _two_processes(script: str) -> tuple[list[int], list[str]]:
    """Run ``script`` as processes 0 and 1 of a 2-process CPU cluster (4 devices each): return codes and outputs."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("SLURM_")}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS,
                "PYTHONUNBUFFERED": "1"})
    port = _free_port()
    procs = [subprocess.Popen([PY, "-c", script, json.dumps({"nproc": 2, "pid": p, "port": port})],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
             for p in range(2)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outs


def test_gather_then_exit_ends_both_processes():
    for _ in range(3):
        rcs, outs = _two_processes(_GATHER_THEN_EXIT)
        assert rcs == [3, 3], outs
        assert all("rows [[0, 10], [1, 11]] first 7" in o for o in outs), outs


_GATHER_64_BIT = r'''
import json, sys
args = json.loads(sys.argv[1])
import jax, numpy as np
jax.distributed.initialize(f"localhost:{args['port']}", args["nproc"], args["pid"])
from minicpm4_jax.train.distributed import broadcast_from_process_0, process_allgather
pid = args["pid"]
big = process_allgather(np.int64(2**40 + pid))
t = process_allgather(np.array([1.7e9 + 0.25 + pid, 1e-12 * pid]))
flags = process_allgather(np.array([[True, pid == 1]]))
print("got", big.dtype, big.tolist(), t.dtype, t.tolist(), flags.shape, flags.tolist(),
      repr(broadcast_from_process_0(2**40 + pid)), flush=True)
for mine in ((np.zeros((2, 3), np.int32) if pid == 0 else np.zeros((3, 2), np.int32)),
             (np.int64(7) if pid == 0 else np.float64(7.0))):  # the same bytes per process, another value
    try:
        print("silently", process_allgather(mine).tolist(), flush=True)
    except ValueError as e:
        print("refused:", e, flush=True)
'''


def test_gather_keeps_64_bit_values_and_dtypes():
    """Earlier sessions: the all-gather narrowed 64-bit values to 32 bits without ``jax_enable_x64`` in several
    processes (``2**40`` arrived as 0, a float64 time lost its fraction), while one process returned them whole."""
    rcs, outs = _two_processes(_GATHER_64_BIT)
    assert rcs == [0, 0], outs
    want = ("got int64 [1099511627776, 1099511627777] float64 [[1700000000.25, 0.0], [1700000001.25, 1e-12]] "
            "(2, 1, 2) [[[True, False]], [[True, True]]] np.int64(1099511627776)")
    assert all(want in o for o in outs), outs
    # the same number of bytes in another shape or dtype was read as this process's (after daa4b5b): one line
    for p, o in enumerate(outs):
        assert "silently" not in o, o
        assert (f"refused: process_allgather: process {1 - p} gave a value of dtype and shape "
                f"int32 {[[3, 2], [2, 3]][p]}, process {p} int32 {[[2, 3], [3, 2]][p]}; give every process a value "
                "of one dtype and shape") in o, o
        assert f"process {1 - p} gave a value of dtype and shape {['float64', 'int64'][p]} []" in o, o


def test_a_run_file_process_0_cannot_write_stops_every_process(corpus, tmp_path):
    """Process 0 alone writes config.json; when that failed (a full disk) the other process went on into the first
    step and waited there for process 0 (break test 91). Both end, before training, with one error naming it."""
    ov = tiny_overrides(corpus, tmp_path / "cache", tmp_path / "run", **{"mesh.data": 2, "mesh.fsdp": 1, "mesh.tensor": 1})
    res = _launch({"overrides": ov, "out": str(tmp_path / "a"), "full_disk": "config.json"}, 2, 1, timeout=120.0)
    logs = "\n".join(t for _, t in res)
    assert all(rc not in (0, None) for rc, _ in res), logs[-3000:]
    assert "RunFileWriteError: writing " in res[0][1] and "config.json failed (No space left on device)" in res[0][1]
    assert "RunFileWriteError: process 0 could not write the run's files" in res[1][1], res[1][1][-2000:]
    assert "nothing was trained" in res[1][1] and not (tmp_path / "run" / "checkpoints" / "1").exists()


def test_qat_init_from_in_two_processes(corpus, tmp_path):
    """``qat.init_from`` read the source's parameters whole onto the first local device and then ``jax.device_put``
    them into the run's shardings, which in a multi-process run span the other process's devices: every process
    failed with a ValueError traceback ("device_put's second argument must be ... addressable devices") before the
    first step. Each array is now read straight into its shards (as a resume reads the train state)."""
    from minicpm4_jax.train.checkpoint import Checkpointer
    from minicpm4_jax.train.step import init_train_state

    mesh = {"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 1}  # the parameters split over the two processes
    src_cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", tmp_path / "src",
                                               **{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}))
    _, state = init_train_state(src_cfg, 0, make_mesh(dataclasses.replace(src_cfg.mesh, fsdp=-1)))
    ck = Checkpointer(src_cfg, tmp_path / "src" / "checkpoints")
    try:
        ck.save(3, state)
    finally:
        ck.close()
    ov = tiny_overrides(corpus, tmp_path / "cache", tmp_path / "q", steps=1, **mesh, **{
        "qat.enabled": "true", "qat.init_from": str(tmp_path / "src"), "optimizer.warmup_steps": 0,
        "optimizer.decay_steps": 0})
    res = _launch({"overrides": ov, "out": str(tmp_path / "a")}, 2, 1, timeout=240.0)
    logs = "\n".join(t for _, t in res)
    assert [rc for rc, _ in res] == [0, 0], logs[-3000:]
    assert f"qat: starting from the latent weights of {tmp_path / 'src' / 'checkpoints'}/3" in res[0][1]
    a = [json.loads((tmp_path / f"a.{p}.json").read_text()) for p in range(2)]
    assert a[0]["step"] == a[1]["step"] == 1 and a[0]["losses"] == a[1]["losses"]
    assert 0 < a[0]["losses"]["1"] < 10


def test_two_processes_match_one_process_preempt_and_resume(corpus, tmp_path):
    from minicpm4_jax.train.checkpoint import Checkpointer, sharded_abstract_state
    from minicpm4_jax.train.loop import run_training

    cache = tmp_path / "cache"
    # reference: one process, 8 devices, same mesh and global batch, uninterrupted (also warms the data cache)
    ref_cfg = load_config(None, tiny_overrides(corpus, cache, tmp_path / "ref"))
    ref = run_training(ref_cfg, log=lambda _m: None, progress=False)
    ref_losses = {h["step"]: h["loss"] for h in ref["history"]}
    assert sorted(ref_losses) == list(range(1, 13))

    # two processes x 4 devices; SIGTERM reaches process 1 only, during step 2
    mp_out = tmp_path / "mp"
    args = {"overrides": tiny_overrides(corpus, cache, mp_out), "out": str(tmp_path / "a"), "sleep": 0.1,
            "term_at": 1, "term_pid": 1}
    res = _launch(args, 2, 4)
    logs = "\n".join(t for _, t in res)
    assert [rc for rc, _ in res] == [143, 143], logs[-3000:]
    a = [json.loads((tmp_path / f"a.{p}.json").read_text()) for p in range(2)]
    stop = a[0]["step"]
    assert a[1]["step"] == stop and 2 <= stop < 12 and a[0]["checkpoint_step"] == stop, a
    assert "SIGTERM received: saving a checkpoint at step" in res[0][1] and "all 2 processes" in res[0][1]
    assert "SIGTERM received" not in res[1][1]  # process 0 alone prints
    data_dir = mp_out / "checkpoints" / str(stop) / "data"
    assert sorted(f.name for f in data_dir.glob("process_*")) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert (mp_out / "config.json").is_file() and not (mp_out / "summary.json").exists()
    # per-process data: the processes' rows of global batch k are batch k of one process, in order;
    # the 2-process iterator state (a global batch count) restores in one process
    from minicpm4_jax.train import data as data_api
    from minicpm4_jax.train.checkpoint import restore_data_iterator

    data = data_api.prepare_data(ref_cfg.data, log=lambda _m: None)
    one = data_api.train_iterator(data, ref_cfg.data)
    parts = [data_api.train_iterator(data, ref_cfg.data, process_index=i, process_count=2) for i in range(2)]
    for _ in range(stop):
        b = [next(x)["input_ids"] for x in parts]
        assert np.array_equal(np.concatenate(b), next(one)["input_ids"]) and b[0].shape[0] == 4
    states = {(data_dir / f"process_{i}-of-2.json").read_text() for i in range(2)}
    assert len(states) == 1 and json.loads(states.pop()) == one.get_state()
    fresh = data_api.train_iterator(data, ref_cfg.data)
    assert restore_data_iterator(mp_out, stop, fresh)
    assert np.array_equal(next(fresh)["input_ids"], next(one)["input_ids"])

    # two fresh processes resume from exactly that step
    res = _launch({**args, "out": str(tmp_path / "b"), "resume": True, "sleep": 0.0, "term_at": None}, 2, 4)
    assert [rc for rc, _ in res] == [0, 0], "\n".join(t for _, t in res)[-3000:]
    assert f"resumed from {mp_out / 'checkpoints'}/{stop}" in res[0][1]
    b = [json.loads((tmp_path / f"b.{p}.json").read_text()) for p in range(2)]
    got = {**{int(k): v for k, v in a[0]["losses"].items()}, **{int(k): v for k, v in b[0]["losses"].items()}}
    assert sorted(got) == list(range(1, 13)) and b[1]["losses"] == b[0]["losses"]
    diff = max(abs(got[k] - ref_losses[k]) for k in got)
    assert diff <= 1e-5, (diff, got, ref_losses)

    # another run holding the folder refuses both processes at once (process 1 used to wait for process 0 at the
    # checkpoint manager's barrier until it timed out)
    from minicpm4_jax.train.loop import RunLock

    other = RunLock(mp_out)
    other.acquire(lambda _m: None)
    try:
        res = _launch({**args, "out": str(tmp_path / "c"), "resume": True, "sleep": 0.0, "term_at": None}, 2, 4,
                      timeout=150)
    finally:
        other.release()
    logs = "\n".join(t for _, t in res)
    assert [rc for rc, _ in res] == [1, 1], logs[-3000:]
    assert f"ConfigError: out_dir {str(mp_out)!r} is in use by another training process (pid {os.getpid()}" \
        in res[0][1], res[0][1][-3000:]
    assert f"ConfigError: process 0 could not lock {mp_out}" in res[1][1], res[1][1][-2000:]

    # the 2-process checkpoint restores in this single process (8 devices) and equals the reference
    mesh = make_mesh(ref_cfg.mesh)
    want, have = {}, {}
    for name, d in (("ref", tmp_path / "ref"), ("mp", mp_out)):
        ck = Checkpointer(load_config(None, tiny_overrides(corpus, cache, d)))
        try:
            step, st = ck.restore(sharded_abstract_state(ref_cfg, mesh), check=False)
        finally:
            ck.close()
        assert step == 12
        (want if name == "ref" else have).update(_params(st.params))
    assert want.keys() == have.keys()
    pdiff = max(float(np.max(np.abs(want[k] - have[k]))) for k in want)
    assert pdiff <= 1e-5, pdiff
    print(f"2 processes vs 1: max |loss diff| {diff:.2e} over 12 steps (stop at {stop}), max |param diff| {pdiff:.2e}")


def test_auto_mode_on_slurm_with_qat_and_mtp_matches_one_process(corpus, tmp_path):
    """``distributed.mode=auto`` as under ``srun``: two processes find the coordinator, their count and their
    ids in the SLURM environment alone (JAX's cluster detection), and train with the MTP head and ternary QAT
    switched on half-way (token_share 0.5: the switch, the re-warmup and the fake-quantized forward all run
    sharded over the processes). Losses and parameters equal one process on 8 devices."""
    from minicpm4_jax.train.checkpoint import Checkpointer, sharded_abstract_state
    from minicpm4_jax.train.loop import run_training

    cache = tmp_path / "cache"
    extra = {"model.mtp": "true", "qat.enabled": "true", "qat.token_share": 0.5, "qat.warmup_steps": 2,
             "steps": 8}
    ref_cfg = load_config(None, tiny_overrides(corpus, cache, tmp_path / "ref", **extra))
    ref = run_training(ref_cfg, log=lambda _m: None, progress=False)
    ref_losses = {h["step"]: h["loss"] for h in ref["history"]}
    assert sorted(ref_losses) == list(range(1, 9))

    out = tmp_path / "auto"
    args = {"overrides": tiny_overrides(corpus, cache, out, **extra), "out": str(tmp_path / "a"), "auto": True}
    res = _launch(args, 2, 4, env_for=_slurm_env(2))
    logs = "\n".join(t for _, t in res)
    assert [rc for rc, _ in res] == [0, 0], logs[-3000:]
    assert "distributed: 2 processes, 8 devices (4 on this process)" in res[0][1], res[0][1][-2000:]
    assert "qat" in res[0][1].lower()
    a = [json.loads((tmp_path / f"a.{p}.json").read_text()) for p in range(2)]
    got = {int(k): v for k, v in a[0]["losses"].items()}
    assert sorted(got) == list(range(1, 9)) and a[1]["losses"] == a[0]["losses"]
    diff = max(abs(got[k] - ref_losses[k]) for k in got)
    assert diff <= 1e-5, (diff, got, ref_losses)

    mesh = make_mesh(ref_cfg.mesh)
    want, have = {}, {}
    for d, into in ((tmp_path / "ref", want), (out, have)):
        ck = Checkpointer(load_config(None, tiny_overrides(corpus, cache, d, **extra)))
        try:
            step, st = ck.restore(sharded_abstract_state(ref_cfg, mesh), check=False)
        finally:
            ck.close()
        assert step == 8
        into.update(_params(st.params))
    assert want.keys() == have.keys() and any("mtp" in k for k in want)
    pdiff = max(float(np.max(np.abs(want[k] - have[k]))) for k in want)
    assert pdiff <= 1e-5, pdiff
    print(f"auto (SLURM) 2 processes + MTP + QAT vs 1: max |loss diff| {diff:.2e}, max |param diff| {pdiff:.2e}")
