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
# The tests' programs are tiny and compiling them is most of the suite's time: XLA's CPU backend compiles them
# with LLVM's optimisation level 0 (the HLO passes, fusions and float semantics are XLA's own and unchanged;
# only the machine code is less optimised). Measured on the 2-core CI machine with a cold compilation cache:
# tests/test_mup.py 55 -> 33 s; the whole suite (-n 2) 31:31 -> 23:59 wall, 59 -> 44 min CPU. An
# --xla_backend_optimization_level already in XLA_FLAGS is kept (e.g. =3 to run the suite as users compile).
#: XLA flags for subprocesses that set their own device count (give them this instead of an empty XLA_FLAGS).
SUBPROCESS_XLA_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=240"
                        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60")
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    SUBPROCESS_XLA_FLAGS += " --xla_backend_optimization_level=0"
else:
    SUBPROCESS_XLA_FLAGS += " " + next(f for f in os.environ["XLA_FLAGS"].split()
                                       if f.startswith("--xla_backend_optimization_level"))
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " " + SUBPROCESS_XLA_FLAGS
_REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".cache" / "jax_compilation"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _no_persistent_cache_for_cpu_collectives() -> None:
    """Keep multi-device CPU programs out of the persistent compilation cache.

    With jax 0.12.0.1, an XLA:CPU executable with collectives that comes back from the persistent cache
    deadlocks in most runs: every fake device's thread blocks in a different all-gather rendezvous and XLA
    aborts after its collective timeout. The 8-device MTP + QAT train step of ``test_distributed.py`` hung in
    12 of 13 runs that loaded it from the cache and in none of 9 that compiled it. Single-device programs,
    most of the suite's compile time, stay cached. Subprocesses that run multi-device programs get
    :func:`subprocess_env`, which has no cache directory.
    """
    try:
        from jax._src import compiler as _compiler
    except ImportError:  # pragma: no cover - private module moved: disable the cache instead
        jax.config.update("jax_enable_compilation_cache", False)
        return
    orig = getattr(_compiler, "_get_cache_key", None)
    if orig is None:  # pragma: no cover
        jax.config.update("jax_enable_compilation_cache", False)
        return

    def cache_key(options, backend, computation, devices, *args, **kwargs):
        if getattr(backend, "platform", "") == "cpu" and getattr(devices, "size", 1) > 1:
            return None  # not cached: compiled in this process
        return orig(options, backend, computation, devices, *args, **kwargs)

    _compiler._get_cache_key = cache_key


_no_persistent_cache_for_cpu_collectives()


def subprocess_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a subprocess that runs multi-device CPU programs: no persistent compilation cache
    (see :func:`_no_persistent_cache_for_cpu_collectives`), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.update(extra)
    return env

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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Make ``--dist loadgroup`` honour ``xdist_group`` marks under pytest >= 9.2.

    pytest-xdist (3.8) groups a worker's tests by appending ``@<group>`` to ``item._nodeid``; pytest 9.2 keeps
    the id in ``item._id`` (``nodeid`` is derived from it), so the suffix never reached the scheduler and every
    group's tests were spread over both workers: each worker recomputed the module fixtures (``test_sharding``,
    ``test_train_memory``, ``test_mup``) and multi-device modules ran side by side. Where xdist's own suffix is
    missing, set it through the structured id (a no-op under older pytest, where xdist's works).
    """
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pragma: no cover - pytest < 9.2: xdist's own suffix works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        nodeid = item.nodeid
        if not names or nodeid.rfind("@") > nodeid.rfind("]"):
            continue
        if hasattr(item, "_id"):
            item._id = NodeId.parse(f"{nodeid}@{'_'.join(names)}")
