"""``minicpm4 eval ruler|bench|report``: the evaluation subcommands (issue 6).

Each subcommand's options and work live with its code (:mod:`minicpm4_jax.eval.ruler.run`,
:mod:`minicpm4_jax.eval.bench.run`, :mod:`minicpm4_jax.eval.report`); this module only registers them and
imports each lazily, so ``minicpm4 train`` never imports the evaluation stack.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_eval_parser", "run_eval"]

_COMMANDS = {
    "ruler": ("minicpm4_jax.eval.ruler.run",
              "RULER long-context suite (13 tasks, any length): generate the data, run a checkpoint, score"),
    "bench": ("minicpm4_jax.eval.bench.run",
              "standard benchmarks from local files: MMLU/CMMLU/C-Eval/ARC, GSM8K, MATH500, BBH, HumanEval, MBPP"),
    "report": ("minicpm4_jax.eval.report",
               "render plots (PNG) and a summary from results files of ruler/bench runs"),
}


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``eval`` with its three subcommands on the ``minicpm4`` parser."""
    ev = sub.add_parser("eval", help="evaluate a checkpoint offline: RULER, standard benchmarks, reports",
                        description="Offline evaluation: RULER, the standard benchmarks and reports.")
    esub = ev.add_subparsers(dest="eval_command", metavar="SUITE", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        try:
            mod = importlib.import_module(module)  # import-light modules: no jax at import time
        except ModuleNotFoundError as e:
            if not e.name or not (module == e.name or module.startswith(e.name + ".")):
                raise
            continue  # a partial checkout without that suite
        p = esub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)


def run_eval(args: argparse.Namespace) -> int:
    """Run the chosen ``eval`` subcommand; returns the exit status."""
    module, _ = _COMMANDS[args.eval_command]
    return int(importlib.import_module(module).run(args))
