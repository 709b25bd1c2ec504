"""Data mixtures (``data.weights`` / ``data.decay_weights``; ``train.data``: ``mixture_schedule``, the mixing dataset).

Each ``data.sources`` entry becomes a component with its own split and token cache (the cache a one-source run
with the same tokenizer uses), one tokenizer trained on the union of the components' training documents only,
windows served in the weights' proportions (exact per period, evenly interleaved), the decay weights from the
first step of the learning-rate decay with each component's stream continuing where it stopped, checkpointable
iterator state, disjoint process rows, per-component validation losses in the training loop, and one-line errors
for bad weights. The two test corpora share no word, so every window's component is known from its tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from minicpm4_jax.config import ConfigError, DataConfig, load_config
from minicpm4_jax.train import data as D

WORDS = {"a": ["alpha", "apple", "amber", "arrow"], "b": ["zulu", "zebra", "zinc", "zone"]}


def _write_corpus(root: Path, name: str, n_docs: int = 24) -> Path:
    d = root / name
    d.mkdir()
    rng = np.random.default_rng(len(name))
    for i in range(n_docs):
        words = rng.choice(WORDS[name[0]], 80)
        (d / f"{name}{i:02d}.txt").write_text(" ".join(f"{w}{int(rng.integers(10))}" for w in words) + "\n")
    return d


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    return {"a": _write_corpus(root, "a"), "b": _write_corpus(root, "b"), "cache": root / "cache"}


def _cfg(corpora, **kw) -> DataConfig:
    base = dict(sources=(str(corpora["a"]), str(corpora["b"])), weights=(3.0, 1.0), tokenizer_vocab_size=300,
                seq_len=16, batch_size=4, val_fraction=0.1, cache_dir=str(corpora["cache"]))
    base.update(kw)
    return DataConfig(**base)


def _classifier(data):
    own = [set(np.asarray(m.data.train_tokens).tolist()) for m in data.components]
    only = [own[0] - own[1], own[1] - own[0]]

    def which(row: np.ndarray) -> int:
        ids = set(row.tolist())
        hits = [bool(ids & o) for o in only]
        assert hits.count(True) == 1, "a window with tokens of both components or of neither"
        return hits.index(True)

    return which


def test_schedule_is_exact_even_and_skips_zero_weights():
    comp, rank, counts = D.mixture_schedule([3, 1, 0, 2.5], period=130)
    assert counts.tolist() == [60, 20, 0, 50] and counts.sum() == 130
    assert np.bincount(comp, minlength=4).tolist() == counts.tolist()
    for c in range(4):  # ranks count each component's slots in order
        np.testing.assert_array_equal(rank[comp == c], np.arange(counts[c]))
    p = counts / counts.sum()
    for n in range(1, 131):  # every prefix within one window of its share
        assert np.all(np.abs(np.bincount(comp[:n], minlength=4) - n * p) < 1.0 + 1e-9), n
    # largest remainder: 1/3 each of 10 slots -> 4, 3, 3 (ties to the first component)
    assert D.mixture_schedule([1, 1, 1], period=10)[2].tolist() == [4, 3, 3]


def test_components_have_their_own_caches_and_a_tokenizer_of_the_training_documents(corpora, monkeypatch):
    seen: list[list[str]] = []
    real = D.train_tokenizer

    def spy(docs, *a, **kw):
        seen.append(list(docs))
        return real(seen[-1], *a, **kw)

    monkeypatch.setattr(D, "train_tokenizer", spy)
    cfg = _cfg(corpora, cache_dir=str(corpora["cache"] / "spy"))
    data = D.prepare_data(cfg, log=lambda _m: None)
    assert [m.name for m in data.components] == ["a", "b"]
    assert [(m.weight, m.decay_weight) for m in data.components] == [(3.0, 3.0), (1.0, 1.0)]
    # the tokenizer saw exactly the components' training documents, no validation document
    train_docs, val_docs = [], []
    for src in cfg.sources:
        part = dataclasses.replace(cfg, sources=(src,), weights=None)
        tr, va, _ = D._split_documents(D.read_corpus(part).documents, cfg.val_fraction, cfg.seed)
        train_docs += tr
        val_docs += va
    assert len(seen) == 1 and sorted(seen[0]) == sorted(train_docs) and not set(seen[0]) & set(val_docs)
    # each component's tokens are those of a one-source run with the same tokenizer
    tok_file = Path(data.tokenizer.source)  # the trained SentencePiece model
    assert tok_file.is_file()
    for m, src in zip(data.components, cfg.sources):
        alone = D.prepare_data(dataclasses.replace(cfg, sources=(src,), weights=None, tokenizer=str(tok_file)),
                               log=lambda _m: None)
        np.testing.assert_array_equal(np.asarray(alone.train_tokens), np.asarray(m.data.train_tokens))
        np.testing.assert_array_equal(np.asarray(alone.val_tokens), np.asarray(m.data.val_tokens))
        assert alone.manifest["key"] == m.data.manifest["key"]
    man = data.manifest
    assert man["mixture"] and man["num_train_tokens"] == sum(c["num_train_tokens"] for c in man["components"])
    assert data.train_tokens.shape[0] == man["num_train_tokens"]


def test_a_mixtures_whole_corpus_is_chained_not_copied(tmp_path):
    """Break test (helper 99): a mixture's ``train_tokens`` / ``val_tokens`` (read by the n-gram baselines) were
    ``np.concatenate`` of its components' memmaps: every token copied into memory, in each process, at the start of
    the run (2 bytes per token: 20 GB for a 10B-token mixture). They are now a ``TokenChain`` of the memmaps, which
    reads only what is sliced, and equals the concatenation."""
    import gc
    import tracemalloc

    parts = {}
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        rng = np.random.default_rng(len(name))
        for i in range(6):
            words = rng.choice(WORDS[name], 40_000)
            (d / f"{name}{i}.txt").write_text(" ".join(f"{w}{int(rng.integers(10))}" for w in words) + "\n")
        parts[name] = d
    cfg = _cfg({**parts, "cache": tmp_path / "cache"})
    D.prepare_data(cfg, log=lambda _m: None)  # tokenized and cached
    tracemalloc.start()
    try:
        data = D.prepare_data(cfg, log=lambda _m: None)
        gc.collect()  # what the prepared data holds in memory, not garbage awaiting the collector
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    n_tokens = data.manifest["num_train_tokens"] + data.manifest["num_val_tokens"]
    assert n_tokens * 2 > 2**20 and kept < 2**20, f"{kept / 2**20:.2f} MiB held for {n_tokens:,} tokens"
    for split in ("train_tokens", "val_tokens"):
        chain, whole = getattr(data, split), np.concatenate([getattr(m.data, split) for m in data.components])
        assert chain.shape == whole.shape and len(chain) == whole.size and chain.dtype == whole.dtype
        np.testing.assert_array_equal(np.asarray(chain), whole)
        cut = getattr(data.components[0].data, split).shape[0]
        for sl in (slice(cut - 5, cut + 7), slice(0, 3), slice(-4, None), slice(cut, cut), slice(1, 40, 3)):
            np.testing.assert_array_equal(chain[sl], whole[sl], err_msg=str(sl))
        assert chain[cut] == whole[cut] and chain[-1] == whole[-1]
    np.testing.assert_array_equal(D.ngram_sample(data.train_tokens, 640),
                                  D.ngram_sample(np.concatenate([m.data.train_tokens for m in data.components]), 640))


def test_proportions_decay_switch_and_continuing_streams(corpora):
    cfg = _cfg(corpora, decay_weights=(0.0, 1.0))
    data = D.prepare_data(cfg, log=lambda _m: None)
    which = _classifier(data)
    switch = 25
    it = D.train_iterator(data, cfg, decay_start_batch=switch)
    batches = [np.asarray(next(it)["input_ids"]) for _ in range(40)]
    labels = [[which(r) for r in b] for b in batches]
    before = np.array(labels[:switch]).ravel()
    assert abs(int(np.sum(before == 0)) - 0.75 * before.size) < 1.0  # 3 : 1, within one window
    assert all(x == 1 for b in labels[switch:] for x in b)  # decay weights 0 : 1
    # component b's stream continues across the switch: its first windows are all distinct (its epoch holds more)
    b_windows = [r.tobytes() for b, lab in zip(batches, labels) for r, x in zip(b, lab) if x == 1]
    n_b = len(D._Windows(data.components[1].data.train_tokens, cfg.seq_len))
    assert len(b_windows) > 20 and len(set(b_windows[:n_b])) == min(n_b, len(b_windows))
    # without decay weights nothing switches: the same order as without a decay start
    plain = _cfg(corpora)
    d2 = D.prepare_data(plain, log=lambda _m: None)
    x = [np.asarray(next(D.train_iterator(d2, plain, decay_start_batch=3))["input_ids"]) for _ in range(1)]
    y = [np.asarray(next(D.train_iterator(d2, plain))["input_ids"]) for _ in range(1)]
    np.testing.assert_array_equal(x[0], y[0])


def test_state_restores_across_the_switch_and_process_rows_are_disjoint(corpora):
    cfg = _cfg(corpora, decay_weights=(1.0, 2.0), batch_size=8)
    data = D.prepare_data(cfg, log=lambda _m: None)
    it = D.train_iterator(data, cfg, decay_start_batch=4)
    for _ in range(3):
        next(it)
    state = it.get_state()
    ahead = [np.asarray(next(it)["input_ids"]) for _ in range(4)]  # batches 3..6 straddle the switch
    it2 = D.train_iterator(data, cfg, decay_start_batch=4)
    it2.set_state(state)
    np.testing.assert_array_equal(np.stack(ahead), np.stack([np.asarray(next(it2)["input_ids"]) for _ in range(4)]))
    whole = D.train_iterator(data, cfg, decay_start_batch=4)
    halves = [D.train_iterator(data, cfg, process_index=p, process_count=2, decay_start_batch=4) for p in (0, 1)]
    for _ in range(6):
        g = np.asarray(next(whole)["input_ids"])
        np.testing.assert_array_equal(g, np.concatenate([np.asarray(next(h)["input_ids"]) for h in halves]))


@pytest.mark.parametrize("kw,match", [
    (dict(weights=(1.0,)), r"data.weights has 1 entries for 2 data.sources; give one weight per source"),
    (dict(weights=(1.0, -1.0)), r"data.weights=\[1.0, -1.0\] must be finite numbers >= 0 with a positive, finite sum"),
    (dict(weights=(0.0, 0.0)), r"data.weights=\[0.0, 0.0\] must be finite"),
    (dict(weights=(1.0, float("nan"))), r"data.weights=\[1.0, nan\] must be finite"),
    (dict(weights=(1e308, 1e308)), r"data.weights=\[1e\+308, 1e\+308\] must be .* finite sum"),  # overflowed
    (dict(weights=None, decay_weights=(1.0, 1.0)), r"data.decay_weights=\[1.0, 1.0\] needs data.weights"),
    (dict(decay_weights=(1.0, 1.0, 1.0)), r"data.decay_weights has 3 entries for 2 data.sources"),
])
def test_bad_weights_are_one_line_errors(corpora, kw, match):
    with pytest.raises(ConfigError, match=match):
        D.prepare_data(_cfg(corpora, **kw), log=lambda _m: None)
    ov = [f"data.sources=[{corpora['a']},{corpora['b']}]"]
    for k, v in {**dict(weights=(3.0, 1.0)), **kw}.items():
        ov.append(f"data.{k}=" + ("null" if v is None else "[" + ",".join(str(x) for x in v) + "]"))
    with pytest.raises(ConfigError, match=match):
        load_config("cpu_tiny", ov)


def test_component_names():
    assert D.component_names(["stdlib", "/x/web.jsonl", "/y/web.jsonl", "/z/code dir", "stdlib"]) == [
        "stdlib", "web", "web_2", "code_dir", "stdlib_2"]


def test_training_loop_reports_each_components_loss_and_refuses_new_weights(corpora, tmp_path):
    from minicpm4_jax.train.loop import run_training

    ov = {"model.vocab_size": 512, "model.hidden_size": 64, "model.intermediate_size": 128,
          "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
          "model.max_position_embeddings": 64, "model.dim_model_base": 16, "model.mtp": "false",
          "data.sources": f"[{corpora['a']},{corpora['b']}]", "data.weights": "[3,1]", "data.decay_weights": "[1,3]",
          "data.tokenizer_vocab_size": 300, "data.seq_len": 16, "data.batch_size": 4, "data.val_fraction": 0.1,
          "data.cache_dir": str(corpora["cache"]), "steps": 6, "optimizer.warmup_steps": 1,
          "optimizer.decay_steps": 2, "log_every": 2, "eval_every": 3, "eval_batches": 2,
          "checkpoint.save_every": 3, "out_dir": str(tmp_path / "run"), "sample_tokens": 0, "tensorboard": False}
    cfg = load_config(None, [f"{k}={v}" for k, v in ov.items()])
    said: list[str] = []
    summary = run_training(cfg, log=said.append, progress=False)
    parts = summary["val_loss_components"]
    assert set(parts) == {"a", "b"} and all(np.isfinite(v) for v in parts.values())
    assert min(parts.values()) - 1e-6 <= summary["val_loss"] <= max(parts.values()) + 1e-6
    assert any("val_loss" in m and "(a " in m and ", b " in m for m in said), said[-5:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["val_loss_components"] == pytest.approx(parts)
    changed = load_config(None, [f"{k}={v}" for k, v in {**ov, "data.weights": "[1,1]", "steps": 8}.items()])
    with pytest.raises(ConfigError, match=r"data.weights"):
        run_training(changed, resume=True, log=lambda _m: None, progress=False)


@pytest.mark.parametrize("decay", [0, 2])
def test_decay_weights_without_a_decay_phase_are_reported(corpora, tmp_path, decay):
    """With no decay phase the mixture never switches: data.decay_weights were ignored without a word (break
    test 91)."""
    from minicpm4_jax.train.loop import run_training

    cfg = load_config(None, [
        "model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=1",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.max_position_embeddings=64",
        "model.dim_model_base=16", "model.mtp=false", f"data.sources=[{corpora['a']},{corpora['b']}]",
        "data.weights=[3,1]", "data.decay_weights=[1,3]", "data.tokenizer_vocab_size=300", "data.seq_len=16",
        "data.batch_size=4", "data.val_fraction=0.1", f"data.cache_dir={corpora['cache']}", "steps=2",
        "optimizer.warmup_steps=0", f"optimizer.decay_steps={decay}", "eval_batches=1", "sample_tokens=0",
        f"out_dir={tmp_path / 'run'}", "tensorboard=false"])
    said: list[str] = []
    run_training(cfg, log=said.append, progress=False)
    warned = [m for m in said if "data.decay_weights=[1.0, 3.0] never apply" in m]
    assert len(warned) == (1 if decay == 0 else 0), said


@pytest.mark.parametrize("ov", [
    [],
    ["optimizer.decay_steps=30"],
    ["qat.enabled=true", "qat.token_share=0.5"],
    ["qat.enabled=true", "qat.token_share=0.05", "qat.warmup_steps=2"],
    ["qat.enabled=true", "qat.token_share=0.5", "optimizer.decay_steps=30"],
], ids=["wsd", "wsd_decay_steps", "qat_fraction", "qat_inside_decay", "qat_decay_steps"])
def test_decay_weights_start_at_the_first_step_of_the_final_decay(ov):
    # the loop switches a mixture to data.decay_weights at decay_start_step(cfg): the step from which the learning
    # rate only falls. With QAT the last decay is the QAT stage's own, decay_fraction x the QAT steps (the switch
    # came 50 steps early here: at steps - decay_fraction x steps)
    from minicpm4_jax.train.step import decay_start_step, lr_schedule

    cfg = load_config("cpu_tiny", ["steps=1000", "optimizer.warmup_steps=10", "optimizer.decay_fraction=0.1",
                                   "optimizer.decay_steps=null"] + ov)
    lr = np.asarray(lr_schedule(cfg)(np.arange(cfg.steps)))
    rising_or_flat = np.nonzero(lr[1:] >= lr[:-1])[0] + 1
    start = int(rising_or_flat[-1])  # lr(start) = peak, strictly falling after
    assert np.all(np.diff(lr[start:]) < 0) and start < cfg.steps - 1
    assert decay_start_step(cfg) == start


@pytest.mark.parametrize("text,split", [("zulu1 zebra2\n", "train"), (None, "validation")])
def test_a_component_too_short_for_a_window_is_named(corpora, tmp_path, text, split):
    # the split check ran per component but its message named no source: which of the mixture's entries is short?
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if text is not None:
        (tiny / "x.txt").write_text(text)
    else:  # one document: enough training text, a validation tail of a few characters
        (tiny / "x.txt").write_text(" ".join(["zulu1 zebra2"] * 40) + "\n")
    cfg = _cfg(corpora, sources=(str(corpora["a"]), str(tiny)), val_fraction=0.01)
    with pytest.raises(ConfigError, match=rf"^mixture component 'tiny' \({tiny}\): the {split} split has \d+ tokens, "
                                          r"fewer than one window of data.seq_len\+1=17; [^\n]*$"):
        D.prepare_data(cfg, log=lambda _m: None)


def test_a_qat_run_that_continues_the_data_order_switches_at_its_own_decay(corpora, tmp_path, monkeypatch):
    # qat.init_from + qat.continue_data: the QAT run reads global batch 8 + s at its step s. The mixture switched at
    # global batch decay_start_step(qat run) = 4, so all 6 steps (global batches 8..13) were served decay weights
    # instead of the first 4; its resume must switch at the same batch
    import os
    import signal

    from minicpm4_jax.train import loop

    which = _classifier(D.prepare_data(_cfg(corpora), log=lambda _m: None))
    served: dict[int, int] = {}  # global batch -> the component of its first row (read ahead by the prefetch too)
    rb = D._row_batches_class()
    real = rb.__getitem__

    def record(self, index):
        x = real(self, index)
        if isinstance(index, int):
            served[index] = which(np.asarray(x["input_ids"])[0])
        return x

    monkeypatch.setattr(rb, "__getitem__", record)
    ov = {"model.vocab_size": 512, "model.hidden_size": 64, "model.intermediate_size": 128,
          "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
          "model.max_position_embeddings": 64, "model.dim_model_base": 16, "model.mtp": "false",
          "data.sources": f"[{corpora['a']},{corpora['b']}]", "data.weights": "[1,0]", "data.decay_weights": "[0,1]",
          "data.tokenizer_vocab_size": 300, "data.seq_len": 16, "data.batch_size": 4, "data.val_fraction": 0.1,
          "data.cache_dir": str(corpora["cache"]), "steps": 8, "optimizer.warmup_steps": 1,
          "optimizer.decay_steps": 2, "log_every": 100, "eval_every": 100, "eval_batches": 1,
          "checkpoint.save_every": 100, "out_dir": str(tmp_path / "hp"), "sample_tokens": 0, "tensorboard": False}
    run = loop.run_training
    run(load_config(None, [f"{k}={v}" for k, v in ov.items()]), log=lambda _m: None, progress=False)
    qat = {**ov, "out_dir": str(tmp_path / "qat"), "steps": 6, "qat.enabled": "true",
           "qat.init_from": str(tmp_path / "hp"), "checkpoint.save_every": 2}
    cfg = load_config(None, [f"{k}={v}" for k, v in qat.items()])

    def stop_at_3(step, state):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return state

    said: list[str] = []
    s1 = run(cfg, log=said.append, progress=False, step_hook=stop_at_3)
    assert any("data order continues from step 8" in m for m in said), said
    assert s1["stop_reason"] == "signal" and s1["step"] == 4
    run(cfg, resume=True, log=lambda _m: None, progress=False)
    # steps 0..3 before the QAT run's decay (steps 4, 5: decay_steps 2), then the decay weights; the resume from
    # step 4 continues there
    assert [served[i] for i in range(8, 14)] == [0, 0, 0, 0, 1, 1], served


def test_a_weight_below_the_schedules_resolution_is_reported(corpora):
    said: list[str] = []
    D.prepare_data(_cfg(corpora, weights=(1.0, 1e-9), decay_weights=(1.0, 1.0)), log=said.append)
    warn = [m for m in said if m.startswith("warning:")]
    assert warn == [f"warning: data.weights: component(s) 'b' get less than 1/{D.MIXTURE_PERIOD} of the windows and are "
                    "never served; raise their weights or drop them"], said
