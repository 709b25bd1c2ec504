"""BitCPM4 at small scale: how much of the token budget must ternary QAT get (paper §3.3, issue 8)?

On one preset (default ``configs/cpu_tiny_qat.yaml``: the cpu_tiny model on the CPython standard
library) and a budget of N training steps (N tokens = N x batch x seq_len), trains

* (c) ``high precision`` for N steps (WSD over N; a checkpoint every ``gcd`` of the branch points),
* (a) ``ternary from scratch``: QAT for all N steps from the random init,
* (b) for each share s: high precision for (1 - s)·N steps, then ternary QAT for s·N steps.

(b) branches off (c): its high-precision stage is (c)'s checkpoint at step (1 - s)·N, which lies in
(c)'s stable phase as long as s >= the decay fraction (0.1), exactly as WSD runs are branched; the
QAT stage starts from those latent weights with a fresh optimizer, the learning rate re-warmed over
``--qat-warmup`` of its steps and its own WSD decay (``qat.init_from``, ``qat.init_step``), and
continues (c)'s data order (``qat.continue_data``), so every run sees the same token stream. Every
run is scored by its final held-out loss (nats/token on the same validation batches; the ternary
model for (a) and (b)).

Prints a table, writes ``<out>/results.json`` and plots held-out loss against s with (a) and (c) as
horizontal lines (``--plot``, default ``docs/img/qat_token_share.png``). A run whose folder already
holds a ``summary.json`` for the same config is reused (``--fresh`` retrains everything); a run that diverged
scores NaN and its record (``diverged.json``) is reused too.

Example (about 20 minutes on a 2-core CPU)::

    nice -n 19 .venv/bin/python scripts/qat_token_share.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _split_shares(ap: argparse.ArgumentParser, a: argparse.Namespace, argv: list[str]) -> None:
    """``--shares 0.1 0.2 steps=40``: nargs="+" takes the KEY=VALUE overrides that follow the shares too; move them
    back to ``a.overrides`` (in command-line order) and parse the shares, each in (0, 1)."""
    from minicpm4_jax.argtypes import float_range

    share = float_range(0, 1, lo_open=True, hi_open=True)
    shares, moved = [], []
    for text in a.shares:
        if "=" in text:
            moved.append(text)
        elif moved:
            ap.error(f"argument --shares: {text!r} follows the override {moved[-1]!r}: give the shares first, then "
                     f"the KEY=VALUE overrides")
        else:
            try:
                shares.append(share(text))
            except argparse.ArgumentTypeError as e:
                ap.error(f"argument --shares: {e}")
    if not shares:
        ap.error("argument --shares: give at least one share before the KEY=VALUE overrides")
    a.shares = shares
    a.overrides = sorted([*a.overrides, *moved], key=argv.index)


def main(argv: list[str] | None = None) -> int:
    from minicpm4_jax.argtypes import DefaultsHelpFormatter, float_range, int_range

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--config", default="cpu_tiny_qat", help="preset name or YAML path (default cpu_tiny_qat)")
    ap.add_argument("--steps", type=int_range(1), default=None,
                    help="N, the steps of every run (default: the preset's)")
    ap.add_argument("--shares", nargs="+", default=["0.1", "0.2", "0.4", "0.6"], metavar="S",
                    help="QAT token shares s, each in (0, 1); KEY=VALUE overrides may follow them")
    ap.add_argument("--qat-warmup", type=float_range(0, 1), default=0.1,
                    help="re-warmup length of a QAT stage as a fraction of its steps (default 0.1)")
    ap.add_argument("--out", default="runs/qat_token_share", help="folder of the runs and results.json")
    ap.add_argument("--plot", default="docs/img/qat_token_share.png", help="plot file ('' for none)")
    ap.add_argument("--fresh", action="store_true", help="retrain runs even if a finished one exists")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every run")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    _split_shares(ap, a, argv)

    import jax

    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.sweep import train_or_reuse as _run

    t_start = time.perf_counter()
    base = load_config(a.config, a.overrides)
    n = a.steps or base.steps
    qat_steps = {s: int(round(s * n)) for s in a.shares}
    branch = {s: n - k for s, k in qat_steps.items()}
    if any(k < 1 or b < 1 for s, k in qat_steps.items() for b in [branch[s]]):
        sys.exit(f"every share must leave >= 1 high-precision and >= 1 QAT step of N={n}: {qat_steps}")
    every = math.gcd(n, *branch.values())
    out_root = (REPO / a.out) if not Path(a.out).is_absolute() else Path(a.out)
    out_root.mkdir(parents=True, exist_ok=True)
    common = list(a.overrides) + [f"steps={n}", "sample_tokens=0", f"eval_every={10 * n}"]
    tokens_per_step = base.data.batch_size * base.data.seq_len

    hp_cfg = load_config(a.config, common + ["qat.enabled=false", f"out_dir={out_root / 'hp'}",
                                             f"checkpoint.save_every={every}", f"checkpoint.keep={n // every + 1}"])
    decay = int(round(hp_cfg.optimizer.decay_fraction * n)) if hp_cfg.optimizer.decay_steps is None else \
        hp_cfg.optimizer.decay_steps
    late = [s for s, b in branch.items() if b > n - decay]
    if late:
        print(f"note: the branch points of s={late} lie in the high-precision run's decay phase "
              f"(last {decay} steps)")
    results = {"c": _run("hp", hp_cfg, out_root, a.fresh)}
    scratch_cfg = load_config(a.config, common + ["qat.enabled=true", "qat.token_share=1",
                                                  f"out_dir={out_root / 'ternary_scratch'}",
                                                  f"checkpoint.save_every={n}", "checkpoint.keep=1"])
    results["a"] = _run("ternary_scratch", scratch_cfg, out_root, a.fresh)
    b_runs = {}
    for s in sorted(a.shares):
        k = qat_steps[s]
        cfg = load_config(a.config, list(a.overrides) + [
            f"steps={k}", "sample_tokens=0", f"eval_every={10 * n}", "qat.enabled=true", "qat.token_share=1",
            f"qat.init_from={out_root / 'hp'}", f"qat.init_step={branch[s]}",
            f"qat.warmup_steps={max(1, int(round(a.qat_warmup * k)))}", f"out_dir={out_root / f'qat_s{s:g}'}",
            f"checkpoint.save_every={k}", "checkpoint.keep=1"])
        b_runs[s] = _run(f"qat_s{s:g}", cfg, out_root, a.fresh)

    la, lc = results["a"]["val_loss"], results["c"]["val_loss"]
    rows = [("high precision (c)", n * tokens_per_step, 0, lc),
            ("ternary from scratch (a)", 0, n * tokens_per_step, la)]
    for s, r in b_runs.items():
        rows.append((f"HP then QAT, s={s:g}", branch[s] * tokens_per_step, qat_steps[s] * tokens_per_step,
                     r["val_loss"]))
    print(f"\nN = {n} steps x {tokens_per_step} tokens = {n * tokens_per_step:,} tokens per run; "
          f"held-out loss in nats/token ({base.eval_batches} x {tokens_per_step} tokens)")
    head = f"{'run':<26s} {'HP tokens':>10s} {'QAT tokens':>10s} {'held-out':>9s} {'vs (a)':>8s} {'vs (c)':>8s}"
    print(head)
    print("-" * len(head))
    for name, hp_t, q_t, loss in rows:
        print(f"{name:<26s} {hp_t:>10,d} {q_t:>10,d} {loss:9.4f} {loss - la:+8.4f} {loss - lc:+8.4f}")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall / 60:.1f} min")

    out = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} x {__import__('os').cpu_count()} CPUs, jax {jax.__version__} "
                   f"({jax.default_backend()})",
        "config": a.config, "overrides": list(a.overrides), "steps": n, "tokens_per_step": tokens_per_step,
        "decay_steps": decay, "checkpoint_every": every, "qat_warmup_fraction": a.qat_warmup,
        "high_precision": {"val_loss": lc, "wall_seconds": results["c"].get("wall_seconds")},
        "ternary_from_scratch": {"val_loss": la, "wall_seconds": results["a"].get("wall_seconds"),
                                 "zero_fraction": results["a"].get("qat", {}).get("zero_fraction")},
        "hp_then_qat": {f"{s:g}": {"hp_steps": branch[s], "qat_steps": qat_steps[s], "val_loss": r["val_loss"],
                                   "wall_seconds": r.get("wall_seconds"),
                                   "zero_fraction": r.get("qat", {}).get("zero_fraction")}
                        for s, r in b_runs.items()},
        "wall_seconds": wall,
    }
    (out_root / "results.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {out_root / 'results.json'}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = sorted(b_runs)
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.plot(xs, [b_runs[s]["val_loss"] for s in xs], "o-", color="C0", label="(b) high precision, then QAT")
        ax.axhline(la, color="C3", ls="--", label=f"(a) ternary from scratch ({la:.3f})")
        ax.axhline(lc, color="C2", ls=":", label=f"(c) high precision ({lc:.3f})")
        ax.set_xlabel("QAT share s of the training tokens")
        ax.set_ylabel("final held-out loss (nats/token)")
        ax.set_title(f"BitCPM4-style ternary QAT, {Path(str(a.config)).stem}, "
                     f"N = {n * tokens_per_step / 1e6:.2f}M tokens")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        plot = (REPO / a.plot) if not Path(a.plot).is_absolute() else Path(a.plot)
        plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120)
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    from minicpm4_jax.config import ConfigError

    try:
        sys.exit(main())
    except ConfigError as e:  # a bad preset, override or run: one line, no traceback
        sys.exit(f"error: {e}")
