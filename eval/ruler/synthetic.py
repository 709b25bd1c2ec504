"""RULER's sample generators, one class per task family (spec §1.4-§1.8).

Each generator builds the *full* prompt text of one sample (chat wrapper + task template + answer prefix,
formatted) for a given haystack size, drawing from the task's two random streams exactly in upstream's
order: ``rng`` (a :class:`random.Random` seeded with the task seed, upstream's global ``random``) and
``nprng`` (a :class:`numpy.random.RandomState` with the same seed, upstream's global ``np.random``).
Several shuffles use a *fresh* ``Random(seed)`` on every call, as upstream does (same permutation pattern
for lists of equal length).

The length search around them (:mod:`minicpm4_jax.eval.ruler.fit`) asks each generator for

* ``incremental`` -- the haystack step (spec §1.3 table);
* ``upper_bound(count)`` -- the binary search's upper bound, from one estimation sample;
* ``probe(n)`` -- the text the search measures (``search_extra`` tokens are added to it: vt's one-shot);
* ``sample(n, i)`` -- the text and gold outputs of sample ``i``.

:class:`FreqWords` (fwe) has its own linear search and is driven by ``fit`` separately.
"""

from __future__ import annotations

import heapq
import math
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.ruler import haystack as H
from minicpm4_jax.eval.ruler.tasks import FAMILIES, TaskSpec, full_template

__all__ = ["Env", "Niah", "VariableTracking", "CommonWords", "FreqWords", "QA", "make_generator", "DEPTHS", "zeta"]

#: Needle depths (percent): ``np.round(np.linspace(0, 100, 40)).astype(int)``.
DEPTHS: list[int] = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]

Counter = Callable[[str], int]


@dataclass
class Env:
    """Everything a generator needs besides its task arguments.

    ``inputs``: a :class:`~minicpm4_jax.eval.ruler.run.RulerInputs`-like object with ``essay_words()``,
    ``squad_dataset()``, ``hotpotqa_dataset()``, ``large_words()`` (only the ones a task needs are called).
    """

    seed: int
    max_seq_length: int
    chat_template: str
    inputs: Any
    rng: random.Random = field(init=False)
    nprng: np.random.RandomState = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.nprng = np.random.RandomState(self.seed % (2 ** 32))


def _words_text(words: Sequence[str], n: int) -> str:
    """The first ``n`` haystack words joined by spaces, repeating the list when ``n`` exceeds it."""
    if n <= len(words):
        return " ".join(words[:n])
    reps = (n + len(words) - 1) // len(words)
    return " ".join((list(words) * reps)[:n])


class _SentenceCache:
    """``sent_tokenize`` of the first ``n`` essay words, memoised per ``n`` (the per-sample loop reuses it)."""

    def __init__(self, words: Sequence[str], repeat: bool = True, size: int = 4):
        self.words, self.repeat, self.size = words, repeat, size
        self._cache: dict[int, list[str]] = {}

    def __call__(self, n: int) -> list[str]:
        if n not in self._cache:
            text = _words_text(self.words, n) if self.repeat else " ".join(self.words[:n])
            if len(self._cache) >= self.size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[n] = H.sent_tokenize(text.strip())
        return self._cache[n]


def _insert_between_sentences(sents: list[str], inserts: list[str], rng: random.Random) -> str:
    """Put ``inserts`` (in order) between sentence chunks at depths drawn from :data:`DEPTHS`."""
    cuts = sorted(int(len(sents) * (depth / 100)) for depth in rng.sample(DEPTHS, len(inserts)))
    pos = [0] + cuts + [len(sents)]
    parts = []
    for i in range(1, len(pos)):
        parts.append(" ".join(sents[pos[i - 1]:pos[i]]))
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


class _Generator:
    family: str
    incremental: int
    min_units: int = 1  # the smallest haystack a sample can be built in
    search_extra: int = 0
    estimate_units: int = 0
    estimate_factor: float = 3.0

    def __init__(self, spec: TaskSpec, env: Env):
        self.spec, self.env = spec, env
        self.args = dict(spec.args)
        self.fam = FAMILIES[spec.family]
        self.template = full_template(self.fam, env.chat_template)
        self.rng, self.nprng = env.rng, env.nprng

    def prepare(self, count_raw: Counter) -> dict[str, Any]:
        """Work done before the search (vt's one-shot example); returns facts for the results file."""
        return {}

    def upper_bound(self, count_raw: Counter) -> int:
        """Upstream's upper bound: ``int(max_seq_length / (tokens per unit) * 3)`` from an estimation sample."""
        n = self.estimate_units or self.incremental
        tpu = count_raw(self.probe(n)) / n
        return max(int((self.env.max_seq_length / tpu) * 3), self.incremental * 2)

    def probe(self, n: int) -> str:
        return self.sample(n, 0)[0]

    def sample(self, n: int, index: int) -> tuple[str, list[str]]:
        raise NotImplementedError


# -- NIAH ----------------------------------------------------------------------------------------------------
class Niah(_Generator):
    """Needle in a haystack (8 variants; spec §1.4)."""

    family = "niah"

    def __init__(self, spec: TaskSpec, env: Env):
        super().__init__(spec, env)
        a = self.args
        self.hay = a["type_haystack"]
        self.kind_k, self.kind_v = a["type_needle_k"], a["type_needle_v"]
        self.nv, self.nq = int(a["num_needle_v"]), int(a["num_needle_q"])
        self.nk = max(int(a["num_needle_k"]), self.nq)
        if self.hay not in ("essay", "noise", "needle"):
            raise ConfigError(f"{spec.name}: type_haystack={self.hay!r}; use essay, noise or needle")
        for kind in (self.kind_k, self.kind_v):
            if kind not in ("numbers", "words", "uuids"):
                raise ConfigError(f"{spec.name}: needle kind {kind!r}; use numbers, words or uuids")
        self.incremental = 500 if self.hay == "essay" else 25
        if self.hay != "essay" and env.max_seq_length < 4096:
            self.incremental = 5
        self._words = H.niah_word_keys() if "words" in (self.kind_k, self.kind_v) else None
        self._sents = _SentenceCache(env.inputs.essay_words()) if self.hay == "essay" else None

    def _random(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return self.rng.choice(self._words)
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def sample(self, n: int, index: int) -> tuple[str, list[str]]:
        rng = self.rng
        keys, values, needles = [], [], []
        for _ in range(self.nk):
            keys.append(self._random(self.kind_k))
            vals = []
            for _ in range(self.nv):
                vals.append(self._random(self.kind_v))
                needles.append(H.NEEDLE.format(type_needle_v=self.kind_v, key=keys[-1], value=vals[-1]))
            values.append(vals)
        random.Random(self.env.seed).shuffle(needles)

        if self.hay == "essay":
            context = _insert_between_sentences(self._sents(n), needles, rng)
        else:
            if self.hay == "noise":
                lines = [H.NOISE] * n
            else:
                lines = []
                for _ in range(n):
                    k = self._random(self.kind_k)
                    v = self._random(self.kind_v)
                    lines.append(H.NEEDLE.format(type_needle_v=self.kind_v, key=k, value=v))
            for pos, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(pos, needle)
            context = "\n".join(lines)

        chosen = rng.sample(range(self.nk), self.nq)
        queries = [keys[i] for i in chosen]
        answers = [a for i in chosen for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        template, type_v = self.template, self.kind_v
        if self.nq * self.nv == 1:  # singular wording (plain substring edits, as upstream)
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_v = type_v[:-1]
        return template.format(type_needle_v=type_v, context=context, query=query), answers


# -- variable tracking ---------------------------------------------------------------------------------------
class VariableTracking(_Generator):
    """vt (spec §1.5): chains of ``VAR X = ...`` in a noise (or essay) haystack plus a one-shot example."""

    family = "variable_tracking"

    def __init__(self, spec: TaskSpec, env: Env):
        super().__init__(spec, env)
        self.hay = self.args.get("type_haystack", "noise")
        if self.hay not in ("noise", "essay"):
            raise ConfigError(f"{spec.name}: type_haystack={self.hay!r}; use noise or essay")
        self.num_chains = int(self.args.get("num_chains", 1))
        self.num_hops = int(self.args.get("num_hops", 4))
        self.incremental = 500 if self.hay == "essay" else 10
        if self.hay != "essay" and env.max_seq_length < 4096:
            self.incremental = 5
        if self.hay == "noise":  # every chain's statements go between distinct noise lines
            self.min_units = self.num_hops + 1
        self._words = env.inputs.essay_words() if self.hay == "essay" else None
        self._sents = _SentenceCache(self._words, repeat=False) if self.hay == "essay" else None
        self.icl_template = self.fam.template + self.fam.answer_prefix  # the one-shot has no chat wrapper
        self.icl_example: str | None = None

    # chains ------------------------------------------------------------------------------------------------
    def _chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        rng = self.rng
        k = 3 if is_icl else 5
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        want = (hops + 1) * self.num_chains
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range(want)]
        while len(set(names)) < want:  # upstream quirk: extra names form extra (partial) chains
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        groups, chains = [], []
        for i in range(0, len(names), hops + 1):
            vs = names[i:i + hops + 1]
            groups.append(vs)
            first = "12345" if is_icl else str(self.nprng.randint(10000, 99999))
            chain = [f"VAR {vs[0]} = {first}"]
            for j in range(hops):
                chain.append(f"VAR {vs[j + 1]} = VAR {vs[j]} ")
            chains.append(chain)
        return groups, chains

    def _shuffle_sublists_heap(self, lists: list[list[str]]) -> list[str]:
        heap: list[tuple[float, int, int]] = []
        for i in range(len(lists)):
            heapq.heappush(heap, (self.rng.random(), i, 0))
        out = []
        while heap:
            _, li, ei = heapq.heappop(heap)
            out.append(lists[li][ei])
            if ei + 1 < len(lists[li]):
                heapq.heappush(heap, (self.rng.random(), li, ei + 1))
        return out

    def _text(self, n: int, is_icl: bool) -> tuple[str, list[str]]:
        groups, chains = self._chains(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        if self.hay == "essay":
            flat = self._shuffle_sublists_heap(chains)
            context = _insert_between_sentences(self._sents(n), [c.strip() + "." for c in flat], self.rng)
        else:
            lines = [H.NOISE] * n
            for chain in chains:
                positions = sorted(self.rng.sample(range(len(lines)), len(chain)))
                for j, pos in enumerate(positions):
                    lines.insert(pos + j, chain[j])
            context = "\n".join(lines)
        context = context.replace(". \n", ".\n")
        template = self.icl_template if is_icl else self.template
        return template.format(context=context, query=value, num_v=hops + 1), groups[0]

    # one-shot example --------------------------------------------------------------------------------------
    def prepare(self, count_raw: Counter) -> dict[str, Any]:
        """Build the one-shot example as upstream: its own search with a 500-token budget, no generation."""
        inc = 50 if self.hay == "essay" else 5
        budget = 500
        tpu = count_raw(self._text(inc, True)[0]) / inc
        lo, hi = inc, max(int((budget / tpu) * 3), inc * 2)
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            if count_raw(self._text(mid, True)[0]) <= budget:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        n = best if best is not None else inc
        while True:
            text, outs = self._text(n, True)
            if count_raw(text) <= budget:
                break
            if n <= inc:
                raise ConfigError(f"{self.spec.name}: the one-shot example does not fit RULER's 500-token budget with "
                                  "this tokenizer (it splits the example into too many tokens, e.g. a small vocabulary); "
                                  f"leave {self.spec.name} out of --tasks or evaluate a model with a larger vocabulary")
            n -= inc
        self.icl_example = text + " " + " ".join(outs) + "\n"
        self.search_extra = count_raw(self.icl_example)
        return {"icl_units": n, "icl_tokens": self.search_extra}

    def _randomize_icl(self) -> str:
        assert self.icl_example is not None
        ex = self.icl_example
        for item in ex.strip().split()[-self.num_hops - 1:]:
            ex = ex.replace(item, "".join(self.rng.choices(string.ascii_uppercase, k=len(item))).upper())
        return ex.replace("12345", str(self.nprng.randint(10000, 99999)))

    def probe(self, n: int) -> str:
        return self._text(n, False)[0]

    def sample(self, n: int, index: int) -> tuple[str, list[str]]:
        text, outs = self._text(n, False)
        cut = text.index(self.fam.template[:20])
        return text[:cut] + self._randomize_icl() + "\n" + text[cut:], outs


# -- common words extraction ---------------------------------------------------------------------------------
class CommonWords(_Generator):
    """cwe (spec §1.6): a numbered word list where 10 words repeat ``freq_cw`` times; one few-shot example."""

    family = "common_words_extraction"
    incremental = 10
    estimate_units = 4096

    def __init__(self, spec: TaskSpec, env: Env):
        super().__init__(spec, env)
        a = self.args
        self.freq_cw, self.freq_ucw = int(a.get("freq_cw", 30)), int(a.get("freq_ucw", 3))
        self.num_cw, self.num_fewshot = int(a.get("num_cw", 10)), int(a.get("num_fewshot", 1))
        self.pool = H.cwe_word_pool(env.seed)
        self._large: Sequence[str] | None = None
        self.used_large = False

    def _draw(self, n: int) -> list[str]:
        if n <= len(self.pool):
            return self.rng.sample(self.pool, n)
        if self._large is None:
            self._large = self.env.inputs.large_words()
        if n > len(self._large):
            raise ConfigError(f"{self.spec.name}: a sample needs {n} distinct words but the large word list has "
                              f"{len(self._large)}; give a bigger list (--cwe-words)")
        self.used_large = True
        return self.rng.sample(self._large, n)

    def _example(self, n: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        full = self._draw(n)
        common, uncommon = full[:self.num_cw], full[self.num_cw:]
        words = common * common_repeats + uncommon * uncommon_repeats
        random.Random(self.env.seed).shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common

    def sample(self, n: int, index: int) -> tuple[str, list[str]]:
        shots = []
        short = self.env.max_seq_length < 4096
        for _ in range(self.num_fewshot):
            shots.append(self._example(20, 3, 1) if short else self._example(40, 10, 3))
        context, answer = self._example(n, 6, 1) if short else self._example(n, self.freq_cw, self.freq_ucw)
        shot_texts = [self.template.format(num_cw=self.num_cw, context=c, query="") + " "
                      + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in shots]
        text = "\n".join(shot_texts) + "\n" + self.template.format(num_cw=self.num_cw, context=context, query="")
        return text, answer

    def upper_bound(self, count_raw: Counter) -> int:
        """cwe's bound: ``int(max_seq_length // (tokens per word)) * 2`` from a 4096-word sample."""
        tpw = count_raw(self.probe(4096)) / 4096
        return max(int(self.env.max_seq_length // tpw) * 2, self.incremental * 2)


# -- frequent words extraction -------------------------------------------------------------------------------
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6)


def zeta(s: float) -> float:
    """Riemann zeta for real ``s > 1``: ``pi**2/6`` for 2 (bit-equal to scipy), else Euler-Maclaurin."""
    if s == 2.0:
        return math.pi ** 2 / 6
    if s <= 1:
        raise ConfigError(f"fwe alpha={s} must be > 1 (zeta diverges)")
    n = 20
    total = math.fsum(k ** -s for k in range(1, n))
    total += n ** (1 - s) / (s - 1) + 0.5 * n ** -s
    rising, fact = s, 1.0  # s(s+1)...(s+2j-2), (2j)!
    for j, b in enumerate(_BERNOULLI, start=1):
        fact *= (2 * j - 1) * (2 * j)
        total += b / fact * rising * n ** (-s - 2 * j + 1)
        rising *= (s + 2 * j - 1) * (s + 2 * j)
    return total


class FreqWords(_Generator):
    """fwe (spec §1.7): Zipf-distributed random 6-letter words; the answer is ranks 2-4."""

    family = "freq_words_extraction"

    def __init__(self, spec: TaskSpec, env: Env):
        super().__init__(spec, env)
        self.alpha = float(self.args.get("alpha", 2.0))
        self.wordlen = int(self.args.get("coded_wordlen", 6))
        self.zeta = zeta(self.alpha)
        self.max_len = env.max_seq_length - self.fam.tokens_to_generate  # upstream's L
        if self.max_len < 64:
            raise ConfigError(f"{spec.name}: length {env.max_seq_length} leaves no room for a prompt")
        self.vocab_size = int(self.args.get("vocab_size", -1))
        if self.vocab_size <= 0:
            self.vocab_size = self.max_len // 50
        self.incremental = max(1, self.max_len // 32)

    def vocab(self) -> list[str]:
        rng = self.rng
        letters = string.ascii_lowercase
        vocab = ["".join(rng.choices(letters, k=self.wordlen)) for _ in range(self.vocab_size)]
        while len(set(vocab)) < self.vocab_size:
            vocab.append("".join(rng.choices(letters, k=self.wordlen)))
        vocab = sorted(set(vocab))
        random.Random(self.env.seed).shuffle(vocab)
        vocab[0] = "..."  # the top rank is noise
        return vocab

    def text(self, vocab: list[str], num_words: int) -> tuple[str, list[str]]:
        k = np.arange(1, len(vocab) + 1)
        counts = (num_words * (k ** -self.alpha) / self.zeta).astype(int)
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(self.env.seed).shuffle(words)
        return self.template.format(context=" ".join(words), query=""), vocab[1:4]

    def sample(self, n: int, index: int) -> tuple[str, list[str]]:  # pragma: no cover - fit drives fwe
        return self.text(self.vocab(), n)


# -- QA ------------------------------------------------------------------------------------------------------
class QA(_Generator):
    """qa_1 / qa_2 (spec §1.8): the gold document(s) among distractors, ``Document i:`` blocks."""

    family = "qa"
    incremental = 10

    def __init__(self, spec: TaskSpec, env: Env):
        super().__init__(spec, env)
        ds = self.args["dataset"]
        if ds == "squad":
            self.data = env.inputs.squad_dataset()
        elif ds == "hotpotqa":
            self.data = env.inputs.hotpotqa_dataset()
        else:
            raise ConfigError(f"{spec.name}: dataset={ds!r}; use squad or hotpotqa")

    def _docs(self, q: dict[str, Any], n: int) -> list[str]:
        docs = self.data.docs
        gold, more = q["context"], q["more_context"]
        if n < len(docs):
            if n - len(gold) > len(more):
                taken = set(gold + more)
                extra = [i for i in range(len(docs)) if i not in taken]
                ids = gold + more + self.rng.sample(extra, max(0, n - len(gold) - len(more)))
            else:
                ids = gold + self.rng.sample(more, max(0, n - len(gold)))
            chosen = [docs[i] for i in ids]
        else:
            reps = (n + len(docs) - 1) // len(docs)
            chosen = (docs * reps)[:n]
        random.Random(self.env.seed).shuffle(chosen)
        return chosen

    def sample(self, n: int, index: int) -> tuple[str, list[str]]:
        q = self.data.qas[index % len(self.data.qas)]
        chosen = self._docs(q, n)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
        return self.template.format(context=context, query=q["query"]), list(q["outputs"])


_CLASSES = {"niah": Niah, "variable_tracking": VariableTracking, "common_words_extraction": CommonWords,
            "freq_words_extraction": FreqWords, "qa": QA}


def make_generator(spec: TaskSpec, env: Env) -> _Generator:
    """The generator of ``spec``'s family."""
    return _CLASSES[spec.family](spec, env)
