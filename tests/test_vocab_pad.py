"""Vocabulary padding (issue 5): ``model.vocab_pad_multiple`` pads the embedding/head rows, the padding is out
of the loss and of every prediction, stays zero through training, and is never exported."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from test_train import cache_dir, corpus, tiny_overrides  # noqa: F401

from minicpm4_jax.cli import main
from minicpm4_jax.config import ConfigError, ModelConfig, load_config
from minicpm4_jax.nn import MiniCPM4
from minicpm4_jax.train.checkpoint import load_params_for_inference
from minicpm4_jax.train.step import next_token_loss

BASE = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, dim_model_base=16, tie_word_embeddings=False)


def _padded_copy(model: MiniCPM4, multiple: int) -> MiniCPM4:
    """A padded model holding ``model``'s weights (padding rows zero)."""
    cfg = dataclasses.replace(model.cfg, vocab_pad_multiple=multiple)
    padded = MiniCPM4(cfg, rngs=nnx.Rngs(1))
    src, dst = nnx.state(model, nnx.Param), nnx.state(padded, nnx.Param)

    def put(s, d):
        return d.at[tuple(slice(0, n) for n in s.shape)].set(s) if s.shape != d.shape else s

    nnx.update(padded, jax.tree.map(put, src, dst))
    return padded


@pytest.mark.parametrize("tied", [True, False])
def test_padding_is_out_of_logits_loss_and_gradients(tied):
    cfg = dataclasses.replace(BASE, tie_word_embeddings=tied)
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    padded = _padded_copy(model, 64)
    assert padded.cfg.padded_vocab_size == 128 and padded.embed_tokens.embedding[...].shape == (128, 32)
    fresh = MiniCPM4(padded.cfg, rngs=nnx.Rngs(3))
    assert not np.any(np.asarray(fresh.embed_tokens.embedding[...][100:]))  # padding starts at zero
    if not tied:
        assert not np.any(np.asarray(fresh.lm_head[...][:, 100:]))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 17)), jnp.int32)
    lp, lu = padded(ids[:, :-1]), model(ids[:, :-1])
    assert lp.shape[-1] == 128 and bool(jnp.all(jnp.isneginf(lp[..., 100:])))
    np.testing.assert_array_equal(np.asarray(lp[..., :100]), np.asarray(lu))
    np.testing.assert_allclose(float(next_token_loss(lp, ids[:, 1:])), float(next_token_loss(lu, ids[:, 1:])),
                               rtol=1e-6)

    def loss(p):
        return next_token_loss(nnx.merge(nnx.graphdef(padded), p)(ids[:, :-1]), ids[:, 1:])

    g = jax.grad(loss)(nnx.state(padded, nnx.Param))
    assert not np.any(np.asarray(g["embed_tokens"]["embedding"][...][100:]))
    if not tied:
        assert not np.any(np.asarray(g["lm_head"][...][:, 100:]))
    assert np.any(np.asarray(g["embed_tokens"]["embedding"][...][:100]))


def test_bad_multiple_is_one_line():
    with pytest.raises(ConfigError, match="vocab_pad_multiple=0"):
        load_config("cpu_tiny", ["model.vocab_pad_multiple=0"])


def test_trained_padded_checkpoint_exports_without_padding(corpus, cache_dir, tmp_path):  # noqa: F811
    from minicpm4_jax.train.loop import run_training

    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(corpus, cache_dir, run, **{
        "model.vocab_size": 500, "model.vocab_pad_multiple": 128, "model.tie_word_embeddings": "false",
        "steps": 4, "eval_every": 4, "checkpoint.save_every": 4, "sample_tokens": 0, "tensorboard": "false"}))
    summary = run_training(cfg, progress=False, handle_signals=False, log=lambda _s: None)
    assert np.isfinite(summary["val_loss"])
    _, model = load_params_for_inference(run)
    emb, head = np.asarray(model.embed_tokens.embedding[...]), np.asarray(model.lm_head[...])
    assert emb.shape == (512, 64) and head.shape == (64, 512)
    assert not emb[500:].any() and not head[:, 500:].any()  # zero gradient + decoupled decay keep them zero
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (500, 64)
    assert tensors["lm_head.weight"].shape == (500, 64)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], emb[:500])
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    _, back = load_params_for_inference(tmp_path / "back")
    assert back.cfg.vocab_size == 500 and back.cfg.padded_vocab_size == 500
    ids = jnp.asarray([[3, 17, 250, 499, 42]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)[..., :500]))
