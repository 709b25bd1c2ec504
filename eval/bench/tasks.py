"""Benchmark definitions: which files, which prompt, which answer, from a directory the user names.

A task is loaded into a :class:`Task` holding fully built *items* (prompt text, choices or stop
strings, gold answer) so that scoring never looks at files again. ``data_dir`` may be the
folder that holds all benchmarks (``mmlu/``, ``gsm8k/``, ...) or the benchmark's own folder.

Prompts follow the standard published formats (lm-evaluation-harness task definitions, see
``docs``/spec §2.3): MMLU ``{question}\\nA. ..\\nAnswer:`` with `` A``..`` D`` scored by
log-likelihood, CMMLU/C-Eval with their Chinese description and ``答案：``, ARC
``Question: ..\\nAnswer:`` with the choice texts (acc and acc_norm), GSM8K
``Question: ..\\nAnswer:`` with worked-solution shots, BBH with the suzgun chain-of-thought
prompts (or their answer-only form), HumanEval the raw prompt, MBPP the 3-shot ``[BEGIN]``/``[DONE]``
format on task ids 11-510.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from minicpm4_jax.eval.bench import readers
from minicpm4_jax.eval.bench.readers import (WHERE, DataError, bad, find_files, read_json, read_records, require,
                                             require_text)
from minicpm4_jax.eval.bench.subjects import CEVAL_SUBJECTS, CMMLU_SUBJECTS

LETTERS = "ABCDEFGHIJ"


@dataclass
class Task:
    name: str
    kind: str  #: "mc" (log-likelihood choice), "gen" (generation + exact match), "code" (pass@k)
    metric: str  #: primary metric name (``acc``, ``exact_match``, ``pass@1``)
    items: list[dict]
    files: list[Path] = field(default_factory=list)  #: every data file read (hashed in the results)
    k_shot: int = 0
    meta: dict = field(default_factory=dict)
    shot_files: list[Path] = field(default_factory=list)  #: those of ``files`` read for few-shot exemplars only


# ------------------------------------------------------------------------------ helpers
def _bench_dir(data_dir: Path, folder: str, marker: str, gz: bool = False) -> Path:
    """``data_dir/folder`` if it exists, else ``data_dir`` itself when it looks like the folder (holds a file
    matching ``marker``, or with ``gz`` its gzip-compressed ``marker.gz``)."""
    data_dir = Path(data_dir)
    for cand in (data_dir / folder, data_dir):
        if cand.is_dir() and any(any(cand.glob(m)) for m in (marker, marker + ".gz")[: 1 + gz]):
            return cand
    raise DataError(f"{data_dir}: no {folder} data (looked for {folder}/{marker} and {marker})")


def _first(root: Path, patterns: list[str], what: str) -> Path:
    """The first file under ``root`` matching ``patterns`` (in order of preference), else a one-line DataError."""
    found = find_files(root, patterns)
    if not found:
        raise DataError(f"{root}: no {what} file (accepted names: {', '.join(patterns)})")
    return found[0]


def _limit(items: list[dict], limit: int | None) -> list[dict]:
    """First ``limit`` items, interleaving subtasks so a small limit still covers every subject."""
    if limit is None or limit >= len(items):
        return items
    by: dict[str, list[dict]] = {}
    for it in items:
        by.setdefault(it.get("subtask", ""), []).append(it)
    out: list[dict] = []
    queues = list(by.values())
    i = 0
    while len(out) < limit:
        q = queues[i % len(queues)]
        idx = i // len(queues)
        if idx < len(q):
            out.append(q[idx])
        i += 1
        if i > limit * len(queues) + len(items):
            break
    return out


def _mc_fields(rec: dict) -> tuple[str, list[str], int]:
    """(question, choices, gold index) from the MC layouts in circulation.

    Accepted: ``question`` + ``choices`` list + int/letter ``answer`` (HF MMLU); ``question`` +
    ``choice0..N`` + int ``answer`` (the shared MMLU re-export); ``question``/``Question`` +
    ``A``..``D`` + letter ``answer``/``Answer`` (CMMLU, C-Eval); a headerless row
    ``question, A, B, C, D, letter`` (the original MMLU tarball).
    """
    q = rec.get("question", rec.get("Question"))
    if isinstance(rec.get("choices"), list):
        choices = [str(c) for c in rec["choices"]]
    elif "choice0" in rec:
        choices = [str(rec[f"choice{i}"]) for i in range(10) if f"choice{i}" in rec]
    elif "A" in rec:
        choices = [str(rec[c]) for c in LETTERS if c in rec]
    elif "0" in rec and "5" in rec:  # headerless tarball row
        q = rec["0"]
        choices = [str(rec[str(i)]) for i in range(1, 5)]
        rec = {**rec, "answer": rec["5"]}
    else:
        raise bad(rec, "no choices (expected 'choices', 'choice0'..'choice3' or 'A'..'D' columns)")
    if q is None:
        raise bad(rec, "missing field 'question'")
    ans = rec.get("answer", rec.get("Answer"))
    if ans is None:
        raise bad(rec, "missing field 'answer'")
    a = str(ans).strip()
    if a.isdigit():
        gold = int(a)
    elif len(a) == 1 and a.upper() in LETTERS:
        gold = LETTERS.index(a.upper())
    else:
        raise bad(rec, f"answer {a!r} is neither a choice index nor a letter")
    if not 0 <= gold < len(choices):
        raise bad(rec, f"answer {a!r} is out of range for {len(choices)} choices")
    return str(q), choices, gold


def _mc_text(q: str, choices: list[str], answer_word: str) -> str:
    body = q.strip() + "\n" + "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(choices))
    return body + answer_word


def _subject_mc(name: str, root: Path, eval_split: str, eval_glob: str, dev_glob: str, suffixes: tuple[str, str],
                description: Callable[[str], str], answer_word: str, k_shot: int, limit: int | None,
                csv_header: bool | None = None, known: Mapping[str, str] | None = None) -> Task:
    """The per-subject layout: ``root/<eval_split>/<subject><suffixes[0]>`` (and ``root/dev/<subject><suffixes[1]>``
    for the shots), each file optionally gzip-compressed (``.gz``, as :mod:`readers` reads it). ``known`` (the
    benchmark's subject names): a folder holding none of them is another
    benchmark's (MMLU's ``test/*_test.csv`` also matches CMMLU's ``test/*.csv``) and is refused.

    Raises:
        DataError: no eval files, none of the ``known`` subjects, an empty subject file, missing or short dev files.
    """
    eval_files = find_files(root / eval_split, [eval_glob, eval_glob + ".gz"])
    if not eval_files:
        raise DataError(f"{root / eval_split}: no files matching {eval_glob}")

    def subject_of(f: Path) -> str:
        for suf in (suffixes[0] + ".gz", suffixes[0]):
            if f.name.endswith(suf):
                return f.name[: -len(suf)]
        return f.name

    if known is not None and not any(subject_of(f) in known for f in eval_files):
        raise DataError(f"{root / eval_split}: none of its {len(eval_files)} files is a {name} subject (e.g. "
                        f"{eval_files[0].name!r}; {name} names them like {next(iter(known))}{suffixes[0]}): "
                        f"this looks like another benchmark's folder; pass the {name} data")
    items, files, shot_files = [], [], []
    for f in eval_files:
        subject = subject_of(f)
        recs = read_records(f, csv_header=csv_header)
        if not recs:  # a broken download would otherwise drop the subject from the score without a word
            raise DataError(f"{f}: no records in this {name} subject file; restore it or remove it from the folder")
        files.append(f)
        shots = ""
        if k_shot > 0:
            dev = None
            for ext in (".csv", ".jsonl", ".json", ".parquet", ".csv.gz"):
                cand = root / "dev" / f"{subject}{suffixes[1].rsplit('.', 1)[0]}{ext}"
                if cand.is_file():
                    dev = cand
                    break
            if dev is None:
                raise DataError(f"{root / 'dev'}: no dev file for subject {subject!r} (needed for {k_shot}-shot)")
            dev_recs = read_records(dev, csv_header=csv_header)
            files.append(dev)
            shot_files.append(dev)
            if len(dev_recs) < k_shot:
                raise DataError(f"{dev}: {k_shot}-shot needs {k_shot} dev rows, the file has {len(dev_recs)}")
            for r in dev_recs[:k_shot]:
                q, ch, g = _mc_fields(r)
                shots += _mc_text(q, ch, answer_word) + f" {LETTERS[g]}\n\n"
        desc = description(subject)
        for i, r in enumerate(recs):
            q, ch, g = _mc_fields(r)
            items.append({
                "id": f"{subject}/{i}", "subtask": subject, "where": r[WHERE],
                "context": desc + shots + _mc_text(q, ch, answer_word),
                "choices": [f" {LETTERS[j]}" for j in range(len(ch))], "gold": g,
            })
    return Task(name, "mc", "acc", _limit(items, limit), files, k_shot,
                {"acc_norm": name != "mmlu", "subtasks": len(eval_files)}, shot_files)


def _single_file_mc(name: str, data_dir: Path, folder: str, eval_split: str, description: Callable[[str], str],
                    answer_word: str, k_shot: int, limit: int | None) -> Task:
    """The one-file-per-split layout (e.g. the Hugging Face parquet/jsonl exports): records carry
    a ``subject`` column; shots come from the ``dev`` file's rows of the same subject."""
    pats = [f"{eval_split}.jsonl", f"{eval_split}.json", f"{eval_split}.csv", f"{eval_split}.parquet",
            f"{eval_split}-*.parquet", f"{eval_split}.jsonl.gz"]
    root = None
    for cand in (Path(data_dir) / folder, Path(data_dir), Path(data_dir) / folder / "all"):
        if cand.is_dir() and find_files(cand, pats):
            root = cand
            break
    if root is None:
        raise DataError(f"{data_dir}: no {folder} data (looked for {folder}/{eval_split}/<subject> files "
                        f"and {folder}/{eval_split}.jsonl|json|csv|parquet with a 'subject' column)")
    files = find_files(root, pats)
    recs = [r for f in files for r in read_records(f)]
    if recs and not any(r.get("subject") is not None for r in recs):
        # a whole file without the column is another benchmark's (e.g. --data-dir gsm8k/ with --tasks mmlu found
        # gsm8k's test.jsonl), not a broken row: say so instead of "missing field 'subject'" at line 1 (helper 107)
        have = sorted(k for k in recs[0] if k != WHERE)
        raise DataError(f"{files[0]}: no record has a 'subject' column (fields: {', '.join(have)}): this looks like "
                        f"another benchmark's data, not {name}'s; pass the {name} data ({folder}/{eval_split}/"
                        f"<subject> files, or a {eval_split} file with a 'subject' column)")
    require(recs, ["subject"], name)
    by_dev: dict[str, list[dict]] = {}
    dev_files: list[Path] = []
    if k_shot:
        dev_files = find_files(root, [p.replace(eval_split, "dev", 1) for p in pats])
        if not dev_files:
            raise DataError(f"{root}: no dev file for {k_shot}-shot")
        files += dev_files
        for r in (r for f in dev_files for r in read_records(f)):
            by_dev.setdefault(str(r.get("subject")), []).append(r)
    items, counters = [], {}
    for r in recs:
        subject = str(r["subject"])
        shots = ""
        if k_shot:
            pool = by_dev.get(subject, [])
            if len(pool) < k_shot:
                raise bad(r, f"{k_shot}-shot needs {k_shot} dev rows of subject {subject!r}, found {len(pool)}")
            for d in pool[:k_shot]:
                q, ch, g = _mc_fields(d)
                shots += _mc_text(q, ch, answer_word) + f" {LETTERS[g]}\n\n"
        q, ch, g = _mc_fields(r)
        i = counters[subject] = counters.get(subject, -1) + 1
        items.append({"id": f"{subject}/{i}", "subtask": subject, "where": r[WHERE],
                      "context": description(subject) + shots + _mc_text(q, ch, answer_word),
                      "choices": [f" {LETTERS[j]}" for j in range(len(ch))], "gold": g})
    items.sort(key=lambda it: it["subtask"])  # stable: file order within a subject
    return Task(name, "mc", "acc", _limit(items, limit), files, k_shot,
                {"acc_norm": name != "mmlu", "subtasks": len(counters)}, dev_files)


# ---------------------------------------------------------------------------- MC tasks
def load_mmlu(data_dir: Path, k_shot: int = 5, limit: int | None = None, **_) -> Task:
    def desc(s: str) -> str:
        return f"The following are multiple choice questions (with answers) about {s.replace('_', ' ')}.\n\n"

    try:
        root = _bench_dir(data_dir, "mmlu", "test/*_test.*")
    except DataError:
        return _single_file_mc("mmlu", data_dir, "mmlu", "test", desc, "Answer:", k_shot, limit)

    # The original tarball has no header row; the re-export (and HF parquet) has one.
    sample = find_files(root / "test", ["*_test.csv", "*_test.csv.gz"])
    header = None
    if sample:
        try:
            with readers.open_text(sample[0]) as f:
                first = f.readline().lower()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DataError(f"{sample[0]}: cannot read ({' '.join(str(e).split())})") from None
        header = None if first.startswith("question,") or first.startswith(",question") else False
    return _subject_mc("mmlu", root, "test", "*_test.*", "*_dev.*", ("_test.csv", "_dev.csv"), desc, "Answer:",
                       k_shot, limit, csv_header=header)


def load_cmmlu(data_dir: Path, k_shot: int = 5, limit: int | None = None, **_) -> Task:
    def desc(s: str) -> str:
        return f"以下是关于{CMMLU_SUBJECTS.get(s, s)}的单项选择题，请直接给出正确答案的选项。\n\n"

    try:
        root = _bench_dir(data_dir, "cmmlu", "test/*.csv", gz=True)
    except DataError:
        return _single_file_mc("cmmlu", data_dir, "cmmlu", "test", desc, "答案：", k_shot, limit)

    return _subject_mc("cmmlu", root, "test", "*.csv", "*.csv", (".csv", ".csv"), desc, "答案：", k_shot, limit,
                       known=CMMLU_SUBJECTS)


def load_ceval(data_dir: Path, k_shot: int = 5, limit: int | None = None, **_) -> Task:
    def desc(s: str) -> str:
        return f"以下是中国关于{CEVAL_SUBJECTS.get(s, s)}的单项选择题，请选出其中的正确答案。\n\n"

    try:
        root = _bench_dir(data_dir, "ceval", "val/*_val.csv", gz=True)
    except DataError:
        return _single_file_mc("ceval", data_dir, "ceval", "val", desc, "答案：", k_shot, limit)

    return _subject_mc("ceval", root, "val", "*_val.csv", "*_dev.csv", ("_val.csv", "_dev.csv"), desc, "答案：",
                       k_shot, limit, known=CEVAL_SUBJECTS)


def _arc_fields(rec: dict) -> tuple[str, list[str], int]:
    q = rec.get("question")
    if isinstance(q, dict):  # original AI2 layout
        stem, ch = q.get("stem"), q.get("choices")
        if stem is None or not isinstance(ch, list):
            raise bad(rec, "question must have 'stem' and a 'choices' list")
        if not all(isinstance(c, dict) for c in ch):
            raise bad(rec, "each of question.choices must be an object {text, label}")
        texts = [str(c.get("text")) for c in ch]
        labels = [str(c.get("label")) for c in ch]
    else:  # HF layout: question str, choices {text: [], label: []}
        ch = rec.get("choices")
        if q is None or not isinstance(ch, dict):
            raise bad(rec, "expected 'question' and 'choices' {text, label}")
        stem, texts, labels = q, [str(t) for t in ch.get("text", [])], [str(x) for x in ch.get("label", [])]
    key = str(rec.get("answerKey", "")).strip()
    if key not in labels:
        raise bad(rec, f"answerKey {key!r} is not one of the labels {labels}")
    return str(stem), texts, labels.index(key)


def _load_arc(name: str, prefix: str, data_dir: Path, k_shot: int = 0, limit: int | None = None, **_) -> Task:
    root = _bench_dir(data_dir, "arc", f"{prefix}-Test.*")
    test = _first(root, [f"{prefix}-Test.jsonl", f"{prefix}-Test.json", f"{prefix}-Test.parquet",
                         f"{prefix}-Test.jsonl.gz"], f"{name} test")
    files = [test]
    shots = ""
    if k_shot:
        dev = find_files(root, [f"{prefix}-Dev.*", f"{prefix}-Train.*"])
        if not dev:
            raise DataError(f"{root}: no {prefix}-Dev file for {k_shot}-shot")
        files.append(dev[0])
        dev_recs = read_records(dev[0])
        if len(dev_recs) < k_shot:  # (was: silently fewer shots, and the results recorded the asked k)
            raise DataError(f"{dev[0]}: {k_shot}-shot needs {k_shot} dev rows, the file has {len(dev_recs)}; "
                            f"lower --k-shot for {name}")
        for r in dev_recs[:k_shot]:
            s, t, g = _arc_fields(r)
            shots += f"Question: {s}\nAnswer: {t[g]}\n\n"
    items = []
    for i, r in enumerate(read_records(test)):
        s, texts, g = _arc_fields(r)
        items.append({"id": str(r.get("id", i)), "subtask": name, "where": r[WHERE],
                      "context": shots + f"Question: {s}\nAnswer:", "choices": [" " + t for t in texts], "gold": g})
    return Task(name, "mc", "acc", _limit(items, limit), files, k_shot, {"acc_norm": True}, files[1:])


def load_arc_challenge(data_dir: Path, **kw) -> Task:
    return _load_arc("arc_challenge", "ARC-Challenge", data_dir, **kw)


def load_arc_easy(data_dir: Path, **kw) -> Task:
    return _load_arc("arc_easy", "ARC-Easy", data_dir, **kw)


# --------------------------------------------------------------------------- generation
def gsm8k_gold(answer: str) -> str:
    m = re.search(r"####\s*(.+)$", answer.strip())
    return normalize_number(m.group(1)) if m else ""


def normalize_number(s: str) -> str:
    """lm-eval's GSM8K answer normalisation before ``exact_match`` (``regexes_to_ignore`` ``,``, ``$``,
    ``(?s).*#### ``, a final ``.``; ``ignore_case``): ``"$1,234."`` -> ``"1234"``; ``"1234.00"`` stays (lm-eval
    counts it wrong against ``1234``, and so does this, so that the scores compare)."""
    s = s.strip().replace(",", "").replace("$", "")
    s = re.sub(r"(?s).*#### ", "", s)
    return re.sub(r"\.$", "", s).lower()


def load_gsm8k(data_dir: Path, k_shot: int = 5, limit: int | None = None, seed: int = 1234, **_) -> Task:
    root = _bench_dir(data_dir, "gsm8k", "test.*")
    test = _first(root, ["test.jsonl", "test.json", "test.parquet", "test.jsonl.gz", "test-*.parquet"], "gsm8k test")
    files = [test]
    pool: list[dict] = []
    if k_shot:
        train = find_files(root, ["train.jsonl", "train.json", "train.parquet", "train.jsonl.gz", "train-*.parquet"])
        if not train:
            raise DataError(f"{root}: no train file for {k_shot}-shot")
        pool = read_records(train[0])
        require(pool, ["question", "answer"], "gsm8k")
        files.append(train[0])
        if len(pool) < k_shot:
            raise DataError(f"{train[0]}: {k_shot}-shot needs {k_shot} train rows, the file has {len(pool)}; "
                            "lower --k-shot for gsm8k")
    recs = read_records(test)
    require(recs, ["question", "answer"], "gsm8k")
    rng = random.Random(seed)  # lm-eval's sampler: one generator, k train rows drawn for each test row in turn
    items = []
    for i, r in enumerate(recs):
        gold = gsm8k_gold(str(r["answer"]))
        if not gold:
            raise bad(r, "answer has no '#### <number>' line")
        shots = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n"
                        for s in (rng.sample(pool, k_shot) if k_shot else ()))
        items.append({"id": str(i), "subtask": "gsm8k", "where": r[WHERE],
                      "prompt": shots + f"Question: {r['question']}\nAnswer:",
                      "until": ["Question:", "</s>", "<|im_end|>", "\n\n"], "max_new_tokens": 256,
                      "gold": gold, "extract": "gsm8k"})
    return Task("gsm8k", "gen", "exact_match", _limit(items, limit), files, k_shot, {"shot_seed": seed}, files[1:])


def load_math500(data_dir: Path, k_shot: int = 0, limit: int | None = None, **_) -> Task:
    from minicpm4_jax.eval.bench.math_equiv import gold_answer, last_boxed

    root = _bench_dir(data_dir, "math500", "test.*")
    test = _first(root, ["test.jsonl", "test.json", "test.parquet", "test.jsonl.gz"], "math500 test")
    files = [test]
    shots = ""
    if k_shot:  # only from a training file the user provides (never from the test problems)
        train = find_files(root, ["train.jsonl", "train.json", "train.parquet"])
        if not train:
            raise DataError(f"{root}: {k_shot}-shot needs a train.jsonl beside test.jsonl (MATH-500 has none)")
        files.append(train[0])
        for r in read_records(train[0])[:k_shot]:
            if last_boxed(str(r.get("solution", ""))) is None:
                raise bad(r, "few-shot solution has no \\boxed{} answer")
            shots += f"Problem:\n{r['problem']}\n\nSolution:\n{r['solution']}\n\n"
    recs = read_records(test)
    require(recs, ["problem"], "math500")
    items = []
    for i, r in enumerate(recs):
        gold = gold_answer(r)
        if not gold:
            raise bad(r, "no 'answer' and no \\boxed{} in 'solution'")
        items.append({"id": str(r.get("unique_id", i)), "subtask": str(r.get("subject", "math500")), "where": r[WHERE],
                      "prompt": "Solve the following problem. Put the final answer in \\boxed{}.\n\n" + shots
                      + f"Problem:\n{r['problem']}\n\nSolution:",
                      "until": ["Problem:", "</s>", "<|im_end|>"], "max_new_tokens": 512, "gold": gold,
                      "extract": "math"})
    return Task("math500", "gen", "exact_match", _limit(items, limit), files, k_shot, shot_files=files[1:])


_BBH_SHOT = re.compile(r"Q: (?P<q>.*?)\nA: Let's think step by step\.(?P<cot>[ \n].*?)(?=\n\nQ: |\Z)", re.S)


def bbh_prompt_parts(prompt_text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """(task description, [(question, chain of thought, final answer)]) of a suzgun CoT prompt.

    The chain of thought keeps its leading separator (a newline, or a space in
    sports_understanding) so the exemplars are reproduced verbatim.
    """
    text = prompt_text.split("-----\n", 1)[1] if "-----\n" in prompt_text else prompt_text
    desc, _, rest = text.partition("\n\nQ: ")
    rest = "Q: " + rest
    shots = []
    for m in _BBH_SHOT.finditer(rest):
        cot = m.group("cot").rstrip()
        shots.append((m.group("q"), cot, extract_bbh_cot(cot)))
    return desc.strip(), shots


def extract_bbh_cot(text: str) -> str:
    """Text after the last "the answer is " up to the end of that line, without the final period."""
    idx = text.lower().rfind("the answer is ")
    if idx < 0:
        return ""
    ans = text[idx + len("the answer is "):].split("\n", 1)[0].strip()
    return ans[:-1].strip() if ans.endswith(".") else ans


def extract_bbh_direct(text: str) -> str:
    ans = text.strip().split("\n", 1)[0].strip()
    return ans[:-1].strip() if ans.endswith(".") else ans


def _load_bbh(data_dir: Path, cot: bool, limit: int | None, k_shot: int = 3, **_) -> Task:
    root = _bench_dir(data_dir, "bbh", "data/*.json")
    prompts_file = root / "cot_prompts.json"
    prompts = read_json(prompts_file)
    if not isinstance(prompts, dict):
        raise DataError(f"{prompts_file}:1: expected an object {{task: prompt text}}")
    files = [prompts_file]
    items = []
    k = min(k_shot, 3)
    for f in find_files(root / "data", ["*.json"]):
        task = f.stem
        if task not in prompts:
            raise DataError(f"{prompts_file}: no prompt for task {task!r}")
        if not isinstance(prompts[task], str):
            raise DataError(f"{prompts_file}: the prompt of task {task!r} must be text, got "
                            f"{type(prompts[task]).__name__}")
        desc, shots = bbh_prompt_parts(prompts[task])
        if len(shots) < k:
            raise DataError(f"{prompts_file}: prompt of {task!r} has {len(shots)} exemplars, {k} needed")
        if cot:
            head = desc + "\n\n" + "".join(f"Q: {q}\nA: Let's think step by step.{c}\n\n" for q, c, _ in shots[:k])
        else:
            head = desc + "\n\n" + "".join(f"Q: {q}\nA: {a}\n\n" for q, _, a in shots[:k])
        recs = read_records(f, field="examples")
        require(recs, ["input", "target"], f"bbh/{task}")
        files.append(f)
        for i, r in enumerate(recs):
            prompt = head + f"Q: {r['input']}\nA:" + (" Let's think step by step." if cot else "")
            items.append({"id": f"{task}/{i}", "subtask": task, "where": r[WHERE], "prompt": prompt,
                          "until": ["\n\nQ:", "\nQ:", "</s>", "<|im_end|>"] + ([] if cot else ["\n\n"]),
                          "max_new_tokens": 512 if cot else 32, "gold": str(r["target"]),
                          "extract": "bbh_cot" if cot else "bbh_direct"})
    name = "bbh" if cot else "bbh_direct"
    return Task(name, "gen", "exact_match", _limit(items, limit), files, k, {"cot": cot}, [prompts_file])


def load_bbh(data_dir: Path, limit: int | None = None, **kw) -> Task:
    return _load_bbh(data_dir, True, limit, **{k: v for k, v in kw.items() if k == "k_shot"})


def load_bbh_direct(data_dir: Path, limit: int | None = None, **kw) -> Task:
    return _load_bbh(data_dir, False, limit, **{k: v for k, v in kw.items() if k == "k_shot"})


# --------------------------------------------------------------------------------- code
HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def load_humaneval(data_dir: Path, limit: int | None = None, **_) -> Task:
    root = _bench_dir(data_dir, "humaneval", "HumanEval*")
    f = _first(root, ["HumanEval.jsonl.gz", "HumanEval.jsonl", "HumanEval*.jsonl*", "HumanEval*.parquet"],
               "humaneval")
    recs = read_records(f)
    require(recs, ["task_id"], "humaneval")
    require_text(recs, ["prompt", "test", "entry_point"], "humaneval")
    items = [{"id": r["task_id"], "subtask": "humaneval", "where": r[WHERE], "prompt": r["prompt"],
              "until": HUMANEVAL_STOP, "max_new_tokens": 512, "test": r["test"], "entry_point": r["entry_point"],
              "canonical": r.get("canonical_solution"), "program": "humaneval"} for r in recs]
    return Task("humaneval", "code", "pass@1", _limit(items, limit), [f], 0)


def humaneval_program(item: dict, completion: str) -> str:
    return item["prompt"] + completion + "\n\n" + item["test"] + "\n\n" + f"check({item['entry_point']})\n"


def _mbpp_prompt(r: dict) -> str:
    tests = "\n".join(r["test_list"])
    return f"You are an expert Python programmer, and here is your task: {r['text']} " \
           f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"


def load_mbpp(data_dir: Path, limit: int | None = None, k_shot: int = 3, **_) -> Task:
    root = _bench_dir(data_dir, "mbpp", "*.jsonl")
    f = _first(root, ["mbpp.jsonl", "mbpp.json", "mbpp*.parquet"], "mbpp")
    recs = read_records(f)
    require(recs, ["task_id", "test_list"], "mbpp")
    require_text(recs, ["text", "code"], "mbpp")
    by_id = {}
    for r in recs:
        if not isinstance(r["test_list"], list) or not all(isinstance(t, str) for t in r["test_list"]):
            raise bad(r, "'test_list' must be a list of assert strings")
        if r.get("test_setup_code") is not None and not isinstance(r["test_setup_code"], str):
            raise bad(r, "'test_setup_code' must be text")
        r["code"] = r["code"].replace("\r\n", "\n")
        try:
            by_id[int(r["task_id"])] = r
        except (TypeError, ValueError):
            raise bad(r, f"task_id {r['task_id']!r} is not an integer") from None
    shot_ids = [2, 3, 4][: min(k_shot, 3)]
    missing = [i for i in shot_ids if i not in by_id]
    if missing:
        raise DataError(f"{f}: few-shot task ids {missing} are missing (MBPP's prompt uses 2, 3, 4)")
    head = "".join(_mbpp_prompt(by_id[i]) + by_id[i]["code"] + "\n[DONE]\n\n" for i in shot_ids)
    items = []
    for tid in range(11, 511):
        if tid not in by_id:
            continue
        r = by_id[tid]
        items.append({"id": f"mbpp/{tid}", "subtask": "mbpp", "where": r[WHERE], "prompt": head + _mbpp_prompt(r),
                      "until": ["[DONE]", "\n[DONE]"], "max_new_tokens": 512,
                      "setup": str(r.get("test_setup_code") or ""), "tests": list(r["test_list"]),
                      "canonical": r["code"], "program": "mbpp"})
    if not items:
        raise DataError(f"{f}: no task ids in the MBPP test range 11-510")
    return Task("mbpp", "code", "pass@1", _limit(items, limit), [f], len(shot_ids))


def mbpp_program(item: dict, completion: str) -> str:
    """The program an MBPP answer is scored by: ``completion + test_setup_code + test_list`` (eval.md §2.2, as the
    MBPP paper runs it). The setup follows the completion because it may use what the completion defines (task 367's
    setup builds trees of the answer's ``Node`` class)."""
    return completion + "\n\n" + (item.get("setup") or "") + "\n" + "\n".join(item["tests"]) + "\n"


def build_program(item: dict, completion: str) -> str:
    return humaneval_program(item, completion) if item["program"] == "humaneval" else mbpp_program(item, completion)


# ---------------------------------------------------------------------------- registry
LOADERS: dict[str, Callable[..., Task]] = {
    "mmlu": load_mmlu, "cmmlu": load_cmmlu, "ceval": load_ceval,
    "arc_challenge": load_arc_challenge, "arc_easy": load_arc_easy,
    "gsm8k": load_gsm8k, "math500": load_math500, "bbh": load_bbh, "bbh_direct": load_bbh_direct,
    "humaneval": load_humaneval, "mbpp": load_mbpp,
}
#: the paper's benchmark list (ARC is available on request)
DEFAULT_TASKS = ("mmlu", "cmmlu", "ceval", "bbh", "gsm8k", "math500", "mbpp", "humaneval")


def load_task(name: str, data_dir: str | Path, *, k_shot: int | None = None, limit: int | None = None,
              seed: int = 1234) -> Task:
    """Load benchmark ``name`` from ``data_dir``. ``k_shot=None`` = the task's standard default."""
    if name not in LOADERS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(LOADERS)}")
    kw: dict = {"limit": limit, "seed": seed}
    if k_shot is not None:
        if k_shot < 0:
            raise ValueError(f"k-shot must be >= 0, got {k_shot}")
        kw["k_shot"] = k_shot
    task = LOADERS[name](Path(data_dir), **kw)
    if not task.items:  # an empty or header-only file would score 0 over n = 0 and enter the average
        evaluated = [str(f) for f in task.files if f not in task.shot_files]
        raise DataError(f"{name}: no records in {', '.join(evaluated) or data_dir}")
    return task


__all__ = ["Task", "LOADERS", "DEFAULT_TASKS", "load_task", "build_program", "extract_bbh_cot", "extract_bbh_direct",
           "gsm8k_gold", "normalize_number", "readers"]
