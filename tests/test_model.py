"""Dense MiniCPM4 model: RMSNorm, LongRoPE, μP sites, GQA attention, scan/remat, causality.

The reference here is an independent NumPy float64 forward written from spec §2 (no code shared
with the model), so a wrong μP site, RoPE layout or GQA grouping shows up as a mismatch.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ModelConfig, RopeScalingConfig
from minicpm4_jax.nn import MiniCPM4
from minicpm4_jax.nn.layers import rms_norm
from minicpm4_jax.nn.rope import attention_scaling, inv_frequencies, longrope_factors, rope_tables
from minicpm4_jax.ops.attention_ref import dense_attention


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, scale_emb=3.0,
        dim_model_base=16, scale_depth=1.7, initializer_range=0.1, tie_word_embeddings=True,
        rope_scaling=RopeScalingConfig(short_factor=tuple(np.linspace(1.0, 9.0, 4)),
                                       long_factor=tuple(np.linspace(1.0, 9.0, 4)),
                                       original_max_position_embeddings=64),
    )
    base.update(kw)
    return ModelConfig(**base)


def np_params(model: MiniCPM4) -> dict:
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def np_forward(p: dict, cfg: ModelConfig, ids: np.ndarray) -> np.ndarray:
    """Independent float64 forward of spec §2 (one sequence)."""
    t = ids.shape[0]
    d, nq, nkv = cfg.resolved_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    g = nq // nkv

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w

    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    rs = cfg.rope_scaling
    ext = np.ones(d // 2) if rs is None else np.asarray(
        rs.long_factor if cfg.max_position_embeddings > rs.original_max_position_embeddings else rs.short_factor)
    scale = 1.0
    if rs is not None and cfg.max_position_embeddings > rs.original_max_position_embeddings:
        o = rs.original_max_position_embeddings
        scale = math.sqrt(1 + math.log(cfg.max_position_embeddings / o) / math.log(o))
    ang = np.arange(t)[:, None] * inv[None, :] / ext[None, :]
    cos, sin = np.cos(ang) * scale, np.sin(ang) * scale

    def rope(x):  # x [t, h, d], pairs (i, i + d/2)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    emb = p["embed_tokens"]["embedding"]
    x = emb[ids] * cfg.scale_emb
    res = cfg.scale_depth / math.sqrt(cfg.num_hidden_layers)
    L = p["layers"]
    for li in range(cfg.num_hidden_layers):
        h = norm(x, L["input_layernorm"][li])
        q = rope(np.einsum("th,hnd->tnd", h, L["q_proj"][li]))
        k = rope(np.einsum("th,hnd->tnd", h, L["k_proj"][li]))
        v = np.einsum("th,hnd->tnd", h, L["v_proj"][li])
        out = np.zeros((t, nq, d))
        for j in range(nq):
            kv = j // g
            logits = q[:, j] @ k[:, kv].T / math.sqrt(d)
            logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, j] = w @ v[:, kv]
        x = x + np.einsum("tnd,ndh->th", out, L["o_proj"][li]) * res
        h = norm(x, L["post_attention_layernorm"][li])
        gt = h @ L["gate_proj"][li]
        m = (gt / (1 + np.exp(-gt))) * (h @ L["up_proj"][li])
        x = x + (m @ L["down_proj"][li]) * res
    x = norm(x, p["norm"]) / (cfg.hidden_size / cfg.dim_model_base)
    head = emb.T if cfg.tie_word_embeddings else p["lm_head"]
    return x @ head


def perturbed_model(cfg: ModelConfig, seed: int = 0) -> MiniCPM4:
    """A model whose norm weights are random (so a dropped norm weight cannot hide)."""
    model = MiniCPM4(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for name in ("input_layernorm", "post_attention_layernorm"):
        var = getattr(model.layers, name)
        var[...] = jnp.asarray(rng.uniform(0.5, 1.5, var.shape), jnp.float32)
    model.norm[...] = jnp.asarray(rng.uniform(0.5, 1.5, model.norm.shape), jnp.float32)
    return model


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"tie_word_embeddings": False},
        {"max_position_embeddings": 256},  # long factors + attention scaling != 1
        {"num_key_value_heads": 6, "scan_layers": False},
        {"rope_scaling": None, "remat": "full"},
    ],
    ids=["tied-gqa", "untied", "scaled-rope", "mha-unscanned", "plain-rope-remat"],
)
def test_forward_matches_numpy_reference(kw):
    cfg = tiny_cfg(**kw)
    model = perturbed_model(cfg)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 70))
    got = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))
    p = np_params(model)
    for b in range(2):
        ref = np_forward(p, cfg, ids[b])
        np.testing.assert_allclose(got[b], ref, atol=2e-5, rtol=1e-4)


def test_mup_sites_each_applied_once():
    """B10: each μP multiplier scales the output exactly as the formula says, once."""
    cfg = tiny_cfg(num_hidden_layers=1)
    model = perturbed_model(cfg)
    # zero the residual branches: hidden = norm(scale_emb * E[ids]); logits = hidden/wm @ E^T
    model.layers.o_proj[...] = jnp.zeros_like(model.layers.o_proj[...])
    model.layers.down_proj[...] = jnp.zeros_like(model.layers.down_proj[...])
    ids = jnp.arange(16, dtype=jnp.int32)[None]
    e = np.asarray(model.embed_tokens.embedding[...], np.float64)
    x = e[np.arange(16)] * cfg.scale_emb
    w = np.asarray(model.norm[...], np.float64)
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w
    np.testing.assert_allclose(np.asarray(model.hidden_states(ids))[0], h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model(ids))[0], (h / (48 / 16)) @ e.T, rtol=1e-5, atol=1e-5)
    # doubling dim_model_base doubles the logits exactly (the head divisor is hidden/dim_model_base)
    cfg2 = dataclasses.replace(cfg, dim_model_base=32)
    model2 = nnx.merge(nnx.graphdef(MiniCPM4(cfg2, rngs=nnx.Rngs(0))), nnx.state(model))
    np.testing.assert_allclose(np.asarray(model2(ids)), 2 * np.asarray(model(ids)), rtol=1e-6)


def test_residual_scale_value():
    cfg = tiny_cfg(scale_depth=1.4, num_hidden_layers=4)
    assert cfg.residual_scale == pytest.approx(0.7)
    assert cfg.width_mult == 3.0


def test_init_scales_follow_mup():
    cfg = tiny_cfg(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                   dim_model_base=64, vocab_size=2000, num_hidden_layers=2, rope_scaling=None,
                   tie_word_embeddings=False)
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    hidden_std = cfg.initializer_range / math.sqrt(cfg.width_mult)  # 0.05
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        std = float(np.std(np.asarray(getattr(model.layers, name)[...])))
        assert std == pytest.approx(hidden_std, rel=0.05), name
    assert float(np.std(np.asarray(model.embed_tokens.embedding[...]))) == pytest.approx(0.1, rel=0.03)
    assert float(np.std(np.asarray(model.lm_head[...]))) == pytest.approx(0.1, rel=0.03)
    np.testing.assert_array_equal(np.asarray(model.layers.input_layernorm[...]), 1.0)
    np.testing.assert_array_equal(np.asarray(model.norm[...]), 1.0)


def test_params_carry_logical_axes():
    model = MiniCPM4(tiny_cfg(tie_word_embeddings=False), rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(specs)}
    assert tuple(flat["layers/q_proj"].get_value()) == ("layers", "embed", "q_heads", "head_dim")
    assert tuple(flat["embed_tokens/embedding"].get_value()) == ("vocab", "embed")
    assert tuple(flat["lm_head"].get_value()) == ("embed", "vocab")
    assert tuple(flat["norm"].get_value()) == ("norm",)


def test_rms_norm_formula():
    x = np.random.default_rng(0).normal(size=(3, 5, 16)).astype(np.float32) * 3
    w = np.random.default_rng(1).uniform(0.5, 2, size=(16,)).astype(np.float32)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), ref, rtol=1e-5)
    # bf16 input: statistics in fp32, output bf16
    y = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1e-6)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-2)


def _rope_cfg(max_pos: int) -> ModelConfig:
    return ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_pos,
                       rope_scaling=RopeScalingConfig(short_factor=(1.0,) * 8, long_factor=(4.0,) * 8,
                                                      original_max_position_embeddings=64))


def test_longrope_switch_boundary_b07():
    """B07: dynamic rule (transformers/llama.cpp): long iff length > original; no crash at 63/64/65."""
    cfg = _rope_cfg(256)
    assert np.all(longrope_factors(cfg, 63) == 1.0)
    assert np.all(longrope_factors(cfg, 64) == 1.0)
    assert np.all(longrope_factors(cfg, 65) == 4.0)
    # static rule (the model's): chosen once from the configured lengths
    assert np.all(longrope_factors(cfg) == 4.0)
    assert np.all(longrope_factors(_rope_cfg(64)) == 1.0)
    for n in (63, 64, 65):
        cos, sin = rope_tables(jnp.arange(n)[None], cfg, seq_len=n)
        ext = 1.0 if n <= 64 else 4.0
        ang = np.arange(n)[:, None] * inv_frequencies(16, 10000.0)[None] / ext
        s = attention_scaling(cfg)
        np.testing.assert_allclose(np.asarray(cos[0, :, :8]), np.cos(ang) * s, atol=1e-5)


def test_longrope_tables_closed_form_b09():
    """B09: tables equal the closed form incl. mscale sqrt(1+ln4/ln64) on cos and sin."""
    cfg = _rope_cfg(256)
    s = attention_scaling(cfg)
    assert s == pytest.approx(1.1547005383792515, rel=1e-9)
    assert attention_scaling(_rope_cfg(64)) == 1.0
    pos = jnp.asarray([[0, 1, 63, 200]])
    cos, sin = rope_tables(pos, cfg)
    inv = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    ang = np.asarray([0, 1, 63, 200])[:, None] * inv[None] / 4.0
    np.testing.assert_allclose(np.asarray(cos[0]), np.concatenate([np.cos(ang)] * 2, -1) * s, atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin[0]), np.concatenate([np.sin(ang)] * 2, -1) * s, atol=2e-5)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    c_plain, _ = rope_tables(pos, plain)
    # at position 200 the angle is 4x smaller than plain RoPE for every frequency
    np.testing.assert_allclose(np.asarray(c_plain[0, 3, :8]), np.cos(200 * inv), atol=2e-5)
    np.testing.assert_allclose(np.asarray(cos[0, 3, :8]) / s, np.cos(200 * inv / 4.0), atol=2e-5)
    assert not np.allclose(np.asarray(cos[0, 3, :8]) / s, np.asarray(c_plain[0, 3, :8]))


def test_dense_attention_gqa_against_naive():
    rng = np.random.default_rng(0)
    b, t, nq, nkv, d = 2, 9, 6, 2, 8
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(b, t, nq, d), (b, t, nkv, d), (b, t, nkv, d)])
    pos = np.broadcast_to(np.arange(t), (b, t))
    out = np.asarray(dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                     q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos)))
    for h in range(nq):
        kv = h // (nq // nkv)
        lg = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kv]) / math.sqrt(d)
        lg = np.where(np.tril(np.ones((t, t), bool)), lg, -np.inf)
        w = np.exp(lg - lg.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[:, :, h], np.einsum("bts,bsd->btd", w, v[:, :, kv]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t_cut", [0, 31, 47, 63])
def test_causality_future_tokens_do_not_leak(t_cut):
    """B02 for the dense path: logits at positions <= t are bit-identical when later tokens change."""
    cfg = tiny_cfg()
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(t_cut)
    x = rng.integers(0, cfg.vocab_size, size=(1, 64))
    x2 = x.copy()
    x2[0, t_cut + 1:] = rng.integers(0, cfg.vocab_size, size=64 - t_cut - 1)
    f = jax.jit(lambda m, i: m(i))
    a, b = np.asarray(f(model, jnp.asarray(x, jnp.int32))), np.asarray(f(model, jnp.asarray(x2, jnp.int32)))
    np.testing.assert_array_equal(a[0, : t_cut + 1], b[0, : t_cut + 1])
    if t_cut < 63:
        assert not np.array_equal(a[0, t_cut + 1:], b[0, t_cut + 1:])


def test_bf16_compute_close_to_fp32():
    cfg = tiny_cfg()
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, size=(1, 32)), jnp.int32)
    ref = np.asarray(model(ids))
    m16 = nnx.merge(nnx.graphdef(MiniCPM4(dataclasses.replace(cfg, dtype="bfloat16"), rngs=nnx.Rngs(1))),
                    nnx.state(model))
    out = m16(ids)
    assert out.dtype == jnp.float32  # logits always fp32
    assert m16.embed_tokens.embedding[...].dtype == jnp.float32  # params stay fp32
    np.testing.assert_allclose(np.asarray(out), ref, atol=0.1 * np.abs(ref).max())


def test_tree_mode_smoke(tmp_path):
    """The model builds and runs under NNX tree mode (FLIP 5310): no shared Variables, no sow."""
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from flax import nnx\n"
        "nnx.set_graph_mode(False)\n"
        "from minicpm4_jax.config import ModelConfig\n"
        "from minicpm4_jax.nn import MiniCPM4\n"
        "cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
        "                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, dim_model_base=8)\n"
        "m = MiniCPM4(cfg, rngs=nnx.Rngs(0))\n"
        "y = jax.jit(lambda m, x: m(x))(m, jnp.zeros((1, 8), jnp.int32))\n"
        "assert y.shape == (1, 8, 50) and bool(jnp.all(jnp.isfinite(y)))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
