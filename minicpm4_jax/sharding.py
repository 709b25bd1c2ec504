"""Device mesh and logical-axis sharding rules for training (issue 5, first slice).

* :func:`make_mesh` builds the ``(data, fsdp, tensor)`` mesh from :class:`~minicpm4_jax.config.MeshConfig`
  (a size of ``-1`` takes the remaining devices).
* :data:`LOGICAL_RULES` is the one table mapping logical axis names to mesh axes. Parameters carry
  their logical names in the ``out_sharding`` metadata of their ``nnx.Param`` (see
  :func:`minicpm4_jax.nn.layers.param`; the layer stack prepends ``layers``).
* :func:`param_shardings`, :func:`state_shardings` and :func:`batch_sharding` turn them into
  ``NamedSharding`` trees for ``jax.jit`` in/out shardings.

Axis types: the mesh is built with ``AxisType.Auto`` on all three axes, on purpose. ``jax.make_mesh``
defaults to ``Explicit`` since jax 0.9, where shardings are part of the array types and every
ambiguous contraction needs an ``out_sharding=``; the model code does not (yet) annotate its
activations, so we let XLA/Shardy propagate shardings from the parameters and the batch. Because all
shardings go through :data:`LOGICAL_RULES`, moving to Explicit later is a local change.

A dimension whose size is not divisible by the product of its mesh axes is *replicated* instead of
failing (e.g. MiniCPM4's 2 KV heads on ``tensor=4``); batches, on the other hand, must divide
``data * fsdp`` (:func:`check_batch_size`).

Multi-host (``train/distributed.py`` starts the processes): every process builds the same global
mesh over ``jax.devices()``; :func:`process_batch_rows` says which rows of a global batch the
process's devices hold under the batch sharding, the data pipeline reads only those rows, and
:func:`make_global_batch` assembles the global ``jax.Array`` with
``jax.make_array_from_process_local_data`` (one process: the same call on the whole batch).

:func:`embedding_lookup` is the one model op laid out by hand (a ``shard_map`` with explicit collectives), because
the partitioner's layout of its backward replicated a tensor on ``data = 1`` meshes; the residual stream's sharding
constraints live in ``train/step.py`` (``activation_sharding``) and the kernels' ``shard_map`` in ``ops/dispatch.py``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from minicpm4_jax.config import ConfigError, MeshConfig

__all__ = ["MESH_AXES", "LOGICAL_RULES", "BATCH_AXES", "resolve_mesh_shape", "make_mesh", "logical_to_spec",
           "param_shardings", "state_shardings", "batch_sharding", "replicated", "check_batch_size", "check_vocab_size",
           "process_batch_rows", "make_global_batch", "embedding_lookup"]

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")

#: Logical axis name -> mesh axis (a name, a tuple of names, or ``None`` = replicated).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),  # replicated by logical_to_spec when num_key_value_heads % tensor != 0
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
)

BATCH_AXES: tuple[str, ...] = ("data", "fsdp")


def resolve_mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """The concrete ``(data, fsdp, tensor)`` sizes for ``n_devices`` devices.

    ``(1, 1, 1)`` (the default) always means one device, whatever the host has. Any other mesh must
    use all ``n_devices``; one size may be ``-1`` (filled with the remaining devices).

    Raises:
        ConfigError: sizes that do not multiply to ``n_devices`` (one line naming sizes and count).
    """
    sizes = (cfg.data, cfg.fsdp, cfg.tensor)
    if sizes == (1, 1, 1):
        return (1, 1, 1)
    if sum(1 for s in sizes if s == -1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh (data, fsdp, tensor)={sizes} invalid: give positive sizes and at most one -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ConfigError(f"mesh (data, fsdp, tensor)={sizes}: {n_devices} devices are not divisible by "
                              f"{known}; choose sizes whose product divides the device count")
        sizes = tuple(n_devices // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != n_devices:
        raise ConfigError(f"mesh (data, fsdp, tensor)={sizes} multiplies to {math.prod(sizes)} but there are "
                          f"{n_devices} devices; make the product equal the device count (or use -1 on one axis)")
    return sizes  # type: ignore[return-value]


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """The training mesh ``(data, fsdp, tensor)`` with ``AxisType.Auto`` axes (see the module docs).

    Args:
        cfg: sizes; ``None`` means the default single-device mesh.
        devices: the devices to use (default ``jax.devices()``); the ``(1, 1, 1)`` mesh takes the first.
    """
    cfg = cfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    devices = devices[: math.prod(shape)]
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _axis_sizes(mesh: Mesh | Mapping[str, int]) -> Mapping[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else mesh


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh | Mapping[str, int],
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> P:
    """The ``PartitionSpec`` of an array with logical axis ``names`` and ``shape`` on ``mesh``.

    First matching rule wins; a dimension not divisible by its mesh axes' size, a mesh axis of size
    1, or a mesh axis already used by an earlier dimension gives ``None`` (replicated) for that dim.

    Raises:
        ValueError: ``names`` and ``shape`` differ in length or a name has no rule.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    sizes = _axis_sizes(mesh)
    table = dict(rules)
    used: set[str] = set()
    out: list[Any] = []
    for name, dim in zip(names, shape):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"no sharding rule for logical axis {name!r}; add it to LOGICAL_RULES")
        target = table[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if sizes.get(a, 1) > 1 and a not in used)
        n = math.prod(sizes[a] for a in axes)
        if not axes or dim % n:
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    return P(*out)


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated ``NamedSharding`` on ``mesh``."""
    return NamedSharding(mesh, P())


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _logical_names(v: nnx.Variable) -> tuple[str, ...] | None:
    meta = v.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
    return tuple(names) if names is not None else None


def state_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """``NamedSharding`` tree for any pytree holding ``nnx.Variable`` s with logical names.

    Works for the params, the optimizer state (optax keeps the ``nnx.Param`` wrappers and their
    metadata on the moments, so they get the params' specs) and the whole ``TrainState``. Leaves
    outside such a Variable (step counters, scalars, the optimizer ``count``) are replicated.
    ``tree`` may hold arrays or ``jax.ShapeDtypeStruct`` s.
    """
    rep = replicated(mesh)

    def one(x: Any) -> Any:
        if _is_var(x):
            names = _logical_names(x)
            value = x.get_value() if hasattr(x, "get_value") else x.value
            if names is None or len(names) != len(getattr(value, "shape", ())):
                return x.replace(rep)
            return x.replace(NamedSharding(mesh, logical_to_spec(names, value.shape, mesh, rules)))
        return rep

    return jax.tree.map(one, tree, is_leaf=_is_var)


def param_shardings(params: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """``NamedSharding`` s of an ``nnx.State`` of Params (see :func:`state_shardings`)."""
    return state_shardings(params, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches ``[batch, seq]``: batch over ``(data, fsdp)``, sequence replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch", None), (_batch_multiple(mesh), 1), mesh))


def embedding_lookup(table: jax.Array, ids: jax.Array, mesh: Mesh, dtype: Any) -> jax.Array:
    """Rows ``table[ids]`` in ``dtype``, ``[batch, seq, hidden]`` batch-sharded over ``(data, fsdp)``, as one
    ``jax.shard_map`` over ``mesh`` with explicit collectives (forward and, by autodiff, backward).

    ``table`` ``[vocab, hidden]`` is laid out as the embedding parameter (:data:`LOGICAL_RULES`: ``vocab`` on
    ``tensor``, ``hidden`` on ``fsdp``), ``ids`` int ``[batch, seq]`` as a token batch. Per device: the ids of
    its ``fsdp`` group are all-gathered (int32, small), each ``tensor`` shard looks up the rows of its vocabulary
    range (zeros elsewhere; the sum over ``tensor`` completes them), and an all-to-all over ``fsdp`` trades the
    group's batch rows of the local ``hidden`` slice for the device's own batch rows of every slice. The
    backward is the transpose: an all-to-all of the cotangent, then a local scatter-add into the table's shard
    (summed over ``data`` replicas by ``shard_map``'s autodiff).

    Why not ``jnp.take`` under the partitioner: on meshes with ``data = 1`` and ``fsdp, tensor > 1`` Shardy
    cannot move the lookup's cotangent from the batch sharding to the table's ``hidden``-on-``fsdp`` sharding
    ("Involuntary full rematerialization": it all-reduces a zero-padded full-batch ``[batch, seq, hidden /
    fsdp]`` buffer instead; MiniCPM4-8B on a (1, 128, 2) mesh: docs/benchmarks.md).

    Falls back to ``jnp.take`` (XLA's partitioner) when the batch does not divide over ``data * fsdp``.
    """
    shards = _batch_multiple(mesh)
    if ids.ndim != 2 or ids.shape[0] % shards or mesh.size == 1:
        return jnp.take(table, ids, axis=0).astype(dtype)
    tspec = logical_to_spec(("vocab", "embed"), table.shape, mesh)
    vocab_axis, embed_axis = (tspec[i] if i < len(tspec) else None for i in range(2))
    bspec = batch_sharding(mesh).spec
    ids_spec = P(bspec[0] if len(bspec) else None, None)

    def local(tab: jax.Array, idx: jax.Array) -> jax.Array:
        if embed_axis is not None:  # the fsdp group's ids: [batch / data, seq]
            idx = jax.lax.all_gather(idx, embed_axis, axis=0, tiled=True)
        if vocab_axis is not None:
            n = tab.shape[0]
            rows = idx - jax.lax.axis_index(vocab_axis) * n
            hit = (rows >= 0) & (rows < n)
            x = jnp.take(tab, jnp.clip(rows, 0, n - 1), axis=0).astype(dtype)
            x = jax.lax.psum(jnp.where(hit[..., None], x, jnp.zeros((), dtype)), vocab_axis)
        else:
            x = jnp.take(tab, idx, axis=0).astype(dtype)
        if embed_axis is not None:  # [batch / data, seq, hidden / fsdp] -> [batch / (data fsdp), seq, hidden]
            x = jax.lax.all_to_all(x, embed_axis, 0, 2, tiled=True)
        return x

    return jax.shard_map(local, mesh=mesh, in_specs=(P(vocab_axis, embed_axis), ids_spec),
                         out_specs=P(*ids_spec, None))(table, ids)


def _batch_multiple(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_size(batch_size: int, mesh: Mesh, microbatches: int = 1) -> None:
    """Raise ConfigError unless ``batch_size`` divides over the mesh's ``data * fsdp`` devices, in each of
    ``microbatches`` microbatches (``gradient_accumulation_steps``)."""
    n = _batch_multiple(mesh)
    if batch_size % n:
        raise ConfigError(f"data.batch_size={batch_size} is not divisible by mesh data*fsdp={n}; "
                          f"use a multiple of {n}")
    if batch_size % (n * microbatches):
        raise ConfigError(f"data.batch_size={batch_size} does not split into gradient_accumulation_steps="
                          f"{microbatches} microbatches over mesh data*fsdp={n}; use a multiple of "
                          f"{n * microbatches} or fewer accumulation steps")


#: XLA flag under which XLA:CPU runs the train step with a replicated vocab axis (see :func:`check_vocab_size`).
CPU_SERIAL_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def check_vocab_size(padded_vocab_size: int, mesh: Mesh) -> None:
    """Raise ConfigError when the embedding's vocabulary rows do not divide over the ``tensor`` axis of a CPU mesh.

    :func:`logical_to_spec` replicates a non-divisible vocab axis. With that layout XLA:CPU's
    concurrency-optimized scheduler produced a train step whose fake devices waited in different collectives
    (cpu_tiny, MTP with ``mtp_detach`` and ``mtp_feature_weight``, ``model.vocab_size=1025`` on ``mesh.tensor=2``:
    hung, then aborted, in 6 of 6 runs; with ``XLA_FLAGS`` holding :data:`CPU_SERIAL_SCHEDULER_FLAG`, 3 of 3 ran).
    The flag is XLA:CPU's, so GPU and TPU meshes are not refused (untested there). Padding the rows
    (``model.vocab_pad_multiple``) keeps the vocab axis sharded and costs nothing; no export writes them.
    """
    t = int(dict(mesh.shape).get("tensor", 1))
    if (t > 1 and padded_vocab_size % t and mesh.devices.flat[0].platform == "cpu"
            and CPU_SERIAL_SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", "")):
        raise ConfigError(f"model.vocab_size={padded_vocab_size} (after model.vocab_pad_multiple) is not divisible "
                          f"by mesh.tensor={t}, which deadlocks XLA:CPU's scheduler; set model.vocab_pad_multiple to a "
                          f"multiple of {t} (e.g. {math.lcm(t, 128)}) or add {CPU_SERIAL_SCHEDULER_FLAG} to XLA_FLAGS")


def process_batch_rows(sharding: NamedSharding, batch_size: int) -> list[int]:
    """The rows of a global ``[batch_size, ...]`` batch that this process's devices hold, ascending.

    With the batch split over ``(data, fsdp)`` these are ``batch_size / process_count`` rows per
    process (a contiguous block when the mesh keeps each process's devices together, as
    ``jax.make_mesh`` does); a process whose devices replicate the batch axis holds all rows. This is
    what the data pipeline of this process must read, in this order, for :func:`make_global_batch`.
    """
    index_map = sharding.addressable_devices_indices_map((batch_size, 1))
    rows: set[int] = set()
    for idx in index_map.values():
        sl = idx[0] if idx else slice(None)
        rows.update(range(*sl.indices(batch_size)))
    return sorted(rows)


def make_global_batch(local: Any, sharding: NamedSharding, global_shape: Sequence[int]) -> jax.Array:
    """The global batch ``jax.Array`` from this process's rows (``local``: the rows of
    :func:`process_batch_rows` in that order, or the whole batch) via ``jax.make_array_from_process_local_data``.

    Raises:
        ValueError: ``local`` has neither this process's row count nor the global row count.
    """
    import numpy as np

    local = np.asarray(local)
    global_shape = tuple(int(d) for d in global_shape)
    rows = process_batch_rows(sharding, global_shape[0])
    if local.shape[0] == global_shape[0] and len(rows) != global_shape[0]:
        local = local[np.asarray(rows)]  # the whole batch was given: keep this process's rows
    if local.shape[0] != len(rows) or tuple(local.shape[1:]) != global_shape[1:]:
        raise ValueError(f"process {jax.process_index()} holds rows {rows[:4]}... ({len(rows)} rows) of the global "
                         f"batch {global_shape}, but its local batch has shape {local.shape}")
    return jax.make_array_from_process_local_data(sharding, local, global_shape)
