"""Tokenizers: load a SentencePiece ``tokenizer.model`` or a Hugging Face ``tokenizer.json``, train one.

* :class:`Tokenizer` wraps either backend behind one small API (``encode`` without BOS/EOS,
  ``decode``, ``vocab_size``, special ids, ``save``).
* :func:`load_tokenizer` picks the backend from a file name or a folder's content (the official
  MiniCPM4 folder holds ``tokenizer.model`` + ``added_tokens.json`` + ``tokenizer_config.json``).
* :func:`train_tokenizer` trains the default tokenizer the way the official MiniCPM one is built: a
  SentencePiece **BPE with byte fallback**, ``<unk>``=0, ``<s>``=1, ``</s>``=2, no pad piece,
  ``split_digits``, ``allow_whitespace_only_pieces``, identity normalisation without a dummy prefix
  and without collapsing whitespace (so code indentation survives a round trip), ``"\\n"`` and
  ``"\\t"`` as user-defined pieces (as in the official model). Training is single-threaded with a
  seeded, sorted sentence sample, so two trainings give byte-identical ``tokenizer.model`` files;
  results are cached under a key that hashes the corpus and every setting.
* :meth:`Tokenizer.save` writes ``tokenizer.model`` (SentencePiece), ``tokenizer.json`` (converted
  with the logic of transformers' ``LlamaConverter``: BPE vocab + merges ranked by piece score, byte
  fallback, user-defined/control pieces as added tokens, ``" "`` -> ``"▁"`` normaliser) and
  ``tokenizer_config.json`` (``LlamaTokenizer``), which is what HF loaders and llama.cpp's
  ``convert_hf_to_gguf.py`` (``_set_vocab_sentencepiece`` reads ``tokenizer.model``) expect.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ConfigError
from minicpm4_jax.convert.io import atomic_write

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "load_run_tokenizer",
    "check_tokenizer_vocab",
    "check_tokenizer_record",
    "document_start",
    "usable_document_start",
    "DOCUMENT_STARTS",
    "train_tokenizer",
    "sentencepiece_to_hf_json",
    "bos_eos_post_processor",
    "with_bos_eos_post_processor",
    "SPM_TRAINER_SETTINGS",
]

#: SentencePiece trainer settings of the default tokenizer (mirrors the official MiniCPM4 model's
#: ``trainer_spec``/``normalizer_spec``; ``vocab_size`` and the sentence sample come from the caller).
SPM_TRAINER_SETTINGS: dict[str, Any] = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    split_by_unicode_script=True,
    split_by_whitespace=True,
    allow_whitespace_only_pieces=True,
    remove_extra_whitespaces=False,
    normalization_rule_name="identity",
    add_dummy_prefix=False,
    user_defined_symbols=["\n", "\t"],
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    unk_piece="<unk>",
    bos_piece="<s>",
    eos_piece="</s>",
    character_coverage=0.9995,
    max_sentence_length=16384,
    num_threads=1,
    input_sentence_size=0,
    shuffle_input_sentence=False,
)

_TRAIN_FORMAT = 2  # bump when the training recipe changes (invalidates cached tokenizers); 2: long lines in pieces


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _token_str(tok: Any) -> str | None:
    """A special token from a tokenizer_config.json entry (a string or an AddedToken dict)."""
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


class Tokenizer:
    """A SentencePiece or Hugging Face ``tokenizers`` tokenizer behind one API.

    Construct with :func:`load_tokenizer`, :func:`train_tokenizer` or the ``from_*`` class methods.
    ``encode`` never adds BOS/EOS; special-token strings listed in ``added_tokens.json`` (e.g. the
    official ``<|im_end|>`` = 73440) are recognised in the text. ``kind`` is ``"sentencepiece"`` or
    ``"hf"``. ``file_hash`` is the SHA-256 of the files that define the tokenizer (model bytes plus
    added tokens), used by the data cache to notice a changed tokenizer.
    """

    def __init__(
        self,
        *,
        sp_model: bytes | None = None,
        hf_json: str | None = None,
        added_tokens: dict[str, int] | None = None,
        hf_config: dict[str, Any] | None = None,
        source: str = "",
    ) -> None:
        if (sp_model is None) == (hf_json is None):
            raise ValueError("give exactly one of sp_model / hf_json")
        self.source = source
        self._hf_config = dict(hf_config or {})
        self.added_tokens: dict[str, int] = dict(added_tokens or {})
        self._sp = None
        self._hf = None
        self._sp_bytes = sp_model
        self._hf_json = hf_json
        if sp_model is not None:
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor()
            try:
                sp.LoadFromSerializedProto(sp_model)
            except Exception as e:  # noqa: BLE001 - sentencepiece raises plain RuntimeError/OSError
                raise ConfigError(
                    f"tokenizer {source or '<bytes>'} is not a valid SentencePiece model ({e}); "
                    "give a tokenizer.model file or data.tokenizer=train"
                ) from None
            self._sp = sp
            self.kind = "sentencepiece"
            base = sp.get_piece_size()
            self._base_size = base
            self._id_to_added = {i: t for t, i in self.added_tokens.items() if i >= base}
            h = hashlib.sha256(sp_model)
            if self._id_to_added:  # only tokens past the pieces change what encode/decode do
                h.update(json.dumps(sorted(self._id_to_added.items())).encode())
            self.file_hash = h.hexdigest()
            toks = sorted(self._id_to_added.values(), key=len, reverse=True)
            self._added_re = re.compile("|".join(re.escape(t) for t in toks)) if toks else None
        else:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._hf = HFTokenizer.from_str(hf_json)
            except Exception as e:  # noqa: BLE001
                raise ConfigError(
                    f"tokenizer {source or '<json>'} is not a valid tokenizer.json ({str(e).splitlines()[0]}); "
                    "give a Hugging Face tokenizer.json, a tokenizer.model or data.tokenizer=train"
                ) from None
            self.kind = "hf"
            self._base_size = self._hf.get_vocab_size(with_added_tokens=True)
            self._id_to_added = {}
            self._added_re = None
            self.file_hash = _sha256(hf_json.encode())

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_sentencepiece(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.model``; ``added_tokens.json``/``tokenizer_config.json`` beside it are used too.

        Raises:
            ConfigError: the file is missing or not a SentencePiece model.
        """
        p = Path(path)
        data = _read_bytes(p, "tokenizer")
        added = _read_json(p.parent / "added_tokens.json") or {}
        cfg = _read_json(p.parent / "tokenizer_config.json") or {}
        # added_tokens_decoder entries with ids beyond the SentencePiece vocab are added tokens too.
        for sid, entry in (cfg.get("added_tokens_decoder") or {}).items():
            content = _token_str(entry)
            if content is not None and content not in added:
                added[content] = int(sid)
        return cls(sp_model=data, added_tokens={k: int(v) for k, v in added.items()}, hf_config=cfg, source=str(p))

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a Hugging Face ``tokenizer.json`` (``tokenizer_config.json`` beside it names the specials).

        Raises:
            ConfigError: the file is missing or not a valid ``tokenizer.json``.
        """
        p = Path(path)
        data = _read_bytes(p, "tokenizer")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"tokenizer {p} is not UTF-8 JSON; give a Hugging Face tokenizer.json") from None
        cfg = _read_json(p.parent / "tokenizer_config.json") or {}
        return cls(hf_json=text, hf_config=cfg, source=str(p))

    # ---- properties ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids: SentencePiece pieces plus added tokens beyond them (73448 for MiniCPM4)."""
        if self.kind == "sentencepiece":
            extra = max(self._id_to_added, default=self._base_size - 1) + 1
            return max(self._base_size, extra)
        return self._base_size

    def _special_id(self, name: str, default_tokens: Sequence[str]) -> int | None:
        tok = _token_str(self._hf_config.get(name))
        cands = ([tok] if tok else []) + list(default_tokens)
        for c in cands:
            i = self.token_to_id(c)
            if i is not None:
                return i
        return None

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token (``<s>`` = 1 for MiniCPM), ``None`` when absent."""
        if self.kind == "sentencepiece":
            i = self._sp.bos_id()
            return i if i >= 0 else None
        return self._special_id("bos_token", ["<s>", "<|begin_of_text|>", "<bos>"])

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence / document separator token (``</s>`` = 2), ``None`` when absent.

        For SentencePiece this is the model's own eos piece (``</s>``), not the chat ``eos_token``
        (``<|im_end|>``) of the official ``tokenizer_config.json``: pretraining separates documents
        with ``</s>``.
        """
        if self.kind == "sentencepiece":
            i = self._sp.eos_id()
            return i if i >= 0 else None
        return self._special_id("eos_token", ["</s>", "<|endoftext|>", "<eos>"])

    @property
    def pad_id(self) -> int | None:
        """Id of the padding token, ``None`` when the tokenizer has none (the default tokenizer has none)."""
        if self.kind == "sentencepiece":
            i = self._sp.pad_id()
            return i if i >= 0 else None
        return self._special_id("pad_token", ["<pad>"])

    @property
    def unk_id(self) -> int | None:
        """Id of the unknown token (``<unk>`` = 0), ``None`` when absent."""
        if self.kind == "sentencepiece":
            i = self._sp.unk_id()
            return i if i >= 0 else None
        return self._special_id("unk_token", ["<unk>"])

    def token_to_id(self, token: str) -> int | None:
        """Id of one piece/token string, ``None`` when it is not in the vocabulary."""
        if token in self.added_tokens:
            return self.added_tokens[token]
        if self.kind == "sentencepiece":
            i = self._sp.piece_to_id(token)
            return None if (i == self._sp.unk_id() and token != self._sp.id_to_piece(i)) else i
        return self._hf.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        """The piece string of id ``i``."""
        if i in self._id_to_added:
            return self._id_to_added[i]
        if self.kind == "sentencepiece":
            return self._sp.id_to_piece(int(i))
        return self._hf.id_to_token(int(i))

    # ---- encode / decode -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Token ids of each text (no BOS/EOS), encoded in parallel (``num_threads`` ``None``: all cores)."""
        texts = list(texts)
        if self.kind == "hf":
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        nt = num_threads if num_threads is not None else (os.cpu_count() or 1)
        if self._added_re is None:
            return self._sp.encode(texts, num_threads=nt)
        out = []
        for t in texts:
            ids: list[int] = []
            pos = 0
            for m in self._added_re.finditer(t):
                if m.start() > pos:
                    ids.extend(self._sp.encode(t[pos : m.start()]))
                ids.append(self.added_tokens[m.group(0)])
                pos = m.end()
            if pos < len(t):
                ids.extend(self._sp.encode(t[pos:]))
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (special/control tokens such as ``<s>`` decode to nothing)."""
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self._hf.decode(ids, skip_special_tokens=False)
        if not self._id_to_added:
            return self._sp.decode(ids)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._id_to_added:
                if run:
                    parts.append(self._sp.decode(run))
                    run = []
                parts.append(self._id_to_added[i])
            else:
                run.append(i)
        if run:
            parts.append(self._sp.decode(run))
        return "".join(parts)

    # ---- export --------------------------------------------------------------------------------
    def to_hf_json(self) -> str:
        """The ``tokenizer.json`` text (converted from the SentencePiece model when needed).

        A converted one gets the BOS/EOS post-processor that :meth:`tokenizer_config` states
        (``add_bos_token``/``add_eos_token`` with its ``bos_token``/``eos_token``): transformers reads the
        post-processor from ``tokenizer.json`` and ignores those two flags when the file exists.
        A loaded ``tokenizer.json`` is returned as it is.
        """
        if self.kind == "hf":
            return self._hf_json
        cfg = self.tokenizer_config()
        return sentencepiece_to_hf_json(self._sp_bytes, added_tokens=self._id_to_added,
                                        add_bos_token=bool(cfg.get("add_bos_token")),
                                        add_eos_token=bool(cfg.get("add_eos_token")),
                                        bos_token=_token_str(cfg.get("bos_token")),
                                        eos_token=_token_str(cfg.get("eos_token")))

    def tokenizer_config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` dict written by :meth:`save`."""
        cfg = dict(self._hf_config)
        if self.kind == "sentencepiece":
            cfg.setdefault("tokenizer_class", "LlamaTokenizer")
            cfg.setdefault("legacy", True)  # plain sp_model.encode, no extra prefix handling
            # transformers 5 rebuilds LlamaTokenizer from tokenizer.model and prepends "▁" unless told
            # otherwise: state the model's own dummy-prefix rule explicitly (checked in
            # tests/test_tokenizer_hf.py against AutoTokenizer)
            cfg["add_prefix_space"] = self._sp.encode_as_pieces("a")[0].startswith("\u2581")
            cfg.setdefault("sp_model_kwargs", {})
        else:
            cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        cfg.setdefault("add_bos_token", True)
        cfg.setdefault("add_eos_token", False)
        cfg.setdefault("clean_up_tokenization_spaces", False)
        cfg.setdefault("spaces_between_special_tokens", False)
        cfg.setdefault("model_max_length", 1_000_000)
        for name, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("unk_token", self.unk_id)):
            if name not in cfg:
                cfg[name] = self.id_to_token(tid) if tid is not None else None
        cfg.setdefault("pad_token", self.id_to_token(self.pad_id) if self.pad_id is not None else None)
        if "added_tokens_decoder" not in cfg:
            dec: dict[str, Any] = {}
            specials = {i for i in (self.unk_id, self.bos_id, self.eos_id, self.pad_id) if i is not None}
            specials |= set(self._id_to_added)
            for i in sorted(specials):
                dec[str(i)] = {
                    "content": self.id_to_token(i),
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
            cfg["added_tokens_decoder"] = dec
        return cfg

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Write the tokenizer files into ``directory`` (created if needed); returns the paths written.

        SentencePiece: ``tokenizer.model``, ``tokenizer.json``, ``tokenizer_config.json``,
        ``special_tokens_map.json`` (+ ``added_tokens.json`` when there are added tokens).
        ``tokenizers``: ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.
        Each file is written atomically (temp file + rename).
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        written = []
        if self.kind == "sentencepiece":
            written.append(atomic_write(d / "tokenizer.model", self._sp_bytes))
            if self._id_to_added:
                added = {t: i for i, t in sorted(self._id_to_added.items())}
                written.append(atomic_write(d / "added_tokens.json", json.dumps(added, indent=2).encode()))
        written.append(atomic_write(d / "tokenizer.json", self.to_hf_json().encode("utf-8")))
        cfg = self.tokenizer_config()
        written.append(atomic_write(d / "tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False).encode()))
        stm = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(k) is not None}
        if cfg.get("additional_special_tokens"):
            stm["additional_special_tokens"] = cfg["additional_special_tokens"]
        written.append(atomic_write(d / "special_tokens_map.json", json.dumps(stm, indent=2, ensure_ascii=False).encode()))
        return written

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, source={self.source!r})"


# ------------------------------------------------------------------------------------------------
# SentencePiece -> tokenizer.json (transformers' LlamaConverter logic, reimplemented minimally)
# ------------------------------------------------------------------------------------------------


def _spm_proto(model_bytes: bytes):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(model_bytes)
    return m


def bos_eos_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None, add_bos: bool,
                           add_eos: bool) -> Any:
    """The ``tokenizers`` post-processor that adds BOS/EOS as ``add_bos_token``/``add_eos_token`` say.

    The template transformers' ``LlamaTokenizerFast.update_post_processor`` builds: single
    ``[BOS] $A [EOS]``, pair ``[BOS] $A [EOS] [BOS] $B [EOS]`` (each bracket only when its flag is on).

    Args:
        bos, eos: ``(token, id)`` or ``None`` when the tokenizer has no such token.
        add_bos, add_eos: the ``tokenizer_config.json`` flags.

    Returns:
        A ``tokenizers.processors.TemplateProcessing``.

    Raises:
        ConfigError: a flag is on but its token is ``None``.
    """
    from tokenizers import processors

    for flag, tok, what in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and tok is None:
            raise ConfigError(f"add_{what}_token is true but the tokenizer has no {what}_token; set add_{what}_token "
                              f"false in tokenizer_config.json or give a {what}_token")
    a = ([f"{bos[0]}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if add_eos else [])
    b = ([f"{bos[0]}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if add_eos else [])
    specials = ([bos] if add_bos else []) + ([eos] if add_eos and eos != bos else [])
    return processors.TemplateProcessing(single=" ".join(a), pair=" ".join(a + b), special_tokens=specials)


def sentencepiece_to_hf_json(model_bytes: bytes, added_tokens: dict[int, str] | None = None, *,
                             add_bos_token: bool = True, add_eos_token: bool = False, bos_token: str | None = None,
                             eos_token: str | None = None) -> str:
    """Convert a SentencePiece **BPE** model to a Hugging Face ``tokenizer.json`` string.

    As transformers' ``LlamaConverter``: vocab = pieces in id order; merges = every split of a piece
    into two in-vocab pieces, ranked by the merged piece's score (stable, descending); ``BPE(...,
    byte_fallback=True, fuse_unk=True)``; control pieces become special added tokens, user-defined
    pieces non-special added tokens (``normalized=False``); normaliser ``" " -> "▁"`` (plus a ``"▁"``
    prefix only when the model has ``add_dummy_prefix``); decoder Replace/ByteFallback/Fuse
    (+Strip when prefixed). ``added_tokens`` (id -> content, ids past the pieces) are appended as
    special tokens. The post-processor is :func:`bos_eos_post_processor` of ``add_bos_token`` /
    ``add_eos_token`` (transformers takes BOS/EOS insertion from ``tokenizer.json``, not from
    ``tokenizer_config.json``, when the file exists; as ``LlamaTokenizerFast`` saves it).

    Args:
        bos_token, eos_token: the BOS/EOS token strings (a piece or an ``added_tokens`` entry);
            ``None``: the model's own ``bos``/``eos`` piece (none when the model has none).

    Raises:
        ConfigError: the model is not BPE or not byte-fallback; a ``bos_token``/``eos_token`` that
            is not in the vocabulary, or none while its ``add_*_token`` is true.
    """
    from tokenizers import AddedToken, decoders, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    m = _spm_proto(model_bytes)
    if m.trainer_spec.model_type != 2:  # BPE
        raise ConfigError("tokenizer.json export supports SentencePiece BPE models only (this one is not BPE)")
    pieces = [(p.piece, p.score) for p in m.pieces]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in pieces:
        local = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2], reverse=True)  # stable: ties keep piece-id order
    unk = m.trainer_spec.unk_piece or "<unk>"
    tok = HFTokenizer(
        BPE(
            vocab,
            [(a, b) for a, b, _ in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=bool(m.trainer_spec.byte_fallback),
            dropout=None,
        )
    )
    dummy = bool(m.normalizer_spec.add_dummy_prefix)
    seq = [normalizers.Prepend("▁")] if dummy else []
    seq.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(seq)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if dummy:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    # control (3) and unknown (2) pieces are special; user-defined (4) are plain added tokens.
    added = [
        AddedToken(p.piece, normalized=False, special=p.type in (2, 3))
        for p in m.pieces
        if p.type in (2, 3, 4)
    ]
    tok.add_tokens(added)
    if added_tokens:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for _, t in sorted(added_tokens.items())])
    ids = {**vocab, **{t: i for i, t in (added_tokens or {}).items()}}

    def special(name: str, given: str | None, own_id: int) -> tuple[str, int] | None:
        if given is None:
            return (pieces[own_id][0], own_id) if 0 <= own_id < len(pieces) else None
        if given not in ids:
            raise ConfigError(f"{name} {given!r} is not in the tokenizer's vocabulary; set {name} in "
                              "tokenizer_config.json to one of its tokens")
        return given, ids[given]

    tok.post_processor = bos_eos_post_processor(special("bos_token", bos_token, m.trainer_spec.bos_id),
                                                special("eos_token", eos_token, m.trainer_spec.eos_id),
                                                add_bos_token, add_eos_token)
    return tok.to_str(pretty=True)


def with_bos_eos_post_processor(hf_json: str, tokenizer_config: dict[str, Any], *, replace: bool = False) -> str | None:
    """``hf_json`` with the :func:`bos_eos_post_processor` of ``tokenizer_config``, when it has none (or ``replace``).

    For a ``tokenizer.json`` whose ``post_processor`` is ``null`` (as this project wrote it before the
    converter added one): transformers 5 then adds no BOS although ``tokenizer_config.json`` says
    ``add_bos_token: true`` (it ignores the flag when ``tokenizer.json`` exists). Only that key is
    changed.

    Args:
        hf_json: the ``tokenizer.json`` text.
        tokenizer_config: the ``tokenizer_config.json`` dict (``add_bos_token`` default true,
            ``add_eos_token`` default false, as ``LlamaTokenizer``; ``bos_token``/``eos_token``).
        replace: also when ``hf_json`` has a post-processor (an export that changes the BOS token or
            ``add_bos_token``): a ``TemplateProcessing`` is replaced, a ``Sequence`` keeps its other members
            with the template last, a ``ByteLevel`` becomes ``Sequence([ByteLevel, template])``.

    Returns:
        The new text, or ``None`` when ``hf_json`` already has a post-processor and ``replace`` is false.

    Raises:
        ConfigError: ``hf_json`` is not a valid ``tokenizer.json``, a BOS/EOS token to add is not in its
            vocabulary, or (``replace``) its post-processor is one that adds its own special tokens
            (``RobertaProcessing``, ``BertProcessing``).
    """
    from tokenizers import Tokenizer as HFTokenizer

    try:
        data = json.loads(hf_json)
        old = data.get("post_processor")
        if old is not None and not replace:
            return None
        hf = HFTokenizer.from_str(hf_json)
    except Exception as e:  # noqa: BLE001 - json and tokenizers raise several kinds
        raise ConfigError(f"tokenizer.json is not valid ({str(e).splitlines()[0]}); fix or remove it") from None
    add_bos = bool(tokenizer_config.get("add_bos_token", True))
    add_eos = bool(tokenizer_config.get("add_eos_token", False))

    def special(name: str, flag: bool) -> tuple[str, int] | None:
        t = _token_str(tokenizer_config.get(name))
        if t is None:
            return None
        i = hf.token_to_id(t)
        if i is None:
            if not flag:
                return None
            raise ConfigError(f"{name} {t!r} of tokenizer_config.json is not in tokenizer.json's vocabulary; set "
                              f"{name} to one of its tokens")
        return t, i

    hf.post_processor = bos_eos_post_processor(special("bos_token", add_bos), special("eos_token", add_eos),
                                               add_bos, add_eos)
    template = json.loads(hf.to_str())["post_processor"]
    kind = old.get("type") if isinstance(old, dict) else None
    if old is None or kind == "TemplateProcessing":
        data["post_processor"] = template
    elif kind == "Sequence":
        keep = [q for q in old.get("processors") or []
                if not (isinstance(q, dict) and q.get("type") == "TemplateProcessing")]
        data["post_processor"] = {**old, "processors": keep + [template]}
    elif kind == "ByteLevel":
        data["post_processor"] = {"type": "Sequence", "processors": [old, template]}
    else:
        raise ConfigError(f"tokenizer.json's post_processor is {kind}, which adds its own special tokens, so the "
                          "BOS of tokenizer_config.json cannot be put in front; use a tokenizer.json whose "
                          "post_processor is TemplateProcessing, ByteLevel or null")
    return json.dumps(data, indent=2, ensure_ascii=False)


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


def _read_bytes(p: Path, what: str) -> bytes:
    if not p.exists():
        raise ConfigError(
            f"{what} path {p} does not exist; give a tokenizer.model / tokenizer.json file, a folder holding "
            "one, or data.tokenizer=train"
        )
    try:
        return p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} path {p} cannot be read ({e.strerror}); check its permissions") from None


def _read_json(p: Path) -> Any:
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON ({e}); fix or remove it") from None


def load_tokenizer(path: str | os.PathLike, *, fix: str | None = None) -> Tokenizer:
    """Load a tokenizer from a ``tokenizer.model``/``*.model`` file, a ``tokenizer.json``/``*.json``
    file, or a folder holding ``tokenizer.model`` (preferred) or ``tokenizer.json``.

    Args:
        fix: the hint that ends an error's message in place of the default one, which suits a training
            config's ``data.tokenizer`` (``... or data.tokenizer=train``); e.g. a command's ``--tokenizer``.

    Raises:
        ConfigError: (one line, naming the path and the fix) when the path does not exist, the folder
            holds neither file, the extension is unknown, or the file does not parse.
    """
    try:
        return _load_tokenizer(Path(os.path.expanduser(str(path))))
    except ConfigError as e:
        what, sep, hint = str(e).rpartition("; ")
        if fix is None or not sep or "data.tokenizer" not in hint:
            raise
        raise ConfigError(f"{what}; {fix}") from None


def load_run_tokenizer(run: str | os.PathLike, ckpt_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved beside a run's checkpoints (``generate``, ``eval``): the first folder of
    ``run/tokenizer``, ``ckpt_dir/../tokenizer`` and ``ckpt_dir/tokenizer``, checked against the run.

    Raises:
        ConfigError: no such folder; its tokenizer does not load; or the run's ``data.json`` (written by ``train``)
            records another tokenizer's ``tokenizer_hash`` (a tokenizer swapped in would decode every id to the
            wrong text). Each message names the folder and the fix. The model's side is
            :func:`check_tokenizer_vocab`.
    """
    ckpt = Path(ckpt_dir)
    cands = list(dict.fromkeys(p.absolute() for p in (Path(run) / "tokenizer", ckpt.parent / "tokenizer",
                                                       ckpt / "tokenizer")))  # distinct, in order
    tok_dir = next((c for c in cands if c.is_dir()), None)
    if tok_dir is None:
        raise ConfigError(f"no tokenizer folder next to the checkpoint (looked in {', '.join(map(str, cands))}); "
                          f"copy the tokenizer folder of the run the model was trained in (or imported from) to {cands[0]}")
    fix = (f"restore {tok_dir} from the tokenizer the model was trained with (the run's tokenizer/ folder, or the "
           "Hugging Face folder it was imported from)")
    tok = load_tokenizer(tok_dir, fix=fix)
    check_tokenizer_record(tok, tok_dir.parent, f"the tokenizer in {tok_dir}", fix)
    return tok


def check_tokenizer_record(tokenizer: Any, run_dir: str | os.PathLike, what: str, fix: str) -> None:
    """Raise ConfigError when the run in ``run_dir`` records another tokenizer than ``tokenizer``.

    The record is ``data.json``'s ``tokenizer_hash`` (written by ``train``), else the ``tokenizer_hash`` of an
    import's ``minicpm4_manifest.json`` (``minicpm4 import``); without either (or with an unreadable one) there is
    nothing to compare. A tokenizer swapped in would decode every id to the wrong text. ``what`` names the
    tokenizer in the message, ``fix`` ends it.
    """
    run = Path(run_dir)
    saved, record = None, None
    for name, ok in (("data.json", lambda d: True),
                     ("minicpm4_manifest.json", lambda d: str(d.get("format", "")).startswith("import"))):
        try:
            data = json.loads((run / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and ok(data) and isinstance(data.get("tokenizer_hash"), str) and data["tokenizer_hash"]:
            saved, record = data["tokenizer_hash"], run / name
            break
    digest = getattr(tokenizer, "file_hash", "")
    if saved is not None and digest and saved != digest:
        raise ConfigError(f"{what} (sha256 {digest[:12]}) is not the one {record} records for this run "
                          f"(sha256 {saved[:12]}); {fix}")


#: What a document of a model starts after: its tokenizer's EOS or BOS token, or nothing.
DOCUMENT_STARTS = ("eos", "bos", "none")


def document_start(run: str | os.PathLike, ckpt_dir: str | os.PathLike | None = None, tokenizer: Any = None) -> str:
    """The token a document of this run's model starts after: ``"eos"``, ``"bos"`` or ``"none"``.

    A run trained here (its folder holds ``data.json``) saw every document after the EOS that ends the previous
    one (``train.data``: documents joined with EOS), so it is prompted after ``[eos_id]``. An imported checkpoint
    (an ``import`` ``minicpm4_manifest.json``) takes what the import recorded as ``document_start``: the source's
    own record when it was exported by this project, else its tokenizer's ``add_bos_token`` (the official
    MiniCPM4 tokenizers: true, so ``"bos"``; imports written before the record existed: ``"bos"``). Anything
    else: ``"eos"``. ``generate``, ``eval`` and the lm-eval backend use this unless told otherwise (``--prefix``).

    Args:
        run: the run folder (``out_dir``) or its ``checkpoints`` folder, as the user gave it.
        ckpt_dir: the checkpoint folder :func:`~minicpm4_jax.train.checkpoint.find_checkpoint_dir` found (its
            parent is looked at too).
        tokenizer: the run's tokenizer, if loaded: ``"none"`` when it lacks the token (``bos_id`` / ``eos_id``
            ``None`` or negative).
    """
    return usable_document_start(_recorded_document_start(run, ckpt_dir), tokenizer)


def usable_document_start(start: str, tokenizer: Any = None) -> str:
    """``start`` (``"eos"`` / ``"bos"`` / ``"none"``), or ``"none"`` when ``tokenizer`` (if given) lacks that token
    (its ``eos_id`` / ``bos_id`` ``None`` or negative)."""
    tid = None if tokenizer is None or start == "none" else getattr(tokenizer, f"{start}_id", None)
    return "none" if tokenizer is not None and (tid is None or tid < 0) else start


def _recorded_document_start(run: str | os.PathLike, ckpt_dir: str | os.PathLike | None) -> str:
    folders = [Path(run)] + ([Path(ckpt_dir).parent] if ckpt_dir is not None else [])
    for folder in dict.fromkeys(f.absolute() for f in folders):
        if (folder / "data.json").is_file():
            return "eos"
        path = folder / "minicpm4_manifest.json"
        if not path.is_file():
            continue
        try:  # a run folder holding a manifest is an import's (an export folder is never a run): a damaged one
            manifest = json.loads(path.read_text(encoding="utf-8"))  # still says so (helper 71)
        except (OSError, ValueError):
            return "bos"
        if not isinstance(manifest, dict) or str(manifest.get("format", "")).startswith("import"):
            start = manifest.get("document_start", "bos") if isinstance(manifest, dict) else "bos"
            return start if start in DOCUMENT_STARTS else "bos"
    return "eos"


def check_tokenizer_vocab(tokenizer: Any, vocab_size: int) -> None:
    """Raise ConfigError when ``tokenizer`` has more tokens than the model's ``vocab_size`` (its ids past the
    embedding table): it is not the model's tokenizer. Fewer is fine (the vocabulary is padded)."""
    n = getattr(tokenizer, "vocab_size", None)
    if n is not None and int(n) > vocab_size:
        src = getattr(tokenizer, "source", "")
        raise ConfigError(f"the tokenizer{' ' + str(src) if src else ''} has {n} tokens but the model's vocab_size is {vocab_size}, so it is "
                          "not the model's tokenizer; use the tokenizer the model was trained with (its run's "
                          "tokenizer/ folder, or the Hugging Face folder it was imported from)")


def _load_tokenizer(p: Path) -> Tokenizer:
    if not p.exists():
        raise ConfigError(
            f"tokenizer path {p} does not exist; give a tokenizer.model / tokenizer.json file, a folder holding "
            "one, or data.tokenizer=train"
        )
    if p.is_dir():
        if (p / "tokenizer.model").is_file():
            return Tokenizer.from_sentencepiece(p / "tokenizer.model")
        if (p / "tokenizer.json").is_file():
            return Tokenizer.from_hf_json(p / "tokenizer.json")
        raise ConfigError(
            f"tokenizer folder {p} holds neither tokenizer.model nor tokenizer.json; point at a folder or file "
            "that has one, or use data.tokenizer=train"
        )
    if p.suffix == ".model":
        return Tokenizer.from_sentencepiece(p)
    if p.suffix == ".json":
        if p.name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "config.json"):
            raise ConfigError(f"tokenizer path {p} is a config file, not a tokenizer; give tokenizer.json or its folder")
        return Tokenizer.from_hf_json(p)
    raise ConfigError(
        f"tokenizer path {p} is neither a .model (SentencePiece) nor a .json (tokenizer.json) file; "
        "give one of those or its folder"
    )


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------


def _iter_texts(corpus: Iterable[str | os.PathLike]) -> Iterable[str]:
    for item in corpus:
        if isinstance(item, (str,)):
            yield item
        elif isinstance(item, os.PathLike):
            p = Path(item)
            try:
                yield p.read_bytes().decode("utf-8")
            except FileNotFoundError:
                raise ConfigError(f"tokenizer training file {p} does not exist; fix the path") from None
            except UnicodeDecodeError:
                continue  # not UTF-8: skipped, as the data pipeline does
        else:
            raise TypeError(f"train_tokenizer corpus items must be str texts or paths, got {type(item).__name__}")


def special_id_mismatches(tok: Any, model_cfg: Any, document_start: str | None = None) -> list[str]:
    """How the tokenizer's bos / eos ids disagree with ``model.bos_token_id`` / ``model.eos_token_id`` (empty when
    they agree or the tokenizer has none): the data pipeline ends documents with the tokenizer's eos, while an
    export writes the model's ids into ``config.json`` / ``generation_config.json`` (a runtime then stops on
    another token).

    With ``document_start="eos"`` a ``model.bos_token_id`` equal to the tokenizer's eos id is no mismatch: it is the
    id an export writes as the BOS for such a model anyway (``hf_export.with_document_start``), and what ``import
    hf --no-tokenizer`` of such an export keeps, not knowing the tokenizer's own BOS."""
    out = []
    runtime_bos = document_start == "eos" and model_cfg.bos_token_id == getattr(tok, "eos_id", None)
    if getattr(tok, "bos_id", None) is not None and tok.bos_id != model_cfg.bos_token_id and not runtime_bos:
        out.append(f"tokenizer bos id {tok.bos_id} != model.bos_token_id {model_cfg.bos_token_id}")
    if getattr(tok, "eos_id", None) is not None and tok.eos_id not in tuple(model_cfg.eos_token_id):
        out.append(f"tokenizer eos id {tok.eos_id} is not in model.eos_token_id {list(model_cfg.eos_token_id)}")
    return out


def _split_long(line: str, limit: int) -> list[str]:
    """``line`` in pieces of at most ``limit`` UTF-8 bytes, each cut before a space where one lies in the piece's
    second half (else inside a word, on a character boundary). Linear in the line's length."""
    def nbytes(a: int, b: int) -> int:
        return len(line[a:b].encode("utf-8", "surrogatepass"))

    n = len(line)
    if n * 4 <= limit or nbytes(0, n) <= limit:
        return [line]
    out: list[str] = []
    pos = 0
    while pos < n:
        lo, hi = 1, min(n - pos, limit)  # the longest piece within the limit (bytes >= characters)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if nbytes(pos, pos + mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        if pos + lo >= n:
            out.append(line[pos:])
            break
        space = line.rfind(" ", pos + lo // 2, pos + lo)
        cut = space if space > pos else pos + lo
        out.append(line[pos:cut])
        pos = cut
    return out


def _sentences(texts: Iterable[str]) -> list[str]:
    """The trainer's sentences: every non-empty line, a line longer than the trainer's ``max_sentence_length``
    bytes in pieces (SentencePiece skips such a sentence without a word: a corpus of long lines, e.g. JSON
    records or minified code, trained its tokenizer on its short lines only)."""
    limit = SPM_TRAINER_SETTINGS["max_sentence_length"]
    out: list[str] = []
    for t in texts:
        for line in t.split("\n"):
            if line:
                out.extend(_split_long(line, limit))
    return out


def train_tokenizer(
    corpus: Iterable[str | os.PathLike],
    vocab_size: int,
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    max_sentences: int = 2_000_000,
    corpus_hash: str | None = None,
    log: Callable[[str], Any] = print,
) -> Tokenizer:
    """Train (or fetch from cache) the default SentencePiece BPE tokenizer on ``corpus``.

    ``corpus``: texts (``str``, one document each) or file paths (``os.PathLike``, read as UTF-8;
    files that are not UTF-8 are skipped). Documents are split into lines (the trainer's sentences;
    ``"\\n"`` itself is a user-defined piece; a line over the trainer's 16,384 bytes in pieces); if there
    are more than ``max_sentences`` lines, a seeded sample of them (kept in corpus order) is used. Settings
    are :data:`SPM_TRAINER_SETTINGS`.

    The model is cached in ``out_dir/spm-<key>/`` where ``key`` hashes the corpus (``corpus_hash``
    when the caller already has a content hash, else the sentences themselves), ``vocab_size``,
    ``seed``, ``max_sentences``, the settings and the sentencepiece version; a hit skips training.
    The folder is written atomically and holds ``tokenizer.model``, ``tokenizer.json`` and
    ``tokenizer_config.json`` (see :meth:`Tokenizer.save`).

    Returns:
        The trained :class:`Tokenizer` (``vocab_size`` pieces, unk 0, bos 1, eos 2, no pad).

    Raises:
        ConfigError: empty corpus, or a vocabulary size the corpus cannot support (the message gives
            SentencePiece's limit).
    """
    import sentencepiece as spm

    if vocab_size < 260:
        raise ConfigError(f"tokenizer vocab_size={vocab_size} is too small; byte fallback needs >= 260 (256 bytes + specials)")
    sentences: list[str] | None = None
    settings = {
        "format": _TRAIN_FORMAT,
        "vocab_size": int(vocab_size),
        "seed": int(seed),
        "max_sentences": int(max_sentences),
        "trainer": {k: v for k, v in SPM_TRAINER_SETTINGS.items()},
        "sentencepiece": spm.__version__,
    }
    if corpus_hash is None:
        sentences = _sentences(_iter_texts(corpus))
        h = hashlib.sha256()
        for s in sentences:
            h.update(s.encode("utf-8", "surrogatepass"))
            h.update(b"\n")
        corpus_hash = h.hexdigest()
    key = _sha256(json.dumps({"corpus": corpus_hash, **settings}, sort_keys=True).encode())[:24]
    root = Path(out_dir)
    final = root / f"spm-{key}"
    model_path = final / "tokenizer.model"
    if model_path.is_file():
        try:
            tok = Tokenizer.from_sentencepiece(model_path)
            log(f"tokenizer: reusing cached {final}")
            return tok
        except ConfigError:
            shutil.rmtree(final, ignore_errors=True)  # corrupted cache: rebuild
    if sentences is None:
        sentences = _sentences(_iter_texts(corpus))
    if not sentences:
        raise ConfigError("tokenizer training corpus has no text; give non-empty documents")
    if len(sentences) > max_sentences:
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(len(sentences), size=max_sentences, replace=False))
        sentences = [sentences[i] for i in idx]
    t0 = time.perf_counter()
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buf,
            vocab_size=int(vocab_size),
            minloglevel=2,
            **SPM_TRAINER_SETTINGS,
        )
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        need = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if need:  # every distinct character needs a piece: the vocabulary is too small, not too large
            raise ConfigError(
                f"tokenizer training with vocab_size={vocab_size} failed: the corpus has characters for "
                f"{need.group(1)} pieces (with the special ones); raise data.tokenizer_vocab_size to >= "
                f"{need.group(1)}") from None
        raise ConfigError(
            f"tokenizer training with vocab_size={vocab_size} failed ({msg}); lower data.tokenizer_vocab_size "
            "or give a larger corpus"
        ) from None
    dt = time.perf_counter() - t0
    tok = Tokenizer(sp_model=buf.getvalue(), source=str(model_path))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-spm-{key}-", dir=root))
    try:
        from minicpm4_jax.convert.io import default_dir_mode

        os.chmod(tmp, default_dir_mode())  # mkdtemp's 0700 would shut other users out of a shared cache
        tok.save(tmp)
        (tmp / "train_info.json").write_text(
            json.dumps({"corpus_hash": corpus_hash, "num_sentences": len(sentences), "train_seconds": round(dt, 3), **settings}, indent=2)
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not model_path.is_file():  # a concurrent writer may have won the race; otherwise re-raise
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"tokenizer: trained SentencePiece BPE vocab={vocab_size} on {len(sentences)} lines in {dt:.1f}s -> {final}")
    tok = Tokenizer.from_sentencepiece(model_path)  # the same object a later cache hit returns
    tok.train_seconds = dt  # type: ignore[attr-defined]
    return tok
