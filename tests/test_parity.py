"""Numerical parity with an independent implementation (issue 2) and the released-config bridges.

The μP scalars are folded into the weights (``minicpm4_jax.convert.llama_fold``) and the result is
loaded into transformers' native ``LlamaForCausalLM`` (longrope, untied head) on CPU PyTorch in the
Python 3.11 side environment (``tests/torch_env.py``). Its float32 logits must match our jitted
float32 JAX logits to <= 1e-4 max abs on random tiny configs: GQA / MHA / MQA, tied and untied
heads, distinct per-frequency LongRoPE factors (short == long), max_position_embeddings equal to
and above original_max_position_embeddings (attention scaling != 1), sequence lengths below, at
and above the original length, random μP scalars and random (non-unit) norm weights.

Every case is written to one directory and the torch side processes all of them in one
subprocess (torch import costs seconds); with pytest-xdist the first worker builds them under a
file lock and the others reuse the result.

Field fault B10 (μP multipliers dropped or applied twice) is covered by distinctive scalars
(scale_emb 3, scale_depth 5, width_mult 7) checked in the folded tensors, by variants that change
one scalar with the same weights, and by mutants (a multiplier applied twice or dropped, RoPE
factors or attention scaling lost) that the parity tolerance must catch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import shared_path
from minicpm4_jax.config import ModelConfig, RopeScalingConfig, load_config, validate_model
from minicpm4_jax.convert import LLAMA_PARAM_MAP, flat_params, fold_to_llama, hf_param_shapes, unfold_from_llama
from minicpm4_jax.nn.model import MiniCPM4
from minicpm4_jax.nn.rope import attention_scaling, inv_frequencies, longrope_factors

TOL = 1e-4
ORIG = 32  # original_max_position_embeddings of the tiny cases: lengths around it are cheap
LENGTHS = (19, ORIG, 45)  # below, at, above the original length
BATCH = 2

# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------


def _factors(n: int, lo: float = 1.0, hi: float = 8.0) -> tuple[float, ...]:
    """Distinct per-frequency divisors lo..hi (geometric, slightly irregular)."""
    base = np.geomspace(lo, hi, n)
    wiggle = 1.0 + 0.01 * np.sin(np.arange(n) * 1.7)
    wiggle[0] = wiggle[-1] = 1.0
    return tuple(float(x) for x in base * wiggle)


def _tiny(seed: int, *, hidden=64, heads=4, kv=2, head_dim=None, layers=2, vocab=101, inter=96,
          max_pos=ORIG, rope=True, tied=True, distinct_lists=False, **mup) -> ModelConfig:
    """A tiny config with random μP scalars (unless given) drawn from ``seed``; ``distinct_lists``: a
    ``short_factor`` unlike ``long_factor`` (released configs have equal lists)."""
    r = np.random.default_rng(1000 + seed)
    d = head_dim or hidden // heads
    rs = None
    if rope:
        f = _factors(d // 2)
        short = _factors(d // 2, 1.0, 2.5)[::-1] if distinct_lists else f
        rs = RopeScalingConfig(short_factor=short, long_factor=f, original_max_position_embeddings=ORIG)
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=max_pos,
        rms_norm_eps=float(r.choice([1e-5, 1e-6])), rope_theta=float(r.choice([10000.0, 500.0])),
        rope_scaling=rs, tie_word_embeddings=tied,
        scale_emb=mup.get("scale_emb", float(np.round(r.uniform(2.0, 14.0), 3))),
        scale_depth=mup.get("scale_depth", float(np.round(r.uniform(0.5, 2.5), 3))),
        dim_model_base=mup.get("dim_model_base", int(r.choice([8, 16, 32]))),
        initializer_range=0.2, dtype="float32", param_dtype="float32", attention_impl="xla",
    )
    validate_model(cfg)
    return cfg


#: name -> (config, fold options). Each runs at LENGTHS.
CASES: dict[str, tuple[ModelConfig, dict]] = {
    "gqa_tied_max_eq_orig": (_tiny(0, heads=4, kv=2, tied=True, max_pos=ORIG), {}),
    "gqa_untied_max_4x": (_tiny(1, heads=4, kv=2, tied=False, max_pos=4 * ORIG), {}),
    "mha_tied_max_2x": (_tiny(2, heads=4, kv=4, tied=True, max_pos=2 * ORIG), {}),
    "mha_untied_max_eq_orig": (_tiny(3, heads=4, kv=4, tied=False, max_pos=ORIG, layers=3), {}),
    "mqa_untied_headdim32_max_3x": (_tiny(4, heads=4, kv=1, head_dim=32, tied=False, max_pos=3 * ORIG, layers=3), {}),
    # transformers derives the attention scaling itself from factor = max/orig (no attention_factor)
    "gqa4_tied_max_8x_derived_scaling": (_tiny(5, heads=8, kv=2, tied=True, max_pos=8 * ORIG),
                                         {"explicit_attention_factor": False}),
    "gqa_untied_plain_rope": (_tiny(6, heads=4, kv=2, tied=False, rope=False, max_pos=64), {}),
    # short_factor != long_factor: the model uses long_factor at every length, transformers would take the short
    # list up to ORIG tokens (19 and 32 here) unless the export writes the used list as both
    "gqa_tied_max_2x_distinct_lists": (_tiny(8, heads=4, kv=2, tied=True, max_pos=2 * ORIG, distinct_lists=True),
                                       {}),
}

# B10: distinctive multipliers 3 (scale_emb), 5 (scale_depth; residual 5/sqrt(4) = 2.5), 7 (width_mult)
_B10 = dict(hidden=56, heads=4, kv=2, layers=4, vocab=97, inter=80, tied=True, max_pos=2 * ORIG)
B10_BASE = _tiny(7, scale_emb=3.0, scale_depth=5.0, dim_model_base=8, **_B10)
B10_VARIANTS = {  # same weights, one scalar changed
    "b10_base": B10_BASE,
    "b10_scale_emb_6": dataclasses.replace(B10_BASE, scale_emb=6.0),
    "b10_scale_depth_10": dataclasses.replace(B10_BASE, scale_depth=10.0),
    "b10_width_mult_14": dataclasses.replace(B10_BASE, dim_model_base=4),
}
B10_LENGTH = 40


def _mutate_double_emb(t, c):
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"] * 3.0


def _mutate_no_residual_scale(t, c):
    for k in t:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = t[k] / B10_BASE.residual_scale


def _mutate_head_unscaled(t, c):
    t["lm_head.weight"] = t["lm_head.weight"] * B10_BASE.width_mult


def _mutate_plain_rope(t, c):
    c["rope_scaling"] = None


def _mutate_attention_factor_one(t, c):  # export.md §1.3 pitfall: "factor": 1.0, no attention_factor
    c["rope_scaling"]["factor"] = 1.0
    c["rope_scaling"].pop("attention_factor", None)


#: name -> (source case, mutation of (tensors, config)); each must MISS parity by far.
MUTANTS = {
    "mut_scale_emb_twice": ("b10_base", _mutate_double_emb),
    "mut_residual_scale_dropped": ("b10_base", _mutate_no_residual_scale),
    "mut_head_divisor_dropped": ("b10_base", _mutate_head_unscaled),
    "mut_rope_factors_dropped": ("gqa_untied_max_4x", _mutate_plain_rope),
    "mut_attention_scaling_one": ("gqa_untied_max_4x", _mutate_attention_factor_one),
}

# ------------------------------------------------------------------------------------------------
# JAX side
# ------------------------------------------------------------------------------------------------


def _build_model(cfg: ModelConfig, seed: int) -> MiniCPM4:
    """Random init, then norm weights multiplied by U(0.5, 1.5) so a norm bug cannot hide."""
    model = MiniCPM4(cfg, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(params)
    r = np.random.default_rng(seed)
    pure["norm"] = pure["norm"] * r.uniform(0.5, 1.5, pure["norm"].shape).astype(np.float32)
    for nm in ("input_layernorm", "post_attention_layernorm"):
        w = pure["layers"][nm]
        pure["layers"][nm] = w * r.uniform(0.5, 1.5, w.shape).astype(np.float32)
    nnx.replace_by_pure_dict(params, pure)
    nnx.update(model, params)
    return model


def _load_params(model: MiniCPM4, flat: dict[str, np.ndarray]) -> None:
    params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(params)

    def put(d, path, v):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = jnp.asarray(v)

    for k, v in flat.items():
        put(pure, k.split("/"), v)
    nnx.replace_by_pure_dict(params, pure)
    nnx.update(model, params)


def _jax_logits(model: MiniCPM4, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids):
        return nnx.merge(graphdef, state)(ids)

    return {k: np.asarray(fwd(state, jnp.asarray(v, jnp.int32))) for k, v in inputs.items()}


def _inputs(cfg: ModelConfig, lengths, seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {f"T{t}": r.integers(0, cfg.vocab_size, (BATCH, t)).astype(np.int32) for t in lengths}


def _write_case(d: Path, tensors: dict[str, np.ndarray], hf_cfg: dict, inputs: dict, jax_logits: dict) -> None:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_cfg, indent=1))
    np.savez(d / "inputs.npz", **inputs)
    np.savez(d / "jax_logits.npz", **jax_logits)


def _build_all(root: Path) -> list[Path]:
    """Write every case (weights, config, inputs, JAX logits) under ``root``; return the case dirs."""
    dirs: list[Path] = []
    sources: dict[str, tuple[dict, dict]] = {}
    for i, (name, (cfg, opts)) in enumerate(CASES.items()):
        model = _build_model(cfg, seed=i)
        inputs = _inputs(cfg, LENGTHS, seed=100 + i)
        tensors, hf_cfg = fold_to_llama(model, cfg, **opts)
        _write_case(root / name, tensors, hf_cfg, inputs, _jax_logits(model, inputs))
        sources[name] = (tensors, hf_cfg)
        dirs.append(root / name)
    base = _build_model(B10_BASE, seed=77)
    base_params = flat_params(base)
    inputs = _inputs(B10_BASE, (B10_LENGTH,), seed=177)
    for name, cfg in B10_VARIANTS.items():
        model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
        _load_params(model, base_params)
        tensors, hf_cfg = fold_to_llama(model, cfg)
        _write_case(root / name, tensors, hf_cfg, inputs, _jax_logits(model, inputs))
        sources[name] = (tensors, hf_cfg)
        dirs.append(root / name)
        np.savez(root / name / "source_params.npz", **{k.replace("/", "."): v for k, v in base_params.items()})
    for name, (src, mutate) in MUTANTS.items():
        tensors = {k: v.copy() for k, v in sources[src][0].items()}
        hf_cfg = json.loads(json.dumps(sources[src][1]))
        mutate(tensors, hf_cfg)
        jl = dict(np.load(root / src / "jax_logits.npz"))
        _write_case(root / name, tensors, hf_cfg, dict(np.load(root / src / "inputs.npz")), jl)
        dirs.append(root / name)
    return dirs


@pytest.fixture(scope="session")
def parity_root(tmp_path_factory) -> Path:
    """All cases built and run through the torch side once per test run (shared by xdist workers)."""
    from torch_env import run_torch_side

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the workers of this run
    root = base / "llama_parity"
    with open(base / "llama_parity.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "DONE").exists():
            root.mkdir(exist_ok=True)
            dirs = _build_all(root)
            run_torch_side("logits", "--threads", "2", *map(str, dirs), timeout=900)
            (root / "DONE").write_text("ok")
    return root


def _max_abs(root: Path, name: str) -> dict[str, float]:
    a, b = np.load(root / name / "jax_logits.npz"), np.load(root / name / "logits.npz")
    out = {}
    for k in a.files:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        assert np.all(np.isfinite(b[k])), f"{name}/{k}: torch logits not finite"
        out[k] = float(np.max(np.abs(a[k] - b[k])))
    return out


# ------------------------------------------------------------------------------------------------
# parity tests
# ------------------------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_llama(parity_root, name):
    cfg, _ = CASES[name]
    errs = _max_abs(parity_root, name)
    scale = float(np.max(np.abs(np.load(parity_root / name / "jax_logits.npz")[f"T{LENGTHS[-1]}"])))
    print(f"{name}: max|logit|={scale:.3f} max-abs err per length {errs}")
    assert scale > 0.5, "logits too small for the tolerance to mean anything"
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, f"{name}: JAX vs transformers max abs error above {TOL}: {bad}"
    # transformers computed the same LongRoPE constants (independently when no attention_factor is given)
    info = json.loads((parity_root / name / "torch_info.json").read_text())
    assert info["attention_scaling"] == pytest.approx(attention_scaling(cfg), rel=1e-12)
    ours = inv_frequencies(cfg.resolved_head_dim, cfg.rope_theta) / longrope_factors(cfg)
    np.testing.assert_allclose(np.asarray(info["original_inv_freq"]), ours, rtol=2e-6)
    if cfg.rope_scaling is not None and cfg.max_position_embeddings > cfg.rope_scaling.original_max_position_embeddings:
        assert info["attention_scaling"] > 1.01  # the scaling is really exercised


@pytest.mark.torch
def test_b10_each_multiplier_changes_torch_logits_exactly_as_jax(parity_root):
    """Changing one μP scalar in the source changes the exported logits as it changes ours (B10)."""
    base_j = np.load(parity_root / "b10_base" / "jax_logits.npz")["T40"]
    base_t = np.load(parity_root / "b10_base" / "logits.npz")["T40"]
    assert np.max(np.abs(base_j - base_t)) <= TOL
    for name in B10_VARIANTS:
        if name == "b10_base":
            continue
        j = np.load(parity_root / name / "jax_logits.npz")["T40"]
        t = np.load(parity_root / name / "logits.npz")["T40"]
        assert np.max(np.abs(j - base_j)) > 1e-2, f"{name}: the scalar change did not move JAX logits"
        err = float(np.max(np.abs((t - base_t) - (j - base_j))))
        print(f"{name}: JAX change {np.max(np.abs(j - base_j)):.3f}, torch-vs-JAX change mismatch {err:.2e}, "
              f"parity {np.max(np.abs(j - t)):.2e}")
        assert err <= 2 * TOL, f"{name}: torch logit change differs from the JAX change by {err}"
        assert np.max(np.abs(j - t)) <= TOL


@pytest.mark.torch
@pytest.mark.parametrize("name", list(MUTANTS))
def test_parity_catches_mutated_exports(parity_root, name):
    """A multiplier applied twice or dropped, or lost RoPE factors/scaling, misses parity by far."""
    errs = _max_abs(parity_root, name)
    worst = max(errs.values())
    print(f"{name}: max-abs err {errs}")
    assert worst > 100 * TOL, f"{name}: the parity check would not notice this fault (err {worst})"


# ------------------------------------------------------------------------------------------------
# folding is exact (no torch needed)
# ------------------------------------------------------------------------------------------------


def test_fold_applies_each_multiplier_exactly_once():
    cfg = B10_BASE
    assert cfg.scale_emb == 3.0 and cfg.residual_scale == 2.5 and cfg.width_mult == 7.0
    model = _build_model(cfg, seed=3)
    p = flat_params(model)
    t, hf = fold_to_llama(model, cfg)
    assert set(t) == set(hf_param_shapes(cfg))
    assert all(v.dtype == np.float32 and v.flags["C_CONTIGUOUS"] for v in t.values())
    E = p["embed_tokens/embedding"]
    np.testing.assert_array_equal(t["model.embed_tokens.weight"], E * np.float32(3.0))
    np.testing.assert_array_equal(t["lm_head.weight"], (E.astype(np.float64) / 7.0).astype(np.float32))
    np.testing.assert_array_equal(t["model.norm.weight"], p["norm"])
    h, d = cfg.hidden_size, cfg.resolved_head_dim
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}."
        np.testing.assert_array_equal(t[L + "self_attn.q_proj.weight"], p["layers/q_proj"][i].reshape(h, -1).T)
        np.testing.assert_array_equal(t[L + "self_attn.k_proj.weight"], p["layers/k_proj"][i].reshape(h, -1).T)
        np.testing.assert_array_equal(t[L + "self_attn.v_proj.weight"], p["layers/v_proj"][i].reshape(h, -1).T)
        np.testing.assert_array_equal(t[L + "mlp.gate_proj.weight"], p["layers/gate_proj"][i].T)
        np.testing.assert_array_equal(t[L + "mlp.up_proj.weight"], p["layers/up_proj"][i].T)
        np.testing.assert_array_equal(t[L + "input_layernorm.weight"], p["layers/input_layernorm"][i])
        np.testing.assert_array_equal(t[L + "post_attention_layernorm.weight"], p["layers/post_attention_layernorm"][i])
        np.testing.assert_array_equal(t[L + "self_attn.o_proj.weight"],
                                      p["layers/o_proj"][i].reshape(cfg.num_attention_heads * d, h).T * np.float32(2.5))
        np.testing.assert_array_equal(t[L + "mlp.down_proj.weight"], p["layers/down_proj"][i].T * np.float32(2.5))
    # the runtime must not apply any multiplier again
    for k in ("scale_emb", "scale_depth", "dim_model_base", "mup_denominator", "sparse_config", "auto_map"):
        assert k not in hf
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["tie_word_embeddings"] is False and hf["attention_bias"] is False and hf["mlp_bias"] is False
    assert hf["rope_scaling"]["factor"] == 2.0
    assert hf["rope_scaling"]["attention_factor"] == attention_scaling(cfg) > 1.0


@pytest.mark.parametrize("tied", [True, False])
def test_unfold_inverts_fold(tied):
    cfg = _tiny(11, tied=tied, heads=4, kv=1, head_dim=24, max_pos=2 * ORIG)
    model = _build_model(cfg, seed=11)
    p = flat_params(model)
    back = unfold_from_llama(fold_to_llama(model, cfg)[0], cfg)
    assert set(back) == set(p)
    for k in p:
        np.testing.assert_allclose(back[k], p[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_mapping_table_covers_every_parameter_once():
    for tied in (True, False):
        cfg = _tiny(12, tied=tied)
        names = set(flat_params(MiniCPM4(cfg, rngs=nnx.Rngs(0))))
        ours = {r.ours for r in LLAMA_PARAM_MAP if not (tied and r.ours == "lm_head")}
        assert names == ours
    assert len({r.hf for r in LLAMA_PARAM_MAP}) == len(LLAMA_PARAM_MAP)


# ------------------------------------------------------------------------------------------------
# released config and presets (spec §1.1)
# ------------------------------------------------------------------------------------------------

#: keys of the official config.json that are loader/runtime metadata, not architecture
IGNORABLE_HF_KEYS = {"auto_map", "_name_or_path", "transformers_version", "use_cache", "torch_dtype", "architectures"}
#: ModelConfig fields that are run-time choices of this project, not part of the architecture
RUNTIME_FIELDS = {"dtype", "param_dtype", "scan_layers", "remat", "attention_impl"}


def _released_05b() -> dict:
    return json.loads(shared_path("data", "minicpm4-0.5b", "config.json").read_text())


def test_released_05b_config_round_trips():
    hf = _released_05b()
    cfg = ModelConfig.from_hf_config(hf)
    validate_model(cfg)
    out = cfg.to_hf_config()
    diffs = {k: (hf[k], out.get(k, "<missing>")) for k in hf if k not in IGNORABLE_HF_KEYS and out.get(k) != hf[k]}
    assert not diffs, f"to_hf_config changed keys of the released config: {diffs}"
    assert ModelConfig.from_hf_config(out) == cfg
    # constructor defaults the released file relies on (spec §1.1)
    assert cfg.tie_word_embeddings is True and cfg.rope_theta == 10000.0 and cfg.head_dim is None
    assert attention_scaling(cfg) == 1.0


PRESETS = {
    # name: hidden, layers, heads, kv, inter, eps, tied, max_pos, orig, n_factors, first, last
    "minicpm4_0p5b": (1024, 24, 16, 2, 4096, 1e-5, True, 32768, 32768, 32, 1.0004360675811768, 49.85338592529297),
    "minicpm4_8b": (4096, 32, 32, 2, 16384, 1e-6, False, 32768, 32768, 64, 0.9977997200264581, 31.02392307921529),
    "minicpm41_8b": (4096, 32, 32, 2, 16384, 1e-6, False, 65536, 65536, 64, 0.9982316082870437, 126.01712561287873),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_release_presets_have_spec_shapes(name):
    h, layers, nq, nkv, inter, eps, tied, max_pos, orig, nf, first, last = PRESETS[name]
    m = load_config(name).model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads, m.intermediate_size) == (
        h, layers, nq, nkv, inter)
    assert m.rms_norm_eps == eps and m.tie_word_embeddings is tied
    assert m.max_position_embeddings == max_pos and m.rope_scaling.original_max_position_embeddings == orig
    assert m.rope_scaling.rope_type == "longrope"
    for lst in (m.rope_scaling.short_factor, m.rope_scaling.long_factor):
        assert len(lst) == nf == m.resolved_head_dim // 2
        assert lst[0] == first and lst[-1] == last
    assert m.rope_scaling.short_factor == m.rope_scaling.long_factor
    assert (m.vocab_size, m.scale_emb, m.dim_model_base, m.scale_depth, m.rope_theta, m.initializer_range) == (
        73448, 12.0, 256, 1.4, 10000.0, 0.1)
    assert attention_scaling(m) == 1.0
    assert math.isclose(m.residual_scale, 1.4 / math.sqrt(layers))


def test_05b_preset_equals_released_config():
    released = ModelConfig.from_hf_config(_released_05b())
    preset = load_config("minicpm4_0p5b").model
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME_FIELDS]
    diffs = {f: (getattr(preset, f), getattr(released, f)) for f in fields if getattr(preset, f) != getattr(released, f)}
    assert not diffs, f"0.5B preset differs from the released config.json: {diffs}"
