"""``minicpm4 export gguf``: a checkpoint -> a llama.cpp ``minicpm``-architecture GGUF (F32/F16/BF16/Q8_0/TQ1_0/TQ2_0).

Written with the ``gguf`` package (spec ``export.md`` §2.1-§2.2), following what llama.cpp's own
``convert_hf_to_gguf.py`` (``conversion/minicpm.py`` ``MiniCPMModel``, ``conversion/base.py``
``TextModel``) writes for an official MiniCPM folder, so the two agree tensor for tensor (the test
suite runs that converter as an oracle):

* keys: the generic text-model keys (``block_count``, ``context_length``, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count[_kv]``, ``attention.layer_norm_rms_epsilon``,
  ``rope.freq_base``, ``rope.scaling.type = longrope``), **all three** MiniCPM scale keys
  (``minicpm.embedding_scale`` = scale_emb, ``minicpm.residual_scale`` = scale_depth/sqrt(L),
  ``minicpm.logit_scale`` = hidden/dim_model_base: llama.cpp's legacy defaults differ, so never
  omit one), ``general.file_type`` and ``general.quantization_version``; additionally
  ``rope.scaling.original_context_length`` (llama.cpp picks the long factors when the context
  exceeds it) and, when ``max_position_embeddings > original``, ``rope.scaling.attn_factor`` =
  sqrt(1 + ln(max/orig)/ln(orig)) (llama.cpp's LongRoPE magnitude scaling, default 1);
* tensors: official (unfolded) weights under llama.cpp names (``gguf.get_tensor_name_map``);
  ``attn_q``/``attn_k`` rows permuted from HF's rotate-half order into ggml's interleaved NORM
  rope order (``LlamaModel.permute``); ``rope_factors_long``/``rope_factors_short`` float32
  ``[head_dim/2]``; no ``output`` when tied (llama.cpp reuses ``token_embd``); norms and 1-D
  tensors in F32, every other tensor in the chosen type (Q8_0 falls back to F16 for rows that are
  not a multiple of 32, as the converter does);
* vocabulary: the SentencePiece model (``tokenizer.ggml.model = llama``) with the converter's
  rules (``_create_vocab_sentencepiece``: piece types, added tokens from ``added_tokens.json`` and
  ``tokenizer_config.json``, ``[PAD{i}]`` fill up to ``vocab_size``), special ids and the chat
  template through ``gguf.SpecialVocab`` (on the tokenizer files our HF export writes); additionally
  ``tokenizer.ggml.add_space_prefix`` (the model's ``add_dummy_prefix``: llama.cpp's SPM default is
  true, MiniCPM4's model has none), the eos/unk ids SpecialVocab cannot resolve (a list
  ``eos_token_id``: its first) and ``eot_token_id`` for a second eos id (llama.cpp stops on eos/eot).
  A model whose documents start after EOS (a run trained here: ``source.document_start`` ``eos``) gets the
  EOS id as ``tokenizer.ggml.bos_token_id`` with ``add_bos_token`` true, so llama.cpp prepends the EOS, as
  the HF export's tokenizer does (``hf_export.with_document_start``).
  Q8_0/TQ blocks whose float16 scale would overflow are refused, as F16 weights above 65504 are.

Dense attention only: llama.cpp has no InfLLM v2, so a sparse model is refused unless ``allow_dense``
(``--allow-dense``: exported dense, ``sparse_config`` dropped, the opt-in recorded in the manifest).
``--out`` is a folder (it receives ``minicpm4-<outtype>.gguf`` and the manifest): one ending in
``.gguf`` is refused.
Tensors are written one at a time (``add_tensor_info`` then ``write_tensor_data``), so the host
holds the parameters plus one converted tensor.

Ternary types (``--outtype tq2_0|tq1_0``, spec ``export.md`` §2.3, §5): the attention and MLP
matrices are packed with the ``gguf`` package's TQ2_0/TQ1_0 quantizers (256-element blocks along
``in``, one fp16 scale ``d = max|block|`` each, codes ``round(x/d)``); ``token_embd``/``output`` stay
F16 and norms F32, as llama.cpp's converter does. A block holds one magnitude, so this is exact
(up to the fp16 rounding of the scale) only for weights that are ternary with one scale per
256-block: a QAT checkpoint with ``per_tensor`` or ``per_row`` scales (or groups that are a
multiple of 256) and rows that are a multiple of 256, or any checkpoint whose weights already are
such ternary values (e.g. an imported BitCPM4 release). Anything else is refused with one line
naming the tensor and the reason, never re-quantized: the config-level reasons (row length,
group size) before any parameter is read, the weight-level one (a block with several
magnitudes) before the file is written. Dequantization multiplies the codes by ``d`` (fault B14).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ConfigError, ModelConfig
from minicpm4_jax.convert.io import (
    MANIFEST_NAME,
    ConvertError,
    check_disk_space,
    check_float16_range,
    check_output_target,
    refuse_output_over_source,
    staged_output,
    write_manifest,
)
from minicpm4_jax.convert.llama_fold import flat_params
from minicpm4_jax.convert.official import from_official, iter_official_tensors, official_config, official_param_shapes
from minicpm4_jax.nn.rope import dynamic_runtime_factor_lists

__all__ = ["OUTTYPES", "TERNARY_OUTTYPES", "write_gguf", "write_gguf_dir", "export_gguf", "read_gguf_params",
           "permute_qk", "unpermute_qk", "gguf_tensor_types", "sentencepiece_vocab", "check_ternary_outtype",
           "check_ternary_blocks", "check_block_scale_range"]

#: ``--outtype`` -> (LlamaFileType name, GGMLQuantizationType name of the matrices)
OUTTYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "bf16": ("MOSTLY_BF16", "BF16"),
            "q8_0": ("MOSTLY_Q8_0", "Q8_0"), "tq1_0": ("MOSTLY_TQ1_0", "TQ1_0"), "tq2_0": ("MOSTLY_TQ2_0", "TQ2_0")}
#: ternary outtypes: TQ matrices, token_embd/output F16, norms F32
TERNARY_OUTTYPES = ("tq1_0", "tq2_0")
_TQ_BLOCK = 256
_EXACT_HINT = "use --outtype f32 (exact), bf16 or f16 instead"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> ggml NORM (interleaved) order, as llama.cpp's ``LlamaModel.permute``.

    ``w``: ``[n_head * head_dim, in]`` (q_proj with ``n_head`` = query heads, k_proj with the KV
    heads). Within each head, output row ``2j`` takes HF row ``j`` and row ``2j+1`` takes HF row
    ``j + head_dim/2``, so rotating adjacent pairs equals HF's rotate-half.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sentencepiece_vocab(tokenizer_dir: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """``(tokens, scores, token types)`` of length ``vocab_size`` by llama.cpp's converter rules.

    Source: ``conversion/base.py`` ``TextModel._create_vocab_sentencepiece`` (llama.cpp as vendored
    in llama-cpp-python 0.3.36): pieces with their scores and types (unknown/control/unused/byte/
    normal); ``added_tokens.json`` entries as USER_DEFINED with score -1000; ``tokenizer_config.json``
    ``added_tokens_decoder`` entries as CONTROL when special (else USER_DEFINED); unused ids as
    ``[PAD{i}]`` (UNUSED, score -10000).

    Raises:
        ConvertError: no ``tokenizer.model`` in ``tokenizer_dir`` (llama.cpp reads SentencePiece).
    """
    import gguf
    from sentencepiece import SentencePieceProcessor

    T = gguf.TokenType
    path = tokenizer_dir / "tokenizer.model"
    if not path.is_file():
        raise ConvertError(f"{tokenizer_dir} has no tokenizer.model; the GGUF vocabulary is read from a SentencePiece "
                           "model (llama.cpp's minicpm path): pass --tokenizer with one")
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(path))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(T.UNUSED)] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        t = T.NORMAL
        if sp.IsUnknown(i):
            t = T.UNKNOWN
        elif sp.IsControl(i):
            t = T.CONTROL
        elif sp.IsUnused(i):
            t = T.UNUSED
        elif sp.IsByte(i):
            t = T.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), int(t)
    added = tokenizer_dir / "added_tokens.json"
    if added.is_file():
        for key, i in json.loads(added.read_text(encoding="utf-8")).items():
            if int(i) < vocab_size:
                tokens[int(i)], scores[int(i)], types[int(i)] = key.encode("utf-8"), -1000.0, int(T.USER_DEFINED)
    tc = tokenizer_dir / "tokenizer_config.json"
    if tc.is_file():
        dec = json.loads(tc.read_text(encoding="utf-8")).get("added_tokens_decoder", {}) or {}
        for sid, data in dec.items():
            i = int(sid)
            if i >= vocab_size:
                continue
            tok: str = data["content"]
            if data.get("special") or _looks_special(tok):
                types[i] = int(T.CONTROL)
            else:
                tok = tok.replace("\u2581", " ")
                types[i] = int(T.USER_DEFINED)
            scores[i] = -1000.0
            tokens[i] = tok.encode("utf-8")
    return tokens, scores, types


def _looks_special(tok: str) -> bool:
    """The converter's ``does_token_look_special`` (``conversion/base.py``)."""
    return (tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (tok.startswith("<|") and tok.endswith("|>"))
            or (tok.startswith("<\uff5c") and tok.endswith("\uff5c>"))
            or (tok.startswith("<unused") and tok.endswith(">")))


def gguf_tensor_types(cfg: ModelConfig, outtype: str) -> dict[str, str]:
    """``{gguf tensor name: GGMLQuantizationType name}`` our writer uses for ``cfg`` and ``outtype``."""
    return {name: q for name, q, _ in _plan(cfg, outtype)}


def _plan(cfg: ModelConfig, outtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``[(gguf name, qtype name, numpy shape)]`` in write order."""
    import gguf

    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not supported; use one of {list(OUTTYPES)}")
    mat_q = OUTTYPES[outtype][1]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MINICPM, cfg.num_hidden_layers)
    out = []
    if cfg.rope_scaling is not None:
        half = cfg.resolved_head_dim // 2
        out.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", "F32", (half,)))
        out.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight", "F32", (half,)))
    bs = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[mat_q]][0]
    ternary = outtype in TERNARY_OUTTYPES
    for hf_name, shape in official_param_shapes(cfg).items():
        name = tmap.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:  # pragma: no cover - table mismatch
            raise ConvertError(f"no llama.cpp name for {hf_name}")
        if len(shape) <= 1 or name.endswith("_norm.weight"):
            q = "F32"
        elif ternary and name in ("token_embd.weight", "output.weight"):
            q = "F16"  # as llama.cpp's converter does for tq1_0/tq2_0
        elif ternary and shape[-1] % bs:
            raise ConvertError(
                f"--outtype {outtype}: {hf_name} ({name}) has rows of {shape[-1]} input columns, not a multiple of the "
                f"{bs}-element {mat_q} block, so {mat_q} cannot hold it; {_EXACT_HINT}")
        elif shape[-1] % bs:
            q = "F16"  # the converter's QuantError fallback
        else:
            q = mat_q
        out.append((name, q, shape))
    return out


def check_ternary_outtype(cfg: ModelConfig, outtype: str, spec: Any) -> None:
    """Config-level checks of a ternary ``outtype`` (before any parameter is read).

    Args:
        spec: the checkpoint's ``minicpm4_jax.quant.TernarySpec`` (``None``: not a QAT checkpoint;
            its weights are then checked block by block in :func:`write_gguf`).

    Raises:
        ConvertError: a matrix whose rows are not a multiple of 256 (named by ``_plan``), or scale
            groups that split a 256-block (``per_group`` with ``group_size % 256 != 0``), naming
            the first such tensor.
    """
    if outtype not in TERNARY_OUTTYPES:
        return
    plan = _plan(cfg, outtype)  # raises for rows that are not a multiple of the block
    if spec is None or spec.granularity != "per_group" or spec.group_size % _TQ_BLOCK == 0:
        return
    from minicpm4_jax.quant import ternary_hf_names

    mat_q = OUTTYPES[outtype][1]
    names = _gguf_names(cfg)
    tq = {n for n, q, _ in plan if q == mat_q}
    first = next(h for h in ternary_hf_names(cfg, spec) if names.get(h) in tq)
    raise ConvertError(
        f"--outtype {outtype}: {first} ({names[first]}) has a ternary scale every {spec.group_size} input columns "
        f"(qat.granularity=per_group, group_size={spec.group_size}) but a {mat_q} block of {_TQ_BLOCK} columns holds one "
        f"scale, so it would be re-quantized; {mat_q} is exact for per_tensor/per_row scales or groups that are a "
        f"multiple of {_TQ_BLOCK}: {_EXACT_HINT}")


def check_ternary_blocks(flat: Mapping[str, Any], cfg: ModelConfig, outtype: str, ternary_checkpoint: bool) -> None:
    """Weight-level check of a ternary ``outtype``: every TQ matrix holds one magnitude per 256-block.

    Raises:
        ConvertError: the first matrix with a block of several magnitudes (names it, the block and
            how many magnitudes, and what to do).
    """
    from minicpm4_jax.quant import first_non_ternary_group

    mat_q = OUTTYPES[outtype][1]
    names = _gguf_names(cfg)
    tq = {n for n, q, _ in _plan(cfg, outtype) if q == mat_q}
    for hf_name, arr in iter_official_tensors(flat, cfg, np.float32):
        if names[hf_name] not in tq:
            continue
        bad = first_non_ternary_group(arr, "per_group", _TQ_BLOCK)
        if bad is None:
            continue
        why = ("the checkpoint's ternary weights do not match its quantization settings" if ternary_checkpoint else
               "the checkpoint is not a ternary model (train it with qat.enabled=true and per_tensor/per_row scales, "
               "or import ternary weights)")
        raise ConvertError(f"--outtype {outtype}: {hf_name} ({names[hf_name]}) is not ternary per {_TQ_BLOCK}-column "
                           f"block: {bad}; {mat_q} stores one magnitude per block and would re-quantize it; {why}; "
                           f"{_EXACT_HINT}")


def _gguf_names(cfg: ModelConfig) -> dict[str, str]:
    import gguf

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MINICPM, cfg.num_hidden_layers)
    return {hf: tmap.get_name(hf, try_suffixes=(".weight",)) for hf in official_param_shapes(cfg)}


def _encode(arr: np.ndarray, qname: str) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), gguf.GGMLQuantizationType[qname])


def _nbytes(shape: tuple[int, ...], qname: str) -> int:
    import gguf

    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qname]]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // bs) * ts


def _add_metadata(w: Any, cfg: ModelConfig, outtype: str, name: str) -> None:
    import gguf

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rs = cfg.rope_scaling
    if rs is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_orig_ctx_len(rs.original_max_position_embeddings)
        if cfg.max_position_embeddings > rs.original_max_position_embeddings:
            from minicpm4_jax.nn.rope import attention_scaling

            w.add_rope_scaling_attn_factors(float(attention_scaling(cfg)))
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.head_dim is not None:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType[OUTTYPES[outtype][0]])
    w.add_embedding_scale(float(cfg.scale_emb))
    w.add_residual_scale(float(cfg.scale_depth / math.sqrt(cfg.num_hidden_layers)))
    w.add_logit_scale(float(cfg.hidden_size / cfg.dim_model_base))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(w: Any, cfg: ModelConfig, tokenizer_dir: Path, document_start: str = "bos") -> list[str]:
    """The ``tokenizer.*`` keys; returns warnings.

    As the converter: pieces, scores and types, then ``gguf.SpecialVocab`` (bos/eos/unk ids,
    add_bos/add_eos, chat template) on the folder our HF export writes (``hf_export.write_tokenizer_files``:
    with the ``tokenizer.json`` generated for a folder that has none, so the converter run on our HF
    export sees the same). Beyond the converter (llama.cpp ``src/llama-vocab.cpp`` ``llama_vocab::impl::load``):

    * ``tokenizer.ggml.add_space_prefix`` = the SentencePiece model's ``add_dummy_prefix``: llama.cpp
      prepends ``"▁"`` to SPM text unless the key says otherwise, while MiniCPM4's model has no dummy prefix;
    * ``eos_token_id`` = the first of ``model.eos_token_id`` and ``unknown_token_id`` = the model's unk
      piece, when SpecialVocab found none (a list ``eos_token_id`` in config.json and a ``tokenizer_config``
      eos that no ``tokenizer.json`` resolves leave them unset; llama.cpp would then assume 2 and 0);
    * ``eot_token_id`` = the first other id of ``model.eos_token_id`` (e.g. ``<|im_end|>`` when eos is
      ``</s>``): llama.cpp ends generation on eos, eot and eom only (plus a few token texts it knows),
      as the Laguna converter does for an eos list.

    ``document_start`` ``"eos"`` (a run trained here) gives the HF export's view of such a model (its
    ``bos_token`` / ``bos_token_id`` the EOS, ``add_bos_token`` true), so ``tokenizer.ggml.bos_token_id`` is the EOS id
    and llama.cpp prepends it; ``"none"`` gives ``tokenizer.ggml.add_bos_token`` false.
    """
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    from minicpm4_jax.convert.hf_export import with_document_start, write_tokenizer_files
    from minicpm4_jax.tokenizer import Tokenizer

    tokens, scores, types = sentencepiece_vocab(tokenizer_dir, cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    proto = pb.ModelProto()
    proto.ParseFromString((tokenizer_dir / "tokenizer.model").read_bytes())
    w.add_add_space_prefix(bool(proto.normalizer_spec.add_dummy_prefix))
    # SpecialVocab reads tokenizer_config.json / special_tokens_map.json and config.json (bos/eos ids,
    # add_bos/add_eos, chat template) exactly as the converter does: give it the official view.
    try:
        tok = Tokenizer.from_sentencepiece(tokenizer_dir / "tokenizer.model")
    except ConfigError as e:
        raise ConvertError(f"the tokenizer in {tokenizer_dir}: {e}") from None
    run_cfg, start = with_document_start(cfg, document_start, tok)  # bos_token_id: the EOS for a model trained here
    with tempfile.TemporaryDirectory() as td:
        tdp = Path(td)
        write_tokenizer_files(tokenizer_dir, tdp, start)
        (tdp / "config.json").write_text(json.dumps(official_config(run_cfg)))
        quiet = logging.getLogger("gguf.vocab")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # its "Unknown separator token '<s>'" on LlamaTokenizerFast's pair template
        try:
            special = gguf.SpecialVocab(tdp, n_vocab=len(tokens))
        finally:
            quiet.setLevel(level)
    ids = special.special_token_ids
    eos_list = [int(i) for i in cfg.eos_token_id]
    if "eos" not in ids and eos_list:
        ids["eos"] = eos_list[0]
    unk = proto.trainer_spec.unk_id
    if "unk" not in ids and 0 <= unk < len(tokens) and types[unk] in (int(gguf.TokenType.UNKNOWN),
                                                                       int(gguf.TokenType.CONTROL)):
        ids["unk"] = unk
    # the BOS too when it is an eos id: a run trained here written with its document separator as the BOS
    # (document_start eos) must still stop there (helper 74: with the official tokenizer, eos <|im_end|>, </s> was lost)
    others = [i for i in dict.fromkeys(eos_list) if i != ids.get("eos")]
    warnings = []
    if others and "eot" not in ids:
        ids["eot"] = others[0]
    if len(others) > 1:
        warnings.append(f"model.eos_token_id {eos_list}: llama.cpp stops on eos {ids.get('eos')} and eot {others[0]} "
                        f"only; {others[1:]} end generation there only if their text is one it knows")
    special.add_to_gguf(w)
    return warnings


#: block types with one float16 scale per block: ``{qtype: (block size, scale = max|block| / divisor)}``
#: (``gguf.quants``: Q8_0 ``d = max|x| / 127``; TQ1_0/TQ2_0 ``d = max|x|``)
_FP16_SCALE = {"Q8_0": (32, 127.0), "TQ1_0": (_TQ_BLOCK, 1.0), "TQ2_0": (_TQ_BLOCK, 1.0)}


def check_block_scale_range(arr: np.ndarray, name: str, qtype: str) -> None:
    """Raise when a block's float16 scale of ``qtype`` would overflow (numpy writes inf, the block dequantizes to inf/NaN).

    Args:
        arr: the float32 matrix ``[..., in]`` (``in`` a multiple of the block).
        name: the GGUF tensor name (for the message).
        qtype: ``Q8_0``, ``TQ1_0`` or ``TQ2_0``.

    Raises:
        ConvertError: naming the tensor, its largest magnitude, the scale and the fix.
    """
    block, div = _FP16_SCALE[qtype]
    if not arr.size:
        return
    amax = np.abs(np.asarray(arr, np.float32)).reshape(-1, block).max(axis=-1)
    d = amax[np.isfinite(amax)] / np.float32(div)
    with np.errstate(over="ignore"):
        overflow = bool(d.size) and bool(np.isinf(d.astype(np.float16)).any())
    if overflow:
        big = float(d.max() * div)
        scale = f"gives a block scale (max/{div:g}) of {big / div:.6g}" if div != 1 else "is its block's scale"
        raise ConvertError(f"{name} does not fit {qtype} (--outtype {qtype.lower()}): its largest magnitude {big:.6g} "
                           f"{scale}, above float16's 65504, which would be written as inf; export with --outtype f32 "
                           "or bf16")


def _iter_gguf_tensors(flat: Mapping[str, Any], cfg: ModelConfig, plan) -> Iterator[np.ndarray]:
    names = _gguf_names(cfg)
    qtypes = {n: q for n, q, _ in plan}
    if cfg.rope_scaling is not None:  # llama.cpp switches lists by context size: write the list this model uses
        short, long_, _ = dynamic_runtime_factor_lists(cfg)
        yield _encode(np.asarray(long_, np.float32), "F32")
        yield _encode(np.asarray(short, np.float32), "F32")
    for hf_name, arr in iter_official_tensors(flat, cfg, np.float32):
        if hf_name.endswith("self_attn.q_proj.weight"):
            arr = permute_qk(arr, cfg.num_attention_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            arr = permute_qk(arr, cfg.num_key_value_heads)
        if qtypes[names[hf_name]] == "F16":
            check_float16_range(arr, names[hf_name], "--outtype f16")
        elif qtypes[names[hf_name]] in _FP16_SCALE:
            check_block_scale_range(arr, names[hf_name], qtypes[names[hf_name]])
        yield _encode(arr, qtypes[names[hf_name]])


def write_gguf(params: Any, cfg: ModelConfig, path: str | Path, *, outtype: str = "f16",
               tokenizer_dir: str | Path, name: str = "minicpm4", allow_dense: bool = False,
               ternary: Any = None, document_start: str = "bos") -> list[str]:
    """Write ``params`` as a ``minicpm`` GGUF file at ``path`` (see the module docstring).

    Args:
        params: our parameters (anything ``llama_fold.flat_params`` accepts), float32.
        cfg: their model config.
        path: the ``.gguf`` file to create.
        outtype: ``f32`` | ``f16`` | ``bf16`` | ``q8_0`` | ``tq1_0`` | ``tq2_0``.
        tokenizer_dir: folder with ``tokenizer.model`` (+ ``tokenizer_config.json`` etc.).
        name: ``general.name``.
        allow_dense: write a sparse (InfLLM v2) model as a dense one (``--allow-dense``).
        ternary: the ``minicpm4_jax.quant.TernarySpec`` of a QAT checkpoint whose ``params`` are
            already fake-quantized (used for the checks and messages of ``tq1_0``/``tq2_0``).
        document_start: what the model's documents start after (``"eos"``, ``"bos"``, ``"none"``;
            ``tokenizer.document_start``): ``"eos"`` writes the EOS id as ``tokenizer.ggml.bos_token_id`` with
            ``add_bos_token`` true, so llama.cpp prompts the model as it was trained; ``"none"``: ``add_bos_token``
            false (``hf_export.with_document_start``).

    Returns:
        Warnings (e.g. F16 fallback for rows that Q8_0 cannot block, ``--allow-dense``).

    Raises:
        ConvertError: unknown outtype or document start, a sparse model without ``allow_dense``, no SentencePiece
            tokenizer, or a tokenizer larger than ``vocab_size``; for ``tq1_0``/``tq2_0`` weights that
            the type cannot hold exactly (see the module docstring): all before the file is opened; while
            the tensors are written, a weight that float16 cannot hold: above 65504 for F16 tensors, a
            float16 block scale that overflows for Q8_0 (max|block|/127) and TQ1_0/TQ2_0 (max|block|),
            naming the tensor (``write_gguf_dir`` then leaves nothing behind).
    """
    import gguf

    from minicpm4_jax.convert.hf_export import check_dense_only
    from minicpm4_jax.tokenizer import DOCUMENT_STARTS

    if document_start not in DOCUMENT_STARTS:
        raise ConvertError(f"document_start {document_start!r} is not one of {list(DOCUMENT_STARTS)}")
    plan = _plan(cfg, outtype)
    dense_warn = check_dense_only(cfg, _GGUF_TARGET, allow_dense, _GGUF_KEEP_HINT)
    flat = flat_params(params)
    if outtype in TERNARY_OUTTYPES:
        check_ternary_outtype(cfg, outtype, ternary)
        check_ternary_blocks(flat, cfg, outtype, ternary is not None)
    tok_dir = Path(tokenizer_dir)
    warnings = [f"{n}: row size {s[-1]} is not a multiple of the Q8_0 block; written as F16"
                for n, q, s in plan if q == "F16" and outtype == "q8_0"] + dense_warn
    if cfg.rope_scaling is not None and (note := dynamic_runtime_factor_lists(cfg)[2]):
        warnings.append(note.replace("a runtime that switches", "llama.cpp, which switches"))
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MINICPM])
    try:
        _add_metadata(w, cfg, outtype, name)
        warnings += _add_vocab(w, cfg, tok_dir, document_start)
        for gname, q, shape in plan:
            qt = gguf.GGMLQuantizationType[q]
            nb = _nbytes(shape, q)
            if q == "F32":
                w.add_tensor_info(gname, shape, np.dtype(np.float32), nb, raw_dtype=qt)
            elif q == "F16":
                w.add_tensor_info(gname, shape, np.dtype(np.float16), nb, raw_dtype=qt)
            else:
                byte_shape = (*shape[:-1], nb // max(1, int(np.prod(shape[:-1], dtype=np.int64))))
                w.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), nb, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for data in _iter_gguf_tensors(flat, cfg, plan):
            w.write_tensor_data(data)
    finally:
        w.close()
    return warnings


_GGUF_TARGET = "GGUF (llama.cpp has no InfLLM v2)"
_GGUF_KEEP_HINT = "'minicpm4 export hf --layout minicpm' keeps sparse_config"


def _check_out_is_a_folder_name(out: str | Path, outtype: str) -> None:
    if Path(out).suffix.lower() == ".gguf":
        raise ConvertError(f"--out {out} ends in .gguf, but --out is the output folder (it receives "
                           f"minicpm4-{outtype}.gguf and {MANIFEST_NAME}); give a folder, e.g. --out "
                           f"{Path(out).with_suffix('')}")


def _check_train_for(outtype: str) -> Any:
    """``(train config, step) -> None``: the config-level ternary checks of ``outtype``."""

    def check(tc: Any, step: int) -> None:
        from minicpm4_jax.quant import checkpoint_is_ternary, ternary_spec

        spec = ternary_spec(tc.qat) if checkpoint_is_ternary(tc, step) else None
        check_ternary_outtype(tc.model, outtype, spec)

    return check


def export_gguf(checkpoint: str | Path, out: str | Path, *, outtype: str = "f16", step: int | None = None,
                tokenizer: str | Path | None = None, force: bool = False,
                log: Callable[[str], Any] | None = None, allow_dense: bool = False) -> Any:
    """``minicpm4 export gguf``: checkpoint -> ``out/minicpm4-<outtype>.gguf`` + ``minicpm4_manifest.json``.

    Every check that needs no parameter runs before the parameters are read (as ``export_hf``): the
    arguments (``outtype``, ``out`` not ending in ``.gguf``), the source (checkpoint folder, step, a
    tokenizer folder with ``tokenizer.model``: the GGUF vocabulary needs it), ``out`` against the
    source and the file system, then from the stored config a sparse model without ``allow_dense``,
    the tokenizer against ``vocab_size`` and the free disk space.

    Returns:
        ``hf_export.ExportResult``.

    Raises:
        ConvertError: bad outtype or ``out``, a non-empty ``out`` without ``force``, ``out`` over the
            source, no checkpoint/tokenizer, tokenizer/vocabulary mismatch, a sparse model without
            ``allow_dense``, not enough disk: before anything is written.
    """
    from minicpm4_jax.convert.hf_export import check_dense_only, check_tokenizer, load_export_source, \
        resolve_export_source

    out_abs = Path(out).expanduser().absolute()
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not supported; use one of {list(OUTTYPES)}")
    _check_out_is_a_folder_name(out, outtype)
    paths = resolve_export_source(checkpoint, step=step, tokenizer=tokenizer, sentencepiece=True)
    refuse_output_over_source(out_abs, paths.protected())
    check_output_target(out_abs, force)

    def check(cfg: ModelConfig) -> None:
        check_dense_only(cfg, _GGUF_TARGET, allow_dense, _GGUF_KEEP_HINT)
        check_tokenizer(paths.tokenizer_dir, cfg, record_dir=paths.record_dir)
        check_disk_space(out_abs.parent, _needed_bytes(cfg, outtype))

    src = load_export_source(checkpoint, paths=paths, check_config=check, check_train=_check_train_for(outtype))
    return write_gguf_dir(src.params, src.cfg, out_abs, outtype=outtype, tokenizer_dir=src.tokenizer_dir,
                          force=force, provenance=src.provenance, log=log, allow_dense=allow_dense,
                          ternary=src.ternary)


def _needed_bytes(cfg: ModelConfig, outtype: str) -> int:
    return sum(_nbytes(s, q) for _, q, s in _plan(cfg, outtype)) + 64 * cfg.vocab_size + (4 << 20)


def write_gguf_dir(params: Any, cfg: ModelConfig, out: str | Path, *, outtype: str = "f16",
                   tokenizer_dir: str | Path | None, force: bool = False,
                   provenance: Mapping[str, Any] | None = None, log: Callable[[str], Any] | None = None,
                   allow_dense: bool = False, ternary: Any = None, document_start: str | None = None) -> Any:
    """Write ``out/minicpm4-<outtype>.gguf`` and the manifest atomically (see :func:`write_gguf`).

    ``document_start`` (default ``provenance["document_start"]``, else ``"bos"``) as :func:`write_gguf`; when given
    (here or in ``provenance``) the manifest's ``source.document_start`` records the one written.

    Raises:
        ConvertError: as :func:`export_gguf`.
    """
    from minicpm4_jax.convert.hf_export import (ExportResult, check_dense_only, check_tokenizer, export_document_start,
                                                requested_document_start)

    plan = _plan(cfg, outtype)
    _check_out_is_a_folder_name(out, outtype)
    check_output_target(Path(out), force)
    if tokenizer_dir is None:
        raise ConvertError("no tokenizer folder found next to the checkpoint; a GGUF needs the vocabulary: "
                           "pass --tokenizer DIR (with tokenizer.model)")
    tok_dir = Path(tokenizer_dir)
    if not (tok_dir / "tokenizer.model").is_file():
        raise ConvertError(f"{tok_dir} has no tokenizer.model; the GGUF vocabulary is read from a SentencePiece "
                           "model (llama.cpp's minicpm path): pass --tokenizer with one")
    _tok, warnings = check_tokenizer(tok_dir, cfg, document_start=requested_document_start(document_start, provenance))
    _run_cfg, start, source = export_document_start(cfg, document_start, provenance, _tok)
    check_dense_only(cfg, _GGUF_TARGET, allow_dense, _GGUF_KEEP_HINT)  # before anything is written
    if outtype in TERNARY_OUTTYPES:  # the weight-level check runs in write_gguf, before its file is opened
        check_ternary_outtype(cfg, outtype, ternary)
    sparse = cfg.attention == "infllmv2"
    needed = _needed_bytes(cfg, outtype)
    fname = f"minicpm4-{outtype}.gguf"
    with staged_output(out, force=force, needed_bytes=needed) as stage:
        warnings += write_gguf(params, cfg, stage / fname, outtype=outtype, tokenizer_dir=tok_dir,
                               allow_dense=allow_dense, ternary=ternary, document_start=start)
        for w_ in warnings:
            if log:
                log(f"warning: {w_}")
        manifest = {
            "format": "gguf",
            "architecture": "minicpm",
            "outtype": outtype,
            "dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0 (norms, rope factors: float32)",
                      "tq1_0": "tq1_0 (token_embd/output: float16; norms, rope factors: float32)",
                      "tq2_0": "tq2_0 (token_embd/output: float16; norms, rope factors: float32)"}[outtype],
            "file": fname,
            "source": source,
            "folded": [],
            "applied_at_runtime": ["minicpm.embedding_scale", "minicpm.residual_scale", "minicpm.logit_scale"],
            "permuted": ["attn_q and attn_k rows: HF rotate-half -> ggml NORM (interleaved) rope order"],
            "dropped": ["sparse_config"] if sparse else [],
            "attention": "dense",
            "allow_dense": bool(allow_dense and sparse),
            "warnings": warnings,
        }
        if ternary is not None:
            manifest["quantization"] = ternary.describe()
        write_manifest(stage, manifest)
    return ExportResult(path=Path(out).expanduser().absolute(), files=[fname], warnings=warnings, manifest=manifest)


def read_gguf_params(path: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our flat float32 params from a GGUF written for ``cfg`` (dequantized, q/k un-permuted).

    Used to check an export end to end: for F32 the result equals the exported parameters bit for bit.

    Raises:
        ConvertError: not a ``minicpm`` GGUF, or a tensor is missing or mis-shaped.
    """
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields.get("general.architecture")
    arch_s = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else None
    if arch_s != "minicpm":
        raise ConvertError(f"{path} is a {arch_s!r} GGUF, not 'minicpm'")
    tens = {t.name: t for t in r.tensors}
    names = _gguf_names(cfg)
    shapes = official_param_shapes(cfg)

    def get(hf_name: str) -> np.ndarray:
        g = names[hf_name]
        if g not in tens:
            raise ConvertError(f"{path} has no tensor {g!r} ({hf_name})")
        t = tens[g]
        a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shapes[hf_name])
        if hf_name.endswith("self_attn.q_proj.weight"):
            a = unpermute_qk(a, cfg.num_attention_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            a = unpermute_qk(a, cfg.num_key_value_heads)
        return a

    return from_official(get, cfg, np.float32)
