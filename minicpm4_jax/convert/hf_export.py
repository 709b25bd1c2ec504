"""``minicpm4 export hf``: a trained checkpoint -> a Hugging Face model folder.

Two layouts (spec ``export.md`` §1.2, §1.3, §7 rows 1-2):

* ``minicpm`` (official): ``MiniCPMForCausalLM`` ``config.json`` with the μP scalars, LongRoPE
  (never a ``factor`` key) and ``sparse_config`` when the model was trained sparse; unfolded weights
  with the official names (spec ``minicpm4_model.md`` §6; no ``lm_head`` when tied). Read by
  llama.cpp's ``convert_hf_to_gguf.py``, CPM.cu, GPTQModel and transformers once MiniCPM4 is native.
* ``llama``: a plain ``LlamaForCausalLM`` with the μP scalars folded into the weights
  (``llama_fold.fold_to_llama``), loadable by stock transformers / vLLM with no remote code. Dense
  attention only: a sparse (InfLLM v2) model is refused unless ``allow_dense`` (``--allow-dense``),
  which exports it without ``sparse_config`` and records the opt-in in the manifest.

Both write sharded safetensors (``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` + a
valid index), the tokenizer files, ``generation_config.json`` and ``minicpm4_manifest.json``
(source checkpoint step and parameter hash, format, dtype, what was folded), into a staging folder
renamed into place only when complete (``io.staged_output``). A missing tokenizer is an error
unless ``no_tokenizer`` (``--no-tokenizer``, recorded in the manifest). :func:`export_hf` runs every
check that needs no parameters (arguments, source paths, ``--out`` against the source and the file
system, tokenizer, the stored model config) before the checkpoint's parameters are read. The MTP module is
not part of these folders: ``minicpm4 export eagle`` (:mod:`minicpm4_jax.convert.eagle`) writes it as an EAGLE draft.

The token a runtime puts before a prompt is the model's document start (``tokenizer.document_start``, recorded as
the manifest's ``source.document_start``): for a run trained here, whose documents all followed an EOS, the EOS,
written the GPT-2 way as the BOS of ``tokenizer_config.json`` / ``tokenizer.json`` / ``config.json`` /
``generation_config.json`` (:func:`with_document_start`, :func:`write_tokenizer_files`); ``<s>`` for an imported
official model, as before.

A ternary checkpoint (a QAT run past its QAT start, BitCPM4 paper §3.3) is exported in the released
BitCPM4 convention (``export.md`` §5): **fake-quantized** weights, each ternary tensor holding
``q * s`` in the stored dtype (at most 3 values per scale group; rounding ``±s`` to bf16/f16 keeps
it so, since rounding is sign-symmetric), the ordinary ``config.json`` with no
``quantization_config``, and the quantization settings in the manifest. Every ternary tensor is
checked to hold at most one magnitude per scale group as it is written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ConfigError, ModelConfig, TrainConfig
from minicpm4_jax.convert.io import (
    ConvertError,
    check_disk_space,
    check_float16_range,
    check_output_target,
    default_file_mode,
    params_sha256,
    refuse_output_over_source,
    parse_size,
    plan_shards,
    staged_output,
    write_manifest,
    write_safetensors_shards,
)
from minicpm4_jax.convert.llama_fold import flat_params, fold_to_llama
from minicpm4_jax.nn.rope import dynamic_runtime_factor_lists
from minicpm4_jax.convert.official import (
    REMOTE_CODE_AUTO_MAP,
    REMOTE_CODE_FILES,
    iter_official_tensors,
    official_config,
    official_param_shapes,
    official_tensor_names,
    head_dim_warnings,
    remote_code_dir,
    sparse_runtime_warnings,
)

__all__ = [
    "ExportSource",
    "ExportResult",
    "SourcePaths",
    "resolve_export_source",
    "load_export_source",
    "check_tokenizer",
    "check_dense_only",
    "write_hf",
    "export_hf",
    "TOKENIZER_FILES",
    "write_tokenizer_files",
    "with_document_start",
    "requested_document_start",
    "np_dtype",
    "LAYOUTS",
    "DTYPES",
]

LAYOUTS = ("minicpm", "llama")
DTYPES = ("float32", "bfloat16", "float16")
#: tokenizer files copied into an HF export (those present in the source tokenizer folder)
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")


def np_dtype(name: str) -> Any:
    """``"float32"|"bfloat16"|"float16"`` -> numpy dtype (``ml_dtypes.bfloat16`` for bf16).

    Raises:
        ConvertError: another name.
    """
    if name == "float32":
        return np.dtype(np.float32)
    if name == "float16":
        return np.dtype(np.float16)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise ConvertError(f"--dtype {name!r} is not supported; use one of {list(DTYPES)}")


@dataclass
class ExportSource:
    """What an export reads: parameters, their config, the tokenizer folder and provenance.

    Attributes:
        cfg: the model config.
        params: our flat parameters ``{'/'-path: np.ndarray}`` (float32, per-layer stacked ``[L, ...]``;
            for a ternary checkpoint already fake-quantized).
        tokenizer_dir: folder with the tokenizer files, or ``None``.
        provenance: what the manifest records about the source (checkpoint folder, step, hashes).
        ternary: the quantization settings (``minicpm4_jax.quant.TernarySpec``) when the checkpoint
            is a ternary QAT model, else ``None``.
    """

    cfg: ModelConfig
    params: dict[str, np.ndarray]
    tokenizer_dir: Path | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    ternary: Any = None


@dataclass
class ExportResult:
    """Where an export went and what it said: ``path`` (folder), ``files`` written, ``warnings``."""

    path: Path
    files: list[str]
    warnings: list[str]
    manifest: dict[str, Any]


def _find_tokenizer_dir(ckpt_dir: Path, run_dir: Path | None) -> tuple[Path | None, list[Path]]:
    cands = ([run_dir / "tokenizer"] if run_dir else []) + [ckpt_dir.parent / "tokenizer", ckpt_dir / "tokenizer"]
    cands = list(dict.fromkeys(cands))
    return next((c for c in cands if c.is_dir()), None), cands


@dataclass
class SourcePaths:
    """Where an export reads from, resolved without reading any parameter.

    Attributes:
        checkpoint_dir: the orbax checkpoints folder.
        run_dir: the run folder holding it (``None`` when not known, e.g. a custom checkpoint folder).
        tokenizer_dir: the tokenizer folder (checked to hold a tokenizer), or ``None`` with ``--no-tokenizer``.
        step: the checkpoint step to export.
        record_dir: the folder whose ``data.json`` / import manifest records the run's tokenizer
            (``tokenizer.check_tokenizer_record``): ``run_dir``, else the checkpoints folder's parent.
    """

    checkpoint_dir: Path
    run_dir: Path | None
    tokenizer_dir: Path | None
    step: int
    record_dir: Path | None = None

    def protected(self) -> list[tuple[str, Path]]:
        """``[(what, folder)]`` an output must not overlap (see ``io.refuse_output_over_source``)."""
        out = [("run folder", self.run_dir), ("checkpoints folder", self.checkpoint_dir),
               ("tokenizer folder", self.tokenizer_dir)]
        return [(w, p) for w, p in out if p is not None]


def _check_tokenizer_files(tok_dir: Path, label: str, *, sentencepiece: bool, opt_out: bool) -> None:
    if sentencepiece:
        if not (tok_dir / "tokenizer.model").is_file():
            raise ConvertError(f"{label} {tok_dir} has no tokenizer.model; a GGUF's vocabulary is read from the "
                               "SentencePiece model (llama.cpp's minicpm path): pass --tokenizer with a folder holding one")
        return
    if not any((tok_dir / n).is_file() for n in ("tokenizer.model", "tokenizer.json")):
        raise ConvertError(f"{label} {tok_dir} holds neither tokenizer.model nor tokenizer.json; pass --tokenizer with "
                           "the folder of the model's tokenizer (a run's tokenizer/ folder)"
                           + (", or --no-tokenizer to export without one" if opt_out else ""))


def resolve_export_source(checkpoint: str | Path, *, step: int | None = None, tokenizer: str | Path | None = None,
                          no_tokenizer: bool = False, sentencepiece: bool = False,
                          step_option: str = "--step") -> SourcePaths:
    """Resolve a checkpoint, its step and the tokenizer folder, reading no parameter.

    Args:
        checkpoint: a run's ``out_dir`` or its ``checkpoints`` folder.
        step: which checkpoint step (default: the latest complete one).
        tokenizer: tokenizer folder; default ``<out_dir>/tokenizer`` next to the checkpoint.
        no_tokenizer: export without a tokenizer (``--no-tokenizer``); the default requires one.
        sentencepiece: the tokenizer must be a SentencePiece ``tokenizer.model`` (GGUF); implies a
            tokenizer is required.

    Raises:
        ConvertError: no checkpoint there (or a file, or one step's folder), no such step, no tokenizer (or a
            folder without tokenizer files), ``--tokenizer`` with ``--no-tokenizer``.
    """
    import orbax.checkpoint as ocp

    from minicpm4_jax.train.checkpoint import find_checkpoint_dir

    try:  # a plain ConfigError from the run-side lookup: every export documents ConvertError for a bad source
        ckpt_dir = find_checkpoint_dir(checkpoint, step_option=step_option)
    except ConvertError:
        raise
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    given = Path(checkpoint).expanduser().resolve()
    run_dir = given if given != ckpt_dir else (ckpt_dir.parent if ckpt_dir.name == "checkpoints" else None)
    if no_tokenizer and tokenizer is not None:
        raise ConvertError(f"--tokenizer {tokenizer} and --no-tokenizer contradict each other; pass one of them")
    if tokenizer is not None:
        tok_dir = Path(tokenizer).expanduser().resolve()
        if not tok_dir.is_dir():
            raise ConvertError(f"--tokenizer {tokenizer} is not a folder; give the folder holding tokenizer.model")
        _check_tokenizer_files(tok_dir, "--tokenizer", sentencepiece=sentencepiece, opt_out=not sentencepiece)
    elif no_tokenizer and not sentencepiece:
        tok_dir = None
    else:
        tok_dir, looked = _find_tokenizer_dir(ckpt_dir, run_dir)
        if tok_dir is None:
            where = ", ".join(str(c) for c in looked)
            if sentencepiece:
                raise ConvertError(f"no tokenizer folder next to the checkpoint (looked in {where}); a GGUF needs the "
                                   "vocabulary: pass --tokenizer DIR (a folder with tokenizer.model)")
            raise ConvertError(f"no tokenizer folder next to the checkpoint (looked in {where}); pass --tokenizer DIR "
                               "(a folder with tokenizer.model or tokenizer.json), or --no-tokenizer to export the "
                               "weights and config only")
        _check_tokenizer_files(tok_dir, "tokenizer folder", sentencepiece=sentencepiece, opt_out=not sentencepiece)
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(create=False))
    try:
        steps = sorted(mngr.all_steps())
    finally:
        mngr.close()
    if not steps:
        raise ConvertError(f"no complete checkpoint in {ckpt_dir}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConvertError(f"--step {step} is not a checkpoint in {ckpt_dir}; available steps: {steps}")
    return SourcePaths(checkpoint_dir=ckpt_dir, run_dir=run_dir, tokenizer_dir=tok_dir, step=int(step),
                       record_dir=run_dir if run_dir is not None else ckpt_dir.parent)


def load_export_source(checkpoint: str | Path, *, step: int | None = None,
                       tokenizer: str | Path | None = None, no_tokenizer: bool = False,
                       paths: SourcePaths | None = None,
                       check_config: Callable[[ModelConfig], Any] | None = None,
                       check_train: Callable[[TrainConfig, int], Any] | None = None,
                       include_mtp: bool = False) -> ExportSource:
    """Read a training run's (or an import's) checkpoint for export.

    A ternary QAT checkpoint (``minicpm4_jax.quant.checkpoint_is_ternary``) comes back
    fake-quantized (``ExportSource.ternary`` set), as ``load_params_for_inference`` gives it.

    Args:
        checkpoint: a run's ``out_dir`` or its ``checkpoints`` folder.
        step: which checkpoint step (default: the latest complete one).
        tokenizer: tokenizer folder; default ``<out_dir>/tokenizer`` when it exists.
        no_tokenizer: allow a source without a tokenizer.
        paths: the already resolved :func:`resolve_export_source` (then ``step``/``tokenizer`` are ignored).
        check_config: called with the stored model config before any parameter is read.
        check_train: called with the stored run config and the step before any parameter is read.
        include_mtp: keep the MTP draft parameters (``mtp/...``; ``export eagle``); by default they are
            dropped, because the official releases ship the draft head as a separate folder.

    Raises:
        ConfigError/ConvertError: no checkpoint there, no such step, no tokenizer, a corrupt step, or
            what ``check_config`` raises.
    """
    from minicpm4_jax.tokenizer import document_start
    from minicpm4_jax.train.checkpoint import load_params_for_inference

    if paths is None:
        paths = resolve_export_source(checkpoint, step=step, tokenizer=tokenizer, no_tokenizer=no_tokenizer)
    from minicpm4_jax.quant import checkpoint_is_ternary, ternary_spec

    def check(tc: TrainConfig) -> None:
        if check_config is not None:
            check_config(tc.model)
        if check_train is not None:
            check_train(tc, paths.step)

    train_cfg, model = load_params_for_inference(paths.checkpoint_dir, paths.step, check_config=check)
    # the base model only: an MTP draft head (model.mtp) ships separately in the official releases (spec §7)
    params = {k: v for k, v in flat_params(model).items() if include_mtp or not k.startswith("mtp/")}
    params, model_cfg = drop_vocab_padding(params, train_cfg.model)
    ternary = ternary_spec(train_cfg.qat) if checkpoint_is_ternary(train_cfg, paths.step) else None
    prov = {
        "checkpoint": str(paths.checkpoint_dir),
        "step": int(paths.step),
        "params_sha256": params_sha256(params),
        # what the model's documents start after (a run trained here: EOS); `import hf` of this export reads it
        "document_start": document_start(checkpoint, paths.checkpoint_dir),
    }
    if ternary is not None:
        prov["params"] = "fake-quantized ternary weights of the checkpoint's latent weights (qat)"
    return ExportSource(cfg=model_cfg, params=params, tokenizer_dir=paths.tokenizer_dir, provenance=prov,
                        ternary=ternary)


def check_dense_only(cfg: ModelConfig, target: str, allow_dense: bool, keep_hint: str) -> list[str]:
    """Refuse a sparse (InfLLM v2) model for a dense-only ``target`` unless ``allow_dense``.

    Returns:
        The warning to record when ``allow_dense`` lets it through (empty for a dense model).

    Raises:
        ConvertError: a sparse model without ``allow_dense`` (names why and both ways out).
    """
    if cfg.attention != "infllmv2":
        return []
    if not allow_dense:
        raise ConvertError(
            f"the model uses sparse attention (model.attention=infllmv2) but {target} runs dense attention only, so "
            f"the export would compute something other than the trained model; {keep_hint}, or pass --allow-dense "
            "to export it as a dense model anyway"
        )
    return [f"--allow-dense: {target} runs dense attention only; sparse_config is dropped and every runtime loading "
            "this export runs the model dense"]


def check_tokenizer(tokenizer_dir: Path | None, cfg: ModelConfig,
                    fix: str = "pass --tokenizer with the folder of the model's tokenizer (a run's tokenizer/ folder)",
                    record_dir: Path | None = None, document_start: str | None = None) -> tuple[Any, list[str]]:
    """Load the tokenizer of ``tokenizer_dir`` and check it against ``cfg`` (and the run's record).

    Args:
        fix: the hint appended when the tokenizer cannot be read.
        record_dir: the run folder whose ``data.json`` / import manifest records the tokenizer it was trained
            (imported) with; the tokenizer must be that one (``tokenizer.check_tokenizer_record``).
        document_start: the start the export is asked for (:func:`requested_document_start`): with ``"eos"``, a
            ``bos_token_id`` that is the EOS is not warned about (``tokenizer.special_id_mismatches``).

    Returns:
        ``(tokenizer or None, warnings)``.

    Raises:
        ConvertError: the tokenizer has more ids than ``vocab_size`` (its ids would index past the
            embedding), the folder holds no readable tokenizer, or the run records another tokenizer.
    """
    if tokenizer_dir is None:
        return None, []
    from minicpm4_jax.tokenizer import check_tokenizer_record, load_tokenizer

    try:
        tok = load_tokenizer(tokenizer_dir, fix=fix)
        if record_dir is not None:
            check_tokenizer_record(tok, record_dir, f"the tokenizer in {tokenizer_dir}",
                                   "export with the tokenizer the model was trained (imported) with: omit "
                                   "--tokenizer to use the run's tokenizer/ folder, or restore that folder")
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    if tok.vocab_size > cfg.vocab_size:
        raise ConvertError(
            f"tokenizer {tokenizer_dir} has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}; "
            "the tokenizer does not belong to this checkpoint: pass the right --tokenizer"
        )
    from minicpm4_jax.tokenizer import special_id_mismatches

    return tok, special_id_mismatches(tok, cfg, document_start)


def with_document_start(cfg: ModelConfig, document_start: str, tokenizer: Any = None) -> tuple[ModelConfig, str]:
    """The model config as an export writes it for runtimes, and the document start it is written for.

    A runtime puts ``bos_token_id`` (``config.json``, ``generation_config.json``, the GGUF's
    ``tokenizer.ggml.bos_token_id``) before a prompt when its tokenizer says ``add_bos_token``. A model whose
    documents start after EOS (``document_start`` ``"eos"``: a run trained here) is exported the GPT-2 way, with
    the EOS as that BOS: the returned config's ``bos_token_id`` is ``tokenizer.eos_id`` (the document separator
    of the data pipeline; ``cfg.eos_token_id[0]`` without a tokenizer). ``"bos"`` and ``"none"`` keep ``cfg``.

    Args:
        cfg: the model config (its ``bos_token_id`` is the tokenizer's own BOS, as training checks).
        document_start: ``"eos"``, ``"bos"`` or ``"none"`` (``tokenizer.document_start``).
        tokenizer: the exported tokenizer, if any: a start whose token it lacks becomes ``"none"``
            (``tokenizer.usable_document_start``).

    Returns:
        ``(config to write, effective document start)``.

    Raises:
        ConvertError: ``document_start`` is not one of the three.
    """
    import dataclasses

    from minicpm4_jax.tokenizer import DOCUMENT_STARTS, usable_document_start

    if document_start not in DOCUMENT_STARTS:
        raise ConvertError(f"document_start {document_start!r} is not one of {list(DOCUMENT_STARTS)}")
    start = usable_document_start(document_start, tokenizer)
    if start == "eos":
        eos = tokenizer.eos_id if tokenizer is not None else cfg.eos_token_id[0]
        cfg = dataclasses.replace(cfg, bos_token_id=int(eos))
    return cfg, start


def requested_document_start(document_start: str | None, provenance: Mapping[str, Any] | None) -> str | None:
    """The document start an export is asked for: ``document_start``, else ``provenance["document_start"]`` (the
    run's record), else ``None`` (:func:`export_document_start` then writes ``"bos"``)."""
    return document_start if document_start is not None else (provenance or {}).get("document_start")


def export_document_start(cfg: ModelConfig, document_start: str | None, provenance: Mapping[str, Any] | None,
                          tokenizer: Any = None) -> tuple[ModelConfig, str, dict[str, Any]]:
    """What an export writes for its document start: ``(config for runtimes, effective start, manifest source)``.

    ``document_start`` defaults to ``provenance["document_start"]``, else ``"bos"``; when either gives one, the
    returned source (a copy of ``provenance``) records the effective start (:func:`with_document_start`).

    Raises:
        ConvertError: a start other than eos/bos/none.
    """
    given = requested_document_start(document_start, provenance)
    run_cfg, start = with_document_start(cfg, "bos" if given is None else given, tokenizer)
    source = dict(provenance or {})
    if given is not None:
        source["document_start"] = start
    return run_cfg, start, source


def write_tokenizer_files(tokenizer_dir: Path, dest: Path, document_start: str = "bos") -> tuple[list[str], list[str]]:
    """Put the tokenizer of ``tokenizer_dir`` into ``dest`` as transformers must read it to give our ids.

    The :data:`TOKENIZER_FILES` present are copied as they are, except for a SentencePiece folder
    (one with ``tokenizer.model``):

    * without ``tokenizer.json`` (e.g. an imported official MiniCPM4 folder): ``tokenizer.json`` is
      generated from ``tokenizer.model`` and its added tokens (``Tokenizer.to_hf_json``: BPE, byte
      fallback, the model's own dummy-prefix rule, a BOS/EOS post-processor) and ``tokenizer_config.json``
      is rewritten by ``Tokenizer.tokenizer_config`` (the source's keys, plus ``add_prefix_space``
      stating the model's dummy-prefix rule). Otherwise transformers 5 either rebuilds the tokenizer
      from ``tokenizer.model`` with a ``"▁"`` prefix (``add_prefix_space: null`` means true: other ids)
      or, without sentencepiece + protobuf, fails to load it;
    * with a ``tokenizer.json`` whose ``post_processor`` is ``null`` (written by this project before it
      added one): that key is filled in from ``tokenizer_config.json``'s ``add_bos_token`` /
      ``add_eos_token`` (``tokenizer.with_bos_eos_post_processor``), since transformers ignores those
      flags when ``tokenizer.json`` exists.

    Then the token a consumer puts before a prompt is made the model's document start (any tokenizer kind):

    * ``document_start="eos"`` (a run trained here saw every document after an EOS): ``tokenizer_config.json``
      (and ``special_tokens_map.json``) get ``bos_token`` = the EOS token (the tokenizer's ``eos_id``, ``</s>``)
      and ``add_bos_token: true``, and ``tokenizer.json`` a post-processor that puts it first, the GPT-2 way
      (transformers' ``AutoTokenizer`` and llama.cpp then prepend the EOS id by themselves);
    * ``"none"``: ``add_bos_token: false`` and a post-processor without BOS;
    * ``"bos"`` (the official models): nothing more. A start whose token the tokenizer lacks is ``"none"``.

    Returns:
        ``(file names written, notes on what was generated or changed)``.

    Raises:
        ConvertError: the tokenizer files do not load or disagree (a BOS/EOS token not in the vocabulary), a
            ``document_start`` other than eos/bos/none, or a ``tokenizer.json`` post-processor that cannot be
            given the document start.
    """
    from minicpm4_jax.tokenizer import DOCUMENT_STARTS, Tokenizer, with_bos_eos_post_processor

    if document_start not in DOCUMENT_STARTS:
        raise ConvertError(f"document_start {document_start!r} is not one of {list(DOCUMENT_STARTS)}")
    out = []
    for name in TOKENIZER_FILES:
        p = tokenizer_dir / name
        if p.is_file():
            shutil.copyfile(p, dest / name)
            os.chmod(dest / name, default_file_mode())
            out.append(name)
    notes: list[str] = []
    texts: dict[str, str] = {}
    try:
        if "tokenizer.model" in out:
            tok = Tokenizer.from_sentencepiece(tokenizer_dir / "tokenizer.model")
            if "tokenizer.json" not in out:
                tc_text = json.dumps(tok.tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
                texts = {"tokenizer.json": tok.to_hf_json(), "tokenizer_config.json": tc_text}
                notes += [f"tokenizer.json: generated from tokenizer.model ({tokenizer_dir} has none)",
                          "tokenizer_config.json: rewritten with add_prefix_space="
                          f"{str(tok.tokenizer_config()['add_prefix_space']).lower()} (the SentencePiece model's "
                          "dummy-prefix rule) for the generated tokenizer.json"]
            else:
                patched = with_bos_eos_post_processor((dest / "tokenizer.json").read_text(encoding="utf-8"),
                                                      tok.tokenizer_config())
                if patched is not None:
                    texts["tokenizer.json"] = patched
                    notes.append("tokenizer.json: BOS/EOS post_processor added from tokenizer_config.json's "
                                 "add_bos_token/add_eos_token (the source file had none)")
        elif document_start != "bos":
            tok = Tokenizer.from_hf_json(tokenizer_dir / "tokenizer.json")
        else:
            tok = None
        if tok is not None and document_start != "bos":
            texts, start_notes = _document_start_files(tok, dest, texts, document_start)
            notes += start_notes
    except ConfigError as e:
        raise ConvertError(f"the tokenizer in {tokenizer_dir}: {e}") from None
    for name, text in texts.items():
        (dest / name).write_text(text, encoding="utf-8")
        os.chmod(dest / name, default_file_mode())
        if name not in out:
            out.append(name)
    return out, notes


def _document_start_files(tok: Any, dest: Path, texts: dict[str, str], document_start: str
                          ) -> tuple[dict[str, str], list[str]]:
    """``texts`` (file name -> text to write into ``dest``) with the BOS of ``document_start`` (eos / none) in
    ``tokenizer_config.json``, ``special_tokens_map.json`` and ``tokenizer.json``; and the notes saying so."""
    from minicpm4_jax.tokenizer import usable_document_start, with_bos_eos_post_processor

    def current(name: str) -> str | None:
        if name in texts:
            return texts[name]
        return (dest / name).read_text(encoding="utf-8") if (dest / name).is_file() else None

    def loaded(name: str) -> dict[str, Any] | None:
        text = current(name)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{name} is not valid JSON ({e}); fix or remove it") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{name} holds a JSON {type(data).__name__}, not an object; fix or remove it")
        return data

    start = usable_document_start(document_start, tok)
    if start == "bos":
        return texts, []
    texts = dict(texts)
    cfg = loaded("tokenizer_config.json") or tok.tokenizer_config()
    if start == "eos":
        eos = tok.id_to_token(tok.eos_id)
        cfg["bos_token"] = eos
        cfg["add_bos_token"] = True
        stm = loaded("special_tokens_map.json")
        if stm is not None:
            old = stm.get("bos_token")
            stm["bos_token"] = {**old, "content": eos} if isinstance(old, dict) else eos
            texts["special_tokens_map.json"] = json.dumps(stm, indent=2, ensure_ascii=False) + "\n"
        note = (f"bos_token {eos!r} (the EOS, id {tok.eos_id}) with add_bos_token true and a tokenizer.json "
                "post_processor that puts it first: the model saw every document after an EOS (document_start eos)")
    else:
        cfg["add_bos_token"] = False
        note = ("add_bos_token false and a tokenizer.json post_processor without BOS: the model's documents start "
                "after nothing (document_start none)")
    texts["tokenizer_config.json"] = json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"
    hf_json = current("tokenizer.json")
    if hf_json is not None:
        texts["tokenizer.json"] = with_bos_eos_post_processor(hf_json, cfg, replace=True)
    return texts, [f"tokenizer files: {note}"]


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    eos = list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0]
    out: dict[str, Any] = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": eos}
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out


def _tokenizer_bytes(tokenizer_dir: Path | None) -> int:
    if tokenizer_dir is None:
        return 0
    n = sum((tokenizer_dir / n).stat().st_size for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file())
    model = tokenizer_dir / "tokenizer.model"
    if model.is_file() and not (tokenizer_dir / "tokenizer.json").is_file():
        n += 8 * model.stat().st_size  # the generated tokenizer.json (vocabulary + merges as JSON)
    return n


def drop_vocab_padding(params: Mapping[str, Any], cfg: ModelConfig) -> tuple[dict[str, Any], ModelConfig]:
    """``('/'``-keyed params, cfg)`` without vocabulary padding (``vocab_pad_multiple``): what every export writes.

    The embedding keeps its first ``vocab_size`` rows and an untied ``lm_head`` its first ``vocab_size``
    columns; the returned config has ``vocab_pad_multiple = 1``.
    """
    import dataclasses

    if cfg.padded_vocab_size == cfg.vocab_size:
        return dict(params), dataclasses.replace(cfg, vocab_pad_multiple=1)
    v = cfg.vocab_size
    out = dict(params)
    out["embed_tokens/embedding"] = params["embed_tokens/embedding"][:v]
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"][:, :v]
    return out, dataclasses.replace(cfg, vocab_pad_multiple=1)


def write_hf(params: Mapping[str, Any] | Any, cfg: ModelConfig, out: str | Path, *, layout: str = "minicpm",
             dtype: str = "float32", tokenizer_dir: str | Path | None = None, force: bool = False,
             max_shard_size: str | int = "5GB", provenance: Mapping[str, Any] | None = None,
             log: Callable[[str], Any] | None = None, no_tokenizer: bool = False,
             allow_dense: bool = False, ternary: Any = None, document_start: str | None = None) -> ExportResult:
    """Write our parameters as a Hugging Face folder ``out`` in ``layout``.

    Args:
        params: our parameters (anything ``llama_fold.flat_params`` accepts: a model, an
            ``nnx.State`` or a ``'/'``-keyed dict), float32, per-layer stacked ``[L, ...]``.
        cfg: their model config.
        out: the output folder (must be absent or empty unless ``force``).
        layout: ``"minicpm"`` (official, unfolded) or ``"llama"`` (μP folded, ``LlamaForCausalLM``).
        dtype: stored dtype, ``float32`` (lossless) | ``bfloat16`` | ``float16`` (round to nearest even).
        tokenizer_dir: folder whose tokenizer files are copied (checked against ``vocab_size``).
        force: replace a non-empty ``out``.
        max_shard_size: shard limit (``"5GB"``, ``"200MB"`` or bytes); one shard is ``model.safetensors``.
        provenance: source information recorded in the manifest (checkpoint, step, hashes).
        log: called with each warning line (default: none; warnings are also returned).
        no_tokenizer: write without a tokenizer (``--no-tokenizer``); otherwise ``tokenizer_dir`` is required.
        allow_dense: let a sparse (InfLLM v2) model through to the dense-only ``llama`` layout
            (``--allow-dense``); recorded in the manifest.
        ternary: a ``minicpm4_jax.quant.TernarySpec`` when ``params`` are fake-quantized ternary
            weights (BitCPM4): each ternary tensor is checked to hold at most 3 values per scale
            group after the cast to ``dtype``, and the settings go into the manifest.
        document_start: what the model's documents start after (``"eos"``, ``"bos"``, ``"none"``;
            ``tokenizer.document_start``); default ``provenance["document_start"]``, else ``"bos"``. ``"eos"`` (a
            run trained here) writes the EOS as the BOS a runtime prepends: ``bos_token_id`` of ``config.json`` and
            ``generation_config.json`` (:func:`with_document_start`) and the tokenizer files
            (:func:`write_tokenizer_files`); ``"none"``: ``add_bos_token`` false. When given (here or in
            ``provenance``), the manifest's ``source.document_start`` records the one written (``"none"`` when the
            tokenizer lacks the token).

    Memory: the official layout converts one tensor at a time and holds one shard; the llama layout
    folds all tensors first (``fold_to_llama``, float64 math per tensor), i.e. a second copy of the model.

    Returns:
        :class:`ExportResult`.

    Raises:
        ConvertError: unknown layout/dtype/document start, no tokenizer without ``no_tokenizer``, a tokenizer larger
            than the vocabulary, a sparse model to the llama layout without ``allow_dense``, a
            non-empty ``out`` without ``force``, not enough disk space: all before anything is written;
            a ternary tensor with more than 3 values in a scale group (while writing; nothing is left).
    """
    if layout not in LAYOUTS:
        raise ConvertError(f"--layout {layout!r} is not supported; use 'minicpm' (official) or 'llama' (folded)")
    npdt = np_dtype(dtype)
    max_bytes = parse_size(max_shard_size, "--max-shard-size")
    check_output_target(Path(out), force)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tok_dir is None and not no_tokenizer:
        raise ConvertError("no tokenizer folder given: pass --tokenizer DIR (tokenizer_dir), or --no-tokenizer "
                           "(no_tokenizer=True) to write the weights and config only")
    if tok_dir is not None and no_tokenizer:
        raise ConvertError(f"--tokenizer {tok_dir} and --no-tokenizer contradict each other; pass one of them")
    _tok, warnings = check_tokenizer(tok_dir, cfg, document_start=requested_document_start(document_start, provenance))
    # the ids a runtime reads (bos_token_id = the EOS for a model trained here); cfg itself keeps the tokenizer's
    run_cfg, start, source = export_document_start(cfg, document_start, provenance, _tok)
    sparse = cfg.attention == "infllmv2" and cfg.sparse_config is not None
    if layout == "llama":
        warnings += check_dense_only(cfg, "--layout llama (LlamaForCausalLM)", allow_dense,
                                     "use --layout minicpm to keep sparse_config")
    flat = flat_params(params)
    folded: list[str] = []
    dropped: list[str] = []
    if layout == "minicpm":
        shapes = official_param_shapes(cfg)
        names = official_tensor_names(cfg)
        hf_cfg = official_config(run_cfg, dtype)
        warnings += [f"sparse_config: {w}" for w in sparse_runtime_warnings(cfg)]
        warnings += head_dim_warnings(cfg)
        tensors_iter = iter_official_tensors(flat, cfg, npdt)
    else:
        tensors, hf_cfg = fold_to_llama(flat, run_cfg)
        hf_cfg["torch_dtype"] = dtype
        if cfg.rope_scaling is not None and (note := dynamic_runtime_factor_lists(cfg)[2]):
            warnings.append(note.replace("a runtime that switches", "transformers, which switches"))
        names = list(tensors)
        shapes = {k: v.shape for k, v in tensors.items()}
        if npdt == np.float16:
            for k in names:
                check_float16_range(tensors[k], k, "--dtype float16")
        tensors_iter = ((k, np.ascontiguousarray(tensors[k].astype(npdt, copy=False))) for k in names)
        folded = [f"model.embed_tokens.weight x scale_emb ({cfg.scale_emb})",
                  f"self_attn.o_proj.weight and mlp.down_proj.weight x scale_depth/sqrt(num_hidden_layers) "
                  f"({cfg.residual_scale!r})",
                  f"lm_head.weight = {'embed_tokens (tied)' if cfg.tie_word_embeddings else 'lm_head'} / "
                  f"(hidden_size/dim_model_base) ({cfg.width_mult!r}); untied"]
        if sparse:
            dropped.append("sparse_config")
    quantization = None
    if ternary is not None:
        tensors_iter = _checked_ternary(tensors_iter, cfg, ternary, layout, dtype)
        quantization = {**ternary.describe(),
                        "stored": f"fake-quantized: each ternary tensor holds q*s in {dtype} (at most 3 values per "
                                  "scale group); config.json has no quantization_config (the BitCPM4 release "
                                  "convention)"}
    sizes = [(n, int(np.prod(shapes[n], dtype=np.int64)) * npdt.itemsize) for n in names]
    plan = plan_shards(sizes, max_bytes)
    needed = sum(s for _, s in sizes) + _tokenizer_bytes(tok_dir) + (1 << 20)
    for w in warnings:
        if log:
            log(f"warning: {w}")
    with staged_output(out, force=force, needed_bytes=needed) as stage:
        files = [p.name for p in write_safetensors_shards(stage, tensors_iter, plan)]
        if layout == "minicpm":  # AutoConfig (CPM.cu) / AutoModelForCausalLM need code for model_type minicpm
            hf_cfg = {**hf_cfg, "auto_map": dict(REMOTE_CODE_AUTO_MAP)}
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(remote_code_dir() / name, stage / name)
                os.chmod(stage / name, default_file_mode())
            files += list(REMOTE_CODE_FILES)
        (stage / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        (stage / "generation_config.json").write_text(json.dumps(_generation_config(run_cfg), indent=2) + "\n")
        files += ["config.json", "generation_config.json"]
        tok_files, tok_notes = write_tokenizer_files(tok_dir, stage, start) if tok_dir is not None else ([], [])
        files += tok_files
        manifest = {
            "format": f"hf-{layout}",
            "architecture": hf_cfg["architectures"][0],
            "dtype": dtype,
            "source": source,
            "folded": folded,
            "dropped": dropped,
            "attention": "dense" if (layout == "llama" or not sparse) else "infllmv2 (sparse_config in config.json)",
            "allow_dense": bool(allow_dense and sparse and layout == "llama"),
            "no_tokenizer": tok_dir is None,
            "tokenizer_files": tok_files,
            "tokenizer_notes": tok_notes,
            "mtp_draft": ("not in this folder: the official EAGLE draft heads ship as separate folders; write it "
                          "with `minicpm4 export eagle`") if getattr(cfg, "mtp", False)
                         else "not exported: this model has no MTP module",
            "warnings": warnings,
            "shards": len(plan),
        }
        if quantization is not None:
            manifest["quantization"] = quantization
        write_manifest(stage, manifest)
    return ExportResult(path=Path(out).expanduser().absolute(), files=files, warnings=warnings, manifest=manifest)


def _checked_ternary(tensors: Any, cfg: ModelConfig, spec: Any, layout: str, dtype: str) -> Any:
    """Pass ``(name, array)`` through, raising ConvertError for a ternary tensor with > 3 values per scale group."""
    from minicpm4_jax.quant import first_non_ternary_group, ternary_hf_names

    names = ternary_hf_names(cfg, spec, layout)
    for name, arr in tensors:
        if name in names:
            bad = first_non_ternary_group(arr, spec.granularity, spec.group_size)
            if bad is not None:
                raise ConvertError(f"{name} is not ternary after the cast to {dtype}: {bad} (a scale group must hold "
                                   "at most 3 values); the checkpoint's quantization settings do not match its weights")
        yield name, arr


def export_hf(checkpoint: str | Path, out: str | Path, *, layout: str = "minicpm", dtype: str = "float32",
              step: int | None = None, tokenizer: str | Path | None = None, force: bool = False,
              max_shard_size: str | int = "5GB", log: Callable[[str], Any] | None = None,
              no_tokenizer: bool = False, allow_dense: bool = False) -> ExportResult:
    """``minicpm4 export hf``: :func:`load_export_source` then :func:`write_hf`.

    A ternary QAT checkpoint is written fake-quantized (the BitCPM4 release convention; use
    ``dtype="bfloat16"`` for the released storage type).

    Every check that needs no parameter runs first, in this order: the arguments (layout, dtype,
    shard size), the source (checkpoint folder, step, tokenizer folder), ``out`` against the source
    (never the run/checkpoints/tokenizer folder, a folder holding one or a folder inside one, with or
    without ``force``), ``out`` itself (not under a file, empty unless ``force``), then, from the
    stored config alone, a sparse model for the llama layout, the tokenizer against ``vocab_size``
    and the free disk space. Only then are the parameters read.

    Args:
        checkpoint: a run's ``out_dir`` (or an import's ``OUT``) or its ``checkpoints`` folder.
        out: the output folder (absent or empty unless ``force``).
        layout: ``"minicpm"`` (official ``MiniCPMForCausalLM``) or ``"llama"`` (μP folded ``LlamaForCausalLM``).
        dtype: stored dtype, ``"float32"`` | ``"bfloat16"`` | ``"float16"``.
        step: the checkpoint step (default: the latest).
        tokenizer: tokenizer folder (default: the run's ``tokenizer/``).
        force: replace an earlier output in ``out``.
        max_shard_size: the largest safetensors shard, bytes or ``"5GB"`` / ``"500MB"`` / ``"2GiB"``.
        log: receives warnings and notes (one line each).
        no_tokenizer: write no tokenizer files (recorded in the manifest).
        allow_dense: write a sparse (InfLLM v2) model to the dense-only llama layout.

    Returns:
        :class:`ExportResult` (``path``, ``files``, ``manifest``).

    Raises:
        ConvertError: any of the checks above (a bad layout, dtype or shard size, ``allow_dense`` with the
            minicpm layout, no checkpoint / step / tokenizer, ``out`` over the source or not empty without
            ``force``, a sparse model for the llama layout without ``allow_dense``, a tokenizer larger than the
            vocabulary, too little disk space), before anything is written.
        ConfigError: a damaged checkpoint step, found while the parameters are read (the base class of
            ``ConvertError``: catch ``ConfigError`` for both).
    """
    if layout not in LAYOUTS:
        raise ConvertError(f"--layout {layout!r} is not supported; use 'minicpm' (official) or 'llama' (folded)")
    npdt = np_dtype(dtype)
    parse_size(max_shard_size, "--max-shard-size")
    if allow_dense and layout == "minicpm":
        raise ConvertError("--allow-dense applies to --layout llama (and GGUF), which are dense only; --layout minicpm "
                           "keeps sparse_config: leave --allow-dense out")
    paths = resolve_export_source(checkpoint, step=step, tokenizer=tokenizer, no_tokenizer=no_tokenizer)
    out_abs = Path(out).expanduser().absolute()
    refuse_output_over_source(out_abs, paths.protected())
    check_output_target(out_abs, force)

    def check(cfg: ModelConfig) -> None:
        if layout == "llama":
            check_dense_only(cfg, "--layout llama (LlamaForCausalLM)", allow_dense,
                             "use --layout minicpm to keep sparse_config")
        check_tokenizer(paths.tokenizer_dir, cfg, record_dir=paths.record_dir)
        n = sum(int(np.prod(s, dtype=np.int64)) for s in official_param_shapes(cfg).values())
        if layout == "llama" and cfg.tie_word_embeddings:
            n += cfg.vocab_size * cfg.hidden_size
        check_disk_space(out_abs.parent, n * npdt.itemsize + _tokenizer_bytes(paths.tokenizer_dir))

    src = load_export_source(checkpoint, paths=paths, check_config=check)
    return write_hf(src.params, src.cfg, out_abs, layout=layout, dtype=dtype, tokenizer_dir=src.tokenizer_dir,
                    force=force, max_shard_size=max_shard_size, provenance=src.provenance, log=log,
                    no_tokenizer=no_tokenizer, allow_dense=allow_dense, ternary=src.ternary)
