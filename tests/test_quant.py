"""Ternary QAT, BitCPM4 (issue 8): quantizer, STE, training, packed inference, HF and GGUF export.

Reference computations are independent: NumPy absmean quantization on the exported Hugging Face
``[out, in]`` tensors (so "row" and "group" mean what the exported files mean), the ``gguf``
package's own TQ1_0/TQ2_0 codecs, and a plain (non-STE) loss for the gradient check. Field fault
B14 (ternary dequantization dividing by the scale) is tested on its own input.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from test_convert_common import jax_logits, model_from_flat, random_params, read_json, tiny_cfg, \
    tiny_tokenizer_dir  # noqa: F401

from minicpm4_jax.cli import main
from minicpm4_jax.config import ConfigError, load_config
from minicpm4_jax.convert import flat_params, to_official
from minicpm4_jax.convert.gguf_export import check_ternary_blocks, check_ternary_outtype, read_gguf_params, \
    write_gguf
from minicpm4_jax.convert.hf_import import import_hf
from minicpm4_jax.convert.io import MANIFEST_NAME, ConvertError, SafetensorsSource
from minicpm4_jax.quant import (MatrixLayout, TernarySpec, dequantize, fake_quant, fake_quant_params, fake_quant_ste,
                                first_non_ternary_group, numpy_ternary, pack_codes, pack_params, recover_codes,
                                ternarize, ternary_codes, ternary_hf_names, unpack_codes,
                                unpack_params)
from minicpm4_jax.train.checkpoint import load_params_for_inference
from minicpm4_jax.train.loop import run_training
from minicpm4_jax.train.optim import two_stage_schedule, wsd_schedule
from minicpm4_jax.train.step import lr_schedule, next_token_loss

REPO = Path(__file__).resolve().parent.parent


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------------
# the quantizer against NumPy, on the exported HF tensors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row", "per_group"])
def test_quantizer_matches_numpy_on_hf_tensors(granularity):
    """Values and scales of every ternary tensor equal an independent NumPy absmean quantizer run
    on the Hugging Face ``[out, in]`` tensor: rows are output features, groups run along ``in``."""
    cfg = tiny_cfg(tied=False)  # hidden 64, 4 heads x 16 (o_proj in = 64), intermediate 96
    spec = TernarySpec(granularity=granularity, group_size=32, quantize_embeddings=True, quantize_lm_head=True)
    params = random_params(cfg, seed=30)
    q = ternarize(params, cfg, spec)
    assert set(q) == set(params)
    hf_lat, hf_q = to_official(params, cfg), to_official(q, cfg)
    names = ternary_hf_names(cfg, spec)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names and len(names) == 2 + 7 * 2
    for name in hf_lat:
        if name not in names:  # norms stay high precision, bit for bit
            np.testing.assert_array_equal(hf_q[name], hf_lat[name])
            continue
        w = hf_lat[name]
        codes, s = numpy_ternary(w, granularity, 32)
        n_groups = {"per_tensor": 1, "per_row": w.shape[0], "per_group": w.size // 32}[granularity]
        assert s.shape == (n_groups,), name
        # our scales, read back from the stored values (every absmean group holds a nonzero code)
        got_codes, got_s = recover_codes(hf_q[name], granularity, 32)
        np.testing.assert_allclose(got_s, s, rtol=2e-6, err_msg=name)
        # codes: equal except where float32 vs float64 could flip a rounding tie |W/s| ~ 0.5
        ratio = np.abs(w.astype(np.float64) / np.repeat(s, w.size // n_groups).reshape(w.shape))
        near_tie = np.abs(ratio - 0.5) < 1e-5
        assert near_tie.mean() < 1e-3
        np.testing.assert_array_equal(got_codes[~near_tie], codes[~near_tie], err_msg=name)
        assert first_non_ternary_group(hf_q[name], granularity, 32) is None
        assert 0.15 < float(np.mean(codes == 0)) < 0.5  # a Gaussian matrix: about 31% zeros


def test_scale_layout_of_our_arrays():
    """Per-row scales of our ``[in, out]`` arrays run along ``out`` (HF rows), groups along ``in``."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 3)), jnp.float32)  # [L, in, out]
    for gran, shape in (("per_tensor", (2, 1, 1, 1)), ("per_row", (2, 1, 1, 3)), ("per_group", (2, 2, 1, 3))):
        lay = MatrixLayout(shape=(2, 8, 3), n_lead=1, n_in=1, in_first=True, granularity=gran, group_size=4)
        codes, s = ternary_codes(w, lay)
        assert s.shape == shape and codes.dtype == jnp.int8
        for layer in range(2):
            hf = np.asarray(w[layer]).T  # [out, in]
            _, s_np = numpy_ternary(hf, gran, 4)
            np.testing.assert_allclose(np.asarray(s[layer]).reshape(-1) if gran != "per_group"
                                       else np.asarray(s[layer])[:, 0, :].T.reshape(-1), s_np, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# B14: dequantization multiplies by the scale
# ------------------------------------------------------------------------------------------------


def test_b14_dequantization_multiplies_by_the_scale(tmp_path, tiny_tokenizer_dir):
    row = jnp.asarray([[0.9, -0.3, 0.05, -1.2]], jnp.float32)
    lay = MatrixLayout(shape=(1, 4), n_lead=0, n_in=1, in_first=False, granularity="per_row")
    codes, s = ternary_codes(row, lay)
    assert float(s.reshape(())) == pytest.approx(0.6125, rel=1e-7)
    np.testing.assert_array_equal(np.asarray(codes), [[1, 0, 0, -1]])
    deq = np.asarray(dequantize(codes, s, lay))
    np.testing.assert_allclose(deq, [[0.6125, 0, 0, -0.6125]], rtol=1e-7)
    assert not np.allclose(deq, [[1 / 0.6125, 0, 0, -1 / 0.6125]])  # the divide-by-scale bug gives 1.633
    # a 4x8 random matrix: dequantize == codes * scale; quantize -> dequantize -> quantize is idempotent
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32)
    lay = MatrixLayout(shape=(4, 8), n_lead=0, n_in=1, in_first=False, granularity="per_row")
    c, s = ternary_codes(w, lay)
    wq = np.asarray(fake_quant(w, lay))
    np.testing.assert_array_equal(wq, np.asarray(c, np.float32) * np.asarray(s).reshape(4, 1))
    c2, _ = ternary_codes(jnp.asarray(wq), lay)
    np.testing.assert_array_equal(np.asarray(c2), np.asarray(c))
    rc, rs = recover_codes(wq, "per_row")
    np.testing.assert_array_equal(rc, np.asarray(c))
    np.testing.assert_array_equal(rs, np.asarray(s).reshape(4))
    # the GGUF ternary codec (gguf package) dequantizes to +-s, not +-1/s
    big = np.zeros((2, 256), np.float32)
    big[:, ::3] = 0.6125
    big[:, 1::3] = -0.6125
    for qt in (gguf.GGMLQuantizationType.TQ2_0, gguf.GGMLQuantizationType.TQ1_0):
        back = gguf.quants.dequantize(gguf.quants.quantize(big, qt), qt)
        np.testing.assert_array_equal(back, np.sign(big) * np.float32(np.float16(0.6125)))


# ------------------------------------------------------------------------------------------------
# the straight-through estimator
# ------------------------------------------------------------------------------------------------


def test_ste_gradient_is_identity_in_the_clamp_range_including_the_bounds():
    # mean|w| = 8/8 = 1 exactly, so w/s == w: three weights sit exactly on the clamp bounds +-1,
    # two on the rounding ties +-0.5, two outside the range
    w = jnp.asarray([[2.0, -1.0, 1.0, -1.0, 0.5, -0.5, 0.25, -1.75]], jnp.float32)
    g = jnp.arange(1.0, 9.0, dtype=jnp.float32)[None]
    for ste in ("identity", "clipped"):
        lay = MatrixLayout(shape=(1, 8), n_lead=0, n_in=1, in_first=False, granularity="per_row", ste=ste)
        _, s = ternary_codes(w, lay)
        assert float(s.reshape(())) == 1.0
        x = np.asarray(w) / 1.0
        inside = np.abs(x) <= 1.0
        assert (np.abs(x[inside]) == 1.0).sum() == 3  # the bounds are really hit
        out, vjp = jax.vjp(lambda v: fake_quant_ste(v, lay), w)
        np.testing.assert_array_equal(np.asarray(out), [[1, -1, 1, -1, 0, 0, 0, -1]])  # forward: exactly q*s
        (grad,) = vjp(g)
        np.testing.assert_array_equal(np.asarray(grad)[inside], np.asarray(g)[inside])  # identity, bounds included
        want_outside = np.asarray(g)[~inside] if ste == "identity" else 0.0
        np.testing.assert_array_equal(np.asarray(grad)[~inside], want_outside)


def test_qat_loss_gradient_equals_the_gradient_at_the_ternary_weights():
    """Through the whole model: d loss(Q(W)) / dW (STE) equals d loss / dW evaluated at W = Q(W)."""
    cfg = tiny_cfg(tied=True)
    spec = TernarySpec(granularity="per_row")
    model = model_from_flat(cfg, random_params(cfg, seed=31))
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)

    def loss(p):
        return next_token_loss(nnx.merge(graphdef, p)(ids[:, :-1]), ids[:, 1:])

    g_ste = jax.grad(lambda p: loss(fake_quant_params(p, cfg, spec, ste=True)))(params)
    g_at_q = jax.grad(loss)(ternarize(params, cfg, spec))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_ste)[0], jax.tree.leaves(g_at_q)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(g_ste["layers"]["q_proj"][...]).max()) > 0


# ------------------------------------------------------------------------------------------------
# packed 2-bit storage
# ------------------------------------------------------------------------------------------------


def test_pack_codes_round_trip():
    c = jnp.asarray(np.random.default_rng(3).integers(-1, 2, (3, 7, 5)), jnp.int8)
    p = pack_codes(c)
    assert p.dtype == jnp.uint8 and p.shape == ((3 * 7 * 5 + 3) // 4,)
    np.testing.assert_array_equal(np.asarray(unpack_codes(p, c.shape)), np.asarray(c))


@pytest.mark.parametrize("granularity", ["per_row", "per_group"])
def test_packed_inference_gives_identical_logits(granularity):
    cfg = tiny_cfg(tied=False)
    spec = TernarySpec(granularity=granularity, group_size=32, quantize_lm_head=True)
    model = model_from_flat(cfg, random_params(cfg, seed=32))
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    fake = np.asarray(fwd(ternarize(params, cfg, spec), ids))
    packed = pack_params(params, cfg, spec)
    packed_fwd = jax.jit(lambda p, x: nnx.merge(graphdef, unpack_params(p))(x))  # unpacked on the fly
    got = np.asarray(packed_fwd(packed, ids))
    np.testing.assert_array_equal(got, fake)
    assert not np.allclose(fake, np.asarray(fwd(params, ids)), atol=1e-3)  # ternary differs from the latent model
    # 2 bits per weight (+ scales) instead of 32
    q = packed["layers"]["q_proj"].get_value()
    assert q.packed.dtype == jnp.uint8 and q.packed.size == (int(np.prod(q.layout.shape)) + 3) // 4
    assert q.nbytes < 4 * int(np.prod(q.layout.shape)) / 8


# ------------------------------------------------------------------------------------------------
# training: a QAT run lowers the loss; the in-run switch equals init_from + continued data
# ------------------------------------------------------------------------------------------------


def _record_first_params(seen: dict):
    """A ``run_training`` step hook keeping the parameters at step 0 in ``seen["params"]``."""

    def hook(step, state):
        if step == 0:
            seen["params"] = jax.tree.map(np.asarray, state.params)
        return state

    return hook


def _corpus_docs(n_docs: int = 60) -> list[str]:
    from test_train import _corpus_text

    return _corpus_text(0, n_docs)


def _overrides(root: Path, out: str, **kw) -> list[str]:
    ov = {
        "model.vocab_size": 512, "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
        "model.max_position_embeddings": 128, "model.dim_model_base": 16, "model.dtype": "float32",
        "data.sources": f"[{root / 'corpus'}]", "data.tokenizer_vocab_size": 384, "data.seq_len": 32,
        "data.batch_size": 4, "data.val_fraction": 0.1, "data.cache_dir": str(root / "cache"),
        "steps": 16, "optimizer.warmup_steps": 2, "optimizer.decay_steps": 2, "optimizer.learning_rate": 0.02,
        "log_every": 1, "eval_every": 8, "eval_batches": 2, "checkpoint.save_every": 8, "checkpoint.keep": 3,
        "out_dir": str(root / out), "sample_tokens": 0, "tensorboard": True,
    }
    ov.update(kw)
    return [f"{k}={v}" for k, v in ov.items()]


@pytest.fixture(scope="module")
def qat_runs(tmp_path_factory):
    """A two-stage run (8 high-precision + 8 QAT steps) and a QAT run started from its step 8."""
    root = tmp_path_factory.mktemp("qat")
    (root / "corpus").mkdir()
    for i, doc in enumerate(_corpus_docs()):
        (root / "corpus" / f"doc{i:03d}.txt").write_text(doc)
    logs: list[str] = []
    two = load_config(None, _overrides(root, "two", **{"qat.enabled": True, "qat.token_share": 0.5,
                                                       "qat.warmup_steps": 2}))
    s_two = run_training(two, log=logs.append, progress=False)
    logs_init: list[str] = []
    seen: dict = {}
    hook = _record_first_params(seen)

    init = load_config(None, _overrides(root, "init", steps=8, **{
        "qat.enabled": True, "qat.init_from": str(root / "two"), "qat.init_step": 8}))
    s_init = run_training(init, log=logs_init.append, progress=False, step_hook=hook)
    return {"root": root, "two": s_two, "init": s_init, "logs": logs, "logs_init": logs_init, "seen": seen,
            "cfg_two": two}


def test_qat_run_lowers_the_loss_and_logs_ternary_stats(qat_runs):
    s = qat_runs["two"]
    hist = {h["step"]: h for h in s["history"]}
    assert s["qat"]["start_step"] == 8 and s["qat"]["qat_steps"] == 8 and s["qat"]["ternary_at_end"] is True
    # ternary statistics only once QAT has started; about a third of the codes are zero
    assert "ternary_zero_fraction" not in hist[8] and "ternary_zero_fraction" in hist[9]
    assert 0.15 < hist[16]["ternary_zero_fraction"] < 0.5 and hist[16]["ternary_scale"] > 0
    # the QAT stage lowers the (ternary) training loss, and the ternary model beats the HP model it started from
    qat_losses = [hist[i]["loss"] for i in range(9, 17)]
    assert np.mean(qat_losses[-2:]) < np.mean(qat_losses[:2]) - 0.2, qat_losses
    val = dict((int(k), v) for k, v in s["val_history"])
    assert val[16] < val[8]
    # the learning rate is re-warmed at the switch: warmup 2 -> half the peak at the first QAT step
    assert hist[9]["lr"] == pytest.approx(0.01, rel=1e-6) and hist[10]["lr"] == pytest.approx(0.02, rel=1e-6)
    text = "\n".join(qat_runs["logs"])
    assert "ternary zeros" in text and "layer  1 zeros/scale" in text and "ternary model at step 16" in text
    # the announced QAT steps are numbered as in the log: the first ternary update is step 9 (it said 8..16)
    assert "STE identity) for steps 9..16 (8 of 16 steps" in text and "re-warmed at step 9" in text, text[:2000]
    per_layer = s["qat"]["per_layer"]["layers/q_proj"]
    assert len(per_layer["zero_fraction"]) == 2 and len(per_layer["scale_mean"]) == 2
    assert list((qat_runs["root"] / "two" / "tensorboard").glob("events.out.tfevents.*"))


def test_ternary_checkpoint_serves_inference_with_ternary_weights(qat_runs):
    run = qat_runs["root"] / "two"
    cfg, model = load_params_for_inference(run)
    _, latent = load_params_for_inference(run, ternary=False)
    _, hp = load_params_for_inference(run, 8)  # the switch step: the high-precision model
    flat, flat_latent, flat_hp = flat_params(model), flat_params(latent), flat_params(hp)
    spec = TernarySpec(granularity=cfg.qat.granularity)
    names = ternary_hf_names(cfg.model, spec)
    hf = to_official(flat, cfg.model)
    for n in names:
        assert first_non_ternary_group(hf[n], "per_row") is None, n
    for k in ("layers/q_proj", "layers/down_proj"):
        assert not np.array_equal(flat[k], flat_latent[k])
        assert len(np.unique(flat_hp[k])) > 100  # step 8 is not ternary
    np.testing.assert_array_equal(flat["norm"], flat_latent["norm"])
    for k, v in ternarize(flat_latent, cfg.model, spec).items():
        np.testing.assert_array_equal(v, flat[k])


def test_init_from_equals_the_in_run_switch(qat_runs):
    """A QAT run from the step-8 checkpoint (latent weights, data order continued) sees the same
    weights and batch at its first step as the two-stage run at its first QAT step: same loss."""
    seen = qat_runs["seen"]["params"]
    _, hp8 = load_params_for_inference(qat_runs["root"] / "two", 8, ternary=False)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(seen)[0], jax.tree.leaves(nnx.state(hp8, nnx.Param))):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert any("data order continues from step 8" in m for m in qat_runs["logs_init"])
    two = {h["step"]: h["loss"] for h in qat_runs["two"]["history"]}
    init = {h["step"]: h["loss"] for h in qat_runs["init"]["history"]}
    assert init[1] == pytest.approx(two[9], rel=1e-5)
    s = qat_runs["init"]["qat"]
    assert s["init_step"] == 8 and s["token_share"] == pytest.approx(0.5) and s["start_step"] == 0


def test_a_resumed_init_from_run_still_reports_its_source(qat_runs):
    """A ``--resume`` does not resolve ``qat.init_from`` again; the summary takes the source from the run's
    data.json (it reported a token share of 1.0 and no source before)."""
    root = qat_runs["root"]
    init = load_config(None, _overrides(root, "init", steps=8, **{
        "qat.enabled": True, "qat.init_from": str(root / "two"), "qat.init_step": 8}))
    s = run_training(init, resume=True, log=lambda m: None, progress=False)
    first = qat_runs["init"]["qat"]
    assert s["step"] == 8 and s["qat"]["init_from"] == first["init_from"] and s["qat"]["init_step"] == 8
    assert s["qat"]["init_tokens"] == first["init_tokens"] > 0 and s["qat"]["token_share"] == pytest.approx(0.5)


def test_init_from_checks(qat_runs, tmp_path):
    root = qat_runs["root"]
    from minicpm4_jax.train.qat import resolve_init

    bad = load_config(None, _overrides(root, "x1", steps=8, **{
        "qat.enabled": True, "qat.init_from": str(root / "two"), "model.intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"holds a different model: model.intermediate_size: 128 != 96") as e:
        resolve_init(bad)
    _one_line(e.value)
    missing = load_config(None, _overrides(root, "x2", steps=8, **{
        "qat.enabled": True, "qat.init_from": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match="qat.init_from: checkpoint directory .* does not exist"):
        run_training(missing, progress=False)
    assert not (root / "x2" / "config.json").exists()  # refused before anything was written
    wrong_step = load_config(None, _overrides(root, "x3", steps=8, **{
        "qat.enabled": True, "qat.init_from": str(root / "two"), "qat.init_step": 5}))
    with pytest.raises(ConfigError, match=r"qat.init_step=5 is not a checkpoint .*saved steps: 8, 16"):
        resolve_init(wrong_step)


def test_init_from_a_checkpoint_with_other_rotary_tables_is_refused(tmp_path):
    """``rope_scaling`` / ``max_position_embeddings`` may differ from the init checkpoint's only where they give the
    same rotary tables: LongRoPE factors or attention scaling that differ rotate every position otherwise (the
    check let them through: a 40-step tiny run's held-out loss went 1.6706 -> 1.6987 under factors of 4, and
    -> 1.6653 under the scaling of max_position_embeddings 1024 over 128, before any QAT step)."""
    from minicpm4_jax.train.checkpoint import Checkpointer
    from minicpm4_jax.train.qat import resolve_init
    from minicpm4_jax.train.step import init_train_state

    src_cfg = load_config(None, _overrides(tmp_path, "src"))  # no rope_scaling, head_dim 16, 128 positions
    _, state = init_train_state(src_cfg, 0)
    ck = Checkpointer(src_cfg, tmp_path / "src" / "checkpoints")
    try:
        ck.save(1, state)
    finally:
        ck.close()

    def qat_cfg(**kw):
        return load_config(None, _overrides(tmp_path, "q", steps=8, **{
            "qat.enabled": True, "qat.init_from": str(tmp_path / "src"), **kw}))

    def longrope(orig, short, long_):
        return json.dumps({"rope_type": "longrope", "original_max_position_embeddings": orig,
                           "short_factor": [short] * 8, "long_factor": [long_] * 8})

    # the same tables: a longer context without LongRoPE, or LongRoPE factors of 1 at its original length
    assert resolve_init(qat_cfg(**{"model.max_position_embeddings": 256})).step == 1
    assert resolve_init(qat_cfg(**{"model.rope_scaling": longrope(128, 1.0, 4.0)})).step == 1
    # other factors (the long list of 4s, since 128 > 64) and their attention scaling sqrt(1 + ln 2 / ln 64)
    with pytest.raises(ConfigError, match=r"another rotary embedding: model.rope_factors: all 1 != all 4; "
                                          r"model.rope_attention_scaling: 1 != 1.08012 .*from model.rope_scaling\)"
                       ) as e:
        resolve_init(qat_cfg(**{"model.rope_scaling": longrope(64, 1.0, 4.0)}))
    _one_line(e.value)
    # the same factors (all 1), but the scaling of 1024 positions over the original 128
    with pytest.raises(ConfigError, match=r"model.rope_attention_scaling: 1 != 1.19523 .*from model.rope_scaling "
                                          r"and model.max_position_embeddings\): its weights would see other") as e:
        resolve_init(qat_cfg(**{"model.rope_scaling": longrope(128, 1.0, 1.0), "model.max_position_embeddings": 1024}))
    assert "rope_factors" not in str(e.value)


def test_continue_data_with_data_sources_spelled_otherwise(qat_runs, tmp_path, monkeypatch):
    """``qat.continue_data`` compared ``data.sources`` as spelled: a QAT run naming the init run's corpus by another
    path to the same folder (relative instead of absolute) restarted the data order from the beginning, which a
    resume of such a run accepts (``same_sources``). Other files are still another data order."""
    from minicpm4_jax.train.qat import continue_data_order, resolve_init

    root = qat_runs["root"]
    monkeypatch.chdir(root)
    logs: list[str] = []
    got: list = []
    it = type("It", (), {"set_state": lambda self, st: got.append(st)})()
    rel = load_config(None, _overrides(root, "rel", steps=8, **{
        "data.sources": "[corpus]", "qat.enabled": True, "qat.init_from": str(root / "two"), "qat.init_step": 8}))
    assert continue_data_order(rel, resolve_init(rel), it, logs.append), logs
    assert got and got[0]["next_index"] == 8 and "data order continues from step 8" in logs[-1]
    (root / "other").mkdir(exist_ok=True)
    (root / "other" / "a.txt").write_text("other text\n" * 50)
    other = dataclasses.replace(rel, data=dataclasses.replace(rel.data, sources=("other",)))
    assert not continue_data_order(other, resolve_init(rel), it, logs.append)
    assert "data settings differ: data.sources" in logs[-1] and len(got) == 1


def test_init_from_with_another_param_dtype(qat_runs):
    """``model.param_dtype`` may differ from the init checkpoint's (MODEL_FIELDS_MAY_DIFFER), but the weights were
    loaded in the checkpoint's float32 beside a bfloat16 optimizer state: the train step compiled for them failed at
    the second step ("TypeError: Argument types differ from the types for which this computation was compiled").
    They are cast to the run's dtype."""
    root = qat_runs["root"]
    seen: dict = {}
    cfg = load_config(None, _overrides(root, "bf16", steps=2, **{
        "qat.enabled": True, "qat.init_from": str(root / "two"), "qat.init_step": 8, "model.param_dtype": "bfloat16",
        "optimizer.warmup_steps": 0, "optimizer.decay_steps": 0, "checkpoint.save_every": 2, "tensorboard": False}))
    s = run_training(cfg, log=lambda _m: None, progress=False, step_hook=_record_first_params(seen))
    assert s["step"] == 2 and np.isfinite(s["val_loss"])
    _, hp8 = load_params_for_inference(root / "two", 8, ternary=False)
    first = jax.tree.leaves(seen["params"])
    for a, b in zip(first, jax.tree.leaves(nnx.state(hp8, nnx.Param))):
        assert a.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a, np.asarray(b).astype(ml_dtypes.bfloat16))


def test_init_from_an_hf_import(qat_runs, tmp_path, tiny_tokenizer_dir):
    """``qat.init_from`` accepts the OUT of ``minicpm4 import hf`` (no optimizer state, no data state)."""
    from minicpm4_jax.convert.hf_export import write_hf

    cfg = tiny_cfg(tied=True, max_pos=128)
    params = random_params(cfg, seed=35)
    write_hf(params, cfg, tmp_path / "hf", tokenizer_dir=tiny_tokenizer_dir)
    import_hf(tmp_path / "hf", tmp_path / "imp")
    root = qat_runs["root"]
    model = {f"model.{k}": v for k, v in dataclasses.asdict(cfg).items()
             if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "scale_emb", "scale_depth", "dim_model_base", "max_position_embeddings",
                      "rope_theta")}
    logs: list[str] = []
    seen: dict = {}
    hook = _record_first_params(seen)

    qcfg = load_config(None, _overrides(root, "from_import", steps=4, **model, **{
        "model.rope_scaling": json.dumps(dataclasses.asdict(cfg.rope_scaling)),
        "data.tokenizer": str(tmp_path / "imp" / "tokenizer"), "data.tokenizer_vocab_size": 320,
        "qat.enabled": True, "qat.init_from": str(tmp_path / "imp"), "checkpoint.save_every": 4}))
    s = run_training(qcfg, log=logs.append, progress=False, step_hook=hook)
    assert s["qat"]["init_step"] == 0 and s["qat"]["ternary_at_end"] is True
    got = flat_params(seen["params"])
    assert set(got) == set(params)
    for k, v in got.items():
        np.testing.assert_array_equal(np.asarray(v), params[k], err_msg=k)
    assert any("data order starts from the beginning" in m and "holds no data-iterator state" in m for m in logs)
    assert not any("settings differ" in m for m in logs)  # the import's default data section is not a real run's


# ------------------------------------------------------------------------------------------------
# schedule and config
# ------------------------------------------------------------------------------------------------


def test_two_stage_schedule_rewarms_then_wsd():
    cfg = load_config("cpu_tiny", ["steps=100", "optimizer.warmup_steps=10", "optimizer.decay_fraction=0.1",
                                   "optimizer.min_lr_ratio=0.1", "optimizer.learning_rate=1.0",
                                   "qat.enabled=true", "qat.token_share=0.4", "qat.warmup_steps=4"])
    assert cfg.qat_start_step == 60 and cfg.qat_steps == 40
    lr = lr_schedule(cfg)
    hp = wsd_schedule(cfg.optimizer, 100)
    for s in (0, 9, 30, 59):
        assert float(lr(s)) == float(hp(s))
    assert float(lr(59)) == 1.0
    np.testing.assert_allclose([float(lr(s)) for s in (60, 61, 62, 63)], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert float(lr(95)) == 1.0  # stable until the last 10% of the QAT stage (4 steps)
    vals = [float(lr(s)) for s in range(96, 101)]
    assert all(b <= a for a, b in zip(vals, vals[1:]))
    assert float(lr(100)) == pytest.approx(0.1, rel=1e-6) and float(lr(140)) == pytest.approx(0.1, rel=1e-6)
    only = two_stage_schedule(cfg.optimizer, 40, 0, warmup_steps=4, learning_rate=0.5)
    assert float(only(0)) == pytest.approx(0.125) and float(only(3)) == pytest.approx(0.5)


@pytest.mark.parametrize("overrides,match", [
    (["qat.enabled=true", "qat.granularity=per_col"], r"qat.granularity='per_col'; use one of"),
    (["qat.enabled=true", "qat.granularity=per_group", "qat.group_size=48"],
     r"qat.group_size=48 does not divide the 256 input columns of q/k/v_proj"),
    (["qat.enabled=true", "qat.granularity=per_group", "qat.group_size=0"], r"qat.group_size=0 must be positive"),
    (["qat.enabled=true", "qat.token_share=0"], r"qat.token_share=0.0 must be in \(0, 1\]"),
    (["qat.enabled=true", "qat.token_share=1.5"], r"qat.token_share=1.5 must be in \(0, 1\]"),
    (["qat.init_from=runs/x"], r"qat.init_from='runs/x' is set but qat.enabled is false"),
    (["qat.enabled=true", "qat.init_from=runs/x", "qat.token_share=0.5"],
     r"qat.token_share=0.5 with qat.init_from: a run started from a checkpoint is all QAT"),
    (["qat.enabled=true", "qat.init_step=3"], r"qat.init_step=3 needs qat.init_from"),
    (["qat.enabled=true", "qat.quantize_lm_head=true"],
     r"qat.quantize_lm_head=true but the head is tied to the embedding"),
    (["qat.enabled=true", "qat.ste=round"], r"qat.ste='round'; use 'identity'"),
    (["qat.enabled=true", "qat.token_share=0.05"],
     r"the QAT stage has 18 steps but its re-warmup \(30\) \+ decay \(4\) steps exceed them"),
    (["qat.enabled=true", "qat.learning_rate=0"], r"qat.learning_rate=0.0 must be a finite number > 0"),
    # sixth break test: inf was accepted (the run diverged half-way), and with QAT off nonsense values passed
    (["qat.enabled=true", "qat.learning_rate=inf"], r"qat.learning_rate=inf must be a finite number > 0"),
    (["qat.learning_rate=-1"], r"qat.learning_rate=-1.0 must be a finite number > 0"),
    (["qat.warmup_steps=-5"], r"qat.warmup_steps=-5 must be >= 0"),
    (["qat.token_share=2"], r"qat.token_share=2.0 must be in \(0, 1\]"),
    (["qat.enabled=true", "qat.token_sharee=0.5"], r"unknown config key 'qat.token_sharee'.*did you mean 'token_share'"),
])
def test_bad_qat_config_is_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config("cpu_tiny", overrides)
    _one_line(e.value)


def test_qat_settings_of_a_run_without_qat_are_named_as_inactive():
    """A QAT preset trained in high precision (``qat.enabled=false``, as scripts/qat_token_share.py's baseline) is
    accepted; the training log names its QAT settings as having no effect."""
    from minicpm4_jax.config import inactive_qat_options

    assert inactive_qat_options(load_config("cpu_tiny_qat", ["qat.enabled=false"])) == [
        "qat.token_share=0.4", "qat.warmup_steps=6"]
    assert inactive_qat_options(load_config("cpu_tiny_qat")) == []
    assert inactive_qat_options(load_config("cpu_tiny")) == []


def test_a_high_precision_stage_shorter_than_the_warmup_is_warned_about(tmp_path, monkeypatch):
    """Helper 90: ``qat.token_share`` leaving fewer high-precision steps than ``optimizer.warmup_steps`` trained
    silently (the stage ended mid-warmup, at hp / warmup of the peak learning rate, and QAT started from there);
    the log now says so with the values and the fix, before the data are prepared. A stage that reaches the peak,
    a QAT-only run and a run without QAT are not warned about."""
    import minicpm4_jax.train.loop as loop_mod
    from minicpm4_jax.config import qat_warmup_warning

    short = load_config(None, _overrides(tmp_path, "r", **{"steps": 100, "optimizer.warmup_steps": 10,
                                                           "qat.enabled": True, "qat.token_share": 0.96,
                                                           "qat.warmup_steps": 2}))
    assert qat_warmup_warning(short) == (
        "warning: qat.token_share=0.96 x steps=100 leaves 4 high-precision steps, fewer than "
        "optimizer.warmup_steps=10: that stage ends inside its warmup (at 40% of the peak learning rate) before QAT "
        "starts; lower optimizer.warmup_steps to 4 or less, lower qat.token_share, or set qat.token_share=1 for a "
        "QAT-only run")
    for share, enabled in ((0.9, True), (1.0, True), (0.96, False)):
        assert qat_warmup_warning(dataclasses.replace(short, qat=dataclasses.replace(
            short.qat, token_share=share, enabled=enabled))) is None, (share, enabled)

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    said: list[str] = []
    monkeypatch.setattr(loop_mod, "_data_api", stop)
    with pytest.raises(Stop):
        run_training(short, log=said.append, progress=False)
    assert qat_warmup_warning(short) in said, said


def test_the_one_step_decay_warning_counts_the_qat_stages_own_decay(tmp_path, monkeypatch):
    """Break test (helper 99): the "a decay of 1 step changes nothing" warning measured decay_fraction against the
    whole run, but a QAT run decays over decay_fraction of its QAT steps: steps=20, token_share=0.5,
    decay_fraction=0.1 decays over round(0.1 x 10) = 1 step unwarned, and steps=10 (a decay of round(0.5) = 0
    steps) was warned about a decay of 1 step."""
    import minicpm4_jax.train.loop as loop_mod
    from minicpm4_jax.train.step import decay_start_step, lr_schedule

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(loop_mod, "_data_api", stop)
    common = {"optimizer.decay_steps": "null", "optimizer.decay_fraction": 0.1, "optimizer.warmup_steps": 0,
              "qat.enabled": True, "qat.token_share": 0.5, "qat.warmup_steps": 0}
    for steps, warned in ((20, True), (10, False)):
        cfg = load_config(None, _overrides(tmp_path, f"r{steps}", **{**common, "steps": steps}))
        # the QAT stage's WSD: peak until its decay starts, min_lr_ratio x peak at the end of the run
        start = steps - (1 if warned else 0)
        assert decay_start_step(cfg) == start, (steps, decay_start_step(cfg))
        lr = np.asarray(jax.vmap(lr_schedule(cfg))(jnp.arange(steps + 1)))
        assert np.all(lr[steps // 2:start] == lr[steps // 2]) and lr[steps] < lr[steps // 2], (steps, lr)
        said: list[str] = []
        with pytest.raises(Stop):
            run_training(cfg, log=said.append, progress=False)
        hits = [m for m in said if m.startswith("warning: a decay of 1 step changes nothing")]
        assert bool(hits) == warned, (steps, said)
        if warned:
            assert "decay_fraction of the QAT steps" in hits[0]


# ------------------------------------------------------------------------------------------------
# export: fake-quant HF folder, TQ1_0/TQ2_0 GGUF
# ------------------------------------------------------------------------------------------------


def test_export_hf_fake_quant_has_at_most_three_values_per_group(qat_runs, tmp_path):
    run = qat_runs["root"] / "two"
    cfg, model = load_params_for_inference(run)
    ternary = flat_params(model)
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    man = read_json(tmp_path / "bf16" / MANIFEST_NAME)
    assert man["quantization"]["granularity"] == "per_row" and "fake-quantized" in man["quantization"]["stored"]
    assert "quantization_config" not in read_json(tmp_path / "bf16" / "config.json")
    want = to_official({k: v.astype(ml_dtypes.bfloat16) for k, v in ternary.items()}, cfg.model)
    names = ternary_hf_names(cfg.model, TernarySpec())
    with SafetensorsSource(tmp_path / "bf16") as src:
        for n in src.entries:
            w = src.get(n)
            np.testing.assert_array_equal(w.astype(np.float32), want[n].astype(np.float32), err_msg=n)
            if n in names:
                assert max(len(np.unique(r)) for r in w) <= 3, n  # at most 3 values per scale group (row)
                assert len(np.unique(w)) > 3  # ... but not per tensor: the rows have their own scales
    # the μP-folded Llama layout scales whole tensors (o_proj, down_proj by scale_depth/sqrt(L)): still ternary
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "llama"), "--layout", "llama"]) == 0
    assert "quantization" in read_json(tmp_path / "llama" / MANIFEST_NAME)
    with SafetensorsSource(tmp_path / "llama") as src:
        o = src.get("model.layers.1.self_attn.o_proj.weight")
        assert max(len(np.unique(r)) for r in o) <= 3
        np.testing.assert_allclose(np.abs(o).max(axis=1), np.abs(want["model.layers.1.self_attn.o_proj.weight"]
                                                                 .astype(np.float32)).max(axis=1)
                                   * cfg.model.residual_scale, rtol=1e-2)
    # float32: the exported model's logits equal the QAT model's fake-quant forward (B14)
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "f32")]) == 0
    back = flat_params(import_hf(tmp_path / "f32", tmp_path / "reimp").params)
    ids = np.random.default_rng(5).integers(0, cfg.model.vocab_size, (2, 20)).astype(np.int32)
    np.testing.assert_allclose(jax_logits(cfg.model, back, ids), jax_logits(cfg.model, ternary, ids), atol=1e-4)


def _tq_cfg(tied: bool = True):
    return tiny_cfg(tied=tied, hidden=256, inter=256, heads=4, kv=2, layers=2)  # every row a multiple of 256


@pytest.mark.parametrize("granularity,outtype", [("per_row", "tq2_0"), ("per_tensor", "tq1_0"), ("per_row", "tq1_0")])
def test_gguf_tq_round_trip_reproduces_the_ternary_weights(tmp_path, tiny_tokenizer_dir, granularity, outtype):
    cfg = _tq_cfg(tied=granularity == "per_row")
    spec = TernarySpec(granularity=granularity)
    q = ternarize(random_params(cfg, seed=33), cfg, spec)
    path = tmp_path / "t.gguf"
    write_gguf(q, cfg, path, outtype=outtype, tokenizer_dir=tiny_tokenizer_dir, ternary=spec)
    tens = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tens["blk.0.attn_q.weight"].tensor_type.name == outtype.upper()
    assert tens["blk.1.ffn_down.weight"].tensor_type.name == outtype.upper()
    assert tens["token_embd.weight"].tensor_type.name == "F16" and tens["output_norm.weight"].tensor_type.name == "F32"
    back = read_gguf_params(path, cfg)
    hf_q, hf_back = to_official(q, cfg), to_official(back, cfg)
    for n in ternary_hf_names(cfg, spec):
        codes, s = recover_codes(hf_q[n], granularity)
        per = hf_q[n].size // s.size
        s16 = np.repeat(s.astype(np.float16).astype(np.float32), per).reshape(hf_q[n].shape)
        # exactly the ternary codes times the fp16-rounded scale; the dequantized magnitude is s, not 1/s
        np.testing.assert_array_equal(hf_back[n], codes.astype(np.float32) * s16, err_msg=n)
        np.testing.assert_allclose(hf_back[n], hf_q[n], rtol=1e-3, atol=0, err_msg=n)
    np.testing.assert_array_equal(back["norm"], q["norm"])
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 16)).astype(np.int32)
    ref = jax_logits(cfg, q, ids)
    assert np.max(np.abs(jax_logits(cfg, back, ids) - ref)) <= 1e-2 * np.max(np.abs(ref))


def test_gguf_tq_refuses_what_it_cannot_hold_exactly(tmp_path, tiny_tokenizer_dir, qat_runs, capsys):
    cfg = _tq_cfg()
    # per-group scales of 32 columns: one scale per 256-block is not enough (before any weight is read)
    with pytest.raises(ConvertError, match=r"model.layers.0.self_attn.q_proj.weight \(blk.0.attn_q.weight\) has a "
                                           r"ternary scale every 32 input columns") as e:
        check_ternary_outtype(cfg, "tq2_0", TernarySpec(granularity="per_group", group_size=32))
    _one_line(e.value)
    check_ternary_outtype(cfg, "tq2_0", TernarySpec(granularity="per_group", group_size=256))  # exact: allowed
    # high-precision weights: refused, naming the tensor and the block
    hp = random_params(cfg, seed=34)
    with pytest.raises(ConvertError, match=r"model.layers.0.self_attn.q_proj.weight \(blk.0.attn_q.weight\) is not "
                                           r"ternary per 256-column block: row 0, columns 0..255 holds \d+ distinct") as e:
        write_gguf(hp, cfg, tmp_path / "hp.gguf", outtype="tq2_0", tokenizer_dir=tiny_tokenizer_dir)
    _one_line(e.value)
    assert not (tmp_path / "hp.gguf").exists()
    # imported ternary weights without QAT settings are accepted (e.g. a BitCPM4 release)
    q = ternarize(hp, cfg, TernarySpec(granularity="per_row"))
    check_ternary_blocks(q, cfg, "tq2_0", ternary_checkpoint=False)
    # rows that are not a multiple of 256: the tiny QAT run (hidden 64) through the CLI
    run = qat_runs["root"] / "two"
    out = tmp_path / "g"
    capsys.readouterr()
    assert main(["export", "gguf", "--checkpoint", str(run), "--out", str(out), "--outtype", "tq2_0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --outtype tq2_0: model.layers.0.self_attn.q_proj.weight "
                                               "(blk.0.attn_q.weight) has rows of 64 input columns"), err
    assert not out.exists()


@pytest.mark.llamacpp
@pytest.mark.skipif(__import__("os").environ.get("MINICPM4_LLAMACPP") != "1",
                    reason="opt-in: set MINICPM4_LLAMACPP=1 (builds llama-cpp-python from source once, 15-30 min) "
                           "and run with -m llamacpp")
@pytest.mark.parametrize("outtype", ["tq2_0", "tq1_0"])
def test_gguf_tq_logits_in_llamacpp(tmp_path, tiny_tokenizer_dir, outtype):
    """llama.cpp itself runs the ternary GGUF: its logits against the JAX model with the same ternary weights.

    llama.cpp's TQ kernels multiply ternary weights by activations quantized to 8 bits (Q8_K), so the match is
    approximate: the bound is 2% of the largest logit (measured errors are printed).
    """
    import subprocess

    from test_gguf_export import REPO

    cfg = _tq_cfg(tied=False)
    spec = TernarySpec(granularity="per_row")
    q = ternarize(random_params(cfg, seed=41), cfg, spec)
    path = tmp_path / "t.gguf"
    write_gguf(q, cfg, path, outtype=outtype, tokenizer_dir=tiny_tokenizer_dir, ternary=spec)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids[0])
    proc = subprocess.run(["bash", str(REPO / "scripts" / "verify_gguf_llamacpp.sh"), str(path), str(tmp_path / "ids.npy"),
                           str(tmp_path / "scores.npy")], cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    scores = np.load(tmp_path / "scores.npy")
    ref = jax_logits(cfg, read_gguf_params(path, cfg), ids)[0]  # the exact dequantized weights of the file
    err = float(np.max(np.abs(scores - ref)))
    top1 = float(np.mean(np.argmax(scores, -1) == np.argmax(ref, -1)))
    print(f"llama.cpp {outtype.upper()} vs JAX: max|dlogit| {err:.3e} of max|logit| {np.max(np.abs(ref)):.3e}, "
          f"top-1 agreement {top1:.2f}")
    assert err <= 2e-2 * float(np.max(np.abs(ref)))
