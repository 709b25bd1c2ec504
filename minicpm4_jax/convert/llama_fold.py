"""MiniCPM4 <-> "Llama-folded" Hugging Face layout (spec ``export.md`` §1.3, ``minicpm4_model.md`` §2, §6).

MiniCPM is a Llama with three μP scalars (spec §3.1). Folding them into the weights gives a plain
``LlamaForCausalLM`` that computes the same logits with no MiniCPM code:

* ``model.embed_tokens.weight = E * scale_emb``
* ``o_proj`` and ``down_proj`` ``* scale_depth / sqrt(num_hidden_layers)`` (each residual branch ends
  in exactly one of them)
* ``lm_head.weight = (E or lm_head)ᵀ / (hidden_size / dim_model_base)``, always emitted: the folded
  head differs from the folded embedding, so the Llama is untied even when our head is tied
* norms, q/k/v, gate and up unchanged (only transposed to ``nn.Linear`` layout ``[out, in]``)

Each multiplier is applied exactly once (field fault B10): the Llama config carries none of
``scale_emb``/``scale_depth``/``dim_model_base``, so a runtime cannot apply them a second time.

One table, :data:`LLAMA_PARAM_MAP`, names every tensor on both sides; :func:`fold_to_llama` and
:func:`unfold_from_llama` both walk it. Our per-layer parameters are stacked with a leading
``[num_hidden_layers]`` axis (see ``minicpm4_jax/nn/model.py``); HF names carry the layer index.

The arithmetic runs in float64 and is rounded once to float32, so e.g. the folded embedding is
bit-identical to the float32 product ``E * scale_emb``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from minicpm4_jax.config import ModelConfig

__all__ = [
    "ParamMap",
    "LLAMA_PARAM_MAP",
    "flat_params",
    "fold_to_llama",
    "unfold_from_llama",
    "llama_config",
    "hf_param_shapes",
]


@dataclass(frozen=True)
class ParamMap:
    """One row of the mapping table.

    Attributes:
        hf: Hugging Face Llama tensor name; ``{i}`` marks a per-layer tensor (layer index).
        ours: '/'-joined NNX path of our parameter (per-layer ones are stacked ``[L, ...]``).
        kind: the transform (see :func:`_to_hf` / :func:`_from_hf`):
            ``embed`` ``[V, H]`` × scale_emb; ``norm`` ``[H]`` unchanged; ``qkv`` ``[H, n, d]`` ->
            ``[n*d, H]``; ``o`` ``[n, d, H]`` -> ``[H, n*d]`` × residual scale; ``in_out``
            ``[H, F]`` -> ``[F, H]``; ``down`` ``[F, H]`` -> ``[H, F]`` × residual scale; ``head``
            ``[H, V]`` (or the tied ``[V, H]`` embedding) -> ``[V, H]`` ÷ width_mult.
    """

    hf: str
    ours: str
    kind: str

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


#: The single name/transform table between our NNX parameters and HF ``LlamaForCausalLM``.
LLAMA_PARAM_MAP: tuple[ParamMap, ...] = (
    ParamMap("model.embed_tokens.weight", "embed_tokens/embedding", "embed"),
    ParamMap("model.layers.{i}.input_layernorm.weight", "layers/input_layernorm", "norm"),
    ParamMap("model.layers.{i}.self_attn.q_proj.weight", "layers/q_proj", "qkv"),
    ParamMap("model.layers.{i}.self_attn.k_proj.weight", "layers/k_proj", "qkv"),
    ParamMap("model.layers.{i}.self_attn.v_proj.weight", "layers/v_proj", "qkv"),
    ParamMap("model.layers.{i}.self_attn.o_proj.weight", "layers/o_proj", "o"),
    ParamMap("model.layers.{i}.post_attention_layernorm.weight", "layers/post_attention_layernorm", "norm"),
    ParamMap("model.layers.{i}.mlp.gate_proj.weight", "layers/gate_proj", "in_out"),
    ParamMap("model.layers.{i}.mlp.up_proj.weight", "layers/up_proj", "in_out"),
    ParamMap("model.layers.{i}.mlp.down_proj.weight", "layers/down_proj", "down"),
    ParamMap("model.norm.weight", "norm", "norm"),
    ParamMap("lm_head.weight", "lm_head", "head"),
)

_TIED_HEAD_SOURCE = "embed_tokens/embedding"


# ------------------------------------------------------------------------------------------------
# parameters -> flat numpy dict
# ------------------------------------------------------------------------------------------------


def _leaf_value(v: Any) -> Any:
    """The array inside an nnx Variable (or the value itself)."""
    if hasattr(v, "get_value"):
        return v.get_value()
    if hasattr(v, "value"):
        return v.value
    return v


def flat_params(model_or_state: Any) -> dict[str, np.ndarray]:
    """Our parameters as ``{'/'-joined path: np.ndarray}`` (e.g. ``layers/q_proj`` ``[L, H, n, d]``).

    Accepts an ``nnx.Module`` (its ``nnx.Param`` state is taken), an ``nnx.State``, a nested dict
    of arrays / Variables (e.g. ``state.to_pure_dict()``) or an already flat ``'/'``-keyed dict.
    Arrays keep their dtype (device arrays are copied to host).
    """
    from flax import nnx  # local: keep this module importable for the numpy-only paths

    obj = model_or_state
    if isinstance(obj, nnx.Module):
        obj = nnx.state(obj, nnx.Param)
    if isinstance(obj, nnx.State):
        return {"/".join(str(k) for k in path): np.asarray(_leaf_value(v)) for path, v in nnx.to_flat_state(obj)}
    if isinstance(obj, Mapping):
        out: dict[str, np.ndarray] = {}

        def walk(d: Mapping, prefix: str) -> None:
            for k, v in d.items():
                key = f"{prefix}/{k}" if prefix else str(k)
                if isinstance(v, Mapping) and not hasattr(v, "shape"):
                    walk(v, key)
                else:
                    out[key] = np.asarray(_leaf_value(v))

        walk(obj, "")
        return out
    raise TypeError(f"flat_params: expected an nnx.Module, nnx.State or dict, got {type(obj).__name__}")


# ------------------------------------------------------------------------------------------------
# transforms
# ------------------------------------------------------------------------------------------------


def _to_hf(kind: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Our (one-layer) tensor -> HF tensor, μP scalars folded; float64 math, one float32 rounding."""
    w = np.asarray(w, dtype=np.float64)
    if kind == "embed":
        out = w * float(cfg.scale_emb)
    elif kind == "norm":
        out = w
    elif kind == "qkv":
        h, n, d = w.shape
        out = w.reshape(h, n * d).T
    elif kind == "o":
        n, d, h = w.shape
        out = w.reshape(n * d, h).T * cfg.residual_scale
    elif kind == "in_out":
        out = w.T
    elif kind == "down":
        out = w.T * cfg.residual_scale
    elif kind == "head":  # ours untied lm_head [H, V]
        out = w.T / cfg.width_mult
    elif kind == "head_tied":  # the embedding [V, H]
        out = w / cfg.width_mult
    else:  # pragma: no cover - table typo
        raise ValueError(f"unknown transform kind {kind!r}")
    return np.ascontiguousarray(out.astype(np.float32))


def _from_hf(kind: str, w: np.ndarray, cfg: ModelConfig, n_heads: int) -> np.ndarray:
    """HF tensor -> our (one-layer) tensor, μP scalars divided back out (inverse of :func:`_to_hf`)."""
    w = np.asarray(w, dtype=np.float64)
    d = cfg.resolved_head_dim
    if kind == "embed":
        out = w / float(cfg.scale_emb)
    elif kind == "norm":
        out = w
    elif kind == "qkv":
        out = w.T.reshape(w.shape[1], n_heads, d)
    elif kind == "o":
        out = (w.T / cfg.residual_scale).reshape(n_heads, d, w.shape[0])
    elif kind == "in_out":
        out = w.T
    elif kind == "down":
        out = w.T / cfg.residual_scale
    elif kind == "head":
        out = w.T * cfg.width_mult
    else:  # pragma: no cover
        raise ValueError(f"unknown transform kind {kind!r}")
    return np.ascontiguousarray(out.astype(np.float32))


def _heads_for(row: ParamMap, cfg: ModelConfig) -> int:
    return cfg.num_attention_heads if row.ours.endswith(("q_proj", "o_proj")) else cfg.num_key_value_heads


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected HF Llama tensor names and shapes for ``cfg`` (the folded export; ``lm_head`` always)."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kd = cfg.num_attention_heads * cfg.resolved_head_dim, cfg.num_key_value_heads * cfg.resolved_head_dim
    per = {
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "self_attn.q_proj": (qd, h), "self_attn.k_proj": (kd, h), "self_attn.v_proj": (kd, h),
        "self_attn.o_proj": (h, qd), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
    }
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        for k, s in per.items():
            out[f"model.layers.{i}.{k}.weight"] = s
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------


def llama_config(cfg: ModelConfig, *, explicit_attention_factor: bool = True) -> dict[str, Any]:
    """The ``config.json`` dict of the folded ``LlamaForCausalLM``.

    LongRoPE: ``rope_scaling`` keeps ``rope_type: longrope``, both factor lists (where they differ, the one this
    model uses written as both: transformers switches lists by sequence length, this model does not; see
    :func:`~minicpm4_jax.nn.rope.dynamic_runtime_factor_lists`) and
    ``original_max_position_embeddings`` (also repeated at top level, where transformers 4.x reads
    it and where transformers 5 gives it priority: same value). ``factor`` is
    ``max_position_embeddings / original_max_position_embeddings``, never a bare 1.0 (export.md
    §1.3: a 1.0 would force the attention scaling to 1 above the original length). With
    ``explicit_attention_factor`` the magnitude scaling ``sqrt(1 + ln(max/orig)/ln(orig))`` (1.0 when
    ``max <= orig``) is written as ``attention_factor`` so every runtime uses our value; without it
    transformers derives the same number from ``factor`` itself (the parity test checks both).

    Deliberately absent: ``scale_emb``, ``scale_depth``, ``dim_model_base`` (already folded) and
    ``sparse_config`` (the folded export is dense attention only).
    """
    from minicpm4_jax.nn.rope import attention_scaling, dynamic_runtime_factor_lists

    eos = list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0]
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    rs = cfg.rope_scaling
    if rs is not None:
        orig = rs.original_max_position_embeddings
        short, long_, _ = dynamic_runtime_factor_lists(cfg)
        scaling: dict[str, Any] = {
            "rope_type": rs.rope_type,
            "short_factor": list(short),
            "long_factor": list(long_),
            "original_max_position_embeddings": orig,
            "factor": cfg.max_position_embeddings / orig,
        }
        if explicit_attention_factor:
            scaling["attention_factor"] = attention_scaling(cfg)
        out["rope_scaling"] = scaling
        out["original_max_position_embeddings"] = orig
    return out


# ------------------------------------------------------------------------------------------------
# fold / unfold
# ------------------------------------------------------------------------------------------------


def fold_to_llama(
    params_state_or_dict: Any, cfg: ModelConfig, *, explicit_attention_factor: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Fold the μP scalars into the weights of a ``LlamaForCausalLM`` with the same logits.

    Args:
        params_state_or_dict: our parameters (anything :func:`flat_params` accepts).
        cfg: the model config the parameters belong to.
        explicit_attention_factor: see :func:`llama_config`.

    Returns:
        ``(tensors, hf_config)``: HF-named contiguous float32 arrays (``lm_head.weight`` always
        present) and the Llama ``config.json`` dict.

    Raises:
        KeyError: a parameter the table needs is missing; ValueError: a shape does not match ``cfg``.
    """
    flat = flat_params(params_state_or_dict)
    tensors: dict[str, np.ndarray] = {}
    for row in LLAMA_PARAM_MAP:
        kind, src = row.kind, row.ours
        if row.kind == "head" and cfg.tie_word_embeddings:
            kind, src = "head_tied", _TIED_HEAD_SOURCE
        if src not in flat:
            raise KeyError(f"parameter {src!r} is missing (have {sorted(flat)})")
        w = flat[src]
        if row.per_layer:
            if w.shape[0] != cfg.num_hidden_layers:
                raise ValueError(f"{src}: leading axis {w.shape[0]} != num_hidden_layers {cfg.num_hidden_layers}")
            for i in range(cfg.num_hidden_layers):
                tensors[row.hf.format(i=i)] = _to_hf(kind, w[i], cfg)
        else:
            tensors[row.hf] = _to_hf(kind, w, cfg)
    expected = hf_param_shapes(cfg)
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(f"{name}: folded shape {tensors[name].shape} != expected {shape} for this config")
    return tensors, llama_config(cfg, explicit_attention_factor=explicit_attention_factor)


def unfold_from_llama(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of :func:`fold_to_llama`: HF Llama tensors -> our flat ``'/'``-keyed float32 params.

    With ``cfg.tie_word_embeddings`` the embedding comes from ``model.embed_tokens.weight`` and the
    (redundant) ``lm_head.weight`` is ignored. Layer tensors are stacked on a leading ``[L]`` axis.
    """
    out: dict[str, np.ndarray] = {}
    for row in LLAMA_PARAM_MAP:
        if row.kind == "head" and cfg.tie_word_embeddings:
            continue
        n = _heads_for(row, cfg)
        if row.per_layer:
            out[row.ours] = np.stack(
                [_from_hf(row.kind, tensors[row.hf.format(i=i)], cfg, n) for i in range(cfg.num_hidden_layers)]
            )
        else:
            out[row.ours] = _from_hf(row.kind, tensors[row.hf], cfg, n)
    return out

