"""Query tiling shared by the attention references and the InfLLM v2 selection (arrays only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pad_axis", "query_tiles"]


def pad_axis(x: jax.Array, multiple: int, axis: int, value) -> jax.Array:
    """Pad ``axis`` of ``x`` at the end with ``value`` up to a multiple of ``multiple``."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def query_tiles(q: jax.Array, q_positions: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """Split queries into tiles along the sequence, tiles first (for ``lax.map``).

    Args:
        q: ``[batch, T, heads, head_dim]``.
        q_positions: int ``[batch, T]``.
        tile: tokens per tile (``T`` is padded up to a multiple; padded rows get position -1).

    Returns:
        ``(q_tiles [n_tiles, batch, tile, heads, head_dim], pos_tiles [n_tiles, batch, tile])`` int32 positions.
    """
    b, _, nq, d = q.shape
    qp = pad_axis(q, tile, 1, 0)
    pp = pad_axis(q_positions.astype(jnp.int32), tile, 1, -1)
    n = qp.shape[1] // tile
    return qp.reshape(b, n, tile, nq, d).swapaxes(0, 1), pp.reshape(b, n, tile).swapaxes(0, 1)
