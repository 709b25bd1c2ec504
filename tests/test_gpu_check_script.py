"""``scripts/gpu_check.sh`` (issue 4, "On a GPU") works: its CPU dry run (interpret=True, tiny sizes) passes.

Runs the whole driver (every step under its timeout, per-part JSON, summary) with ``--quick`` and the shortest
lengths; checks the summary and that each benchmark row carries its timings and ratios. It checks the script,
not the kernels' speed (that needs the GPU run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    # The script bounds itself: every step under its timeout, all of them within this budget, then its 60 s summary.
    # The test waits for that (it had 240 s, less than the steps' own limits: at load 20 on 2 cores the steps took
    # 21 + 136 + 120 + 118 s and the test would have been killed in the third, its summary unwritten).
    budget_s = 600
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_BUDGET_S=str(budget_s),
               GPU_CHECK_JAX_CACHE=os.environ.get("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache")))
    env.pop("OUT", None)
    cmd = ["bash", "scripts/gpu_check.sh", "--dry-run", "--quick", "--out", str(out), "--",
           "--lengths", "128", "--bwd-lengths", "128", "--decode-lengths", "256"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget_s + 60 + 60)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"] == "PASS" and summary["failures"] == 0 and not summary["not_run"]
    assert [s[0] for s in summary["steps"]] == ["env", "correctness", "decode", "prefill", "prefill-bwd"]
    parts = summary["parts"]
    assert set(parts) == {"env", "correctness", "decode", "prefill", "prefill-bwd"}
    assert all(p["complete"] and p["dry_run"] for p in parts.values())
    assert len(parts["correctness"]["checks"]) == 3  # quick dry run: stage 2, decode, stage 1
    (pre,), (bwd,), (dec, dec_big) = (parts[p]["bench"] for p in ("prefill", "prefill-bwd", "decode"))
    # the longest decode length is also timed at the big batch (dry run: 2), right after batch 1
    assert (dec["N"], dec["batch"], dec_big["N"], dec_big["batch"]) == (256, 1, 256, 2)
    assert dec_big["sparse_full_ms"] > 0 and dec_big["speedup_full_vs_dense"] > 0
    for r in (pre, bwd):
        assert r["sparse_stage2_ms"] > 0 and r["dense_ms"] > 0 and r["speedup_kernel"] > 0
        assert 0 < r["attended_fraction"] <= 1 and r["tile_blocks_mean"] > 0
    assert pre["select_xla_ms"] > 0 and pre["speedup_end_to_end"] > 0
    assert dec["sparse_full_ms"] > 0 and dec["dense_pallas_ms"] > 0 and dec["speedup_full_vs_dense"] > 0
    # decode times come from calls of several layers (per-layer ms), with the selection variants and the breakdown
    assert dec["layers"] == 2
    assert min(dec[k] for k in ("select_ms", "sparse_stage2_ms", "sparse_xla_select_ms", "sparse_nosplit_ms",
                                "sparse_xla_ms")) > 0
    assert any("split and single-kernel" in c["name"] and c["status"] == "PASS" for c in parts["decode"]["checks"])
    assert "OVERALL PASS" in (out / "summary.txt").read_text()


def test_refuses_to_run_without_gpu(tmp_path):
    """Without ``--cpu-dry-run`` on a CPU-only host the script fails loudly instead of timing the interpreter."""
    res = subprocess.run([sys.executable, "scripts/gpu_kernel_check.py", "--part", "decode", "--out", str(tmp_path)],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "FAIL no GPU" in res.stdout


def test_summary_reports_decode_goal_per_batch(tmp_path):
    """The goal line names the batch of each 128K decode ratio (batch 1 first, then the big batch)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_kernel_check as gk
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = [dict(mode="decode", N=131072, batch=16, dense_ms=0.6, sparse_full_ms=0.1, speedup_full_vs_dense=6.0),
            dict(mode="decode", N=131072, batch=1, dense_ms=0.04, sparse_full_ms=0.08, speedup_full_vs_dense=0.5),
            dict(mode="decode", N=32768, batch=1, skipped="time budget")]
    part = dict(complete=True, checks=[dict(name="x", status="PASS")], bench=rows, device={"device_kind": "test"})
    (tmp_path / "decode.json").write_text(json.dumps(part))
    gk.part_summary(str(tmp_path))
    goals = json.loads((tmp_path / "summary.json").read_text())["goals"]
    assert goals == {"decode_128k_speedup": 0.5, "decode_128k_batch": 1, "decode_128k_speedup_batch16": 6.0}
    text = (tmp_path / "summary.txt").read_text()
    assert "decode 0.50x at batch 1, 6.00x at batch 16" in text
    assert "  131072  16 " in text and "   32768   1 time budget" in text
