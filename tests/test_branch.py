"""Decay branches of a WSD run (``branch_from`` / ``branch_step``, ``train/branch.py``).

A branch restores another run's checkpoint from its stable phase and continues with its own length and decay:
it must equal a run trained from scratch with the branch's settings (bitwise: same machine, same mesh), also for
a data mixture whose decay weights the branch changes; the source folder must be left untouched (only read);
and a branch that would not be that run is refused before anything is written: another model, optimizer or
seed, a branch point inside either decay, a step that is not a checkpoint, the run's own folder, QAT.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from test_train import _params, _restore, cache_dir, corpus, tiny_cfg  # noqa: F401 - module fixtures

from minicpm4_jax.config import ConfigError
from minicpm4_jax.train.loop import run_training

QUIET = dict(log=lambda _m: None, progress=False)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source(corpus, cache_dir, tmp_path_factory):  # noqa: F811
    """12 steps, decay over the last 4; checkpoints every 2 steps (the stable phase ends after step 8)."""
    out = tmp_path_factory.mktemp("src") / "run"
    cfg = tiny_cfg(corpus, cache_dir, out, steps=12, **{"optimizer.decay_steps": 4, "checkpoint.save_every": 2,
                                                        "checkpoint.keep": 10})
    run_training(cfg, **QUIET)
    return out


def test_branch_equals_a_run_from_scratch_and_leaves_the_source_alone(corpus, cache_dir, tmp_path, source):  # noqa: F811
    before = _tree_digest(source)
    kw = {"steps": 16, "optimizer.decay_steps": 6}
    said: list[str] = []
    s_branch = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "branch", branch_from=source, branch_step=6, **kw),
                            log=said.append, progress=False)
    assert any(m.startswith("branch: continuing") and "/6 " in m for m in said), said
    assert s_branch["step"] == 16 and s_branch["branch_step"] == 6
    s_fresh = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "fresh", **kw), **QUIET)
    _, a = _restore(tiny_cfg(corpus, cache_dir, tmp_path / "branch", **kw))
    _, b = _restore(tiny_cfg(corpus, cache_dir, tmp_path / "fresh", **kw))
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    assert not [k for k in pa if not np.array_equal(pa[k], pb[k])]
    assert s_branch["val_loss"] == s_fresh["val_loss"]
    # the branch's log is the fresh run's: after the branch point its own, before it the source's (metrics.jsonl)
    def logged(summary):
        return [(h["step"], h["loss"], h["grad_norm"], h["lr"]) for h in summary["history"]]

    assert logged(s_branch) == logged(s_fresh) and len(logged(s_fresh)) == 8
    assert s_branch["val_history"] == s_fresh["val_history"] and s_fresh["val_history"][0][0] == 4
    assert _tree_digest(source) == before


def test_a_mixture_branch_with_new_decay_weights(corpus, cache_dir, tmp_path, tmp_path_factory):  # noqa: F811
    other = tmp_path_factory.mktemp("other")
    for i in range(30):
        (other / f"o{i}.txt").write_text("class Widget:\n    size = %d\n    name = 'w%d'\n" % (i, i) * 6)
    mix = {"data.sources": f"[{corpus},{other}]", "data.weights": "[3,1]"}
    src = tmp_path / "src"
    run_training(tiny_cfg(corpus, cache_dir, src, steps=8, **mix, **{"optimizer.decay_steps": 2,
                                                                        "checkpoint.save_every": 2}), **QUIET)
    kw = {**mix, "steps": 10, "optimizer.decay_steps": 3, "data.decay_weights": "[1,3]"}
    s_branch = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=src, branch_step=4, **kw), **QUIET)
    s_fresh = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "f", **kw), **QUIET)
    assert s_branch["val_loss"] == s_fresh["val_loss"]
    assert len(s_branch["val_loss_components"]) == 2
    assert s_branch["val_loss_components"] == s_fresh["val_loss_components"]
    _, a = _restore(tiny_cfg(corpus, cache_dir, tmp_path / "b", **kw))
    _, b = _restore(tiny_cfg(corpus, cache_dir, tmp_path / "f", **kw))
    pa, pb = _params(a), _params(b)
    assert not [k for k in pa if not np.array_equal(pa[k], pb[k])]


def test_a_mixture_branch_one_step_into_a_decay(corpus, cache_dir, tmp_path, tmp_path_factory):  # noqa: F811
    """The first decay step keeps the stable learning rate (lr(N - D) = peak), so the schedules agree up to a branch
    point one step into a decay; but a mixture switches to its decay_weights there: the batches differ."""
    other = tmp_path_factory.mktemp("other")
    for i in range(30):
        (other / f"o{i}.txt").write_text("class Widget:\n    size = %d\n    name = 'w%d'\n" % (i, i) * 6)
    mix = {"data.sources": f"[{corpus},{other}]", "data.weights": "[3,1]", "data.decay_weights": "[1,3]"}
    src = tmp_path / "src"  # decays from step 5 (update 4); checkpoints 4, 5 and 6
    run_training(tiny_cfg(corpus, cache_dir, src, steps=6, **mix, **{"optimizer.decay_steps": 2,
                                                                        "checkpoint.save_every": 1}), **QUIET)
    for name, at, kw, match in [
        ("inside_source_decay", 5, {"steps": 10, "optimizer.decay_steps": 3},
         r"checkpoints/5: the data mixture .* \(step 5 in the source, step 8 in this run\).* no later than 4 "),
        ("inside_own_decay", 4, {"steps": 9, "optimizer.decay_steps": 6},
         r"checkpoints/4: the data mixture .* \(step 5 in the source, step 4 in this run\).* no later than 3 "),
    ]:
        out = tmp_path / name
        with pytest.raises(ConfigError, match=match):
            run_training(tiny_cfg(corpus, cache_dir, out, branch_from=src, branch_step=at, **mix, **kw), **QUIET)
        assert not out.exists() or not any(out.rglob("*")), name
    # both switch at the same step to the same weights: the same batches, accepted
    from minicpm4_jax.train.branch import resolve_branch

    kw = {**mix, "steps": 8, "optimizer.decay_steps": 4}
    same = tiny_cfg(corpus, cache_dir, tmp_path / "same", branch_from=src, branch_step=5, **kw)
    assert resolve_branch(same).step == 5


@pytest.mark.parametrize("kw,match", [
    (dict(branch_step=10, steps=16), r"the learning rate of this run differs from the source's at step 10 .*the source "
                                      r"decays from step 9 and this run from step 13; branch at a step no later"),
    (dict(branch_step=6, steps=16, **{"optimizer.learning_rate": 0.01}),
     r"was trained with another config: optimizer.learning_rate: 0.02 != 0.01"),
    (dict(branch_step=6, steps=16, seed=1), r"was trained with another config: seed: 0 != 1"),
    (dict(branch_step=6, steps=16, **{"optimizer.warmup_steps": 3}),
     r"was trained with another config: optimizer.warmup_steps: 2 != 3"),
    (dict(branch_step=5, steps=16), r"branch_step=5 is not a checkpoint in .* \(saved steps: 2, 4, 6, 8, 10, 12\)"),
    (dict(branch_step=6, steps=6), r"branch_step=6 must be in \[1, steps=6\)"),
])
def test_branches_that_are_not_that_run_are_refused(corpus, cache_dir, tmp_path, source, kw, match):  # noqa: F811
    cfg_kw = {"optimizer.decay_steps": 4, **kw}
    out = tmp_path / "b"
    with pytest.raises(ConfigError, match=match):
        run_training(tiny_cfg(corpus, cache_dir, out, branch_from=source, **cfg_kw), **QUIET)
    assert not out.exists() or not any(out.rglob("*"))  # refused before anything is written


def test_a_branch_may_spell_the_sources_otherwise(corpus, cache_dir, tmp_path, source, monkeypatch):  # noqa: F811
    """``data.sources`` naming the source run's corpus by a relative path (the source gave it absolute) was refused
    as "trained with another config: data.sources: [...] != [...]", which a resume of that run accepts
    (``same_sources``); another corpus is still refused."""
    from minicpm4_jax.train.branch import resolve_branch

    monkeypatch.chdir(corpus.parent)
    kw = {"optimizer.decay_steps": 4, "steps": 16, "branch_step": 6}
    assert resolve_branch(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=source, **kw,
                                   **{"data.sources": f"[{corpus.name}]"})).step == 6
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match=r"was trained with another config: data.sources: "):
        resolve_branch(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=source, **kw,
                                **{"data.sources": f"[{tmp_path / 'other'}]"}))


def test_bad_branch_sources(corpus, cache_dir, tmp_path, source):  # noqa: F811
    with pytest.raises(ConfigError, match=r"branch_from: checkpoint directory '.*nowhere' does not exist"):
        run_training(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=tmp_path / "nowhere", steps=16), **QUIET)
    from minicpm4_jax.train.branch import resolve_branch

    with pytest.raises(ConfigError, match=r"is this run's own checkpoint folder; a branch writes its own"):
        resolve_branch(tiny_cfg(corpus, cache_dir, source, branch_from=source, steps=16))
    # the messages name the config keys (not a command's --checkpoint / --step)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"^branch_from=.*afile is a file, not a folder; give the training run's"):
        run_training(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=tmp_path / "afile", steps=16), **QUIET)
    with pytest.raises(ConfigError, match=r"^branch_from=.*/checkpoints/6 is the folder of one checkpoint step \(6\), "
                                          r"not a run; give the run folder instead: branch_from=.*run branch_step=6$"):
        run_training(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=source / "checkpoints" / "6", steps=16),
                     **QUIET)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").rglob("*"))
    # a step whose config item is gone (train.checkpoint.resolve_source): named with the branch's keys
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    shutil.rmtree(damaged / "checkpoints" / "6" / "config")
    with pytest.raises(ConfigError, match=r"^branch_from: checkpoint step 6 in .*damaged/checkpoints has no readable "
                                          r"config \(.*\); pick another branch_step \(saved steps: 2, 4, 8, 10, 12\)$"):
        resolve_branch(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=damaged, branch_step=6, steps=16))
    with pytest.raises(ConfigError, match=r"branch_step=4 needs branch_from"):
        tiny_cfg(corpus, cache_dir, tmp_path / "c", branch_step=4)
    with pytest.raises(ConfigError, match=r"branch_from with qat.enabled"):
        tiny_cfg(corpus, cache_dir, tmp_path / "c", branch_from=source, **{"qat.enabled": "true"})


def test_a_branch_resumes_its_own_checkpoints(corpus, cache_dir, tmp_path, source):  # noqa: F811
    kw = {"steps": 14, "optimizer.decay_steps": 4, "checkpoint.save_every": 2}
    out = tmp_path / "b"

    def stop_after_11(step, state):
        if step == 10:  # flag set during update 11; the loop saves step 11 and stops
            os.kill(os.getpid(), signal.SIGTERM)
        return state

    s1 = run_training(tiny_cfg(corpus, cache_dir, out, branch_from=source, branch_step=8, **kw),
                      step_hook=stop_after_11, **QUIET)
    assert s1["stop_reason"] == "signal" and s1["step"] == 11
    s = run_training(tiny_cfg(corpus, cache_dir, out, branch_from=source, branch_step=8, **kw), resume=True, **QUIET)
    fresh = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "f", **kw), **QUIET)
    assert s["step"] == 14 and s["val_loss"] == fresh["val_loss"]
    assert json.loads((out / "summary.json").read_text())["step"] == 14
    # the resumed segment no longer resolves the source, but its summary still names it (data.json's origin)
    assert (s["branch_from"], s["branch_step"]) == (str(source / "checkpoints"), 8)


def test_a_source_whose_corpus_changed_is_refused(corpus, cache_dir, tmp_path):  # noqa: F811
    """The source run's data.json records its corpus; the message names the source run and a fix that works for a
    branch (a new out_dir would not help)."""
    import shutil

    own = tmp_path / "corpus"
    shutil.copytree(corpus, own)
    src = tmp_path / "src"
    said: list[str] = []
    run_training(tiny_cfg(own, cache_dir, src, steps=4, **{"optimizer.decay_steps": 1, "checkpoint.save_every": 2}),
                 log=said.append, progress=False)
    # break test 62: a 1-step decay trains exactly like none (its update runs at the peak): said so
    assert any(m.startswith("warning: a decay of 1 step changes nothing") for m in said), said
    first = sorted(own.iterdir())[0]
    first.write_text(first.read_text() + "\n# changed\n")
    out = tmp_path / "b"
    with pytest.raises(ConfigError, match=r"^branch_from: the (tokenizer|corpus under data.sources) differs from the "
                                          r"one the branch_from run \(.*src\) was started with .*; restore the files "
                                          r"that run was trained on$"):
        run_training(tiny_cfg(own, cache_dir, out, branch_from=src, branch_step=2, steps=8), **QUIET)
    assert not out.exists() or not any(out.rglob("*"))


def test_a_source_with_its_checkpoints_outside_its_folder(corpus, cache_dir, tmp_path):  # noqa: F811
    """Break test (helper 99): a run trained with ``checkpoint.directory`` outside its ``out_dir`` (its config.json
    records the folder) could not be named by its folder: ``branch_from=<out_dir>`` (and ``generate`` / ``eval`` /
    ``export --checkpoint <out_dir>``) said "no checkpoint found" there, and ``branch_from=<checkpoint folder>``
    looked for the source's data.json and metrics.jsonl beside that folder, so the corpus went unchecked and the
    branch's history lacked the source's rows. The run folder now resolves to its recorded checkpoint folder, and
    the branch reads the run's own files."""
    from minicpm4_jax.tokenizer import load_run_tokenizer
    from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference

    src, ck = tmp_path / "runs" / "src", tmp_path / "scratch" / "ck"
    run_training(tiny_cfg(corpus, cache_dir, src, steps=8, **{"checkpoint.directory": ck, "checkpoint.save_every": 2,
                                                               "checkpoint.keep": 10, "optimizer.decay_steps": 2}),
                 **QUIET)
    assert not (src / "checkpoints").exists() and find_checkpoint_dir(src) == ck
    cfg, _model = load_params_for_inference(src)  # what generate / eval / export load
    assert cfg.steps == 8 and load_run_tokenizer(src, ck).vocab_size == 384
    said: list[str] = []
    kw = {"steps": 10, "optimizer.decay_steps": 3}
    s = run_training(tiny_cfg(corpus, cache_dir, tmp_path / "b", branch_from=src, branch_step=4, **kw),
                     log=said.append, progress=False)
    assert s["step"] == 10 and s["branch_step"] == 4 and f"branch: continuing {ck}/4 " in " ".join(said), said
    assert not any("is missing" in m for m in said), said  # the source's data.json was found and checked
    assert [h["step"] for h in s["history"]] == [2, 4, 6, 8, 10]  # the source's rows up to the branch point
