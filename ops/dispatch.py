"""Which implementation runs: the Pallas kernels or the pure-XLA references (issue 4's "small dispatch").

``model.attention_impl``:

* ``xla``: the references of :mod:`minicpm4_jax.ops` on every backend (dense attention materialises its
  ``[batch, heads, T, T]`` scores: the oracle).
* ``pallas``: the Pallas kernels of :mod:`minicpm4_jax.ops.pallas` -- Mosaic TPU kernels on TPU, the Triton
  lowering on NVIDIA GPUs, and the TPU kernels in Pallas's interpreter on CPU (exact, slow: for tests).
* ``auto``: dense attention (the model's, the MTP layer's and InfLLM v2's dense fallback) by blocks with its own
  backward on every backend (:func:`~minicpm4_jax.ops.flash_xla.flash_attention`: memory linear in the length;
  faster than the reference on the 2-core CPU at every measured length); InfLLM v2 by the XLA references,
  except on the CPU backend in float32 when the native CPU kernel of
  :mod:`minicpm4_jax.ops.native` builds (:func:`native_decode`): the decode attention of the KV cache, and the
  non-forced picks of InfLLM v2's stage 2 in prefill and training forwards
  (:func:`minicpm4_jax.infllm.attention.native_stage2`, :func:`sparse_impl`; the backward stays XLA's).
  The Pallas kernels are tested in interpret mode and cross-lowered for TPU and CUDA in CI; the Triton
  kernels passed every correctness check compiled on an H200 (2026-11-29, ``docs/benchmarks.md``), the TPU
  kernels have not run on a TPU. ``auto`` stays on XLA for them until a hardware run times the XLA references
  against the kernels on the same machine (the H200 runs timed the kernels against cuDNN dense attention,
  not against the XLA sparse path).

Nothing TPU- or GPU-specific is imported here or at package import.
"""

from __future__ import annotations

import jax

from minicpm4_jax.config import ConfigError

__all__ = ["native_decode", "on_mesh", "pallas_target", "resolve_impl", "sparse_impl"]


def resolve_impl(attention_impl: str) -> str:
    """``"xla"`` or ``"pallas"`` for a config's ``attention_impl`` (``auto`` -> ``xla``, see module docs)."""
    if attention_impl not in ("xla", "pallas", "auto"):
        raise ConfigError(f"model.attention_impl={attention_impl!r}; use 'xla', 'pallas' or 'auto'")
    return "pallas" if attention_impl == "pallas" else "xla"


def native_decode(attention_impl: str, cache_dtype) -> bool:
    """Whether decode steps use the native CPU kernel (:mod:`minicpm4_jax.ops.native`) instead of the XLA
    reference: ``attention_impl="auto"``, the CPU backend, a float32 cache, and the kernel builds (it is
    compiled at the first call; ``MINICPM4_JAX_NATIVE=0`` (or ``false``/``no``/``off``) turns it off). On the
    2-core CPU of ``docs/benchmarks.md`` ("Decode") a sparse decode step of the tiny model at 32K took ~4.5 ms
    against 10.5 ms with the XLA references."""
    if attention_impl != "auto" or jax.default_backend() != "cpu" or jax.numpy.dtype(cache_dtype) != "float32":
        return False
    from minicpm4_jax.ops import native  # noqa: PLC0415 (compiles on first use)

    return native.available()


def sparse_impl(attention_impl: str, dtype) -> str:
    """The ``impl`` of :func:`~minicpm4_jax.infllm.attention.infllmv2_attention` for a config's
    ``attention_impl`` and the compute dtype: ``"pallas"``, ``"native"`` (``auto`` on the CPU backend in
    float32 when the native kernel builds, :func:`native_decode`'s rule) or ``"xla"``. On the 2-core CPU of
    ``docs/benchmarks.md`` one 8B-layout sparse attention layer's forward at 32K tokens took 20-22 s this way,
    2.06-2.20x faster than a tile-skipping dense attention (58.5 s with the XLA stage 2 before)."""
    impl = resolve_impl(attention_impl)
    if impl == "xla" and native_decode(attention_impl, dtype):
        return "native"
    return impl


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


def on_mesh(fn, args: tuple, layouts: tuple[str | None, ...], out_layout: str):
    """Call a single-device function (a ``pallas_call``) on every device's shard of the current mesh.

    Without a mesh in context (``jax.set_mesh``; the train step sets one) or on one device this is
    ``fn(*args)``. Otherwise ``fn`` runs under ``jax.shard_map`` with the batch split over the mesh's ``data``
    and ``fsdp`` axes and heads over ``tensor`` (spec ``jax_stack.md`` §2.4: a ``pallas_call`` is a
    single-device program). Query and KV heads split contiguously, so each query head's KV head lies on
    the same device. An axis whose size a mesh axis does not divide stays whole (replicated: correct, only
    redundant).

    Args:
        fn: ``fn(*args) -> array``.
        args: arrays (``None`` entries are passed through unsharded).
        layouts: one string per argument, one character per dimension: ``b`` batch, ``h`` heads, ``.``
            unsharded (e.g. ``"b.h."`` for ``[batch, T, heads, head_dim]``); ignored for ``None`` args.
        out_layout: the output's layout string.
    """
    import math

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*args)
    sizes = dict(mesh.shape)
    batch_axes = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
    n_batch = math.prod(sizes[a] for a in batch_axes)
    t = sizes.get("tensor", 1)
    live = [(a, lay) for a, lay in zip(args, layouts) if a is not None]
    b_ok = bool(batch_axes) and all(a.shape[lay.index("b")] % n_batch == 0 for a, lay in live if "b" in lay)
    h_ok = t > 1 and all(a.shape[lay.index("h")] % t == 0 for a, lay in live if "h" in lay)
    axis = {"b": batch_axes if b_ok else None, "h": "tensor" if h_ok else None, ".": None}
    spec = lambda lay: jax.sharding.PartitionSpec(*(axis[c] for c in lay))  # noqa: E731
    # A zero-sized argument (e.g. gen-2's coarse keys when T is shorter than one coarse kernel) stays out of
    # the shard_map and is rebuilt, with its per-device shape, inside: with jax/jaxlib 0.11.2 a jitted
    # shard_map with a zero-sized operand segfaults in XLA's compiler (seen on XLA:CPU with 2 and 8 fake
    # devices, in the Shardy step of SPMD partitioning); jax 0.12.0.1 compiles it.
    idx = [i for i, a in enumerate(args) if a is not None and a.size > 0]
    split = {"b": n_batch if b_ok else 1, "h": t if h_ok else 1, ".": 1}
    empty = {i: (tuple(n // split[c] for n, c in zip(a.shape, layouts[i])), a.dtype)
             for i, a in enumerate(args) if a is not None and a.size == 0}

    def body(*shards):
        full = list(args)
        for i, x in zip(idx, shards):
            full[i] = x
        for i, (shape, dtype) in empty.items():
            full[i] = jax.numpy.zeros(shape, dtype)
        return fn(*full)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(spec(layouts[i]) for i in idx),
                         out_specs=spec(out_layout), check_vma=False)(*(args[i] for i in idx))
