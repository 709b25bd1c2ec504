"""Sweeps of short training runs (experiment scripts: ``scripts/qat_token_share.py``, ``scripts/mup_transfer.py``)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["DIVERGED_FILE", "train_or_reuse"]

#: The record a sweep writes into the folder of a run that diverged (the run itself writes no ``summary.json``).
DIVERGED_FILE = "diverged.json"


def _read_json(path: Path) -> Any:
    """The JSON in ``path``, or ``None`` when it is absent or unreadable (a damaged file is not a finished run)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_or_reuse(name: str, cfg: Any, out_root: Path, fresh: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into ``out_root/name`` and return its summary, or reuse a finished run of the same config.

    A run folder counts as finished when it holds ``summary.json`` (or :data:`DIVERGED_FILE`) and a ``config.json``
    equal to the one a run of ``cfg`` writes (:func:`~minicpm4_jax.train.loop.recorded_config`; ``cfg.out_dir``
    must be that folder). A run of that config stopped before it finished (Ctrl-C, a killed sweep) is resumed from
    its latest checkpoint; anything else there is removed first. ``fresh`` retrains always.

    A run that diverges (:class:`~minicpm4_jax.train.loop.TrainingDiverged`: a learning rate too high for the
    model, which a learning-rate sweep is there to find) does not stop the sweep: it returns
    ``{"stop_reason": "diverged", "diverged": <the one-line message>, "val_loss": nan}``, also written to
    ``out_root/name/diverged.json`` so that the next invocation reuses it instead of training it again.
    """
    from minicpm4_jax.train.checkpoint import checkpoint_dir_of, holds_checkpoint_steps
    from minicpm4_jax.train.loop import TrainingDiverged, recorded_config, run_training, write_json_atomic

    run_dir = out_root / name
    summ, conf, div = run_dir / "summary.json", run_dir / "config.json", run_dir / DIVERGED_FILE
    same = not fresh and _read_json(conf) == recorded_config(cfg)
    if same:
        for f in (summ, div):
            got = _read_json(f)
            if isinstance(got, dict):
                print(f"== {name}: reusing {run_dir}" + (" (it diverged)" if f == div else ""), flush=True)
                return got
    # an unfinished run of this config (interrupted sweep): its checkpoints are continued, not removed
    resume = same and holds_checkpoint_steps(checkpoint_dir_of(cfg))
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)
    print(f"== {name}: {'resuming' if resume else 'training'} {cfg.steps} steps into {run_dir}", flush=True)
    t0 = time.perf_counter()
    try:
        s = run_training(cfg, resume=resume, progress=False, handle_signals=False)
    except TrainingDiverged as e:
        rec = {"stop_reason": "diverged", "diverged": str(e), "val_loss": math.nan,
               "wall_seconds": time.perf_counter() - t0}
        write_json_atomic(div, rec)
        print(f"== {name}: diverged after {rec['wall_seconds']:.0f} s: {e}", flush=True)
        return rec
    print(f"== {name}: held-out loss {s['val_loss']:.4f} after {time.perf_counter() - t0:.0f} s", flush=True)
    return s
