"""The official MiniCPM4 Hugging Face layout (``MiniCPMForCausalLM``): names, shapes, config, checks.

Spec ``minicpm4_model.md`` §6 (weight names and shapes) and ``export.md`` §1.2 (what the openbmb
repositories ship). The official names are exactly the Llama names of
:data:`~minicpm4_jax.convert.llama_fold.LLAMA_PARAM_MAP` (the one name table of this package), with
two differences from the Llama-folded export: the weights are **not** folded (the runtime applies
``scale_emb``, ``scale_depth/sqrt(L)`` and ``1/(hidden/dim_model_base)``), and ``lm_head.weight`` is
absent when the head is tied (as in MiniCPM4-0.5B).

Every transform here is a pure relayout (reshape + transpose, no arithmetic), so a float32 export
and its import are bit-identical, and a bfloat16 export of parameters that already hold bfloat16
values is too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ModelConfig
from minicpm4_jax.convert.io import check_float16_range
from minicpm4_jax.convert.llama_fold import LLAMA_PARAM_MAP, ParamMap

__all__ = [
    "official_param_shapes",
    "official_tensor_names",
    "to_official",
    "from_official",
    "iter_official_tensors",
    "official_config",
    "sparse_runtime_warnings",
    "head_dim_warnings",
    "OFFICIAL_SPARSE_KEYS",
]

#: keys of the official ``sparse_config`` block (spec ``minicpm4_model.md`` §1.3)
OFFICIAL_SPARSE_KEYS = ("kernel_size", "kernel_stride", "init_blocks", "block_size", "window_size", "topk",
                        "use_nope", "dense_len")


def _rows(cfg: ModelConfig) -> list[ParamMap]:
    return [r for r in LLAMA_PARAM_MAP if not (r.kind == "head" and cfg.tie_word_embeddings)]


def official_tensor_names(cfg: ModelConfig) -> list[str]:
    """The official tensor names for ``cfg`` in a fixed order (embedding, layer 0..L-1, norm, head)."""
    out: list[str] = []
    rows = _rows(cfg)
    out += [r.hf for r in rows if not r.per_layer and r.kind == "embed"]
    for i in range(cfg.num_hidden_layers):
        out += [r.hf.format(i=i) for r in rows if r.per_layer]
    out += [r.hf for r in rows if not r.per_layer and r.kind != "embed"]
    return out


def official_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{official name: torch shape [out, in]}`` for ``cfg`` (spec §6; no ``lm_head`` when tied).

    For the released 0.5B config this is the 0.5B column of spec table §6 (``embed_tokens``
    ``[73448, 1024]``, ``k_proj`` ``[128, 1024]``, ...); for the 8B, the 8B column.
    """
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd = cfg.num_attention_heads * cfg.resolved_head_dim
    kd = cfg.num_key_value_heads * cfg.resolved_head_dim
    per = {
        "input_layernorm": (h,), "self_attn.q_proj": (qd, h), "self_attn.k_proj": (kd, h),
        "self_attn.v_proj": (kd, h), "self_attn.o_proj": (h, qd), "post_attention_layernorm": (h,),
        "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
    }
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        for k, s in per.items():
            out[f"model.layers.{i}.{k}.weight"] = s
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


# ------------------------------------------------------------------------------------------------
# relayout (no arithmetic)
# ------------------------------------------------------------------------------------------------


def _ours_to_hf(kind: str, w: np.ndarray) -> np.ndarray:
    """One layer's tensor, our layout -> torch ``[out, in]`` layout (dtype kept)."""
    if kind in ("embed", "norm"):
        return w
    if kind == "qkv":  # [H, n, d] -> [n*d, H]
        return w.reshape(w.shape[0], -1).T
    if kind == "o":  # [n, d, H] -> [H, n*d]
        return w.reshape(-1, w.shape[-1]).T
    if kind in ("in_out", "down", "head"):  # [in, out] -> [out, in]
        return w.T
    raise ValueError(f"unknown transform kind {kind!r}")  # pragma: no cover - table typo


def _hf_to_ours(kind: str, w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Inverse of :func:`_ours_to_hf` for one layer."""
    if kind in ("embed", "norm"):
        return w
    if kind == "qkv":  # [n*d, H] -> [H, n, d]
        return w.T.reshape(w.shape[1], n_heads, head_dim)
    if kind == "o":  # [H, n*d] -> [n, d, H]
        return w.T.reshape(n_heads, head_dim, w.shape[0])
    if kind in ("in_out", "down", "head"):
        return w.T
    raise ValueError(f"unknown transform kind {kind!r}")  # pragma: no cover


def _heads(row: ParamMap, cfg: ModelConfig) -> int:
    return cfg.num_attention_heads if row.ours.endswith(("q_proj", "o_proj")) else cfg.num_key_value_heads


def iter_official_tensors(flat: Mapping[str, Any], cfg: ModelConfig, dtype: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(official name, C-contiguous array)`` one tensor at a time, in :func:`official_tensor_names` order.

    Args:
        flat: our parameters as ``{'/'-joined path: array}`` (see ``llama_fold.flat_params``);
            per-layer ones stacked ``[L, ...]``. Device arrays are copied to host one layer at a time.
        cfg: their model config.
        dtype: numpy dtype of the output (``np.float32``, ``np.float16``, ``ml_dtypes.bfloat16``);
            ``None`` keeps the parameter dtype. Casting rounds to nearest even.

    Raises:
        KeyError: a parameter the layout needs is missing from ``flat``.
        ConvertError: a tensor overflows float16 (``dtype`` float16).
    """
    by_name = {}
    for row in _rows(cfg):
        if row.ours not in flat:
            raise KeyError(f"parameter {row.ours!r} is missing (have {sorted(flat)})")
        by_name[row.hf] = row

    def conv(name: str, row: ParamMap, w: Any) -> np.ndarray:
        a = _ours_to_hf(row.kind, np.asarray(w))
        if dtype is not None:
            if np.dtype(dtype) == np.float16:
                check_float16_range(a, name, "--dtype float16")
            a = a.astype(dtype)
        return np.ascontiguousarray(a)

    for name in official_tensor_names(cfg):
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            row = by_name[name.replace(f"model.layers.{i}.", "model.layers.{i}.", 1)]
            yield name, conv(name, row, flat[row.ours][i])
        else:
            row = by_name[name]
            yield name, conv(name, row, flat[row.ours])


def to_official(flat: Mapping[str, Any], cfg: ModelConfig, dtype: Any = None) -> dict[str, np.ndarray]:
    """All official tensors as a dict (see :func:`iter_official_tensors`; holds a second copy in memory)."""
    return dict(iter_official_tensors(flat, cfg, dtype))


def from_official(get: Callable[[str], np.ndarray], cfg: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Our flat params (``'/'``-keyed, per-layer stacked ``[L, ...]``) from official tensors.

    Args:
        get: returns the official tensor of a name (e.g. a dict's ``__getitem__`` or a lazy file reader).
        cfg: the model config.
        dtype: output dtype (float32: the project's parameter dtype; exact for f32/f16/bf16 inputs).
    """
    out: dict[str, np.ndarray] = {}
    d = cfg.resolved_head_dim
    for row in _rows(cfg):
        n = _heads(row, cfg)
        if row.per_layer:
            first = _hf_to_ours(row.kind, get(row.hf.format(i=0)), n, d)
            arr = np.empty((cfg.num_hidden_layers, *first.shape), dtype)
            arr[0] = first
            for i in range(1, cfg.num_hidden_layers):
                arr[i] = _hf_to_ours(row.kind, get(row.hf.format(i=i)), n, d)
            out[row.ours] = arr
        else:
            out[row.ours] = np.ascontiguousarray(_hf_to_ours(row.kind, get(row.hf), n, d).astype(dtype))
    return out


def layer_slice_reader(cfg: ModelConfig, row: ParamMap, get: Callable[[str], np.ndarray],
                       dtype: Any = np.float32) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """A callback ``index -> np.ndarray`` producing the part ``index`` of our param ``row.ours``.

    Reads only the official tensors of the layers inside ``index`` (one at a time), so a device
    shard is built without materialising the whole stacked parameter: the shape of
    ``jax.make_array_from_callback``'s data callback.
    """
    d = cfg.resolved_head_dim
    n = _heads(row, cfg)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not row.per_layer:
            return np.ascontiguousarray(_hf_to_ours(row.kind, get(row.hf), n, d)[index].astype(dtype))
        layers = range(cfg.num_hidden_layers)[index[0]] if index else range(cfg.num_hidden_layers)
        rest = tuple(index[1:])
        out = None
        for j, i in enumerate(layers):  # fill in place: one source tensor at a time, no list + stack copy
            part = _hf_to_ours(row.kind, get(row.hf.format(i=i)), n, d)[rest]
            if out is None:
                out = np.empty((len(layers), *part.shape), dtype)
            out[j] = part
        return out

    return read


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------


def official_config(cfg: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of the official layout (``MiniCPMForCausalLM``, ``model_type`` ``minicpm``).

    Built from ``ModelConfig.to_hf_config``: the three μP scalars, ``tie_word_embeddings``, LongRoPE
    ``rope_scaling`` with ``rope_type``/``short_factor``/``long_factor``/
    ``original_max_position_embeddings`` and never a ``factor`` key (export.md §1.3: an added
    ``"factor": 1.0`` changes transformers' attention scaling), ``sparse_config`` when the model
    was trained sparse (the official keys plus this project's ``variant`` / ``kernel_offby1_quirk``,
    which official readers ignore and ``import hf`` reads back). ``torch_dtype`` names the stored dtype. No
    ``auto_map`` here: :func:`~minicpm4_jax.convert.hf_export.write_hf` adds it (:data:`REMOTE_CODE_AUTO_MAP`) with
    the project's own ``configuration_minicpm.py`` / ``modeling_minicpm.py``, which ``AutoConfig`` (CPM.cu) and
    ``AutoModelForCausalLM`` need with ``trust_remote_code=True``; llama.cpp's converter reads the keys directly.
    """
    out = cfg.to_hf_config()
    out["torch_dtype"] = dtype_name
    rs = out.get("rope_scaling")
    if rs is not None:
        rs.pop("factor", None)
    return out


#: ``config.json``'s ``auto_map`` of an official-layout export: the classes of the files in ``remote_code/``
#: (the release's class names, so loaders that name them keep working)
REMOTE_CODE_AUTO_MAP = {
    "AutoConfig": "configuration_minicpm.MiniCPMConfig",
    "AutoModel": "modeling_minicpm.MiniCPMModel",
    "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM",
}
#: the project's own remote-code files shipped with an official-layout export (package data)
REMOTE_CODE_FILES = ("configuration_minicpm.py", "modeling_minicpm.py")


def remote_code_dir() -> Path:
    """The folder holding :data:`REMOTE_CODE_FILES` (``minicpm4_jax/convert/remote_code``)."""
    return Path(__file__).resolve().parent / "remote_code"


def head_dim_warnings(cfg: ModelConfig) -> list[str]:
    """Why official readers of the MiniCPM layout cannot load this model's attention shapes (empty: they can).

    OpenBMB's ``modeling_minicpm.py`` and CPM.cu take the head width as ``hidden_size // num_attention_heads`` (the
    released configs have no ``head_dim`` key), and llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/minicpm.py``)
    checks the LongRoPE lists against that width (``ValueError: The length of rope long and short factors must
    be ...``; seen with llama-cpp-python 0.3.36's converter). The folder's own ``modeling_minicpm.py`` reads
    ``head_dim`` and ``minicpm4 export gguf`` writes it as the GGUF key length, which llama.cpp itself reads.
    """
    implied = cfg.hidden_size // cfg.num_attention_heads
    if cfg.resolved_head_dim == implied and cfg.hidden_size % cfg.num_attention_heads == 0:
        return []
    return [f"head_dim {cfg.resolved_head_dim} is not hidden_size/num_attention_heads ({cfg.hidden_size}/"
            f"{cfg.num_attention_heads}): OpenBMB's modeling_minicpm.py, CPM.cu and llama.cpp's convert_hf_to_gguf.py "
            "assume that width and cannot load this folder (this folder's own remote code and --layout llama read "
            "head_dim; for llama.cpp use `minicpm4 export gguf`)"]


def sparse_runtime_warnings(cfg: ModelConfig) -> list[str]:
    """Why the official sparse runtimes cannot run this model's ``sparse_config`` (empty: they can).

    The official InfLLM v2 CUDA kernels (HF remote code, CPM.cu) hard-code GQA groups of 16 query
    heads, head_dim 128, kernel_size 32 / kernel_stride 16 and block_size 64 (spec
    ``minicpm4_model.md`` §0, §1.3, §5). A model outside that envelope still exports (the weights are
    dense-compatible), but those runtimes will fail or fall back to dense attention.
    """
    if cfg.attention != "infllmv2" or cfg.sparse_config is None:
        return []
    s = cfg.sparse_config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    out = []
    if group != 16:
        out.append(f"GQA group size {group} (num_attention_heads/num_key_value_heads) is not 16: the official "
                   "InfLLM v2 kernels (CPM.cu, HF remote code) only run groups of 16; they will run this model dense")
    if cfg.resolved_head_dim != 128:
        out.append(f"head_dim {cfg.resolved_head_dim} is not 128: the official InfLLM v2 kernels only support 128")
    if (s.kernel_size, s.kernel_stride) != (32, 16):
        out.append(f"sparse_config kernel_size/kernel_stride {s.kernel_size}/{s.kernel_stride} are not 32/16, "
                   "the only values the official stage-1 kernel supports")
    if s.block_size != 64:
        out.append(f"sparse_config block_size {s.block_size} is not 64, the only value the official kernels support")
    if s.variant != "gen2":
        out.append(f"sparse_config variant {s.variant!r}: the released MiniCPM4.1 code runs gen2; the key is ignored "
                   "by official readers")
    return out
