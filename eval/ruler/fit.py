"""Fit RULER samples to a target length with the model's own tokenizer (spec §1.3) and build the records.

The budget of every sample is ``prefix_tokens + tokens(prompt) + tokens_to_generate <= max_seq_length``
where ``prompt`` is the whole model input (chat wrapper, task template, answer prefix) and
``prefix_tokens`` the document-start token(s) the model puts before it (0 reproduces upstream's count).

* All tasks but fwe: one estimation sample gives tokens per haystack unit; a binary search over the unit
  count in ``[incremental, upper]`` finds the largest count whose (fresh, random) probe fits; every sample
  starts from that count and steps down by ``incremental`` while it overflows. The search keeps its probes:
  when the result is ``N``, the probe at ``N + 1`` overflowed (the upper bound is doubled while the top of
  the range still fits, so this always holds).
* fwe: a linear scan from ``L // 6`` words in steps of ``L // 32`` (``L = max_seq_length - 50``) until the
  prompt reaches ``L`` tokens, one step back; each sample shrinks by a step while over budget.

:func:`generate_task` returns the records in RULER's JSONL record format (spec §1.2) and the fit facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.ruler.synthetic import Env, FreqWords, make_generator
from minicpm4_jax.eval.ruler.tasks import CHAT_TEMPLATES, TASKS, resolve_chat_template

__all__ = ["TaskData", "binary_search", "generate_task", "split_answer_prefix"]

_DATA_FIELDS = ("index", "input", "outputs", "length", "length_w_model_temp", "answer_prefix")


@dataclass
class TaskData:
    """One task at one length: RULER records plus how the length was fitted.

    ``fit``: ``units`` (the search result), ``incremental``, ``probes`` (``[units, tokens counted against the
    budget]`` in search order), ``budget`` (= max_seq_length), ``prefix_tokens`` and task-specific facts.
    """

    task: str
    max_seq_length: int
    records: list[dict[str, Any]]
    fit: dict[str, Any] = field(default_factory=dict)


def binary_search(fits: Callable[[int], tuple[bool, int]], lo: int, hi: int,
                  max_hi: int = 1 << 40) -> tuple[int | None, list[list[int]]]:
    """Largest ``n`` in ``[lo, hi]`` with ``fits(n)[0]`` (upstream's search); ``(None, probes)`` if none fits.

    ``fits(n)`` returns ``(fits, tokens)``; every call is recorded in ``probes`` as ``[n, tokens]``. When the
    top of the range fits, the range is extended (``hi`` doubled) until a probe overflows.
    """
    probes: list[list[int]] = []

    def check(n: int) -> bool:
        ok, tokens = fits(n)
        probes.append([n, int(tokens)])
        return ok

    best = None
    while True:
        a, b = lo, hi
        while a <= b:
            mid = (a + b) // 2
            if check(mid):
                best, a = mid, mid + 1
            else:
                b = mid - 1
        if best is None or best < hi or hi >= max_hi:
            return best, probes
        lo, hi = hi + 1, min(hi * 2, max_hi)  # the whole range fitted: look further


def split_answer_prefix(text: str, answer_prefix: str) -> tuple[str, str]:
    """Split a full prompt at the last occurrence of the first 10 characters of the family's (unformatted)
    answer prefix: ``(input, answer_prefix)`` (spec §1.2)."""
    cut = text.rfind(answer_prefix[:10])
    if cut < 0:
        raise ConfigError(f"answer prefix {answer_prefix[:10]!r} not found in the prompt (custom chat template?)")
    return text[:cut], text[cut:]


def generate_task(task: str, max_seq_length: int, tokenizer: Any, *, num_samples: int, seed: int = 42,
                  inputs: Any, chat_template: str = "base", prefix_tokens: int = 0,
                  progress: bool = False) -> TaskData:
    """Generate ``num_samples`` samples of ``task`` fitted to ``max_seq_length`` tokens of ``tokenizer``.

    Args:
        task: a name of :data:`~minicpm4_jax.eval.ruler.tasks.TASKS`.
        tokenizer: anything with ``encode(text) -> list[int]`` (the evaluated model's tokenizer).
        seed: the task seed (upstream 42): a fresh ``random.Random(seed)`` / ``RandomState(seed)`` per call,
            so the result does not depend on which other tasks or lengths are generated.
        inputs: :class:`~minicpm4_jax.eval.ruler.run.RulerInputs` (essay, SQuAD, HotpotQA, large word list).
        chat_template: a :data:`~minicpm4_jax.eval.ruler.tasks.CHAT_TEMPLATES` name or a wrapper string.
        prefix_tokens: tokens the model adds before every prompt (counted in the budget).
        progress: a tqdm bar over the samples.

    Returns:
        :class:`TaskData` with RULER records: ``index, input, outputs, length, length_w_model_temp,
        answer_prefix`` (+ ``token_position_answer`` for NIAH, whose ``index`` is upstream's quirk: the
        character offset of the first answer in ``input``) and ``others`` (task, max_seq_length, units, seed,
        sample ordinal, prefix_tokens).

    Raises:
        ConfigError: unknown task, a length too short for the task, or a missing input file.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown RULER task {task!r}; use one of {', '.join(TASKS)}")
    if num_samples < 1:
        raise ConfigError(f"num_samples={num_samples} must be >= 1")
    if prefix_tokens < 0:
        raise ConfigError(f"prefix_tokens={prefix_tokens} must be >= 0")
    spec = TASKS[task]
    wrapper = resolve_chat_template(chat_template)
    env = Env(seed=seed, max_seq_length=max_seq_length, chat_template=wrapper, inputs=inputs)
    gen = make_generator(spec, env)
    gen_tokens = spec.tokens_to_generate

    def count_raw(text: str) -> int:
        return len(tokenizer.encode(text))

    def total(text: str, extra: int = 0) -> int:
        return prefix_tokens + count_raw(text) + extra + gen_tokens

    template_name = chat_template if chat_template in CHAT_TEMPLATES else "custom"
    fit: dict[str, Any] = {"budget": max_seq_length, "prefix_tokens": prefix_tokens, "seed": seed,
                           "tokens_to_generate": gen_tokens, "chat_template": template_name}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_samples, desc=f"ruler data {task} @{max_seq_length}", leave=False)

    def others(i: int, units: int) -> dict[str, Any]:
        return {"task": task, "max_seq_length": max_seq_length, "sample": i, "units": units, "seed": seed,
                "prefix_tokens": prefix_tokens}

    records: list[dict[str, Any]] = []
    try:
        if isinstance(gen, FreqWords):
            records = _fit_fwe(gen, count_raw, prefix_tokens, num_samples, fit, others, bar)
        else:
            fit.update(gen.prepare(count_raw))
            inc = gen.incremental
            least = max(1, gen.min_units)  # fewer units cannot hold the sample (vt: a chain's lines)
            upper = gen.upper_bound(count_raw)
            units, probes = binary_search(lambda n: _fits(total(gen.probe(n), gen.search_extra), max_seq_length),
                                          max(inc, least), upper)
            fit.update(incremental=inc, upper_bound=upper, probes=probes,
                       units=units if units is not None else max(inc, least), search_found=units is not None)
            units = fit["units"]
            for i in range(num_samples):
                n = units
                while True:
                    text, outputs = gen.sample(n, i)
                    length = total(text)
                    if length <= max_seq_length:
                        break
                    if n - inc < least:
                        raise ConfigError(f"RULER {task}: sample {i} needs {length} tokens > length {max_seq_length} "
                                          f"with the smallest haystack the search steps to ({n} units; a step of "
                                          f"{inc} leaves fewer than the {least} a sample needs); use a longer length")
                    n -= inc
                records.append(_record(spec.family, gen.fam.answer_prefix, text, outputs, length, i,
                                       others(i, n), tokenizer))
                if bar is not None:
                    bar.update(1)
            if getattr(gen, "used_large", False):
                fit["cwe_large_word_list"] = True
    finally:
        if bar is not None:
            bar.close()
    return TaskData(task, max_seq_length, records, fit)


def _fits(tokens: int, budget: int) -> tuple[bool, int]:
    return tokens <= budget, tokens


def _fit_fwe(gen: FreqWords, count_raw, prefix_tokens: int, num_samples: int, fit: dict[str, Any], others,
             bar) -> list[dict[str, Any]]:
    """fwe's linear search (spec §1.7) and samples; the word count is found once and reused."""
    L = gen.max_len - prefix_tokens  # text tokens allowed
    inc = gen.incremental
    vocab = gen.vocab()
    w = gen.max_len // gen.wordlen
    probes = []
    text, _ = gen.text(vocab, w)
    tokens = count_raw(text)
    probes.append([w, tokens + prefix_tokens + gen.fam.tokens_to_generate])
    while tokens < L:
        w += inc
        text, _ = gen.text(vocab, w)
        tokens = count_raw(text)
        probes.append([w, tokens + prefix_tokens + gen.fam.tokens_to_generate])
    w -= inc
    fit.update(incremental=inc, units=w, probes=probes, vocab_size=gen.vocab_size, alpha=gen.alpha)
    records = []
    for i in range(num_samples):
        vocab = gen.vocab()
        n = w
        text, outputs = gen.text(vocab, n)
        while count_raw(text) > L:
            n -= inc
            if n <= 0:
                raise ConfigError(f"RULER fwe: no word count fits length {gen.env.max_seq_length}")
            text, outputs = gen.text(vocab, n)
        length = prefix_tokens + count_raw(text) + gen.fam.tokens_to_generate
        records.append(_record(gen.family, gen.fam.answer_prefix, text, outputs, length, i, others(i, n), None))
        if bar is not None:
            bar.update(1)
    return records


def _record(family: str, answer_prefix: str, text: str, outputs: list[str], length: int, i: int,
            others: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    inp, prefix = split_answer_prefix(text, answer_prefix)
    rec: dict[str, Any] = {"index": i, "input": inp, "outputs": list(outputs), "length": length,
                           "length_w_model_temp": length, "answer_prefix": prefix}
    if family == "niah":
        pos = inp.find(outputs[0])
        rec["index"] = pos  # upstream quirk: niah's index is the first answer's character offset
        rec["token_position_answer"] = len(tokenizer.encode(inp[:pos]))
    rec["others"] = others
    return rec
