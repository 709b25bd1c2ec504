"""The ``minicpm4`` command line: ``minicpm4 train`` and ``minicpm4 generate``.

Errors in the user's input (:class:`~minicpm4_jax.config.ConfigError`) print ``error: <message>``
on stderr and exit with status 2, without a traceback. A diverged run or a failed checkpoint write
(e.g. disk full) prints one ``error: <message>`` line and exits with status 1; a run
stopped by SIGTERM/SIGINT (after saving a checkpoint) exits with ``128 + signal number``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

_TRAIN_EPILOG = """\
overrides are dotted config keys with YAML values, e.g.
  minicpm4 train --config cpu_tiny steps=200 optimizer.learning_rate=0.005 data.batch_size=8
  minicpm4 train --config configs/cpu_tiny.yaml --resume log_every=5   # continue; logging may change
sections: model, optimizer, data, mesh, checkpoint, and top-level keys (steps, seed, log_every,
eval_every, eval_batches, out_dir, tensorboard, max_train_minutes, sample_prompt, sample_tokens, sample_temperature, sample_top_p);
every key, its type and default: minicpm4_jax/config.py (one dataclass per section).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``minicpm4`` command (subcommands ``train`` and ``generate``)."""
    p = argparse.ArgumentParser(
        prog="minicpm4",
        description="MiniCPM4 in JAX/Flax NNX: train a model or sample text from a checkpoint.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train a model from a config preset (the main job)",
        description="Train MiniCPM4 from a YAML preset with dotted key=value overrides; writes checkpoints, "
        "TensorBoard logs, the tokenizer and summary.json under out_dir.",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", "-c", metavar="PRESET_OR_PATH", default="cpu_tiny",
                   help="a preset name from configs/ (e.g. cpu_tiny) or a path to a YAML file (default: cpu_tiny)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint of the run (train state and data order), bitwise "
                        "identical to an uninterrupted run; the config must match the checkpoint's except logging, "
                        "eval, sampling, checkpoint frequency/location, max_train_minutes and out_dir")
    t.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override (repeatable); same as a positional override")
    t.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. steps=100 model.hidden_size=128 (values parsed as YAML)")

    g = sub.add_parser(
        "generate",
        help="sample text from a trained checkpoint",
        description="Continue a prompt with a trained model (no KV cache: one full forward per token).",
    )
    g.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a training run's out_dir or its checkpoints folder (the latest step is used); the "
                        "tokenizer is read from <out_dir>/tokenizer")
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue (must not be empty)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="how many tokens to add (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy, deterministic (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with probability >= P (default 1.0 = all)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    return p


def _drop_orbax_tracebacks() -> None:
    """Drop orbax's background-thread error logs that carry a traceback (a failed checkpoint write
    logs several hundred lines from its worker threads); the failure itself reaches the main thread as
    :class:`~minicpm4_jax.train.checkpoint.CheckpointWriteError` and is printed as one ``error:`` line."""
    import logging

    class _NoOrbaxTracebacks(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.exc_info and "orbax" in (record.pathname or ""))

    logger = logging.getLogger("absl")
    if not any(type(f).__name__ == "_NoOrbaxTracebacks" for f in logger.filters):
        logger.addFilter(_NoOrbaxTracebacks())


def _cmd_train(args: argparse.Namespace) -> int:
    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.loop import CheckpointWriteError, TrainingDiverged, run_training

    cfg = load_config(args.config, list(args.overrides) + list(args.set_overrides))
    _drop_orbax_tracebacks()
    try:
        summary = run_training(cfg, resume=args.resume, progress=not args.no_progress)
    except (TrainingDiverged, CheckpointWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if summary.get("stop_reason") == "signal":
        return 128 + int(signal.Signals[summary["signal"]])
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from minicpm4_jax.config import ConfigError
    from minicpm4_jax.generate import generate
    from minicpm4_jax.tokenizer import load_tokenizer
    from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference

    ckpt_dir = find_checkpoint_dir(args.checkpoint)
    cands = [Path(args.checkpoint) / "tokenizer", ckpt_dir.parent / "tokenizer", ckpt_dir / "tokenizer"]
    tok_dir = next((c for c in cands if c.is_dir()), None)
    if tok_dir is None:
        raise ConfigError(f"no tokenizer folder next to the checkpoint (looked in {[str(c) for c in cands]})")
    _cfg, model = load_params_for_inference(ckpt_dir)
    tokenizer = load_tokenizer(str(tok_dir))
    # This project's data pipeline separates documents with EOS: a new document follows an EOS.
    prefix = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    text = generate(model, tokenizer, args.prompt, args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, seed=args.seed, prefix_ids=prefix)
    print(args.prompt + text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``minicpm4`` console script; returns the exit status."""
    from minicpm4_jax.config import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come before and after options (``train steps=12 --resume out_dir=x``)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or args.command != "train"]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + list(extra)
    try:
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "generate":
            return _cmd_generate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
