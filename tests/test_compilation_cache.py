"""The ``minicpm4`` command's persistent compilation cache (:mod:`minicpm4_jax.compilation_cache`).

A command run twice with one fresh cache folder loads every program the second time (JAX's own hit / miss log
lines, the entries not growing, the same losses); a cache the user configured wins; the off switch; an unusable
folder is one warning line and an uncached run; multi-device CPU programs stay out of the cache.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from minicpm4_jax.compilation_cache import configure_compilation_cache

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

# configures the cache as the command does, then compiles a one-device program (and, with several devices, one
# over all of them); prints what it found
_PROBE = r'''
import json
import jax, numpy as np
from minicpm4_jax.compilation_cache import configure_compilation_cache
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
folder = configure_compilation_cache()
def one_device(x):
    return (x * 2).sum()
def all_devices(x):
    return x.sum() * 3
out = {"folder": folder, "jax_dir": jax.config.jax_compilation_cache_dir,
       "min_time": jax.config.jax_persistent_cache_min_compile_time_secs,
       "single": float(jax.jit(one_device)(np.arange(4.0, dtype=np.float32)))}
if jax.device_count() > 1:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    x = jax.device_put(np.arange(16.0, dtype=np.float32), NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d")))
    out["sharded"] = float(jax.jit(all_devices)(x))
out["keyed"] = events.count("/jax/compilation_cache/compile_requests_use_cache")
out["hits"] = events.count("/jax/compilation_cache/cache_hits")
print("RESULT " + json.dumps(out))
'''


def _env(root: Path, **extra: str) -> dict[str, str]:
    """A user's environment: no cache settings of JAX's or the suite's, the project cache root ``root``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE",
                                "MINICPM4_JAX_COMPILATION_CACHE", "JAX_NUM_CPU_DEVICES"))}
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "MINICPM4_JAX_CACHE": str(root),
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _probe(env: dict[str, str]) -> tuple[dict, str]:
    r = subprocess.run([PY, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), r.stderr


def _entries(folder: Path, program: str = "") -> set[str]:
    """The cache entries in ``folder`` (of the jitted function ``program`` if given)."""
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if p.name.endswith("-cache") and p.name.startswith(f"jit_{program}")}


def _corpus(tmp_path: Path) -> Path:
    from test_distributed import corpus_docs

    d = tmp_path / "corpus"
    d.mkdir()
    for i, doc in enumerate(corpus_docs()):
        (d / f"doc{i:03d}.txt").write_text(doc)
    return d


def test_second_run_reads_the_cache(tmp_path):
    """``minicpm4 train`` twice on one fresh cache folder: the first run misses and writes, the second only hits
    (every program of the first run), writes nothing new and trains the same losses."""
    corpus, root = _corpus(tmp_path), tmp_path / "root"
    env = _env(root, JAX_DEBUG_LOG_MODULES="jax._src.compiler")  # JAX's hit / miss lines on stderr
    ov = ["model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
          "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
          "model.dim_model_base=16", "model.rope_scaling=null", "model.mtp=false", "model.scan_layers=false",
          f"data.sources=[{corpus}]", "data.tokenizer_vocab_size=384", "data.seq_len=16", "data.batch_size=2",
          "data.val_fraction=0.1", f"data.cache_dir={tmp_path / 'data'}", "steps=2", "optimizer.warmup_steps=1",
          "optimizer.decay_steps=1", "log_every=1", "eval_every=1000", "eval_batches=1",
          "checkpoint.save_every=1000", "sample_tokens=0", "tensorboard=false", "max_train_minutes=null"]
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        r = subprocess.run([PY, "-m", "minicpm4_jax.cli", "train", "--no-progress", *ov, f"out_dir={out}"],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        runs.append({"hits": r.stderr.count("Persistent compilation cache hit for"),
                     "misses": r.stderr.count("PERSISTENT COMPILATION CACHE MISS"),
                     "entries": _entries(root / "xla"),
                     "losses": [(row["kind"], row["step"], row["loss"], row.get("grad_norm")) for row in rows]})
    cold, warm = runs
    assert cold["misses"] >= 1 and len(cold["entries"]) >= 1, cold
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"], (cold, warm)
    assert warm["entries"] == cold["entries"]
    assert len(cold["losses"]) == 3 and warm["losses"] == cold["losses"]


def test_the_users_cache_wins(tmp_path, monkeypatch):
    # JAX_COMPILATION_CACHE_DIR (and the user's minimum compile time) are kept; the default folder is not made
    user = tmp_path / "user"
    res, _ = _probe(_env(tmp_path / "root", JAX_COMPILATION_CACHE_DIR=str(user),
                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
    assert res["folder"] == res["jax_dir"] == str(user) and res["min_time"] == 0.0
    assert _entries(user, "one_device") and not (tmp_path / "root").exists()
    # set in the process (here by conftest.py): kept, with its threshold
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    assert before[0]
    monkeypatch.setenv("MINICPM4_JAX_CACHE", str(tmp_path / "root2"))
    monkeypatch.delenv("MINICPM4_JAX_COMPILATION_CACHE", raising=False)
    assert configure_compilation_cache() == before[0]
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == before
    assert not (tmp_path / "root2").exists()


def test_default_folder_and_the_off_switch(tmp_path):
    root = tmp_path / "root"
    res, _ = _probe(_env(root))
    assert res["folder"] == res["jax_dir"] == str(root / "xla") and res["min_time"] == 0.0
    assert len(_entries(root / "xla", "one_device")) == 1  # the tiny program, though it compiles in far less than JAX's 1 s
    for off in ("0", "false", "OFF"):
        root = tmp_path / f"off_{off}"
        res, _ = _probe(_env(root, MINICPM4_JAX_COMPILATION_CACHE=off))
        assert res["folder"] is None and res["jax_dir"] is None and not root.exists(), off
    res, _ = _probe(_env(tmp_path / "jax_off", JAX_ENABLE_COMPILATION_CACHE="false"))
    assert res["folder"] is None and not (tmp_path / "jax_off").exists()
    # a value that is neither: one error line from the command, nothing run
    r = subprocess.run([PY, "-m", "minicpm4_jax.cli", "train", "--config", "cpu_tiny", "steps=1"], capture_output=True,
                       text=True, env=_env(tmp_path / "bad", MINICPM4_JAX_COMPILATION_CACHE="maybe"), cwd=REPO,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: MINICPM4_JAX_COMPILATION_CACHE='maybe'") and "give 1" in r.stderr


@pytest.mark.parametrize("blocked", ["root", "xla", "user"])
def test_unusable_folder_is_one_warning_then_uncached(tmp_path, blocked):
    # a file where the cache root (its xla folder, the user's folder) should be: no cache, one line naming the
    # folder and the fix (for the user's folder JAX itself warned in two lines at the first compilation)
    root = tmp_path / "root"
    if blocked == "root":
        root.write_text("not a folder")
    else:
        root.mkdir()
        (root / "xla").write_text("not a folder")
    extra = {"JAX_COMPILATION_CACHE_DIR": str(root / "xla" / "user")} if blocked == "user" else {}
    res, err = _probe(_env(root, **extra))
    assert res["single"] == 12.0 and res["folder"] is None
    if blocked == "user":  # the folder stays as the user set it, the cache is off: no program is looked up
        assert res["jax_dir"] == str(root / "xla" / "user") and res["keyed"] == 0
    else:
        assert res["jax_dir"] is None
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    folder = root / "xla" / "user" if blocked == "user" else root / "xla"
    assert lines[0].startswith(f"warning: compilation cache folder {folder} is not writable (")
    assert ("set JAX_COMPILATION_CACHE_DIR to a writable folder" if blocked == "user"
            else "set MINICPM4_JAX_CACHE to a writable folder") in lines[0]


def test_permission_denied_is_one_warning(tmp_path, monkeypatch):
    """A read-only home as root sees it too (root writes into a mode-0500 folder): the probe's EACCES."""
    import minicpm4_jax.compilation_cache as cc

    def denied(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setenv("MINICPM4_JAX_CACHE", str(tmp_path / "home"))
    monkeypatch.delenv("MINICPM4_JAX_COMPILATION_CACHE", raising=False)
    monkeypatch.setattr(cc.tempfile, "mkstemp", denied)
    user = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)  # as in a process nobody configured
    try:
        lines = []
        assert configure_compilation_cache(warn=lines.append) is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", user)
    assert lines == [f"warning: compilation cache folder {tmp_path / 'home' / 'xla'} is not writable (Permission "
                     "denied); running without it: set MINICPM4_JAX_CACHE to a writable folder (or "
                     "MINICPM4_JAX_COMPILATION_CACHE=0)"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_folder_is_one_warning_then_uncached(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o500)
    try:
        res, err = _probe(_env(root))
    finally:
        root.chmod(0o700)
    assert res["single"] == 12.0 and res["folder"] is None
    assert [ln for ln in err.splitlines() if ln.strip()][0].startswith("warning: compilation cache folder")


def test_multi_device_cpu_programs_stay_out(tmp_path):
    """On 8 CPU devices the program over all of them is compiled, not cached (README: such executables loaded from
    the cache deadlocked with jax 0.12.0.1); the one-device program is cached; both give the same result twice."""
    root = tmp_path / "root"
    env = _env(root, JAX_NUM_CPU_DEVICES="8")
    first, _ = _probe(env)
    assert first["sharded"] == 360.0 and len(_entries(root / "xla", "one_device")) == 1
    assert not _entries(root / "xla", "all_devices")
    assert (first["keyed"], first["hits"]) == (1, 0)  # the 8-device program got no cache key: not looked up
    second, _ = _probe(env)
    assert (second["keyed"], second["hits"]) == (1, 1)
    assert second["sharded"] == first["sharded"] and not _entries(root / "xla", "all_devices")


def _damage(entry: Path, how: str) -> None:
    import zlib

    if how == "empty":  # a full disk: JAX created the file, then the write failed
        entry.write_bytes(b"")
    elif how == "truncated":  # a run killed mid-write
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    elif how == "unparsable":  # decompresses, but is no executable (JAX warned, compiled, never replaced it)
        entry.write_bytes(zlib.compress(b"\0" * 8 + b"not an executable"))
    elif how == "flipped":  # bit rot that still decompresses (zstd has no checksum): loaded as it is before
        raw = bytearray(zlib.decompress(entry.read_bytes()))
        for i in range(len(raw) // 2, len(raw), 97):
            raw[i] ^= 0xFF
        entry.write_bytes(zlib.compress(bytes(raw)))
    else:  # an entry JAX wrote (no digest beside it), truncated: must decompress
        entry.with_name(entry.name[: -len("cache")] + "sha256").unlink(missing_ok=True)
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])


@pytest.mark.parametrize("how", ["empty", "truncated", "unparsable", "flipped", "truncated_without_digest"])
def test_damaged_entry_is_replaced(tmp_path, how):
    """A damaged entry (JAX never replaced one that exists: every later run warned and compiled again, or loaded
    flipped bytes that still decompressed) is compiled again and rewritten by the next run, with one warning line;
    the run after reads it."""
    root = tmp_path / "root"
    env = _env(root)
    _probe(env)
    (entry,) = (root / "xla" / name for name in _entries(root / "xla", "one_device"))
    _damage(entry, how)
    res, err = _probe(env)
    assert res["single"] == 12.0 and res["hits"] == 0, res
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"warning: compilation cache entry {entry} is damaged ("), err
    again, err = _probe(env)
    assert (again["single"], again["hits"]) == (12.0, 1) and not err.strip(), err


def test_failed_write_leaves_no_entry(tmp_path):
    """A write that fails midway (here a 1000-byte file size limit, as a full disk): one warning line, no partial
    entry (JAX wrote the first 1000 bytes, which every later run failed to read); a later run writes it."""
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    root = tmp_path / "root"
    env = _env(root)
    r = subprocess.run([PY, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
                       preexec_fn=small_files)
    assert r.returncode == 0 and '"single": 12.0' in r.stdout, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"warning: cannot write to the compilation cache folder {root / 'xla'} "
                                                   "(File too large)"), r.stderr
    assert not _entries(root / "xla") and [p.name for p in (root / "xla").iterdir()] == [".minicpm4-lock"]
    res, err = _probe(env)
    assert (res["single"], res["hits"]) == (12.0, 0) and not err.strip(), err
    again, _ = _probe(env)
    assert again["hits"] == 1


@pytest.mark.parametrize("value", ["~/my cache", "rel/cache", " "])
def test_cache_root_as_a_shell_reads_it(tmp_path, monkeypatch, value):
    """``MINICPM4_JAX_CACHE='~/my cache'`` unexpanded (a systemd unit, a Dockerfile ENV): the home folder, not a
    folder named ``~`` in the current one, for the XLA cache and the native kernel alike; a relative path from the
    current folder, made absolute; a blank value is the default."""
    from minicpm4_jax.compilation_cache import cache_root
    from minicpm4_jax.ops.native import library_path

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    want = {"~/my cache": home / "my cache", "rel/cache": cwd / "rel" / "cache",
            " ": home / ".cache" / "minicpm4_jax"}[value]
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MINICPM4_JAX_CACHE", value)
    monkeypatch.chdir(cwd)
    assert cache_root() == want and library_path().parent == want / "native"
    env = _env(tmp_path, HOME=str(home), MINICPM4_JAX_CACHE=value)
    r = subprocess.run([PY, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert res["folder"] == str(want / "xla") and _entries(want / "xla", "one_device")
    assert not (cwd / "~").exists() and not (cwd / " ").exists()


def test_stale_temporary_file_is_removed(tmp_path):
    """A temporary entry file of a process killed between its write and its rename is removed when it is over an
    hour old (a fresh one may be another process's write in progress: kept); so is a digest whose entry JAX's
    eviction removed."""
    root = tmp_path / "root"
    (root / "xla").mkdir(parents=True)
    old, fresh = root / "xla" / ".jit_f-1-aa.tmp", root / "xla" / ".jit_f-2-bb.tmp"
    orphan, kept = root / "xla" / "jit_g-00-sha256", root / "xla" / "jit_h-00-sha256"  # a digest JAX evicted
    (root / "xla" / "jit_h-00-cache").write_bytes(b"an entry")
    for p in (old, fresh, orphan, kept):
        p.write_bytes(b"partial")
    for p in (old, orphan, kept):
        os.utime(p, (1e9, 1e9))
    res, _ = _probe(_env(root))
    assert res["single"] == 12.0 and not old.exists() and fresh.exists()
    assert not orphan.exists() and kept.exists()


def test_two_writers_of_one_key_leave_a_matching_digest(tmp_path):
    """Two processes writing one key at once (executables are not byte-identical across processes): without the
    folder lock one's entry ended beside the other's digest, and the next run called it damaged (seen with 3
    parallel ``minicpm4 generate`` on a fresh folder). Here writer B starts between A's digest and A's entry."""
    import threading
    import time as _time

    from jax._src.lru_cache import LRUCache

    import minicpm4_jax.compilation_cache as cc

    folder = tmp_path / "xla"
    warned = []
    a, b = (cc._SafeFileCache(LRUCache(str(folder), max_size=-1), warned.append) for _ in range(2))
    threads = []
    write = a._write

    def a_write(path, data):
        write(path, data)
        if path.name.endswith("-sha256") and not threads:  # A wrote its digest: B writes now
            threads.append(threading.Thread(target=b.put, args=("jit_f-1", b"executable of B")))
            threads[0].start()
            _time.sleep(0.5)

    a._write = a_write
    a.put("jit_f-1", b"executable of A")
    threads[0].join(timeout=30)
    fresh = cc._SafeFileCache(LRUCache(str(folder), max_size=-1), warned.append)
    assert fresh.get("jit_f-1") in (b"executable of A", b"executable of B") and not warned, warned
