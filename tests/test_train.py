"""The training main job end to end on a tiny config: learning, bitwise resume, bad input, signals, CLI.

Uses the real data pipeline (``minicpm4_jax.train.data``) on a small corpus written to a temp
folder; the tokenizer/memmap cache is shared by the whole module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from minicpm4_jax.config import ConfigError, config_to_dict, load_config
from minicpm4_jax.train import loop as loop_mod
from minicpm4_jax.train.checkpoint import Checkpointer, holds_checkpoint_steps, load_params_for_inference
from minicpm4_jax.train.loop import TrainingDiverged, run_training
from minicpm4_jax.train.step import abstract_train_state

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _corpus_text(seed: int = 0, n_docs: int = 60) -> list[str]:
    """Small structured 'source code' documents: learnable, a few thousand tokens in all."""
    rng = np.random.default_rng(seed)
    names = ["alpha", "beta", "gamma", "delta", "value", "items", "result", "count", "index", "total"]
    docs = []
    for d in range(n_docs):
        lines = [f"# module {d}", "import os", ""]
        for _ in range(int(rng.integers(3, 7))):
            a, b = rng.choice(names, 2, replace=False)
            lines += [f"def {a}_{b}({a}, {b}):", f"    \"\"\"Return the {a} of {b}.\"\"\"",
                      f"    {a} = {a} + {b}", f"    for i in range({int(rng.integers(2, 9))}):",
                      f"        {b} = {b} * i", f"    return {a}", ""]
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(_corpus_text()):
        (d / f"doc{i:03d}.txt").write_text(doc)
    return d


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def tiny_overrides(corpus: Path, cache_dir: Path, out_dir: Path, **kw) -> list[str]:
    ov = {
        "model.vocab_size": 512, "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
        "model.max_position_embeddings": 128, "model.dim_model_base": 16, "model.dtype": "float32",
        "data.sources": f"[{corpus}]", "data.tokenizer_vocab_size": 384, "data.seq_len": 32,
        "data.batch_size": 4, "data.val_fraction": 0.1, "data.cache_dir": str(cache_dir),
        "steps": 8, "optimizer.warmup_steps": 2, "optimizer.decay_steps": 2, "optimizer.learning_rate": 0.02,
        "log_every": 2, "eval_every": 4, "eval_batches": 2, "checkpoint.save_every": 4, "checkpoint.keep": 3,
        "out_dir": str(out_dir), "sample_prompt": "def ", "sample_tokens": 6, "tensorboard": True,
    }
    ov.update(kw)
    return [f"{k}={v}" for k, v in ov.items()]


def tiny_cfg(corpus, cache_dir, out_dir, **kw):
    return load_config(None, tiny_overrides(corpus, cache_dir, out_dir, **kw))


def _params(state_or_params):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state_or_params)[0]}


def _restore(cfg):
    ck = Checkpointer(cfg)
    try:
        return ck.restore(abstract_train_state(cfg))
    finally:
        ck.close()


def test_trains_and_loss_decreases(corpus, cache_dir, tmp_path):
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "run", steps=24, log_every=4, eval_every=12,
                   profile_start_step=5, profile_steps=2, **{"checkpoint.save_every": 12, "optimizer.decay_steps": 4})
    logs: list[str] = []
    s = run_training(cfg, log=logs.append, progress=False)
    # steps 5..6 traced by jax.profiler into <out_dir>/profile/process_0 (XProf / TensorBoard's profile plugin)
    traces = list((tmp_path / "run" / "profile" / "process_0").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
    assert any(line.startswith("profile: steps 5..6 traced into ") for line in logs), logs
    hist = [h["loss"] for h in s["history"]]
    assert s["step"] == 24 and s["stop_reason"] == "steps"
    assert hist[-1] < hist[0] - 0.5, hist
    assert s["val_history"][-1][1] < s["val_history"][0][1]
    for k in ("val_loss", "unigram_entropy", "bigram_entropy", "unigram_heldout_xent", "bigram_heldout_xent",
              "tokens_per_second", "mfu"):
        assert np.isfinite(s[k]), k
    assert s["val_loss"] < s["unigram_entropy"]
    assert isinstance(s["sample"], str)
    out = tmp_path / "run"
    assert json.loads((out / "summary.json").read_text())["step"] == 24
    assert (out / "tokenizer").is_dir() and any((out / "tokenizer").iterdir())
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert Checkpointer(cfg).all_steps() == [12, 24]
    text = "\n".join(logs)
    assert "train_step memory" in text and "unigram entropy" in text and "MFU" in text
    # the checkpoint serves generation: same params as the final state
    _cfg, model = load_params_for_inference(out)
    step, st = _restore(cfg)
    assert step == 24
    from flax import nnx

    got = _params(nnx.split(model, nnx.Param)[1])
    want = _params(st.params)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


def test_resume_is_bitwise_identical(corpus, cache_dir, tmp_path):
    full = tiny_cfg(corpus, cache_dir, tmp_path / "full")
    s_full = run_training(full, log=lambda _m: None, progress=False)
    _, ref = _restore(full)

    half = tiny_cfg(corpus, cache_dir, tmp_path / "half")
    # first half: a run configured for the full length, stopped by a signal-free early exit at N/2
    first = dataclasses.replace(half)

    class StopAt:
        def __call__(self, step, state):
            if step == 3:  # flag set during update 4; the loop stops before update 5
                os.kill(os.getpid(), signal.SIGTERM)
            return state

    s1 = run_training(first, log=lambda _m: None, progress=False, step_hook=StopAt())
    assert s1["stop_reason"] == "signal" and s1["step"] == 4
    assert Checkpointer(half).all_steps() == [4]
    # what a kill after the checkpoint leaves in the history file: a row past it and a line cut short
    with open(tmp_path / "half" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 6, "loss": 99.0}) + "\n" + '{"kind": "val", "st')
    # fresh objects, resume to the end
    said: list[str] = []
    (tmp_path / "half" / "summary.json").write_text('{"step": 2, "stale": true}')  # an earlier segment's
    seen: list[bool] = []
    s2 = run_training(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "half")), resume=True,
                      log=said.append, progress=False,
                      step_hook=lambda step, st: seen.append((tmp_path / "half" / "summary.json").exists()) or st)
    assert seen and not any(seen)  # removed at the start: a signal stop now would leave none, not a stale one
    assert s2["step"] == 8
    assert any("1 unreadable line(s) of" in m for m in said), said
    # fifth break test: summary.json held only the steps since the resume (history 6, 8; val_history 8)
    for s_ in (s2, json.loads((tmp_path / "half" / "summary.json").read_text())):
        assert [(h["step"], h["loss"]) for h in s_["history"]] == [(h["step"], h["loss"]) for h in s_full["history"]]
        assert [tuple(v) for v in s_["val_history"]] == [tuple(v) for v in s_full["val_history"]] != []
        assert [h["step"] for h in s_["history"]] == [2, 4, 6, 8]
    # resuming the finished run trains nothing and redoes the final evaluation: the same history, each step once
    said.clear()
    s3 = run_training(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "half")), resume=True,
                      log=said.append, progress=False)
    assert any("nothing to train" in m for m in said), said
    assert s3["history"] == s2["history"] and s3["val_history"] == s2["val_history"]
    assert np.isfinite(s3["tokens_per_second"]) and s3["train_loss"] == s2["train_loss"] == s2["history"][-1]["loss"]
    assert s3["last_step_loss"] == s2["last_step_loss"] == s2["history"][-1]["last_step_loss"]
    lines = [json.loads(x) for x in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("train", 2), ("train", 4), ("val", 4), ("train", 6),
                                                       ("train", 8), ("val", 8)]
    _, got = _restore(half)
    a, b = _params(ref), _params(got)
    assert a.keys() == b.keys()
    diff = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not diff, f"leaves differ after resume: {diff[:5]}"
    assert s2["val_loss"] == pytest.approx(json.loads((tmp_path / "full" / "summary.json").read_text())["val_loss"],
                                           abs=0.0)


def test_a_stop_inside_a_log_window_logs_its_steps(corpus, cache_dir, tmp_path):
    """A signal at step 3 with log_every=4: steps 1..3 get a row at step 3 (they were never logged, and a resume
    from the step-3 checkpoint does not train them again); the resumed run's next row covers step 4 alone.
    Both segments run with ``resume="auto"`` (``--auto-resume``)."""
    out = tmp_path / "run"

    def stop_at_3(step, state):
        if step == 2:  # flag set during update 3; the loop saves step 3 and stops
            os.kill(os.getpid(), signal.SIGTERM)
        return state

    kw = {"log_every": 4, "eval_every": 8, "eval_batches": 100000}
    said: list[str] = []
    # --auto-resume both times, as a requeued job runs it: a fresh start, then a resume of its checkpoint
    s1 = run_training(tiny_cfg(corpus, cache_dir, out, **kw), resume="auto", log=said.append, progress=False,
                      step_hook=stop_at_3)
    assert s1["stop_reason"] == "signal" and s1["step"] == 3
    assert [h["step"] for h in s1["history"]] == [3]
    # break test 62: files of a run (and of the shared data cache) follow the umask, not mkstemp's 0600 / 0700
    from minicpm4_jax.convert.io import default_dir_mode, default_file_mode

    for f in [*(out / "tokenizer").iterdir(), out / "config.json", out / "data.json"]:
        assert f.stat().st_mode & 0o777 == default_file_mode(), f
    cached = [d for sub in ("tokens", "tokenizers") for d in (cache_dir / sub).iterdir() if not d.name.startswith(".")]
    assert cached and all(d.stat().st_mode & 0o777 == default_dir_mode() for d in cached), cached
    # a config.json cut short (it was written in place; a kill or a full disk) no longer makes the run unresumable
    (out / "config.json").write_text('{"model": {"vocab')
    s2 = run_training(tiny_cfg(corpus, cache_dir, out, **kw), resume="auto", log=said.append, progress=False)
    assert json.loads((out / "config.json").read_text())["steps"] == 8
    assert any(m.startswith("--auto-resume: no checkpoint yet in ") for m in said)
    # break test 62: eval_batches above what the split holds was capped silently
    assert any(re.match(r"eval_batches=100000: the validation split holds \d+ batch\(es\) of 4 x 32 tokens; "
                        r"evaluating on those$", m) for m in said), said
    assert any(m == f"--auto-resume: resuming from {out / 'checkpoints'}" for m in said), said
    assert s2["step"] == 8 and s2["stop_reason"] == "steps"
    rows = {h["step"]: h for h in s2["history"]}
    assert sorted(rows) == [3, 4, 8]
    assert rows[4]["loss"] == rows[4]["last_step_loss"]  # a window of one step: 1..3 are not counted again
    assert rows[8]["loss"] != rows[8]["last_step_loss"]  # steps 5..8


def test_every_logged_value_is_the_mean_over_its_window(corpus, cache_dir, tmp_path):
    """A row at log_every=2 holds, for every per-step value (loss, grad_norm, the MTP draft's losses), the mean
    over its two steps, and the learning rate of its own step (helper 69: only the loss was averaged, so grad_norm
    and mtp on one row were the last step's while loss was the window's)."""
    kw = {"steps": 4, "eval_every": 100, "checkpoint.save_every": 100, "tensorboard": False, "model.mtp": True,
          "mtp_feature_weight": 1.0}
    per_step = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "a", log_every=1, **kw), log=lambda _m: None,
                            progress=False)["history"]
    windows = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "b", log_every=2, **kw), log=lambda _m: None,
                           progress=False)["history"]
    one = {h["step"]: h for h in per_step}
    two = {h["step"]: h for h in windows}
    assert sorted(one) == [1, 2, 3, 4] and sorted(two) == [2, 4]
    keys = {"loss", "grad_norm", "mtp_loss", "mtp_feature_loss"}
    assert keys <= set(two[2]), sorted(two[2])
    for step in (2, 4):
        for k in keys:
            assert two[step][k] == pytest.approx((one[step - 1][k] + one[step][k]) / 2, rel=1e-6), (step, k)
        assert two[step]["lr"] == one[step]["lr"] and two[step]["last_step_loss"] == one[step]["loss"]
    assert one[1]["grad_norm"] != one[2]["grad_norm"]  # the two steps differ: the mean is not either one


def test_resume_same_data_order(corpus, cache_dir, tmp_path):
    """The iterator restored from a checkpoint continues with exactly the batches an uninterrupted one yields."""
    from minicpm4_jax.train import data as data_api

    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "d")
    data = data_api.prepare_data(cfg.data, log=lambda _m: None)
    it = data_api.train_iterator(data, cfg.data)
    seen = [np.asarray(next(it)["input_ids"]) for _ in range(3)]
    from minicpm4_jax.train.step import init_train_state

    _, st = init_train_state(cfg, jax.random.key(0))
    ck = Checkpointer(cfg)
    ck.save(3, st, it)
    ck.wait()
    ahead = [np.asarray(next(it)["input_ids"]) for _ in range(3)]
    ck.close()
    it2 = data_api.train_iterator(data, cfg.data)
    ck2 = Checkpointer(cfg)
    ck2.restore(abstract_train_state(cfg), data_iterator=it2)
    ck2.close()
    again = [np.asarray(next(it2)["input_ids"]) for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(ahead, again))
    assert not np.array_equal(seen[0], ahead[0])


def test_checkpoint_from_different_model_config(corpus, cache_dir, tmp_path):
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "r", steps=4, **{"checkpoint.save_every": 4})
    run_training(cfg, log=lambda _m: None, progress=False)
    other = tiny_cfg(corpus, cache_dir, tmp_path / "r", steps=8,
                     **{"model.hidden_size": 128, "model.num_hidden_layers": 3})
    with pytest.raises(ConfigError) as e:
        run_training(other, resume=True, log=lambda _m: None, progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert "model.hidden_size: 64 != 128" in msg and "model.num_hidden_layers: 2 != 3" in msg
    assert "intermediate_size" not in msg
    # training again into the same folder without --resume never overwrites it
    with pytest.raises(ConfigError, match="--resume"):
        run_training(cfg, log=lambda _m: None, progress=False)
    # resume without any checkpoint
    with pytest.raises(ConfigError, match="no checkpoint"):
        run_training(tiny_cfg(corpus, cache_dir, tmp_path / "empty"), resume=True, log=lambda _m: None,
                     progress=False)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(corpus, cache_dir, tmp_path):
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "nan", **{"checkpoint.save_every": 2})

    def poison(step, state):
        if step == 5:  # params become NaN before update 6
            return dataclasses.replace(state, params=jax.tree.map(lambda x: x * jnp.nan, state.params))
        return state

    with pytest.raises(TrainingDiverged) as e:
        run_training(cfg, log=lambda _m: None, progress=False, step_hook=poison)
    msg = str(e.value)
    assert "at step 6" in msg and "last good checkpoint: step 4" in msg
    ck = Checkpointer(cfg)
    assert ck.all_steps() == [2, 4]
    ck.close()
    step, st = _restore(cfg)
    assert step == 4 and all(np.all(np.isfinite(v)) for v in _params(st.params).values())
    # the run resumes from the last good checkpoint and finishes
    s = run_training(cfg, resume=True, log=lambda _m: None, progress=False)
    assert s["step"] == 8 and np.isfinite(s["val_loss"])


@pytest.mark.parametrize("at, last", [(1, "no checkpoint was saved"), (3, "last good checkpoint: step 2 in ")])
def test_non_finite_parameters_at_a_save_name_the_last_good_checkpoint(corpus, cache_dir, tmp_path, at, last):
    """An update that leaves the loss and gradient finite but the parameters not (here an infinite Adam state) is
    caught by the save's check; before the first checkpoint its message said "last good checkpoint: step None"
    (break test 91)."""
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "inf", **{"checkpoint.save_every": 2, "model.rope_scaling": "null"})

    def poison(step, state):
        if step == at:  # the moments turn update `at + 1`'s parameters infinite; its loss is computed before that
            inf = jax.tree.map(lambda x: jnp.full_like(x, jnp.inf) if jnp.issubdtype(x.dtype, jnp.floating)
                               and x.ndim else x, state.opt_state)
            return dataclasses.replace(state, opt_state=inf)
        return state

    with pytest.raises(TrainingDiverged) as e:
        run_training(cfg, log=lambda _m: None, progress=False, step_hook=poison)
    msg = str(e.value)
    assert msg.startswith(f"non-finite parameters after step {at + 1}; not saved; ") and last in msg, msg
    assert "None" not in msg
    ck = Checkpointer(cfg)
    assert ck.all_steps() == ([] if at == 1 else [2])
    ck.close()


# an InfLLM v2 layout that really selects at 96 tokens: <= 3 blocks of 16 of a query's prefix
TINY_SPARSE = {"model.attention": "infllmv2", "model.sparse_config.block_size": 16,
               "model.sparse_config.kernel_size": 16, "model.sparse_config.kernel_stride": 8,
               "model.sparse_config.window_size": 16, "model.sparse_config.topk": 2,
               "model.sparse_config.dense_len": 32, "data.seq_len": 96, "model.max_position_embeddings": 128}


def test_run_with_the_official_kernel_quirk_ends_with_its_sample_and_summary(corpus, cache_dir, tmp_path):
    """``model.sparse_config.kernel_offby1_quirk: true`` (train with the official stage-1 mask) is a valid config,
    but the cached engine refuses it; the run trained every step, then its final sample raised that refusal, so it
    ended without ``summary.json``. The sample (decode steps are unaffected by the quirk, spec §5.2) now runs with
    the clean rule and says so."""
    sparse = {"model.attention": "infllmv2", "model.sparse_config.block_size": 16,
              "model.sparse_config.kernel_size": 16, "model.sparse_config.kernel_stride": 8,
              "model.sparse_config.window_size": 16, "model.sparse_config.topk": 2,
              "model.sparse_config.dense_len": -1, "model.sparse_config.kernel_offby1_quirk": True,
              "tensorboard": False, "steps": 2, "log_every": 1, "eval_every": 2, "checkpoint.save_every": 2,
              "optimizer.warmup_steps": 1, "optimizer.decay_steps": 1, "sample_tokens": 4}
    logs: list[str] = []
    s = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "quirk", **sparse), log=logs.append, progress=False)
    assert s["step"] == 2 and (tmp_path / "quirk" / "summary.json").is_file()
    assert any(m.startswith("sample (") for m in logs) and any("kernel_offby1_quirk" in m for m in logs), logs


def test_run_whose_sample_has_nonfinite_logits_ends_with_its_summary(corpus, cache_dir, tmp_path, monkeypatch):
    """Since bee1cfe generate() refuses non-finite logits (NonFiniteLogitsError); the end-of-run sample of a model
    whose logits go NaN (here its sample copy's embedding, set to NaN) then raised out of run_training after every
    step had trained, without summary.json. The sample now says why there is none and the run ends normally."""
    import minicpm4_jax.generate as gen_mod

    real = gen_mod.generate

    def poisoned(model, *a, **kw):
        e = model.embed_tokens.embedding
        e[...] = jnp.full_like(e[...], jnp.nan)  # the sample's own copy of the weights, not the trained state
        return real(model, *a, **kw)

    monkeypatch.setattr(gen_mod, "generate", poisoned)
    over = {"tensorboard": False, "steps": 2, "log_every": 1, "eval_every": 2, "checkpoint.save_every": 2,
            "optimizer.warmup_steps": 1, "optimizer.decay_steps": 1, "sample_tokens": 4}
    logs: list[str] = []
    s = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "nan", **over), log=logs.append, progress=False)
    assert s["step"] == 2 and (tmp_path / "nan" / "summary.json").is_file()
    assert any(m.startswith("sample: none (non-finite logits for sequence 0 at position ") for m in logs), logs


def test_sparse_run_logs_attended_fraction(corpus, cache_dir, tmp_path):
    """InfLLM v2 training: every log row carries the mean attended key fraction, and it is really < 1."""
    sparse = {**TINY_SPARSE, "tensorboard": False, "sample_tokens": 0}
    logs: list[str] = []
    s = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "sparse", **sparse), log=logs.append, progress=False)
    fr = [h["attended_fraction"] for h in s["history"]]
    assert len(fr) == 4 and all(0.5 < f < 0.9 for f in fr), fr  # <= 3 blocks of 16 of a <= 96-token prefix
    assert s["attended_fraction"] == fr[-1]
    assert all(np.isfinite(h["loss"]) for h in s["history"])
    dense = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "dense", **{**sparse, "model.attention": "dense"}),
                         log=lambda _m: None, progress=False)
    assert "attended_fraction" not in dense["history"][0] and dense["attended_fraction"] is None
    # the researcher-facing scripts on these runs: selection of a trained layer, and the two loss curves
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    text = tmp_path / "input.txt"
    text.write_text("".join(p.read_text() for p in sorted(corpus.iterdir())[:3]))
    png = tmp_path / "sel.png"
    _run_script(scripts / "plot_infllm_selection.py", ["--checkpoint", str(tmp_path / "sparse"), "--text", str(text),
                                                        "--layer", "1", "--tokens", "96", "--out", str(png)])
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    curves = tmp_path / "curves.png"
    _run_script(scripts / "plot_train_curves.py", [str(tmp_path / "dense"), str(tmp_path / "sparse"), "--labels",
                                                    "dense", "sparse", "--out", str(curves)])
    assert curves.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="--checkpoint needs --text"):
        _run_script(scripts / "plot_infllm_selection.py", ["--checkpoint", str(tmp_path / "sparse")])
    with pytest.raises(SystemExit, match="--layer 7 is outside this model's layers 0..1"):  # one line
        _run_script(scripts / "plot_infllm_selection.py", ["--checkpoint", str(tmp_path / "sparse"), "--text",
                                                            str(text), "--layer", "7", "--out", str(png)])


def test_selection_plot_share_counts_visible_keys_only():
    """The plot's per-panel share: a full causal mask is exactly 100% (the current block's future keys excluded)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "plot_infllm_selection.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t, bs = 100, 32
    full = np.arange(4)[None, :] <= (np.arange(t) // bs)[:, None]
    assert mod.attended_share(full, bs) == 1.0
    first = np.zeros((t, 4), bool)
    first[:, 0] = True
    want = np.minimum(np.arange(t) + 1, bs).sum() / (np.arange(t) + 1).sum()
    assert abs(mod.attended_share(first, bs) - want) < 1e-12


def _run_script(path: Path, argv: list[str]) -> None:
    """Run a script's ``main(argv)`` in this process (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(argv)


def test_huge_learning_rate_reports_step(corpus, cache_dir, tmp_path):
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "lr", **{"optimizer.learning_rate": 1e30,
                                                          "optimizer.warmup_steps": 0})
    with pytest.raises(TrainingDiverged, match=r"at step \d+"):
        run_training(cfg, log=lambda _m: None, progress=False)


def test_unwritable_or_full_output_dir(corpus, cache_dir, tmp_path, monkeypatch):
    # a path below a regular file can never be created (also as root)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not writable") as e:
        run_training(tiny_cfg(corpus, cache_dir, blocker / "run"), log=lambda _m: None, progress=False)
    assert "\n" not in str(e.value)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # not root
            with pytest.raises(ConfigError, match="not writable"):
                run_training(tiny_cfg(corpus, cache_dir, ro / "run"), log=lambda _m: None, progress=False)
    finally:
        ro.chmod(0o700)
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(loop_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=10 * 2**20))
    with pytest.raises(ConfigError, match="MiB free"):
        run_training(tiny_cfg(corpus, cache_dir, tmp_path / "full"), log=lambda _m: None, progress=False)


# ---------------------------------------------------------------------------------------------
# the CLI (subprocesses)
# ---------------------------------------------------------------------------------------------


#: the CLI subprocesses (one CPU device) reuse the persistent compilation cache as this process does (conftest:
#: programs that compile in 0.5 s or more; JAX's own default, 1 s, left most of generate's programs out)
_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(jax.config.jax_persistent_cache_min_compile_time_secs)}


def _cli(*args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", **_CACHE_ENV}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS
    return subprocess.run([PY, "-m", "minicpm4_jax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=kw.get("timeout", 240))


def test_cli_help_and_bad_keys():
    r = _cli("--help")
    assert r.returncode == 0 and "train" in r.stdout and "generate" in r.stdout
    r = _cli("train", "--help")
    assert r.returncode == 0
    for opt in ("--config", "--resume", "--set", "KEY=VALUE"):
        assert opt in r.stdout
    r = _cli("generate", "--help")
    for opt in ("--checkpoint", "--prompt", "--max-new-tokens", "--temperature", "--top-p", "--seed"):
        assert opt in r.stdout
    r = _cli("train", "--config", "cpu_tiny", "optimizer.learnig_rate=0.1")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "did you mean 'learning_rate'" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_sigterm_saves_checkpoint_then_generate(corpus, cache_dir, tmp_path):
    out = tmp_path / "sig"
    ov = tiny_overrides(corpus, cache_dir, out, steps=100000, log_every=1, eval_every=100000,
                        **{"optimizer.decay_steps": 10, "checkpoint.save_every": 100000,
                           "model.rope_scaling": "null", "max_train_minutes": "null"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS,
           **_CACHE_ENV}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    p = subprocess.Popen([PY, "-m", "minicpm4_jax.cli", "train", "--no-progress", *ov], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines = []
    t0 = time.time()
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step") and "loss" in line:
                p.send_signal(signal.SIGTERM)
                break
            assert time.time() - t0 < 240, "".join(lines)
        rest, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err + "".join(lines) + rest
    assert "Traceback" not in err
    assert "SIGTERM received" in rest
    steps = Checkpointer(tiny_cfg(corpus, cache_dir, out)).all_steps()
    assert steps and 1 <= steps[-1] < 100000

    # generate from that checkpoint: greedy is deterministic, output starts with the prompt
    r1 = _cli("generate", "--checkpoint", str(out), "--prompt", "def ", "--max-new-tokens", "8")
    assert r1.returncode == 0, r1.stderr
    assert r1.stdout.startswith("def ")
    # the latest step named explicitly, in another process: the same tokens (greedy is deterministic across
    # processes, and --step picks that checkpoint)
    r4 = _cli("generate", "--checkpoint", str(out), "--step", str(steps[-1]), "--prompt", "def ", "--max-new-tokens", "8")
    assert r4.returncode == 0 and r4.stdout == r1.stdout, r4.stderr
    assert "decode" in r1.stderr and "tokens/s" in r1.stderr and "nan" not in r1.stderr
    one = _cli("generate", "--checkpoint", str(out), "--prompt", "def ", "--max-new-tokens", "1")
    # one new token comes from the prefill: the summary says so instead of printing nan rates
    assert one.returncode == 0 and "no decode steps" in one.stderr and "nan" not in one.stderr, one.stderr
    r = _cli("generate", "--checkpoint", str(out), "--step", "99999999", "--prompt", "def ")
    assert r.returncode == 2 and f"saved steps: {steps[-1]}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r3 = _cli("generate", "--checkpoint", str(out), "--prompt", "def ", "--max-new-tokens", "8",
              "--temperature", "1.0", "--top-p", "0.9", "--seed", "3")
    assert r3.returncode == 0, r3.stderr
    # bad input: empty prompt, too long
    r = _cli("generate", "--checkpoint", str(out), "--prompt", "", "--max-new-tokens", "4")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "empty" in r.stderr
    r = _cli("generate", "--checkpoint", str(out), "--prompt", "x " * 200, "--max-new-tokens", "4")
    assert r.returncode == 2 and "max_position_embeddings" in r.stderr
    r = _cli("generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "def")
    assert r.returncode == 2 and "does not exist" in r.stderr

    # a tokenizer that is not the run's (tenth-session break test: the official 73,448-token tokenizer copied into
    # the run of an 8,192-token model generated "defdefdef" with exit 0): data.json's tokenizer_hash, and the size
    import json

    from minicpm4_jax.tokenizer import check_tokenizer_vocab, load_run_tokenizer

    tok = load_run_tokenizer(out, out / "checkpoints")  # the run's own tokenizer matches its record
    check_tokenizer_vocab(tok, tiny_cfg(corpus, cache_dir, out).model.vocab_size)
    with pytest.raises(ConfigError, match=r"has \d+ tokens but the model's vocab_size is 8, so it is not the model's"):
        check_tokenizer_vocab(tok, 8)
    record = out / "data.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "tokenizer_hash": "0" * 64}))
    r = _cli("generate", "--checkpoint", str(out), "--prompt", "def ", "--max-new-tokens", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"is not the one {record} records for this run (sha256 000000000000)" in r.stderr, r.stderr
    r = _cli("export", "gguf", "--checkpoint", str(out), "--out", str(tmp_path / "gguf"))  # export checks it too
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"is not the one {record} records for this run (sha256 000000000000)" in r.stderr, r.stderr


def _run_signal_script(script_text: str, mode: str, corpus, cache_dir, out: Path, *, steps: int, save_every: int):
    """Run ``script_text`` (a CLI train run that signals itself as ``mode`` says) in a fresh one-device process;
    returns its config overrides and the completed process."""
    kw = {"steps": steps, "optimizer.decay_steps": 2, "checkpoint.save_every": save_every, "eval_every": 100,
          "model.rope_scaling": "null", "max_train_minutes": "null"}
    ov = tiny_overrides(corpus, cache_dir, out, **kw)
    script = out.parent / f"{out.name}.py"
    script.write_text(script_text)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS,
           **_CACHE_ENV}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    r = subprocess.run([PY, str(script), mode, *ov], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    return ov, r


#: a CLI run whose first SIGINT comes from a step hook (the loop stops at step 3) and whose second SIGINT (then a
#: SIGTERM) comes from the final save: "before" sends them before that save starts, "after" once it has started
_TWICE_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from minicpm4_jax import cli
    from minicpm4_jax.train import loop

    MODE = sys.argv[1]

    class Ck(loop.Checkpointer):
        def save(self, step, *a, **k):
            if step != 3:
                return super().save(step, *a, **k)
            started = super().save(step, *a, **k) if MODE == "after" else False
            try:
                os.kill(os.getpid(), signal.SIGINT)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)
            return started

    def hook(step, state):
        if step == 2:  # the flag is set during update 3; the loop stops and announces step 3
            os.kill(os.getpid(), signal.SIGINT)
        return state

    real = loop.run_training
    loop.Checkpointer = Ck
    loop.run_training = lambda cfg, **kw: real(cfg, step_hook=hook, **kw)
    sys.exit(cli.main(["train", "--no-progress", *sys.argv[2:]]))
""")


@pytest.mark.parametrize("mode", ["before", "after"])
def test_cli_second_interrupt_during_the_final_save_is_one_line(corpus, cache_dir, tmp_path, mode):
    """Break test: Ctrl-C twice (the second during the save the first announced) printed a KeyboardInterrupt
    traceback and nothing said the announced step was not saved. Now: one ``error:`` line naming the step and the
    last complete checkpoint, exit 130; a SIGTERM after it changes nothing; earlier checkpoints are intact and the
    run resumes. A save already under way ("after") is awaited, and the line says it is complete."""
    out = tmp_path / "twice"
    ov, r = _run_signal_script(_TWICE_SCRIPT, mode, corpus, cache_dir, out, steps=6, save_every=2)
    assert "SIGINT received: saving a checkpoint at step 3" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 128 + signal.SIGINT, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    ckpt_dir = out / "checkpoints"
    want = (f"error: second interrupt: stopped without saving step 3; the last complete checkpoint is step 2 in "
            f"{ckpt_dir} (resume with --resume)" if mode == "before" else
            f"error: second interrupt: stopped; checkpoint step 3 in {ckpt_dir} is complete (resume with --resume)")
    assert errors == [want], r.stderr
    cfg = load_config("cpu_tiny", ov)  # the CLI's default preset
    assert Checkpointer(cfg).all_steps() == ([2] if mode == "before" else [2, 3])
    if mode == "before":
        s = run_training(cfg, resume=True, log=lambda _m: None, progress=False)
        assert s["step"] == 6 and Checkpointer(cfg).all_steps()[-1] == 6


#: a CLI run of 5 steps (the last checkpoint, step 5, is saved after the loop) that gets a signal after its last step:
#: "save-SIGINT" during that final save (before the finishing phase), "sample-SIGINT" / "sample-SIGTERM" during the
#: sample of the finishing phase (after the final evaluation)
_FINISH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from minicpm4_jax import cli, generate
    from minicpm4_jax.train import loop

    WHEN, SIG = sys.argv[1].split("-")

    class Ck(loop.Checkpointer):
        def save(self, step, *a, **k):
            started = super().save(step, *a, **k)
            if step == 5 and WHEN == "save":
                os.kill(os.getpid(), getattr(signal, SIG))
            return started

    def sample(*a, **k):
        os.kill(os.getpid(), getattr(signal, SIG))
        raise AssertionError("the signal did not stop the run")

    loop.Checkpointer = Ck
    generate.generate = sample
    sys.exit(cli.main(["train", "--no-progress", *sys.argv[2:]]))
""")


@pytest.mark.parametrize("mode", ["save-SIGINT", "sample-SIGINT", "sample-SIGTERM"])
def test_cli_signal_after_the_last_step_stops_at_once(corpus, cache_dir, tmp_path, mode):
    """Break test (eleventh session): a Ctrl-C during the final evaluation or sample was ignored and the run exited 0
    after finishing them. Now a signal after the last step boundary stops a one-process run: during the final save
    it is a normal signal stop once that save completes; after it (the finishing phase) at once, with one ``error:``
    line naming the complete checkpoint, no summary.json, exit 128 + the signal number."""
    out = tmp_path / "finish"
    ov, r = _run_signal_script(_FINISH_SCRIPT, mode, corpus, cache_dir, out, steps=5, save_every=4)
    sig = getattr(signal, mode.split("-")[1])
    assert r.returncode == 128 + sig, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    ckpt_dir = out / "checkpoints"
    cfg = load_config("cpu_tiny", ov)
    assert Checkpointer(cfg).all_steps() == [4, 5]
    assert not (out / "summary.json").exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    if mode.startswith("save"):
        assert "SIGINT received: saving a checkpoint at step 5 and exiting" in r.stdout, r.stdout + r.stderr
        assert errors == [] and "held-out" not in r.stdout, r.stdout + r.stderr  # no final evaluation
    else:
        assert "held-out" in r.stdout, r.stdout  # the final evaluation ran, the sample was interrupted
        assert errors == [f"error: {sig.name} after the last step: stopped; checkpoint step 5 in {ckpt_dir} is "
                          "complete; the final evaluation, sample and summary.json were skipped"], r.stderr


def test_a_second_interrupt_while_a_save_starts_lets_it_start():
    """Break test 62: two Ctrl-C 50 ms apart raised SecondInterrupt inside orbax's start of the step's save, which was
    abandoned (a .orbax-checkpoint-tmp left, one save interval lost). Now it is held until the save has started."""
    from minicpm4_jax.train.distributed import SecondInterrupt, StopWatch

    sw = StopWatch()
    sw._handle(int(signal.SIGINT), None)  # the first: save and stop at the next step boundary
    started: list[int] = []
    with pytest.raises(SecondInterrupt):
        with sw.starting_save():
            sw._handle(int(signal.SIGINT), None)  # held, not raised inside the save
            started.append(1)
    assert started == [1] and sw.aborted
    other = StopWatch()  # outside a save's start the second Ctrl-C raises where it lands, as before
    other._handle(int(signal.SIGINT), None)
    with pytest.raises(SecondInterrupt):
        other._handle(int(signal.SIGINT), None)
    with other.starting_save():  # nothing pending: a save's start passes through
        pass


def test_signal_in_the_finishing_phase_of_several_processes_is_a_flag():
    """With several processes the finishing phase runs collectives that one process cannot leave alone: finishing()
    neither reports nor arms a signal there (a pretend multi-process StopWatch; the real two-process runs are in
    tests/test_distributed.py)."""
    from minicpm4_jax.train.distributed import FinishInterrupt, StopWatch

    one = StopWatch()
    assert one.finishing() is False
    with pytest.raises(FinishInterrupt, match="SIGTERM during the finishing phase") as e:
        one._handle(int(signal.SIGTERM), None)
    assert e.value.signum == signal.SIGTERM and one.aborted
    one._handle(int(signal.SIGINT), None)  # aborting: later signals are ignored
    early = StopWatch()
    early._handle(int(signal.SIGINT), None)  # before the finishing phase: a flag
    assert early.finishing() is True and early.signum == signal.SIGINT
    multi = StopWatch()
    multi.multi = True
    assert multi.finishing() is False
    multi._handle(int(signal.SIGTERM), None)
    assert multi.signum == signal.SIGTERM and not multi.aborted


def test_cli_interrupt_outside_the_loop_handlers_is_one_line(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C before the training loop installs its handlers (data preparation, compilation) or after it restored
    them: one ``error:`` line and exit 130, not a KeyboardInterrupt traceback."""
    from minicpm4_jax import cli

    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod, "run_training", interrupted)
    out = tmp_path / "x"
    assert cli.main(["train", *tiny_overrides(corpus, cache_dir, out, **{"model.rope_scaling": "null"})]) == 130
    err = capsys.readouterr().err
    # twelfth-session break test: before the first checkpoint the line said "resume with --resume", which then failed
    assert err == (f"error: interrupted before the first checkpoint; nothing to resume in {out / 'checkpoints'}: train "
                   "again without --resume\n"), err
    from minicpm4_jax.train.checkpoint import _STEP_MARKERS

    (out / "checkpoints" / "4" / _STEP_MARKERS[0]).mkdir(parents=True)  # a step on disk (as the folder test sees it)
    assert cli.main(["train", *tiny_overrides(corpus, cache_dir, out, **{"model.rope_scaling": "null"})]) == 130
    err = capsys.readouterr().err
    assert err == (f"error: interrupted; no further checkpoint was saved (the complete ones in {out / 'checkpoints'} "
                   "are intact: resume with --resume)\n"), err


def test_interrupted_message_without_a_checkpoint():
    from minicpm4_jax.train.loop import interrupted_message

    assert interrupted_message(5, None, Path("/r/checkpoints")) == (
        "second interrupt: stopped without saving step 5; no checkpoint was saved in /r/checkpoints (train again "
        "without --resume)")


def test_generate_greedy_matches_argmax_and_top_p():
    from flax import nnx

    from minicpm4_jax.generate import generate_ids, top_p_filter
    from minicpm4_jax.train.step import init_model

    cfg = load_config(None, ["model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64",
                             "model.num_hidden_layers=1", "model.num_attention_heads=2",
                             "model.num_key_value_heads=1", "model.max_position_embeddings=16",
                             "model.dim_model_base=8", "data.seq_len=8", "data.tokenizer_vocab_size=64",
                             "optimizer.warmup_steps=0", "optimizer.decay_steps=0"])
    model = init_model(cfg.model, 0)
    ids = generate_ids(model, [1, 5, 7], 5)
    # reference: the full forward on the growing sequence (no padding)
    seq = [1, 5, 7]
    for _ in range(5):
        logits = model(jnp.asarray([seq], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, -1])))
    assert ids == seq[3:]
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        generate_ids(model, [1] * 10, 7)
    with pytest.raises(ConfigError, match="empty"):
        generate_ids(model, [], 3)
    lg = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))
    kept = np.isfinite(np.asarray(top_p_filter(lg, 0.7)))
    assert kept.tolist() == [True, True, False, False]
    assert np.isfinite(np.asarray(top_p_filter(lg, 0.1))).tolist() == [True, False, False, False]
    assert np.all(np.isfinite(np.asarray(top_p_filter(lg, 1.0))))
    del nnx


def test_interrupted_save_keeps_previous_checkpoint(corpus, cache_dir, tmp_path):
    """A save killed half-way leaves only a temporary folder: never listed, the previous step restores."""
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "k", steps=4, **{"checkpoint.save_every": 4})
    run_training(cfg, log=lambda _m: None, progress=False)
    ck_dir = tmp_path / "k" / "checkpoints"
    partial = ck_dir / "8.orbax-checkpoint-tmp-1234567890"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 100)
    ck = Checkpointer(cfg)
    assert ck.latest_step() == 4 and ck.all_steps() == [4]
    ck.close()
    step, st = _restore(cfg)
    assert step == 4 and int(st.step) == 4


# ---------------------------------------------------------------------------------------------
# refused runs, resume rules, throughput accounting, failed checkpoint writes, divergence message
# ---------------------------------------------------------------------------------------------


def _run_files(out: Path) -> dict[str, bytes]:
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in (out / "tokenizer").rglob("*") if p.is_file()}
    files["config.json"] = (out / "config.json").read_bytes()
    return files


def test_refused_runs_write_nothing(corpus, cache_dir, tmp_path, monkeypatch):
    out = tmp_path / "a"
    cfg = tiny_cfg(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 4})
    run_training(cfg, log=lambda _m: None, progress=False)
    before = _run_files(out)
    assert any(k.startswith("tokenizer/") for k in before)
    # existing checkpoints without --resume (and another tokenizer size)
    with pytest.raises(ConfigError, match="--resume"):
        run_training(tiny_cfg(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 4,
                                                                   "data.tokenizer_vocab_size": 320}),
                     log=lambda _m: None, progress=False)
    # --resume with another model
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        run_training(tiny_cfg(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 4,
                                                                   "model.num_hidden_layers": 3}),
                     resume=True, log=lambda _m: None, progress=False)
    assert _run_files(out) == before
    # --resume without a checkpoint fails before data preparation and writes no tokenizer/config
    monkeypatch.setattr(loop_mod, "_data_api", lambda: pytest.fail("data prepared for a refused run"))
    with pytest.raises(ConfigError, match="no checkpoint"):
        run_training(tiny_cfg(corpus, cache_dir, tmp_path / "empty"), resume=True, log=lambda _m: None,
                     progress=False)
    assert not (tmp_path / "empty" / "tokenizer").exists() and not (tmp_path / "empty" / "config.json").exists()


@pytest.mark.parametrize("bad", ["missing_source", "py_source", "missing_tokenizer"])
def test_refused_data_checks_leave_no_empty_folders(corpus, cache_dir, tmp_path, bad):
    """A run refused by the data/tokenizer checks (after the output checks created out_dir and checkpoints/)
    removes the empty folders it made (was: an empty out_dir/checkpoints/ left behind); a folder that existed
    before stays, and so does anything holding a file."""
    (tmp_path / "a.py").write_text("print(1)\n")
    kw = {"missing_source": {"data.sources": f"[{tmp_path / 'none.txt'}]"},
          "py_source": {"data.sources": f"[{tmp_path / 'a.py'}]"},
          "missing_tokenizer": {"data.tokenizer": str(tmp_path / "no_tok")}}[bad]
    fresh = tmp_path / "new" / "run"
    with pytest.raises(ConfigError):
        run_training(tiny_cfg(corpus, cache_dir, fresh, **kw), log=lambda _m: None, progress=False)
    assert not (tmp_path / "new").exists()
    given, ck = tmp_path / "given", tmp_path / "ck" / "x"
    (given / "keep").mkdir(parents=True)
    with pytest.raises(ConfigError):
        run_training(tiny_cfg(corpus, cache_dir, given, **kw, **{"checkpoint.directory": str(ck)}),
                     log=lambda _m: None, progress=False)
    assert sorted(p.name for p in given.iterdir()) == ["keep"] and not (tmp_path / "ck").exists()


def test_resume_refuses_changed_run_and_allows_logging_changes(corpus, cache_dir, tmp_path):
    out = tmp_path / "r"
    kw = {"steps": 4, "checkpoint.save_every": 4}
    run_training(tiny_cfg(corpus, cache_dir, out, **kw), log=lambda _m: None, progress=False)
    with pytest.raises(ConfigError) as e:
        run_training(tiny_cfg(corpus, cache_dir, out, **{**kw, "steps": 6}), resume=True,
                     log=lambda _m: None, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "steps: 4 != 6" in msg and "new out_dir" in msg
    assert "model." not in msg
    with pytest.raises(ConfigError, match=r"data\.seed: 0 != 1"):
        run_training(tiny_cfg(corpus, cache_dir, out, **{**kw, "data.seed": 1}), resume=True,
                     log=lambda _m: None, progress=False)
    with pytest.raises(ConfigError, match=r"optimizer\.learning_rate: 0\.02 != 0\.03"):
        run_training(tiny_cfg(corpus, cache_dir, out, **{**kw, "optimizer.learning_rate": 0.03}), resume=True,
                     log=lambda _m: None, progress=False)
    logs: list[str] = []
    s = run_training(tiny_cfg(corpus, cache_dir, out, **{**kw, "log_every": 1, "sample_tokens": 2}), resume=True,
                     log=logs.append, progress=False)
    assert s["step"] == 4
    text = "\n".join(logs)
    assert "log_every: 2 != 1" in text and "sample_tokens: 6 != 2" in text


def test_a_resume_may_change_rematerialisation_and_the_attention_implementation(corpus, cache_dir, tmp_path):
    """Break test (helper 99): a run resumed onto smaller devices that runs out of memory turns on
    ``model.remat``; one started with ``attention_impl=pallas`` is resumed where that kernel does not run. Both
    choices change neither the parameters nor the math (qat.init_from already accepted them), but a resume
    refused them as "a different model config". The resumed run trains on with the uninterrupted run's losses."""
    kw = {"steps": 4, "checkpoint.save_every": 2, "log_every": 1}
    full = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "full", **kw), log=lambda _m: None, progress=False)

    def stop_after_2(step, state):
        if step == 1:  # flag set during update 2; the loop stops before update 3
            os.kill(os.getpid(), signal.SIGTERM)
        return state

    out = tmp_path / "r"
    s1 = run_training(tiny_cfg(corpus, cache_dir, out, **kw), log=lambda _m: None, progress=False,
                      step_hook=stop_after_2)
    assert s1["stop_reason"] == "signal" and s1["step"] == 2
    logs: list[str] = []
    s2 = run_training(tiny_cfg(corpus, cache_dir, out, **{**kw, "model.remat": "full", "model.attention_impl": "xla"}),
                      resume=True, log=logs.append, progress=False)
    assert s2["step"] == 4 and f"resumed from {out / 'checkpoints'}/2" in logs
    assert any("model.remat: 'none' != 'full' (checkpoint != current; allowed)" in m for m in logs), logs
    assert any("model.attention_impl: 'auto' != 'xla' (checkpoint != current; allowed)" in m for m in logs), logs
    want = [(h["step"], h["loss"]) for h in full["history"]]
    got = [(h["step"], h["loss"]) for h in s2["history"]]
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5)
    # what the model is stays refused
    with pytest.raises(ConfigError, match=r"model\.num_hidden_layers: 2 != 3"):
        run_training(tiny_cfg(corpus, cache_dir, out, **{**kw, "model.num_hidden_layers": 3}), resume=True,
                     log=lambda _m: None, progress=False)


def test_the_end_of_run_table_says_when_its_ngram_rows_are_sampled(corpus, cache_dir, tmp_path, monkeypatch):
    """The n-gram rows of the end-of-run table read at most NGRAM_MAX_TOKENS of each split (helper 99: the whole
    split took ~54 bytes per token, tens of GB on a real corpus); the table's header says when they were sampled."""
    import minicpm4_jax.train.data as data_mod

    monkeypatch.setattr(data_mod, "NGRAM_MAX_TOKENS", 2048)
    said: list[str] = []
    s = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "r", steps=2, eval_every=10, sample_tokens=0,
                              **{"checkpoint.save_every": 2, "optimizer.warmup_steps": 0, "optimizer.decay_steps": 0}),
                     log=said.append, progress=False)
    n_train = data_mod.prepare_data(tiny_cfg(corpus, cache_dir, tmp_path / "r").data,
                                    log=lambda _m: None).manifest["num_train_tokens"]
    assert n_train > 2048  # the validation split (~1,500 tokens) fits: it is read whole
    head = [m for m in said if m.startswith("loss per token (nats) on the tokenized corpus")]
    assert head == [f"loss per token (nats) on the tokenized corpus (n-gram rows from 2,048 evenly spread tokens of "
                    f"the train {n_train:,}-token split(s)):"], said
    assert all(math.isfinite(s[k]) for k in ("unigram_entropy", "bigram_entropy", "bigram_heldout_xent"))


def test_throughput_excludes_eval_and_save_time():
    now = [0.0]
    meter = loop_mod._Throughput(tokens_per_step=100, clock=lambda: now[0])
    # steps 1-4 take 1 s each; an eval after step 3 (5 s) and a save after step 2 (7 s) are excluded
    for k in range(1, 5):
        now[0] += 1.0
        meter.step()
        if k == 2:
            with meter.paused():
                now[0] += 7.0
        if k == 3:
            with meter.paused():
                now[0] += 5.0
    assert meter.take() == pytest.approx(100.0)
    # the next window starts clean (a save right after the log line is excluded too)
    with meter.paused():
        now[0] += 3.0
    for _ in range(2):
        now[0] += 0.5
        meter.step()
    assert meter.take() == pytest.approx(200.0)


def test_logged_tokens_per_second_not_inflated_by_eval_or_save(corpus, cache_dir, tmp_path):
    """Every step sleeps >= 40 ms, so no window can honestly exceed batch*seq_len/0.04 tokens/s.

    Only this upper bound is machine-independent. That eval/save time is excluded, rather than slowing
    a window down, is checked with a fake clock in test_throughput_excludes_eval_and_save_time.
    A check that the windows agree with each other used to live here. It failed when the other test
    worker loaded the machine (one window 3x slower), so it was a timing test and is gone.
    """
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "tps", steps=12, log_every=4, eval_every=3,
                   **{"checkpoint.save_every": 2, "optimizer.decay_steps": 2, "sample_tokens": 0})

    def slow(step, state):
        time.sleep(0.04)
        return state

    s = run_training(cfg, log=lambda _m: None, progress=False, step_hook=slow)
    tps = [h["tokens_per_second"] for h in s["history"]]
    bound = 4 * 32 / 0.04
    assert len(tps) == 3 and all(0 < x <= 1.05 * bound for x in tps), (tps, bound)


def test_mfu_above_100_percent_is_explained_once(corpus, cache_dir, tmp_path, monkeypatch):
    """Helper 94: a matmul peak measured while other jobs held the cores (25.5 GFLOP/s) made a sparse run log
    "MFU 121.6%" with no word. Now the first row above 100% warns, naming both rates; later rows do not repeat it."""
    monkeypatch.setattr(loop_mod, "measure_matmul_peak_flops", lambda: 1e3)  # 1 kFLOP/s: any run exceeds it
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "mfu", steps=4, log_every=2, eval_every=4,
                   **{"checkpoint.save_every": 4, "optimizer.decay_steps": 2, "sample_tokens": 0})
    logs: list[str] = []
    s = run_training(cfg, log=logs.append, progress=False)
    warned = [m for m in logs if m.startswith("warning: MFU ")]
    assert len(s["history"]) == 2 and all(h["mfu"] > 1 for h in s["history"]), s["history"]
    assert len(warned) == 1, logs
    assert "at step 2:" in warned[0] and "(0.0 GFLOP/s)" in warned[0] and "compare runs by tokens/s" in warned[0]


def test_mfu_above_100_percent_names_the_dense_count_of_a_sparse_run(corpus, cache_dir, tmp_path, monkeypatch):
    """Break test (helper 95): the MFU warning blamed only a peak measured on a busy machine, but the FLOP count
    takes attention as dense over every position, which an InfLLM v2 run mostly skips (cpu_tiny_sparse: 43% of its
    counted FLOPs are attention, at an attended fraction of 0.36), and a bfloat16 model outruns the fp32 peak: the
    warning names the causes that apply to the run."""
    monkeypatch.setattr(loop_mod, "measure_matmul_peak_flops", lambda: 1e3)
    sparse = {**TINY_SPARSE, "tensorboard": False, "sample_tokens": 0, "steps": 2, "eval_every": 2,
              "checkpoint.save_every": 2, "optimizer.decay_steps": 0}
    logs: list[str] = []
    run_training(tiny_cfg(corpus, cache_dir, tmp_path / "sparse", **sparse), log=logs.append, progress=False)
    warned = [m for m in logs if m.startswith("warning: MFU ")]
    assert len(warned) == 1 and "takes attention as dense over all 96 positions, which InfLLM v2" in warned[0], logs
    assert "\n" not in warned[0]
    from minicpm4_jax.train.metrics import mfu_above_peak_causes

    dense = tiny_cfg(corpus, cache_dir, tmp_path / "d").model
    assert mfu_above_peak_causes(dense, 96) == []
    assert mfu_above_peak_causes(tiny_cfg(corpus, cache_dir, tmp_path / "d", **sparse).model, 31) == []
    bf16 = tiny_cfg(corpus, cache_dir, tmp_path / "d", **{"model.dtype": "bfloat16"}).model
    assert mfu_above_peak_causes(bf16, 96) == ["the model computes in bfloat16, whose matmuls run faster than the "
                                               "fp32 peak measures"]


def test_mfu_counts_the_peak_of_every_accelerator_of_the_mesh(corpus, cache_dir, tmp_path, monkeypatch):
    """MFU divided the whole mesh's model FLOP/s by the matmul peak measured on one device, so a run on 8 GPUs read
    8x its utilisation (a 40% run logged 320%, and the above-100% warning blamed a busy machine). Accelerators count
    one peak each; fake CPU devices of one process share its cores, which one device's measurement already uses."""
    from minicpm4_jax.train.metrics import model_flops_per_second, peak_devices

    def devs(platform, processes, n=8):
        return [types.SimpleNamespace(platform=platform, process_index=i * processes // n) for i in range(n)]

    assert peak_devices(devs("gpu", 1)) == 8 and peak_devices(devs("tpu", 2)) == 8
    assert peak_devices(devs("cpu", 1)) == 1 and peak_devices(devs("cpu", 2)) == 2
    assert len(jax.devices()) == 8 and peak_devices(jax.devices()) == 1  # this test process's fake CPU devices
    # the loop's MFU uses it: as if the mesh held 4 accelerators
    monkeypatch.setattr(loop_mod, "measure_matmul_peak_flops", lambda: 1e9)
    monkeypatch.setattr(loop_mod, "peak_devices", lambda devices: 4)
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "mfu", steps=2, log_every=1, eval_every=2, tensorboard=False,
                   **{"checkpoint.save_every": 2, "optimizer.warmup_steps": 1, "optimizer.decay_steps": 0,
                      "sample_tokens": 0})
    logs: list[str] = []
    s = run_training(cfg, log=logs.append, progress=False)
    assert s["peak_flops"] == 4e9 and s["peak_flops_per_device"] == 1e9
    for h in s["history"]:
        assert h["mfu"] == pytest.approx(model_flops_per_second(cfg.model, 32, h["tokens_per_second"]) / 4e9)
    assert any("1.0 GFLOP/s per device; MFU against the 4 devices' 4.0 GFLOP/s" in m for m in logs), logs


def test_disk_full_during_async_checkpoint_write_cli(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    import logging

    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh

    from minicpm4_jax import cli

    absl_logger = logging.getLogger("absl")
    monkeypatch.setattr(absl_logger, "filters", list(absl_logger.filters))
    real = jh.JsonCheckpointHandler._save_fn

    async def full_disk(self, x, directory):  # the write of checkpoint step 4 (the second save) fails
        if Path(str(directory)).name.split(".")[0] == "4" or Path(str(directory)).parent.name.split(".")[0] == "4":
            raise OSError(28, "No space left on device")
        return await real(self, x, directory)

    monkeypatch.setattr(jh.JsonCheckpointHandler, "_save_fn", full_disk)
    out = tmp_path / "full"
    ov = tiny_overrides(corpus, cache_dir, out, **{"checkpoint.save_every": 2, "model.rope_scaling": "null",
                                                   "max_train_minutes": "null"})
    rc = cli.main(["train", "--no-progress", *ov])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: saving checkpoint step 4 ")
    assert "No space left on device" in lines[0] and "last complete checkpoint: step 2" in lines[0]
    monkeypatch.setattr(jh.JsonCheckpointHandler, "_save_fn", real)
    cfg = load_config("cpu_tiny", ov)
    ck = Checkpointer(cfg)
    assert ck.all_steps() == [2]
    ck.close()
    step, st = _restore(cfg)
    assert step == 2 and int(st.step) == 2


def test_failing_checkpoint_save_raises_clean_error(corpus, cache_dir, tmp_path, monkeypatch):
    from minicpm4_jax.train.loop import CheckpointWriteError

    calls = []
    real = Checkpointer.save

    def save(self, step, *a, **k):
        calls.append(step)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, step, *a, **k)

    monkeypatch.setattr(Checkpointer, "save", save)
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "s", **{"checkpoint.save_every": 2, "sample_tokens": 0})
    with pytest.raises(CheckpointWriteError) as e:
        run_training(cfg, log=lambda _m: None, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "step 4" in msg and "No space left on device" in msg
    assert "last complete checkpoint: step 2" in msg
    monkeypatch.setattr(Checkpointer, "save", real)
    step, _st = _restore(cfg)
    assert step == 2


def test_a_failed_background_save_stops_the_run_at_the_next_step(corpus, cache_dir, tmp_path, monkeypatch):
    """An async checkpoint write that fails in the background (a full disk) stops the run after the next update,
    not at the next save ``save_every`` steps later (helper 69: training went on to the next save)."""
    from minicpm4_jax.train.loop import CheckpointWriteError

    real = Checkpointer.save

    def save(self, step, *a, **k):
        started = real(self, step, *a, **k)
        if step == 2:  # the write "fails" in the background: the next settle reports it
            self.manager.wait_until_finished()

            def failed():
                raise OSError(28, "No space left on device")

            self.manager.wait_until_finished = failed
        return started

    monkeypatch.setattr(Checkpointer, "save", save)
    hooked: list[int] = []

    def hook(step, state):
        hooked.append(step)
        return state

    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "s", **{"checkpoint.save_every": 2, "log_every": 1,
                                                          "sample_tokens": 0, "checkpoint.async_save": True})
    with pytest.raises(CheckpointWriteError) as e:
        run_training(cfg, log=lambda _m: None, progress=False, step_hook=hook)
    assert "step 2" in str(e.value) and "No space left on device" in str(e.value), str(e.value)
    assert max(hooked) == 2, hooked  # the update after the save ran (3), none after it


def test_divergence_message_names_the_non_finite_value():
    m = loop_mod.divergence_message(6, 9.01, float("nan"), "last good checkpoint: step 4 in /x")
    assert "non-finite grad norm (nan) at step 6" in m and "non-finite loss" not in m
    assert "loss 9.01 is finite" in m and "last good checkpoint: step 4" in m
    m = loop_mod.divergence_message(3, float("inf"), 1.5, "no checkpoint was saved")
    assert "non-finite loss (inf) at step 3" in m and "grad norm 1.5 is finite" in m
    m = loop_mod.divergence_message(2, float("nan"), float("nan"), "no checkpoint was saved")
    assert "non-finite loss (nan) and grad norm (nan) at step 2" in m


def test_checkpointer_start_up_finishes_removing_interrupted_saves(corpus, cache_dir, tmp_path):
    """A killed save's temporary folder is gone once a Checkpointer exists, so a second one on the same
    directory never races the first one's background ``rmtree`` (the CI failure of stop 14: the loser's
    first save raised FileNotFoundError)."""
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "run")
    tmp_dir = tmp_path / "run" / "checkpoints" / "8.orbax-checkpoint-tmp"
    for i in range(40):  # big enough that a background removal is still running when __init__ returns
        sub = tmp_dir / "state" / f"d{i}"
        sub.mkdir(parents=True)
        for j in range(100):
            (sub / f"f{j}").write_bytes(b"x")
    first = Checkpointer(cfg)
    assert not tmp_dir.exists()
    first.close()
    second = Checkpointer(cfg)
    from minicpm4_jax.train.step import init_train_state

    _, st = init_train_state(cfg, jax.random.key(0))
    assert second.save(8, st) and (second.wait() is None)
    assert second.all_steps() == [8]
    second.close()


def test_checkpointer_start_up_survives_a_failed_removal(corpus, cache_dir, tmp_path, monkeypatch):
    """orbax's background removal can fail (the folder is still being written by the threads of a failed async
    save of this process: CI at 4fa072c, "Directory not empty"); start-up then removes the folders itself,
    and a folder it cannot remove only warns."""
    import shutil

    from orbax.checkpoint._src.path import temporary_paths

    async def failing_cleanup(*_a, **_k):  # orbax's background removal, failing
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", failing_cleanup)
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "run")
    tmp_dir = tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp"
    (tmp_dir / "state").mkdir(parents=True)
    (tmp_dir / "state" / "x").write_bytes(b"x")
    ck = Checkpointer(cfg)
    assert not tmp_dir.exists()
    assert ck.all_steps() == []
    ck.close()
    (tmp_dir / "state").mkdir(parents=True)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # nothing can be removed
    with pytest.warns(UserWarning, match=r"4\.orbax-checkpoint-tmp.*Directory not empty"):
        ck = Checkpointer(cfg)
    ck.close()


def _train_error(ov, resume: bool = False) -> str:
    """The one-line ConfigError (what the CLI prints after "error: ") of a refused run."""
    with pytest.raises(ConfigError) as e:
        run_training(load_config(None, ov), resume=resume, log=lambda _m: None, progress=False)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_special_ids_that_are_not_the_tokenizers_are_refused_before_writing(corpus, cache_dir, tmp_path):
    """Sixth break test: model.eos_token_id=[5] / bos_token_id=7 trained silently beside a tokenizer with bos 1 and
    eos 2, and `export hf` then wrote 5 / 7 into config.json (a runtime would stop on token 5)."""
    out = tmp_path / "run"
    err = _train_error(tiny_overrides(corpus, cache_dir, out, **{"model.eos_token_id": "[5]", "model.bos_token_id": 7}))
    assert err == ("tokenizer bos id 1 != model.bos_token_id 7; tokenizer eos id 2 is not in model.eos_token_id [5]: "
                   "the model's special ids must be the tokenizer's (exports write them for runtimes); set "
                   "model.bos_token_id=1 model.eos_token_id=[2]"), err
    assert not out.exists()
    # a list that holds the tokenizer's eos (the official [2, 73440] style) is fine
    from minicpm4_jax.tokenizer import special_id_mismatches

    tok = types.SimpleNamespace(bos_id=1, eos_id=2)
    assert special_id_mismatches(tok, load_config(None, ["model.eos_token_id=[7, 2]"]).model) == []


def test_training_refuses_a_topk_beyond_every_block(corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    err = _train_error(tiny_overrides(corpus, cache_dir, out, **{
        "model.attention": "infllmv2", "model.sparse_config.block_size": 32, "model.sparse_config.window_size": 32,
        "model.sparse_config.topk": 5}))
    assert err.startswith("model.sparse_config.topk=5 exceeds the 4 blocks of max_position_embeddings=128"), err
    assert not out.exists()


def test_a_shared_checkpoint_directory_names_that_key(corpus, cache_dir, tmp_path):
    """Sixth break test: a second run with its own out_dir but the first run's checkpoint.directory was told to
    "choose another out_dir", which changes nothing."""
    kw = {"steps": 4, "checkpoint.save_every": 4, "checkpoint.directory": str(tmp_path / "ck"), "sample_tokens": 0}
    run_training(tiny_cfg(corpus, cache_dir, tmp_path / "a", **kw), log=lambda _m: None, progress=False)
    err = _train_error(tiny_overrides(corpus, cache_dir, tmp_path / "b", **kw))
    assert err.endswith("pass --resume to continue, or choose another checkpoint.directory"), err


def test_a_second_process_on_a_running_folder_is_refused(corpus, cache_dir, tmp_path):
    """Break test 85: a second `train --resume` on the folder of a run still training opened the checkpoint
    manager, which deleted the first run's save in progress (it died at that save). The run holds a lock on
    out_dir from its checks to its end: a second process is refused in one line naming the holder."""
    from minicpm4_jax.train.loop import RUN_LOCK_NAME, RunLock

    out = tmp_path / "a"
    kw = {"steps": 4, "checkpoint.save_every": 2, "sample_tokens": 0}
    seen = []

    def hook(step, state):
        seen.append((out / RUN_LOCK_NAME).read_text())
        return state

    run_training(tiny_cfg(corpus, cache_dir, out, **kw), log=lambda _m: None, progress=False, step_hook=hook)
    assert seen and all(t.startswith(f"pid {os.getpid()} on ") for t in seen), seen
    assert not (out / RUN_LOCK_NAME).exists()  # released at the end
    other = RunLock(out)  # another process training there (a second open file description conflicts like one)
    other.acquire(lambda _m: None)
    try:
        steps = sorted(p.name for p in (out / "checkpoints").iterdir())
        err = _train_error(tiny_overrides(corpus, cache_dir, out, **kw), resume=True)
        assert err.startswith(f"out_dir {str(out)!r} is in use by another training process (pid {os.getpid()} on "), err
        assert err.endswith("wait for it to end or stop it, or choose another out_dir"), err
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == steps
        assert (out / RUN_LOCK_NAME).is_file()  # the holder's file is not touched
    finally:
        other.release()
    assert run_training(tiny_cfg(corpus, cache_dir, out, **kw), resume=True, log=lambda _m: None,
                        progress=False)["step"] == 4  # the lock gone, the resume runs
    assert not (out / RUN_LOCK_NAME).exists()


def test_a_run_lock_taken_on_a_released_file_is_retaken(tmp_path, monkeypatch):
    """The holder releases (unlinks the file, then unlocks) between a second process's open and flock: that flock
    succeeded on the unlinked file, so a third process created a new file and locked it too (two runs on one
    folder). The lock is kept only on the file the path names."""
    import fcntl

    from minicpm4_jax.train.loop import RunLock

    first = RunLock(tmp_path)
    first.acquire(lambda _m: None)
    real = fcntl.flock

    def flock_after_release(fd, op):
        first.release()  # the holder ends just after the second process opened its file
        monkeypatch.setattr(fcntl, "flock", real)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_release)
    second = RunLock(tmp_path)
    second.acquire(lambda _m: None)
    try:
        assert os.path.samestat(os.fstat(second.fd), os.stat(second.path))
        with pytest.raises(ConfigError, match="is in use by another training process"):
            RunLock(tmp_path).acquire(lambda _m: None)
    finally:
        second.release()


def test_a_run_lock_that_cannot_be_opened_is_one_line(corpus, cache_dir, tmp_path, monkeypatch):
    """A lock file another user's killed run left in a shared folder (0644, theirs) made os.open raise a
    PermissionError traceback; it is one line naming the file and the fix, and the folder is left as it was."""
    from minicpm4_jax.train.loop import RUN_LOCK_NAME

    out = tmp_path / "a"
    out.mkdir()
    (out / RUN_LOCK_NAME).write_text("pid 1 on other, since 2026-01-01 00:00:00\n")
    real = os.open

    def deny(path, *a, **kw):
        if str(path).endswith(RUN_LOCK_NAME):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    err = _train_error(tiny_overrides(corpus, cache_dir, out, steps=4, sample_tokens=0))
    assert err == (f"cannot open the run lock {str(out / RUN_LOCK_NAME)!r} (Permission denied); if no training process "
                   "uses this out_dir, remove that file, else choose another out_dir"), err
    assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK_NAME]


def test_a_run_on_a_checkpoint_directory_in_use_is_refused(corpus, cache_dir, tmp_path):
    """Review of the run lock: a run with its own out_dir and another running run's checkpoint.directory passed
    the out_dir lock, and its checkpoint manager deleted that run's save in progress (<step>.orbax-checkpoint-tmp).
    A checkpoint.directory outside out_dir is locked too."""
    from minicpm4_jax.train.loop import RUN_LOCK_NAME, RunLock

    ck = tmp_path / "ck"
    kw = {"steps": 4, "checkpoint.save_every": 2, "checkpoint.directory": str(ck), "sample_tokens": 0}
    run_training(tiny_cfg(corpus, cache_dir, tmp_path / "a", **kw), log=lambda _m: None, progress=False)
    assert not (ck / RUN_LOCK_NAME).exists() and not (tmp_path / "a" / RUN_LOCK_NAME).exists()
    running = RunLock(ck, "checkpoint.directory")  # run a, still training and saving step 6
    running.acquire(lambda _m: None)
    try:
        (ck / "6.orbax-checkpoint-tmp").mkdir()
        (ck / "6.orbax-checkpoint-tmp" / "x").write_text("a save in progress")
        for resume in (False, True):
            err = _train_error(tiny_overrides(corpus, cache_dir, tmp_path / "b", **kw), resume=resume)
            assert err.startswith(f"checkpoint.directory {str(ck)!r} is in use by another training process (pid "), err
            assert err.endswith("or choose another checkpoint.directory"), err
            assert (ck / "6.orbax-checkpoint-tmp" / "x").read_text() == "a save in progress"
        assert not (tmp_path / "b" / RUN_LOCK_NAME).exists()  # b released what it took
    finally:
        running.release()


def test_resume_refuses_a_changed_corpus_and_keeps_the_tokenizer(cache_dir, tmp_path, capsys):
    """Found by a fresh-eyes test: a file added under data.sources made --resume retrain the tokenizer and
    overwrite out_dir/tokenizer, then train on ids that meant other pieces."""
    from minicpm4_jax.train.qat import InitSource, check_init_tokenizer

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, doc in enumerate(_corpus_text(seed=3)):
        (docs / f"doc{i:03d}.txt").write_text(doc)
    out = tmp_path / "run"
    ov = tiny_overrides(docs, cache_dir, out, steps=4, **{"checkpoint.save_every": 2})
    run_training(load_config(None, ov), log=lambda _m: None, progress=False)
    rec = json.loads((out / "data.json").read_text())
    assert len(rec["corpus_hash"]) == 64 and len(rec["tokenizer_hash"]) == 64
    tok_before = (out / "tokenizer" / "tokenizer.model").read_bytes()
    (docs / "extra.txt").write_text("\n".join(_corpus_text(seed=4, n_docs=20)))
    err = _train_error(ov, resume=True)
    assert "differs from the one this run was started with" in err and "data.sources changed" in err, err
    assert (out / "tokenizer" / "tokenizer.model").read_bytes() == tok_before
    assert Checkpointer(load_config(None, ov)).all_steps() == [2, 4]
    # QAT from this run on the changed corpus: its retrained tokenizer is named in a warning
    from minicpm4_jax.train import data as data_api

    changed = data_api.prepare_data(load_config(None, ov).data, log=lambda _m: None).tokenizer
    logs: list[str] = []
    src = InitSource(directory=out / "checkpoints", step=4, cfg=load_config(None, ov))
    assert not check_init_tokenizer(src, changed, logs.append)
    assert len(logs) == 1 and "tokenizer differs" in logs[0] and str(out / "tokenizer") in logs[0]
    (docs / "extra.txt").unlink()  # the original corpus again: resume runs, and the same tokenizer is accepted
    s = run_training(load_config(None, [*ov, "steps=4"]), resume=True, log=lambda _m: None, progress=False)
    assert s["step"] == 4
    original = data_api.prepare_data(load_config(None, ov).data, log=lambda _m: None).tokenizer
    assert check_init_tokenizer(src, original, logs.append) and len(logs) == 1
    # no record (a run from before it existed, or removed): resume runs unchecked and says so
    (out / "data.json").unlink()
    said: list[str] = []
    assert run_training(load_config(None, [*ov, "steps=4"]), resume=True, log=said.append, progress=False)["step"] == 4
    assert any("data.json is missing" in m and "not checked" in m for m in said), said
    assert not (out / "data.json").exists()  # not re-created from the corpus as it is now
    for junk in ("[]", "null", '{"corpus_hash": 5}'):  # valid JSON, not a record: a warning, not a traceback
        (out / "data.json").write_text(junk)
        said.clear()
        run_training(load_config(None, [*ov, "steps=4"]), resume=True, log=said.append, progress=False)
        assert any("data.json is unreadable" in m for m in said), (junk, said)


def test_resume_with_data_sources_spelled_otherwise_runs(corpus, cache_dir, tmp_path, monkeypatch):
    """Earlier sessions: data.sources spelled relative in a run and absolute in its --resume (the same files) was
    refused twice: as a changed data config, and as a changed corpus (the corpus hash covered the paths as spelled).
    Both compare the resolved paths now; a record from before (the spelled-path hash) is accepted for the same
    spelling; other files behind the same names are still refused (the test above)."""
    import shutil

    from minicpm4_jax.train.data import read_corpus

    shutil.copytree(corpus, tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    rel = tiny_overrides(Path("docs"), cache_dir, out, steps=4, **{"checkpoint.save_every": 2})
    absolute = tiny_overrides(tmp_path / "docs", cache_dir, out, steps=4, **{"checkpoint.save_every": 2})
    assert read_corpus(load_config(None, rel).data, with_documents=False).corpus_hash == \
        read_corpus(load_config(None, absolute).data, with_documents=False).corpus_hash
    run_training(load_config(None, rel), log=lambda _m: None, progress=False)
    said: list[str] = []
    assert run_training(load_config(None, absolute), resume=True, log=said.append, progress=False)["step"] == 4
    assert any("data.sources" in m for m in said), said  # named as a tolerated difference
    # a run recorded before the hash covered resolved paths: its hash is that of the paths as spelled
    rec = json.loads((out / "data.json").read_text())
    rec["corpus_hash"] = read_corpus(load_config(None, rel).data, with_documents=False).corpus_hash_as_spelled
    (out / "data.json").write_text(json.dumps(rec))
    assert run_training(load_config(None, rel), resume=True, log=lambda _m: None, progress=False)["step"] == 4
    # the same spelling of other files: refused
    (tmp_path / "docs" / "extra.txt").write_text("\n".join(_corpus_text(seed=4, n_docs=20)))
    assert "data.sources changed" in _train_error(absolute, resume=True)


def test_resume_from_a_damaged_checkpoint_is_one_line(corpus, cache_dir, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    ov = tiny_overrides(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 2})
    run_training(load_config(None, ov), log=lambda _m: None, progress=False)
    step4 = out / "checkpoints" / "4"
    backup = tmp_path / "step4"
    shutil.copytree(step4, backup)
    damage = {
        "array data": lambda: shutil.rmtree(step4 / "state" / "d"),
        "config item": lambda: shutil.rmtree(step4 / "config"),
        "data state": lambda: next((step4 / "data").glob("*.json")).write_text("{not json"),
    }
    for what, do in damage.items():
        do()
        err = _train_error(ov, resume=True)
        assert "checkpoint step 4" in err and "incomplete or corrupt" in err and "saved steps: 2" in err, (what, err)
        shutil.rmtree(step4)
        shutil.copytree(backup, step4)
    # a step without its data-iterator state resumes, with a warning that the data order restarts
    shutil.rmtree(step4 / "data")
    with pytest.warns(UserWarning, match="data order restarts"):
        s = run_training(load_config(None, ov), resume=True, log=lambda _m: None, progress=False)
    assert s["step"] == 4


def test_train_refuses_an_export_folder_a_file_and_a_missing_resume_folder(corpus, cache_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["MiniCPMForCausalLM"], "hidden_size": 64}))
    err = _train_error(tiny_overrides(corpus, cache_dir, hf))
    assert "not a training config" in err
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["MiniCPMForCausalLM"]
    assert sorted(p.name for p in hf.iterdir()) == ["config.json"]
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "minicpm4_manifest.json").write_text("{}")
    assert "holds an export" in _train_error(tiny_overrides(corpus, cache_dir, gguf))
    f = tmp_path / "file"
    f.write_text("x")
    assert "is a file, not a folder" in _train_error(tiny_overrides(corpus, cache_dir, f))
    missing = tmp_path / "missing"
    err = _train_error(tiny_overrides(corpus, cache_dir, missing), resume=True)
    assert "does not exist" in err and not missing.exists()


def test_train_refuses_a_user_folder_and_a_folder_inside_the_corpus(corpus, cache_dir, tmp_path, monkeypatch):
    """Twelfth-session break test: out_dir=/ (or ~) was accepted, the run's files spread into it, and every later
    out_dir below it was refused as inside that run; an out_dir inside a data.sources folder trained on its own
    checkpoints' commit_success.txt files and could never --resume ("the files under data.sources changed"). Both
    are one line before anything is written; a folder holding only what a run writes (a run stopped before its
    first checkpoint) still trains."""
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    own = tmp_path / "own"  # another copy of the corpus, holding the run
    shutil.copytree(corpus, own)
    with monkeypatch.context() as m:
        m.setattr(loop_mod, "_data_api", lambda: pytest.fail("data prepared for a refused run"))
        err = _train_error(tiny_overrides(corpus, cache_dir, home))
        assert (f"out_dir {str(home)!r} is not empty (2 entries that are not a run's, e.g. 'notes.txt') and is not a "
                f"run folder: a run would mix its files into it; choose a new or empty folder, e.g. "
                f"out_dir={home / 'NAME'}") == err, err
        for out, how in ((own / "runs" / "a", "is inside"), (own, "is"), (tmp_path, "holds")):
            err = _train_error([*tiny_overrides(corpus, cache_dir, out), f"data.sources=[{own}]"])
            assert f"out_dir {str(out)!r} {how} the data.sources source {own}, which this run reads: the run's own files" \
                in err, err
        err = _train_error([*tiny_overrides(corpus, cache_dir, tmp_path / "r"), f"data.sources=[{own}]",
                            f"checkpoint.directory={own / 'ck'}"])
        assert f"checkpoint.directory '{own / 'ck'}' is inside the data.sources source {own}" in err, err
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt", "project"]
    assert not (own / "runs").exists() and not (own / "ck").exists() and not (tmp_path / "r").exists()
    stopped = tmp_path / "stopped"  # what a run interrupted before its first checkpoint leaves, minus config.json
    (stopped / "tokenizer").mkdir(parents=True)
    (stopped / "checkpoints").mkdir()
    (stopped / ".DS_Store").write_text("")
    ov = tiny_overrides(corpus, cache_dir, stopped, steps=4, **{"checkpoint.save_every": 4, "eval_every": 4})
    assert run_training(load_config(None, ov), log=lambda _m: None, progress=False)["step"] == 4


def _fake_run(folder: Path, cfg, steps: tuple[int, ...] = (4,), checkpoints: str = "checkpoints") -> Path:
    """A folder shaped like a finished run (training config.json, tokenizer/, orbax step folders), written directly."""
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    (folder / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    for st in steps:
        (folder / checkpoints / str(st) / "state").mkdir(parents=True)
        (folder / checkpoints / str(st) / "_CHECKPOINT_METADATA").write_text("{}")
    return folder


def _tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_train_refuses_an_out_dir_inside_another_run(corpus, cache_dir, tmp_path, monkeypatch):
    """Break test: out_dir=<run>/checkpoints trained a run into another run's checkpoints folder (config.json,
    tokenizer/, checkpoints/ there), and then 'generate --checkpoint <run> --step 3' loaded that nested run's step;
    a step folder, <run>/tokenizer and branch_from=<run> out_dir=<run>/checkpoints/br were accepted too. Each is now
    one line before anything is written; out_dir beside other runs in a plain folder, and --resume, still train."""
    from minicpm4_jax.train.checkpoint import find_checkpoint_dir

    runs = tmp_path / "runs"
    a = _fake_run(runs / "a", tiny_cfg(corpus, cache_dir, runs / "a"))
    ck = tmp_path / "ck"  # a bare checkpoints folder (checkpoint.directory of some run)
    (ck / "7" / "state").mkdir(parents=True)
    (ck / "7" / "_CHECKPOINT_METADATA").write_text("{}")
    before_a, before_ck = _tree(a), _tree(ck)
    with monkeypatch.context() as m:
        m.setattr(loop_mod, "_data_api", lambda: pytest.fail("data prepared for a refused run"))
        for out in (a / "checkpoints", a / "checkpoints" / "4", a / "checkpoints" / "4" / "x", a / "tokenizer",
                    a / "new"):
            err = _train_error(tiny_overrides(corpus, cache_dir, out))
            assert f"out_dir {str(out)!r} is inside the run folder {a} of another run" in err, err
            assert f"choose an out_dir outside {a}" in err, err
        err = _train_error(tiny_overrides(corpus, cache_dir, ck))
        assert f"is the checkpoints folder {ck} of another run" in err, err
        err = _train_error(tiny_overrides(corpus, cache_dir, ck / "7"))
        assert f"is the checkpoint step folder {ck / '7'} of another run" in err, err
        err = _train_error(tiny_overrides(corpus, cache_dir, ck / "7" / "br"))
        assert f"is inside the checkpoint step folder {ck / '7'}" in err, err
        err = _train_error(tiny_overrides(corpus, cache_dir, tmp_path / "fresh",
                                          **{"checkpoint.directory": a / "checkpoints" / "mine"}))
        assert f"checkpoint.directory '{a / 'checkpoints' / 'mine'}' is inside the run folder {a}" in err, err
        # the folders a run reads (branch_from, qat.init_from): out_dir neither is, lies inside nor holds one
        err = _train_error(tiny_overrides(corpus, cache_dir, a / "checkpoints" / "br", branch_from=a, steps=16))
        assert f"is inside the branch_from source {a}, which this run reads" in err, err
        err = _train_error(tiny_overrides(corpus, cache_dir, runs, branch_from=a, steps=16))
        assert f"out_dir {str(runs)!r} holds the branch_from source {a}" in err, err
        # a folder of runs (out_dir=runs instead of runs/NAME): the new run would enclose them
        err = _train_error(tiny_overrides(corpus, cache_dir, runs))
        assert f"out_dir {str(runs)!r} holds the run folder {a} of another run; a run there would enclose it" in err
        err = _train_error(tiny_overrides(corpus, cache_dir, ck / "q", **{"qat.enabled": "true",
                                                                         "qat.init_from": ck}))
        assert f"is inside the qat.init_from source {ck}" in err, err
        assert _tree(a) == before_a and _tree(ck) == before_ck and not (tmp_path / "fresh").exists()
        assert not runs.joinpath("config.json").exists()
    # a run trained into a checkpoints folder before this check: the outer run's checkpoints still resolve to its
    # own (resolving <run> and then <run>/checkpoints again stepped into the nested run's checkpoints/)
    _fake_run(a / "checkpoints", tiny_cfg(corpus, cache_dir, a / "checkpoints"), steps=(3,))
    assert find_checkpoint_dir(a) == a / "checkpoints"
    assert find_checkpoint_dir(find_checkpoint_dir(a)) == a / "checkpoints"
    assert find_checkpoint_dir(a / "checkpoints" / "checkpoints") == a / "checkpoints" / "checkpoints"
    # normal runs: a fresh out_dir beside other runs in a plain folder, then --resume into it
    b = runs / "b"
    ov = tiny_overrides(corpus, cache_dir, b, steps=4, **{"checkpoint.save_every": 4})
    assert run_training(load_config(None, ov), log=lambda _m: None, progress=False)["step"] == 4
    assert run_training(load_config(None, [*ov, "steps=4"]), resume=True, log=lambda _m: None,
                        progress=False)["step"] == 4
    assert find_checkpoint_dir(b) == b / "checkpoints"


def test_train_refuses_a_batch_larger_than_the_corpus_before_writing(corpus, cache_dir, tmp_path, monkeypatch):
    """Break test: data.batch_size=10000000 wrote config.json, data.json and tokenizer/ into out_dir, then the
    process was OOM-killed. It is refused by the data check, before anything is written."""
    from types import SimpleNamespace

    from minicpm4_jax.train import data as data_api

    def prepare_data(cfg, **kw):  # a batch the data check let through stops here, not in an out-of-memory kill
        data_api.prepare_data(cfg, **kw)
        pytest.fail(f"data.batch_size={cfg.batch_size} was accepted")

    monkeypatch.setattr(loop_mod, "_data_api", lambda: SimpleNamespace(prepare_data=prepare_data))
    out = tmp_path / "big"
    err = _train_error(tiny_overrides(corpus, cache_dir, out, **{"data.batch_size": 10_000_000}))
    assert err.startswith("data.batch_size=10000000 x data.seq_len=32 = 320,000,000 tokens per batch exceed the "
                          "train split's"), err
    assert not out.exists()


def test_qat_tokenizer_check_compares_files_of_the_same_kind(tmp_path):
    """Fresh-eyes test: data.tokenizer=<export>/tokenizer.json, byte-identical to the init run's tokenizer.json,
    was reported as a different tokenizer (it was compared with the init folder's tokenizer.model)."""
    from minicpm4_jax.tokenizer import load_tokenizer, train_tokenizer
    from minicpm4_jax.train.qat import InitSource, check_init_tokenizer

    tok = train_tokenizer(_corpus_text(seed=5), 384, tmp_path / "spm", 0, log=lambda _m: None)
    run = tmp_path / "run"
    tok.save(run / "tokenizer")
    (run / "checkpoints").mkdir()
    src = InitSource(directory=run / "checkpoints", step=0, cfg=None)
    logs: list[str] = []
    for same in (run / "tokenizer", run / "tokenizer" / "tokenizer.json", run / "tokenizer" / "tokenizer.model"):
        assert check_init_tokenizer(src, load_tokenizer(same), logs.append), same
    other = train_tokenizer(_corpus_text(seed=6), 400, tmp_path / "spm2", 0, log=lambda _m: None)
    assert not check_init_tokenizer(src, other, logs.append)
    assert len(logs) == 1 and "tokenizer differs" in logs[0]


def test_step_tracer_window_resume_and_early_stop(tmp_path):
    """The profile window: cut by a resume (traced from the next step, or nothing when it is past), stopped and
    reported when the loop ends inside it (time limit, signal), and an unusable folder is refused up front."""
    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.loop import _StepTracer

    cfg = load_config("cpu_tiny", ["steps=40", "profile_start_step=5", "profile_steps=4"])
    said: list[str] = []
    tr = _StepTracer(cfg, tmp_path / "a", said.append, start=6)  # resumed inside the window 5..8
    assert (tr.first, tr.last) == (7, 8) and "tracing steps 7..8 of the window 5..8" in said[-1]
    tr = _StepTracer(cfg, tmp_path / "b", said.append, start=8)
    assert tr.first is None and "nothing traced" in said[-1]
    for s in range(9, 12):  # a window in the past never starts a trace
        tr.before(s)
    assert not tr.active and not (tmp_path / "b" / "profile").exists()
    # the loop stops after step 6, inside the window: the trace is stopped and reported there
    tr = _StepTracer(cfg, tmp_path / "c", said.append)
    for s in (5, 6):
        tr.before(s)
        tr.after(s, jnp.ones(2) * s)
    assert tr.active
    tr.finish(6, None)
    assert not tr.active and said[-1].startswith("profile: steps 5..6 traced into ")
    assert list((tmp_path / "c" / "profile" / "process_0").glob("plugins/profile/*/*.xplane.pb"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "profile").write_text("a file")
    with pytest.raises(ConfigError, match="profile folder .* cannot be created"):
        _StepTracer(cfg, tmp_path / "d", said.append)


def test_run_history_file_rows_up_to_the_resume_and_write_failures(tmp_path):
    """metrics.jsonl: a resume keeps the rows up to its checkpoint step (later ones are trained again) and skips
    lines it cannot read; a file it cannot write (a folder in its place) is one warning, never a failed run."""
    from minicpm4_jax.train.metrics import RunHistory

    path = tmp_path / "metrics.jsonl"
    h = RunHistory(path, start=0, write=True, log=pytest.fail)
    for step in (2, 4, 6):
        h.log({"step": step, "loss": 10.0 - step, "tokens_per_second": 100.0 * step})
    h.evaluation(4, 5.5)
    with open(path, "a") as f:
        f.write("not json\n")
    said: list[str] = []
    r = RunHistory(path, start=4, write=True, log=said.append)
    assert [x["step"] for x in r.history] == [2, 4] and r.val_history == [(4, 5.5)] and r.skipped == 1
    assert r.median_rate() == 300.0 and not said
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 4, 4]  # rewritten, row 6 gone
    r.evaluation(4, 5.0)  # the final evaluation of a resumed finished run replaces the one at its step
    assert r.val_history == [(4, 5.0)] and path.read_text().count('"val"') == 1
    # break test: one non-UTF-8 byte dropped the whole file (every row lost on the rewrite); a string or infinite
    # step crashed the sort; a rate of 0 divided by zero in summary.json's step time
    with open(path, "ab") as f:
        f.write(b'\xff\n{"kind": "train", "step": "5", "loss": 1.0}\n{"kind": "train", "step": Infinity}\n'
                b'{"kind": "train", "step": 5, "loss": 1.0, "tokens_per_second": 0}\n')
    r2 = RunHistory(path, start=6, write=True, log=said.append)
    assert [x["step"] for x in r2.history] == [2, 4, 5] and r2.skipped == 3 and r2.median_rate() == 300.0
    blocked = tmp_path / "b" / "metrics.jsonl"
    blocked.mkdir(parents=True)
    b = RunHistory(blocked, start=0, write=True, log=said.append)
    b.log({"step": 2, "loss": 1.0})
    assert len(said) == 1 and f"cannot write {blocked}" in said[0] and b.history == [{"step": 2, "loss": 1.0}]


def test_resume_and_auto_resume_are_exclusive(capsys):
    from minicpm4_jax.cli import build_parser

    args = build_parser().parse_args(["train", "--auto-resume", "steps=4"])
    assert args.auto_resume and not args.resume and args.overrides == ["steps=4"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--resume", "--auto-resume"])
    assert "argument --auto-resume: not allowed with argument --resume" in capsys.readouterr().err


def _read_events(folder: Path) -> list:
    """The events of the one event file in ``folder`` (the TFRecord framing: length, crc, data, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    (path,) = folder.glob("events.out.tfevents.*")
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("Q", data[i:i + 8])
        out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
        i += 12 + n + 4
    return out


def test_tensorboard_events_are_written_and_a_full_disk_turns_them_off(tmp_path):
    """Break test 62: with tensorboardX's threaded SummaryWriter a full disk killed its thread with a traceback and
    writer.close() raised over the run's own error line. The synchronous writer warns once and carries on."""
    import errno

    from minicpm4_jax.train.metrics import MetricsWriter

    from tensorboardX.proto import event_pb2

    said: list[str] = []
    w = MetricsWriter(tmp_path / "tb", log=said.append, purge_step=3)
    w.scalars(3, {"loss": 2.5, "lr": 0.01}, prefix="train")
    w.text(3, "sample", "hello")
    w.close()
    events = _read_events(tmp_path / "tb")
    assert events[0].file_version == "brain.Event:2"
    # break test 64: a resume's writer purges what a killed attempt logged past the checkpoint (steps >= 3 here)
    assert events[1].step == 3 and events[1].session_log.status == event_pb2.SessionLog.START
    got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value if v.HasField("simple_value")]
    assert got == [(3, "train/loss", 2.5), (3, "train/lr", pytest.approx(0.01))]
    assert any(v.tag.startswith("sample") for e in events for v in e.summary.value) and said == []

    class Full:
        def write(self, *_a):
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = close = write

    w = MetricsWriter(tmp_path / "tb2", log=said.append)
    w._writer._py_recordio_writer._writer = Full()
    w.scalars(1, {"loss": 1.0})
    w.scalars(2, {"loss": 1.0})
    w.close()  # does not raise
    assert not w.enabled and len(said) == 1 and "No space left on device" in said[0], said
    assert "TensorBoard logging is off for the rest of the run" in said[0]


def test_a_hand_edited_origin_record_is_left_out_not_a_crash(tmp_path):
    """Break test 64: data.json's origin with init_tokens null crashed the end of a resumed QAT run (no summary)."""
    from minicpm4_jax.train.loop import read_run_origin

    good = {"branch_from": "/r/checkpoints", "branch_step": 8}
    (tmp_path / "data.json").write_text(json.dumps({"origin": {**good, "init_from": "/q", "init_step": 4,
                                                               "init_tokens": None}}))
    assert read_run_origin(tmp_path) == good
    (tmp_path / "data.json").write_text(json.dumps({"origin": {"init_from": "/q", "init_step": 4, "init_tokens": 64,
                                                               "branch_from": 3, "branch_step": 8}}))
    assert read_run_origin(tmp_path) == {"init_from": "/q", "init_step": 4, "init_tokens": 64}
    (tmp_path / "data.json").write_text('{"origin": [1]}')
    assert read_run_origin(tmp_path) == {}


def test_a_resume_needs_disk_for_one_more_checkpoint_only(tmp_path):
    """Helper 69: after a full disk, freeing space let a fresh run start but the resume was refused: it asked for
    two checkpoints' room although its saved steps hold one, and ignored the failed save's temporary folder that
    opening the checkpoints removes."""
    from minicpm4_jax.train.loop import MIN_FREE_MB, _interrupted_save_bytes, required_free_bytes, trained_params

    cfg = load_config("cpu_tiny")
    ckpt = 12 * trained_params(cfg)  # its MTP draft head included
    base = MIN_FREE_MB * 2**20
    assert required_free_bytes(cfg) == base + 2 * ckpt
    assert required_free_bytes(cfg, resuming=True) == base + ckpt
    assert required_free_bytes(cfg, resuming=True, reclaimable=ckpt // 2) == base + ckpt - ckpt // 2
    assert required_free_bytes(cfg, resuming=True, reclaimable=10 * ckpt) == base
    d = tmp_path / "checkpoints"
    (d / "8.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    (d / "8.orbax-checkpoint-tmp" / "state" / "a").write_bytes(b"x" * 1000)
    (d / "8.orbax-checkpoint-tmp" / "b").write_bytes(b"x" * 24)
    (d / "4").mkdir()
    (d / "4" / "c").write_bytes(b"x" * 5000)  # a complete step is not reclaimed
    assert _interrupted_save_bytes(d) == 1024 and _interrupted_save_bytes(tmp_path / "none") == 0


def test_eval_coverage_note_names_the_rows_of_a_short_split():
    """Break test 85: a validation split of fewer windows than data.batch_size is evaluated as one smaller batch;
    the note said a full batch ("1 batch(es) of 64 x 128 tokens" for 11 windows)."""
    from minicpm4_jax.config import DataConfig
    from minicpm4_jax.train import data as data_api

    cfg = DataConfig(seq_len=128, batch_size=64)
    short = data_api.val_batches(types.SimpleNamespace(val_tokens=np.arange(1499, dtype=np.uint16)), cfg, 2)
    assert [b.shape for b in short] == [(11, 129)]
    assert loop_mod.eval_coverage_note(2, None, short) == ("eval_batches=2: the validation split holds 1 batch(es) "
                                                           "of 11 x 128 tokens; evaluating on those")
    full = data_api.val_batches(types.SimpleNamespace(val_tokens=np.arange(20000, dtype=np.uint16)), cfg, 8)
    assert loop_mod.eval_coverage_note(8, "code", full) == ("eval_batches=8: the validation split of code holds 2 "
                                                            "batch(es) of 64 x 128 tokens; evaluating on those")
    assert loop_mod.eval_coverage_note(2, "code", full) is None


def test_a_new_run_refuses_the_folder_of_a_run_whose_checkpoints_lie_elsewhere(corpus, cache_dir, tmp_path, monkeypatch):
    """Break test 85: `train out_dir=<finished run> checkpoint.directory=<another folder>` (or `--auto-resume` with a
    changed checkpoint.directory, which then found no checkpoint) trained a new run over the finished one's
    summary.json, metrics.jsonl, config.json and TensorBoard events; only the new checkpoint folder was checked for
    steps. Also the other way round: a run whose config.json records a checkpoint.directory."""
    a = _fake_run(tmp_path / "a", tiny_cfg(corpus, cache_dir, tmp_path / "a"))
    ck_b = tmp_path / "ck_b"
    b = _fake_run(tmp_path / "b", tiny_cfg(corpus, cache_dir, tmp_path / "b", **{"checkpoint.directory": ck_b}),
                  checkpoints=str(ck_b))
    before = _tree(a), _tree(b)
    with monkeypatch.context() as m:
        m.setattr(loop_mod, "_data_api", lambda: pytest.fail("data prepared for a refused run"))
        for resume in (False, "auto"):
            with pytest.raises(ConfigError) as e:
                run_training(tiny_cfg(corpus, cache_dir, a, **{"checkpoint.directory": tmp_path / "elsewhere"}),
                             resume=resume, log=lambda _m: None, progress=False)
            assert str(e.value) == (
                f"out_dir {str(a)!r} is the folder of a run with checkpoints in {a / 'checkpoints'}, but this run's "
                f"checkpoint.directory is {str(tmp_path / 'elsewhere')!r}: a new run there would overwrite that run's "
                "summary.json and metrics.jsonl; continue it with --resume and its checkpoint.directory, or choose "
                "another out_dir")
        err = _train_error(tiny_overrides(corpus, cache_dir, b))
        assert f"is the folder of a run with checkpoints in {ck_b}, but this run's checkpoint.directory is " \
               f"{str(b / 'checkpoints')!r}" in err, err
        # and --resume with the changed checkpoint.directory names where the run's checkpoints are
        err = _train_error(tiny_overrides(corpus, cache_dir, a, **{"checkpoint.directory": tmp_path / "elsewhere"}),
                           resume=True)
        assert err == (f"--resume: no checkpoint found in {tmp_path / 'elsewhere'}, but the run in {a} has its "
                       f"checkpoints in {a / 'checkpoints'}; resume with checkpoint.directory={a / 'checkpoints'} (or "
                       "without checkpoint.directory when that is out_dir/checkpoints)"), err
    assert (_tree(a), _tree(b)) == before and not (tmp_path / "elsewhere").exists()


def test_a_relative_checkpoint_directory_is_recorded_where_the_run_put_it(corpus, cache_dir, tmp_path, monkeypatch):
    """Helper 90: config.json recorded a relative checkpoint.directory as given, and the check for a run whose
    checkpoints lie elsewhere resolved it against the working directory of the *next* run: started from another
    folder, a new run into the finished run's out_dir (with another checkpoint.directory) found no checkpoints there
    and would overwrite its summary.json and metrics.jsonl. The recorded folder is the one the Checkpointer wrote to
    (resolved when the run started), whatever the working directory of the run that reads it."""
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir(), other.mkdir()
    out = tmp_path / "run"
    monkeypatch.chdir(home)
    run_training(tiny_cfg(corpus, cache_dir, out, steps=4, **{"checkpoint.save_every": 4, "eval_every": 4,
                                                               "sample_tokens": 0, "checkpoint.directory": "ck"}),
                 log=lambda _m: None, progress=False)
    assert holds_checkpoint_steps(home / "ck")
    assert json.loads((out / "config.json").read_text())["checkpoint"]["directory"] == str(home / "ck")
    monkeypatch.chdir(other)
    assert loop_mod._recorded_checkpoint_dirs(out) == [out / "checkpoints", home / "ck"]
    monkeypatch.setattr(loop_mod, "_data_api", lambda: pytest.fail("data prepared for a refused run"))
    err = _train_error(tiny_overrides(corpus, cache_dir, out, **{"checkpoint.directory": "ck"}))
    assert err.startswith(f"out_dir {str(out)!r} is the folder of a run with checkpoints in {home / 'ck'}, but this "
                          f"run's checkpoint.directory is {str(other / 'ck')!r}"), err


def test_a_summary_that_cannot_be_removed_at_start_is_one_line(corpus, cache_dir, tmp_path, capsys):
    """Earlier sessions: a resume removes the earlier segment's summary.json outside the guard that turns a failed
    run-file write into one line (RunFileWriteError); a summary.json that cannot be removed (here a folder: EISDIR;
    a read-only folder: EACCES) was a traceback."""
    from minicpm4_jax import cli

    out = tmp_path / "run"
    ov = tiny_overrides(corpus, cache_dir, out, steps=2, log_every=2, **{
        "model.rope_scaling": "null", "optimizer.warmup_steps": 0, "optimizer.decay_steps": 0, "sample_tokens": 0})
    assert cli.main(["train", "--no-progress", *ov]) == 0
    (out / "summary.json").unlink()
    (out / "summary.json" / "x").mkdir(parents=True)
    capsys.readouterr()
    rc = cli.main(["train", "--no-progress", "--resume", *ov])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: removing the earlier {out / 'summary.json'} failed ("), err
    assert "nothing was trained" in lines[0] and "checkpoints in" in lines[0] and "intact" in lines[0], err


@pytest.mark.parametrize("name", ["config.json", "tokenizer.model", "summary.json"])
def test_disk_full_on_a_run_file_is_one_line(corpus, cache_dir, tmp_path, monkeypatch, capsys, name):
    """A full disk while writing the run folder's own files (tokenizer/, config.json at the start; summary.json after
    the final checkpoint, when the run's checkpoints have filled the disk) was an OSError traceback (break test 91)."""
    import minicpm4_jax.convert.io as cio
    import minicpm4_jax.tokenizer as tokmod
    from minicpm4_jax import cli

    real = cio.atomic_write

    def full(path, data):
        if Path(path).name == name:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(cio, "atomic_write", full)
    monkeypatch.setattr(tokmod, "atomic_write", full)
    out = tmp_path / "run"
    ov = tiny_overrides(corpus, cache_dir, out, steps=2, log_every=2, **{
        "model.rope_scaling": "null", "optimizer.warmup_steps": 0, "optimizer.decay_steps": 0, "sample_tokens": 0})
    rc = cli.main(["train", "--no-progress", *ov])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], err
    cfg = load_config("cpu_tiny", ov)  # the CLI's default preset under the overrides
    if name == "summary.json":
        assert lines[0].startswith(f"error: writing {out / 'summary.json'} failed"), err
        assert f"checkpoint step 2 in {out / 'checkpoints'} is complete" in lines[0] and "--resume" in lines[0]
        step, st = _restore(cfg)
        assert step == 2 and int(st.step) == 2
        monkeypatch.setattr(cio, "atomic_write", real)
        monkeypatch.setattr(tokmod, "atomic_write", real)
        assert cli.main(["train", "--no-progress", "--resume", *ov]) == 0
        assert json.loads((out / "summary.json").read_text())["step"] == 2
    else:
        assert "nothing was trained" in lines[0] and "run the same command again" in lines[0], err
        assert not (out / "checkpoints").exists() or not Checkpointer(cfg).all_steps()


def test_disk_full_while_caching_the_trained_tokenizer_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    """The token cache's failed write was one line, the tokenizer cache's beside it a traceback (break test 91)."""
    import minicpm4_jax.tokenizer as tokmod
    from minicpm4_jax import cli

    real = tokmod.atomic_write

    def full(path, data):
        if Path(path).parent.name.startswith(".tmp-spm-"):
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(tokmod, "atomic_write", full)
    cache = tmp_path / "cache"
    ov = tiny_overrides(corpus, cache, tmp_path / "run", **{"model.rope_scaling": "null"})
    rc = cli.main(["train", "--no-progress", *ov])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"error: writing the trained tokenizer under {cache / 'tokenizers'} failed (No "
                                        "space left on device); free disk space or point data.cache_dir at a writable "
                                        "folder"], err
    assert not list((cache / "tokenizers").glob("*"))  # nothing half-written is left to be reused


def test_a_sweep_reuses_a_finished_run_with_a_relative_checkpoint_directory(corpus, cache_dir, tmp_path, monkeypatch):
    """Break test (helper 95): config.json records a relative checkpoint.directory resolved (helper 90), but the
    sweep's reuse check compared it with ``config_to_dict(cfg)`` (the relative one): a finished run never matched, so
    its folder was removed and the run trained again (into a checkpoint.directory still holding its steps)."""
    from minicpm4_jax.train import sweep

    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "runs" / "a", steps=4, **{"checkpoint.directory": "ck"})
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    saved = config_to_dict(cfg)  # what run_training writes (test_a_relative_checkpoint_directory_is_recorded_...)
    saved["checkpoint"]["directory"] = str(tmp_path / "ck")
    (run / "config.json").write_text(json.dumps(saved))
    (run / "summary.json").write_text(json.dumps({"val_loss": 1.5}))
    monkeypatch.setattr(loop_mod, "run_training", lambda *a, **k: pytest.fail("a finished run trained again"))
    assert sweep.train_or_reuse("a", cfg, tmp_path / "runs") == {"val_loss": 1.5}
    assert loop_mod.recorded_config(cfg) == saved


def test_a_sweep_goes_on_past_a_diverging_run_and_reuses_its_record(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    """Break test (helper 99): a learning-rate sweep (scripts/mup_transfer.py, whose table takes a non-finite loss as
    NaN) died with a TrainingDiverged traceback at the first learning rate too high for the model, and since such a
    run leaves no summary.json every later invocation trained it (and died) again."""
    import math

    from minicpm4_jax.train import sweep

    root = tmp_path / "runs"
    cfg = tiny_cfg(corpus, cache_dir, root / "hot", steps=4, **{"optimizer.learning_rate": 1e6,
                                                                 "optimizer.grad_clip": 0, "optimizer.warmup_steps": 0})
    got = sweep.train_or_reuse("hot", cfg, root)
    assert got["stop_reason"] == "diverged" and math.isnan(got["val_loss"]), got
    assert got["diverged"].startswith("non-finite ") and "\n" not in got["diverged"], got
    assert "== hot: diverged after" in capsys.readouterr().out
    assert not (root / "hot" / "summary.json").exists()
    # the next invocation of the sweep reuses the record instead of training the run again
    with monkeypatch.context() as m:
        m.setattr(loop_mod, "run_training", lambda *a, **k: pytest.fail("a diverged run trained again"))
        again = sweep.train_or_reuse("hot", cfg, root)
    assert again["stop_reason"] == "diverged" and math.isnan(again["val_loss"]) and again["diverged"] == got["diverged"]
    assert "reusing" in capsys.readouterr().out
    # a run started in that folder by hand (with a learning rate that trains) drops the sweep's stale record
    cool = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=0.02, grad_clip=1.0))
    run_training(cool, log=lambda _m: None, progress=False)
    assert (root / "hot" / "summary.json").is_file() and not (root / "hot" / "diverged.json").exists()


def test_a_sweep_resumes_an_interrupted_run_instead_of_removing_it(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    """A sweep stopped inside a run (Ctrl-C) left that run's folder without summary.json; the next invocation
    removed the folder, checkpoints included, and trained the run from step 0. A run of the same config is now
    resumed from its latest checkpoint (one of another config is still removed)."""
    from minicpm4_jax.train import sweep

    root = tmp_path / "runs"
    cfg = tiny_cfg(corpus, cache_dir, root / "a", steps=4, tensorboard=False, log_every=1,
                   **{"checkpoint.save_every": 2, "sample_tokens": 0, "optimizer.warmup_steps": 1, "optimizer.decay_steps": 1})

    def interrupt(step, state):
        if step == 3:
            raise KeyboardInterrupt
        return state

    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, log=lambda _m: None, progress=False, handle_signals=False, step_hook=interrupt)
    assert not (root / "a" / "summary.json").exists() and (root / "a" / "checkpoints" / "2").is_dir()
    calls: list[dict] = []
    real = loop_mod.run_training
    monkeypatch.setattr(loop_mod, "run_training", lambda c, **k: calls.append(k) or real(c, **k))
    got = sweep.train_or_reuse("a", cfg, root)
    assert [k.get("resume", False) for k in calls] == [True] and got["step"] == 4, calls
    assert [h["step"] for h in got["history"]] == [1, 2, 3, 4]  # the rows of the interrupted segment up to its checkpoint are kept
    assert "== a: resuming 4 steps into" in capsys.readouterr().out
    # another config in that folder: removed and trained afresh
    (root / "a" / "summary.json").unlink()
    monkeypatch.setattr(loop_mod, "run_training", lambda c, **k: calls.append(k) or {"val_loss": 1.0})
    assert sweep.train_or_reuse("a", dataclasses.replace(cfg, seed=1), root) == {"val_loss": 1.0}
    assert calls[-1].get("resume", False) is False and not (root / "a").exists()
    assert "== a: training 4 steps into" in capsys.readouterr().out


def test_run_training_validates_a_config_built_in_python(corpus, cache_dir, tmp_path):
    """Only ``load_config`` validated: ``run_training(dataclasses.replace(cfg, steps=0))`` (the Python entry point)
    trained nothing, saved a step-0 checkpoint and wrote a summary, where ``steps=0`` on the command line is one
    ConfigError line. It is now the same error, before anything is written."""
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "run")
    for bad in (dataclasses.replace(cfg, steps=0),
                dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=4096))):
        with pytest.raises(ConfigError, match=r"steps=0 must be|data.seq_len=4096 is above"):
            run_training(bad, log=lambda m: None, progress=False, handle_signals=False)
    assert not (tmp_path / "run").exists()
