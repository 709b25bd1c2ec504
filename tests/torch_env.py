"""Helpers for tests that need the Python 3.11 CPU PyTorch side (not a test module).

:func:`ensure_torch_env` creates ``.venv-torch`` with ``scripts/bootstrap_torch_env.sh`` once per
session (a file lock keeps pytest-xdist workers from racing; the script's stamp file makes later
runs a ~ms no-op). The only reason to skip is a missing Python 3.11 interpreter (the CPU torch wheel
is cp311); any other failure fails the test. :func:`run_torch_side` runs ``scripts/torch_side.py``.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCH_VENV = REPO / ".venv-torch"
TORCH_PY = TORCH_VENV / "bin" / "python"
BOOTSTRAP = REPO / "scripts" / "bootstrap_torch_env.sh"
TORCH_SIDE = REPO / "scripts" / "torch_side.py"
_LOCK = REPO / ".cache" / "torch_env.lock"
_NO_PYTHON_MARK = "no Python 3.11 interpreter found"

_ready: bool = False


def ensure_torch_env() -> Path:
    """Create ``.venv-torch`` if needed; return its python. Skips only when no Python 3.11 exists."""
    global _ready
    if _ready:
        return TORCH_PY
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            proc = subprocess.run(["bash", str(BOOTSTRAP), str(TORCH_VENV)], cwd=REPO, capture_output=True,
                                  text=True, timeout=1800)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        if any(_NO_PYTHON_MARK in line for line in msg):
            pytest.skip(next(line for line in msg if _NO_PYTHON_MARK in line))
        pytest.fail(f"scripts/bootstrap_torch_env.sh failed (exit {proc.returncode}):\n" + "\n".join(msg[-30:]),
                    pytrace=False)
    _ready = True
    return TORCH_PY


def run_torch_side(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``scripts/torch_side.py ARGS`` under the torch env; fail the test (with stderr) on error."""
    py = ensure_torch_env()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTHON"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([str(py), str(TORCH_SIDE), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torch_side.py {' '.join(args[:1])} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                    pytrace=False)
    return proc


__all__ = ["ensure_torch_env", "run_torch_side", "TORCH_PY", "REPO"]
