"""Code benchmarks (HumanEval, MBPP): sample completions, execute them in the sandbox, pass@k."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minicpm4_jax.eval.bench.gen import generate_all
from minicpm4_jax.eval.bench.tasks import build_program
from minicpm4_jax.eval.sandbox import SandboxLimits, check_isolation, run_programs


class CodeExecutionNotAllowed(RuntimeError):
    """Executing model-written code needs an explicit ``--allow-code-execution``."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)`` for ``n`` samples, ``c`` correct."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def score_code(model, items: list[dict], *, n_samples: int = 1, ks: Sequence[int] = (1,),
               temperature: float | None = None, seed: int = 0, allow_code_execution: bool = False,
               limits: SandboxLimits | None = None, workers: int = 4) -> tuple[list[dict], dict]:
    """Generate ``n_samples`` completions per problem (greedy when 1, else ``temperature`` 0.8 by
    default), run each program in the sandbox and report pass@k for every k <= n_samples."""
    if not allow_code_execution:
        raise CodeExecutionNotAllowed(
            "code benchmarks execute model-written programs: pass --allow-code-execution to run them in the sandbox")
    check_isolation()  # refuse (one line) before spending time on generation
    if temperature is None:
        temperature = 0.0 if n_samples == 1 else 0.8
    cuts: list[int] = []
    gens = generate_all(model, items, temperature=temperature, seed=seed, n_samples=n_samples, cuts=cuts)
    programs = [build_program(it, g) for it, gs in zip(items, gens) for g in gs]
    results = run_programs(programs, limits or SandboxLimits(), workers=workers, progress=len(programs) > 20,
                           check_end=True)  # a program that exits before its tests finish fails
    out, per_k = [], {k: [] for k in ks if k <= n_samples}
    pos = 0
    for it, gs in zip(items, gens):
        rs = results[pos : pos + len(gs)]
        pos += len(gs)
        c = sum(r.passed for r in rs)
        rec = {"id": it["id"], "subtask": it.get("subtask", ""), "n": len(gs), "passed": c,
               "completions": gs, "status": [r.status for r in rs],
               "errors": [(r.stderr.strip().splitlines() or [""])[-1][:300] for r in rs]}
        for k in per_k:
            rec[f"pass@{k}"] = pass_at_k(len(gs), c, k)
            per_k[k].append(rec[f"pass@{k}"])
        if cuts[len(out)]:
            rec["context_cut_tokens"] = cuts[len(out)]
        out.append(rec)
    agg = {f"pass@{k}": (float(np.mean(v)) if v else 0.0) for k, v in per_k.items()}
    agg["n"] = len(items)
    agg["samples_per_problem"] = n_samples
    agg["temperature"] = temperature
    agg["truncated"] = sum(1 for c in cuts if c)
    return out, agg
