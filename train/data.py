"""Training data: corpus readers, tokenize-once token cache, validation split, grain pipelines, n-gram baselines.

Flow of :func:`prepare_data`:

1. **Corpus.** ``DataConfig.sources``: ``"stdlib"`` (every ``.py`` file under the running interpreter's
   ``sysconfig.get_paths()["stdlib"]``, recursively, ``site-packages``/``dist-packages``/``__pycache__``
   skipped, paths sorted), or paths to ``.txt`` (one document per file), ``.jsonl`` (one document per
   record, field ``DataConfig.text_field``), ``.parquet`` (one document per row of that column) files,
   folders of such files (recursive, sorted), or a Hugging Face ``save_to_disk`` folder
   (``state.json`` + ``*.arrow`` IPC stream files, read with pyarrow; a ``DatasetDict`` folder uses
   its ``train`` split). Files that are not valid UTF-8 are skipped and counted
   (``manifest["skipped_files"]``); empty files inside a folder or the stdlib are skipped. Records
   (jsonl lines, parquet/arrow rows) without a string ``text_field`` are skipped and counted
   (``manifest["skipped_records"]``, the first places in ``skipped_record_examples``); a file with
   records but none usable is refused.
2. **Hashes.** Every file's bytes are SHA-256 hashed; the corpus hash covers resolved (absolute) paths, sizes
   and content hashes, so a relative and an absolute spelling of the same files give one hash. The token cache key hashes the corpus hash, the tokenizer's file hash and every setting
   that changes the tokens (``text_field``, ``val_fraction``, ``seed``, format version), so a changed
   corpus byte, tokenizer or setting selects a different cache entry: a stale cache is never reused.
3. **Validation split, by document, before tokenization** (so a trained tokenizer never sees it):
   the documents are permuted with ``numpy.random.default_rng(seed)`` and taken in that order into
   the validation set until they hold ``val_fraction`` of the corpus characters. If that is
   impossible (one document, or the picked documents would exceed twice the target), the corpus is
   split at its tail instead: the last ``val_fraction`` of the characters (cut at a line break).
   ``manifest["val_split"]`` says which rule applied.
4. **Tokenizer.** ``DataConfig.tokenizer == "train"``: :func:`~minicpm4_jax.tokenizer.train_tokenizer`
   on the training documents (cached under ``<cache>/tokenizers``); otherwise a path for
   :func:`~minicpm4_jax.tokenizer.load_tokenizer`.
5. **Token cache** ``<cache>/tokens/<key>/``: ``train.bin`` / ``val.bin`` (uint16 when the vocabulary
   fits, else uint32; each document followed by the EOS id) and ``manifest.json``. Built in a temp
   folder and renamed into place, so a killed build never leaves a folder that looks valid.

The cache root is ``DataConfig.cache_dir`` or ``<repo>/.cache/data`` (gitignored); when the package is
installed outside a source checkout, ``$XDG_CACHE_HOME/minicpm4_jax/data`` (``~/.cache/...``). A cache
inside the interpreter's folders is refused.

Mixtures (``DataConfig.weights``, one weight per ``sources`` entry): every entry is prepared as a corpus of
its own by the steps above (its own validation split and token cache, the same cache a one-source run with that
tokenizer uses), with one tokenizer for all (``tokenizer: train``: trained on the union of the components'
training documents; cached by the components' corpus hashes). :func:`train_iterator` interleaves the components'
shuffled, independently repeating window streams in the weights' proportions (:func:`mixture_schedule`: exact
per period of :data:`MIXTURE_PERIOD` windows, evenly spread), switching to ``decay_weights`` at the first step of
the learning-rate decay (each stream continues where it stopped); the training loop reports every component's
validation loss next to the overall one.

Serving: :func:`train_iterator` is a grain ``MapDataset`` pipeline over non-overlapping windows of
``seq_len + 1`` tokens (stride ``seq_len``), shuffled per epoch with the seed, repeated, sliced per
process (each process reads only its rows of every global batch); :func:`val_batches` is the
first validation windows in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import minicpm4_jax
from minicpm4_jax.config import ConfigError, DataConfig, check_mixture
from minicpm4_jax.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "PreparedData",
    "MixtureComponent",
    "component_names",
    "prepare_data",
    "check_batch_fits",
    "train_iterator",
    "mixture_schedule",
    "MIXTURE_PERIOD",
    "val_batches",
    "corpus_entropies",
    "heldout_ngram_xent",
    "ngram_sample",
    "NGRAM_MAX_TOKENS",
    "TokenChain",
    "default_cache_dir",
    "read_corpus",
    "Corpus",
]

_FORMAT = 1  # bump when the token cache layout or the split/tokenization rules change
_TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


# ------------------------------------------------------------------------------------------------
# cache location
# ------------------------------------------------------------------------------------------------


def _interpreter_dirs() -> list[Path]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for k in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(k)
        if p:
            dirs.add(p)
    return [Path(d).resolve() for d in dirs if d]


def _inside(path: Path, dirs: list[Path]) -> Path | None:
    rp = path.resolve()
    for d in dirs:
        if rp == d or d in rp.parents:
            return d
    return None


def default_cache_dir() -> Path:
    """``<repo>/.cache/data`` in a source checkout (``<repo>`` holds ``pyproject.toml`` next to the
    ``minicpm4_jax`` package), else ``$XDG_CACHE_HOME/minicpm4_jax/data`` (default ``~/.cache``)."""
    repo = Path(minicpm4_jax.__file__).resolve().parent.parent
    if (repo / "pyproject.toml").is_file() and _inside(repo / ".cache", _interpreter_dirs()) is None:
        return repo / ".cache" / "data"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "minicpm4_jax" / "data"


def _check_cache_dir(cfg: DataConfig) -> Path:
    root = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_cache_dir()
    root = root.absolute()
    hit = _inside(root, _interpreter_dirs())
    if hit is not None:
        raise ConfigError(
            f"data.cache_dir={root} is inside the Python installation ({hit}); point data.cache_dir at a project "
            "or user folder (default <repo>/.cache/data)"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"data.cache_dir={root} is not a writable folder ({e.strerror or e}); point data.cache_dir at a writable folder"
        ) from None
    return root


# ------------------------------------------------------------------------------------------------
# corpus reading
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _File:
    path: Path
    kind: str  # py | txt | jsonl | parquet | arrow
    data: bytes
    sha256: str
    explicit: bool  # named directly in data.sources (an empty one is an error)


@dataclasses.dataclass
class Corpus:
    """The documents of a corpus and what was skipped while reading it.

    ``documents``: non-empty texts in corpus order. ``skipped_files``: paths of files that are not
    valid UTF-8 (skipped). ``empty_files``: files with no text (skipped). ``skipped_records``:
    ``path:line`` (jsonl) or ``path:row N`` (parquet/arrow) of the records without a string
    ``text_field`` (skipped). ``corpus_hash``: SHA-256 over every file's resolved path, size and content hash.
    ``corpus_hash_as_spelled``: the same over the paths as ``data.sources`` spells them (the corpus hash of runs
    recorded before it was made spelling-independent; :func:`~minicpm4_jax.train.loop.check_run_data` accepts it).
    """

    files: list[dict[str, Any]]
    corpus_hash: str
    corpus_hash_as_spelled: str = ""
    documents: list[str] | None = None
    skipped_files: list[str] = dataclasses.field(default_factory=list)
    empty_files: list[str] = dataclasses.field(default_factory=list)
    skipped_records: list[str] = dataclasses.field(default_factory=list)
    raw: list[_File] = dataclasses.field(default_factory=list, repr=False)  # file bytes, until decoded


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for dp, dn, fn in os.walk(root):
        dn[:] = sorted(d for d in dn if d not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(Path(dp) / f for f in fn if f.endswith(".py"))
    return sorted(out)


def _hf_dataset_files(d: Path) -> list[Path] | None:
    """Arrow files of a ``save_to_disk`` folder in order, or ``None`` when ``d`` is not one."""
    if (d / "dataset_dict.json").is_file():
        splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ConfigError(
                f"data.sources {d} is a DatasetDict without a 'train' split (splits: {splits}); point at one split's folder"
            )
        return _hf_dataset_files(d / "train")
    if not (d / "state.json").is_file():
        return None
    state = json.loads((d / "state.json").read_text())
    names = [f["filename"] for f in state.get("_data_files", [])]
    if not names:
        names = sorted(p.name for p in d.glob("*.arrow"))
    return [d / n for n in names]


def _kind_of(p: Path) -> str:
    return {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".py": "py"}[p.suffix]


def _resolve_sources(cfg: DataConfig) -> list[tuple[Path, str, bool]]:
    if not cfg.sources:
        raise ConfigError("data.sources is empty; give 'stdlib' or paths to .txt/.jsonl/.parquet files")
    out: list[tuple[Path, str, bool]] = []
    for src in cfg.sources:
        if src == "stdlib":
            out.extend((p, "py", False) for p in _stdlib_files())
            continue
        p = Path(os.path.expanduser(src))
        if not p.exists():
            raise ConfigError(
                f"data.sources entry {src!r} does not exist; give 'stdlib' or an existing .txt/.jsonl/.parquet "
                "file or folder"
            )
        if p.is_dir():
            arrows = _hf_dataset_files(p)
            if arrows is not None:
                missing = [a for a in arrows if not a.is_file()]
                if missing or not arrows:
                    raise ConfigError(
                        f"data.sources dataset folder {src!r} lists missing arrow files {[m.name for m in missing]}; "
                        "re-save it with save_to_disk"
                    )
                out.extend((a, "arrow", True) for a in arrows)
                continue
            found = sorted(
                q for q in p.rglob("*") if q.is_file() and q.suffix in _TEXT_SUFFIXES and not q.name.startswith(".")
            )
            if not found:
                raise ConfigError(
                    f"data.sources folder {src!r} holds no .txt/.jsonl/.parquet files; add some or point elsewhere"
                )
            out.extend((q, _kind_of(q), False) for q in found)
        elif p.suffix in _TEXT_SUFFIXES + (".arrow",):
            out.append((p, _kind_of(p), True))
        else:
            raise ConfigError(
                f"data.sources entry {src!r} has an unsupported type {p.suffix or '(none)'}; "
                "use .txt, .jsonl, .parquet, a folder of them, or a save_to_disk dataset folder"
            )
    return out


def _read_files(cfg: DataConfig) -> list[_File]:
    files: list[_File] = []
    seen: set[Path] = set()
    for path, kind, explicit in _resolve_sources(cfg):
        rp = path.resolve()
        if rp in seen:
            continue
        seen.add(rp)
        try:
            if not stat.S_ISREG(rp.stat().st_mode):  # a FIFO would block forever, /dev/zero never end
                raise ConfigError(f"corpus file {path} is not a regular file (a pipe, device or socket); give a file "
                                  "of text, or copy the stream into one")
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"corpus file {path} cannot be read ({e.strerror}); fix its permissions or remove it") from None
        if explicit and not data.strip():
            raise ConfigError(f"corpus file {path} is empty; give a file with text or remove it from data.sources")
        files.append(_File(path=path, kind=kind, data=data, sha256=hashlib.sha256(data).hexdigest(), explicit=explicit))
    return files


def _corpus_hash(files: list[_File], *, as_spelled: bool = False) -> str:
    """SHA-256 over every file's resolved path (``as_spelled``: the path as ``data.sources`` spells it), size and
    content hash."""
    h = hashlib.sha256()
    for f in files:
        path = f.path if as_spelled else f.path.resolve()
        h.update(f"{path}\0{len(f.data)}\0{f.sha256}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _table_texts(table, field: str, path: Path, skipped: list[str]) -> list[str]:
    if field not in table.column_names:
        raise ConfigError(
            f"{path} has no column {field!r} (columns: {table.column_names}); set data.text_field to the text column"
        )
    values = table.column(field).to_pylist()
    docs = [t for t in values if isinstance(t, str)]
    if values and not docs:
        raise ConfigError(f"{path} has no string value in column {field!r} ({len(values)} rows); set "
                          "data.text_field to the text column")
    skipped.extend(f"{path}:row {i + 1}" for i, t in enumerate(values) if not isinstance(t, str))
    return docs


def _documents(f: _File, field: str, skipped: list[str]) -> list[str] | None:
    """Texts of one file; ``None`` when the file is not valid UTF-8. The places of records without a string
    ``field`` are appended to ``skipped``."""
    if f.kind in ("py", "txt"):
        try:
            return [f.data.decode("utf-8")]
        except UnicodeDecodeError:
            return None
    if f.kind == "jsonl":
        try:
            text = f.data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        docs: list[str] = []
        missing: list[str] = []
        n_records = 0
        keys: set[str] = set()
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{f.path}:{lineno} is not valid JSON ({e.msg}); fix the line or remove the file") from None
            n_records += 1
            v = rec.get(field) if isinstance(rec, dict) else None
            if isinstance(rec, dict):
                keys.update(rec)
            if isinstance(v, str):
                docs.append(v)
            else:
                missing.append(f"{f.path}:{lineno}")
        if n_records and not docs:
            if field in keys:  # the field is there, but holds numbers / lists / null, not text
                raise ConfigError(f"{f.path}: field {field!r} holds no string in any record (e.g. {missing[0]}); "
                                  "give records whose text is a JSON string, or set data.text_field to the text field")
            raise ConfigError(
                f"{f.path} has no string field {field!r} in any record (fields: {sorted(keys)[:10]}); "
                "set data.text_field to the text field"
            )
        skipped.extend(missing)
        return docs
    import pyarrow as pa

    try:
        if f.kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(pa.BufferReader(f.data))
        else:  # arrow: datasets writes IPC streams; accept the file format too
            try:
                table = pa.ipc.open_stream(pa.BufferReader(f.data)).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(pa.BufferReader(f.data)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{f.path} cannot be read as {f.kind} ({e}); fix or remove the file") from None
    return _table_texts(table, field, f.path, skipped)


def _decode_files(files: list[_File], cfg: DataConfig, corpus: Corpus) -> None:
    docs: list[str] = []
    for f in files:
        got = _documents(f, cfg.text_field, corpus.skipped_records)
        if got is None:
            corpus.skipped_files.append(str(f.path))
            continue
        got = [d for d in got if d.strip()]
        if not got:
            corpus.empty_files.append(str(f.path))
        docs.extend(got)
    if not docs:
        records = any(f.kind not in ("py", "txt") for f in files)  # text_field names a record's field
        raise ConfigError(
            f"data.sources {list(cfg.sources)} hold no decodable text ({len(files)} files, "
            f"{len(corpus.skipped_files)} not UTF-8, {len(corpus.empty_files)} empty); give UTF-8 text files"
            + (f" or set data.text_field (now {cfg.text_field!r})" if records else "")
        )
    corpus.documents = docs


def read_corpus(cfg: DataConfig, *, with_documents: bool = True) -> Corpus:
    """Read (and optionally decode) the corpus named by ``cfg.sources``.

    Returns:
        :class:`Corpus` with the file list (path, size, sha256), the corpus hash and, when
        ``with_documents``, the non-empty documents in order.

    Raises:
        ConfigError: missing path, empty file/folder, unsupported file type, unreadable file, a
            jsonl/parquet/arrow source without ``cfg.text_field``, or no decodable text at all.
    """
    files = _read_files(cfg)
    corpus = Corpus(
        files=[{"path": str(f.path), "size": len(f.data), "sha256": f.sha256} for f in files],
        corpus_hash=_corpus_hash(files),
        corpus_hash_as_spelled=_corpus_hash(files, as_spelled=True),
    )
    if with_documents:
        _decode_files(files, cfg, corpus)
    else:
        corpus.raw = files
    return corpus


# ------------------------------------------------------------------------------------------------
# validation split
# ------------------------------------------------------------------------------------------------


def _split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str], str]:
    """(train docs, val docs, rule): seeded document selection, else a tail split (module docstring)."""
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    total = int(lens.sum())
    target = max(1, math.ceil(val_fraction * total))
    if len(docs) >= 2:
        order = np.random.default_rng(seed).permutation(len(docs))
        cum = np.cumsum(lens[order])
        k = int(np.searchsorted(cum, target)) + 1  # first k docs in permuted order reach the target
        if k < len(docs) and cum[k - 1] <= 2 * target:
            val_set = set(order[:k].tolist())
            train = [d for i, d in enumerate(docs) if i not in val_set]
            val = [docs[i] for i in sorted(val_set)]
            return train, val, "documents"
    # tail split: cut the concatenated corpus at total - target characters, at a line break if possible
    cut = total - target
    train, val = [], []
    pos = 0
    for d in docs:
        if pos + len(d) <= cut:
            train.append(d)
        elif pos >= cut:
            val.append(d)
        else:
            local = cut - pos
            nl = d.rfind("\n", 0, local)
            at = nl + 1 if nl > 0 else local
            head, tail = d[:at], d[at:]
            if head.strip():
                train.append(head)
            if tail.strip():
                val.append(tail)
        pos += len(d)
    return train, val, "tail"


# ------------------------------------------------------------------------------------------------
# prepared data
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """A tokenized corpus ready to serve.

    ``train_tokens``/``val_tokens``: read-only 1-D ``np.memmap`` (uint16 or uint32) of token ids,
    each document followed by ``tokenizer.eos_id`` (a mixture's: a :class:`TokenChain` of its components'). ``manifest``: the cache's ``manifest.json``
    (``num_documents``, ``num_train_documents``, ``num_val_documents``, ``skipped_files`` (count of
    non-UTF-8 files), ``skipped_file_paths``, ``empty_files``, ``skipped_records`` (count of records
    without a string ``text_field``), ``skipped_record_examples``, ``num_train_tokens``,
    ``num_val_tokens``, ``corpus_hash``, ``tokenizer_hash``, ``key``, ``settings``, ``val_split``,
    ``dtype``, ``vocab_size``, ``timings``, ``files``). ``cache_dir``: the folder holding the token
    files (``<cache root>/tokens/<key>``).
    """

    tokenizer: Tokenizer
    train_tokens: "np.ndarray | TokenChain"
    val_tokens: "np.ndarray | TokenChain"
    manifest: dict
    cache_dir: Path
    components: tuple["MixtureComponent", ...] = ()


@dataclasses.dataclass(frozen=True)
class MixtureComponent:
    """One component of a data mixture: ``data.sources[i]`` served with ``data.weights[i]`` (before the decay
    phase) and ``decay_weight`` (from it on); ``data`` is its own :class:`PreparedData` (split and token cache)."""

    name: str
    weight: float
    decay_weight: float
    data: PreparedData


def component_names(sources: Sequence[str]) -> list[str]:
    """Short unique names of mixture components: a path's file or folder name without suffix (``stdlib`` stays),
    ``_2``, ``_3``, ... appended to repeats; characters other than letters, digits, ``-`` and ``_`` become ``_``."""
    names: list[str] = []
    for src in sources:
        base = src if src == "stdlib" else (Path(os.path.expanduser(src)).stem or "source")
        base = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in base)
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _write_tokens(path: Path, tok: Tokenizer, docs: list[str], dtype: np.dtype, chunk: int = 256) -> int:
    eos = tok.eos_id
    if eos is None:
        raise ConfigError(f"tokenizer {tok.source} has no EOS token to separate documents; use one with </s>")
    n = 0
    with open(path, "wb") as f:
        for s in range(0, len(docs), chunk):
            ids = tok.encode_batch(docs[s : s + chunk])
            count = sum(len(x) for x in ids) + len(ids)
            arr = np.fromiter(
                itertools.chain.from_iterable(itertools.chain(x, (eos,)) for x in ids), dtype=np.int64, count=count
            )
            if arr.size and int(arr.max()) >= np.iinfo(dtype).max + 1:
                raise ConfigError(f"token id {int(arr.max())} does not fit {dtype}; tokenizer vocab_size is wrong")
            f.write(arr.astype(dtype).tobytes())
            n += count
    return n


class TokenChain:
    """Read-only 1-D concatenation of 1-D token arrays (a mixture's component memmaps) that copies nothing up front.

    ``shape``, ``ndim``, ``dtype``, ``len()``, an integer index and a slice (which reads only its own tokens: step 1
    slices are concatenated from the parts they cover) work as on the concatenated array; ``np.asarray`` of it
    copies every token (use slices, e.g. :func:`ngram_sample`, on a large corpus).
    """

    def __init__(self, parts: Sequence[np.ndarray]):
        self._parts = list(parts)
        self._ends = np.cumsum([int(p.shape[0]) for p in self._parts], dtype=np.int64)
        self.dtype = np.result_type(*(p.dtype for p in self._parts)) if self._parts else np.dtype(np.uint16)
        self.shape = (int(self._ends[-1]) if self._parts else 0,)
        self.ndim = 1

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                return np.asarray(self)[key]
            out, begin = [], 0
            for part, end in zip(self._parts, self._ends):
                lo, hi = max(start, begin), min(stop, int(end))
                if lo < hi:
                    out.append(np.asarray(part[lo - begin:hi - begin], dtype=self.dtype))
                begin = int(end)
            return np.concatenate(out) if out else np.zeros((0,), self.dtype)
        i = int(key)
        if i < 0:
            i += self.shape[0]
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"index {key} is out of bounds for {self.shape[0]} tokens")
        c = int(np.searchsorted(self._ends, i, side="right"))
        return self._parts[c][i - (int(self._ends[c - 1]) if c else 0)]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def _open_tokens(path: Path, dtype: str, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros((0,), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# per token file of a cache entry: its stat stamp and largest id when last scanned
_VERIFIED = "verified.json"
# a record is trusted only for a file last written this long before it was made: a write within the same
# timestamp tick as the scan (coarse mtime clocks, 2 s on FAT) would leave the stamp unchanged ("racily clean")
_STAMP_MARGIN_NS = 2_000_000_000


def _file_stamp(path: Path) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode]`` of ``path``: any write (or a copy put in its place) changes one."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _max_token(path: Path, dtype: str, count: int) -> int:
    """The largest id of a token file: one pass over its memmap (minutes for a multi-GB cache)."""
    return int(_open_tokens(path, dtype, count).max())


def _record_verified(final: Path, records: dict[str, dict]) -> None:
    """Write ``final/verified.json`` (``{file: {"stamp", "max_id", "at"}}``: the stamp taken before the scan that
    found ``max_id``, ``at`` the time in ns just before that stamp) atomically; a cache folder this process may not
    write keeps none (its files are then scanned at each start). The temporary file's name is unique (not the pid
    alone: two threads, or two hosts sharing the cache, wrote into one file and replaced with each other's record)."""
    tmp = final / f".{_VERIFIED}.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(json.dumps(records))
        os.replace(tmp, final / _VERIFIED)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _load_cached(final: Path, key: str) -> dict | None:
    """The manifest of a complete cache entry for ``key``, or ``None`` (absent or inconsistent: a file of another
    size than the manifest records, or a token id outside the manifest's ``vocab_size``).

    The largest id of each token file is read from ``verified.json`` while the file's stamp (size, mtime, ctime,
    inode: :func:`_file_stamp`) is the one recorded there and its mtime lies :data:`_STAMP_MARGIN_NS` before the
    record, else scanned again and recorded."""
    mpath = final / "manifest.json"
    if not mpath.is_file():
        return None
    try:
        man = json.loads(mpath.read_text())
        ok = man.get("key") == key and man.get("format") == _FORMAT
        item = np.dtype(man["dtype"]).itemsize
        ok = ok and (final / "train.bin").stat().st_size == man["num_train_tokens"] * item
        ok = ok and (final / "val.bin").stat().st_size == man["num_val_tokens"] * item
        # a file of the right size with bytes changed since (bit rot, a stray write) held ids outside the
        # vocabulary: validation gave loss nan and the end of the run an IndexError (break test 85). A pass over
        # the memmaps only when a file changed since the last one (was at every start: minutes for a large cache)
        try:
            seen = json.loads((final / _VERIFIED).read_text())
        except (OSError, ValueError):
            seen = {}
        records, scanned = {}, False
        for name, n in (("train.bin", man["num_train_tokens"]), ("val.bin", man["num_val_tokens"])):
            if ok and n:
                rec = seen.get(name) if isinstance(seen, dict) else None
                at = time.time_ns()  # before the stamp: a write after it changes the stamp, or lies within the margin
                stamp = _file_stamp(final / name)
                if (isinstance(rec, dict) and rec.get("stamp") == stamp and type(rec.get("max_id")) is int
                        and type(rec.get("at")) is int and stamp[1] < rec["at"] - _STAMP_MARGIN_NS):
                    records[name] = rec
                else:
                    # the stamp taken *before* the scan is recorded: a write during a minutes-long scan (after the
                    # pass read that part) leaves the file unlike the record, so the next start scans it again
                    records[name] = {"stamp": stamp, "max_id": _max_token(final / name, man["dtype"], n), "at": at}
                    scanned = True
                ok = records[name]["max_id"] < int(man["vocab_size"])
        if ok and scanned:
            _record_verified(final, records)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return man if ok else None


def _cache_write_error(what: str, root: Path, e: OSError) -> ConfigError:
    """The one-line error of a failed write of ``what`` under the data cache folder ``root`` (a full disk)."""
    return ConfigError(f"writing {what} under {root} failed ({e.strerror or e}); free disk space or point "
                       "data.cache_dir at a writable folder")


def _host_tag() -> str:
    """8 hex digits naming this host in the token cache's temporary folders (``.tmp-<key>-<host>-<pid>-*``)."""
    import socket

    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _remove_stale_tmp(root: Path) -> None:
    """Remove the temporary folders of token-cache builds killed on this host (their pid is gone).

    The folder of a build on another host is left alone: its pid means nothing here, and the processes of a
    multi-host run prepare the data at the same time in a shared cache (break test 99: the process that came second
    removed the first one's build in progress, which then failed with a misleading "free disk space" error). A
    folder named before the host was recorded (``.tmp-<key>-<pid>-*``) is judged by its pid alone, as it was.
    """
    own = _host_tag()
    for d in root.glob(".tmp-*"):
        parts = d.name[len(".tmp-"):].split("-")
        if len(parts) == 4 and parts[1] != own:
            continue  # another host's build
        try:
            pid = int(parts[-2])
        except (ValueError, IndexError):
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def prepare_data(cfg: DataConfig, *, log: Callable[[str], Any] = print) -> PreparedData:
    """Read, split, tokenize (once, cached) and open the corpus of ``cfg``.

    See the module docstring for the sources, the split rule, the cache key and layout.

    Returns:
        :class:`PreparedData` with memmapped ``train_tokens``/``val_tokens`` (1-D uint16/uint32). With
        ``cfg.weights`` (a mixture) its ``components`` hold each source's own :class:`PreparedData`, and
        ``train_tokens``/``val_tokens`` are theirs chained (:class:`TokenChain`, no copy; for the n-gram baselines).

    Raises:
        ConfigError: (one line, naming the value and the fix) bad mixture weights; cache folder not writable or inside
            the interpreter's folders; missing/empty/unsupported corpus paths; no decodable text or a
            missing ``text_field``; a bad tokenizer path; a train or validation split shorter than one
            window of ``seq_len + 1`` tokens; a global batch (``batch_size`` windows) larger than the train split
            (:func:`check_batch_fits`) or overflowing a 64-bit integer.
    """
    if cfg.seq_len <= 0 or cfg.batch_size <= 0:
        raise ConfigError(f"data.seq_len={cfg.seq_len} and data.batch_size={cfg.batch_size} must be positive")
    if cfg.batch_size * (cfg.seq_len + 1) > _INT64_MAX:  # before reading the corpus: no corpus is that large
        raise ConfigError(f"data.batch_size={cfg.batch_size} x (data.seq_len+1={cfg.seq_len + 1}) tokens per batch "
                          "overflow a 64-bit integer; lower data.batch_size (at most the train split's windows)")
    if not 0.0 < cfg.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in (0, 0.5)")
    check_mixture(cfg)
    if cfg.weights is not None:
        return check_batch_fits(cfg, _prepare_mixture(cfg, log))
    root = _check_cache_dir(cfg)
    t_start = time.perf_counter()
    corpus = read_corpus(cfg, with_documents=False)
    split_settings = {"text_field": cfg.text_field, "val_fraction": cfg.val_fraction, "seed": cfg.seed}
    timings: dict[str, float] = {}

    split = _lazy_split(corpus, cfg)
    tok = _tokenizer(cfg, root, corpus.corpus_hash, lambda: split()[0], timings, log)
    data = _token_cache(cfg, root, corpus, tok, split, split_settings, timings, t_start, log)
    # not in the cached manifest: a cache is shared by every spelling of its sources
    data.manifest["corpus_hash_as_spelled"] = corpus.corpus_hash_as_spelled
    return check_batch_fits(cfg, data)


_INT64_MAX = int(np.iinfo(np.int64).max)


def check_batch_fits(cfg: DataConfig, data: PreparedData) -> PreparedData:
    """Refuse a global batch of more windows than the train split holds; returns ``data``.

    A batch is ``cfg.batch_size`` windows of ``seq_len + 1`` tokens (stride ``seq_len``); one larger than the
    corpus (summed over a mixture's components) would repeat windows inside every batch, and an absurd value
    (``data.batch_size=10000000``) ran out of memory building the first batch after the run's files were written.

    Raises:
        ConfigError: naming the batch, the split's tokens and windows, and the fix.
    """
    parts = [c.data for c in data.components] if data.components else [data]
    counts = [int(p.train_tokens.shape[0]) for p in parts]
    windows = sum(max(0, (n - 1) // cfg.seq_len) for n in counts)  # as _Windows cuts them
    if cfg.batch_size > windows:
        n = sum(counts)
        raise ConfigError(
            f"data.batch_size={cfg.batch_size} x data.seq_len={cfg.seq_len} = {cfg.batch_size * cfg.seq_len:,} "
            f"tokens per batch exceed the train split's {n:,} tokens ({windows:,} windows of data.seq_len+1="
            f"{cfg.seq_len + 1}); lower data.batch_size to at most {windows:,} or add text to data.sources")
    return data


def _lazy_split(corpus: Corpus, cfg: DataConfig) -> Callable[[], tuple[list[str], list[str], str]]:
    """``split()``: decodes the corpus and splits it (:func:`_split_documents`) on the first call only."""
    docs_cache: dict[str, Any] = {}

    def split() -> tuple[list[str], list[str], str]:
        if "split" not in docs_cache:
            _decode_files(corpus.raw, cfg, corpus)
            corpus.raw = []
            docs_cache["split"] = _split_documents(corpus.documents, cfg.val_fraction, cfg.seed)
        return docs_cache["split"]

    return split


def _prepare_mixture(cfg: DataConfig, log: Callable[[str], Any]) -> PreparedData:
    """:func:`prepare_data` of a mixture: every ``sources`` entry prepared as a corpus of its own (its split and
    token cache: the cache a one-source run with the same tokenizer uses), one tokenizer for all."""
    root = _check_cache_dir(cfg)
    t_start = time.perf_counter()
    parts = [dataclasses.replace(cfg, sources=(src,), weights=None, decay_weights=None) for src in cfg.sources]
    corpora = [read_corpus(p, with_documents=False) for p in parts]
    splits = [_lazy_split(c, p) for c, p in zip(corpora, parts)]
    mixture_hash, mixture_hash_as_spelled = (
        hashlib.sha256(json.dumps({"components": hashes}).encode()).hexdigest()
        for hashes in ([c.corpus_hash for c in corpora], [c.corpus_hash_as_spelled for c in corpora]))
    split_settings = {"text_field": cfg.text_field, "val_fraction": cfg.val_fraction, "seed": cfg.seed}
    timings: dict[str, float] = {}
    # a trained tokenizer sees every component's training documents and no validation document
    tok = _tokenizer(cfg, root, mixture_hash, lambda: [d for sp in splits for d in sp()[0]], timings, log)
    decay = cfg.decay_weights if cfg.decay_weights is not None else cfg.weights
    names = component_names(cfg.sources)
    for key, ws in (("weights", cfg.weights), ("decay_weights", cfg.decay_weights)):
        if ws is None:
            continue
        counts = mixture_schedule(ws)[2]
        lost = [n for n, w, k in zip(names, ws, counts) if w > 0 and k == 0]
        if lost:  # below the schedule's resolution: a positive weight that serves nothing
            log(f"warning: data.{key}: component(s) {', '.join(map(repr, lost))} get less than 1/{MIXTURE_PERIOD} of "
                "the windows and are never served; raise their weights or drop them")
    comps = []
    for name, w, dw, p, c, sp in zip(names, cfg.weights, decay, parts, corpora, splits):
        log(f"data: mixture component {name!r} ({p.sources[0]}), weight {w:g}" + (
            f", {dw:g} in the decay phase" if cfg.decay_weights is not None else ""))
        try:
            part = _token_cache(p, root, c, tok, sp, split_settings, dict(timings), t_start, log)
        except ConfigError as e:  # which component: the message alone names no source
            raise ConfigError(f"mixture component {name!r} ({p.sources[0]}): {e}") from None
        comps.append(MixtureComponent(name, float(w), float(dw), part))
    man = {
        "format": _FORMAT,
        "mixture": True,
        "key": hashlib.sha256(json.dumps([m.data.manifest["key"] for m in comps]).encode()).hexdigest()[:24],
        "corpus_hash": mixture_hash,
        "corpus_hash_as_spelled": mixture_hash_as_spelled,
        "tokenizer_hash": tok.file_hash,
        "tokenizer_source": tok.source,
        "settings": {"format": _FORMAT, **split_settings},
        "sources": list(cfg.sources),
        "weights": [m.weight for m in comps],
        "decay_weights": [m.decay_weight for m in comps],
        "components": [{"name": m.name, "source": src, "key": m.data.manifest["key"],
                        "corpus_hash": m.data.manifest["corpus_hash"],
                        "num_train_tokens": m.data.manifest["num_train_tokens"],
                        "num_val_tokens": m.data.manifest["num_val_tokens"]} for m, src in zip(comps, cfg.sources)],
        "num_train_tokens": sum(m.data.manifest["num_train_tokens"] for m in comps),
        "num_val_tokens": sum(m.data.manifest["num_val_tokens"] for m in comps),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
    }
    return PreparedData(
        tokenizer=tok,
        # the n-gram baselines and scripts read the whole corpus: the components' tokens, chained without a copy
        # (helper 99: concatenated in memory, 2 bytes per token of every component in each process at the start)
        train_tokens=TokenChain([m.data.train_tokens for m in comps]),
        val_tokens=TokenChain([m.data.val_tokens for m in comps]),
        manifest=man,
        cache_dir=root / "tokens",
        components=tuple(comps),
    )


def _tokenizer(cfg: DataConfig, root: Path, corpus_hash: str, train_docs: Callable[[], list[str]],
               timings: dict[str, float], log: Callable[[str], Any]) -> Tokenizer:
    """``cfg.tokenizer``: trained on ``train_docs()`` (cached by ``corpus_hash`` and the split settings), or loaded."""
    if cfg.tokenizer != "train":
        return load_tokenizer(cfg.tokenizer)
    split_settings = {"text_field": cfg.text_field, "val_fraction": cfg.val_fraction, "seed": cfg.seed}
    train_key = hashlib.sha256(
        json.dumps({"corpus": corpus_hash, "split": split_settings, "format": _FORMAT}, sort_keys=True).encode()
    ).hexdigest()

    class _LazyDocs:
        def __iter__(self):
            return iter(train_docs())

    if cfg.tokenizer_vocab_size < 260:  # named by its key (train_tokenizer cannot know it)
        raise ConfigError(f"data.tokenizer_vocab_size={cfg.tokenizer_vocab_size} is too small for the trained "
                          "tokenizer: byte fallback needs >= 260 (256 bytes + specials)")
    t0 = time.perf_counter()
    try:
        tok = train_tokenizer(_LazyDocs(), cfg.tokenizer_vocab_size, root / "tokenizers", cfg.seed,
                              corpus_hash=train_key, log=log)
    except OSError as e:  # a full disk while caching the trained model (helper 91: a traceback)
        raise _cache_write_error("the trained tokenizer", root / "tokenizers", e) from None
    if hasattr(tok, "train_seconds"):
        timings["tokenizer_train_s"] = round(time.perf_counter() - t0, 3)
    return tok


def _token_cache(cfg: DataConfig, root: Path, corpus: Corpus, tok: Tokenizer,
                 split: Callable[[], tuple[list[str], list[str], str]], split_settings: dict, timings: dict[str, float],
                 t_start: float, log: Callable[[str], Any]) -> PreparedData:
    """Open (or build) the token cache of ``corpus`` under ``tok`` (module docstring, step 5)."""
    # ---- token cache -------------------------------------------------------------------------
    settings = {"format": _FORMAT, **split_settings}
    key = hashlib.sha256(
        json.dumps({"corpus": corpus.corpus_hash, "tokenizer": tok.file_hash, **settings}, sort_keys=True).encode()
    ).hexdigest()[:24]
    tokens_root = root / "tokens"
    tokens_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(tokens_root)
    final = tokens_root / key
    man = _load_cached(final, key)
    if man is not None:
        log(f"data: reusing token cache {final} ({man['num_train_tokens']:,} train / {man['num_val_tokens']:,} val tokens)")
    else:
        if final.exists():
            log(f"data: token cache {final} is incomplete or inconsistent; rebuilding")
            shutil.rmtree(final, ignore_errors=True)
        train_docs, val_docs, rule = split()
        dtype = _token_dtype(tok.vocab_size)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-{_host_tag()}-{os.getpid()}-", dir=tokens_root))
        try:
            from minicpm4_jax.convert.io import default_dir_mode

            os.chmod(tmp, default_dir_mode())  # mkdtemp's 0700 would shut other users out of a shared cache
            t0 = time.perf_counter()
            n_train = _write_tokens(tmp / "train.bin", tok, train_docs, dtype)
            n_val = _write_tokens(tmp / "val.bin", tok, val_docs, dtype)
            timings["tokenize_s"] = round(time.perf_counter() - t0, 3)
            timings["prepare_total_s"] = round(time.perf_counter() - t_start, 3)
            man = {
                "format": _FORMAT,
                "key": key,
                "corpus_hash": corpus.corpus_hash,
                "tokenizer_hash": tok.file_hash,
                "tokenizer_source": tok.source,
                "settings": settings,
                "sources": list(cfg.sources),
                "num_files": len(corpus.files),
                "skipped_files": len(corpus.skipped_files),
                "skipped_file_paths": corpus.skipped_files,
                "empty_files": len(corpus.empty_files),
                "skipped_records": len(corpus.skipped_records),
                "skipped_record_examples": corpus.skipped_records[:10],
                "num_documents": len(corpus.documents),
                "num_train_documents": len(train_docs),
                "num_val_documents": len(val_docs),
                "val_split": rule,
                "num_train_tokens": n_train,
                "num_val_tokens": n_val,
                "dtype": dtype.name,
                "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id,
                "timings": timings,
                "files": corpus.files,
            }
            (tmp / "manifest.json").write_text(json.dumps(man, indent=1))
            for name in ("train.bin", "val.bin", "manifest.json"):
                with open(tmp / name, "rb") as fh:
                    os.fsync(fh.fileno())
            os.rename(tmp, final)
        except OSError as e:
            if _load_cached(final, key) is None:  # not a lost race with a concurrent writer
                raise _cache_write_error("the token cache", tokens_root, e) from None
            man = _load_cached(final, key)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        bad = man.get("skipped_records", 0)
        records = (f" ({bad} records without a string {cfg.text_field!r} field, skipped: first at "
                   f"{man['skipped_record_examples'][0]}; set data.text_field or fix them)" if bad else "")
        log(
            f"data: {man['num_files']} files ({man['skipped_files']} not UTF-8, skipped), {man['num_documents']} "
            f"documents{records}, {man['num_train_tokens']:,} train / {man['num_val_tokens']:,} val tokens "
            f"({rule} split), tokenized in {timings['tokenize_s']:.1f}s -> {final}"
        )
    window = cfg.seq_len + 1
    for split_name, n in (("train", man["num_train_tokens"]), ("validation", man["num_val_tokens"])):
        if n < window:
            raise ConfigError(
                f"the {split_name} split has {n} tokens, fewer than one window of data.seq_len+1={window}; "
                "add text to data.sources or lower data.seq_len"
                + (" / raise data.val_fraction" if split_name == "validation" else "")
            )
    return PreparedData(
        tokenizer=tok,
        train_tokens=_open_tokens(final / "train.bin", man["dtype"], man["num_train_tokens"]),
        val_tokens=_open_tokens(final / "val.bin", man["dtype"], man["num_val_tokens"]),
        manifest=man,
        cache_dir=final,
    )


# ------------------------------------------------------------------------------------------------
# serving
# ------------------------------------------------------------------------------------------------


class _Windows:
    """Random-access source of ``[seq_len + 1]`` int32 windows (stride ``seq_len``) of a token memmap.

    Holds the file path (not the mapping) so it pickles cheaply; the mapping opens on first use.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self._path = getattr(tokens, "filename", None)
        self._dtype = tokens.dtype.str
        self._count = int(tokens.shape[0])
        self._tokens = tokens
        self._seq_len = seq_len
        self._n = max(0, (self._count - 1) // seq_len)

    def __getstate__(self):
        st = dict(self.__dict__)
        if self._path is not None:
            st["_tokens"] = None
        return st

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self._tokens is None:
            self._tokens = np.memmap(self._path, dtype=self._dtype, mode="r", shape=(self._count,))
        i = int(i) % self._n
        s = i * self._seq_len
        return {"input_ids": np.asarray(self._tokens[s : s + self._seq_len + 1], dtype=np.int32)}


_ROW_BATCHES: Any = None


def _row_batches_class() -> Any:
    """The grain ``MapDataset`` of :func:`train_iterator`'s local batches (grain imported lazily)."""
    global _ROW_BATCHES
    if _ROW_BATCHES is None:
        import grain

        class RowBatches(grain.MapDataset):
            """Element ``k``: rows ``rows`` of global batch ``k`` (parent elements ``k*B + r``), stacked.

            Reads only those windows; the element index is the global batch index, so the iterator
            state (``next_index``) means the same on every process and for every process count.
            """

            def __init__(self, parent: Any, batch_size: int, rows: tuple[int, ...]):
                super().__init__(parent)
                self._batch_size = batch_size
                self._rows = rows
                self._length = len(parent) // batch_size

            def __len__(self) -> int:
                return self._length

            def __str__(self) -> str:
                return f"RowBatches(batch_size={self._batch_size}, rows={len(self._rows)})"

            def __getitem__(self, index: Any) -> Any:
                if isinstance(index, slice):
                    return self.slice(index)
                base = (int(index) % self._length) * self._batch_size
                items = [self._parent[base + r] for r in self._rows]
                with self._stats.record_self_time():
                    return {"input_ids": np.stack([x["input_ids"] for x in items])}

        _ROW_BATCHES = RowBatches
    return _ROW_BATCHES


MIXTURE_PERIOD = 10_000  # windows per period of a mixture's schedule: proportions exact to 1 / MIXTURE_PERIOD


def mixture_schedule(weights: Sequence[float],
                     period: int = MIXTURE_PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order in which a mixture serves its components, one period of ``period`` windows.

    Each component gets ``counts[c]`` windows per period, ``period * w_c / sum(w)`` rounded by largest remainder
    (ties to the first component), interleaved as evenly as possible (smooth weighted round-robin: every slot goes
    to the component furthest behind its share; a weight of 0 is never served).

    Returns:
        ``component`` int32 ``[period]`` (the component of each slot), ``rank`` int64 ``[period]`` (how many
        earlier slots of the period went to the same component), ``counts`` int64 ``[num_components]``.
    """
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * period
    counts = np.floor(exact).astype(np.int64)
    short = period - int(counts.sum())
    for c in np.argsort(-(exact - counts), kind="stable")[:short]:
        counts[c] += 1
    current = np.where(counts > 0, 0.0, -np.inf)
    component = np.empty(period, np.int32)
    rank = np.empty(period, np.int64)
    seen = np.zeros(len(w), np.int64)
    for i in range(period):
        current += counts
        c = int(np.argmax(current))
        current[c] -= period
        component[i], rank[i] = c, seen[c]
        seen[c] += 1
    return component, rank, counts


_MIXTURE: Any = None


def _mixture_class() -> Any:
    """The grain ``MapDataset`` that interleaves a mixture's component streams (grain imported lazily)."""
    global _MIXTURE
    if _MIXTURE is None:
        import grain

        class Mixture(grain.MapDataset):
            """Element ``i``: window ``j`` of component ``c`` by :func:`mixture_schedule` of ``weights``; from element
            ``switch`` on, by that of ``decay_weights``, each component's stream continuing where it stopped.

            Random access in O(1) (periodic schedule), so the element index alone is the iterator state: the same
            on every process, restorable from a checkpoint.
            """

            def __init__(self, parents: Sequence[Any], weights: Sequence[float],
                         decay_weights: Sequence[float] | None = None, switch: int | None = None):
                super().__init__(parents)
                self._phase1 = mixture_schedule(weights)
                self._switch = None if decay_weights is None or switch is None else int(switch)
                if self._switch is not None:
                    self._phase2 = mixture_schedule(decay_weights)
                    comp, _, counts = self._phase1
                    full, rest = divmod(self._switch, MIXTURE_PERIOD)
                    # windows of each component served before the switch: its stream continues from there
                    self._start = full * counts + np.bincount(comp[:rest], minlength=len(counts))

            def __len__(self) -> int:
                return sys.maxsize

            def __str__(self) -> str:
                return f"Mixture(components={len(self._parents)}, switch={self._switch})"

            def __getitem__(self, index: Any) -> Any:
                if isinstance(index, slice):
                    return self.slice(index)
                i = int(index)
                if self._switch is None or i < self._switch:
                    (comp, rank, counts), start = self._phase1, None
                else:
                    (comp, rank, counts), start = self._phase2, self._start
                    i -= self._switch
                full, slot = divmod(i, MIXTURE_PERIOD)
                c = int(comp[slot])
                j = full * int(counts[c]) + int(rank[slot]) + (0 if start is None else int(start[c]))
                return self._parents[c][j]

        _MIXTURE = Mixture
    return _MIXTURE


def train_iterator(
    data: PreparedData,
    cfg: DataConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
    rows: Sequence[int] | None = None,
    num_epochs: int | None = None,
    decay_start_batch: int | None = None,
):
    """The training batches of this process, as a checkpointable grain ``DatasetIterator``.

    Pipeline: ``MapDataset.source(windows).seed(cfg.seed).shuffle().repeat(num_epochs)`` (a different
    permutation each epoch; ``None`` repeats forever), cut into **global** batches of
    ``cfg.batch_size`` consecutive windows; this process reads only its rows of each global batch
    (``.to_iter_dataset()`` with a thread prefetch). Windows are non-overlapping ``seq_len + 1`` token
    slices at stride ``seq_len`` (the train step shifts).

    Which rows: ``rows`` (ascending indices into the global batch; the training loop passes
    :func:`minicpm4_jax.sharding.process_batch_rows` of the batch sharding, i.e. the rows this
    process's devices hold), else the contiguous block ``process_index`` of ``process_count`` equal
    blocks. So global batch ``k`` is the same ``cfg.batch_size`` windows, in the same order, whatever
    the process count, and the processes' rows are disjoint. The iterator state counts global
    batches, so a checkpoint's data state restores on any process count.

    **Mixtures** (``data.components``): each component's windows form a stream of their own,
    ``source(windows).seed(cfg.seed + c).shuffle().repeat()`` (every component repeats on its own), and the
    global window order interleaves the streams by :func:`mixture_schedule` of the weights (exact proportions per
    period of :data:`MIXTURE_PERIOD` windows); from global batch ``decay_start_batch`` on (the first step of the
    learning-rate decay, from the training loop) by the decay weights, each stream continuing where it stopped.
    ``num_epochs`` must be ``None`` there.

    Each element: ``{"input_ids": np.ndarray int32 [len(rows), seq_len + 1]}``.
    ``get_state()``/``set_state()`` work and the iterator checkpoints with orbax via
    ``grain.checkpoint.CheckpointSave``/``CheckpointRestore``.

    Raises:
        ConfigError: bad ``process_index``/``process_count``/``rows``, ``batch_size`` not divisible by
            ``process_count``, or a train split shorter than one window.
    """
    import grain

    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} must be in [0, process_count={process_count})")
    if cfg.batch_size % process_count:
        raise ConfigError(
            f"data.batch_size={cfg.batch_size} is not divisible by process_count={process_count}; "
            "use a multiple of the process count"
        )
    if rows is None:
        n = cfg.batch_size // process_count
        rows = range(process_index * n, (process_index + 1) * n)
    rows = tuple(int(r) for r in rows)
    if not rows or any(not 0 <= r < cfg.batch_size for r in rows) or list(rows) != sorted(set(rows)):
        raise ConfigError(f"rows {list(rows)[:8]} must be distinct ascending indices in [0, data.batch_size="
                          f"{cfg.batch_size})")
    if data.components:
        if num_epochs is not None:
            raise ConfigError(f"num_epochs={num_epochs}: a mixture repeats each component on its own; pass None")
        streams = []
        for c, comp in enumerate(data.components):
            src = _Windows(comp.data.train_tokens, cfg.seq_len)
            if len(src) == 0:
                raise ConfigError(f"mixture component {comp.name!r} has {comp.data.train_tokens.shape[0]} training "
                                  f"tokens, fewer than data.seq_len+1={cfg.seq_len + 1}; add text or lower data.seq_len")
            streams.append(grain.MapDataset.source(src).seed(cfg.seed + c).shuffle().repeat(None))
        weights = [m.weight for m in data.components]
        decay = [m.decay_weight for m in data.components]
        decay = None if decay == weights else decay  # the same mixture throughout: no switch
        switch = None if decay_start_batch is None else int(decay_start_batch) * cfg.batch_size
        ds = _mixture_class()(streams, weights, decay, switch)
    else:
        src = _Windows(data.train_tokens, cfg.seq_len)
        if len(src) == 0:
            raise ConfigError(
                f"the train split has {data.train_tokens.shape[0]} tokens, fewer than data.seq_len+1={cfg.seq_len + 1}; "
                "add text or lower data.seq_len"
            )
        ds = grain.MapDataset.source(src).seed(cfg.seed).shuffle().repeat(num_epochs)
    ds = _row_batches_class()(ds, cfg.batch_size, rows)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    return iter(it)


def val_batches(data: PreparedData, cfg: DataConfig, num_batches: int) -> list[np.ndarray]:
    """The first ``num_batches`` validation batches, deterministic and finite.

    Windows are the validation split's non-overlapping ``seq_len + 1`` slices (stride ``seq_len``)
    in order; each batch is an ``np.ndarray`` int32 ``[batch_size, seq_len + 1]``. When the split
    holds fewer than ``num_batches * batch_size`` windows, only full batches are returned; when it
    holds fewer than ``batch_size`` windows, a single smaller batch of all of them.

    Raises:
        ConfigError: the validation split is shorter than one window.
    """
    src = _Windows(data.val_tokens, cfg.seq_len)
    n = len(src)
    if n == 0:
        raise ConfigError(
            f"the validation split has {data.val_tokens.shape[0]} tokens, fewer than data.seq_len+1={cfg.seq_len + 1}; "
            "raise data.val_fraction, add text, or lower data.seq_len"
        )
    b = cfg.batch_size
    if n < b:
        return [np.stack([src[i]["input_ids"] for i in range(n)])]
    k = min(num_batches, n // b)
    return [np.stack([src[j * b + i]["input_ids"] for i in range(b)]) for j in range(k)]


# ------------------------------------------------------------------------------------------------
# baselines
# ------------------------------------------------------------------------------------------------


def _entropy_from_counts(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    n = c.sum()
    return float(-(c / n * np.log(c / n)).sum())


#: Tokens the n-gram statistics read at most from one token array (:func:`ngram_sample`): about 0.9 GiB of memory
#: at their peak (~54 bytes per token read). The whole array took ~54 GB per billion tokens at the end of a run on a
#: real corpus (helper 99), after its last checkpoint, so the run never wrote summary.json (nor did a resume).
NGRAM_MAX_TOKENS = 1 << 24
#: Contiguous runs :func:`ngram_sample` takes from a longer array.
NGRAM_SAMPLE_RUNS = 64


def ngram_sample(tokens: np.ndarray, max_tokens: int | None = None) -> np.ndarray:
    """``tokens`` (1-D) itself when it holds at most ``max_tokens`` (``None``: :data:`NGRAM_MAX_TOKENS`), else
    :data:`NGRAM_SAMPLE_RUNS` contiguous runs of ``max_tokens // NGRAM_SAMPLE_RUNS`` tokens at evenly spaced offsets
    (the first at the start, the last at the end), concatenated in order: a sample spread over the whole corpus,
    read from a memmap without loading the rest (the pairs across the ``NGRAM_SAMPLE_RUNS - 1`` joins are counted
    as bigrams: a negligible share)."""
    n = int(tokens.shape[0])
    max_tokens = NGRAM_MAX_TOKENS if max_tokens is None else int(max_tokens)
    if n <= max_tokens:
        return tokens
    run = max(2, max_tokens // NGRAM_SAMPLE_RUNS)
    starts = np.linspace(0, n - run, NGRAM_SAMPLE_RUNS).round().astype(np.int64)
    return np.concatenate([np.asarray(tokens[s:s + run]) for s in starts])


def corpus_entropies(tokens: np.ndarray, vocab_size: int, *, max_tokens: int | None = None) -> dict[str, float]:
    """Plug-in (maximum-likelihood) entropies of a token stream, in nats per token.

    A stream longer than ``max_tokens`` (``None``: :data:`NGRAM_MAX_TOKENS`) is measured on :func:`ngram_sample` of
    it (memory grows by ~54 bytes per token read; ``max_tokens=len(tokens)`` reads all).

    ``unigram``: H(X) over all tokens. ``bigram``: the conditional entropy H(X_t | X_{t-1}) =
    H(X_{t-1}, X_t) - H(X_{t-1}) over the adjacent pairs. Both are in-sample (no smoothing), hence
    optimistic for the bigram on small corpora; use :func:`heldout_ngram_xent` for fair held-out
    baselines. Vectorised (``np.bincount`` / ``np.unique`` on int64 pair codes).

    Args:
        tokens: 1-D integer array (e.g. the uint16 memmap); at least 2 tokens.
        vocab_size: ids must be in ``[0, vocab_size)``.

    Raises:
        ValueError: fewer than 2 tokens.
    """
    if np.ndim(tokens) != 1 or np.shape(tokens)[0] < 2:
        raise ValueError("corpus_entropies needs a 1-D token array of at least 2 tokens")
    t = np.asarray(ngram_sample(tokens, max_tokens)).astype(np.int64, copy=False)
    uni = _entropy_from_counts(np.bincount(t, minlength=vocab_size))
    codes = t[:-1] * vocab_size + t[1:]
    _, pair_counts = np.unique(codes, return_counts=True)
    h_joint = _entropy_from_counts(pair_counts)
    h_prev = _entropy_from_counts(np.bincount(t[:-1], minlength=vocab_size))
    return {"unigram": uni, "bigram": h_joint - h_prev}


def heldout_ngram_xent(
    train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int, *, add_k: float = 1.0,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Held-out cross-entropies (nats per token) of smoothed n-gram models fit on ``train_tokens``.

    Each array longer than ``max_tokens`` (``None``: :data:`NGRAM_MAX_TOKENS`) is used through :func:`ngram_sample`.

    * ``unigram``: add-``k`` (Laplace for ``k`` = 1) unigram, ``p(w) = (c(w) + k) / (N + k V)``, scored
      on every validation token.
    * ``bigram``: interpolated Kneser-Ney bigram, scored on the validation pairs ``(v_{t-1}, v_t)``:
      ``p(w|v) = max(c(v,w) - D, 0) / c(v) + D N1+(v,.) / c(v) * p_cont(w)``, with
      ``D = n1 / (n1 + 2 n2)`` from the bigram count-of-counts (clipped to [0.1, 0.9] so unseen
      pairs always keep mass), ``p_cont`` the continuation
      probability ``N1+(., w) / N1+(., .)`` itself discounted and interpolated with the uniform
      distribution (so unseen tokens get mass); an unseen history ``v`` backs off to ``p_cont``.

    These are the fair baselines for a model's held-out loss; ``bigram_discount`` is ``D``.

    Raises:
        ValueError: fewer than 2 tokens in either array.
    """
    tr = np.asarray(ngram_sample(train_tokens, max_tokens)).astype(np.int64, copy=False)
    va = np.asarray(ngram_sample(val_tokens, max_tokens)).astype(np.int64, copy=False)
    if tr.shape[0] < 2 or va.shape[0] < 2:
        raise ValueError("heldout_ngram_xent needs at least 2 train and 2 validation tokens")
    V = int(vocab_size)
    # unigram, add-k
    cu = np.bincount(tr, minlength=V).astype(np.float64)
    p_uni = (cu + add_k) / (tr.shape[0] + add_k * V)
    uni = float(-np.log(p_uni[va]).mean())
    # bigram, interpolated Kneser-Ney
    codes, cnt = np.unique(tr[:-1] * V + tr[1:], return_counts=True)
    prev, nxt = codes // V, codes % V
    n1, n2 = int((cnt == 1).sum()), int((cnt == 2).sum())
    D = min(max(n1 / (n1 + 2 * n2) if n1 + 2 * n2 > 0 else 0.5, 0.1), 0.9)
    c_hist = np.bincount(prev, weights=cnt, minlength=V)  # c(v, .)
    n_follow = np.bincount(prev, minlength=V).astype(np.float64)  # N1+(v, .)
    n_precede = np.bincount(nxt, minlength=V).astype(np.float64)  # N1+(., w)
    types = float(codes.shape[0])
    m1, m2 = int((n_precede == 1).sum()), int((n_precede == 2).sum())
    D1 = min(max(m1 / (m1 + 2 * m2) if m1 + 2 * m2 > 0 else 0.5, 0.1), 0.9)
    seen = float((n_precede > 0).sum())
    p_cont = np.maximum(n_precede - D1, 0.0) / types + D1 * seen / types / V
    vp, vn = va[:-1], va[1:]
    vcodes = vp * V + vn
    pos = np.searchsorted(codes, vcodes)
    pos_c = np.minimum(pos, codes.shape[0] - 1)
    c_vw = np.where(codes[pos_c] == vcodes, cnt[pos_c], 0).astype(np.float64)
    ch = c_hist[vp]
    with np.errstate(divide="ignore", invalid="ignore"):
        p_bi = np.where(
            ch > 0,
            (np.maximum(c_vw - D, 0.0) + D * n_follow[vp] * p_cont[vn]) / np.where(ch > 0, ch, 1.0),
            p_cont[vn],
        )
    bi = float(-np.log(p_bi).mean())
    return {"unigram": uni, "bigram": bi, "bigram_discount": float(D)}
