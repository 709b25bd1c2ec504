"""Generation tasks: generate, cut at the stop strings, extract the answer, exact match."""

from __future__ import annotations

import re
from typing import Sequence

from minicpm4_jax.eval.bench.math_equiv import extract_math_answer, is_equiv
from minicpm4_jax.eval.bench.tasks import extract_bbh_cot, extract_bbh_direct, normalize_number


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any (non-empty) stop string."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def extract_gsm8k(text: str) -> tuple[str, str]:
    """(strict, flexible), normalised (:func:`normalize_number`): lm-eval's GSM8K filters, ``strict-match`` (the
    first ``#### N``) and ``flexible-extract`` (the last match of its number pattern); ``""`` where none matches."""
    m = _STRICT.search(text)
    strict = normalize_number(m.group(1)) if m else ""
    found = _FLEXIBLE.findall(text)
    flexible = normalize_number(next(g for g in found[-1] if g)) if found else ""
    return strict, flexible


def can_cut_prompts(model) -> bool:
    """Whether ``model.generate`` can cut long prompts from the left and report it
    (:meth:`~minicpm4_jax.eval.model.EvalModel.generate`'s ``truncate`` / ``return_cuts``)."""
    import inspect

    try:
        params = inspect.signature(model.generate).parameters
    except (TypeError, ValueError):
        return False
    return "truncate" in params and "return_cuts" in params


def generate_all(model, items: list[dict], *, temperature: float = 0.0, seed: int = 0,
                 n_samples: int = 1, cuts: list[int] | None = None) -> list[list[str]]:
    """``n_samples`` completions per item, grouped by (stop strings, budget) for batching.

    A prompt longer than the model's ``max_length`` minus the item's budget is cut from the left (lm-eval's
    Hugging Face backend does the same) when the model can (:func:`can_cut_prompts`); ``cuts``, if given, is filled
    with the prompt tokens cut per item (0 when it fit)."""
    groups: dict[tuple, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault((tuple(it["until"]), int(it["max_new_tokens"])), []).append(i)
    out: list[list[str]] = [[] for _ in items]
    can_cut = can_cut_prompts(model)
    if cuts is not None:
        cuts[:] = [0] * len(items)
    for (until, budget), idx in groups.items():
        for s in range(n_samples):
            prompts = [items[i]["prompt"] for i in idx]
            kw = dict(max_new_tokens=budget, stop=list(until), temperature=temperature, seed=seed + s)
            if can_cut:
                texts, cut = model.generate(prompts, truncate=True, return_cuts=True, **kw)
            else:
                texts, cut = model.generate(prompts, **kw), [0] * len(idx)
            if len(texts) != len(idx):
                raise RuntimeError(f"model returned {len(texts)} generations for {len(idx)} prompts")
            for i, t, c in zip(idx, texts, cut):
                out[i].append(cut_at_stop(t, until))
                if cuts is not None:
                    cuts[i] = max(cuts[i], int(c))
    return out


def score_gen(model, items: list[dict], *, seed: int = 0, math_timeout: float = 5.0) -> tuple[list[dict], dict]:
    """Greedy generation + extraction + exact match. Aggregate ``exact_match`` in [0, 1]; a record whose prompt
    was cut from the left to fit (:func:`generate_all`) gets ``context_cut_tokens``, the aggregate ``truncated``
    (how many items)."""
    cuts: list[int] = []
    gens = generate_all(model, items, seed=seed, cuts=cuts)
    out, hits, strict_hits = [], 0, 0
    for it, (text,) in zip(items, gens):
        kind = it["extract"]
        rec = {"id": it["id"], "subtask": it.get("subtask", ""), "gold": it["gold"], "output": text}
        if kind == "gsm8k":
            strict, flex = extract_gsm8k(text)
            pred = flex  # exact_match = lm-eval's flexible-extract (OpenCompass's last number); strict beside it
            ok = pred == it["gold"]
            rec["strict_correct"] = strict == it["gold"]
            strict_hits += rec["strict_correct"]
        elif kind == "math":
            pred = extract_math_answer(text)
            ok = is_equiv(pred, it["gold"], timeout=math_timeout)
        elif kind == "bbh_cot":
            pred = extract_bbh_cot(text)
            ok = pred == it["gold"].strip()
        elif kind == "bbh_direct":
            pred = extract_bbh_direct(text)
            ok = pred == it["gold"].strip()
        else:
            raise ValueError(f"unknown extraction {kind!r}")
        rec["pred"] = pred
        rec["correct"] = bool(ok)
        hits += bool(ok)
        if cuts[len(out)]:
            rec["context_cut_tokens"] = cuts[len(out)]
        out.append(rec)
    n = len(items)
    agg = {"exact_match": hits / n if n else 0.0, "n": n, "truncated": sum(1 for c in cuts if c)}
    if items and items[0]["extract"] == "gsm8k":
        agg["exact_match_strict"] = strict_hits / n
    return out, agg
