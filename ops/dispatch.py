"""Which implementation runs: the Pallas kernels or the pure-XLA references (issue 4's "small dispatch").

``model.attention_impl``:

* ``xla``: the references of :mod:`minicpm4_jax.ops` on every backend.
* ``pallas``: the Pallas kernels of :mod:`minicpm4_jax.ops.pallas` -- Mosaic TPU kernels on TPU, the Triton
  lowering on NVIDIA GPUs, and the TPU kernels in Pallas's interpreter on CPU (exact, slow: for tests).
* ``auto``: the XLA references. The kernels are tested in interpret mode and cross-lowered for TPU and
  CUDA in CI but have not yet run on real accelerators in this version (``docs/benchmarks.md``); ``auto``
  will pick them once a hardware run has validated them.

Nothing TPU- or GPU-specific is imported here or at package import.
"""

from __future__ import annotations

import jax

from minicpm4_jax.config import ConfigError

__all__ = ["pallas_target", "resolve_impl"]


def resolve_impl(attention_impl: str) -> str:
    """``"xla"`` or ``"pallas"`` for a config's ``attention_impl`` (``auto`` -> ``xla``, see module docs)."""
    if attention_impl not in ("xla", "pallas", "auto"):
        raise ConfigError(f"model.attention_impl={attention_impl!r}; use 'xla', 'pallas' or 'auto'")
    return "pallas" if attention_impl == "pallas" else "xla"


def pallas_target() -> tuple[str, bool]:
    """``(backend, interpret)`` of the Pallas kernels on the default JAX backend.

    Returns:
        ``("tpu", False)`` on TPU, ``("triton", False)`` on an NVIDIA GPU, ``("tpu", True)`` on CPU (the TPU
        kernels in Pallas's interpreter).

    Raises:
        ConfigError: a backend without kernels (e.g. ROCm).
    """
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu", False
    if platform in ("gpu", "cuda"):
        kind = jax.devices()[0].device_kind
        if "nvidia" not in kind.lower() and not kind.upper().startswith(("H", "A", "B", "L", "T", "V")):
            raise ConfigError(f"model.attention_impl='pallas' has Triton kernels for NVIDIA GPUs only, not "
                              f"{kind!r}; use attention_impl='xla'")
        return "triton", False
    if platform == "cpu":
        return "tpu", True
    raise ConfigError(f"model.attention_impl='pallas' has no kernels for the {platform!r} backend; "
                      "use attention_impl='xla'")
