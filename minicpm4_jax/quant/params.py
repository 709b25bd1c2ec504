"""Ternary quantization of a MiniCPM4 parameter tree (BitCPM4, paper §3.3; spec ``export.md`` §5).

Which parameters are ternary and how each one reads as a matrix, in one table
(:data:`TERNARY_TABLE`), and transforms of a whole parameter tree built on it. A tree is an
``nnx.State`` of Params (training, inference) or a flat ``{'/'-path: array}`` dict (export); the
transforms map over its leaves and leave every other parameter untouched. The model itself is
never edited: the caller quantizes the state and then ``nnx.merge``-s it.

* :func:`fake_quant_params`: ``W -> q * s`` for every ternary weight (``ste=True``: with the
  straight-through gradient of :func:`~minicpm4_jax.quant.ternary.fake_quant_ste`, for the loss
  of a QAT step);
* :func:`pack_params` / :func:`unpack_params`: 2-bit packed storage (codes 4 per byte plus float32
  scales) and its on-the-fly inverse, which gives exactly the fake-quant values;
* :func:`ternary_stats`: per layer and matrix, the fraction of zero codes and the mean scale;
* :func:`ternary_spec` / :func:`checkpoint_is_ternary`: what a training config says.

Which weights: the attention and MLP projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``), plus the embedding table with ``quantize_embeddings``
and the untied head with ``quantize_lm_head``. Norms stay high precision. Rows and groups are those
of the exported Hugging Face ``[out, in]`` tensors, so a per-row scale here is a per-row scale of
``model.layers.{i}.self_attn.q_proj.weight`` (and of the GGUF rows, whose 256-element blocks run
along ``in``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minicpm4_jax.config import ModelConfig, QATConfig, TrainConfig
from minicpm4_jax.train.optim import _key_name  # one reading of NNX key paths for optimizer groups and QAT
from minicpm4_jax.quant.ternary import (
    EPS,
    MatrixLayout,
    dequantize,
    fake_quant,
    fake_quant_ste,
    pack_codes,
    ternary_codes,
    unpack_codes,
)

__all__ = [
    "TERNARY_TABLE",
    "TernarySpec",
    "PackedTernary",
    "ternary_spec",
    "checkpoint_is_ternary",
    "ternary_paths",
    "ternary_hf_names",
    "layout_of",
    "fake_quant_params",
    "ternarize",
    "pack_params",
    "unpack_params",
    "ternary_stats",
]


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One ternary-capable parameter: how our array reads as matrices.

    ``in_first``/``n_in`` as in :class:`~minicpm4_jax.quant.ternary.MatrixLayout`; ``stacked``: it
    carries the leading ``[num_hidden_layers]`` axis.
    """

    path: str
    hf: str
    in_first: bool
    n_in: int
    stacked: bool
    kind: str  # "linear" | "embedding" | "head"


#: Every parameter that can be ternary (our '/'-path, official HF name, layout). Our layouts:
#: ``q/k/v_proj`` ``[L, hidden, heads, head_dim]`` (in = hidden), ``o_proj`` ``[L, heads, head_dim,
#: hidden]`` (in = heads*head_dim), ``gate/up_proj`` ``[L, hidden, inter]``, ``down_proj`` ``[L, inter,
#: hidden]``, ``lm_head`` ``[hidden, vocab]``: all ``y = x @ W`` (in first); the embedding
#: ``[vocab, hidden]`` is out-first (a row per token, as HF's ``embed_tokens``/``lm_head``).
TERNARY_TABLE: tuple[_Entry, ...] = (
    _Entry("layers/q_proj", "model.layers.{i}.self_attn.q_proj.weight", True, 1, True, "linear"),
    _Entry("layers/k_proj", "model.layers.{i}.self_attn.k_proj.weight", True, 1, True, "linear"),
    _Entry("layers/v_proj", "model.layers.{i}.self_attn.v_proj.weight", True, 1, True, "linear"),
    _Entry("layers/o_proj", "model.layers.{i}.self_attn.o_proj.weight", True, 2, True, "linear"),
    _Entry("layers/gate_proj", "model.layers.{i}.mlp.gate_proj.weight", True, 1, True, "linear"),
    _Entry("layers/up_proj", "model.layers.{i}.mlp.up_proj.weight", True, 1, True, "linear"),
    _Entry("layers/down_proj", "model.layers.{i}.mlp.down_proj.weight", True, 1, True, "linear"),
    _Entry("embed_tokens/embedding", "model.embed_tokens.weight", False, 1, False, "embedding"),
    _Entry("lm_head", "lm_head.weight", True, 1, False, "head"),
)
_BY_PATH = {e.path: e for e in TERNARY_TABLE}


@dataclasses.dataclass(frozen=True)
class TernarySpec:
    """The quantization settings that decide the weights (hashable; from ``train.qat``).

    Attributes:
        granularity: ``per_tensor`` | ``per_row`` | ``per_group``.
        group_size: input columns per group (``per_group``).
        quantize_embeddings: the embedding table is ternary too (with a tied head: the head as well).
        quantize_lm_head: the untied ``lm_head`` is ternary.
        ste: gradient rule in training (``identity`` | ``clipped``).
        eps: lower bound of a scale.
    """

    granularity: str = "per_row"
    group_size: int = 128
    quantize_embeddings: bool = False
    quantize_lm_head: bool = False
    ste: str = "identity"
    eps: float = EPS

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (recorded in export manifests and training summaries)."""
        out = {"scheme": "ternary absmean (BitCPM4 / BitNet b1.58): W = q * s, q in {-1, 0, 1}, "
                         "s = mean|W| over the scale group",
               "granularity": self.granularity, "quantize_embeddings": self.quantize_embeddings,
               "quantize_lm_head": self.quantize_lm_head, "eps": self.eps}
        if self.granularity == "per_group":
            out["group_size"] = self.group_size
        return out


def ternary_spec(qat: QATConfig) -> TernarySpec:
    """The :class:`TernarySpec` of a ``train.qat`` section."""
    return TernarySpec(granularity=qat.granularity, group_size=qat.group_size,
                       quantize_embeddings=qat.quantize_embeddings, quantize_lm_head=qat.quantize_lm_head,
                       ste=qat.ste)


def checkpoint_is_ternary(cfg: TrainConfig, step: int | None) -> bool:
    """Whether a checkpoint saved at ``step`` by a run with config ``cfg`` holds a ternary model.

    True when the run trained with ``qat.enabled`` and at least one QAT update is in the checkpoint:
    ``step > TrainConfig.qat_start_step`` (``step`` ``None`` counts as the end of the run). A
    checkpoint at the switch step itself is the high-precision model QAT started from. The
    checkpoint stores the latent float weights; the ternary model is :func:`ternarize` of them.
    """
    start = cfg.qat_start_step
    if start is None:
        return False
    return step is None or int(step) > start


def ternary_paths(model_cfg: ModelConfig, spec: TernarySpec) -> list[str]:
    """Our '/'-paths of the ternary parameters for ``model_cfg`` and ``spec``, in table order."""
    out = []
    for e in TERNARY_TABLE:
        if e.kind == "embedding" and not spec.quantize_embeddings:
            continue
        if e.kind == "head" and (model_cfg.tie_word_embeddings or not spec.quantize_lm_head):
            continue
        out.append(e.path)
    return out


def ternary_hf_names(model_cfg: ModelConfig, spec: TernarySpec, layout: str = "minicpm") -> dict[str, str]:
    """``{Hugging Face tensor name: our path}`` of the ternary tensors of an export.

    ``layout`` ``"minicpm"`` (official, unfolded) or ``"llama"`` (μP folded: ``lm_head.weight`` is
    always written; it is ternary when the table it is folded from is).
    """
    out: dict[str, str] = {}
    for p in ternary_paths(model_cfg, spec):
        e = _BY_PATH[p]
        if e.stacked:
            for i in range(model_cfg.num_hidden_layers):
                out[e.hf.format(i=i)] = p
        else:
            out[e.hf] = p
    if layout == "llama" and model_cfg.tie_word_embeddings and spec.quantize_embeddings:
        out["lm_head.weight"] = "embed_tokens/embedding"
    return out


def layout_of(path: str, shape: tuple[int, ...], spec: TernarySpec) -> MatrixLayout:
    """The :class:`MatrixLayout` of our parameter ``path`` with array ``shape`` under ``spec``.

    Raises:
        KeyError: ``path`` is not in :data:`TERNARY_TABLE`.
    """
    e = _BY_PATH[path]
    return MatrixLayout(shape=tuple(int(s) for s in shape), n_lead=1 if e.stacked else 0, n_in=e.n_in,
                        in_first=e.in_first, granularity=spec.granularity, group_size=spec.group_size,
                        eps=spec.eps, ste=spec.ste)


def _path_of(keypath: tuple[Any, ...]) -> str:
    names = [n for n in (_key_name(k) for k in keypath) if n is not None and n != "value"]
    return "/".join(names)


def _is_flat(params: Any) -> bool:
    """A flat ``{'/'-path: array}`` dict (the exporters' form), not a nested tree / ``nnx.State``."""
    return (isinstance(params, dict) and bool(params)
            and all(isinstance(k, str) and not isinstance(v, Mapping) for k, v in params.items()))


def _map(fn, params: Any, model_cfg: ModelConfig, spec: TernarySpec, **kw) -> Any:
    """Apply ``fn(array, layout)`` to the ternary leaves of ``params`` (a tree or a flat '/'-dict)."""
    chosen = set(ternary_paths(model_cfg, spec))
    if _is_flat(params):
        return {k: (fn(v, layout_of(k, np.shape(v), spec), **kw) if k in chosen else v) for k, v in params.items()}

    def leaf(keypath, x):
        p = _path_of(keypath)
        return fn(x, layout_of(p, np.shape(x), spec), **kw) if p in chosen else x

    return jax.tree_util.tree_map_with_path(leaf, params)


def fake_quant_params(params: Any, model_cfg: ModelConfig, spec: TernarySpec, *, ste: bool = False) -> Any:
    """``params`` with every ternary weight replaced by ``q * s`` (same structure, shapes, dtypes).

    Args:
        params: an ``nnx.State`` of the model's Params or a flat ``{'/'-path: array}`` dict.
        model_cfg: the model (decides tied heads).
        spec: the quantization settings.
        ste: use :func:`~minicpm4_jax.quant.ternary.fake_quant_ste` (the QAT loss: gradient by
            ``spec.ste``); otherwise the plain forward (no gradient rule).

    Source: paper §3.3 (weights-only ternary QAT), ``export.md`` §5 (absmean scales).
    """
    return _map(fake_quant_ste if ste else fake_quant, params, model_cfg, spec)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _codes_jit(params: Any, model_cfg: ModelConfig, spec: TernarySpec) -> Any:
    """``params`` with every ternary leaf replaced by its ``(codes, scale)`` (the one place scales are computed)."""
    return _map(lambda w, lay: ternary_codes(w, lay), params, model_cfg, spec)


def _with_codes(fn, params: Any, model_cfg: ModelConfig, spec: TernarySpec) -> Any:
    """Replace every ternary leaf ``w`` of ``params`` by ``fn((codes, scale), layout, dtype name)``."""
    codes = _codes_jit(params, model_cfg, spec)
    chosen = set(ternary_paths(model_cfg, spec))
    if _is_flat(params):
        return {k: (fn(codes[k], layout_of(k, np.shape(v), spec), str(np.asarray(v).dtype)) if k in chosen else v)
                for k, v in params.items()}

    def leaf(keypath, c, x):
        p = _path_of(keypath)
        return fn(c, layout_of(p, np.shape(x), spec), str(x.dtype)) if p in chosen else x

    return jax.tree_util.tree_map_with_path(leaf, codes, params,
                                            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dequantize_leaf(pair: tuple[jax.Array, jax.Array], layout: MatrixLayout, dtype: str) -> jax.Array:
    return dequantize(pair[0], pair[1], layout, jnp.dtype(dtype))


def ternarize(params: Any, model_cfg: ModelConfig, spec: TernarySpec) -> Any:
    """The ternary model of latent weights, for inference: every ternary weight replaced by ``q * s``.

    Same values as ``fake_quant_params(params, ..., ste=False)``, computed as codes and scales
    (jitted, the computation :func:`pack_params` uses too) times each other, an exact product, so
    evaluation, ``generate``, export and packed inference all see bit-identical weights. A flat dict
    of NumPy arrays comes back as a flat dict of NumPy arrays.
    """
    out = _with_codes(_dequantize_leaf, params, model_cfg, spec)
    if isinstance(params, dict) and all(isinstance(v, np.ndarray) for v in params.values()):
        return {k: np.asarray(v) for k, v in out.items()}
    return out


# ------------------------------------------------------------------------------------------------
# packed storage
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedTernary:
    """A ternary weight in 2-bit storage (a pytree: ``packed`` and ``scale`` are its leaves).

    Attributes:
        packed: uint8 ``[ceil(n/4)]``, codes 4 per byte (:func:`~minicpm4_jax.quant.ternary.pack_codes`).
        scale: float32 ``layout.scale_shape``.
        layout: the static :class:`~minicpm4_jax.quant.ternary.MatrixLayout` (shape, granularity).
        dtype: name of the dtype the weight unpacks to.
    """

    packed: jax.Array
    scale: jax.Array
    layout: MatrixLayout
    dtype: str

    def unpack(self) -> jax.Array:
        """The fake-quant weight ``codes * scale`` (``layout.shape``, ``dtype``); jittable."""
        codes = unpack_codes(self.packed, self.layout.shape)
        return dequantize(codes, self.scale, self.layout, jnp.dtype(self.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus scales."""
        return int(self.packed.size) + 4 * int(np.prod(self.scale.shape))


jax.tree_util.register_dataclass(PackedTernary, data_fields=["packed", "scale"], meta_fields=["layout", "dtype"])


def pack_params(params: Any, model_cfg: ModelConfig, spec: TernarySpec) -> Any:
    """``params`` with every ternary weight replaced by a :class:`PackedTernary` (latent weights in).

    The codes and scales are those of :func:`ternarize`, so ``unpack_params(pack_params(p)) ==
    ternarize(p)`` bit for bit. Works on an ``nnx.State`` (the Variables then hold ``PackedTernary``
    values) or a flat '/'-dict.
    """

    def pack(pair, layout, dtype):
        c, s = pair
        return PackedTernary(packed=pack_codes(c), scale=s, layout=layout, dtype=dtype)

    return _with_codes(pack, params, model_cfg, spec)


def unpack_params(packed: Any) -> Any:
    """Inverse of :func:`pack_params`: every :class:`PackedTernary` replaced by its fake-quant weight.

    Jittable: call it inside the jitted forward (``nnx.merge(graphdef, unpack_params(p))``) to keep
    the weights in 2-bit storage between calls and unpack them on the fly.
    """
    return jax.tree.map(lambda x: x.unpack() if isinstance(x, PackedTernary) else x, packed,
                        is_leaf=lambda x: isinstance(x, PackedTernary))


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------


def _one_stats(x: jax.Array, lay: MatrixLayout) -> dict[str, jax.Array]:
    codes, s = ternary_codes(x, lay)
    return {"zero_fraction": jnp.mean((codes == 0).astype(jnp.float32), axis=tuple(range(lay.n_lead, codes.ndim))),
            "scale_mean": jnp.mean(s, axis=tuple(range(lay.n_lead, s.ndim)))}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _stats_jit(params: Any, model_cfg: ModelConfig, spec: TernarySpec) -> dict[str, dict[str, jax.Array]]:
    chosen = set(ternary_paths(model_cfg, spec))
    if _is_flat(params):
        return {k: _one_stats(v, layout_of(k, np.shape(v), spec)) for k, v in params.items() if k in chosen}
    out: dict[str, dict[str, jax.Array]] = {}
    for keypath, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        p = _path_of(keypath)
        if p in chosen:
            out[p] = _one_stats(x, layout_of(p, np.shape(x), spec))
    return out


def ternary_stats(params: Any, model_cfg: ModelConfig, spec: TernarySpec) -> dict[str, dict[str, np.ndarray]]:
    """Per ternary weight: ``{"zero_fraction", "scale_mean"}`` as float arrays ``[L]`` (stacked) or ``[]``.

    ``zero_fraction``: the share of codes that are 0; ``scale_mean``: the mean of the scales of one
    layer's matrix (its only scale for per_tensor). Computed from the latent weights (jitted).
    """
    got = _stats_jit(params, model_cfg, spec)
    return {k: {n: np.asarray(v) for n, v in d.items()} for k, d in got.items()}
