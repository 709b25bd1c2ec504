"""Sweeps of short training runs (experiment scripts: ``scripts/qat_token_share.py``, ``scripts/mup_transfer.py``)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["train_or_reuse"]


def train_or_reuse(name: str, cfg: Any, out_root: Path, fresh: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into ``out_root/name`` and return its summary, or reuse a finished run of the same config.

    A run folder counts as finished when it holds ``summary.json`` and a ``config.json`` equal to the one a run of
    ``cfg`` writes (:func:`~minicpm4_jax.train.loop.recorded_config`; ``cfg.out_dir`` must be that folder); anything
    else there is removed first. ``fresh`` retrains always.
    """
    from minicpm4_jax.train.loop import recorded_config, run_training

    run_dir = out_root / name
    summ, conf = run_dir / "summary.json", run_dir / "config.json"
    if not fresh and summ.is_file() and conf.is_file() and json.loads(conf.read_text()) == recorded_config(cfg):
        print(f"== {name}: reusing {run_dir}", flush=True)
        return json.loads(summ.read_text())
    if run_dir.exists():
        shutil.rmtree(run_dir)
    print(f"== {name}: training {cfg.steps} steps into {run_dir}", flush=True)
    t0 = time.perf_counter()
    s = run_training(cfg, progress=False, handle_signals=False)
    print(f"== {name}: held-out loss {s['val_loss']:.4f} after {time.perf_counter() - t0:.0f} s", flush=True)
    return s
