"""Multiple choice by log-likelihood: one (context, " X") request per choice, argmax wins.

``acc`` compares raw log-likelihoods; ``acc_norm`` divides each by the choice's length in
characters (lm-evaluation-harness's definition). Ties go to the first choice (``argmax``).
"""

from __future__ import annotations

import math
from typing import Sequence


def _argmax(xs: Sequence[float]) -> int:
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def _choice_len(continuation: str, item: dict) -> int:
    """Characters that ``acc_norm`` divides by: the choice text without the target delimiter (``item``'s
    ``target_delimiter``, default one space) that joins it to the context, as lm-eval's ``completion_len``
    (``len(doc_to_choice(doc)[i])``; the scored continuation is ``target_delimiter + choice``)."""
    delim = item.get("target_delimiter", " ")
    return len(continuation) - len(delim) if delim and continuation.startswith(delim) else len(continuation)


def score_mc(model, items: list[dict], *, acc_norm: bool = True) -> tuple[list[dict], dict]:
    """Score multiple-choice ``items`` (``context``, ``choices``, ``gold``) with ``model.loglikelihood``.

    Returns per-item records and the aggregate ``{"acc", "acc_norm"?, "n"}`` (fractions in [0, 1]); ``acc_norm``
    ranks the log-likelihoods divided by the choice's length in characters without its leading delimiter, as
    lm-eval (:func:`_choice_len`). A model with
    ``encode_pair``, ``loglikelihood_tokens`` and ``context_cut`` (:class:`~minicpm4_jax.eval.model.EvalModel`) is
    fed the requests tokenized once, and each record whose context was cut to fit its ``max_length`` (lm-eval's left
    cut) gets ``context_cut_tokens``, the aggregate ``truncated`` (how many items).
    """
    reqs, spans = [], []
    for it in items:
        spans.append((len(reqs), len(it["choices"])))
        reqs.extend((it["context"], c) for c in it["choices"])
    cut = None
    if reqs and all(callable(getattr(model, a, None)) for a in ("encode_pair", "loglikelihood_tokens", "context_cut")):
        ids = [model.encode_pair(c, x) for c, x in reqs]
        res, cut = model.loglikelihood_tokens(ids), model.context_cut(ids)
    else:
        res = model.loglikelihood(reqs) if reqs else []
    if len(res) != len(reqs):
        raise RuntimeError(f"model returned {len(res)} log-likelihoods for {len(reqs)} requests")
    n_cut = 0
    out, hits, hits_n = [], 0, 0
    for it, (s, n) in zip(items, spans):
        lls = [float(r[0]) for r in res[s : s + n]]
        greedy = [bool(r[1]) for r in res[s : s + n]]
        if any(math.isnan(x) for x in lls):
            raise RuntimeError(f"NaN log-likelihood for item {it['id']}")
        pred = _argmax(lls)
        norm = [ll / max(1, _choice_len(c, it)) for ll, c in zip(lls, it["choices"])]
        pred_n = _argmax(norm)
        hits += pred == it["gold"]
        hits_n += pred_n == it["gold"]
        rec = {"id": it["id"], "subtask": it.get("subtask", ""), "gold": it["gold"], "pred": pred,
               "correct": pred == it["gold"], "loglikelihoods": lls, "is_greedy": greedy}
        if acc_norm:
            rec["pred_norm"] = pred_n
            rec["correct_norm"] = pred_n == it["gold"]
        if cut is not None and max(cut[s : s + n]) > 0:
            rec["context_cut_tokens"] = max(cut[s : s + n])
            n_cut += 1
        out.append(rec)
    n = len(items)
    agg = {"acc": hits / n if n else 0.0, "n": n}
    if cut is not None:
        agg["truncated"] = n_cut
    if acc_norm:
        agg["acc_norm"] = hits_n / n if n else 0.0
    return out, agg
