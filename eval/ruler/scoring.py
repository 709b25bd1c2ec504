"""RULER's scoring (spec §1.9): post-processing, the two metrics, and every average RULER reports.

* :func:`postprocess_pred` -- strip; every control character ``\\x00``-``\\x1f`` becomes ``\\n``; strip.
* :func:`string_match_all` -- per sample the fraction of gold strings found (case-insensitive substring);
  task score = mean x 100, rounded to 2 decimals (all NIAH, vt, cwe, fwe).
* :func:`string_match_part` -- per sample 1 if any gold string is found; mean x 100, 2 decimals (qa).
  (lm-eval's helper of that name computes something else; this is RULER's definition.)
* :func:`summarize` -- per task and length, nulls, the per-length RULER score (unweighted mean of the task
  scores), categories, the MiniCPM4 paper's columns, and across lengths ``Avg``, ``wAvg (inc)``,
  ``wAvg (dec)`` and the effective length.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from minicpm4_jax.eval.ruler.tasks import CATEGORIES, PAPER_COLUMNS, TASK_NAMES, TASKS

__all__ = [
    "postprocess_pred", "string_match_all", "string_match_part", "sample_score", "METRICS", "task_score",
    "length_averages", "weighted_averages", "effective_length", "summarize", "EFFECTIVE_THRESHOLD",
]

#: Llama-2-7B's 4K score: the effective-length threshold of RULER's README.
EFFECTIVE_THRESHOLD = 85.6

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(pred: str) -> str:
    """RULER's prediction post-processing."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def _found(ref: str, pred: str) -> float:
    return 1.0 if ref.lower() in pred.lower() else 0.0


def sample_score(pred: str, refs: Sequence[str], metric: str) -> float:
    """One sample's score in [0, 1] (the prediction is used as given: post-process it first)."""
    if metric == "string_match_all":
        return sum(_found(r, pred) for r in refs) / len(refs)
    if metric == "string_match_part":
        return max(_found(r, pred) for r in refs)
    raise ValueError(f"unknown RULER metric {metric!r}")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_all`` (x100, 2 decimals)."""
    return round(sum(sample_score(p, r, "string_match_all") for p, r in zip(preds, refs)) / len(preds) * 100, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_part`` (x100, 2 decimals)."""
    return round(sum(sample_score(p, r, "string_match_part") for p, r in zip(preds, refs)) / len(preds) * 100, 2)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def task_score(task: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Post-process ``preds`` and score them with the task's metric.

    Returns:
        ``{"score": float, "nulls": "k/n", "n": n, "metric": name}`` (nulls: empty predictions after
        post-processing, as upstream counts them).

    Raises:
        ValueError: no predictions, or preds/refs of different lengths.
    """
    if not preds:
        raise ValueError(f"{task}: no predictions to score")
    if len(preds) != len(refs):
        raise ValueError(f"{task}: {len(preds)} predictions for {len(refs)} references")
    metric = TASKS[task].metric
    clean = [postprocess_pred(p) for p in preds]
    nulls = sum(len(p) == 0 for p in clean)
    return {"score": METRICS[metric](clean, refs), "nulls": f"{nulls}/{len(clean)}", "n": len(clean),
            "metric": metric}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def length_averages(scores: Mapping[str, float]) -> dict[str, Any]:
    """Averages of one length's task scores: the RULER score (mean of the tasks present), categories and the
    paper's columns (each over the tasks present; a group with none is omitted); ``complete`` = all 13."""
    present = [t for t in TASK_NAMES if t in scores]
    out: dict[str, Any] = {"score": _mean([scores[t] for t in present]) if present else None,
                           "complete": len(present) == len(TASK_NAMES), "num_tasks": len(present)}
    for key, groups in (("categories", CATEGORIES), ("paper_columns", PAPER_COLUMNS)):
        out[key] = {g: _mean([scores[t] for t in members if t in scores])
                    for g, members in groups.items() if any(t in scores for t in members)}
    return out


def weighted_averages(by_length: Mapping[int, float]) -> dict[str, float]:
    """RULER's across-length averages: ``avg`` (plain mean), ``wavg_inc`` (weights 1..n from the shortest
    length up), ``wavg_dec`` (n..1); with the README's six lengths the weights are 1..6 / 6..1 over 21."""
    lengths = sorted(by_length)
    vals = [by_length[n] for n in lengths]
    k = len(vals)
    w = list(range(1, k + 1))
    tot = sum(w)
    return {"avg": _mean(vals), "wavg_inc": sum(a * b for a, b in zip(w, vals)) / tot,
            "wavg_dec": sum(a * b for a, b in zip(reversed(w), vals)) / tot}


def effective_length(by_length: Mapping[int, float], threshold: float = EFFECTIVE_THRESHOLD) -> int | None:
    """The longest length whose score exceeds ``threshold`` (spec §1.9); ``None`` if none does."""
    ok = [n for n, s in by_length.items() if s > threshold]
    return max(ok) if ok else None


def summarize(task_results: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Any]:
    """The ``scores`` object of a RULER results file.

    Args:
        task_results: ``{task: {length: task_score(...)}}``.

    Returns:
        ``{"tasks": {task: {"metric", "score" (mean over lengths), "n", "by_length": {len: score},
        "nulls": {len: "k/n"}}}, "lengths": {len: length_averages(...)}, "average": {"avg", "wavg_inc",
        "wavg_dec"} (over complete lengths, else all), "effective_length", "score"}`` with lengths as
        strings (JSON keys). ``score`` is ``average.avg`` (one number for a table).
    """
    tasks: dict[str, Any] = {}
    per_length: dict[int, dict[str, float]] = {}
    for task in [t for t in TASK_NAMES if t in task_results] + [t for t in task_results if t not in TASKS]:
        by_len = task_results[task]
        lengths = sorted(by_len)
        tasks[task] = {
            "metric": TASKS[task].metric if task in TASKS else "",
            "score": _mean([by_len[n]["score"] for n in lengths]),
            "n": sum(by_len[n]["n"] for n in lengths),
            "by_length": {str(n): by_len[n]["score"] for n in lengths},
            "nulls": {str(n): by_len[n]["nulls"] for n in lengths},
        }
        for n in lengths:
            per_length.setdefault(n, {})[task] = by_len[n]["score"]
    lengths_out = {str(n): length_averages(per_length[n]) for n in sorted(per_length)}
    complete = {n: lengths_out[str(n)]["score"] for n in sorted(per_length) if lengths_out[str(n)]["complete"]}
    every = {n: lengths_out[str(n)]["score"] for n in sorted(per_length)}
    basis = complete or every
    average = weighted_averages(basis) if basis else {}
    return {"tasks": tasks, "lengths": lengths_out, "average": average,
            "average_over": "complete lengths" if complete else "all lengths, some tasks missing",
            "effective_length": effective_length(basis) if basis else None,
            "score": average.get("avg")}
