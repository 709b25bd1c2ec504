"""``minicpm4 eval bench``: standard benchmarks against a checkpoint, with a JSON + Markdown report.

Python entry points:

* :func:`evaluate` — any object with the eval-model protocol (``loglikelihood``, ``generate``)
  against benchmark names; returns ``{"scores", "items", "datasets", "config"}``;
* :func:`run_bench` — the same plus writing the result files (``kind="bench"``);
* :func:`add_arguments` / :func:`run` — the CLI hooks used by ``minicpm4_jax.eval.cli``.

All scores are percentages (0-100). Multi-subject tasks (MMLU, CMMLU, C-Eval, BBH) report the
micro average over questions as ``score`` (lm-evaluation-harness's ``weight_by_size``) and the
macro average over subjects as ``score_macro`` (OpenCompass's naive average).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from minicpm4_jax.config import check_temperature
from minicpm4_jax.eval.bench.readers import DataError
from minicpm4_jax.eval.bench.tasks import DEFAULT_TASKS, LOADERS, Task, load_task
from minicpm4_jax.eval.results import check_out_dir
from minicpm4_jax.eval.sandbox import SandboxLimits, SandboxUnavailable

CODE_TASKS = ("humaneval", "mbpp")


def _sha256(path: Path) -> str:
    try:
        from minicpm4_jax.eval.results import sha256_file

        return sha256_file(path)
    except ImportError:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()


def _subtask_scores(items: list[dict], key: str = "correct") -> dict[str, dict]:
    by: dict[str, list[float]] = {}
    for it in items:
        by.setdefault(it.get("subtask", ""), []).append(float(it[key]))
    return {s: {"score": 100.0 * sum(v) / len(v), "n": len(v)} for s, v in sorted(by.items())}


def parse_tasks(spec: str | Sequence[str] | None) -> list[str]:
    if spec is None:
        return list(DEFAULT_TASKS)
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]
    if names == ["all"]:
        return list(LOADERS)
    unknown = [t for t in names if t not in LOADERS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(LOADERS)}")
    if not names:
        raise ValueError(f"--tasks {spec if isinstance(spec, str) else list(spec)!r} names no benchmark; give "
                         f"comma-separated names ({', '.join(LOADERS)}) or 'all'")
    return list(dict.fromkeys(names))  # a task named twice runs once


#: tasks a single ``--k-shot N`` applies to (they have a dev/train pool); the others keep their
#: standard setting unless named (``--k-shot bbh=0``): BBH and MBPP have 3 fixed exemplars,
#: MATH-500 needs a training file for shots, HumanEval is 0-shot.
POOL_TASKS = ("mmlu", "cmmlu", "ceval", "arc_challenge", "arc_easy", "gsm8k")
#: the most shots the tasks with fixed exemplars have (BBH's and MBPP's 3; HumanEval is 0-shot only)
MAX_SHOTS = {"bbh": 3, "bbh_direct": 3, "mbpp": 3, "humaneval": 0}


def parse_k_shot(spec, names: Sequence[str]) -> dict[str, int]:
    """``None`` / ``5`` / ``"5"`` / ``"mmlu=5,bbh=0"`` -> {task: k} for the tasks it sets."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, dict):
        out = {str(k): int(v) for k, v in spec.items()}
    elif isinstance(spec, int) or (isinstance(spec, str) and "=" not in spec):
        try:
            k = int(spec)
        except ValueError:
            raise ValueError(f"--k-shot expects N or task=N,...; got {spec!r}") from None
        out = {t: k for t in names if t in POOL_TASKS}
    else:
        out = {}
        for part in str(spec).split(","):
            name, _, val = part.partition("=")
            name = name.strip()
            if name not in LOADERS:
                raise ValueError(f"--k-shot names unknown benchmark {name!r}; known: {', '.join(LOADERS)}")
            try:
                out[name] = int(val)
            except ValueError:
                raise ValueError(f"--k-shot expects N or task=N,...; got {spec!r}") from None
    bad = {t: k for t, k in out.items() if k < 0}
    if bad:
        raise ValueError(f"--k-shot must be >= 0 few-shot examples per task, got "
                         f"{', '.join(f'{t}={k}' for t, k in bad.items())}")
    over = {t: k for t, k in out.items() if t in MAX_SHOTS and k > MAX_SHOTS[t]}
    if over:  # (was: BBH/MBPP silently ran 3 shots, HumanEval 0, and the results recorded those)
        t, k = next(iter(over.items()))
        fix = f"has {MAX_SHOTS[t]} fixed exemplars at most; give {t}=0..{MAX_SHOTS[t]}" if MAX_SHOTS[t] else \
            "is 0-shot only; drop it"
        raise ValueError(f"--k-shot {t}={k}: {t} {fix}")
    return out


def evaluate(model, tasks: Sequence[str] | str | None, data_dir: str | Path, *, limit: int | None = None,
             k_shot: int | str | dict | None = None, seed: int = 1234, n_samples: int = 1,
             pass_ks: Sequence[int] = (1,),
             code_temperature: float | None = None, allow_code_execution: bool = False,
             sandbox_limits: SandboxLimits | None = None, workers: int = 4, math_timeout: float = 5.0,
             log=print, on_task=None) -> dict:
    """Run benchmarks ``tasks`` from ``data_dir`` against ``model``.

    ``model`` needs ``loglikelihood(list[(context, continuation)]) -> list[(float, bool)]`` and
    ``generate(prompts, *, max_new_tokens, stop, temperature, seed) -> list[str]``.
    Code tasks refuse to run unless ``allow_code_execution`` and the sandbox can isolate code.
    ``on_task(result)``, if given, is called after each task with the result so far (the return value's layout;
    the tasks not yet run are named in ``scores["incomplete"]``), so that an interrupted run keeps what finished.

    Raises:
        ValueError: an unknown task, ``limit`` or ``n_samples`` < 1, a bad ``k_shot``;
            :class:`~minicpm4_jax.eval.bench.readers.DataError` (a ``ValueError``): a benchmark's files missing or
            malformed (one line naming file and row), before any task runs.
        CodeExecutionNotAllowed: a code task without ``allow_code_execution``.
        SandboxUnavailable: a code task where the sandbox cannot isolate programs (not root, no namespaces).
    """
    from minicpm4_jax.eval.bench.code import CodeExecutionNotAllowed, score_code
    from minicpm4_jax.eval.bench.gen import score_gen
    from minicpm4_jax.eval.bench.mc import score_mc

    names = parse_tasks(tasks)
    if n_samples < 1:
        raise ValueError(f"pass@k samples must be >= 1, got {n_samples}")
    if limit is not None and limit < 1:  # (was: limit=0 gave "no records in <every file>", blaming the data)
        raise ValueError(f"limit={limit} (--limit) must be >= 1 item per task, or None for all")
    if any(t in CODE_TASKS for t in names):
        if not allow_code_execution:
            raise CodeExecutionNotAllowed(
                f"{', '.join(t for t in names if t in CODE_TASKS)} execute model-written code: pass "
                "--allow-code-execution (programs then run in the sandbox), or leave these tasks out")
        from minicpm4_jax.eval.sandbox import check_isolation

        check_isolation()
    shots = parse_k_shot(k_shot, names)
    loaded: list[Task] = [load_task(t, data_dir, k_shot=shots.get(t), limit=limit, seed=seed) for t in names]
    max_length = getattr(model, "max_length", None)
    if isinstance(max_length, int):  # before any task runs: a budget with no room for a prompt would stop the run
        room = max_length - len(getattr(model, "prefix_ids", []) or [])
        for task in loaded:
            budget = max((int(it.get("max_new_tokens", 0)) for it in task.items if task.kind != "mc"), default=0)
            if budget >= room:
                raise DataError(f"{task.name} generates up to {budget} tokens but the model's max_length is "
                                f"{max_length} (prefix included), so no prompt token fits: leave {task.name} out, "
                                "or evaluate a model with more positions")
    config = {"tasks": names, "data_dir": str(Path(data_dir).expanduser().resolve()), "limit": limit,
              "k_shot": {t.name: t.k_shot for t in loaded}, "seed": seed,
              "pass_k_samples": n_samples, "pass_ks": list(pass_ks), "code_temperature": code_temperature,
              "math_timeout": math_timeout, "allow_code_execution": allow_code_execution,
              "sandbox_limits": ((sandbox_limits or SandboxLimits()).__dict__
                                 if any(t in CODE_TASKS for t in names) else None)}
    base = Path(data_dir)
    datasets: dict[str, str] = {}
    scores: dict = {"tasks": {}}
    all_items: list[dict] = []
    for task in loaded:
        t0 = time.monotonic()
        if task.kind == "mc":
            recs, agg = score_mc(model, task.items, acc_norm=bool(task.meta.get("acc_norm")))
            entry = {"metric": "acc", "score": 100.0 * agg["acc"], "n": agg["n"], "acc": 100.0 * agg["acc"]}
            if "acc_norm" in agg:
                entry["acc_norm"] = 100.0 * agg["acc_norm"]
        elif task.kind == "gen":
            recs, agg = score_gen(model, task.items, seed=seed, math_timeout=math_timeout)
            entry = {"metric": "exact_match", "score": 100.0 * agg["exact_match"], "n": agg["n"]}
            if "exact_match_strict" in agg:
                entry["exact_match_strict"] = 100.0 * agg["exact_match_strict"]
        else:
            recs, agg = score_code(model, task.items, n_samples=n_samples, ks=pass_ks, temperature=code_temperature,
                                   seed=seed, allow_code_execution=allow_code_execution, limits=sandbox_limits,
                                   workers=workers)
            first = min(k for k in pass_ks if k <= n_samples) if any(k <= n_samples for k in pass_ks) else 1
            entry = {"metric": f"pass@{first}", "score": 100.0 * agg.get(f"pass@{first}", 0.0), "n": agg["n"],
                     "samples_per_problem": n_samples, "temperature": agg["temperature"]}
            for k in pass_ks:
                if f"pass@{k}" in agg:
                    entry[f"pass@{k}"] = 100.0 * agg[f"pass@{k}"]
        if agg.get("truncated"):  # lm-eval's left cut to max_length: say so, the score is not full-context
            entry["truncated"] = agg["truncated"]
            if log:
                budget = " minus the generation budget" if task.kind != "mc" else ""
                fix = "fewer --k-shot, or a longer max_length" if task.k_shot else "a model with a longer max_length"
                log(f"warning: {task.name}: {agg['truncated']} of {agg['n']} items had their context cut from "
                    f"the left to max_length={getattr(model, 'max_length', '?')} tokens{budget} ({task.k_shot}-shot); "
                    f"their scores are not full-context scores ({fix})")
        if task.kind != "code":
            subs = _subtask_scores(recs)
            if len(subs) > 1:
                entry["subtasks"] = subs
                entry["score_macro"] = sum(s["score"] for s in subs.values()) / len(subs)
        entry["k_shot"] = task.k_shot
        entry["seconds"] = round(time.monotonic() - t0, 2)
        scores["tasks"][task.name] = entry
        for r in recs:
            r["task"] = task.name
        all_items.extend(recs)
        for f in task.files:
            try:
                key = str(Path(f).resolve().relative_to(base.resolve()))
            except ValueError:
                key = str(f)
            datasets.setdefault(key, _sha256(Path(f)))
        if log:
            log(f"{task.name}: {entry['metric']} {entry['score']:.2f} (n={entry['n']}, {entry['seconds']}s)")
        left = [t.name for t in loaded if t.name not in scores["tasks"]]
        if on_task is not None and left:
            partial = {**scores, "incomplete": f"{len(scores['tasks'])} of {len(loaded)} tasks finished; "
                                               f"not run: {', '.join(left)}"}
            on_task({"scores": partial, "items": list(all_items), "datasets": dict(datasets), "config": config})
    if scores["tasks"]:
        scores["average"] = sum(e["score"] for e in scores["tasks"].values()) / len(scores["tasks"])
    return {"scores": scores, "items": all_items, "datasets": datasets, "config": config}


def model_info(model) -> dict:
    if callable(getattr(model, "info", None)):
        return dict(model.info())
    info = {}
    for k in ("name", "checkpoint_hash", "max_length", "attention", "checkpoint", "step"):
        v = getattr(model, k, None)
        if v is not None and isinstance(v, (str, int, float, bool)):
            info[k] = v
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        for k in ("sha256", "name", "vocab_size"):
            v = getattr(tok, k, None)
            if isinstance(v, (str, int)):
                info[f"tokenizer_{k}"] = v
    return info


def run_bench(model, data_dir: str | Path, tasks: Sequence[str] | str | None = None, *,
              out_dir: str | Path | None = None, extra_config: dict | None = None, **kw) -> dict:
    """:func:`evaluate`, then write ``out_dir`` (JSON + Markdown) when given; returns the result
    dict with ``"paths"`` added.

    With ``out_dir`` the results are also written after every task but the last, with the tasks not yet run named
    in ``scores["incomplete"]``: an interrupted run keeps the tasks that finished (each write replaces the files
    whole). ``on_task(result)`` (optional) is called after each such write."""
    from minicpm4_jax.eval.results import write_results

    user_hook = kw.pop("on_task", None)

    def write(res: dict) -> tuple:
        return write_results(out_dir, kind="bench", config={**res["config"], **(extra_config or {})},
                             model_info=model_info(model), datasets=res["datasets"], items=res["items"],
                             scores=res["scores"])

    def on_task(res: dict) -> None:
        if out_dir is not None:
            write(res)
        if user_hook is not None:
            user_hook(res)

    res = evaluate(model, tasks, data_dir, on_task=on_task, **kw)
    res["paths"] = write(res) if out_dir is not None else None
    res["config"] = {**res["config"], **(extra_config or {})}
    return res


# ------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a training run (its out_dir or checkpoints folder); a Hugging Face folder "
                        "is read after `minicpm4 import hf`")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--data-dir", required=True,
                        help="folder holding the benchmark folders (mmlu/, gsm8k/, ...) or one benchmark's folder")
    parser.add_argument("--tasks", default=None,
                        help=f"comma-separated benchmarks, or 'all' (known: {', '.join(LOADERS)}; default: "
                             f"{','.join(DEFAULT_TASKS)}, the code ones only with --allow-code-execution)")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most this many items per task (subjects interleaved)")
    parser.add_argument("--k-shot", default=None,
                        help="few-shot examples: N for the tasks with a dev/train pool (MMLU, CMMLU, C-Eval, ARC, "
                             "GSM8K), or per task as 'mmlu=5,bbh=0'. Defaults: MMLU/CMMLU/C-Eval/GSM8K 5, BBH 3 "
                             "and MBPP 3 (fixed exemplars, at most 3), ARC/MATH-500/HumanEval 0")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences per generation / log-likelihood batch (default 8)")
    parser.add_argument("--prefill-chunk", type=int, default=512,
                        help="prompt tokens per prefill step (a multiple of 16; default 512)")
    parser.add_argument("--prefix", choices=("auto", "eos", "bos", "none"), default="auto",
                        help="document-start token before each context: auto (default) = the run's own (eos for a "
                             "run trained here, bos for an imported official checkpoint)")
    parser.add_argument("--pass-k-samples", type=int, default=1,
                        help="completions per code problem (1 = greedy pass@1; more = sampling, unbiased pass@k)")
    parser.add_argument("--pass-k", default="1,10,100",
                        help="k values reported when samples allow (default: %(default)s)")
    parser.add_argument("--code-temperature", type=float, default=None,
                        help="sampling temperature for code when --pass-k-samples > 1 (default 0.8)")
    parser.add_argument("--seed", type=int, default=1234, help="few-shot sampling and generation seed (default 1234)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=None,
                        help="write the JSON + Markdown results here")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's results in --out (without it such an --out is refused)")
    parser.add_argument("--no-progress", action="store_true", help="do not show progress bars")
    att = parser.add_mutually_exclusive_group()
    att.add_argument("--sparse", dest="attention", action="store_const", const="sparse",
                     help="InfLLM v2 sparse attention (default: the checkpoint's setting)")
    att.add_argument("--dense", dest="attention", action="store_const", const="dense", help="dense attention")
    parser.add_argument("--allow-code-execution", action="store_true",
                        help="run model-written programs (HumanEval, MBPP) in the sandbox (needs root on Linux)")
    parser.add_argument("--exec-timeout", type=float, default=10.0, help="wall-clock seconds per program (default 10.0)")
    parser.add_argument("--exec-memory-mb", type=int, default=1024, help="address-space limit per process, MiB (default 1024)")
    parser.add_argument("--exec-workers", type=int, default=4, help="programs executed in parallel (default 4)")
    parser.add_argument("--math-timeout", type=float, default=5.0, help="seconds per sympy equivalence check (default 5.0)")


def _ints(spec: str) -> list[int]:
    try:
        vals = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--pass-k expects comma-separated integers, got {spec!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--pass-k values must be >= 1, got {spec!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    """CLI body: returns the exit status; errors are one line on stderr (status 2)."""
    from minicpm4_jax.eval.bench.code import CodeExecutionNotAllowed

    done: list[str] = []  # tasks finished (and, with --out, written) before an interruption
    try:
        names = parse_tasks(args.tasks)
        parse_k_shot(args.k_shot, names)
        ks = _ints(args.pass_k)
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        if not Path(args.data_dir).is_dir():
            what = "is a file, not a folder" if Path(args.data_dir).exists() else "no such directory"
            raise DataError(f"{args.data_dir}: {what} (--data-dir: the folder holding the benchmark folders, or one "
                            "benchmark's folder)")
        check_out_dir(args.out_dir, owned=("bench_results.json", "bench_summary.md"), overwrite=args.overwrite)
        if not (math.isfinite(args.exec_timeout) and args.exec_timeout > 0):  # (nan/inf failed in the sandbox, after
            raise ValueError(f"--exec-timeout={args.exec_timeout} must be a finite number of seconds > 0")  # generation)
        if args.exec_memory_mb < 64 or args.exec_workers < 1:
            raise ValueError("--exec-memory-mb must be >= 64 and --exec-workers >= 1")
        ct = args.code_temperature
        if ct is not None:  # checked whatever the tasks (it goes into the results)
            check_temperature(ct, "--code-temperature")
        if not args.math_timeout > 0:
            raise ValueError(f"--math-timeout={args.math_timeout} must be > 0 seconds (a zero budget marks every "
                             "answer that needs sympy wrong)")
        code = [t for t in names if t in CODE_TASKS]
        if code and args.tasks is None and not args.allow_code_execution:
            names = [t for t in names if t not in CODE_TASKS]
            code = []
            print(f"note: skipping {', '.join(CODE_TASKS)} (they execute model-written code; "
                  "add --allow-code-execution to run them in the sandbox)", file=sys.stderr)
        if code:  # refuse before loading anything
            if not args.allow_code_execution:
                raise CodeExecutionNotAllowed(
                    f"{', '.join(code)} execute model-written code: pass --allow-code-execution, "
                    "or leave them out of --tasks")
            from minicpm4_jax.eval.sandbox import check_isolation

            check_isolation()
        from minicpm4_jax.eval.model import EvalModel

        model = EvalModel.from_checkpoint(args.checkpoint, step=args.step, attention=args.attention,
                                          batch_size=args.batch_size, prefill_chunk=args.prefill_chunk,
                                          prefix=args.prefix, progress=not args.no_progress,
                                          path_option="the checkpoint argument")
        limits = SandboxLimits(timeout_s=args.exec_timeout, memory_mb=args.exec_memory_mb)
        res = run_bench(model, args.data_dir, names, out_dir=args.out_dir, limit=args.limit, k_shot=args.k_shot,
                        seed=args.seed, n_samples=args.pass_k_samples, pass_ks=ks,
                        code_temperature=args.code_temperature,
                        allow_code_execution=args.allow_code_execution, sandbox_limits=limits,
                        workers=args.exec_workers, math_timeout=args.math_timeout,
                        extra_config={"checkpoint": str(args.checkpoint), "step": args.step,
                                      "attention": args.attention, "batch_size": args.batch_size,
                                      "prefill_chunk": args.prefill_chunk,
                                      "prefix": getattr(model, "prefix", args.prefix)},
                        log=lambda s: print(s, file=sys.stderr),
                        on_task=lambda r: done.__setitem__(slice(None), list(r["scores"]["tasks"])))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM under the `minicpm4` command (its handler raises this)
        signum = int(getattr(e, "signum", signal.SIGINT))
        if not done:
            kept = "no task had finished"
        elif args.out_dir:
            path = Path(args.out_dir) / "bench_results.json"
            try:  # what the file holds (the interruption may have come during a write; each write is whole)
                from minicpm4_jax.eval.results import read_results

                scores = read_results(path)["scores"]
                done, complete = list(scores["tasks"]), "incomplete" not in scores
            except (ValueError, KeyError, TypeError):
                complete = False
            kept = (f"the results of every task ({', '.join(done)}) are in {path}" if complete else
                    f"the finished tasks ({', '.join(done)}) are in {path}, marked incomplete (run again with "
                    "--overwrite to redo the run)")
        else:
            kept = f"{', '.join(done)} finished (no --out: nothing was written)"
        print(f"error: interrupted by {signal.Signals(signum).name}; {kept}", file=sys.stderr)
        return 128 + signum
    except (DataError, ValueError, SandboxUnavailable, CodeExecutionNotAllowed, FileNotFoundError) as e:
        # ValueError covers the project's ConfigError (bad checkpoint, options of the eval model)
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for name, e in res["scores"]["tasks"].items():
        print(f"{name:14s} {e['metric']:12s} {e['score']:6.2f}  n={e['n']}")
    if res.get("paths"):
        print(f"results: {res['paths'][0]}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:  # python -m minicpm4_jax.eval.bench.run
    p = argparse.ArgumentParser(prog="minicpm4 eval bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["evaluate", "run_bench", "add_arguments", "run", "parse_tasks", "parse_k_shot", "model_info"]
