"""``minicpm4 eval report`` (issue 6): PNG plots from RULER and benchmark results files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.report import add_arguments, render_report, run
from minicpm4_jax.eval.results import write_results
from minicpm4_jax.eval.ruler.scoring import summarize
from minicpm4_jax.eval.ruler.tasks import TASK_NAMES

pytest.importorskip("matplotlib")

_PNG = b"\x89PNG\r\n\x1a\n"


def _ruler(out: Path, attention: str, offset: float, lengths=(4096, 8192, 32768)) -> Path:
    results = {t: {n: {"score": max(0.0, 100.0 - i * 3 - j * 10 - offset), "nulls": "0/5", "n": 5}
                   for j, n in enumerate(lengths)} for i, t in enumerate(TASK_NAMES)}
    del results["qa_2"][8192]  # a missing cell is drawn as '-'
    model = {"name": "tiny", "checkpoint_hash": "abc123" * 10, "attention": "infllmv2" if attention == "sparse"
             else "dense"}
    res, _ = write_results(out, kind="ruler", config={"attention": attention}, model_info=model, datasets={},
                           items=[], scores=summarize(results))
    return res


def _bench(out: Path, attention: str, offset: float, n: int = 20) -> Path:
    tasks = {name: {"score": s - offset, "metric": m, "n": n} for name, s, m in
             [("mmlu", 31.5, "acc"), ("gsm8k", 4.0, "exact_match"), ("humaneval", 0.0, "pass@1"),
              ("bbh", 22.2, "exact_match"), ("ceval", 27.0, "acc")]}
    res, _ = write_results(out, kind="bench", config={"attention": attention},
                           model_info={"name": "tiny", "checkpoint_hash": "abc123" * 10}, datasets={}, items=[],
                           scores={"tasks": tasks})
    return res


def _valid_png(p: Path) -> tuple[int, int]:
    from PIL import Image

    data = p.read_bytes()
    assert data[:8] == _PNG, p
    with Image.open(p) as im:
        im.verify()
    with Image.open(p) as im:
        assert im.format == "PNG" and im.width > 200 and im.height > 150
        return im.size


def test_report_renders_all_plots(tmp_path):
    _ruler(tmp_path / "dense", "dense", 0.0)
    _ruler(tmp_path / "sparse", "sparse", 4.0)
    _bench(tmp_path / "dense", "dense", 0.0)
    _bench(tmp_path / "sparse", "sparse", 1.5)
    made = render_report([tmp_path / "dense", tmp_path / "sparse"], tmp_path / "report")
    names = sorted(p.name for p in made)
    assert names == sorted([
        "ruler_heatmap_tiny_dense_abc123ab.png", "ruler_heatmap_tiny_sparse_abc123ab.png",
        "ruler_score_vs_length.png", "ruler_sparse_vs_dense_tiny_dense_abc123ab.png",
        "bench_tiny_dense_abc123ab.png", "bench_tiny_sparse_abc123ab.png",
        "bench_sparse_vs_dense_tiny_dense_abc123ab.png"])
    sizes = {p.name: _valid_png(p) for p in made}
    # the side-by-side figure is wider than a single heatmap
    assert sizes["ruler_sparse_vs_dense_tiny_dense_abc123ab.png"][0] > sizes["ruler_heatmap_tiny_dense_abc123ab.png"][0]
    md = (tmp_path / "report" / "report.md").read_text()
    assert all(n in md for n in names) and "4K: " in md


def test_a_sparse_vs_dense_pair_on_different_items_is_flagged(tmp_path):
    """Break test (helper 87): a dense run with --limit 4 and a sparse one with --limit 2 were drawn side by side as a
    comparison (different questions), with no word; so were RULER runs of different sample counts or seeds."""
    _bench(tmp_path / "dense", "dense", 0.0, n=4)
    _bench(tmp_path / "sparse", "sparse", 1.5, n=2)
    _ruler(tmp_path / "dense", "dense", 0.0)
    res = _ruler(tmp_path / "sparse", "sparse", 4.0)
    data = json.loads(res.read_text())
    data["config"]["num_samples"] = 7
    res.write_text(json.dumps(data))
    render_report([tmp_path / "dense", tmp_path / "sparse"], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**Not like for like** (dense vs sparse): bbh n 4 vs 2; ceval n 4 vs 2; gsm8k n 4 vs 2;" in md, md
    assert "**Not like for like** (dense vs sparse): num_samples None vs 7." in md, md
    # a like-for-like pair gets no note
    _bench(tmp_path / "sparse", "sparse", 1.5, n=4)
    render_report([tmp_path / "dense" / "bench_results.json", tmp_path / "sparse" / "bench_results.json"],
                  tmp_path / "r3")
    assert "Not like for like" not in (tmp_path / "r3" / "report.md").read_text()


def test_report_rerun_into_the_same_out_removes_only_the_earlier_reports_plots(tmp_path):
    """A second report into the same --out from fewer results: the earlier plots it does not redraw go (they were
    left beside the new report.md before); a user's own PNG and the results files in the folder stay."""
    _ruler(tmp_path / "dense", "dense", 0.0)
    _ruler(tmp_path / "sparse", "sparse", 4.0)
    _bench(tmp_path / "sparse", "sparse", 1.5)
    out = tmp_path / "dense"  # the report beside one run's results, as `eval report RUN --out RUN` writes it
    first = render_report([tmp_path / "dense", tmp_path / "sparse"], out)
    (out / "bench_notes.png").write_bytes(_PNG)  # a PNG of the user's with a report-like name, not linked
    (out / "mine.png").write_bytes(_PNG)
    again = render_report([tmp_path / "dense"], out)
    assert sorted(p.name for p in again) == ["ruler_heatmap_tiny_dense_abc123ab.png", "ruler_score_vs_length.png"]
    assert len(first) == 5 and all(p.exists() for p in again)
    assert sorted(p.name for p in out.glob("*.png")) == sorted(
        ["bench_notes.png", "mine.png", "ruler_heatmap_tiny_dense_abc123ab.png", "ruler_score_vs_length.png"])
    assert (out / "ruler_results.json").is_file() and "sparse" not in (out / "report.md").read_text()


def test_report_single_result_no_comparison_and_cli(tmp_path):
    res = _ruler(tmp_path / "one", "dense", 0.0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(res), "--out", str(tmp_path / "r"), "--dpi", "60"])) == 0
    pngs = sorted(p.name for p in (tmp_path / "r").glob("*.png"))
    assert pngs == ["ruler_heatmap_tiny_dense_abc123ab.png", "ruler_score_vs_length.png"]
    for p in (tmp_path / "r").glob("*.png"):
        _valid_png(p)
    for dpi in ("19", "1201"):  # 100000 ended in a MemoryError traceback
        with pytest.raises(ConfigError, match=f"--dpi={dpi} must be in \\[20, 1200\\]"):
            run(parser.parse_args([str(res), "--out", str(tmp_path / "r2"), "--dpi", dpi]))


def test_report_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        render_report([tmp_path / "missing.json"], tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*_results.json"):
        render_report([tmp_path / "empty"], tmp_path / "o")
    (tmp_path / "bad_results.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="not a minicpm4 results file"):
        render_report([tmp_path / "bad_results.json"], tmp_path / "o")
    (tmp_path / "bad_results.json").write_bytes(b"\xff\xfe{}")  # not UTF-8: the message names the file
    with pytest.raises(ConfigError, match=r"bad_results.json: cannot read a results JSON \('utf-8' codec"):
        render_report([tmp_path / "bad_results.json"], tmp_path / "o")
    # third break test: a newer results_version was rendered without a word; null scores did not name the file
    (tmp_path / "new_results.json").write_text(json.dumps({"kind": "bench", "scores": {}, "results_version": 99}))
    with pytest.raises(ConfigError, match=r"new_results.json: results_version=99, this minicpm4-jax reads 1 to 1"):
        render_report([tmp_path / "new_results.json"], tmp_path / "o")
    (tmp_path / "null_results.json").write_text(json.dumps({"kind": "bench", "scores": None}))
    with pytest.raises(ConfigError, match=r"null_results.json: 'scores' is NoneType, not a mapping"):
        render_report([tmp_path / "null_results.json"], tmp_path / "o")
    # the re-break test: nested malformed scores ended in AttributeError/ValueError tracebacks, and "a bench results
    # file without scores..." did not say which file
    for name, kind, scores, what in (
            ("b1", "bench", {"tasks": ["mmlu"]}, "malformed bench scores"),
            ("b2", "bench", {}, "a bench results file without scores.tasks"),
            ("r1", "ruler", {"tasks": {"niah_single_1": None}}, "malformed ruler scores"),
            ("r2", "ruler", {"tasks": {"niah_single_1": {"by_length": {"abc": None}}}}, "malformed ruler scores"),
            ("r3", "ruler", {"tasks": []}, "a RULER results file without per-length task scores")):
        f = tmp_path / f"{name}_results.json"
        f.write_text(json.dumps({"kind": kind, "scores": scores}))
        with pytest.raises(ConfigError, match=f"^{f}: {what}"):
            render_report([f], tmp_path / "o")
    other, _ = write_results(tmp_path / "x", kind="lm_eval", config={}, model_info={}, datasets={}, items=[],
                             scores={})
    with pytest.raises(ConfigError, match="no ruler or bench results"):
        render_report([other], tmp_path / "o")


def test_an_incomplete_bench_run_is_marked_in_the_report(tmp_path):
    """Helper 67: a bench results file of an interrupted run (scores.incomplete) was reported like a complete one."""
    tasks = {"arc_easy": {"score": 25.0, "metric": "acc", "n": 8}}
    res, _ = write_results(tmp_path / "b", kind="bench", config={}, model_info={"name": "tiny"}, datasets={},
                           items=[], scores={"tasks": tasks,
                                             "incomplete": "1 of 2 tasks finished; not run: gsm8k"})
    render_report([res], tmp_path / "r", dpi=60)
    md = (tmp_path / "r" / "report.md").read_text()
    assert "**Incomplete run**" in md and "not run: gsm8k" in md
    full = _bench(tmp_path / "full", "dense", 0.0)
    render_report([full], tmp_path / "r2", dpi=60)
    assert "Incomplete" not in (tmp_path / "r2" / "report.md").read_text()


def test_plotted_numbers_equal_the_results_files_including_zero_and_small_scores(tmp_path, monkeypatch):
    """Helper 101: the heatmap's 'RULER mean' row drew a length whose mean is 0.0 as '-' (missing: ``score or nan``),
    and a bench result whose percentages were all <= 1 (a small model's 0.79 % GSM8K) was drawn on a 0-1 axis,
    i.e. as 79 %. Every annotated number must equal the results file's, on a percent axis."""
    import math

    from minicpm4_jax.eval import report

    figs: dict[str, object] = {}
    monkeypatch.setattr(report, "_save", lambda fig, path, dpi: figs.setdefault(Path(path).name, fig) and path)
    ruler = {t: {4096: {"score": 0.0, "nulls": "5/5", "n": 5}, 8192: {"score": 20.0 if i == 0 else 0.0,
                                                                      "nulls": "0/5", "n": 5}}
             for i, t in enumerate(TASK_NAMES)}
    scores = summarize(ruler)
    r, _ = write_results(tmp_path / "r", kind="ruler", config={}, model_info={"name": "tiny"}, datasets={},
                         items=[], scores=scores)
    tasks = {"gsm8k": {"score": 0.79, "metric": "exact_match", "n": 1269},
             "humaneval": {"score": 0.0, "metric": "pass@1", "n": 114}}
    b, _ = write_results(tmp_path / "b", kind="bench", config={}, model_info={"name": "tiny"}, datasets={},
                         items=[], scores={"tasks": tasks})
    render_report([r, b], tmp_path / "report", dpi=40)
    heat = next(f for n, f in figs.items() if n.startswith("ruler_heatmap_"))
    texts = [t.get_text() for t in heat.axes[0].texts]
    means = [scores["lengths"][str(n)]["score"] for n in (4096, 8192)]
    assert means[0] == 0.0 and not math.isnan(means[1])
    assert texts[-2:] == [f"{m:.1f}" for m in means], texts[-2:]  # the last row: RULER mean per length
    assert "-" not in texts  # every cell has a score
    ax = next(f for n, f in figs.items() if n.startswith("bench_")).axes[0]
    assert ax.get_xlim()[1] >= 100.0 and "%" in ax.get_xlabel()
    assert sorted(t.get_text() for t in ax.texts) == ["0.0", "0.8"]


def test_ruler_avg_over_complete_lengths_names_the_lengths_it_leaves_out(tmp_path):
    """Helper 101: report.md's RULER 'Avg' is the results file's average over the lengths that have all 13 tasks, so
    beside a length with fewer tasks it differed from the mean of the cells shown next to it without a word."""
    ruler = {t: {4096: {"score": 90.0, "nulls": "0/5", "n": 5}} for t in TASK_NAMES}
    for t in TASK_NAMES[:3]:
        ruler[t][8192] = {"score": 30.0, "nulls": "0/5", "n": 5}
    scores = summarize(ruler)
    assert scores["average"]["avg"] == 90.0 and scores["average_over"] == "complete lengths"
    r, _ = write_results(tmp_path / "r", kind="ruler", config={}, model_info={"name": "tiny"}, datasets={},
                         items=[], scores=scores)
    render_report([r], tmp_path / "report", dpi=40)
    row = next(line for line in (tmp_path / "report" / "report.md").read_text().splitlines() if "4K: 90.0" in line)
    assert "8K: 30.0" in row and row.endswith("| 90.0 (over the lengths with all 13 tasks; not 8K) |"), row
    full = {t: {4096: {"score": 90.0, "nulls": "0/5", "n": 5}} for t in TASK_NAMES}
    r2, _ = write_results(tmp_path / "r2", kind="ruler", config={}, model_info={"name": "tiny"}, datasets={},
                          items=[], scores=summarize(full))
    render_report([r2], tmp_path / "report2", dpi=40)
    assert "| 90.0 |" in (tmp_path / "report2" / "report.md").read_text()
