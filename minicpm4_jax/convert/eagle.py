"""The MTP module as an EAGLE draft folder: ``minicpm4 export eagle`` and ``minicpm4 import hf --eagle``.

The released MiniCPM4 speculative heads (``openbmb/MiniCPM4-8B-Eagle-FRSpec``, spec ``minicpm4_model.md``
§7, ``export.md`` §3 "EAGLE/MTP draft") are separate Hugging Face folders that CPM.cu loads next to the
base model with ``--draft-model-path``. Our :class:`~minicpm4_jax.nn.mtp.MTPHead` has exactly their
structure, so it exports as one:

* ``config.json``: the base model's official config with ``num_hidden_layers = 1`` (CPM.cu's
  ``EagleConfig`` reads it as the number of draft layers) and ``head_dim`` always written (CPM.cu reads
  ``head_dim`` from the draft config); ``scale_emb``, ``scale_depth`` and ``dim_model_base`` equal to the
  base model's (CPM.cu asserts presence and equality); ``mup_denominator = L_base + 1`` so that readers
  using vLLM's rule (residual × scale_depth/√mup_denominator) get the same residual scale as CPM.cu's
  scale_depth/√(L_base + 1); no ``sparse_config`` (the draft layer attends densely).
* ``model.safetensors`` (one file: CPM.cu's loader takes exactly one ``*.safetensors`` or an index):

  ===============================  =============  ====================================================
  name                             torch shape    ours
  ===============================  =============  ====================================================
  ``fc.weight``                    ``[H, 2H]``    ``mtp/fc`` ``[2H, H]`` transposed; columns ``[:H]``
                                                  act on the normalised embedding (CPM.cu's ``fc1``),
                                                  ``[H:]`` on the normalised hidden state (``fc2``)
  ``input_norm1.weight``           ``[H]``        ``mtp/input_norm1`` (embedding side)
  ``input_norm2.weight``           ``[H]``        ``mtp/input_norm2`` (hidden-state side)
  ``layers.0.<decoder name>``      as the base    ``mtp/layer/<param>`` (the names of the base layers
                                                  without the ``model.`` prefix)
  ===============================  =============  ====================================================

  No ``embed_tokens`` / ``lm_head``: the draft shares the base model's (CPM.cu skips ``embed_tokens`` in a
  draft folder and uses the base ``lm_head``, restricted to the FR-Spec rows when ``--frspec-path`` is given).

Every transform is a pure relayout, so a float32 export and its import are bit-identical.

Not written: vLLM's layout of the same head (``model.fc.weight``, ``model.eagle_layers.N.*``, repository
``openbmb/MiniCPM4-8B-Eagle-vLLM``), EAGLE-3 heads (``d2t``, ``midlayer.*``), and a quantized draft
(``fc.qweight``/``fc.scales``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ModelConfig
from minicpm4_jax.convert.io import (
    ConvertError,
    SafetensorsSource,
    check_disk_space,
    check_float16_range,
    check_output_target,
    quantization_method,
    refuse_output_over_source,
    staged_output,
    write_manifest,
    write_safetensors_shards,
)
from minicpm4_jax.convert.llama_fold import LLAMA_PARAM_MAP
from minicpm4_jax.convert.official import _hf_to_ours, _ours_to_hf, official_config, official_param_shapes

__all__ = [
    "EAGLE_FORMAT",
    "eagle_tensor_map",
    "eagle_param_shapes",
    "eagle_config",
    "iter_eagle_tensors",
    "write_eagle",
    "export_eagle",
    "read_eagle",
]

#: manifest ``format`` of an exported draft folder
EAGLE_FORMAT = "eagle-minicpm4"

#: the μP scalars CPM.cu requires to be present in the draft config and equal to the base model's
_SHARED_SCALARS = ("scale_emb", "scale_depth", "dim_model_base")
#: structural keys the draft layer must share with the base model (our MTP layer is a base decoder layer)
_SHARED_SHAPES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
#: tensor dtypes a draft imports from (as ``import hf``)
_DTYPES_OK = ("F32", "F16", "BF16")


def eagle_tensor_map() -> list[tuple[str, str, str]]:
    """``[(draft tensor name, our '/'-path, transform kind)]`` in file order (module docstring table)."""
    out = [("fc.weight", "mtp/fc", "in_out"),
           ("input_norm1.weight", "mtp/input_norm1", "norm"),
           ("input_norm2.weight", "mtp/input_norm2", "norm")]
    for row in LLAMA_PARAM_MAP:
        if row.per_layer:
            sub = row.hf.removeprefix("model.layers.{i}.")
            out.append((f"layers.0.{sub}", "mtp/layer/" + row.ours.removeprefix("layers/"), row.kind))
    return out


def _heads(ours: str, cfg: ModelConfig) -> int:
    return cfg.num_attention_heads if ours.endswith(("q_proj", "o_proj")) else cfg.num_key_value_heads


def eagle_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{draft tensor name: torch shape [out, in]}`` for the base config ``cfg`` (the base layer's shapes)."""
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"fc.weight": (h, 2 * h), "input_norm1.weight": (h,), "input_norm2.weight": (h,)}
    prefix = "model.layers.0."
    out.update({"layers.0." + k[len(prefix):]: s for k, s in official_param_shapes(cfg).items() if k.startswith(prefix)})
    return out


def eagle_config(cfg: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """The draft folder's ``config.json`` for the base model config ``cfg`` (module docstring)."""
    out = official_config(dataclasses.replace(cfg, attention="dense", sparse_config=None), dtype_name)
    out.pop("architectures", None)
    out["num_hidden_layers"] = 1
    out["head_dim"] = cfg.resolved_head_dim
    out["mup_denominator"] = cfg.num_hidden_layers + 1
    out["base_num_hidden_layers"] = cfg.num_hidden_layers
    out["residual_scale"] = cfg.scale_depth / math.sqrt(cfg.num_hidden_layers + 1)
    return out


def _require_mtp(flat: Mapping[str, Any]) -> None:
    missing = [ours for _, ours, _ in eagle_tensor_map() if ours not in flat]
    if missing:
        raise ConvertError(f"the checkpoint has no MTP module (missing {missing[0]}); train with model.mtp=true to "
                           "get a draft head to export")


def iter_eagle_tensors(flat: Mapping[str, Any], cfg: ModelConfig, dtype: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(draft tensor name, C-contiguous array)`` in :func:`eagle_tensor_map` order.

    Args:
        flat: our parameters (``'/'``-keyed; must hold the ``mtp/...`` ones).
        cfg: the base model config.
        dtype: numpy dtype of the output; ``None`` keeps the parameter dtype.

    Raises:
        ConvertError: the parameters have no MTP module; a value overflows ``dtype`` (float16).
    """
    _require_mtp(flat)
    for name, ours, kind in eagle_tensor_map():
        a = _ours_to_hf(kind, np.asarray(flat[ours]))
        if dtype is not None:
            if np.dtype(dtype) == np.float16:
                check_float16_range(a, name, "--dtype float16")
            a = a.astype(dtype)
        yield name, np.ascontiguousarray(a)


def write_eagle(params: Mapping[str, Any], cfg: ModelConfig, out: str | Path, *, dtype: str = "float32",
                force: bool = False, provenance: Mapping[str, Any] | None = None) -> Any:
    """Write the MTP module of ``params`` as an EAGLE draft folder ``out`` (module docstring).

    Args:
        params: our flat parameters (``'/'``-keyed, float32) including ``mtp/...``.
        cfg: the base model config (``num_hidden_layers`` is the base model's).
        out: output folder (absent or empty unless ``force``); appears only when complete.
        dtype: stored dtype, ``float32`` | ``bfloat16`` | ``float16``.
        force: replace a non-empty ``out``.
        provenance: recorded in the manifest.

    Returns:
        ``hf_export.ExportResult``.

    Raises:
        ConvertError: no MTP module, unknown dtype, a non-empty ``out`` without ``force``.
    """
    from minicpm4_jax.convert.hf_export import ExportResult, np_dtype

    npdt = np_dtype(dtype)
    check_output_target(Path(out), force)
    _require_mtp(params)  # before anything is written
    names = [n for n, _, _ in eagle_tensor_map()]
    shapes = eagle_param_shapes(cfg)
    nbytes = sum(int(np.prod(s)) for s in shapes.values()) * npdt.itemsize
    hf_cfg = eagle_config(cfg, dtype)
    with staged_output(out, force=force, needed_bytes=nbytes + (1 << 20)) as stage:
        files = [p.name for p in write_safetensors_shards(stage, iter_eagle_tensors(params, cfg, npdt), [names])]
        (stage / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        files.append("config.json")
        manifest = {
            "format": EAGLE_FORMAT,
            "dtype": dtype,
            "source": dict(provenance or {}),
            "base_model": {"num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
                           "hidden_size": cfg.hidden_size},
            "residual_scale": f"scale_depth/sqrt(base num_hidden_layers + 1) = {hf_cfg['residual_scale']!r}",
            "shared_with_base": "embed_tokens and lm_head (not stored)",
            "consumers": "CPM.cu --draft-model-path (with the base model exported by `minicpm4 export hf --layout "
                         "minicpm`); this project's `minicpm4 import hf --eagle`",
        }
        write_manifest(stage, manifest)
    return ExportResult(path=Path(out).expanduser().absolute(), files=files, warnings=[], manifest=manifest)


def export_eagle(checkpoint: str | Path, out: str | Path, *, dtype: str = "float32", step: int | None = None,
                 force: bool = False) -> Any:
    """``minicpm4 export eagle``: the MTP module of a run's checkpoint as an EAGLE draft folder.

    Every check that reads no parameter runs first (dtype, checkpoint and step, ``out`` not over the
    run, ``out`` empty, the stored config has ``mtp``, disk space); then the parameters are read.

    Raises:
        ConvertError: a bad argument, a model without an MTP module, or any of the above.
    """
    from minicpm4_jax.convert.hf_export import load_export_source, np_dtype, resolve_export_source, with_document_start

    npdt = np_dtype(dtype)
    paths = resolve_export_source(checkpoint, step=step, no_tokenizer=True)
    out_abs = Path(out).expanduser().absolute()
    refuse_output_over_source(out_abs, paths.protected())
    check_output_target(out_abs, force)

    def check(cfg: ModelConfig) -> None:
        if not cfg.mtp:
            raise ConvertError(f"the checkpoint in {paths.checkpoint_dir} has no MTP module (model.mtp is false); "
                               "there is no draft head to export: train with model.mtp=true")
        n = sum(int(np.prod(s)) for s in eagle_param_shapes(cfg).values())
        check_disk_space(out_abs.parent, n * npdt.itemsize)

    src = load_export_source(checkpoint, paths=paths, check_config=check, include_mtp=True)
    prov = {k: v for k, v in src.provenance.items() if k != "params_sha256"}
    if src.ternary is not None:  # QAT quantizes the base model's matrices (quant.TERNARY_TABLE), not the MTP module
        prov["params"] = ("the MTP module's weights as trained (not ternary: QAT quantizes the base model's "
                          "projections only; the base model exports fake-quantized ternary)")
    # config.json's bos_token_id as the base model's export writes it (the EOS for a run trained here)
    cfg, _start = with_document_start(src.cfg, prov.get("document_start", "bos"))
    return write_eagle(src.params, cfg, out_abs, dtype=dtype, force=force, provenance=prov)


def read_eagle(folder: str | Path, cfg: ModelConfig) -> tuple[Callable[[str, tuple[int, ...]], np.ndarray], list[str]]:
    """Open an EAGLE draft folder for the base model ``cfg`` and check it fits our MTP module.

    Checks (CPM.cu's rules plus what our MTP layer needs): ``config.json`` a JSON object with
    ``num_hidden_layers`` 1 and numbers where numbers belong; no ``quantization_config``;
    ``scale_emb``/``scale_depth``/``dim_model_base`` present and equal to the base model's; the layer shapes
    (hidden/intermediate size, heads, KV heads, head_dim), ``vocab_size`` and ``hidden_act`` (when given) equal
    to the base's; ``base_num_hidden_layers`` (written by :func:`write_eagle`) equal to the base depth; every
    tensor of :func:`eagle_param_shapes` present with its shape and an F32/F16/BF16 dtype; no unknown tensor
    (``embed_tokens`` and ``token_id_remap`` are ignored, as CPM.cu does). Warnings (returned): a
    ``mup_denominator`` other than L+1, or ``rms_norm_eps``, ``rope_theta``, ``max_position_embeddings``,
    ``rope_scaling``, ``tie_word_embeddings`` different from the base model's.

    Returns:
        ``(read, warnings)``: ``read(our '/'-path, shape)`` -> float32 array of that MTP parameter.

    Raises:
        ConvertError: a missing folder/config/tensor, a mismatched scalar or shape, an unknown tensor,
            a quantized or multi-layer draft, a non-finite value (when read).
    """
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise ConvertError(f"--eagle {folder} is not a folder; give the EAGLE draft folder (config.json + "
                           "model.safetensors)")
    cpath = folder / "config.json"
    if not cpath.is_file():
        raise ConvertError(f"--eagle {folder} has no config.json; it is not an EAGLE draft folder")
    try:
        ecfg = json.loads(cpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{cpath} is not valid JSON ({e}); re-download or re-export the draft") from None
    if not isinstance(ecfg, dict):
        raise ConvertError(f"{cpath} holds a JSON {type(ecfg).__name__}, not an object; it is not a model config")

    def number(key: str, *, integer: bool = False, default: Any = None) -> Any:
        v = ecfg.get(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and integer:
            ok = float(v).is_integer()
        if not ok:
            kind = "an integer" if integer else "a number"
            raise ConvertError(f"{cpath}: {key} is {v!r}, not {kind}; the draft config is damaged")
        return int(v) if integer else float(v)

    warnings: list[str] = []
    base = cfg.to_hf_config()
    base["head_dim"] = cfg.resolved_head_dim
    n_layers = number("num_hidden_layers", integer=True, default=1)
    if n_layers != 1:
        archs = ecfg.get("architectures")
        if isinstance(archs, list) and archs and not any("eagle" in str(a).lower() for a in archs):
            raise ConvertError(f"--eagle {folder} looks like a base model ({ecfg['architectures'][0]}, {n_layers} "
                               "layers), not an EAGLE draft folder; give the draft head's folder")
        raise ConvertError(f"{cpath}: num_hidden_layers {n_layers} draft layers; our MTP module has one (use a "
                           "one-layer EAGLE-1 head such as MiniCPM4-8B-Eagle-FRSpec)")
    method = quantization_method(ecfg)
    if method is not None:
        raise ConvertError(f"{cpath} describes a quantized draft (quantization_config {method!r}); only unquantized "
                           "drafts import (use MiniCPM4-8B-Eagle-FRSpec, not the -QAT variant)")
    for key in _SHARED_SCALARS:
        if key not in ecfg:
            raise ConvertError(f"{cpath} has no {key}; CPM.cu requires the draft's {key} to equal the base model's "
                               f"({base[key]}): this draft does not belong to a MiniCPM4 model")
        if number(key) != float(base[key]):
            raise ConvertError(f"{cpath}: {key} {ecfg[key]} differs from the base model's {base[key]}; the draft "
                               "belongs to another base model")
    if "head_dim" not in ecfg:
        ecfg["head_dim"] = number("hidden_size", integer=True) // max(1, number("num_attention_heads", integer=True))
    for key in _SHARED_SHAPES + ("vocab_size",):
        if key == "vocab_size" and key not in ecfg:
            continue
        if number(key, integer=True) != int(base[key]):
            raise ConvertError(f"{cpath}: {key} {ecfg.get(key)} differs from the base model's {base[key]}; the draft "
                               "shares the base model's layer shapes, embedding and head, so it belongs to another "
                               "base model")
    if "hidden_act" in ecfg and ecfg["hidden_act"] != cfg.hidden_act:
        raise ConvertError(f"{cpath}: hidden_act {ecfg['hidden_act']!r} differs from the base model's "
                           f"{cfg.hidden_act!r}; our MTP layer is a base decoder layer")
    if "base_num_hidden_layers" in ecfg and number("base_num_hidden_layers", integer=True) != cfg.num_hidden_layers:
        raise ConvertError(f"{cpath}: exported for a base model of {ecfg['base_num_hidden_layers']} layers, this one "
                           f"has {cfg.num_hidden_layers}; the residual scale would differ")
    if "mup_denominator" in ecfg and number("mup_denominator") != cfg.num_hidden_layers + 1:
        warnings.append(f"{cpath}: mup_denominator {ecfg['mup_denominator']} means a draft residual scale of "
                        f"scale_depth/sqrt({ecfg['mup_denominator']}) to vLLM; this project (like CPM.cu) runs "
                        f"scale_depth/sqrt(L+1) = scale_depth/sqrt({cfg.num_hidden_layers + 1}): the drafts differ "
                        "from that runtime's (speculative decoding stays exact; acceptance may drop), or the draft "
                        "belongs to a base model of another depth")
    if "rms_norm_eps" in ecfg and number("rms_norm_eps") != float(cfg.rms_norm_eps):
        warnings.append(f"{cpath}: rms_norm_eps {ecfg['rms_norm_eps']} differs from the base model's "
                        f"{cfg.rms_norm_eps}; the draft runs with the base value")
    for key in ("rope_theta", "max_position_embeddings", "rope_scaling", "tie_word_embeddings"):
        if key in ecfg and ecfg[key] != base.get(key):
            warnings.append(f"{cpath}: {key} {ecfg[key]!r} differs from the base model's {base.get(key)!r}; the "
                            "draft runs with the base model's rotary table (as CPM.cu does); check that it belongs "
                            "to this base model")
    src = SafetensorsSource(folder)
    shapes = eagle_param_shapes(cfg)
    names = set(src.entries)
    unknown = sorted(n for n in names - set(shapes) if "embed_tokens" not in n and n != "token_id_remap")
    if unknown:
        hint = (" (vLLM's layout: model.fc / model.eagle_layers; rename to fc / layers)"
                if any(n.startswith("model.") for n in unknown) else "")
        raise ConvertError(f"{folder}: tensor {unknown[0]!r} is not part of an EAGLE-1 MiniCPM4 draft{hint}")
    for name, shape in shapes.items():
        if name not in names:
            raise ConvertError(f"{folder}: tensor {name!r} is missing; the draft folder is incomplete")
        got = tuple(src.entries[name].shape)
        if got != shape:
            raise ConvertError(f"{folder}: tensor {name!r} has shape {list(got)}, the base model needs {list(shape)}")
        if src.entries[name].dtype not in _DTYPES_OK:
            raise ConvertError(f"{folder}: tensor {name!r} is {src.entries[name].dtype}; a draft imports from F32, F16 "
                               "or BF16 (a quantized draft must be dequantized first)")
    by_ours = {ours: (name, kind) for name, ours, kind in eagle_tensor_map()}
    d = cfg.resolved_head_dim

    def read(path: str, shape: tuple[int, ...]) -> np.ndarray:
        name, kind = by_ours[path]
        w = np.asarray(src.get(name), dtype=np.float32)
        if not np.isfinite(w).all():
            raise ConvertError(f"{folder}: tensor {name!r} holds non-finite values; the draft is corrupt")
        a = np.ascontiguousarray(_hf_to_ours(kind, w, _heads(path, cfg), d))
        if a.shape != tuple(shape):  # pragma: no cover - guarded by the shape checks above
            raise ConvertError(f"{folder}: tensor {name!r} maps to {a.shape}, expected {shape}")
        return a

    return read, warnings
