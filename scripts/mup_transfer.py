"""μP learning-rate transfer (issue 5, "μP evidence"; paper §2.4 "model wind tunnel", spec §3.2).

Sweeps the learning rate at two or more widths on the default corpus (the CPython standard library of
``make train``), once with MiniCPM's μP (``dim_model_base`` fixed at the smallest width: hidden-matrix init
``initializer_range / sqrt(width_mult)``, hidden learning rate ``lr / width_mult``, logits ÷ ``width_mult``)
and once with the standard parameterisation (the same models with ``dim_model_base = hidden_size``, i.e.
``width_mult = 1`` everywhere, ``optimizer.mup = false``). Under μP the best learning rate should stay put
as the model widens; under SP it should move (down) with width.

Every run: the cpu_tiny recipe (AdamW, WSD, weight decay 0.1, clip 1.0) with ``--layers`` layers of head_dim
32, SwiGLU width 2.5x, no MTP, scored by its final held-out loss (nats/token, the same validation batches).
Prints a table and the best learning rate per width, writes ``<out>/results.json`` and a plot (held-out loss
against learning rate, one curve per width, μP and SP side by side). Finished runs are reused; a run that
diverges (a learning rate too high) scores NaN, and its record is reused too (``train.sweep.train_or_reuse``).

Example (about 25 minutes on an idle 2-core CPU)::

    nice -n 19 .venv/bin/python scripts/mup_transfer.py --widths 64 256 --steps 150
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _overrides(width: int, base: int, mup: bool, lr: float, a: argparse.Namespace, out: Path) -> list[str]:
    heads = width // 32
    return [
        f"model.hidden_size={width}", f"model.intermediate_size={int(2.5 * width)}",
        f"model.num_hidden_layers={a.layers}", f"model.num_attention_heads={heads}",
        f"model.num_key_value_heads={max(1, heads // 2)}", "model.head_dim=32", "model.rope_scaling=null",
        "model.mtp=false", "mtp_feature_weight=0", "mtp_detach=false",
        f"model.dim_model_base={base if mup else width}",
        f"optimizer.mup={'true' if mup else 'false'}", f"optimizer.learning_rate={lr:g}",
        f"optimizer.warmup_steps={max(1, a.steps // 10)}", f"steps={a.steps}", f"data.seq_len={a.seq_len}",
        f"data.batch_size={a.batch_size}", f"eval_every={10 * a.steps}", "sample_tokens=0",
        "max_train_minutes=null", f"checkpoint.save_every={a.steps}", "checkpoint.keep=1", f"seed={a.seed}",
        f"out_dir={out}",
    ]


def main(argv: list[str] | None = None) -> int:
    from minicpm4_jax.argtypes import DefaultsHelpFormatter, float_range, int_range

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--widths", type=int_range(64), nargs="+", default=[64, 256],
                    help="hidden sizes, multiples of 64; the smallest is μP's base width (default 64 256)")
    ap.add_argument("--lrs", type=float_range(0, lo_open=True), nargs="+",
                    default=[2 ** -k for k in (9, 8, 7, 6, 5, 4)],
                    help="learning rates to sweep (default 2^-9 ... 2^-4)")
    ap.add_argument("--steps", type=int_range(1), default=150, help="steps per run (default 150)")
    ap.add_argument("--layers", type=int_range(1), default=4, help="decoder layers (default 4)")
    ap.add_argument("--seq-len", type=int_range(1), default=128, help="tokens per training sequence")
    ap.add_argument("--batch-size", type=int_range(1), default=16, help="sequences per step")
    ap.add_argument("--seed", type=int_range(0), default=0, help="initialisation and data seed of every run")
    ap.add_argument("--out", default="runs/mup_transfer", help="folder of the runs and results.json")
    ap.add_argument("--plot", default="docs/img/mup_transfer.png", help="plot file ('' for none)")
    ap.add_argument("--fresh", action="store_true", help="retrain runs even if a finished one exists")
    a = ap.parse_args(argv)
    if any(w % 64 for w in a.widths) or len(set(a.widths)) < 2:
        sys.exit(f"--widths {a.widths}: give at least two different multiples of 64")

    import jax

    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.sweep import train_or_reuse

    t_start = time.perf_counter()
    out_root = (REPO / a.out) if not Path(a.out).is_absolute() else Path(a.out)
    out_root.mkdir(parents=True, exist_ok=True)
    widths, lrs, base = sorted(a.widths), sorted(a.lrs), min(a.widths)
    loss: dict[str, dict[int, dict[float, float]]] = {"mup": {}, "sp": {}}
    for kind in ("mup", "sp"):
        for w in widths:
            loss[kind][w] = {}
            for lr in lrs:
                name = f"{kind}_w{w}_lr{lr:g}"
                cfg = load_config("cpu_tiny", _overrides(w, base, kind == "mup", lr, a, out_root / name))
                s = train_or_reuse(name, cfg, out_root, a.fresh)
                v = s["val_loss"]
                loss[kind][w][lr] = v if v is not None and math.isfinite(v) else float("nan")

    best = {k: {w: min(lrs, key=lambda lr: (math.isnan(loss[k][w][lr]), loss[k][w][lr])) for w in widths}
            for k in loss}
    print(f"\nheld-out loss (nats/token) after {a.steps} steps x {a.batch_size * a.seq_len} tokens")
    head = f"{'param':<5s} {'width':>5s} " + " ".join(f"{lr:>9.5f}" for lr in lrs) + "   best lr"
    print(head)
    print("-" * len(head))
    for k in ("mup", "sp"):
        for w in widths:
            print(f"{k:<5s} {w:>5d} " + " ".join(f"{loss[k][w][lr]:9.4f}" for lr in lrs) + f"   {best[k][w]:g}")
    shift = {k: math.log2(best[k][widths[-1]] / best[k][widths[0]]) for k in best}
    print(f"best-LR shift from width {widths[0]} to {widths[-1]}: μP {shift['mup']:+.0f} octaves, "
          f"SP {shift['sp']:+.0f} octaves")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall / 60:.1f} min")
    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} x {os.cpu_count()} CPUs, jax {jax.__version__} ({jax.default_backend()})",
        "widths": widths, "learning_rates": lrs, "base_width": base, "steps": a.steps, "layers": a.layers,
        "tokens_per_step": a.batch_size * a.seq_len, "seed": a.seed,
        "val_loss": {k: {str(w): {f"{lr:g}": v for lr, v in d.items()} for w, d in per.items()}
                     for k, per in loss.items()},
        "best_lr": {k: {str(w): lr for w, lr in d.items()} for k, d in best.items()},
        "best_lr_shift_octaves": shift, "wall_seconds": wall,
    }
    (out_root / "results.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out_root / 'results.json'}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
        for ax, k, title in zip(axes, ("mup", "sp"), ("MiniCPM μP (dim_model_base = %d)" % base,
                                                       "standard parameterisation")):
            for i, w in enumerate(widths):
                ys = [loss[k][w][lr] for lr in lrs]
                ax.plot(lrs, ys, "o-", color=f"C{i}", label=f"width {w}")
                ax.plot([best[k][w]], [loss[k][w][best[k][w]]], "*", color=f"C{i}", ms=14)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("learning rate")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0].set_ylabel("final held-out loss (nats/token)")
        finite = [v for per in loss.values() for d in per.values() for v in d.values() if math.isfinite(v)]
        if finite:
            lo = min(finite)
            axes[0].set_ylim(lo - 0.05, min(max(finite), lo + 2.0) + 0.05)
        fig.suptitle(f"LR transfer on the CPython stdlib, {a.steps} steps x {a.batch_size * a.seq_len} tokens")
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
