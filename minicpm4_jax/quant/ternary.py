"""Absmean ternary quantization of one weight matrix (BitCPM4, paper §3.3; spec ``export.md`` §5).

The math on arrays, independent of the model: scales, codes, the fake quantizer with its
straight-through estimator (STE), 2-bit packing, and NumPy checks used by the exporters.

**Layout.** Every function sees a weight as a (possibly batched) matrix in one of two
orientations: ``in_first`` ``[..., in, out]`` (this project's ``y = x @ W`` layout) or out-first
``[..., out, in]`` (the Hugging Face ``nn.Linear`` / ``nn.Embedding`` layout, also this project's
embedding table ``[vocab, hidden]``). A *row* is one output feature (one row of the HF tensor), a
*group* is ``group_size`` consecutive input columns of one row. Leading axes (the stacked layers)
are independent matrices.

**Quantizer** (BitNet b1.58 absmean, as BitCPM-CANN describes it, ``export.md`` §5)::

    s = max(mean(|W| over the scale group), eps)          # per tensor | per row | per group
    q = round(clip(W / s, -1, 1))  in {-1, 0, +1}           # round half to even
    W_q = q * s                                            # dequantization multiplies (fault B14)

``round(clip(x, -1, 1)) == clip(round(x), -1, 1)`` for every ``x``, so the *clamp range* is
``|W / s| <= 1``; its bounds are the weights with ``W / s == ±1`` exactly.

**STE** (:func:`fake_quant_ste`): the forward value is exactly ``q * s`` (a ``jax.custom_vjp``, so
no ``W + stop_gradient(W_q - W)`` rounding error leaks into the forward) and the gradient with
respect to ``W`` is

* ``ste="identity"`` (default): the identity everywhere, inside the clamp range, **on its bounds**
  and outside it (the plain STE of BitNet b1.58 / BitCPM-CANN). A clipped STE would stop the
  gradient of every weight with ``|W| > s``: for a Gaussian matrix that is about 42% of the
  weights, which then only move by weight decay.
* ``ste="clipped"``: the identity for ``|W / s| <= 1`` (**bounds included**) and 0 outside.

In both modes the scale is treated as a constant (no gradient flows through ``mean(|W|)``). A
gradient taken through ``jnp.clip``/``jnp.round`` directly would be 0 almost everywhere, and
``jnp.clip``'s gradient at ``x == ±1`` exactly is 0.5 (``minimum``/``maximum`` split ties), which
is the fault class the custom rule avoids.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minicpm4_jax.config import QAT_GRANULARITIES, QAT_STE_MODES

__all__ = [
    "GRANULARITIES",
    "STE_MODES",
    "EPS",
    "MatrixLayout",
    "ternary_codes",
    "dequantize",
    "fake_quant",
    "fake_quant_ste",
    "pack_codes",
    "unpack_codes",
    "packed_nbytes",
    "numpy_ternary",
    "recover_codes",
    "first_non_ternary_group",
]

#: scale granularities: one scale per matrix, per output row, or per ``group_size`` input columns of a row
GRANULARITIES = QAT_GRANULARITIES
#: STE gradient rules (see the module docstring)
STE_MODES = QAT_STE_MODES
#: lower bound of a scale (BitNet's clamp), so an all-zero group quantizes to zeros instead of NaN
EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """How to read one weight array as a batch of ``[in, out]`` / ``[out, in]`` matrices (hashable, static).

    Attributes:
        shape: the array's shape, e.g. ``(L, hidden, heads, head_dim)`` for a stacked ``q_proj``.
        n_lead: leading batch axes (1 for the stacked decoder layers, 0 for embedding / head).
        n_in: how many axes after the leading ones form the input features when ``in_first``
            (``o_proj`` ``[heads, head_dim, hidden]``: 2); for out-first arrays, how many trailing
            axes form the input features.
        in_first: ``True`` for ``[..., in, out]`` (``y = x @ W``), ``False`` for ``[..., out, in]``.
        granularity: ``per_tensor`` | ``per_row`` | ``per_group``.
        group_size: input columns per group (``per_group`` only; must divide ``in``).
        eps: the scale's lower bound.
        ste: ``identity`` | ``clipped`` (gradient rule of :func:`fake_quant_ste`).
    """

    shape: tuple[int, ...]
    n_lead: int
    n_in: int
    in_first: bool
    granularity: str = "per_row"
    group_size: int = 128
    eps: float = EPS
    ste: str = "identity"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r}; use one of {list(GRANULARITIES)}")
        if self.ste not in STE_MODES:
            raise ValueError(f"ste={self.ste!r}; use one of {list(STE_MODES)}")
        if self.granularity == "per_group" and (self.group_size <= 0 or self.in_features % self.group_size):
            raise ValueError(f"group_size={self.group_size} does not divide in_features={self.in_features}")

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.shape[: self.n_lead])

    @property
    def in_features(self) -> int:
        body = self.shape[self.n_lead:]
        dims = body[: self.n_in] if self.in_first else body[len(body) - self.n_in:]
        return int(math.prod(dims))

    @property
    def out_features(self) -> int:
        return int(math.prod(self.shape[self.n_lead:])) // self.in_features

    @property
    def groups(self) -> tuple[int, int]:
        """``(number of groups per row, group length)``; one group of ``in`` for per-row/per-tensor."""
        g = self.group_size if self.granularity == "per_group" else self.in_features
        return self.in_features // g, g

    @property
    def grouped_shape(self) -> tuple[int, ...]:
        """``lead + (G, g, out)`` (in-first) or ``lead + (out, G, g)`` (out-first)."""
        n_g, g = self.groups
        if self.in_first:
            return (*self.lead, n_g, g, self.out_features)
        return (*self.lead, self.out_features, n_g, g)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of the scales, broadcastable against :attr:`grouped_shape`.

        per_tensor ``lead + (1, 1, 1)``; per_row ``lead + (1, 1, out)`` / ``lead + (out, 1, 1)``;
        per_group ``lead + (G, 1, out)`` / ``lead + (out, G, 1)``.
        """
        n_g, _ = self.groups
        o = self.out_features
        if self.granularity == "per_tensor":
            return (*self.lead, 1, 1, 1)
        if self.in_first:
            return (*self.lead, n_g, 1, o)
        return (*self.lead, o, n_g, 1)

    def _axes(self) -> tuple[int, ...]:
        """Axes of :attr:`grouped_shape` averaged into one scale."""
        if self.granularity == "per_tensor":
            return (-3, -2, -1)
        return (-2,) if self.in_first else (-1,)


def _grouped_f32(w: jax.Array, layout: MatrixLayout) -> jax.Array:
    if tuple(w.shape) != tuple(layout.shape):
        raise ValueError(f"array shape {tuple(w.shape)} != layout shape {layout.shape}")
    return jnp.asarray(w).astype(jnp.float32).reshape(layout.grouped_shape)


def _scale_and_ratio(w: jax.Array, layout: MatrixLayout) -> tuple[jax.Array, jax.Array]:
    xg = _grouped_f32(w, layout)
    s = jnp.maximum(jnp.mean(jnp.abs(xg), axis=layout._axes(), keepdims=True), jnp.float32(layout.eps))
    return s, xg / s


def ternary_codes(w: jax.Array, layout: MatrixLayout) -> tuple[jax.Array, jax.Array]:
    """Absmean ternary codes and scales of ``w``.

    Args:
        w: float array of ``layout.shape`` (any float dtype; the math runs in float32).
        layout: how ``w`` reads as matrices and which scale granularity to use.

    Returns:
        ``(codes, scale)``: ``codes`` int8 ``layout.shape`` in ``{-1, 0, 1}``; ``scale`` float32
        ``layout.scale_shape`` = ``max(mean|W|, eps)`` over each scale group.

    Raises:
        ValueError: ``w.shape`` differs from ``layout.shape``.
    """
    s, x = _scale_and_ratio(w, layout)
    q = jnp.round(jnp.clip(x, -1.0, 1.0))
    return q.astype(jnp.int8).reshape(layout.shape), s


def dequantize(codes: jax.Array, scale: jax.Array, layout: MatrixLayout, dtype: Any = jnp.float32) -> jax.Array:
    """``codes * scale`` (a **multiplication**, never a division: fault B14) in ``layout.shape``.

    Args:
        codes: integer or float ``layout.shape`` in ``{-1, 0, 1}``.
        scale: float32 ``layout.scale_shape``.
        dtype: output dtype (the product is formed in float32 and then cast).
    """
    q = jnp.asarray(codes).astype(jnp.float32).reshape(layout.grouped_shape)
    return (q * scale).reshape(layout.shape).astype(dtype)


def fake_quant(w: jax.Array, layout: MatrixLayout) -> jax.Array:
    """``W_q = q * s`` in ``w``'s dtype, no gradient rule (inference, export): ``dequantize(*ternary_codes(w))``."""
    codes, s = ternary_codes(w, layout)
    return dequantize(codes, s, layout, w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quant_ste(w: jax.Array, layout: MatrixLayout) -> jax.Array:
    """The training fake quantizer: forward exactly :func:`fake_quant`, gradient by ``layout.ste``.

    ``identity``: ``dL/dW = dL/dW_q`` for every weight (bounds ``W/s == ±1`` included).
    ``clipped``: ``dL/dW = dL/dW_q`` where ``|W/s| <= 1`` (inclusive) and 0 elsewhere. The scale gets
    no gradient in either mode. Shapes and dtypes as :func:`fake_quant`.
    """
    return fake_quant(w, layout)


def _ste_fwd(w: jax.Array, layout: MatrixLayout) -> tuple[jax.Array, Any]:
    s, x = _scale_and_ratio(w, layout)
    q = jnp.round(jnp.clip(x, -1.0, 1.0))
    wq = (q * s).reshape(layout.shape).astype(w.dtype)
    if layout.ste == "clipped":
        return wq, (jnp.abs(x) <= 1.0).reshape(layout.shape)
    return wq, None


def _ste_bwd(layout: MatrixLayout, inside: Any, g: jax.Array) -> tuple[jax.Array]:
    if inside is None:
        return (g,)
    return (jnp.where(inside, g, jnp.zeros_like(g)),)


fake_quant_ste.defvjp(_ste_fwd, _ste_bwd)


# ------------------------------------------------------------------------------------------------
# 2-bit packing
# ------------------------------------------------------------------------------------------------


def packed_nbytes(n: int) -> int:
    """Bytes of ``n`` packed ternary codes (4 per byte)."""
    return (n + 3) // 4


def pack_codes(codes: jax.Array) -> jax.Array:
    """Pack ternary codes 4 per byte: uint8 ``[ceil(n/4)]`` of the flattened ``codes``.

    Code ``c`` in ``{-1, 0, 1}`` is stored as ``c + 1`` in 2 bits; element ``4k + j`` sits at bits
    ``2j..2j+1`` of byte ``k`` (as GGUF TQ2_0 orders the 4 values of a byte). The tail is padded
    with code 0.
    """
    u = (jnp.asarray(codes).reshape(-1).astype(jnp.int32) + 1).astype(jnp.uint8)
    n = u.shape[0]
    u = jnp.pad(u, (0, packed_nbytes(n) * 4 - n), constant_values=1).reshape(-1, 4)
    return u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)


def unpack_codes(packed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`pack_codes`: int8 codes of ``shape`` in ``{-1, 0, 1}`` (jittable)."""
    n = int(math.prod(shape))
    shifts = jnp.asarray([0, 2, 4, 6], jnp.uint8)
    u = (packed[:, None] >> shifts[None, :]) & jnp.uint8(3)
    return (u.reshape(-1)[:n].astype(jnp.int8) - jnp.int8(1)).reshape(shape)


# ------------------------------------------------------------------------------------------------
# NumPy: reference and checks on exported tensors ([out, in], HF layout)
# ------------------------------------------------------------------------------------------------


def _np_groups(w_out_in: np.ndarray, granularity: str, group_size: int) -> np.ndarray:
    """``[out, in]`` -> ``[n_scale_groups, elements]``, one row per scale group."""
    w = np.asarray(w_out_in)
    if w.ndim != 2:
        raise ValueError(f"expected an [out, in] matrix, got shape {w.shape}")
    out, inn = w.shape
    if granularity == "per_tensor":
        return w.reshape(1, -1)
    if granularity == "per_row":
        return w
    if granularity == "per_group":
        if group_size <= 0 or inn % group_size:
            raise ValueError(f"group_size={group_size} does not divide in_features={inn}")
        return w.reshape(out * (inn // group_size), group_size)
    raise ValueError(f"granularity={granularity!r}; use one of {list(GRANULARITIES)}")


def numpy_ternary(w_out_in: np.ndarray, granularity: str, group_size: int = 128,
                  eps: float = EPS) -> tuple[np.ndarray, np.ndarray]:
    """Independent NumPy absmean quantizer on an HF-layout ``[out, in]`` matrix (float64 math).

    Returns:
        ``(codes int8 [out, in], scales float64 [n_scale_groups])`` with scale groups in row-major
        order (per_tensor: 1; per_row: ``out``; per_group: ``out * in / group_size``).
    """
    g = _np_groups(np.asarray(w_out_in, np.float64), granularity, group_size)
    s = np.maximum(np.abs(g).mean(axis=1), eps)
    q = np.clip(np.round(g / s[:, None]), -1, 1).astype(np.int8)
    return q.reshape(np.shape(w_out_in)), s


def recover_codes(w_out_in: np.ndarray, granularity: str, group_size: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of an already ternary ``[out, in]`` matrix (e.g. a fake-quant export).

    The scale of a group is its largest magnitude (``max|W|``, 0 for an all-zero group) and the
    codes are ``sign(W)``, so ``recover_codes(dequantize(q, s)) == (q, s)`` exactly wherever the
    group holds a nonzero code: the quantize -> dequantize -> quantize round trip is idempotent
    (fault B14). Use :func:`first_non_ternary_group` first to check the input is ternary.

    Returns:
        ``(codes int8 [out, in], scales [n_scale_groups] in the input dtype)``.
    """
    g = _np_groups(w_out_in, granularity, group_size)
    s = np.abs(g).max(axis=1)
    return np.sign(w_out_in).astype(np.int8), s


def first_non_ternary_group(w_out_in: np.ndarray, granularity: str, group_size: int = 128) -> str | None:
    """``None`` if every scale group of ``[out, in]`` ``w`` holds at most one magnitude (≤ 3 values
    ``{-s, 0, s}``), else a short description of the first group that does not (row, columns, how
    many distinct magnitudes). Exact comparisons: it checks stored values, not a tolerance."""
    w = np.asarray(w_out_in)
    g = np.abs(_np_groups(w, granularity, group_size))
    m = g.max(axis=1, keepdims=True)
    bad = ~((g == m) | (g == 0)).all(axis=1)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    levels = len(np.unique(g[i][g[i] != 0]))
    if granularity == "per_tensor":
        where = "the tensor"
    elif granularity == "per_row":
        where = f"row {i}"
    else:
        per_row = w.shape[1] // group_size
        r, c = divmod(i, per_row)
        where = f"row {r}, columns {c * group_size}..{(c + 1) * group_size - 1}"
    return f"{where} holds {levels} distinct nonzero magnitudes"
