"""Plot the loss curves of training runs side by side (train loss per log window, held-out loss).

Reads each run's ``summary.json`` (written by ``minicpm4 train`` into its ``out_dir``) and draws two
panels: the mean training loss of every log window, and the held-out loss at each evaluation and at
the end. Also prints the final held-out losses and their relative differences to the first run (the
baseline). Used for the InfLLM v2 vs dense comparison in ``docs/benchmarks.md``.

Example::

    .venv/bin/python scripts/plot_train_curves.py runs/cpu_tiny_dense1536 runs/cpu_tiny_sparse \\
        --labels dense "InfLLM v2" --out docs/img/cpu_tiny_sparse_vs_dense.png

matplotlib is imported lazily (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_summary(run: str) -> dict:
    """The ``summary.json`` of a run folder (or the file itself); exits with a one-line message if absent."""
    p = Path(run)
    p = p / "summary.json" if p.is_dir() else p
    if not p.is_file():
        sys.exit(f"no summary.json in {run!r}: give a finished run's out_dir")
    return json.loads(p.read_text())


def main(argv=None) -> int:
    from minicpm4_jax.argtypes import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (out_dir) or summary.json files; the first is the baseline")
    ap.add_argument("--labels", nargs="+", help="one label per run (default: folder names)")
    ap.add_argument("--out", default="train_curves.png", help="PNG file to write")
    ap.add_argument("--title", default="", help="figure title (default: none)")
    a = ap.parse_args(argv)
    labels = a.labels or [Path(r).name for r in a.runs]
    if len(labels) != len(a.runs):
        sys.exit(f"--labels has {len(labels)} names for {len(a.runs)} runs; give one per run")
    runs = [load_summary(r) for r in a.runs]
    base = runs[0]["val_loss"]
    for lab, s in zip(labels, runs):
        extra = f", attended fraction {s['attended_fraction']:.3f}" if s.get("attended_fraction") is not None else ""
        print(f"{lab:>12s}: held-out {s['val_loss']:.4f} nats at step {s['step']} "
              f"({100 * (s['val_loss'] / base - 1):+.2f}% vs {labels[0]}), {s['tokens_per_second']:.0f} tok/s{extra}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("matplotlib is needed for the plot: pip install matplotlib")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for lab, s in zip(labels, runs):
        h = s["history"]
        ax1.plot([r["step"] for r in h], [r["loss"] for r in h], label=lab, lw=1.2)
        vh = s["val_history"]
        ax2.plot([v[0] for v in vh], [v[1] for v in vh], marker="o", label=f"{lab} ({s['val_loss']:.3f})")
    ax1.set_title("training loss (mean per log window)")
    ax2.set_title("held-out loss")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.set_ylabel("nats / token")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylim(top=min(ax1.get_ylim()[1], 7.0))
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
