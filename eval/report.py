"""``minicpm4 eval report``: PNG plots and an index page from results files of ``eval ruler``/``eval bench``.

Input: ``*_results.json`` files written by :func:`minicpm4_jax.eval.results.write_results` (or folders,
searched recursively). Output (``--out DIR``):

* ``ruler_heatmap_<label>.png`` -- per RULER result: score per task (rows, plus the per-length RULER mean)
  and length (columns), annotated;
* ``ruler_score_vs_length.png`` -- the per-length RULER score of every RULER result, one line each;
* ``ruler_sparse_vs_dense_<label>.png`` -- when one model was run with both ``config["attention"]`` values:
  dense and sparse heatmaps side by side and their difference;
* ``bench_<label>.png`` -- per benchmark result: one bar per task;
* ``bench_sparse_vs_dense_<label>.png`` -- grouped bars when a model has both;
* ``report.md`` -- the images with the headline numbers.

Re-running into the same ``--out`` replaces the report: the plots the earlier ``report.md`` linked that the new
one does not draw (e.g. of a result no longer given) are removed; no other file in the folder is touched.

Expected shapes (``scores`` of the results JSON):

* ``kind="ruler"``: ``{"tasks": {task: {"by_length": {"4096": score, ...}, ...}}, "lengths": {"4096":
  {"score": float, ...}}, ...}`` (:func:`minicpm4_jax.eval.ruler.scoring.summarize`);
* ``kind="bench"``: ``{"tasks": {task: {"score": float, "metric": str, "n": int}}}`` with scores in percent
  (0-100, drawn on a 0-100 axis whatever their size).

Plots use matplotlib's Agg canvas directly (no pyplot state, no display needed).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minicpm4_jax.config import ConfigError

__all__ = ["add_arguments", "run", "render_report", "load_results"]


def load_results(paths: Sequence[str | os.PathLike]) -> list[tuple[Path, dict[str, Any]]]:
    """Read results files (folders: every ``*_results.json`` below), in a stable order.

    Raises:
        ConfigError: a missing path, a folder without results files, or a file that is not a results JSON.
    """
    from minicpm4_jax.eval.results import read_results

    files: list[Path] = []
    for x in paths:
        p = Path(x)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*_results.json") if q.is_file())
            if not found:
                raise ConfigError(f"{p}: no *_results.json files in this folder")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder")
    out = []
    seen = set()
    for f in files:
        key = f.resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            res = read_results(f)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_scores(f, res)
        out.append((f, res))
    return out


def _check_scores(path: Path, res: dict[str, Any]) -> None:
    """Raise ConfigError naming ``path`` when a ruler/bench result's ``scores`` cannot be drawn (a list for
    ``tasks``, a null task, a length that is not a number, ...): before any plot, not as a traceback midway."""
    kind = res.get("kind")
    try:
        if kind == "ruler":
            _ruler_matrix(res)
            sc = res["scores"]
            for n, v in (sc.get("lengths") or {}).items():
                int(n), v.get("score")
            (sc.get("average") or {}).get("avg")
        elif kind == "bench":
            _bench_scores(res)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: malformed {kind} scores ({type(e).__name__}: {e}); give a results file that "
                          "'minicpm4 eval' wrote") from None


# -- labels and grouping -------------------------------------------------------------------------------------
def _attention(res: dict[str, Any]) -> str | None:
    att = (res.get("config") or {}).get("attention")
    if att is None:
        att = (res.get("model") or {}).get("attention")
    if att is None:
        return None
    return "sparse" if str(att).lower() in ("sparse", "infllmv2", "infllm") else "dense"


def _model_key(res: dict[str, Any]) -> str:
    m = res.get("model") or {}
    return str(m.get("checkpoint_hash") or m.get("checkpoint") or m.get("name") or "?")


def _label(res: dict[str, Any]) -> str:
    m = res.get("model") or {}
    name = str(m.get("name") or "model")
    att = _attention(res)
    h = str(m.get("checkpoint_hash") or "")[:8]
    return " ".join(x for x in (name, att, h) if x)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:80] or "result"


def _unique(names: list[str]) -> list[str]:
    out, count = [], {}
    for n in names:
        count[n] = count.get(n, 0) + 1
        out.append(n if count[n] == 1 else f"{n}_{count[n]}")
    return out


# -- drawing -------------------------------------------------------------------------------------------------
def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path, dpi: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


def _ruler_matrix(res: dict[str, Any]) -> tuple[list[str], list[str], list[list[float]]]:
    """Rows (tasks + 'RULER mean'), columns (lengths), values (NaN where missing)."""
    from minicpm4_jax.eval.ruler.tasks import TASK_NAMES

    sc = res.get("scores") or {}
    tasks = sc.get("tasks") or {}
    lengths = sorted({int(n) for t in tasks.values() for n in (t.get("by_length") or {})})
    if not lengths:
        raise ConfigError("a RULER results file without per-length task scores (scores.tasks.*.by_length)")
    rows = [t for t in TASK_NAMES if t in tasks] + [t for t in tasks if t not in TASK_NAMES]
    vals = [[float(tasks[t]["by_length"].get(str(n), math.nan)) for n in lengths] for t in rows]
    per_len = sc.get("lengths") or {}
    means = [(per_len.get(str(n)) or {}).get("score") for n in lengths]
    vals.append([math.nan if m is None else float(m) for m in means])  # a mean of 0.0 is a score, not a gap
    return rows + ["RULER mean"], [_fmt_len(n) for n in lengths], vals


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _heatmap(ax, rows, cols, vals, title, *, cmap="RdYlGn", vmin=0.0, vmax=100.0, fmt="{:.1f}"):
    import numpy as np

    arr = np.array(vals, dtype=float)
    im = ax.imshow(np.ma.masked_invalid(arr), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(cols)), labels=cols)
    ax.set_yticks(range(len(rows)), labels=rows)
    ax.set_xlabel("length (tokens)")
    ax.set_title(title, fontsize=10)
    span = vmax - vmin
    for i in range(arr.shape[0]):
        for j in range(arr.shape[1]):
            v = arr[i, j]
            if math.isnan(v):
                ax.text(j, i, "-", ha="center", va="center", fontsize=8, color="gray")
                continue
            rel = (v - vmin) / span if span else 0.5
            color = "black" if 0.25 < rel < 0.85 else "white"
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8, color=color)
    ax.axhline(len(rows) - 1.5, color="black", linewidth=1.0)
    return im


def ruler_heatmap(res: dict[str, Any], path: Path, dpi: int = 120) -> Path:
    """Score per task and length for one RULER result."""
    rows, cols, vals = _ruler_matrix(res)
    fig = _figure(2.2 + 0.9 * len(cols), 1.4 + 0.38 * len(rows))
    ax = fig.add_subplot()
    im = _heatmap(ax, rows, cols, vals, f"RULER: {_label(res)}")
    fig.colorbar(im, ax=ax, label="score")
    return _save(fig, path, dpi)


def ruler_sparse_vs_dense(dense: dict[str, Any], sparse: dict[str, Any], path: Path, dpi: int = 120) -> Path:
    """Dense and sparse heatmaps side by side, and sparse - dense."""
    r_d, c_d, v_d = _ruler_matrix(dense)
    r_s, c_s, v_s = _ruler_matrix(sparse)
    rows = [r for r in r_d if r in r_s]
    cols = [c for c in c_d if c in c_s]
    pick = lambda r0, c0, v0: [[v0[r0.index(r)][c0.index(c)] for c in cols] for r in rows]  # noqa: E731
    vd, vs = pick(r_d, c_d, v_d), pick(r_s, c_s, v_s)
    diff = [[b - a for a, b in zip(ra, rb)] for ra, rb in zip(vd, vs)]
    lim = max([abs(x) for row in diff for x in row if not math.isnan(x)] + [1.0])
    fig = _figure(3.0 + 2.4 * len(cols), 1.6 + 0.38 * len(rows))
    axes = fig.subplots(1, 3, sharey=True)
    im = _heatmap(axes[0], rows, cols, vd, "dense attention")
    _heatmap(axes[1], rows, cols, vs, "sparse attention (InfLLM v2)")
    fig.colorbar(im, ax=axes[:2], label="score", shrink=0.8)
    im2 = _heatmap(axes[2], rows, cols, diff, "sparse - dense", cmap="RdBu", vmin=-lim, vmax=lim, fmt="{:+.1f}")
    fig.colorbar(im2, ax=axes[2], label="difference", shrink=0.8)
    fig.suptitle(f"RULER sparse vs dense: {(dense.get('model') or {}).get('name', '')}", fontsize=11)
    return _save(fig, path, dpi)


def ruler_lines(results: list[dict[str, Any]], labels: list[str], path: Path, dpi: int = 120) -> Path:
    """Per-length RULER score of each result, one line each."""
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot()
    all_lengths: set[int] = set()
    for res, lab in zip(results, labels):
        per = (res.get("scores") or {}).get("lengths") or {}
        xs = sorted(int(n) for n in per if (per[n] or {}).get("score") is not None)
        all_lengths.update(xs)
        style = "--" if _attention(res) == "sparse" else "-"
        ax.plot(xs, [per[str(n)]["score"] for n in xs], style, marker="o", label=lab)
    ax.set_xscale("log", base=2)
    ticks = sorted(all_lengths)
    ax.set_xticks(ticks, labels=[_fmt_len(n) for n in ticks])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.axhline(85.6, color="gray", linewidth=0.8, linestyle=":")
    ax.text(ticks[0] if ticks else 1, 86.5, "85.6 (effective-length threshold)", fontsize=7, color="gray")
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("RULER score (mean of tasks)")
    ax.set_title("RULER score vs length", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, dpi)


def _bench_scores(res: dict[str, Any]) -> dict[str, float]:
    tasks = (res.get("scores") or {}).get("tasks") or {}
    out = {}
    for name, t in tasks.items():
        s = t.get("score") if isinstance(t, dict) else t
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            out[str(name)] = float(s)
    if not out:
        raise ConfigError("a bench results file without scores.tasks.<name>.score")
    return out


def _bench_axis_max(values: list[float]) -> float:
    """The bar axis' upper end: 100 (bench scores are percentages, :mod:`minicpm4_jax.eval.bench.run`), or the
    largest score if one is above it. (A 0-1 axis for results whose scores were all <= 1 drew a small model's
    0.79 % GSM8K as 0.79 of 1, i.e. as 79 %.)"""
    return max([100.0, *values])


def bench_bars(res: dict[str, Any], path: Path, dpi: int = 120) -> Path:
    """One horizontal bar per benchmark task, value annotated."""
    sc = _bench_scores(res)
    names = sorted(sc)
    vals = [sc[n] for n in names]
    top = _bench_axis_max(vals)
    fig = _figure(7.0, 1.2 + 0.35 * len(names))
    ax = fig.add_subplot()
    bars = ax.barh(range(len(names)), vals, color="tab:blue")
    ax.set_yticks(range(len(names)), labels=names)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.1)
    ax.bar_label(bars, labels=[f"{v:.1f}" for v in vals], fontsize=8, padding=2)
    ax.set_xlabel("score (%)")
    incomplete = res.get("scores", {}).get("incomplete")
    ax.set_title(f"Benchmarks: {_label(res)}" + (" (incomplete run)" if incomplete else ""), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path, dpi)


def bench_sparse_vs_dense(dense: dict[str, Any], sparse: dict[str, Any], path: Path, dpi: int = 120) -> Path:
    """Grouped bars: dense and sparse score per task (tasks of either run)."""
    d, s = _bench_scores(dense), _bench_scores(sparse)
    names = sorted(set(d) | set(s))
    top = _bench_axis_max(list(d.values()) + list(s.values()))
    fig = _figure(7.5, 1.4 + 0.5 * len(names))
    ax = fig.add_subplot()
    h = 0.4
    ys = range(len(names))
    b1 = ax.barh([y - h / 2 for y in ys], [d.get(n, 0.0) for n in names], height=h, label="dense", color="tab:blue")
    b2 = ax.barh([y + h / 2 for y in ys], [s.get(n, 0.0) for n in names], height=h, label="sparse",
                 color="tab:orange")
    for bars, src in ((b1, d), (b2, s)):
        ax.bar_label(bars, labels=[("-" if n not in src else f"{src[n]:.1f}")
                                   for n in names], fontsize=7, padding=2)
    ax.set_yticks(list(ys), labels=names)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.12)
    ax.set_xlabel("score (%)")
    ax.set_title(f"Benchmarks sparse vs dense: {(dense.get('model') or {}).get('name', '')}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path, dpi)


# -- the report ----------------------------------------------------------------------------------------------
def _pairs(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(dense, sparse) per model that has both (the latest of each by ``created``)."""
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        att = _attention(r)
        if att is None:
            continue
        slot = by_model.setdefault(_model_key(r), {})
        if att not in slot or str(r.get("created", "")) >= str(slot[att].get("created", "")):
            slot[att] = r
    return [(v["dense"], v["sparse"]) for v in by_model.values() if "dense" in v and "sparse" in v]


#: run settings that change which items are scored or how (a sparse-vs-dense pair must share them to compare)
_PAIR_SETTINGS = {"bench": ("data_dir", "seed", "prefix", "pass_k_samples"),
                  "ruler": ("lengths", "num_samples", "seed", "chat_template", "prefix_tokens", "data_source")}


def _pair_differences(dense: dict[str, Any], sparse: dict[str, Any], kind: str) -> list[str]:
    """What makes a (dense, sparse) pair's scores not like for like: settings of ``_PAIR_SETTINGS`` that differ, and
    tasks of both scored on a different number of items (``n``) or shots (``k_shot``); ``[]`` when they compare."""
    cd, cs = dense.get("config") or {}, sparse.get("config") or {}
    out = [f"{k} {cd.get(k)!r} vs {cs.get(k)!r}" for k in _PAIR_SETTINGS[kind] if cd.get(k) != cs.get(k)]
    td, ts = ((r.get("scores") or {}).get("tasks") or {} for r in (dense, sparse))
    for name in sorted(set(td) & set(ts)):
        for key in ("n", "k_shot"):
            vd, vs = (t.get(key) if isinstance(t, dict) else None for t in (td[name], ts[name]))
            if vd != vs:
                out.append(f"{name} {key} {vd} vs {vs}")
    return out


def _pair_note(dense: dict[str, Any], sparse: dict[str, Any], kind: str) -> list[str]:
    """report.md lines warning that a sparse-vs-dense pair was run on different items or settings."""
    diff = _pair_differences(dense, sparse, kind)
    return [f"\n**Not like for like** (dense vs sparse): {'; '.join(diff)}."] if diff else []


def render_report(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *, dpi: int = 120) -> list[Path]:
    """Render every plot the results support into ``out_dir``; returns the PNG paths (``report.md`` beside).

    Raises:
        ConfigError: unreadable inputs, or no ruler/bench results among them.
    """
    loaded = load_results(paths)
    out = Path(out_dir)
    earlier = _earlier_images(out)
    ruler = [(p, r) for p, r in loaded if r.get("kind") == "ruler"]
    bench = [(p, r) for p, r in loaded if r.get("kind") == "bench"]
    if not ruler and not bench:
        kinds = sorted({str(r.get("kind")) for _, r in loaded})
        raise ConfigError(f"no ruler or bench results among the inputs (kinds: {', '.join(kinds) or 'none'})")
    made: list[Path] = []
    md = ["# Evaluation report", ""]

    if ruler:
        labels = _unique([_label(r) for _, r in ruler])
        md += ["## RULER", "", "| result | file | RULER score per length | Avg |", "| --- | --- | --- | ---: |"]
        for (p, r), lab in zip(ruler, labels):
            per = (r.get("scores") or {}).get("lengths") or {}
            cells = ", ".join(f"{_fmt_len(int(n))}: {v['score']:.1f}" for n, v in
                              sorted(per.items(), key=lambda kv: int(kv[0])) if v.get("score") is not None)
            avg = ((r.get("scores") or {}).get("average") or {}).get("avg")
            partial = sorted(int(n) for n, v in per.items() if v.get("score") is not None and v.get("complete") is False)
            over = (f" (over the lengths with all 13 tasks; not {', '.join(_fmt_len(n) for n in partial)})"
                    if partial and (r.get("scores") or {}).get("average_over") == "complete lengths" else "")
            md.append(f"| {lab} | `{p}` | {cells} | {'-' if avg is None else f'{avg:.1f}'}{over} |")
        md.append("")
        for (_, r), lab in zip(ruler, labels):
            made.append(ruler_heatmap(r, out / f"ruler_heatmap_{_slug(lab)}.png", dpi))
            md.append(f"![RULER {lab}]({made[-1].name})")
        made.append(ruler_lines([r for _, r in ruler], labels, out / "ruler_score_vs_length.png", dpi))
        md.append(f"![RULER score vs length]({made[-1].name})")
        for d, s in _pairs([r for _, r in ruler]):
            made.append(ruler_sparse_vs_dense(d, s, out / f"ruler_sparse_vs_dense_{_slug(_label(d))}.png", dpi))
            md.append(f"![RULER sparse vs dense]({made[-1].name})")
            md += _pair_note(d, s, "ruler")
        md.append("")

    if bench:
        labels = _unique([_label(r) for _, r in bench])
        md += ["## Benchmarks", ""]
        for (p, r), lab in zip(bench, labels):
            made.append(bench_bars(r, out / f"bench_{_slug(lab)}.png", dpi))
            md.append(f"![bench {lab}]({made[-1].name}) (`{p}`)")
            if isinstance(r.get("scores", {}).get("incomplete"), str):  # an interrupted `eval bench`
                md.append(f"\n**Incomplete run** (`{p}`): {r['scores']['incomplete']}.")
        for d, s in _pairs([r for _, r in bench]):
            made.append(bench_sparse_vs_dense(d, s, out / f"bench_sparse_vs_dense_{_slug(_label(d))}.png", dpi))
            md.append(f"![bench sparse vs dense]({made[-1].name})")
            md += _pair_note(d, s, "bench")
        md.append("")

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    for name in sorted(earlier - {p.name for p in made}):  # an earlier report's plots this one does not redraw
        (out / name).unlink(missing_ok=True)
    return made


#: The file names :func:`render_report` writes (besides ``report.md``).
_REPORT_PNG = re.compile(r"(ruler_heatmap_.+|ruler_score_vs_length|ruler_sparse_vs_dense_.+|bench_.+)\.png")


def _earlier_images(out: Path) -> set[str]:
    """The plots an earlier report in ``out`` shows: the PNG names its ``report.md`` links that this module
    writes (a re-run then removes those it does not redraw, so no stale plot of a result no longer given stays
    beside the new report; other files in the folder are never touched)."""
    try:
        text = (out / "report.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return set()
    names = re.findall(r"!\[[^\]]*\]\(([^)/\\]+)\)", text)
    return {n for n in names if _REPORT_PNG.fullmatch(n)}


# -- CLI -----------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minicpm4 eval report``."""
    parser.add_argument("results", nargs="+", help="*_results.json files or folders holding them")
    parser.add_argument("--out", required=True, help="folder for the PNG plots and report.md")
    parser.add_argument("--dpi", type=int, default=120, help="image resolution, 20 to 1200 (default 120)")


def run(args: argparse.Namespace) -> int:
    """Run ``minicpm4 eval report``; returns the exit status (user errors raise ConfigError)."""
    if not 20 <= args.dpi <= 1200:  # (--dpi 100000 ended in a MemoryError traceback)
        raise ConfigError(f"--dpi={args.dpi} must be in [20, 1200]")
    from minicpm4_jax.eval.results import check_out_dir

    try:
        check_out_dir(args.out)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError("eval report needs matplotlib: pip install 'minicpm4-jax[viz]'") from None
    made = render_report(args.results, args.out, dpi=args.dpi)
    for p in made:
        print(p)
    print(Path(args.out) / "report.md")
    return 0
