"""InfLLM v2 wired into the model: dispatch, dense equality, whole-model causality, HF config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig, SparseConfig, validate_model
from minicpm4_jax.nn import MiniCPM4

BASE = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, dim_model_base=16, scale_emb=12.0)


def _with(model: MiniCPM4, cfg: ModelConfig) -> MiniCPM4:
    return nnx.merge(nnx.graphdef(MiniCPM4(cfg, rngs=nnx.Rngs(1))), nnx.state(model))


@pytest.fixture(scope="module")
def dense_model():
    return MiniCPM4(BASE, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_sparse_equals_dense_when_selection_covers_prefix(dense_model, variant):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 300)), jnp.int32)
    sp = SparseConfig(window_size=128, topk=64, dense_len=-1, variant=variant)
    sparse = _with(dense_model, dataclasses.replace(BASE, attention="infllmv2", sparse_config=sp))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(sparse, ids)), np.asarray(dense_model(ids)),
                               atol=1e-5, rtol=1e-5)


def test_dense_fallback_below_dense_len(dense_model):
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 100, (1, 200)), jnp.int32)
    sp = SparseConfig(window_size=64, topk=2, dense_len=256)  # 200 < 256: dense, bit-identical
    sparse = _with(dense_model, dataclasses.replace(BASE, attention="infllmv2", sparse_config=sp))
    np.testing.assert_array_equal(np.asarray(sparse(ids)), np.asarray(dense_model(ids)))


def test_model_causality_sparse_forced(dense_model):
    """B02 for the whole model with the sparse path forced and a selection that really drops blocks."""
    sp = SparseConfig(window_size=64, topk=2, dense_len=-1)
    sparse = _with(dense_model, dataclasses.replace(BASE, attention="infllmv2", sparse_config=sp))
    f = jax.jit(lambda m, x: m(x))
    rng = np.random.default_rng(2)
    x = rng.integers(0, 100, (1, 320))
    ref_dense = np.asarray(dense_model(jnp.asarray(x, jnp.int32)))
    a = np.asarray(f(sparse, jnp.asarray(x, jnp.int32)))
    assert np.abs(a - ref_dense).max() > 1e-4  # the sparse path really differs from dense here
    for t in (0, 31, 47, 63, 100, 255):
        x2 = x.copy()
        x2[0, t + 1:] = rng.integers(0, 100, 319 - t)
        b = np.asarray(f(sparse, jnp.asarray(x2, jnp.int32)))
        np.testing.assert_array_equal(a[0, : t + 1], b[0, : t + 1])


def test_sparse_model_gradients_finite(dense_model):
    sp = SparseConfig(window_size=64, topk=2, dense_len=-1)
    cfg = dataclasses.replace(BASE, attention="infllmv2", sparse_config=sp)
    sparse = _with(dense_model, cfg)
    gd, params = nnx.split(sparse, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 100, (1, 257)), jnp.int32)

    def loss(p):
        logits = nnx.merge(gd, p)(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))

    g = jax.grad(loss)(params)
    leaves = jax.tree.leaves(g)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
    assert float(jnp.abs(g["layers"]["q_proj"][...]).max()) > 0


def test_pallas_impl_limits_are_clear_errors(dense_model, tmp_path, capsys):
    # dense attention has no Pallas kernel: the one validation function rejects it with the dispatch's message
    dense_pallas = dataclasses.replace(BASE, attention_impl="pallas")
    with pytest.raises(ConfigError, match="attention_impl='pallas' has no dense kernel") as v:
        validate_model(dense_pallas)
    # a model built from an unvalidated config still fails clearly in the dispatch, with the same message
    m = _with(dense_model, dense_pallas)
    with pytest.raises(ConfigError) as d:
        m(jnp.zeros((1, 8), jnp.int32))
    assert str(d.value) == str(v.value)
    # the InfLLM v2 kernels need power-of-two blocks
    bad = dataclasses.replace(BASE, attention="infllmv2", attention_impl="pallas",
                              sparse_config=SparseConfig(kernel_size=48, kernel_stride=16, block_size=48,
                                                         window_size=96, dense_len=-1))
    with pytest.raises(ConfigError, match="block_size=48: the Pallas kernels need a power of two"):
        validate_model(bad)
    # `minicpm4 train ... model.attention_impl=pallas` on a dense preset fails in validation, writing nothing
    from minicpm4_jax.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--config", "cpu_tiny", "--no-progress", f"out_dir={out}", "model.attention_impl=pallas"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.attention_impl='pallas' has no dense kernel" in err[0], err
    assert not out.exists()


def test_sparse_config_hf_round_trip_and_default_variant():
    cfg = dataclasses.replace(BASE, attention="infllmv2", sparse_config=SparseConfig(variant="gen1", topk=8))
    validate_model(cfg)
    hf = cfg.to_hf_config()
    assert hf["sparse_config"]["variant"] == "gen1" and hf["sparse_config"]["topk"] == 8
    assert ModelConfig.from_hf_config(hf) == cfg
    # an official config.json's sparse_config has no variant key: that means MiniCPM4.1 (gen2)
    official = {k: v for k, v in hf["sparse_config"].items() if k not in ("variant", "kernel_offby1_quirk")}
    imported = ModelConfig.from_hf_config({**hf, "sparse_config": official})
    assert imported.sparse_config.variant == "gen2" and imported.attention == "infllmv2"
