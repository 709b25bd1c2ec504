"""Speculative decoding with the MTP draft and FR-Spec: exactness (greedy), distribution (sampled), rankings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig, SparseConfig
from minicpm4_jax.infer import InferenceEngine, SamplingParams
from minicpm4_jax.infer.spec import (SpeculativeDecoder, build_frequency_ranking, load_frequency_ranking,
                                     processed_logits, save_frequency_ranking)
from minicpm4_jax.nn import MiniCPM4
from minicpm4_jax.nn.mtp import MTPHead

# a small vocabulary so that an untrained draft agrees with the target often enough to exercise partial
# acceptance and rollback
SMALL = ModelConfig(vocab_size=11, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, dim_model_base=16, scale_emb=12.0,
                    initializer_range=0.5)
SPARSE = SparseConfig(kernel_size=32, kernel_stride=16, block_size=32, window_size=64, topk=2, dense_len=128)
# topk 4: K = 6 blocks of which 2 per row are picked by the stage-1 scores (with SPARSE's topk 2 all 4 gen-2 slots
# are forced blocks, so stale compressed keys after a rollback could not change a token); the tests using it give
# prompts of 170 to 375 tokens (7 to 12+ blocks with the generated ones), so that the picks drop blocks
PICKS = dataclasses.replace(SPARSE, topk=4)


def _pair(cfg, seed=0):
    return MiniCPM4(cfg, rngs=nnx.Rngs(seed)), MTPHead(cfg, rngs=nnx.Rngs(seed + 1))


def _prompts(vocab, lens=(100, 37)):
    return [[int(x) for x in np.random.default_rng(n).integers(0, vocab, n)] for n in lens]


class _OracleDrafts(SpeculativeDecoder):
    """Greedy drafts replaced by the known plain continuation, every ``corrupt``-th position wrong.

    The real draft step still runs (and writes its cache); only its tokens are swapped, so acceptance of 0..k
    drafts per round, the KV-cache rollback and the draft-cache refresh are all exercised.
    """

    def __init__(self, *a, plain, prompt_lens, corrupt=3, **kw):
        super().__init__(*a, **kw)
        self.plain, self.lens, self.corrupt = plain, prompt_lens, corrupt

    def _draft_step(self):
        propose = super()._draft_step()

        def swap(d, pos0):  # host side: the plain continuation, every corrupt-th position wrong
            d = np.array(d)
            for r, p0 in enumerate(np.asarray(pos0)):
                g = int(p0) + 1 - self.lens[r]  # index of the pending token in the plain continuation
                for j in range(self.k):
                    i = g + 1 + j
                    if 0 <= p0 and i < len(self.plain[r]):
                        ok = (int(p0) + j) % self.corrupt != 0
                        d[r, j] = self.plain[r][i] if ok else (self.plain[r][i] + 1) % self.cfg.vocab_size
            return d.astype(np.int32)

        def oracle(weights, draft, dcache, h0, tok0, pos0, seeds, rnd, **kw):
            dcache, drafts, q = propose(weights, draft, dcache, h0, tok0, pos0, seeds, rnd, **kw)
            drafts = jax.pure_callback(swap, jax.ShapeDtypeStruct(drafts.shape, jnp.int32), drafts, pos0)
            return dcache, drafts, q

        return oracle


@pytest.mark.parametrize("sparse", [False, True, "picks"])
def test_greedy_speculative_equals_greedy_plain_with_rollback(sparse):
    sc = PICKS if sparse == "picks" else SPARSE
    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=sc) if sparse else SMALL
    model, mtp = _pair(cfg)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompts = _prompts(cfg.vocab_size, lens=(330, 170) if sparse == "picks" else (100, 37))
    plain = eng.generate(prompts, 60)
    dec = _OracleDrafts(eng, mtp, num_draft=4, plain=plain.tokens, prompt_lens=[len(p) for p in prompts])
    spec = dec.generate(prompts, 60)
    assert spec.tokens == plain.tokens
    assert spec.finish_reasons == ["length", "length"]
    # partly right drafts: 0 < accepted < 4 in most rounds, so rejected tokens were rolled back many times
    assert 1.5 < spec.acceptance_length < 4.0
    assert spec.decode_steps < plain.decode_steps


def test_acceptance_and_attended_fraction_count_only_kept_tokens():
    """Second break test: the acceptance length counted tokens past max_new_tokens (8.00 where 2 verifies kept 9
    tokens), and the attended fraction averaged the verify rows of rejected drafts (0.9994 against plain 1.0)."""
    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=SPARSE)
    model, mtp = _pair(cfg)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompt = _prompts(cfg.vocab_size, lens=(100,))  # decodes across dense_len = 128: dense, then sparse rows
    plain = eng.generate(prompt, 60)
    assert 0.3 < plain.attended_fraction < 1.0
    dec = _OracleDrafts(eng, mtp, num_draft=4, plain=plain.tokens, prompt_lens=[100])
    spec = dec.generate(prompt, 60)
    assert spec.tokens == plain.tokens
    # one sequence: the same positions' fractions, averaged the same way
    np.testing.assert_allclose(spec.attended_fraction, plain.attended_fraction, rtol=1e-6)
    assert spec.acceptance_length * spec.decode_steps == pytest.approx(len(spec.tokens[0]) - 1)
    right = _OracleDrafts(eng, mtp, num_draft=7, plain=plain.tokens, prompt_lens=[100], corrupt=10**6)
    short = right.generate(prompt, 10)  # every draft right: 8 tokens per verify, the last round keeps only 1
    assert short.tokens[0] == plain.tokens[0][:10]
    assert (short.decode_steps, short.acceptance_length) == (2, 4.5)


def _greedy_rounds(eng, mtp, prompts, plain, tokens, rounds=6):
    """Prefill (room for ``tokens``) and ``rounds`` greedy rounds of 4 oracle drafts (every third wrong) for two
    sequences: ``(decoder, state, seqs)``, ``seqs[row]`` the tokens ``x_0 .. x_n`` with ``x_n`` pending. Asserts
    that drafts were accepted and that rejected ones were rolled back."""
    dec = _OracleDrafts(eng, mtp, num_draft=4, plain=plain.tokens, prompt_lens=[len(p) for p in prompts])
    st = dec.prefill(prompts, tokens, lambda lg: jnp.argmax(lg, -1).astype(jnp.int32))
    seqs = [list(p) + [int(t)] for p, t in zip(prompts, np.asarray(st.tok))]
    accepted = []
    for r in range(rounds):
        st, acc, drafts, nxt, _ = dec.round(st, [True, True], jnp.zeros((2,), jnp.uint32), r + 1, SamplingParams())
        accepted += acc
        for row in range(2):
            seqs[row] += [int(x) for x in drafts[row, :acc[row]]] + [int(nxt[row])]
    assert max(accepted) > 0 and min(accepted) < 4
    return dec, st, seqs


def test_draft_cache_after_rounds_equals_one_pass_over_the_accepted_tokens():
    """After prefill and rounds with rejections (rollback), the draft cache holds, at every position ``i`` below
    the cached length ``n`` minus one, the MTP layer's keys/values of ``u_i = f(h_i, x_{i+1})`` with the
    target's true hidden states, as one pass over the accepted sequence gives; ``h_last`` is ``h_{n-1}``."""
    from minicpm4_jax.infer.cache import init_cache
    from minicpm4_jax.infer.spec import _draft_fill

    model, mtp = _pair(SMALL, seed=4)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompts = _prompts(SMALL.vocab_size, lens=(50, 23))
    plain = eng.generate(prompts, 40)
    dec, st, seqs = _greedy_rounds(eng, mtp, prompts, plain, 50 + 40 + 4)
    assert [len(q) - 1 for q in seqs] == st.lengths
    for row in range(2):
        n = st.lengths[row]
        x = seqs[row]
        cache = eng.new_cache(1, n)
        _, _, _, hidden = eng.prefill(cache, [x[:n]], return_hidden=True)  # h_0 .. h_{n-1}, one pass
        np.testing.assert_allclose(np.asarray(st.h_last[row]), np.asarray(hidden[0, n - 1]), rtol=1e-4, atol=1e-4)
        fresh = init_cache(dataclasses.replace(SMALL, num_hidden_layers=1, attention="dense"), 1,
                           st.dcache.k.shape[2]).layers[0]
        want = _draft_fill(eng.weights, dec.draft, fresh, hidden[:, :n - 1], jnp.asarray([x[1:n]], jnp.int32),
                           jnp.arange(n - 1, dtype=jnp.int32)[None], cfg=SMALL, graphdefs=eng._graphdefs,
                           mtp_gd=dec._mtp_gd)
        for got, ref in ((st.dcache.k, want.k), (st.dcache.v, want.v)):
            np.testing.assert_allclose(np.asarray(got[row, :, :n - 1]), np.asarray(ref[0, :, :n - 1]), rtol=1e-4,
                                       atol=1e-4)


def test_target_cache_after_rounds_equals_one_pass_over_the_accepted_tokens():
    """field_faults B16 with sparse attention whose picks matter: after rounds with rejections, the target cache
    holds what one prefill of the accepted tokens gives (keys and values of every kept position, the fine and
    coarse compressed keys of every complete kernel), so no rejected draft's keys survive where a later
    selection reads them, and the kept tokens are plain decoding's."""
    from minicpm4_jax.infllm.compress import coarse_geometry, num_kernels

    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=PICKS)
    model, mtp = _pair(cfg, seed=2)
    eng = InferenceEngine(model, prefill_chunk=64)
    # the rounds cross a coarse kernel boundary (ck2 rows end at 320 + 64 j) and fine ones (ck1: 16 j) in both rows
    prompts = _prompts(cfg.vocab_size, lens=(375, 250))
    plain = eng.generate(prompts, 40)
    assert plain.attended_fraction < 0.8
    _, st, seqs = _greedy_rounds(eng, mtp, prompts, plain, 375 + 40 + 9)
    assert st.lengths[0] > 384 and st.lengths[1] > 256
    assert [q[len(p):] for q, p in zip(seqs, prompts)] == [t[:len(q) - len(p)] for q, p, t in
                                                           zip(seqs, prompts, plain.tokens)]
    sc = cfg.sparse_config
    cks, cst = coarse_geometry(sc.kernel_size, sc.kernel_stride)
    for row in range(2):
        n = st.lengths[row]
        fresh, last, _ = eng.prefill(eng.new_cache(1, n), [seqs[row][:n]])
        for got, want in zip(st.cache.layers, fresh.layers):
            for name in ("k", "v"):
                np.testing.assert_allclose(np.asarray(getattr(got, name)[row, :, :n]),
                                           np.asarray(getattr(want, name)[0, :, :n]), rtol=1e-4, atol=1e-4)
            for name, rows in (("ck1", num_kernels(n, sc.kernel_size, sc.kernel_stride)),
                               ("ck2", num_kernels(n, cks, cst))):
                np.testing.assert_allclose(np.asarray(getattr(got, name)[row, :rows]),
                                           np.asarray(getattr(want, name)[0, :rows]), rtol=1e-4, atol=1e-4)
        # the next token from this cache is the one plain decoding gives after the same tokens
        assert int(st.tok[row]) == int(np.argmax(np.asarray(last[0]))) == seqs[row][n]


def test_verify_logits_equal_the_full_forward_at_every_verified_position():
    """The verify chunk of a round (the pending token and k drafts at positions ``n .. n + k``, run by
    ``_round``'s call of the engine's ``_forward`` with the decoder's verify weights and mode) gives at every row the
    logits of a full forward over the same tokens (fp32, 1e-4), also where the chunk crosses ``dense_len`` (row 0:
    positions 124-128 with dense_len 128, the "mixed" mode) and where picks drop blocks (row 1, 300 tokens, topk 4).
    Greedy exactness and the statistical test above could miss logits that are off but keep the argmax."""
    from minicpm4_jax.infer.engine import _forward, decode_mode

    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=PICKS)
    model, mtp = _pair(cfg, seed=5)
    eng = InferenceEngine(model, prefill_chunk=64)
    k = 4
    dec = SpeculativeDecoder(eng, mtp, num_draft=k)
    lens = (124, 300)
    seqs = _prompts(cfg.vocab_size, lens=tuple(n + k + 1 for n in lens))
    cache, _, _ = eng.prefill(eng.new_cache(2, 320), [s[:n] for s, n in zip(seqs, lens)])
    chunk = jnp.asarray([s[n:n + k + 1] for s, n in zip(seqs, lens)], jnp.int32)
    vpos = jnp.asarray([[n + j for j in range(k + 1)] for n in lens], jnp.int32)
    mode = dec._mode(list(lens), 0)
    assert mode == "mixed" == decode_mode(cfg, [125, 129, 301, 305])
    _, lg, _ = _forward(dec._verify_weights, cache, chunk, vpos, jnp.max(vpos, axis=1) + 1, cfg=cfg,
                        graphdefs=eng._graphdefs, all_rows=True, mode=mode)
    for row, (s, n) in enumerate(zip(seqs, lens)):
        full = np.asarray(model(jnp.asarray([s], jnp.int32)))[0, n:n + k + 1]
        np.testing.assert_allclose(np.asarray(lg[row]), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fr", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_greedy_speculative_equals_greedy_plain_real_draft(sparse, fr):
    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=SPARSE) if sparse else SMALL
    model, mtp = _pair(cfg)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompts = _prompts(cfg.vocab_size)
    plain = eng.generate(prompts, 60)
    ids = np.asarray([3, 1, 4, 0, 5, 9, 2], np.int32) if fr else None  # FR-Spec: the draft sees 7 of 11 tokens
    spec = SpeculativeDecoder(eng, mtp, num_draft=3, fr_spec_ids=ids).generate(prompts, 60)
    assert spec.tokens == plain.tokens
    assert spec.acceptance_length >= 1.0


@pytest.mark.parametrize("tied", [True, False])
def test_greedy_speculative_equals_plain_with_vocab_padding_tied_and_untied(tied):
    # the verify's head on CPU: a [hidden, padded vocab] copy of a tied table, or the untied lm_head itself; the
    # padding columns must stay out of every argmax either way
    cfg = dataclasses.replace(SMALL, vocab_pad_multiple=8, tie_word_embeddings=tied)
    assert cfg.padded_vocab_size == 16
    model, mtp = _pair(cfg)
    eng = InferenceEngine(model)
    prompts = _prompts(cfg.vocab_size)
    plain = eng.generate(prompts, 40)
    dec = SpeculativeDecoder(eng, mtp, num_draft=7)
    assert (dec._verify_weights.lm_head is not None) and (dec._verify_weights.lm_head.shape == (64, 16))
    spec = dec.generate(prompts, 40)
    assert spec.tokens == plain.tokens
    assert all(t < cfg.vocab_size for row in spec.tokens for t in row)
    assert spec.prefill_seconds > 0 and spec.decode_seconds > 0


def test_greedy_speculative_with_stop_ids_and_batch_rows_finishing_early():
    model, mtp = _pair(SMALL, seed=3)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompts = _prompts(SMALL.vocab_size, (20, 50, 9))
    plain = eng.generate(prompts, 25, stop_ids=[4])
    spec = SpeculativeDecoder(eng, mtp, num_draft=4).generate(prompts, 25, stop_ids=[4])
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons


@pytest.mark.parametrize("sampled", [False, True])
def test_pipelined_rounds_equal_rounds_read_one_at_a_time(sampled):
    """generate dispatches round i + 1 (its lengths on the device) before it reads round i; the engine's
    ``pipelined=False`` reads every round first. Same tokens, finish reasons, acceptance and attended fractions, in a
    batch whose rows stop early (a stop id, the budget) and cross dense_len (rounds dispatched on unknown lengths
    must take the attention mode of every length they may have); the pipelined loop runs at most one round more."""
    # dense_len 256: the first sparse steps already skip blocks (init + window + top-k cover 160 positions)
    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=dataclasses.replace(SPARSE, dense_len=256))
    model, mtp = _pair(cfg, seed=3)
    prompts = _prompts(cfg.vocab_size, (240, 20, 9, 250))
    sampling = SamplingParams(temperature=0.8, top_k=5) if sampled else SamplingParams()
    plain = InferenceEngine(model, prefill_chunk=64).generate(prompts, 40, stop_ids=[4])
    outs = {}
    for pipelined in (True, False):
        eng = InferenceEngine(model, prefill_chunk=64, pipelined=pipelined)
        # greedy: mostly right drafts (every 7th position wrong), so that rounds advance by up to k + 1 = 5
        # tokens and the verify rows of a round dispatched before the last was read are kept across dense_len
        dec = (SpeculativeDecoder(eng, mtp, num_draft=4) if sampled else
               _OracleDrafts(eng, mtp, num_draft=4, plain=plain.tokens, prompt_lens=[len(p) for p in prompts],
                             corrupt=7))
        outs[pipelined] = dec.generate(prompts, 40, stop_ids=[4], sampling=sampling, seeds=11)
    p, s = outs[True], outs[False]
    if not sampled:
        assert s.tokens == plain.tokens
        np.testing.assert_allclose(s.attended_fraction, plain.attended_fraction, rtol=1e-6)
    assert p.tokens == s.tokens and p.finish_reasons == s.finish_reasons
    assert {"eos", "length"} <= set(s.finish_reasons), s.finish_reasons  # the batch shrank while rounds ran
    assert min(len(t) for t in s.tokens) < 30 and max(len(t) for t in s.tokens) == 40
    assert p.acceptance_length == s.acceptance_length and s.acceptance_length > 1.0
    np.testing.assert_allclose(p.attended_fraction, s.attended_fraction, rtol=1e-6)
    assert 0.3 < s.attended_fraction < 1.0  # sparse rows were verified
    assert s.decode_steps <= p.decode_steps <= s.decode_steps + 1


def test_sampled_speculative_matches_target_distribution():
    """Chi-square of 8000 three-token continuations against the exact target probabilities."""
    cfg = dataclasses.replace(SMALL, vocab_size=4)
    model, mtp = _pair(cfg, seed=7)
    eng = InferenceEngine(model, prefill_chunk=16)
    sampling = SamplingParams(temperature=0.9, top_k=3)
    prompt = [1, 2, 3, 0, 1]
    n = 8000
    # a draft window of 2 positions is active here (contexts of 5-8 tokens): any draft keeps the distribution
    out = SpeculativeDecoder(eng, mtp, num_draft=2, draft_window=2).generate([prompt] * n, 3, sampling=sampling,
                                                                            seeds=0)
    seqs = np.asarray(out.tokens)
    counts = np.bincount(seqs[:, 0] * 16 + seqs[:, 1] * 4 + seqs[:, 2], minlength=64)

    def probs(prefixes):
        ids = jnp.asarray([prompt + list(p) for p in prefixes], jnp.int32)
        lg = processed_logits(model(ids)[:, -1], sampling)
        return np.asarray(jax.nn.softmax(lg, axis=-1), np.float64)

    p1 = probs([()])[0]
    p2 = probs([(a,) for a in range(4)])
    p3 = probs([(a, b) for a in range(4) for b in range(4)]).reshape(4, 4, 4)
    exact = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)
    assert abs(exact.sum() - 1) < 1e-6  # float32 softmax
    assert np.all(counts[exact == 0] == 0)  # top-k filtered tokens never appear
    m = exact > 0
    chi2 = float(np.sum((counts[m] - n * exact[m]) ** 2 / (n * exact[m])))
    dof = int(m.sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)  # ~4 sigma of the chi-square distribution
    # the test has power: the same counts against a visibly different distribution fail it
    flat = np.where(m, 1.0, 0.0) / m.sum()
    chi2_flat = float(np.sum((counts[m] - n * flat[m]) ** 2 / (n * flat[m])))
    assert chi2_flat > dof + 6 * np.sqrt(2 * dof)
    assert 1.0 < out.acceptance_length  # some drafts were accepted


def test_frequency_ranking_build_save_load(tmp_path):
    streams = [[5, 5, 5, 2, 2, 7], [2, 5, 9]]
    ids = build_frequency_ranking(streams, 4, vocab_size=10, eos_id=None)
    assert ids.tolist() == [5, 2, 7, 9]  # 4x, 3x, then 1x each in id order
    with_eos = build_frequency_ranking(streams, 4, vocab_size=10, eos_id=1)
    assert with_eos.tolist() == [5, 2, 7, 1]  # EOS replaces the tail (official rule)
    # break test: an EOS id outside the vocabulary (a tokenizer's "none" -1) became the last id ([5, 2, 7, -1]),
    # written without a word and refused only when generate loaded the file ("built for another tokenizer")
    for bad in (-1, 10, 2.0):
        with pytest.raises(ConfigError, match=rf"eos_id={bad!r} is not an id of the vocabulary \[0, 10\)"):
            build_frequency_ranking(streams, 4, vocab_size=10, eos_id=bad)
    p = save_frequency_ranking(with_eos, tmp_path / "freq_4.txt")
    assert load_frequency_ranking(p, 10).tolist() == [5, 2, 7, 1]
    with pytest.raises(ConfigError, match="outside"):
        load_frequency_ranking(p, 6)
    with pytest.raises(ConfigError, match="does not exist"):
        load_frequency_ranking(tmp_path / "nope.txt", 10)
    with pytest.raises(ConfigError, match="must be in"):
        build_frequency_ranking(streams, 11, vocab_size=10)
    (tmp_path / "dup.txt").write_text("1\n2\n1\n")
    with pytest.raises(ConfigError, match="repeats"):
        load_frequency_ranking(tmp_path / "dup.txt", 10)
    # malformed official .pt files (fresh-eyes test: each was a raw traceback): not a zip, a zip without a
    # pickle, a pickle of an object (a saved tensor), a truncated pickle
    import pickle
    import zipfile

    def pt(name, members):
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as z:
            for member, data in members.items():
                z.writestr(member, data)
        return path

    (tmp_path / "garbage.pt").write_text("garbage\n")
    tensor = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00."
    for path in (tmp_path / "garbage.pt", pt("nopkl.pt", {"archive/version": "3"}),
                 pt("tensor.pt", {"archive/data.pkl": tensor}),
                 pt("cut.pt", {"archive/data.pkl": pickle.dumps([1, 2, 3], protocol=2)[:-3]})):
        with pytest.raises(ConfigError, match=f"cannot read FR-Spec ranking {path}"):
            load_frequency_ranking(path, 10)
    good = pt("good.pt", {"archive/data.pkl": pickle.dumps([3, 1, 2], protocol=2)})
    assert load_frequency_ranking(good, 10).tolist() == [3, 1, 2]


def test_bad_spec_settings():
    model, mtp = _pair(SMALL)
    eng = InferenceEngine(model)
    with pytest.raises(ConfigError, match="num_draft=0"):
        SpeculativeDecoder(eng, mtp, num_draft=0)
    # a draft longer than the position limit allows would silently never run (fresh-eyes test: --num-draft 9000)
    limit = SMALL.max_position_embeddings
    with pytest.raises(ConfigError, match=rf"num_draft={limit - 1} \(--num-draft\) leaves no room"):
        SpeculativeDecoder(eng, mtp, num_draft=limit - 1)
    SpeculativeDecoder(eng, mtp, num_draft=limit - 2)
    with pytest.raises(ConfigError, match=r"fr_spec_ids has ids outside \[0, 11\)"):
        SpeculativeDecoder(eng, mtp, fr_spec_ids=np.asarray([1, 11]))
    # fresh-eyes test: a repeated id kept one share of its draft probability (sampled output off the target
    # distribution, chi2 317 against a threshold of 69); empty / 2-D / float lists failed deep inside JAX
    with pytest.raises(ConfigError, match="fr_spec_ids repeats token ids"):
        SpeculativeDecoder(eng, mtp, fr_spec_ids=[1, 1, 1, 1, 0, 2, 3])
    for bad in ([], [[1, 2], [3, 4]], [1.7, 2.2]):
        with pytest.raises(ConfigError, match="fr_spec_ids must be a non-empty flat list of integer token ids"):
            SpeculativeDecoder(eng, mtp, fr_spec_ids=bad)
    # break test: a size in place of the ranking (as --fr-spec-vocab takes) was a TypeError traceback (len(8))
    with pytest.raises(ConfigError, match=r"got int64 of shape \(\)\); a size is --fr-spec-vocab's: pass the "
                                          r"ranking's first ids, load_frequency_ranking\(path, vocab_size\)\[:size\]"):
        SpeculativeDecoder(eng, mtp, fr_spec_ids=8)
    assert SpeculativeDecoder(eng, mtp, fr_spec_ids=[3, 1, 4]).vocab_rows == 3
    for bad in (2.5, None, "3", True):
        with pytest.raises(ConfigError, match=r"num_draft=.* must be an integer >= 1"):
            SpeculativeDecoder(eng, mtp, num_draft=bad)
    assert SpeculativeDecoder(eng, mtp, num_draft=np.int64(2)).k == 2
    for bad in (0, -5, True, 2.5):
        with pytest.raises(ConfigError, match=r"draft_window=.* \(--draft-window\) must be a positive"):
            SpeculativeDecoder(eng, mtp, draft_window=bad)
    assert SpeculativeDecoder(eng, mtp, draft_window=np.int64(8)).draft_window == 8
    dec = SpeculativeDecoder(eng, mtp)
    first = lambda lg: jnp.argmax(lg, -1)  # noqa: E731
    with pytest.raises(ConfigError, match="no empty prompt"):
        dec.prefill([[1, 2], []], 10, first)
    with pytest.raises(ConfigError, match="a prompt of 5 tokens does not fit tokens=4"):
        dec.prefill([[1, 2, 3, 4, 5]], 4, first)
    # break-test (helper 47): a missing draft head failed at the first traced round ('NoneType' has no 'inputs')
    with pytest.raises(ConfigError, match=r"needs the model's MTP draft head, got NoneType.*model.mtp=true"):
        SpeculativeDecoder(eng, None)
    # round() with one flag for two sequences broadcast it on the device (row 1's cache advanced, its host
    # length did not); a round past the caches' capacity wrote its tokens nowhere
    st = dec.prefill([[1, 2, 3], [4, 5]], 20, first)
    with pytest.raises(ConfigError, match="active has 1 entries for a state of 2 sequences"):
        dec.round(st, [True], jnp.zeros((2,), jnp.uint32), 1, SamplingParams())
    cap = st.cache.capacity
    st = dec.prefill([[1] * (cap - dec.k), [2, 3]], cap, first)  # row 0: k + 1 tokens do not fit, row 1 fits
    with pytest.raises(ConfigError, match=rf"sequence 0 holds {cap - dec.k} tokens: a round of {dec.k + 1} does "
                                          rf"not fit in caches of {cap} slots"):
        dec.round(st, [True, True], jnp.zeros((2,), jnp.uint32), 1, SamplingParams())
    st, acc, *_ = dec.round(st, [False, True], jnp.zeros((2,), jnp.uint32), 1, SamplingParams())  # row 0 idle
    assert st.lengths[0] == cap - dec.k and st.lengths[1] == 2 + acc[1] + 1


def test_pallas_target_refuses_a_verify_chunk_longer_than_its_decode_kernel():
    """With ``attention_impl: pallas`` the verify of ``k`` drafts runs the Pallas decode kernel on ``k + 1`` tokens per
    sequence, which takes at most 30; ``--num-draft 30`` failed at the first round with a ValueError traceback from
    inside the traced program. It is refused up front (one line naming the limit); 29 drafts still decode."""
    cfg = dataclasses.replace(SMALL, attention="infllmv2", sparse_config=SPARSE, attention_impl="pallas")
    model, mtp = _pair(cfg)
    eng = InferenceEngine(model, prefill_chunk=64)
    with pytest.raises(ConfigError, match=r"num_draft=30 \(--num-draft\).*attention_impl='pallas'.* at most 29"):
        SpeculativeDecoder(eng, mtp, num_draft=30)
    assert SpeculativeDecoder(eng, mtp, num_draft=29).k == 29


def test_draft_window_keeps_greedy_output_and_changes_only_the_drafts():
    """A draft attending only its last 8 positions (CPM.cu's spec_window_size) still gives plain greedy tokens;
    its drafts differ from the full-context draft's, so the window really is applied."""
    model, mtp = _pair(SMALL)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompts = _prompts(SMALL.vocab_size)
    plain = eng.generate(prompts, 40)
    full = SpeculativeDecoder(eng, mtp, num_draft=3, draft_window=None)
    win = SpeculativeDecoder(eng, mtp, num_draft=3, draft_window=8)
    out_full, out_win = full.generate(prompts, 40), win.generate(prompts, 40)
    assert out_full.tokens == plain.tokens and out_win.tokens == plain.tokens
    # the same round from the same state: the windowed draft proposes other tokens
    st = None
    for dec in (full, win):
        state = dec.prefill(prompts, 200, lambda lg: jnp.argmax(lg, -1).astype(jnp.int32))
        _, _, drafts, _, _ = dec.round(state, [True, True], jnp.zeros((2,), jnp.uint32), 1, SamplingParams())
        st = drafts if st is None else st
    assert not np.array_equal(st, drafts)


def test_speculative_near_the_position_limit_finishes_plainly():
    """Break-test regression: a request plain decoding accepts (prompt + new = max positions) is not refused."""
    model, mtp = _pair(SMALL)
    eng = InferenceEngine(model, prefill_chunk=64)
    prompts = [_prompts(SMALL.vocab_size, (1004,))[0], _prompts(SMALL.vocab_size, (990,))[0]]
    plain = eng.generate(prompts, 20)  # 1004 + 20 = 1024 = max_position_embeddings
    dec = _OracleDrafts(eng, mtp, num_draft=8, plain=plain.tokens, prompt_lens=[len(p) for p in prompts])
    spec = dec.generate(prompts, 20)
    assert spec.tokens == plain.tokens
    assert spec.acceptance_length > 1.0  # rounds ran before the plain tail


def test_sampled_rows_do_not_depend_on_a_neighbour_at_the_position_limit():
    """Break test: a row whose request ends at max_position_embeddings (50 + 14 = 64) sent the whole batch to plain
    decode steps, so sampled rows far from the limit (30 + 14, 10 + 14) drew other tokens than alone (a sequence's
    tokens depend only on its prompt and seed), pipelined or not; the row at the limit too (its plain steps' keys
    counted the batch's rounds)."""
    cfg = dataclasses.replace(SMALL, max_position_embeddings=64)
    model, mtp = _pair(cfg, seed=3)
    prompts = _prompts(cfg.vocab_size, (50, 30, 10))
    sampling = SamplingParams(temperature=0.9, top_k=5)
    for pipelined in (True, False):
        dec = SpeculativeDecoder(InferenceEngine(model, prefill_chunk=16, pipelined=pipelined), mtp, num_draft=3)
        batch = dec.generate(prompts, 14, sampling=sampling, seeds=5)
        assert [len(t) for t in batch.tokens] == [14, 14, 14]
        for i, p in enumerate(prompts):
            alone = dec.generate([p], 14, sampling=sampling, seeds=[5 + i])
            assert alone.tokens[0] == batch.tokens[i], (pipelined, i)


@pytest.mark.torch
def test_official_fr_spec_pt_written_by_torch_and_read_back(tmp_path):
    """The official freq_*.pt (torch.save of a list), written and reloaded by torch, read without torch here."""
    from torch_env import run_torch_side

    ids = build_frequency_ranking([[7, 7, 3, 3, 3, 1], [9, 7]], 5, vocab_size=12, eos_id=2)
    txt = save_frequency_ranking(ids, tmp_path / "freq_5.txt")
    proc = run_torch_side("fr-spec-pt", "--ids-txt", str(txt), "--out", str(tmp_path / "freq_5.pt"))
    import json

    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["equal"] and info["n"] == 5 and info["head"] == ids.tolist()
    assert load_frequency_ranking(tmp_path / "freq_5.pt", 12).tolist() == ids.tolist() == [3, 7, 1, 9, 2]


def test_generate_refuses_an_fr_spec_file_with_ids_of_the_padded_vocabulary(tmp_path):
    """Break-test nitpick: ``--fr-spec`` with ids between the tokenizer's size and the model's padded vocabulary was
    accepted; those rows are never produced (``vocab_limit``), so the file was built for another tokenizer."""
    import argparse
    import types

    from minicpm4_jax.cli import _speculative_decoder

    cfg = dataclasses.replace(SMALL, mtp=True)
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    eng = InferenceEngine(model)
    ranking = tmp_path / "freq_3.txt"
    ranking.write_text(f"1 2 {cfg.vocab_size - 1}\n")
    args = argparse.Namespace(spec_decode=True, fr_spec=str(ranking), fr_spec_vocab=None, checkpoint=str(tmp_path),
                              num_draft=None, draft_window=None)
    small_tok = types.SimpleNamespace(vocab_size=cfg.vocab_size - 2)
    with pytest.raises(ConfigError, match=rf"has ids outside \[0, {cfg.vocab_size - 2}\); it was built for another "
                                          "tokenizer"):
        _speculative_decoder(args, model, eng, tmp_path, small_tok)
    dec = _speculative_decoder(args, model, eng, tmp_path, types.SimpleNamespace(vocab_size=cfg.vocab_size))
    assert np.asarray(dec.draft.ids).tolist() == [1, 2, cfg.vocab_size - 1]


def test_generate_resumes_the_plain_tail_at_the_lengths_its_rounds_kept(monkeypatch):
    """field_faults B16 for the host bookkeeping of :meth:`SpeculativeDecoder.generate`: after rounds with rejected
    drafts, a row that ends in plain steps at the position limit resumes with ``prompt + kept tokens - 1`` cached
    tokens (each round keeps ``accepted + 1``; the last token is pending), pipelined or not. Mutation testing (helper
    105): ``lengths[r] += acc[r] + 2`` in ``generate`` passed every test, since the rounds read their lengths from
    the device and this vocabulary-11 model's tail repeats one token whatever its positions."""
    cfg = dataclasses.replace(SMALL, max_position_embeddings=64)
    model, mtp = _pair(cfg)
    prompts = _prompts(cfg.vocab_size, (44, 30))  # 44 + 20 = 64: row 0 ends with plain steps at the limit
    plain = InferenceEngine(model, prefill_chunk=16).generate(prompts, 20)
    for pipelined in (True, False):
        dec = _OracleDrafts(InferenceEngine(model, prefill_chunk=16, pipelined=pipelined), mtp, num_draft=3,
                            plain=plain.tokens, prompt_lens=[len(p) for p in prompts])
        seen, tail = [], dec._plain_tail

        def spy(st, col, *a, tail=tail, seen=seen, **kw):
            seen.append([(n, len(p) + len(o) - 1) for n, p, o, on in zip(st.lengths, prompts, col.out, col.active)
                         if on])
            return tail(st, col, *a, **kw)

        monkeypatch.setattr(dec, "_plain_tail", spy)
        spec = dec.generate(prompts, 20)
        assert spec.tokens == plain.tokens
        assert 1.0 < spec.acceptance_length < 4.0  # rounds with rejections ran before the tail
        assert len(seen) == 1 and seen[0], (pipelined, seen)  # the tail ran, for row 0 at least
        assert all(n == want for n, want in seen[0]), (pipelined, seen)
