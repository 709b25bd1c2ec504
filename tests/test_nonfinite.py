"""Non-finite logits (NaN/Inf in the weights or activations) end a sequence with one clear error instead of being
decoded as token 0 or garbage: plain, batched, sampled, speculative and FR-Spec generation, the CLI and eval."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig
from minicpm4_jax.infer import InferenceEngine, SamplingParams
from minicpm4_jax.infer.engine import NonFiniteLogitsError
from minicpm4_jax.infer.sampling import nonfinite_rows
from minicpm4_jax.infer.spec import SpeculativeDecoder
from minicpm4_jax.nn import MiniCPM4
from minicpm4_jax.nn.mtp import MTPHead

# untied: a poisoned input row (embedding) then touches only the sequences that feed that token
CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, dim_model_base=16, scale_emb=12.0,
                  initializer_range=0.5, tie_word_embeddings=False)
PROMPTS = [[int(x) for x in np.random.default_rng(n).integers(0, 64, n)] for n in (9, 14)]
NEW = 16
FR_IDS = np.arange(0, 256, 2, dtype=np.int32)  # the draft scores 128 of the 256 tokens


def _models(seed=0):
    return MiniCPM4(CFG, rngs=nnx.Rngs(seed)), MTPHead(CFG, rngs=nnx.Rngs(seed + 1))


def _gen(model, mtp, mode, prompts, sampling):
    eng = InferenceEngine(model, prefill_chunk=16)
    if mode in ("spec", "frspec"):
        dec = SpeculativeDecoder(eng, mtp, num_draft=3, fr_spec_ids=FR_IDS if mode == "frspec" else None)
        return dec.generate(prompts, NEW, sampling=sampling, on_nonfinite="keep")
    return eng.generate(prompts, NEW, sampling=sampling, on_nonfinite="keep")


def _poison_token(healthy):
    """``(t, i)``: a token sequence 0 generates as its new token ``i >= 1`` (a decode step) that neither its prompt nor
    its earlier tokens hold, nor any token of the other sequences (prompts and outputs)."""
    others = {t for r in range(1, len(healthy.tokens)) for t in PROMPTS[r] + healthy.tokens[r]}
    out0 = healthy.tokens[0]
    for i in range(1, len(out0) - 2):
        t = out0[i]
        if t not in PROMPTS[0] and t not in out0[:i] and t not in others:
            return t, i
    raise AssertionError(f"no fresh token in {out0} (change the seed)")


def _set_row(model, t, value):
    e = model.embed_tokens.embedding
    e[...] = e[...].at[t].set(value)


@pytest.mark.parametrize("fault", ["nan", "overflow"])
@pytest.mark.parametrize("mode", ["plain", "batched", "sampled", "spec", "frspec"])
def test_nonfinite_logits_end_the_sequence_where_they_start(mode, fault):
    """A NaN embedding row (or one of 3e38, which ``scale_emb`` overflows to Inf) of a token sequence 0 generates at
    a decode step: before, the step after it was decoded silently (greedy: the first NaN's id); now the sequence
    ends there, the error names it and the position, and the other sequence's tokens are untouched."""
    model, mtp = _models()
    # the speculative cases run sequence 0 alone: a batch neighbour whose draft proposes the poisoned token fails
    # too, through the masked-NaN leak pinned by test_a_rejected_drafts_nonfinite_keys_leave_the_neighbour_alone
    prompts = PROMPTS[:1] if mode in ("plain", "spec", "frspec") else PROMPTS
    sampling = SamplingParams(temperature=0.8, top_k=20) if mode == "sampled" else SamplingParams()
    healthy = _gen(model, mtp, mode, prompts, sampling)
    assert healthy.nonfinite == [None] * len(prompts) and set(healthy.finish_reasons) == {"length"}
    t, i = _poison_token(healthy)
    _set_row(model, t, jnp.nan if fault == "nan" else 3e38)
    got = _gen(model, mtp, mode, prompts, sampling)
    pos = len(prompts[0]) + i  # the input t sits there; its logits would give new token i + 1
    assert got.tokens[0] == healthy.tokens[0][:i + 1]
    assert got.finish_reasons[0] == "nonfinite" and got.nonfinite[0] == pos
    assert got.tokens[1:] == healthy.tokens[1:] and got.nonfinite[1:] == [None] * (len(prompts) - 1)
    assert got.finish_reasons[1:] == healthy.finish_reasons[1:]
    with pytest.raises(NonFiniteLogitsError) as e:  # the default: refuse, after the batch, with the whole output
        _gen_raise(model, mtp, mode, prompts, sampling)
    msg = str(e.value)
    assert msg.startswith(f"non-finite logits for sequence 0 at position {pos} (new token {i + 1}): the weights or "
                          "the activations hold NaN/Inf") and "dtype=float32" in msg and "\n" not in msg
    assert e.value.output.tokens == got.tokens and isinstance(e.value, ConfigError)


def _gen_raise(model, mtp, mode, prompts, sampling):
    eng = InferenceEngine(model, prefill_chunk=16)
    if mode in ("spec", "frspec"):
        dec = SpeculativeDecoder(eng, mtp, num_draft=3, fr_spec_ids=FR_IDS if mode == "frspec" else None)
        return dec.generate(prompts, NEW, sampling=sampling)
    return eng.generate(prompts, NEW, sampling=sampling)


@pytest.mark.parametrize("mode", ["batched", "spec"])
def test_an_infinite_head_weight_fails_every_sequence_at_the_prefill(mode):
    """One output-head weight set to +Inf: that token's logit is +-Inf at every position (greedy picked it, or
    NaN's id 0, silently). Every sequence ends at its prompt's last position with no token."""
    model, mtp = _models()
    model.lm_head[...] = model.lm_head[...].at[0, 7].set(jnp.inf)
    out = _gen(model, mtp, mode, PROMPTS, SamplingParams())
    assert out.tokens == [[], []] and out.finish_reasons == ["nonfinite"] * 2
    assert out.nonfinite == [len(p) - 1 for p in PROMPTS]
    with pytest.raises(NonFiniteLogitsError, match=r"^non-finite logits for sequence 0 at position 8 \(new token 0\) "
                                                  r"\(and sequence 1\): "):
        _gen_raise(model, mtp, mode, PROMPTS, SamplingParams())


def test_nonfinite_rows_counts_only_the_sampled_vocabulary():
    lg = jnp.asarray([[0.0, 1.0, 2.0, jnp.nan], [0.0, -jnp.inf, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    assert nonfinite_rows(lg).tolist() == [True, True, False]
    assert nonfinite_rows(lg, vocab_limit=3).tolist() == [False, True, False]  # id 3: padding, never drawn


def test_padding_columns_of_a_padded_vocabulary_are_not_a_fault():
    """The ``-inf`` padding columns (``vocab_pad_multiple``) are never sampled: the first version of the check counted
    them and refused every healthy padded model at its prefill."""
    cfg = dataclasses.replace(CFG, vocab_size=250, vocab_pad_multiple=64)
    assert cfg.padded_vocab_size == 256
    out = InferenceEngine(MiniCPM4(cfg, rngs=nnx.Rngs(0))).generate(PROMPTS, 3)
    assert out.nonfinite == [None, None] and [len(t) for t in out.tokens] == [3, 3]


def test_bad_on_nonfinite_is_refused():
    model, _ = _models()
    with pytest.raises(ConfigError, match=r"^on_nonfinite='skip'; use 'raise'"):
        InferenceEngine(model).generate(PROMPTS, 2, on_nonfinite="skip")


class _Tok:
    """Characters as ids 3..98 (no merges): enough for ``generate`` and ``EvalModel``."""

    bos_id, eos_id, unk_id = 1, 2, 0
    vocab_size = 99
    source, file_hash = "toy", "0" * 64

    def encode(self, text):
        return [3 + (ord(c) - 32) % 96 for c in text]

    def decode(self, ids):
        return "".join(chr(32 + i - 3) if i >= 3 else "" for i in ids)


def test_cli_generate_prints_one_error_line_and_exits_2(monkeypatch, tmp_path, capsys):
    """``minicpm4 generate`` on a checkpoint with a NaN weight printed the NaN's id as text; now one ``error:`` line
    (after the streamed text's line is closed) and status 2, as the other ConfigErrors."""
    import minicpm4_jax.tokenizer as tokenizer_mod
    import minicpm4_jax.train.checkpoint as ckpt_mod
    from minicpm4_jax.cli import main

    model, _ = _models()
    model.lm_head[...] = model.lm_head[...].at[:, 40].set(jnp.nan)  # NaN logits at every position
    monkeypatch.setattr(ckpt_mod, "find_checkpoint_dir", lambda path: tmp_path)
    monkeypatch.setattr(ckpt_mod, "load_params_for_inference", lambda d, step=None: (None, model))
    monkeypatch.setattr(tokenizer_mod, "load_run_tokenizer", lambda run, d: _Tok())
    monkeypatch.setattr(tokenizer_mod, "document_start", lambda run, d, tok: "bos")
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hello", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: non-finite logits for sequence 0 at position 5 (new token 0): the weights or the "
                   "activations hold NaN/Inf (check the checkpoint; bf16 overflow: try dtype=float32)"], err


def test_eval_generate_keeps_the_other_prompts_and_refuses_broken_weights(capsys):
    """EvalModel.generate: one prompt whose logits go non-finite costs only itself (a warning line, its text cut
    there, the others unchanged); a first batch in which every prompt fails (broken weights) raises at once."""
    from minicpm4_jax.eval.model import EvalModel

    model, _ = _models()
    prompts = ["abc", "hello there", "xyz!"]
    healthy = EvalModel(model, _Tok(), batch_size=2, prefix="bos", progress=False).generate(prompts, max_new_tokens=6)
    capsys.readouterr()
    _set_row(model, _Tok().encode("!")[0], jnp.nan)  # only prompt 2 holds "!"
    em = EvalModel(model, _Tok(), batch_size=2, prefix="bos", progress=False)
    got = em.generate(prompts, max_new_tokens=6)
    assert got[:2] == healthy[:2] and got[2] == ""
    assert em.nonfinite_prompts == [(2, 4)]  # prefix + "xyz!": the "!" at position 4 feeds the first new token
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: prompt 2: non-finite logits at position 4 (new token 0)")
    model.lm_head[...] = model.lm_head[...].at[:, 40].set(jnp.nan)  # every prompt now
    with pytest.raises(NonFiniteLogitsError, match=r"^non-finite logits for prompt 1 at position 11 \(new token 0\) "
                                                   r"\(and prompt 2\): "):  # longest first
        EvalModel(model, _Tok(), batch_size=2, prefix="bos", progress=False).generate(prompts, max_new_tokens=6)


def test_eval_loglikelihood_flags_nan_scores_and_refuses_broken_weights(capsys):
    """EvalModel.loglikelihood: a request whose logits go non-finite keeps its NaN score but is named on stderr and in
    ``nonfinite_requests`` (a NaN among a question's choices would otherwise decide an accuracy silently); the
    other scores are unchanged; a first batch in which every score is NaN/Inf (broken weights) raises at once."""
    from minicpm4_jax.eval.model import EvalModel

    model, _ = _models()
    reqs = [("abc", " d"), ("hello there", " friend"), ("xyz", " !")]
    healthy = EvalModel(model, _Tok(), batch_size=2, prefix="bos", progress=False).loglikelihood(reqs)
    assert all(np.isfinite(s) for s, _ in healthy)
    capsys.readouterr()
    _set_row(model, _Tok().encode("!")[0], jnp.nan)  # only request 2 holds "!"; as the last target it is never an input
    _set_row(model, _Tok().encode("z")[0], jnp.nan)
    em = EvalModel(model, _Tok(), batch_size=2, prefix="bos", progress=False)
    got = em.loglikelihood(reqs)
    assert got[:2] == healthy[:2] and np.isnan(got[2][0])
    assert em.nonfinite_requests == [2]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: loglikelihood request 2: the score is nan"), err
    model.lm_head[...] = model.lm_head[...].at[:, 40].set(jnp.nan)  # every request now
    with pytest.raises(ConfigError, match=r"^loglikelihood: every request of the first batch \(2, e\.g\. request 1\) "
                                          r"scored NaN/Inf: "):  # longest first
        EvalModel(model, _Tok(), batch_size=2, prefix="bos", progress=False).loglikelihood(reqs)
