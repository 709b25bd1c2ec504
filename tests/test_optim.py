"""WSD schedule (field fault B12), μP learning-rate groups and init scales, weight-decay mask."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from minicpm4_jax.config import OptimizerConfig, load_config
from minicpm4_jax.nn.model import MiniCPM4
from minicpm4_jax.train.optim import decay_steps_of, make_optimizer, param_group, param_labels, wsd_schedule

TINY = [
    "model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.max_position_embeddings=64",
    "model.dim_model_base=16", "data.seq_len=32", "data.batch_size=4", "data.tokenizer_vocab_size=512", "steps=8",
    "optimizer.warmup_steps=0", "optimizer.decay_steps=0",
]


def _b12(style: str, **kw) -> OptimizerConfig:
    base = dict(learning_rate=1.0, warmup_steps=100, decay_steps=100, min_lr_ratio=0.1, decay_style=style)
    base.update(kw)
    return OptimizerConfig(**base)


@pytest.mark.parametrize("style", ["exponential", "linear"])
def test_wsd_phase_boundaries_b12(style):
    n = 1000
    sched = wsd_schedule(_b12(style), n)
    steps = np.arange(0, 1201)
    lr = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps)))
    # documented warmup start: peak * 1 / W
    assert lr[0] == pytest.approx(0.01, rel=1e-6)
    assert np.all(np.diff(lr[:100]) > 0)
    assert lr[99] == pytest.approx(1.0, rel=1e-6)
    assert lr[100] == pytest.approx(1.0, rel=1e-6)
    assert np.all(lr[100:901] == lr[100])
    assert lr[900] == pytest.approx(1.0, rel=1e-6)
    decay = lr[900:1001]
    assert np.all(np.diff(decay) <= 0), "LR rose during the decay phase"
    assert np.all(np.diff(decay) < 0)
    assert lr[1000] == pytest.approx(0.1, rel=1e-6)
    assert np.all(lr[1000:] == pytest.approx(0.1, rel=1e-6))
    assert float(sched(10**6)) == pytest.approx(0.1, rel=1e-6)
    # normalised by the decay length: half-way through the decay
    mid = 0.1**0.5 if style == "exponential" else 1 - 0.9 * 0.5
    assert lr[950] == pytest.approx(mid, rel=1e-5)
    # eager python ints agree with the jitted values
    for s in (0, 99, 100, 900, 950, 999, 1000, 1001):
        assert float(sched(s)) == pytest.approx(float(lr[s]), rel=1e-6)


@pytest.mark.parametrize("style", ["exponential", "linear"])
def test_wsd_resume_and_decay_fraction(style):
    n = 1000
    a = wsd_schedule(_b12(style), n)
    # decay given as a fraction gives the same schedule
    b = wsd_schedule(_b12(style, decay_steps=None, decay_fraction=0.1), n)
    assert decay_steps_of(_b12(style, decay_steps=None, decay_fraction=0.1), n) == 100
    # "resumed at 950": a fresh schedule, driven by a restored optax count, gives identical LRs
    tx = optax.scale_by_learning_rate(b)
    state = tx.init(jnp.zeros(()))
    state = jax.tree.map(lambda x: jnp.full_like(x, 950) if x.dtype == jnp.int32 else x, state)
    for s in range(950, 1003):
        upd, state = tx.update(jnp.ones(()), state)
        assert float(-upd) == float(a(s)), s


def _tiny_params(cfg):
    model = MiniCPM4(cfg.model, rngs=nnx.Rngs(params=0))
    _, params = nnx.split(model, nnx.Param)
    return params


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_param_groups_by_path():
    cfg = load_config(None, TINY)
    params = _tiny_params(cfg)
    labels = {k: v for k, v in _leaves(jax.tree.map(lambda _: 0, params)).items()}
    groups = {jax.tree_util.keystr(p): param_group(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert set(groups) == set(labels)
    for k, g in groups.items():
        if any(n in k for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            assert g == "hidden", k
        elif "layernorm" in k or k.startswith("['norm']"):
            assert g == "norm", k
        else:
            assert g == "embedding", k
    assert len(jax.tree.leaves(param_labels(params))) == len(jax.tree.leaves(params))
    with pytest.raises(ValueError, match="no μP group"):
        param_group((jax.tree_util.DictKey("mystery_weight"),))


def _is_hidden_matrix(key: str) -> bool:
    """Whether the keystr ``key`` names a μP hidden matrix (spec §3.2: q, k, v, o, gate, up, down and the MTP fc)."""
    return "_proj" in key or key.endswith("['fc'].value")


@pytest.mark.parametrize("tie,mup,mtp", [(True, True, False), (False, True, False), (True, False, False),
                                         (False, False, False), (True, True, True)])
def test_mup_learning_rates_through_updates(tie, mup, mtp):
    """First AdamW step on all-ones gradients: |update| = group LR (Adam normalises the gradient). With the MTP draft
    head its fc (2H -> H) and its layer's matrices are hidden matrices too (break test, helper 99: fc put in the
    embedding group, at width_mult x its learning rate, passed every test)."""
    cfg = load_config(None, TINY + [f"model.tie_word_embeddings={str(tie).lower()}", f"optimizer.mup={str(mup).lower()}",
                                    "optimizer.weight_decay=0.0", "optimizer.learning_rate=0.01",
                                    f"model.mtp={str(mtp).lower()}"])
    assert cfg.model.width_mult == 4.0
    params = _tiny_params(cfg)
    tx = make_optimizer(cfg.model, cfg.optimizer, cfg.steps)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    # clipping scales every gradient by the same factor; Adam's first step removes it again
    updates, _ = jax.jit(tx.update)(grads, state, params)
    hidden_lr = 0.01 / 4.0 if mup else 0.01
    seen = set()
    for k, u in _leaves(updates).items():
        group = "hidden" if _is_hidden_matrix(k) else ("norm" if "norm" in k else "embedding")
        seen.add(group)
        want = hidden_lr if group == "hidden" else 0.01
        np.testing.assert_allclose(u, -want, rtol=1e-4, err_msg=k)
    assert seen == {"hidden", "norm", "embedding"}
    if mtp:
        assert "['mtp']['fc'].value" in _leaves(updates) and "['mtp']['input_norm1'].value" in _leaves(updates)
    if not tie:
        assert any("lm_head" in k for k in _leaves(updates))


def test_no_weight_decay_on_norms():
    """Zero gradients: the only update is decoupled decay -lr_group * wd * p, absent on norm weights."""
    cfg = load_config(None, TINY + ["model.tie_word_embeddings=false", "optimizer.weight_decay=0.1",
                                    "optimizer.learning_rate=0.01"])
    params = _tiny_params(cfg)
    tx = make_optimizer(cfg.model, cfg.optimizer, cfg.steps)
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    p = _leaves(params)
    for k, u in _leaves(updates).items():
        if "norm" in k:
            assert np.all(u == 0.0), k
        else:
            lr = 0.01 / 4.0 if "_proj" in k else 0.01
            np.testing.assert_allclose(u, -lr * 0.1 * p[k], rtol=1e-5, atol=1e-12, err_msg=k)


def test_grad_clipping_global_norm():
    cfg = load_config(None, TINY + ["optimizer.grad_clip=1.0", "optimizer.weight_decay=0.0"])
    params = _tiny_params(cfg)
    clip_only = optax.clip_by_global_norm(1.0)
    g = jax.tree.map(lambda x: 10.0 * jnp.ones_like(x), params)
    clipped, _ = clip_only.update(g, clip_only.init(params))
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-5)
    # the optimizer's chain starts with exactly this clipping
    tx = make_optimizer(cfg.model, cfg.optimizer, cfg.steps)
    assert isinstance(tx.init(params)[0], optax.ClipByGlobalNormState)


def test_mup_init_scales():
    """Hidden matrices ~ N(0, init/sqrt(width_mult)); embedding and untied head ~ N(0, init); norms 1."""
    cfg = load_config(None, [
        "model.vocab_size=2048", "model.hidden_size=512", "model.intermediate_size=1024",
        "model.num_hidden_layers=2", "model.num_attention_heads=8", "model.num_key_value_heads=2",
        "model.dim_model_base=64", "model.initializer_range=0.1", "model.tie_word_embeddings=false",
        "model.max_position_embeddings=64", "data.seq_len=32", "data.tokenizer_vocab_size=2048",
        "optimizer.warmup_steps=0", "optimizer.decay_steps=0", "model.mtp=true",
    ])
    assert cfg.model.width_mult == 8.0
    params = _leaves(_tiny_params(cfg))
    assert "['mtp']['fc'].value" in params  # the draft head's 2H -> H matrix: a hidden matrix (spec §3.2)
    hidden_std = 0.1 / math.sqrt(8.0)
    for k, v in params.items():
        if _is_hidden_matrix(k):
            assert v.std() == pytest.approx(hidden_std, rel=0.03), k
            assert abs(v.mean()) < 0.05 * hidden_std, k
        elif "norm" in k:
            assert np.all(v == 1.0), k
        else:
            assert v.std() == pytest.approx(0.1, rel=0.03), k


def test_group_lr_follows_schedule():
    """With warmup, the update size follows the schedule value at the optax count."""
    cfg = load_config(None, TINY + ["optimizer.warmup_steps=4", "optimizer.weight_decay=0.0", "steps=8",
                                    "optimizer.learning_rate=0.02"])
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, decay_steps=2))
    params = _tiny_params(cfg)
    tx = make_optimizer(cfg.model, cfg.optimizer, cfg.steps)
    sched = wsd_schedule(cfg.optimizer, cfg.steps)
    state = tx.init(params)
    ones = jax.tree.map(jnp.ones_like, params)
    for s in range(3):
        upd, state = tx.update(ones, state, params)
        emb = _leaves(upd)["['embed_tokens']['embedding'].value"]
        np.testing.assert_allclose(emb, -float(sched(s)), rtol=1e-4)
