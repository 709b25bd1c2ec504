"""``minicpm4 import hf DIR``: an official-layout MiniCPM4 Hugging Face folder -> this project's checkpoint.

Reads ``MiniCPMForCausalLM`` folders (spec ``export.md`` §1.2, ``minicpm4_model.md`` §6): one
``model.safetensors`` or shards + ``model.safetensors.index.json``, tied (no ``lm_head.weight``) or
untied, F32/F16/BF16 tensors. Everything is checked before anything is written: the architecture,
the config (via ``ModelConfig.from_hf_config`` and ``validate_model``), every safetensors header
against its file size (truncation), the tensor set against the config (a missing, extra or
mis-shaped tensor is named; a renamed one is reported as both), the tokenizer (required unless
``no_tokenizer`` / ``--no-tokenizer``, recorded in the manifest) and its size against ``vocab_size``,
``OUT`` against the source (never ``DIR`` itself, a folder holding it or a folder inside it) and the
file system, and the free disk space. Every tensor is also checked to be finite as it is streamed
(a NaN/inf is named and nothing is left behind).

Streaming: each parameter is built with ``jax.make_array_from_callback``; the callback reads only
the per-layer tensors inside the requested shard, one at a time, from memory-mapped safetensors,
so the host never holds more than the imported model (float32) plus one source tensor, and with a
target mesh (``shardings``) each device's shard is read directly. The output is the layout of a
training run: ``OUT/checkpoints/0`` (orbax: ``state`` = ``{"step", "params"}`` and the run config),
``OUT/config.json``, ``OUT/tokenizer/`` and ``minicpm4_manifest.json``, so ``minicpm4 generate
--checkpoint OUT`` and ``minicpm4 export ... --checkpoint OUT`` read it directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ConfigError, DataConfig, ModelConfig, TrainConfig, config_to_dict, validate, validate_model
from minicpm4_jax.convert.io import (
    ConvertError,
    SafetensorsSource,
    check_output_target,
    default_file_mode,
    file_sha256,
    params_sha256,
    quantization_method,
    refuse_output_over_source,
    staged_output,
    write_manifest,
)
from minicpm4_jax.convert.llama_fold import LLAMA_PARAM_MAP, flat_params
from minicpm4_jax.convert.official import layer_slice_reader, official_param_shapes, sparse_runtime_warnings

__all__ = ["import_hf", "read_hf_config", "check_hf_tensors", "ImportResult", "OFFICIAL_ARCHITECTURE"]

OFFICIAL_ARCHITECTURE = "MiniCPMForCausalLM"
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json")
_DTYPES_OK = ("F32", "F16", "BF16")


@dataclass
class ImportResult:
    """What an import produced: the output ``path``, the model ``cfg``, the imported ``params``
    (an ``nnx.State`` of ``jax.Array``, on the requested shardings) and any ``warnings``."""

    path: Path
    cfg: ModelConfig
    params: Any
    warnings: list[str]


def read_hf_config(folder: Path, *,
                   sparse_variant: str | None = None) -> tuple[dict[str, Any], ModelConfig, list[str]]:
    """Read and check ``folder/config.json`` of an official MiniCPM folder.

    ``sparse_variant`` (``"gen1"`` / ``"gen2"``, ``import hf --sparse-variant``) replaces the ``sparse_config``'s
    ``variant`` before the configuration is checked, since the checks depend on it (gen2's ``topk``).

    Returns:
        ``(raw dict as the file holds it, ModelConfig (float32, dense or infllmv2 per sparse_config), warnings)``.

    Raises:
        ConvertError: missing/unparsable config, architecture other than ``MiniCPMForCausalLM``
            (with the fix for a Llama-folded folder), or an invalid configuration.
    """
    p = folder / "config.json"
    if not p.is_file():
        raise ConvertError(f"{folder} has no config.json; give an official MiniCPM4 Hugging Face folder")
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{p} is not valid JSON ({e}); fix the file") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"{p} holds a JSON {type(raw).__name__}, not an object; give a Hugging Face config.json")
    archs = raw.get("architectures") or []
    if OFFICIAL_ARCHITECTURE not in archs:
        hint = ""
        if "LlamaForCausalLM" in archs:
            hint = (" (a Llama-folded export: import the official layout instead, written by "
                    "'minicpm4 export hf --layout minicpm')")
        elif (folder / "checkpoints").is_dir() and isinstance(raw.get("model"), dict):
            hint = (" (a training run of this project: generate, eval and export take the run folder as it is; "
                    "there is nothing to import)")
        elif "base_num_hidden_layers" in raw or any("eagle" in str(a).lower() for a in archs):
            hint = (" (an EAGLE draft folder: import it together with its base model, "
                    f"'minicpm4 import hf BASE --eagle {folder} --out RUN')")
        raise ConvertError(f"{p}: architectures={archs!r} is not ['{OFFICIAL_ARCHITECTURE}']{hint}; "
                           "'minicpm4 import hf' reads official MiniCPM4 folders only")
    method = quantization_method(raw)
    if method is not None:  # (was: every quantized tensor named as missing/unexpected, "a renamed tensor?")
        raise ConvertError(f"{p}: quantization_config {method!r}: a quantized checkpoint (GPTQ/AWQ/Marlin/FP8 "
                           "tensors); 'minicpm4 import hf' reads unquantized F32/F16/BF16 weights: import the "
                           "unquantized release (for BitCPM4 ternary models, the bf16 fake-quantized one)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if key not in raw:
            raise ConvertError(f"{p} has no {key!r}; it is not a complete MiniCPM config")
    # architecture switches of MiniCPMForCausalLM's config class that MiniCPM4 leaves off and this model lacks:
    # importing them would silently drop a part of the model (bias vectors, experts)
    for key, what in (("attention_bias", "q/k/v/o projection biases"), ("mlp_bias", "MLP biases"),
                      ("num_experts", "mixture-of-experts layers (MiniCPM-MoE)"),
                      ("num_local_experts", "mixture-of-experts layers")):
        if raw.get(key) not in (None, False, 0):
            raise ConvertError(f"{p}: {key}={raw[key]!r} asks for {what}, which MiniCPM4 does not have and this "
                               f"model does not implement; only MiniCPM4-style folders ({key} absent or off) import")
    try:
        parsed = raw
        if sparse_variant is not None and isinstance(raw.get("sparse_config"), dict):
            parsed = {**raw, "sparse_config": {**raw["sparse_config"], "variant": sparse_variant}}
        cfg = ModelConfig.from_hf_config(parsed, dtype="float32", param_dtype="float32")
        validate_model(cfg)
    except ConfigError as e:
        raise ConvertError(f"{p}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{p}: invalid value ({e}); fix the file") from None
    warns = [f"sparse_config: {w}" for w in sparse_runtime_warnings(cfg)]
    return raw, cfg, warns


def check_hf_tensors(src: SafetensorsSource, cfg: ModelConfig) -> list[str]:
    """Check the tensor set of ``src`` against ``cfg`` (names, shapes, dtypes).

    A tied model may carry a redundant ``lm_head.weight`` only if it equals the embedding.

    Returns:
        Warnings (e.g. a redundant tied head that was ignored).

    Raises:
        ConvertError: naming the first missing tensor, unexpected tensor, wrong shape or dtype.
    """
    expected = official_param_shapes(cfg)
    have = src.entries
    missing = [n for n in expected if n not in have]
    unexpected = [n for n in have if n not in expected and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing and unexpected:  # e.g. a renamed tensor: name both sides
        more = ([f"{len(missing) - 1} more missing"] if len(missing) > 1 else []) + (
            [f"{len(unexpected) - 1} more unexpected"] if len(unexpected) > 1 else [])
        counts = f" ({', '.join(more)})" if more else ""
        raise ConvertError(f"tensor {missing[0]!r} is missing from {src.folder} and tensor {unexpected[0]!r} is "
                           f"unexpected{counts}; the tensor names do not match MiniCPMForCausalLM for this "
                           "config.json (a renamed tensor?): fix the names or config.json")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"tensor {missing[0]!r} is missing from {src.folder}{more}; the weights do not match "
                           "config.json (check num_hidden_layers / tie_word_embeddings)")
    warns = []
    extra = [n for n in have if n not in expected]
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
        if tuple(have["lm_head.weight"].shape) != expected["model.embed_tokens.weight"]:
            raise ConvertError(f"tensor 'lm_head.weight' has shape {list(have['lm_head.weight'].shape)} but "
                               f"the embedding is {list(expected['model.embed_tokens.weight'])}")
        if not np.array_equal(src.get("lm_head.weight"), src.get("model.embed_tokens.weight"), equal_nan=True):
            raise ConvertError("tensor 'lm_head.weight' differs from model.embed_tokens.weight but config.json has "
                               "tie_word_embeddings true (the default); set \"tie_word_embeddings\": false")
        warns.append("lm_head.weight equals the embedding (tied head); ignored")
    if extra:
        raise ConvertError(f"unexpected tensor {extra[0]!r} in {src.folder} (not part of MiniCPMForCausalLM for this "
                           f"config.json{f'; {len(extra) - 1} more' if len(extra) > 1 else ''}); remove it or fix config.json")
    for n, shape in expected.items():
        e = have[n]
        if tuple(e.shape) != tuple(shape):
            raise ConvertError(f"tensor {n!r} has shape {list(e.shape)} but config.json implies {list(shape)}; "
                               "the weights do not belong to this config")
        if e.dtype not in _DTYPES_OK:
            raise ConvertError(f"tensor {n!r} is {e.dtype}; import reads F32, F16 or BF16 (dequantize it first)")
    return warns


def _train_config(cfg: ModelConfig, out: Path, tokenizer: Path | None) -> TrainConfig:
    d = DataConfig()
    data = dataclasses.replace(
        d,
        tokenizer=str(tokenizer) if tokenizer is not None else d.tokenizer,
        tokenizer_vocab_size=min(d.tokenizer_vocab_size, cfg.vocab_size),
        seq_len=min(d.seq_len, cfg.max_position_embeddings),
    )
    tc = TrainConfig(model=cfg, data=data, out_dir=str(out))
    try:
        validate(tc)
    except ConfigError as e:  # pragma: no cover - defaults are chosen to be valid
        raise ConvertError(f"the imported model gives an invalid run config: {e}") from None
    return tc


def _default_sharding() -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _finite_reader(source: SafetensorsSource) -> Callable[[str], np.ndarray]:
    """``source.get`` that refuses a tensor holding NaN or inf (checked on each read, no second pass)."""

    def get(name: str) -> np.ndarray:
        a = source.get(name)
        ok = np.isfinite(a)
        if not ok.all():
            bad = np.argwhere(~ok)
            first = tuple(int(i) for i in bad[0])
            v = a[first]
            raise ConvertError(
                f"tensor {name!r} in {source.entries[name].file.name} holds {len(bad)} non-finite value(s) "
                f"({'NaN' if np.isnan(v) else 'inf' if v > 0 else '-inf'} at index {list(first)}); the weights are "
                "corrupt: download or convert them again"
            )
        return a

    return get


def _document_start(folder: Path, tok: Any = None) -> str:
    """What the imported model's documents start after (``tokenizer.document_start``).

    The record of this project's export when ``folder`` is one (``minicpm4_manifest.json``'s
    ``source.document_start``: a model trained here starts documents after EOS); else what the folder's tokenizer
    prepends, as a runtime reads it: ``"none"`` when ``tokenizer_config.json`` says ``add_bos_token: false``,
    ``"eos"`` when its ``bos_token`` is the EOS token (an export of a run trained here whose manifest was not
    copied: the tokenizer's ``eos_id``, or without a tokenizer its ``eos_token``), else ``"bos"`` (the official
    MiniCPM4 tokenizers; ``add_bos_token`` is true when absent). Without ``tokenizer_config.json``, or without a
    tokenizer when its two token strings differ (the official tokenizer's eos_token is ``<|im_end|>``): ``"eos"``
    when ``config.json``'s ``bos_token_id`` is one of its ``eos_token_id``, else ``"bos"``. ``"none"`` also when the tokenizer lacks the token (``tokenizer.usable_document_start``)."""
    from minicpm4_jax.tokenizer import DOCUMENT_STARTS, _token_str, usable_document_start

    def read(name: str) -> Any:
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def from_manifest(d: dict) -> Any:
        return d["source"].get("document_start") if isinstance(d.get("source"), dict) else None

    def config_eos_ids(d: dict) -> list:
        eos = d.get("eos_token_id")
        return eos if isinstance(eos, list) else [eos]

    def from_tokenizer_config(d: dict) -> str | None:
        if not d.get("add_bos_token", True):
            return "none"
        bos, eos = _token_str(d.get("bos_token")), _token_str(d.get("eos_token"))
        if tok is None:  # the strings, else config.json's ids decide (an official tokenizer's eos is <|im_end|>)
            return "eos" if bos is not None and bos == eos else None
        # the tokenizer's own EOS only: "eos" means "put tok.eos_id first", and a tokenizer.json-only official
        # tokenizer's eos is <|im_end|> where the document separator was </s> (then "bos", i.e. its bos </s>, is right)
        eos_id = getattr(tok, "eos_id", None)
        return "eos" if bos is not None and eos_id is not None and tok.token_to_id(bos) == eos_id else "bos"

    def from_config(d: dict) -> str:
        return "eos" if d.get("bos_token_id") is not None and d.get("bos_token_id") in config_eos_ids(d) else "bos"

    for name, pick in (("minicpm4_manifest.json", from_manifest), ("tokenizer_config.json", from_tokenizer_config),
                       ("config.json", from_config)):
        data = read(name)
        start = pick(data) if data is not None else None
        if start in DOCUMENT_STARTS:
            break
    else:
        start = "bos"
    # none when the tokenizer has no such token (helper 71: "bos" was recorded for a tokenizer without one)
    return usable_document_start(start, tok)


def _model_bos(cfg: ModelConfig, start: str, tok: Any) -> ModelConfig:
    """``cfg`` with ``bos_token_id`` = the tokenizer's own BOS when ``config.json`` names the EOS as BOS for a model
    whose documents start after EOS (this project's export of a run trained here, ``hf_export.with_document_start``):
    ``model.bos_token_id`` is the tokenizer's BOS in a run (training and export check it), not the token put before
    a document (that is ``document_start``). Unchanged otherwise, or without a tokenizer or its BOS: ``import hf
    --no-tokenizer`` cannot know the tokenizer's own BOS and keeps ``config.json``'s (the EOS), which a later export
    of the run writes as its BOS anyway, and does not count as a mismatch with the tokenizer it is given
    (``tokenizer.special_id_mismatches`` with document start ``eos``)."""
    bos = getattr(tok, "bos_id", None) if tok is not None else None
    if start != "eos" or bos is None or bos < 0 or cfg.bos_token_id != getattr(tok, "eos_id", None):
        return cfg
    return dataclasses.replace(cfg, bos_token_id=int(bos))


def _check_sparse_variant(variant: str | None) -> None:
    """Refuse a ``--sparse-variant`` other than gen1/gen2 (see :func:`import_hf`).

    Raises:
        ConvertError: naming the value and the choices.
    """
    if variant is not None and variant not in ("gen1", "gen2"):
        raise ConvertError(f"--sparse-variant {variant!r}; use gen1 (MiniCPM4-8B, June 2025) or gen2 (MiniCPM4.1)")


def _sparse_variant_warnings(raw: dict[str, Any], cfg: ModelConfig, variant: str | None, folder: Path) -> list[str]:
    """The warnings on the InfLLM v2 generation of ``cfg`` (read with ``variant`` applied, :func:`read_hf_config`)
    against what ``raw`` (the file) names.

    Raises:
        ConvertError: ``variant`` given while ``config.json`` has no ``sparse_config``.
    """
    if cfg.sparse_config is None:
        if variant is not None:
            raise ConvertError(f"--sparse-variant {variant}: {folder / 'config.json'} has no sparse_config (the model "
                               "imports dense); add the official sparse_config block to it, or drop --sparse-variant")
        return []
    written = raw["sparse_config"].get("variant")
    if variant is None:
        if written is not None:
            return []
        return ["sparse_config names no variant: imported as gen2 (MiniCPM4.1-8B's remote code); a "
                "MiniCPM4-8B checkpoint of June 2025 runs gen1: import it with --sparse-variant gen1"]
    if written is not None and written != variant:
        return [f"sparse_config variant {written!r} in config.json replaced by --sparse-variant {variant}"]
    return []


def import_hf(src: str | Path, out: str | Path, *, force: bool = False,
              shardings: Callable[[str, tuple[int, ...]], Any] | None = None,
              log: Callable[[str], Any] | None = None, no_tokenizer: bool = False,
              eagle: str | Path | None = None, sparse_variant: str | None = None) -> ImportResult:
    """Import the official-layout folder ``src`` as a checkpoint of this project in ``out``.

    Args:
        src: folder with ``config.json`` (``MiniCPMForCausalLM``), safetensors weights and
            (optionally) the tokenizer files.
        out: output folder (absent or empty unless ``force``); gets ``checkpoints/0``,
            ``config.json``, ``tokenizer/`` and ``minicpm4_manifest.json``.
        force: replace a non-empty ``out``.
        no_tokenizer: import the weights only (``--no-tokenizer``); otherwise ``src`` must hold
            ``tokenizer.model`` or ``tokenizer.json``.
        shardings: ``(param path, shape) -> jax.sharding.Sharding`` placing each parameter (e.g.
            a ``NamedSharding`` on the target mesh); default: the first local device.
        log: called with each warning line.
        eagle: an EAGLE draft folder for this base model (``openbmb/MiniCPM4-8B-Eagle-FRSpec`` or one written
            by ``minicpm4 export eagle``, see ``convert/eagle.py``): imported as the MTP module
            (``model.mtp=true``), so ``generate --spec-decode`` drafts with it.
        sparse_variant: ``"gen1"`` or ``"gen2"``, the InfLLM v2 generation of the imported ``sparse_config``
            (spec ``minicpm4_model.md`` §0, §8.1): the official block has no ``variant`` key, so a folder without
            one is read as gen2 (MiniCPM4.1-8B's remote code) with a warning; MiniCPM4-8B's June-2025 remote code
            is gen1. ``None``: the folder's ``variant`` (this project's exports write it), else gen2.

    The manifest records ``document_start`` (what the model's documents start after, :func:`_document_start`).
    An export of a run trained here names the EOS as its BOS (``bos_token_id`` in ``config.json``, ``bos_token``
    in ``tokenizer_config.json``, so runtimes prepend it); the imported ``model.bos_token_id`` is then the
    tokenizer's own BOS again (``<s>`` of a SentencePiece model), as in the run it was exported from; with
    ``no_tokenizer`` it stays the EOS (:func:`_model_bos`).

    Returns:
        :class:`ImportResult`; ``params`` are float32 ``[L, ...]``-stacked ``jax.Array`` (an ``nnx.State``).

    Raises:
        ConvertError: every bad input listed in the module docstring, before anything is written; a
            ``sparse_variant`` other than gen1/gen2, or given for a folder without a ``sparse_config``.
    """
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from minicpm4_jax.train.checkpoint import state_save_args
    from minicpm4_jax.train.step import init_model

    folder = Path(src).expanduser().resolve()
    if not folder.is_dir():
        raise ConvertError(f"{src} is not a folder; give the Hugging Face model folder")
    out_abs = Path(out).expanduser().absolute()
    refuse_output_over_source(out_abs, [("model folder", folder)])
    check_output_target(out_abs, force, importing=True)
    _check_sparse_variant(sparse_variant)
    raw, cfg, warnings = read_hf_config(folder, sparse_variant=sparse_variant)
    warnings += _sparse_variant_warnings(raw, cfg, sparse_variant, folder)
    source = SafetensorsSource(folder)
    warnings += check_hf_tensors(source, cfg)
    read_draft = None
    eagle_folder = None
    if eagle is not None:
        from minicpm4_jax.convert.eagle import read_eagle

        eagle_folder = Path(eagle).expanduser().resolve()
        refuse_output_over_source(out_abs, [("EAGLE draft folder", eagle_folder)])
        read_draft, eagle_warnings = read_eagle(eagle_folder, cfg)
        warnings += eagle_warnings
        cfg = dataclasses.replace(cfg, mtp=True)
    tok_files = [n for n in _TOKENIZER_FILES if (folder / n).is_file()]
    has_tok = "tokenizer.model" in tok_files or "tokenizer.json" in tok_files
    tok = None  # the imported tokenizer; its hash goes into the manifest (generate/export check it)
    if no_tokenizer:
        if has_tok:
            warnings.append(f"--no-tokenizer: the tokenizer files in {folder} were not imported")
        tok_files = []
    elif has_tok:
        from minicpm4_jax.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(folder, fix=f"fix the tokenizer files in {folder}, or pass --no-tokenizer to "
                                             "import the weights only")
        except ConfigError as e:
            raise ConvertError(str(e)) from None
        if tok.vocab_size > cfg.vocab_size:
            raise ConvertError(f"the tokenizer in {folder} has {tok.vocab_size} tokens but config.json has vocab_size "
                               f"{cfg.vocab_size}; they do not belong together: fix vocab_size or the tokenizer")
    else:
        raise ConvertError(f"no tokenizer in {folder} (no tokenizer.model or tokenizer.json); copy the model's "
                           "tokenizer files into it, or pass --no-tokenizer to import the weights only (generate "
                           "then needs a tokenizer)")
    start = _document_start(folder, tok)
    cfg = _model_bos(cfg, start, tok)
    for w in warnings:
        if log:
            log(f"warning: {w}")

    n_params = cfg.num_params() + cfg.mtp_params()  # with --eagle: the draft head too
    needed = 4 * n_params + sum((folder / n).stat().st_size for n in tok_files) + (1 << 20)
    rows = {r.ours: r for r in LLAMA_PARAM_MAP}
    place = shardings or (lambda _path, _shape: _default_sharding())

    with staged_output(out_abs, force=force, needed_bytes=needed, importing=True) as stage:
        abstract = nnx.eval_shape(lambda: init_model(cfg, 0))
        _graphdef, state = nnx.split(abstract, nnx.Param)
        pure = nnx.to_pure_dict(state)

        def fill(d: dict, prefix: str) -> dict:
            res = {}
            for k, v in d.items():
                path = f"{prefix}/{k}" if prefix else str(k)
                if isinstance(v, dict):
                    res[k] = fill(v, path)
                    continue
                if path.startswith("mtp/"):
                    arr = read_draft(path, tuple(v.shape))
                    res[k] = jax.device_put(arr, place(path, tuple(v.shape)))
                    continue
                row = rows[path]
                reader = layer_slice_reader(cfg, row, get, np.float32)
                res[k] = jax.make_array_from_callback(tuple(v.shape), place(path, tuple(v.shape)), reader)
            return res

        get = _finite_reader(source)
        nnx.replace_by_pure_dict(state, fill(pure, ""))
        source.close()
        tok_dir = None
        if tok_files:
            tok_dir = stage / "tokenizer"
            tok_dir.mkdir()
            for n in tok_files:
                shutil.copyfile(folder / n, tok_dir / n)
                os.chmod(tok_dir / n, default_file_mode())
        train_cfg = _train_config(cfg, out_abs, out_abs / "tokenizer" if tok_dir else None)
        mngr = ocp.CheckpointManager(stage / "checkpoints",
                                     options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
        try:
            mngr.save(0, args=ocp.args.Composite(**state_save_args(
                {"step": jnp.asarray(0, jnp.int32), "params": state}, train_cfg, 0)))
            mngr.wait_until_finished()
        finally:
            mngr.close()
        (stage / "config.json").write_text(json.dumps(config_to_dict(train_cfg), indent=1))
        src_files = sorted({e.file for e in source.entries.values()})
        index = folder / "model.safetensors.index.json"
        manifest = {
            "format": "import hf-minicpm",
            "source": {
                "folder": str(folder),
                "files": {p.name: file_sha256(p) for p in src_files + ([index] if index.is_file() else [])},
                "dtypes": sorted({e.dtype for e in source.entries.values()}),
            },
            "step": 0,
            "params_sha256": params_sha256(flat_params(state)),
            "dtype": "float32",
            "tokenizer_files": tok_files,
            "tokenizer_hash": tok.file_hash if tok is not None else "",
            "no_tokenizer": bool(no_tokenizer),
            "document_start": start,
            "eagle_draft": ({"folder": str(eagle_folder),
                             "files": {p.name: file_sha256(p) for p in sorted(eagle_folder.glob("*.safetensors"))
                                       + sorted(eagle_folder.glob("config.json"))}}
                            if eagle_folder is not None else None),
            "warnings": warnings,
        }
        write_manifest(stage, manifest, hash_files=False)
    return ImportResult(path=out_abs, cfg=cfg, params=state, warnings=warnings)
