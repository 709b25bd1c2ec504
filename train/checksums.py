"""Integrity checksums of a checkpoint's arrays: exact, and the same for any sharding of them.

orbax / TensorStore keep no checksum of the array data: bytes of a checkpoint that change after the save
(a failing disk, a bad copy) are restored silently as other values. :class:`~minicpm4_jax.train.checkpoint.
Checkpointer` therefore saves :func:`tree_checksums` of the state with every step (a small JSON item of the
same orbax step, so it is committed with the arrays or not at all) and every load recomputes them on the
restored arrays (:func:`verify_checksums`).

Per array, two 32-bit sums over its elements, ``i`` the flat row-major index in the *global* array and
``w_i`` the element's bit pattern as ``uint32`` (8/16-bit and bool dtypes widened, 64-bit ones split into
two words)::

    m_i = h(i) | 1
    a = sum_i  w_i * m_i       mod 2**32
    b = sum_i  h(w_i ^ m_i)    mod 2**32

with ``h`` the ``lowbias32`` integer hash (C. Wellons, "hash prospector"). Integer addition mod 2**32 is
associative and commutative, so the sums are bit-identical for any mesh, device count or process count:
each device sums its own shards under ``jax.jit`` and XLA adds the partial sums; no array is gathered onto
one host. ``a`` detects any change of one element (multiplying by an odd number is a bijection mod 2**32);
``b`` is non-linear in the data, so changes of several elements pass both only by chance (about 2**-64).

Cost: two hashes and a few integer operations per element, one jitted program per array shape (and
sharding). The 6.2M-parameter ``cpu_tiny`` train state (21M values with the Adam moments) on a 2-core CPU:
about 30 ms of computation, 50-100 ms added to a save or a resume, and about 1 s to compile once per
process (measured for the first save of a run and for ``load_params_for_inference`` in a fresh process).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["CHECKSUM_FORMAT", "ChecksumMismatch", "checksum_record", "leaf_name", "on_mesh_of", "tree_checksums",
           "verify_checksums"]

#: ``format`` of the saved checksum item (a change of the formula must change it).
CHECKSUM_FORMAT = "minicpm4-jax array checksums v1 (lowbias32, two uint32 sums)"


class ChecksumMismatch(ValueError):
    """A restored array does not match the checksum saved with it (its data changed after the save)."""


def on_mesh_of(fn: Any, tree: Any) -> Any:
    """``jax.jit(fn)`` whose outputs are replicated on the mesh of ``tree``'s first ``NamedSharding`` leaf
    (so every process can read them), or plainly jitted when no leaf has one."""
    mesh = next((x.sharding.mesh for x in jax.tree.leaves(tree)
                 if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)), None)
    return _jit_on(fn, mesh)


@functools.lru_cache(maxsize=16)
def _jit_on(fn: Any, mesh: Any) -> Any:
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def leaf_name(path: tuple[Any, ...]) -> str:
    """A dotted name of a pytree key path, e.g. ``params.layers.up_proj`` (an ``nnx.Variable``'s ``.value`` is
    left out)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _hash(h: jax.Array) -> jax.Array:
    """lowbias32: a bijective mixer of ``uint32`` values."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bit pattern of every element of ``x`` as ``uint32``: shape ``x.shape`` for dtypes of at most 32
    bits, ``[*x.shape, bits // 32]`` for wider ones."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jnp.dtype(x.dtype).itemsize * 8
    if bits < 32:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 64 bits: a trailing axis of 2 words


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """``uint32[*shape]``: each position's row-major flat index (mod 2**32)."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return idx


def _array_sums(x: jax.Array) -> jax.Array:
    """``uint32[2]``: the sums ``(a, b)`` of the module docs."""
    w = _words(x)
    m = _hash(_flat_index(w.shape)) | jnp.uint32(1)
    return jnp.stack([jnp.sum(w * m, dtype=jnp.uint32), jnp.sum(_hash(w ^ m), dtype=jnp.uint32)])


def tree_checksums(tree: Any) -> dict[str, str]:
    """The checksum of every array leaf of ``tree``: ``{leaf_name: 16 hex digits}``.

    Args:
        tree: a pytree of ``jax.Array`` (any sharding, also spanning processes), numpy
            arrays or scalars, e.g. ``{"step", "params", "opt_state"}`` of a train state.

    Returns:
        The same value for the same array contents whatever their sharding; every process gets it (a
        collective: call it on every process).
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [leaf_name(p) for p, _ in flat]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
    # one small program per array shape (cached), dispatched for all arrays before one transfer of the sums:
    # on CPU 3-4x faster than one program over the whole tree, and only one array's temporaries at a time
    sums = jax.device_get([on_mesh_of(_array_sums, x)(x) for x in leaves])
    return {n: f"{int(a):08x}{int(b):08x}" for n, (a, b) in zip(names, sums)}


def verify_checksums(tree: Any, saved: Any) -> None:
    """Check the array leaves of ``tree`` (a restored checkpoint item, possibly a part of the saved one)
    against ``saved``, the checksum item written with it.

    Raises:
        ChecksumMismatch: one line naming the first leaf whose values differ from the saved checksum (or
            that the item does not list), or saying that the item is not a checksum record.
    """
    arrays = saved.get("arrays") if isinstance(saved, dict) else None
    if not isinstance(arrays, dict) or saved.get("format") != CHECKSUM_FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ChecksumMismatch(f"its checksum item is not a record of format {CHECKSUM_FORMAT!r} (got {got!r})")
    for name, value in tree_checksums(tree).items():
        if name not in arrays:
            raise ChecksumMismatch(f"{name} has no checksum in the checksum item saved with it")
        if arrays[name] != value:
            raise ChecksumMismatch(f"{name} does not match the checksum saved with it: its data changed after the "
                                   "save")


def checksum_record(tree: Any, step: int | None = None) -> dict[str, Any]:
    """The JSON item saved with a checkpoint: ``{"format": CHECKSUM_FORMAT, "arrays": tree_checksums(tree)}``, and
    ``"step"``: the step number the checkpoint is saved as (a load compares it with the step folder it reads, so a
    moved or copied step folder is refused)."""
    out = {"format": CHECKSUM_FORMAT, "arrays": tree_checksums(tree)}
    if step is not None:
        out["step"] = int(step)
    return out
