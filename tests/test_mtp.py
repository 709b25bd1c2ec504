"""The MTP module: forward and loss against a hand computation, label alignment, training, spec-decode draft."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig, load_config
from minicpm4_jax.nn import MiniCPM4
from minicpm4_jax.nn.mtp import mtp_distill_loss, mtp_feature_loss, mtp_loss

from test_train import REPO, corpus, cache_dir, tiny_cfg  # noqa: F401  (fixtures)

CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, dim_model_base=8, scale_emb=12.0,
                  scale_depth=1.4, mtp=True)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_mtp_logits_and_loss_against_hand_computation():
    model = MiniCPM4(CFG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 9)), jnp.int32)  # inputs x_0..x_8
    targets = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 9)), jnp.int32)  # x_1..x_9
    hidden = model.hidden_states(ids)
    got = np.asarray(model.mtp_logits(hidden, targets))

    # by hand: u = fc([rms1(emb[x_{i+1}] * scale_emb) ; rms2(h_i)]), one decoder layer with residual scale
    # scale_depth / sqrt(L + 1), no final norm, / width_mult, tied head
    mtp = model.mtp
    emb = np.asarray(model.embed_tokens.embedding[...])
    e = emb[np.asarray(targets)] * CFG.scale_emb
    h = np.asarray(hidden)
    u = np.concatenate([_rms(e, np.asarray(mtp.input_norm1[...]), CFG.rms_norm_eps),
                        _rms(h, np.asarray(mtp.input_norm2[...]), CFG.rms_norm_eps)], axis=-1) @ np.asarray(mtp.fc[...])
    from minicpm4_jax.nn.rope import rope_tables

    layer_cfg = dataclasses.replace(CFG, num_hidden_layers=4)  # residual scale 1.4 / sqrt(3 + 1) = 0.7
    assert abs(layer_cfg.residual_scale - 0.7) < 1e-12
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    cos, sin = rope_tables(pos, layer_cfg)
    o = np.asarray(mtp.layer(jnp.asarray(u, jnp.float32), cos, sin, pos, layer_cfg))
    want = (o / (CFG.hidden_size / CFG.dim_model_base)) @ emb.T
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)

    # loss: position i predicts targets[:, i + 1]; the last position has no label
    logp = want - np.log(np.sum(np.exp(want - want.max(-1, keepdims=True)), -1, keepdims=True)) - want.max(-1, keepdims=True)
    t = np.asarray(targets)
    hand = -np.mean([logp[b, i, t[b, i + 1]] for b in range(2) for i in range(8)])
    assert abs(float(mtp_loss(jnp.asarray(got), targets)) - hand) < 1e-4


def test_mtp_loss_labels_at_sequence_end():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((2, 6, 11)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (2, 6)), jnp.int32)
    base = float(mtp_loss(logits, targets))
    # the last position's logits are never scored ...
    assert float(mtp_loss(logits.at[:, -1].set(100.0), targets)) == base
    # ... targets[:, 0] (x_1, the input of position 0) is not a label, targets[:, -1] is (for position T-2)
    assert float(mtp_loss(logits, targets.at[:, 0].set((targets[:, 0] + 1) % 11))) == base
    assert float(mtp_loss(logits, targets.at[:, -1].set((targets[:, -1] + 1) % 11))) != base


def test_distill_loss_against_hand_kl_with_padding_rows_and_alignment():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 5, 7)).astype(np.float32)
    p = rng.standard_normal((2, 5, 7)).astype(np.float32)
    q[..., -1] = p[..., -1] = -np.inf  # a vocabulary padding row: -inf in both, contributes nothing

    def logsm(x):
        m = x[..., :-1].max(-1, keepdims=True)
        out = np.full_like(x, -np.inf)
        out[..., :-1] = x[..., :-1] - m - np.log(np.exp(x[..., :-1] - m).sum(-1, keepdims=True))
        return out

    lq, lp = logsm(q), logsm(p)
    # position i of the draft against position i + 1 of the base
    hand = np.mean([(np.exp(lp[b, i + 1, :-1]) * (lp[b, i + 1, :-1] - lq[b, i, :-1])).sum()
                    for b in range(2) for i in range(4)])
    got = mtp_distill_loss(jnp.asarray(q), jnp.asarray(p))
    assert abs(float(got) - hand) < 1e-5 and hand > 0.1
    # zero when the draft equals the shifted base; the gradient is finite and reaches only the draft's logits
    assert abs(float(mtp_distill_loss(jnp.asarray(np.roll(p, -1, axis=1)), jnp.asarray(p)))) < 1e-6
    gq, gp = jax.grad(mtp_distill_loss, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(p))
    assert np.isfinite(np.asarray(gq)).all() and not np.asarray(gp).any()
    assert not np.asarray(gq)[:, -1].any()  # the last position has no target


def test_feature_loss_is_smooth_l1_against_the_next_hidden_state():
    rng = np.random.default_rng(3)
    o = rng.standard_normal((2, 6, 8)).astype(np.float32) * 2
    h = rng.standard_normal((2, 6, 8)).astype(np.float32)
    d = np.abs(o[:, :-1] - h[:, 1:])
    hand = np.where(d < 1, 0.5 * d * d, d - 0.5).mean()
    got = mtp_feature_loss(jnp.asarray(o), jnp.asarray(h))
    assert abs(float(got) - hand) < 1e-5
    _, gh = jax.grad(mtp_feature_loss, argnums=(0, 1))(jnp.asarray(o), jnp.asarray(h))
    assert not np.asarray(gh).any()  # the base's states are the target, not trained by this loss


def test_unrolled_depths_equal_the_chained_draft_the_engine_runs():
    """Depth d at position p = the layer run causally on [depth-1 inputs at 0 .. p-d+1, then the chain's inputs of
    depths 2 .. d at p-d+2 .. p] (what the draft cache holds when the chain reaches p), read at its last row.

    Under LongRoPE (field_faults B09 for the chained depths: ``mtp_train_depth >= 2`` trains through
    ``MTPHead.unrolled``, which builds its own rotary tables): distinct long factors and attention scaling != 1, so
    an unrolled chain that rotated without the model's rope_scaling differs from ``mtp_features`` and the reference
    (plain RoPE is the same code with unit factors).
    """
    from minicpm4_jax.config import RopeScalingConfig
    from minicpm4_jax.nn.mtp import mtp_layer_config
    from minicpm4_jax.nn.rope import attention_scaling, rope_tables

    cfg = dataclasses.replace(CFG, rope_scaling=RopeScalingConfig(
        short_factor=(1.0,) * 4, long_factor=(1.0, 3.0, 9.0, 27.0), original_max_position_embeddings=16),
        initializer_range=0.5)
    assert attention_scaling(cfg) > 1.1
    model = MiniCPM4(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(4)
    b, t, depth = 2, 10, 3
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    nxt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    hidden = model.hidden_states(ids)
    outs = model.mtp_unrolled(hidden, nxt, depth)
    assert [o.shape for o in outs] == [(b, t - d + 1, cfg.hidden_size) for d in (1, 2, 3)]
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(model.mtp_features(hidden, nxt)), atol=1e-6)

    mtp, cfg_m = model.mtp, mtp_layer_config(cfg)
    emb = model.embed_tokens.encode(nxt, jnp.float32) * cfg.scale_emb
    u = [mtp.inputs(emb, hidden, cfg)]  # depth-1 inputs at every position
    for d in (2, 3):  # depth d at position p: stand-in = depth d-1 output at p - 1, token x_{p+1}
        u.append(mtp.inputs(emb[:, d - 1:], outs[d - 2][:, :-1], cfg))
    for d in (2, 3):
        for p in range(d - 1, t):
            seq = [u[0][:, :p - d + 2]] + [u[m - 1][:, p - d + m - (m - 1):p - d + m - (m - 1) + 1]
                                           for m in range(2, d + 1)]
            x = jnp.concatenate(seq, axis=1)
            pos = jnp.broadcast_to(jnp.arange(p + 1), (b, p + 1))
            cos, sin = rope_tables(pos, cfg_m)
            want = mtp.layer(x, cos, sin, pos, cfg_m)[:, -1]
            np.testing.assert_allclose(np.asarray(outs[d - 1][:, p - d + 1]), np.asarray(want), atol=2e-5,
                                       err_msg=f"depth {d} position {p}")
    with pytest.raises(ValueError, match="depth=10 must be in"):
        model.mtp_unrolled(hidden, nxt, 10)


def test_decoder_draft_equals_the_mtp_head_under_longrope():
    """field_faults B09 for the speculative decoder's draft layer (infer/spec.py): its first draft distribution,
    from the prefilled draft cache at a position far past original_max_position_embeddings, equals the training-time
    MTP head's (MiniCPM4.mtp_logits over the whole text) with distinct long factors and the attention scaling in
    force. CFG has no rope_scaling, and greedy spec output stays exact with any draft, so no other test sees a draft
    that rotates without the scaling."""
    from minicpm4_jax.config import RopeScalingConfig
    from minicpm4_jax.infer import InferenceEngine, SamplingParams
    from minicpm4_jax.infer.spec import SpeculativeDecoder, _draft_propose

    rs = RopeScalingConfig(short_factor=(1.0, 1.0, 1.0, 1.0), long_factor=(1.0, 3.0, 9.0, 27.0),
                           original_max_position_embeddings=16)
    # head_dim 8: 4 factors; initializer_range 0.5: attention far from uniform, so the rotations matter
    cfg = dataclasses.replace(CFG, max_position_embeddings=256, rope_scaling=rs, initializer_range=0.5)
    model = MiniCPM4(cfg, rngs=nnx.Rngs(2))
    dec = SpeculativeDecoder(InferenceEngine(model, prefill_chunk=64), model.mtp, num_draft=1)
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, cfg.vocab_size, 90)]
    st = dec.prefill([prompt], 100, lambda lg: jnp.argmax(lg, -1).astype(jnp.int32))
    n = st.lengths[0]
    _, _, q = _draft_propose(dec.engine.weights, dec.draft, st.dcache, st.h_last, st.tok, jnp.asarray([n - 1]),
                             jnp.zeros((1,), jnp.uint32), 1, k=1, sampling=SamplingParams(temperature=1.0),
                             vocab_limit=None, **dec._kw)
    ids = jnp.asarray([prompt + [int(st.tok[0])]], jnp.int32)  # x_0 .. x_n
    hidden = model.hidden_states(ids[:, :-1])
    want = jax.nn.softmax(model.mtp_logits(hidden, ids[:, 1:])[0, -1])  # position n - 1 predicts x_{n+1}
    np.testing.assert_allclose(np.asarray(q[0, 0, :cfg.vocab_size]), np.asarray(want), atol=2e-5, rtol=1e-4)
    # the scaling matters at these positions: the head without it gives another distribution
    plain = dataclasses.replace(cfg, rope_scaling=None)
    other = MiniCPM4(plain, rngs=nnx.Rngs(2))
    h_plain = other.hidden_states(ids[:, :-1])
    assert float(jnp.max(jnp.abs(jax.nn.softmax(other.mtp_logits(h_plain, ids[:, 1:])[0, -1]) - want))) > 1e-3


def test_text_acceptance_equals_the_decoders_rounds_on_its_own_text():
    """On the model's own greedy text, the teacher-forced chain from position n - 1 accepts exactly what the
    decoder's round with n cached tokens accepted (FR-Spec too). A 6-token vocabulary so that a random draft agrees
    often enough to test the counting."""
    from minicpm4_jax.infer import InferenceEngine
    from minicpm4_jax.infer.spec import SpeculativeDecoder, chain_counts, text_acceptance

    model = MiniCPM4(dataclasses.replace(CFG, vocab_size=6, max_position_embeddings=128, tie_word_embeddings=False),
                     rngs=nnx.Rngs(1))
    eng = InferenceEngine(model)
    prompt = [1, 4, 2, 5, 3]
    for fr in (None, [0, 1, 3, 4]):
        dec = SpeculativeDecoder(eng, model.mtp, num_draft=3, fr_spec_ids=fr)
        accepted_per_round, orig = [], dec._unpack

        def rec(packed, _orig=orig, _acc=accepted_per_round):
            out = _orig(packed)
            _acc.append(out[0][0])
            return out

        dec._unpack = rec  # every round's result passes through here in order
        gen = dec.generate([prompt], 64)
        text = np.asarray([prompt + gen.tokens[0]])
        rounds, n0 = [], len(prompt)  # (cached tokens before the round, accepted drafts)
        for a in accepted_per_round[:gen.decode_steps]:
            rounds.append((n0, a))
            n0 += a + 1
        counts = chain_counts(model, text, 3, fr)
        checked = [(n0, a) for n0, a in rounds if n0 - 1 < counts.shape[1]]
        accepted = [a for _, a in checked]
        assert len(checked) >= 8 and sum(accepted) >= 4 and min(accepted) < 3, rounds
        assert [int(counts[0, n0 - 1]) for n0, _ in checked] == accepted, (rounds, counts)
        ta = text_acceptance(model, text, 3, fr)
        assert ta["positions"] == counts.size and abs(ta["acceptance"] - 1 - counts.mean()) < 1e-12
        assert len(ta["rate"]) == 3
    with pytest.raises(ConfigError, match="num_draft=0"):
        text_acceptance(model, text, 0)
    with pytest.raises(ConfigError, match="length > num_draft"):
        text_acceptance(model, text[:, :4], 3)
    # break test: an out-of-range id made NaN states whose argmaxes "agreed" everywhere (acceptance 4.0 of 4)
    for bad, msg in ((np.where(np.arange(text.shape[1]) == 9, 6, text), "token id 6 is outside"),
                     (np.where(np.arange(text.shape[1]) == 9, -1, text), "token id -1 is outside"),
                     (text.astype(np.float32), "must be integer ids"), (text > 2, "must be integer ids"),
                     (text[:0], r"rows >= 1"), (np.zeros((1, 130), np.int32), "max_position_embeddings=128")):
        with pytest.raises(ConfigError, match=msg):
            text_acceptance(model, bad, 3)
    for bs in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="batch_size="):
            text_acceptance(model, text, 3, batch_size=bs)


def test_mtp_detach_keeps_the_draft_losses_out_of_the_base_layers(tmp_path):
    """One train step (no global clipping, which couples all gradients): with mtp_detach the base's layers get
    exactly the update of the next-token loss alone; without it the draft's losses move them too."""
    from minicpm4_jax.train.step import init_train_state, make_train_step

    batch = jnp.asarray(np.random.default_rng(6).integers(3, 500, (4, 33)), jnp.int32)

    def layers_after_one_step(*extra):
        cfg = load_config(None, ["model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128",
                                 "model.num_hidden_layers=2", "model.num_attention_heads=4",
                                 "model.num_key_value_heads=2", "model.max_position_embeddings=64",
                                 "model.dim_model_base=16", "model.mtp=true", "data.seq_len=32", "data.tokenizer_vocab_size=512",
                                 "optimizer.grad_clip=0", "optimizer.warmup_steps=1", "mtp_feature_weight=1",
                                 f"out_dir={tmp_path}", *extra])
        graphdef, state = init_train_state(cfg, 0)
        state, m = make_train_step(cfg, graphdef)(state, batch)
        assert np.isfinite(float(m["mtp_loss"])) and np.isfinite(float(m["loss"]))
        return [np.asarray(x) for x in jax.tree.leaves(state.params["layers"])]

    ntp_only = layers_after_one_step("mtp_loss_weight=0", "mtp_feature_weight=0")
    detached = layers_after_one_step("mtp_detach=true")
    joint = layers_after_one_step()
    assert all(np.array_equal(a, b) for a, b in zip(detached, ntp_only))
    assert not all(np.array_equal(a, b) for a, b in zip(joint, ntp_only))


def test_draft_objectives_bad_values_refused():
    for bad, msg in (("mtp_distill=1.5", "mtp_distill=1.5 must be in"), ("mtp_distill=-0.1", "mtp_distill=-0.1"),
                     ("mtp_feature_weight=-1", "mtp_feature_weight=-1"),
                     ("mtp_feature_weight=.nan", "mtp_feature_weight=nan"), ("mtp_train_depth=0", "mtp_train_depth=0"),
                     ("mtp_train_depth=99999", "mtp_train_depth=99999 must be in"),
                     ("mtp_loss_weight=.inf", "mtp_loss_weight=inf must be a finite")):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, [bad])
    # without the MTP head they do nothing: the run says so (test below), a resume ignores them
    from minicpm4_jax.config import inactive_draft_options
    from minicpm4_jax.train.checkpoint import resume_differences

    on = ["mtp_distill=0.5", "mtp_feature_weight=1", "mtp_train_depth=2", "mtp_detach=true"]
    off_cfg = load_config(None, ["model.mtp=false", *on])
    assert inactive_draft_options(off_cfg) == ["mtp_distill=0.5", "mtp_feature_weight=1.0", "mtp_train_depth=2",
                                               "mtp_detach=True"]
    assert resume_differences(off_cfg, load_config(None, ["model.mtp=false"])) == ([], [])
    _, refused = resume_differences(load_config(None, ["model.mtp=true", *on]), load_config(None, ["model.mtp=true"]))
    assert len(refused) == 4 and inactive_draft_options(load_config(None, ["model.mtp=true", *on])) == []


def test_parameter_count_and_disk_estimate_include_the_draft_head_a_run_trains():
    """Earlier sessions: the start-up "params" line and the free-disk estimate (required_free_bytes) left out the MTP
    draft head (cpu_tiny with MTP: 7.05M parameters trained, 6.23M printed). ``mtp_params`` counts it exactly."""
    from minicpm4_jax.train.loop import MIN_FREE_MB, required_free_bytes, trained_params

    for cfg in (load_config("cpu_tiny"), load_config("cpu_tiny_sparse", ["model.mtp=true"]),
                load_config("cpu_tiny", ["model.mtp=false"])):
        model = nnx.eval_shape(lambda: MiniCPM4(cfg.model, rngs=nnx.Rngs(0)))  # noqa: B023
        params = nnx.to_flat_state(nnx.state(model, nnx.Param))
        sizes = {"/".join(map(str, k)): int(np.prod(v.shape)) for k, v in params}
        draft = sum(n for k, n in sizes.items() if k.startswith("mtp/"))
        assert cfg.model.mtp_params() == draft and (draft > 0) == cfg.model.mtp
        assert trained_params(cfg) == sum(sizes.values()) == cfg.model.num_params() + draft
        assert required_free_bytes(cfg) == MIN_FREE_MB * 2**20 + 2 * 12 * sum(sizes.values())
    assert round(trained_params(load_config("cpu_tiny")) / 1e6, 2) == 7.05


def test_model_without_mtp_says_so():
    m = MiniCPM4(dataclasses.replace(CFG, mtp=False), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model.mtp=true"):
        m.mtp_logits(jnp.zeros((1, 3, 32)), jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ConfigError, match="mtp_loss_weight=-1"):
        load_config(None, ["mtp_loss_weight=-1"])


def test_training_with_the_distill_and_feature_objectives_lowers_them(corpus, cache_dir, tmp_path):  # noqa: F811
    """The same 16 steps with the draft objectives on and off: on, the draft ends closer to the base model's
    next-position distribution (KL) and its features closer to the next hidden states, on held-out batches."""
    from minicpm4_jax.train.checkpoint import load_params_for_inference
    from minicpm4_jax.train.loop import run_training

    got = {}
    for name, extra in (("on", {"mtp_distill": "1.0", "mtp_feature_weight": "1.0", "mtp_train_depth": "2"}),
                        ("off", {})):
        cfg = tiny_cfg(corpus, cache_dir, tmp_path / name, steps=16, log_every=4, eval_every=16,
                       **{"model.mtp": "true", "mtp_loss_weight": "1.0", "optimizer.decay_steps": 4, **extra})
        s = run_training(cfg, log=lambda m: None, progress=False)
        if name == "on":
            for key in ("mtp_kl", "mtp_feature_loss", "mtp_loss_depth2"):  # logged and summarised
                assert np.isfinite([h[key] for h in s["history"]]).all() and s[key] == s["history"][-1][key]
        else:
            assert "mtp_kl" not in s["history"][-1]
        _, model = load_params_for_inference(tmp_path / name / "checkpoints")
        ids = jnp.asarray(np.random.default_rng(5).integers(3, 200, (4, 33)), jnp.int32)
        hidden = model.hidden_states(ids[:, :-1])
        feats, feats2 = model.mtp_unrolled(hidden, ids[:, 1:], 2)
        got[name] = (float(mtp_distill_loss(model.logits(feats), model.logits(hidden))),
                     float(mtp_feature_loss(feats, hidden)),
                     float(mtp_distill_loss(model.logits(feats2), model.logits(hidden[:, 1:]))))
    # the second chain depth, trained only in "on", agrees better with the base too
    assert all(on < 0.8 * off for on, off in zip(got["on"], got["off"])), got


def test_draft_options_without_the_head_are_reported(corpus, cache_dir, tmp_path):  # noqa: F811
    """Found by a fresh-eyes test: with model.mtp=false the draft options were ignored silently."""
    from minicpm4_jax.train.loop import run_training

    said: list[str] = []
    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "run", steps=4, log_every=2, eval_every=4,
                   **{"model.mtp": "false", "mtp_feature_weight": "1.0", "mtp_detach": "true",
                      "optimizer.warmup_steps": 1, "optimizer.decay_steps": 1})
    s = run_training(cfg, log=said.append, progress=False)
    assert s["mtp_loss"] is None
    assert sum("model.mtp=false: mtp_feature_weight=1.0, mtp_detach=True shape the MTP draft head" in m
               and "no effect" in m for m in said) == 1, said


def test_training_with_mtp_lowers_both_losses_and_drafts_from_the_checkpoint(corpus, cache_dir, tmp_path,  # noqa: F811
                                                                             capsys):
    from minicpm4_jax.infer import InferenceEngine
    from minicpm4_jax.infer.spec import SpeculativeDecoder
    from minicpm4_jax.train.checkpoint import load_params_for_inference
    from minicpm4_jax.train.loop import run_training

    cfg = tiny_cfg(corpus, cache_dir, tmp_path / "run", steps=24, log_every=4, eval_every=12,
                   **{"model.mtp": "true", "checkpoint.save_every": 12, "optimizer.decay_steps": 4})
    s = run_training(cfg, log=lambda m: None, progress=False)
    hist = s["history"]
    assert hist[-1]["mtp_loss"] < hist[0]["mtp_loss"] - 0.5, [h["mtp_loss"] for h in hist]
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.5
    _, model = load_params_for_inference(tmp_path / "run" / "checkpoints")
    assert model.cfg.mtp and hasattr(model, "mtp")
    eng = InferenceEngine(model)
    prompt = [1, 5, 9, 13, 7]
    plain = eng.generate([prompt], 20)
    spec = SpeculativeDecoder(eng, model.mtp, num_draft=3).generate([prompt], 20)
    assert spec.tokens == plain.tokens

    # the MTP weights are saved with the model at every checkpoint and keep training between them
    _, at12 = load_params_for_inference(tmp_path / "run" / "checkpoints", 12)
    assert not np.allclose(np.asarray(model.mtp.fc[...]), np.asarray(at12.mtp.fc[...]))

    # the command line: --spec-decode (+ FR-Spec from a ranking built for the run) prints the plain greedy text
    import sys

    from minicpm4_jax.cli import main

    sys.path.insert(0, str(REPO / "scripts"))
    import build_fr_spec

    run = str(tmp_path / "run")
    assert build_fr_spec.main(["--checkpoint", run, "--size", "64", "--no-pt"]) == 0
    outs = []
    for extra in ([], ["--spec-decode"], ["--spec-decode", "--fr-spec-vocab", "64", "--num-draft", "2"],
                  ["--spec-decode", "--draft-window", "4"], ["--spec-decode", "--draft-window", "0"]):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", run, "--prompt", "def ", "--max-new-tokens", "12", "--no-stream",
                     *extra]) == 0
        o = capsys.readouterr()
        outs.append(o.out)
        if extra:
            assert "acceptance length" in o.err
    assert outs[0] == outs[1] == outs[2] == outs[3] == outs[4]
    # drafts that never fit below the maximum positions: every token decoded plainly, reported as such (it
    # printed "acceptance length nan")
    k = model.cfg.max_position_embeddings - 3
    capsys.readouterr()
    assert main(["generate", "--checkpoint", run, "--prompt", "def ", "--max-new-tokens", "2", "--no-stream",
                 "--spec-decode", "--num-draft", str(k)]) == 0
    err = capsys.readouterr().err
    assert "no speculative round ran" in err and "nan" not in err, err
    assert main(["generate", "--checkpoint", run, "--prompt", "x", "--spec-decode", "--fr-spec-vocab", "99"]) == 2
    assert "freq_99.txt does not exist" in capsys.readouterr().err

    # exports carry the base model only; the manifest says where the draft head is
    import json

    from safetensors.numpy import load_file

    hf = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", run, "--out", str(hf), "--layout", "minicpm"]) == 0
    names = set(load_file(str(next(hf.glob("*.safetensors")))))
    assert names and not any("mtp" in n or "fc" in n for n in names)
    assert "minicpm4 export eagle" in json.loads((hf / "minicpm4_manifest.json").read_text())["mtp_draft"]

    # break-test regressions: refusals are one line on stderr, exit 2, nothing on stdout (the prompt is echoed
    # only with the first generated text)
    for bad, msg in ((["--top-p", "0"], "top_p=0.0 must be in"), (["--stop", ""], "stop string is empty"),
                     (["--seed", "-1"], "seed -1 is outside"), (["--max-new-tokens", "0"], "max_new_tokens=0"),
                     (["--spec-decode", "--fr-spec", str(tmp_path)], "is a directory"),
                     (["--spec-decode", "--fr-spec-vocab", "0"], "--fr-spec-vocab=0 must be in [1, vocab_size="),
                     (["--spec-decode", "--draft-window", "-3"], "--draft-window=-3 must be >= 0"),
                     (["--draft-window", "7"], "--draft-window shapes the draft of --spec-decode"),
                     (["--num-draft", "2"], "--num-draft shapes the draft of --spec-decode")):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", run, "--prompt", "def ", *bad]) == 2, bad
        o = capsys.readouterr()
        assert o.out == "" and msg in o.err and len(o.err.strip().splitlines()) == 1, (bad, o)


_CHAIN_WORKER = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from minicpm4_jax.config import load_config
from minicpm4_jax.sharding import make_mesh
from minicpm4_jax.train.step import activation_sharding, init_train_state, make_loss_fn

assert jax.device_count() == 8, jax.devices()
seq, depth = 12, 4
base = {"model.vocab_size": 512, "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
        "model.max_position_embeddings": 128, "model.dim_model_base": 16, "model.rope_scaling": "null",
        "model.mtp": "true", "data.seq_len": seq, "data.tokenizer_vocab_size": 384, "data.batch_size": 8, "mtp_train_depth": depth}
batch = jnp.asarray(np.random.default_rng(1).integers(0, 384, (8, seq + 1)), jnp.int32)
out = {}
for mesh in [(1, 1, 1), (2, 2, 2)]:
    o = {**base, "mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]}
    cfg = load_config("cpu_tiny", [f"{k}={v}" for k, v in o.items()])
    m = make_mesh(cfg.mesh)
    gd, st = init_train_state(cfg, 0, m)
    loss, aux = jax.jit(make_loss_fn(cfg, gd, activation_sharding(m)))(st.params, batch, st.step)
    out[str(mesh)] = [float(loss)] + [float(aux["mtp_loss" if d == 1 else f"mtp_loss_depth{d}"])
                                      for d in range(1, depth + 1)]
print("RESULT " + json.dumps(out))
'''


@pytest.mark.xdist_group("multidevice")
def test_chained_depths_on_a_2x2x2_mesh_equal_one_device():
    """``mtp_train_depth`` > 1 with a short window on a (2, 2, 2) mesh: left to sharding propagation, XLA swapped
    the rows of two batch shards of the MTP layer's depth-1 input (every depth's loss off by ~1.5e-2, also depth
    1's); :meth:`MTPHead.unrolled` now constrains each depth's inputs to the batch sharding."""
    import json
    import os
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env(JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu",
                         XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    r = subprocess.run([sys.executable, "-c", _CHAIN_WORKER], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"worker failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    np.testing.assert_allclose(res["(2, 2, 2)"], res["(1, 1, 1)"], rtol=1e-5)


@pytest.mark.parametrize("depth,distill", [(1, False), (2, True)])
def test_mfu_counts_the_draft_heads_flops(depth, distill):
    """MFU's model FLOPs included the base model only: a run with the MTP head (cpu_tiny) reported MFU 32% where its
    FLOPs (the draft's decoder layer, fc and second head matmul, 43% more) give 45% (break test 91). The draft's part
    is counted here from the initialised module's own matrices: 6 x its matrices (norms aside), its vocabulary projection
    (the shared head) and one layer of attention scores per trained depth, plus the distillation's forward head."""
    import math

    from flax import nnx

    from minicpm4_jax.train.metrics import mfu
    from minicpm4_jax.train.step import init_model

    cfg = load_config("cpu_tiny", ["model.num_hidden_layers=2", "data.seq_len=64"]).model
    t = 64
    model = nnx.eval_shape(lambda: init_model(cfg, 0))
    mats = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param)) if len(x.shape) >= 2)
    heads_dim = cfg.num_attention_heads * cfg.resolved_head_dim
    per_depth = (6 * (mats + cfg.padded_vocab_size * cfg.hidden_size) + 12 * heads_dim * t
                 + (2 * cfg.padded_vocab_size * cfg.hidden_size if distill else 0))
    base = dataclasses.replace(cfg, mtp=False).flops_per_token(t)
    # the paper's MTP (one depth, no distillation) is the default
    got = cfg.flops_per_token(t) if (depth, distill) == (1, False) else cfg.flops_per_token(t, mtp_depth=depth,
                                                                                            mtp_distill=distill)
    assert got == pytest.approx(base + depth * per_depth, rel=1e-12)
    assert mfu(cfg, t, 1000.0, 1e12, mtp_depth=depth, mtp_distill=distill) == pytest.approx(got * 1000.0 / 1e12)
    # a model without the head is unchanged by the draft options
    assert dataclasses.replace(cfg, mtp=False).flops_per_token(t, mtp_depth=3, mtp_distill=True) == base
