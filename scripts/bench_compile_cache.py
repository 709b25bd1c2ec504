"""Start-up time of the ``minicpm4`` command with a cold and with a warm persistent compilation cache.

Times, from the launch of the process:

* ``train``: until the first ``step`` log line of ``minicpm4 train --config configs/cpu_tiny.yaml`` (``log_every=1``;
  the run is then stopped with SIGTERM and its folder dropped);
* ``generate``: the whole ``minicpm4 generate --checkpoint RUN --prompt "def " --max-new-tokens 32`` (``--checkpoint``
  a trained run, e.g. ``minicpm4 train --config cpu_tiny steps=4 optimizer.warmup_steps=1 out_dir=runs/tiny4``).

The cache root is a fresh temporary ``MINICPM4_JAX_CACHE``: one untimed run first builds the native CPU kernel
there (``native/``, which the command also caches), then each round removes ``xla/`` (cold) and runs twice (cold,
then warm). ``JAX_COMPILATION_CACHE_DIR`` and the other cache variables of the caller are removed, so the command
uses its own defaults (:mod:`minicpm4_jax.compilation_cache`). Results: ``docs/benchmarks.md``.

    .venv/bin/python scripts/bench_compile_cache.py --checkpoint runs/tiny4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minicpm4_jax.argtypes import int_range  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE",
                                "MINICPM4_JAX_COMPILATION_CACHE"))}
    env.update({"MINICPM4_JAX_CACHE": str(root), "PYTHONUNBUFFERED": "1"})
    return env


def _train_to_first_step(root: Path, work: Path, timeout: float) -> float:
    out = work / "train_out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "minicpm4_jax.cli", "train", "--config", "configs/cpu_tiny.yaml", "--no-progress",
           "steps=20", "optimizer.warmup_steps=1", "log_every=1", "eval_every=1000", "checkpoint.save_every=1000",
           "max_train_minutes=null", f"out_dir={out}"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(root), cwd=REPO)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step"):
                elapsed = time.perf_counter() - t0
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=timeout)
                return elapsed
            if time.perf_counter() - t0 > timeout:
                break
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(out, ignore_errors=True)
    sys.exit(f"train printed no step line within {timeout:.0f} s:\n{''.join(lines[-20:])}")


def _generate(root: Path, checkpoint: str, timeout: float) -> float:
    cmd = [sys.executable, "-m", "minicpm4_jax.cli", "generate", "--checkpoint", checkpoint, "--prompt", "def ",
           "--max-new-tokens", "32", "--no-stream"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(root), cwd=REPO, timeout=timeout)
    elapsed = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"generate failed ({r.returncode}): {r.stderr[-2000:]}")
    return elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="a trained run folder for the generate timing (default: train only)")
    ap.add_argument("--rounds", type=int_range(1), default=3, help="cold + warm pairs per command (default 3)")
    ap.add_argument("--skip-train", action="store_true", help="time generate only")
    ap.add_argument("--timeout", type=int_range(10), default=600, help="seconds per run (default 600)")
    a = ap.parse_args(argv)
    if a.skip_train and not a.checkpoint:
        ap.error("--skip-train needs --checkpoint")
    if a.checkpoint and not Path(a.checkpoint).is_dir():
        ap.error(f"--checkpoint {a.checkpoint} is not a folder; give a trained run's folder")
    jobs = []
    if not a.skip_train:
        jobs.append(("train: launch to first step", lambda root, work: _train_to_first_step(root, work, a.timeout)))
    if a.checkpoint:
        jobs.append(("generate: whole command", lambda root, work: _generate(root, a.checkpoint, a.timeout)))
    with tempfile.TemporaryDirectory(prefix="bench_compile_cache_") as tmp:
        root, work = Path(tmp) / "cache", Path(tmp) / "work"
        work.mkdir()
        for name, run in jobs:
            run(root, work)  # untimed: builds the native kernel (and the data cache) once
            times: dict[str, list[float]] = {"cold": [], "warm": []}
            for i in range(a.rounds):
                shutil.rmtree(root / "xla", ignore_errors=True)
                for kind in ("cold", "warm"):
                    times[kind].append(run(root, work))
                    print(f"{name}: round {i + 1} {kind} {times[kind][-1]:.2f} s", flush=True)
            entries = len([p for p in (root / "xla").iterdir() if p.name.endswith("-cache")])
            size = sum(p.stat().st_size for p in (root / "xla").iterdir()) / 2**20
            print(f"{name}: cold {' '.join(f'{t:.1f}' for t in times['cold'])} s (median "
                  f"{statistics.median(times['cold']):.1f}); warm {' '.join(f'{t:.1f}' for t in times['warm'])} s "
                  f"(median {statistics.median(times['warm']):.1f}); cache {entries} entries, {size:.1f} MiB",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
