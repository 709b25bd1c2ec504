"""Result files of an evaluation run: one JSON with everything, one Markdown summary (issue 6, "Reports").

The JSON holds the run's configuration, the model's identity (checkpoint path and parameter hash, tokenizer
hash), the SHA-256 of every dataset file read, the scores and the per-item predictions, plus the software
versions; ``minicpm4 eval report`` renders plots from it (:mod:`minicpm4_jax.eval.report`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["sha256_file", "write_results", "read_results", "check_out_dir", "checkpoint_folder_above", "remove_outputs",
           "RESULTS_VERSION"]

RESULTS_VERSION = 1


def check_out_dir(path: str | os.PathLike | None, option: str = "--out", *, owned: tuple[str, ...] = (),
                  overwrite: bool = False, flag: str = "--overwrite") -> None:
    """Raise ``ValueError`` (one line) when ``path`` cannot be an output folder: it, or a folder above it, is a file,
    the nearest existing folder refuses new entries (read-only, ``/proc``, no permission), it is or lies in a
    training run's checkpoint folder (:func:`checkpoint_folder_above`), or it already holds an earlier run's
    outputs.

    Args:
        owned: the entries this run writes in ``path`` (``"ruler_results.json"``, ``"pred"`` ...). When one exists
            and ``overwrite`` is false the folder is refused, naming them and ``flag``: a second run never mixes
            its files with an earlier run's or replaces its scores without a word. Other entries (another
            suite's results, unrelated files) are left alone and do not count.
        overwrite: the caller replaces the ``owned`` entries (its ``flag`` was given).

    Run before any work, so an evaluation never finishes only to fail writing its results.
    """
    if path is None:
        return
    from minicpm4_jax.convert.io import folder_write_error

    p = Path(path).absolute()
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"{option} {path}: {q} is a file, not a folder; give a folder path")
            why = folder_write_error(q)
            if why:
                raise ValueError(f"{option} {path}: {q} is not writable ({why}); give a writable folder")
            break
    ck = checkpoint_folder_above(p)
    if ck is not None:
        raise ValueError(f"{option} {path} lies in the checkpoint folder {ck} of a training run; evaluation outputs "
                         "there could replace a checkpoint's own items (its data/ folder): give a folder outside it")
    held = [name for name in owned if os.path.lexists(p / name)]
    if held and not overwrite:
        raise ValueError(f"{option} {path} already holds an earlier run's {', '.join(held)}; give a new folder, or "
                         f"{flag} to replace them")


def checkpoint_folder_above(path: str | os.PathLike) -> Path | None:
    """The orbax checkpoint folder that ``path`` is or lies in, else ``None``: a step folder or a folder of steps
    (a run's ``checkpoints/``; :func:`~minicpm4_jax.train.checkpoint.is_checkpoint_step` /
    :func:`~minicpm4_jax.train.checkpoint.holds_checkpoint_steps`), the nearest one from ``path`` upwards. Outputs
    never go there: an evaluation's ``data/`` is also the name of a step's data-iterator item."""
    from minicpm4_jax.train.checkpoint import holds_checkpoint_steps, is_checkpoint_step

    p = Path(path).absolute()
    return next((q for q in (p, *p.parents) if is_checkpoint_step(q) or holds_checkpoint_steps(q)), None)


def remove_outputs(out_dir: str | os.PathLike, names: tuple[str, ...]) -> None:
    """Remove the entries ``names`` (files or folders) of ``out_dir`` that exist: an earlier run's outputs, replaced
    by this run's (the CLIs refuse them first without ``--overwrite``, :func:`check_out_dir`)."""
    import shutil

    for name in names:
        q = Path(out_dir) / name
        if q.is_dir() and not q.is_symlink():
            shutil.rmtree(q)
        elif os.path.lexists(q):
            q.unlink()


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a file's bytes (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("minicpm4-jax", "jax", "flax"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def default_markdown(result: dict[str, Any]) -> str:
    """A Markdown summary of a results dict: model, datasets, then the scores (per-task table if present)."""
    model = result.get("model", {})
    lines = [f"# {result['kind']} results: {model.get('name', '?')}", "",
             f"- created: {result['created']}",
             f"- checkpoint: `{model.get('checkpoint', '')}` (params sha256 `{model.get('checkpoint_hash', '')[:16]}`)",
             f"- tokenizer sha256: `{str(model.get('tokenizer_hash', ''))[:16]}`",
             f"- attention: {model.get('attention', '?')}", ""]
    scores = result.get("scores", {})
    tasks = scores.get("tasks")
    if isinstance(tasks, dict) and tasks:
        lines += ["| task | metric | score | n |", "| --- | --- | ---: | ---: |"]
        for name, t in tasks.items():
            lines.append(f"| {name} | {t.get('metric', '')} | {_fmt(t.get('score', ''))} | {t.get('n', '')} |")
        lines.append("")
        for name, t in tasks.items():
            if t.get("truncated"):
                lines.append(f"- {name}: {t['truncated']} of {t.get('n', '?')} items scored on a context cut to the "
                             f"model's max_length (`context_cut_tokens` in the items)")
        if any(t.get("truncated") for t in tasks.values()):
            lines.append("")
    rest = {k: v for k, v in scores.items() if k != "tasks"}
    for k, v in rest.items():
        if isinstance(v, (int, float, str)):
            lines.append(f"- {k}: {_fmt(v)}")
    if result.get("datasets"):
        lines += ["", "Datasets (sha256):", ""]
        lines += [f"- {k}: `{v[:16]}`" for k, v in sorted(result["datasets"].items())]
    return "\n".join(lines) + "\n"


def write_results(out_dir: str | os.PathLike, *, kind: str, config: dict[str, Any], model_info: dict[str, Any],
                  datasets: dict[str, str], items: list[dict[str, Any]], scores: dict[str, Any],
                  markdown: str | None = None) -> tuple[Path, Path]:
    """Write ``<out_dir>/<kind>_results.json`` and ``<out_dir>/<kind>_summary.md``; return both paths.

    Args:
        kind: ``"ruler"``, ``"bench"``, ... (the report picks plots by it).
        config: the run's options (tasks, lengths, seeds, ``attention`` ...), JSON-serialisable.
        model_info: :meth:`~minicpm4_jax.eval.model.EvalModel.info` (or a scripted model's description).
        datasets: dataset name -> SHA-256 of the file read (:func:`sha256_file`).
        items: per-item records (prompt id, prediction, gold, score ...).
        scores: the aggregate scores; ``{"tasks": {name: {"score", "metric", "n"}}}`` renders as a table.
        markdown: the summary text; default :func:`default_markdown` of the result.

    Files are written to a temporary name and renamed, so an interrupted run never leaves a truncated result.

    Raises:
        ValueError: a value that is not JSON-serialisable (names the key).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "results_version": RESULTS_VERSION, "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config, "model": model_info, "datasets": datasets, "scores": scores,
        "versions": _versions(), "items": items,
    }
    for key, val in result.items():
        try:
            json.dumps(val)
        except (TypeError, ValueError) as e:
            raise ValueError(f"results field {key!r} is not JSON-serialisable ({e})") from None
    paths = (out / f"{kind}_results.json", out / f"{kind}_summary.md")
    texts = (json.dumps(result, indent=1, ensure_ascii=False) + "\n",
             default_markdown(result) if markdown is None else markdown)
    from minicpm4_jax.convert.io import atomic_write

    for p, text in zip(paths, texts):  # an interruption inside a write leaves the earlier file, and no temporary
        atomic_write(p, text.encode("utf-8"))
    return paths


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """Read a results JSON written by :func:`write_results`.

    Raises:
        ValueError: not a results file of this project, a ``results_version`` this code does not read, or
            ``scores`` that are not a mapping (names the file).
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:  # UnicodeDecodeError: not UTF-8
        raise ValueError(f"{p}: cannot read a results JSON ({e})") from None
    if not isinstance(data, dict) or "kind" not in data or "scores" not in data:
        raise ValueError(f"{p}: not a minicpm4 results file (no 'kind'/'scores'); give a *_results.json")
    version = data.get("results_version", RESULTS_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= RESULTS_VERSION:
        raise ValueError(f"{p}: results_version={version!r}, this minicpm4-jax reads 1 to {RESULTS_VERSION}; render it "
                         "with the version that wrote it")
    if not isinstance(data["scores"], dict):
        raise ValueError(f"{p}: 'scores' is {type(data['scores']).__name__}, not a mapping; the run that wrote it did "
                         "not finish: evaluate again")
    return data
