"""Test environment: CPU, 8 fake devices, float32, persistent compilation cache.

Set before anything imports jax.
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Multi-device CPU programs (the tests' subprocesses inherit this) run one thread per fake device; on a
# loaded 2-core machine a thread can reach a collective more than XLA's default 40 s after its peers, and XLA
# then aborts the process. Wait longer, but not forever: a real deadlock still fails within minutes.
#: XLA flags for subprocesses that set their own device count (give them this instead of an empty XLA_FLAGS).
COLLECTIVE_TIMEOUT_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=240"
                            " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60")
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " " + COLLECTIVE_TIMEOUT_FLAGS
_REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".cache" / "jax_compilation"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

#: ``../shared`` beside the clone: present in CI, absent in a user's clone.
SHARED = _REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """Path under ``../shared``; skips the calling test (with the reason) when it is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent (../shared exists beside the CI clone only)")
    return p


@pytest.fixture
def repo_root() -> Path:
    return _REPO


def lower_for(f, args, platform: str) -> str:
    """StableHLO text of ``jax.jit(f)`` lowered on this CPU host for ``platform`` (``"tpu"`` or ``"cuda"``).

    Cross-lowering (spec ``jax_stack.md`` §2.3) runs the Pallas -> Mosaic TPU / Triton lowering, so an illegal
    block shape fails here; CUDA needs an abstract GPU device in context.
    """
    if platform == "tpu":
        return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
