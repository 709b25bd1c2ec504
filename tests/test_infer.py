"""The KV-cache inference engine: cached decode == full forward, chunked prefill, batching, sampling, stops."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig, RopeScalingConfig, SparseConfig
from minicpm4_jax.infer import InferenceEngine, SamplingParams, sample_tokens, top_k_filter
from minicpm4_jax.infer.engine import with_attention
from minicpm4_jax.infllm.attention import stage2_forced_split
from minicpm4_jax.infllm.compress import compress_keys, coarse_geometry
from minicpm4_jax.infllm.select import select_params
from minicpm4_jax.nn import MiniCPM4
from minicpm4_jax.ops.attention_ref import dense_attention
from minicpm4_jax.ops.decode_ref import dense_decode_attention, sparse_decode_attention
from minicpm4_jax.ops.infllm_ref import infllmv2_stage2

BASE = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024, dim_model_base=16, scale_emb=12.0)
# block 32, K = 2 + 64/32 = 4 blocks (gen-2) / 2 top-k + 2 window blocks (gen-1): a 320-token sequence
# attends at most 128 of its keys, so the selection really drops blocks.
GEOM = dict(kernel_size=32, kernel_stride=16, block_size=32, window_size=64, topk=2)


def _cfg(variant=None, **sparse):
    if variant is None:
        return BASE
    return dataclasses.replace(BASE, attention="infllmv2",
                               sparse_config=SparseConfig(**{**GEOM, "variant": variant, **sparse}))


@pytest.fixture(scope="module")
def weights():
    return nnx.state(MiniCPM4(BASE, rngs=nnx.Rngs(0)))


def _model(weights, cfg):
    return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: MiniCPM4(cfg, rngs=nnx.Rngs(0)))), weights)


def _ids(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(0, BASE.vocab_size, n)]


def _stepwise_logits(engine, prompt, rest, chunk=None):
    """Prefill ``prompt`` then feed ``rest`` one token per decode step; logits before each fed token."""
    n = len(prompt) + len(rest)
    cache = engine.new_cache(1, n)
    cache, last, _ = engine.prefill(cache, [prompt], chunk=chunk)
    out, fracs = [np.asarray(last[0])], []
    for i, t in enumerate(rest[:-1]):
        pos = jnp.asarray([[len(prompt) + i]], jnp.int32)
        cache, lg, frac = engine.extend(cache, jnp.asarray([[t]], jnp.int32), pos)
        out.append(np.asarray(lg[0, 0]))
        fracs.append(float(frac))
    return np.stack(out), fracs


CASES = {
    "dense": (None, {}),
    "gen2": ("gen2", dict(dense_len=-1)),
    "gen1": ("gen1", dict(dense_len=-1)),
    "gen2_nope": ("gen2", dict(dense_len=-1, use_nope=True)),
    # topk 4: K = 6 blocks, of which 4 are forced (init, the window's 2, the query's own), so 2 per row are picked
    # by the stage-1 scores; with topk 2 (the cases above) every gen-2 slot is a forced block and the scores,
    # the compressed-key caches and the decode-time selection never change a logit (audit of field_faults)
    "gen2_picks": ("gen2", dict(dense_len=-1, topk=4)),
    # dense_len 128 <= K * block = 128: sparse equals dense below the switch, so the switch at 128 is exact
    "gen2_switch": ("gen2", dict(dense_len=128)),
    "gen1_switch": ("gen1", dict(dense_len=128)),
}


@pytest.fixture(scope="module")
def official_tok():
    from conftest import shared_path

    from minicpm4_jax.tokenizer import load_tokenizer

    return load_tokenizer(str(shared_path("data", "minicpm4-0.5b")))


def _free_picks(cfg) -> int:
    """Blocks per query row that the stage-1 scores choose (not forced) in ``cfg``'s sparse layout."""
    p = select_params(cfg.sparse_config)
    return stage2_forced_split(p, p.topk_cfg)[2] if p.variant == "gen2" else p.topk_cfg - p.init_blocks


def test_the_picks_cases_select_by_score(weights):
    """The guard on the cases below: "gen2_picks" and "gen1" leave blocks to the scores, "gen2" (topk 2) none;
    at 330 tokens the picked blocks change the logits (the picks are not a subset every row attends anyway)."""
    def cfg(case):
        variant, sp = CASES[case]
        return _cfg(variant, **sp)

    assert _free_picks(cfg("gen2_picks")) == 2 and _free_picks(cfg("gen1")) == 1 and _free_picks(cfg("gen2")) == 0
    seq = jnp.asarray([_ids(330, seed=1)], jnp.int32)
    forced, picks = (np.asarray(_model(weights, cfg(c))(seq))[0, -1] for c in ("gen2", "gen2_picks"))
    assert np.abs(forced - picks).max() > 1e-3


# attention_impl auto decodes with the native CPU kernel (ops/native) where it builds; "@xla" keeps the reference
@pytest.mark.parametrize("case", list(CASES) + ["dense@xla", "gen2@xla", "gen2_picks@xla", "gen1_switch@xla"])
def test_cached_decode_equals_full_forward_every_step(weights, case):
    case, _, impl = case.partition("@")
    variant, sp = CASES[case]
    cfg = dataclasses.replace(_cfg(variant, **sp), attention_impl=impl or "auto")
    model = _model(weights, cfg)
    prompt_len = 100 if case.endswith("switch") else 170  # the switch cases cross dense_len while decoding
    seq = _ids(330, seed=1)
    got, fracs = _stepwise_logits(InferenceEngine(model, prefill_chunk=64), seq[:prompt_len], seq[prompt_len:])
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray([seq], jnp.int32)))[0, prompt_len - 1:-1]
    np.testing.assert_allclose(got, full, atol=1e-4, rtol=1e-4)
    if variant is None:
        assert fracs[-1] == 1.0
    else:  # the last steps really are sparse: at most 4 blocks (6 for gen2_picks) of 32 keys out of ~330
        assert fracs[-1] < (0.6 if case == "gen2_picks" else 0.45)


# distinct per-frequency LongRoPE factors, long != short, max_position_embeddings 16x the original: the long list
# and the attention scaling sqrt(1 + ln 16 / ln 64) are in force at every position
LONGROPE = RopeScalingConfig(short_factor=tuple(np.linspace(1.0, 2.0, 8)),
                             long_factor=tuple(np.geomspace(1.0, 40.0, 8)), original_max_position_embeddings=64)


@pytest.mark.parametrize("case", ["dense", "dense@xla", "gen2", "gen2@xla"])
def test_cached_decode_equals_full_forward_with_longrope(weights, case):
    """field_faults B09 for the inference engine: prefill and every decode step build their rotary tables from the
    model's rope_scaling (long factors and attention scaling), as the full forward does, at positions far past
    original_max_position_embeddings. BASE has no rope_scaling, so the cases above cannot see a dropped one."""
    case, _, impl = case.partition("@")
    cfg = dataclasses.replace(_cfg(None if case == "dense" else case, **({} if case == "dense" else {"dense_len": -1})),
                              rope_scaling=LONGROPE, attention_impl=impl or "auto")
    model = _model(weights, cfg)
    seq = _ids(200, seed=3)
    got, _ = _stepwise_logits(InferenceEngine(model, prefill_chunk=64), seq[:90], seq[90:])
    fwd = jax.jit(lambda m, x: m(x))
    full = np.asarray(fwd(model, jnp.asarray([seq], jnp.int32)))[0, 89:-1]
    np.testing.assert_allclose(got, full, atol=1e-4, rtol=1e-4)
    # the scaling really matters here: the same weights without it give other logits
    plain = np.asarray(fwd(_model(weights, dataclasses.replace(cfg, rope_scaling=None)),
                           jnp.asarray([seq], jnp.int32)))[0, 89:-1]
    assert np.abs(plain - full).max() > 1e-3  # 10x the tolerance above


def test_sparse_selection_differs_from_dense(weights):
    """The sparse cases above test something: at 330 tokens sparse logits differ from dense ones."""
    seq = jnp.asarray([_ids(330, seed=1)], jnp.int32)
    dense = np.asarray(_model(weights, BASE)(seq))[0, -1]
    sparse = np.asarray(_model(weights, _cfg("gen2", dense_len=-1))(seq))[0, -1]
    assert np.abs(dense - sparse).max() > 1e-3


@pytest.mark.parametrize("case", ["dense", "gen2", "gen1", "gen2_switch", "gen2_picks"])
@pytest.mark.parametrize("chunk", [16, 48])
def test_chunked_prefill_equals_single_pass(weights, case, chunk):
    variant, sp = CASES[case]
    model = _model(weights, _cfg(variant, **sp))
    eng = InferenceEngine(model, prefill_chunk=512)
    prompt = _ids(250, seed=2)  # crosses dense_len=128 inside the prompt for the switch case
    one = eng.prefill(eng.new_cache(1, 256), [prompt], all_rows=True)[1]
    many = eng.prefill(eng.new_cache(1, 256), [prompt], chunk=chunk, all_rows=True)[1]
    np.testing.assert_allclose(np.asarray(many), np.asarray(one), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_compressed_cache_equals_recompute_every_step(weights, variant):
    cfg = _cfg(variant, dense_len=-1)
    eng = InferenceEngine(_model(weights, cfg), prefill_chunk=48)
    seq = _ids(200, seed=3)
    cache = eng.new_cache(1, 200)
    cache, _, _ = eng.prefill(cache, [seq[:90]])
    cks, cst = coarse_geometry(32, 16)
    for i in range(90, 200):
        if i > 90:
            cache, _, _ = eng.extend(cache, jnp.asarray([[seq[i - 1]]], jnp.int32), jnp.asarray([[i - 1]], jnp.int32))
        n = int(cache.lengths[0])
        assert n == i
        if i % 7 and i not in (95, 96, 127, 128, 191, 192):  # every 7th step plus the kernel boundaries
            continue
        for lc in cache.layers:
            keys = lc.k.transpose(0, 2, 1, 3)[:, :n]
            ref1 = np.asarray(compress_keys(keys, 32, 16))
            np.testing.assert_allclose(np.asarray(lc.ck1[:, :ref1.shape[1]]), ref1, atol=1e-6, rtol=1e-6)
            assert not np.any(np.asarray(lc.ck1[:, ref1.shape[1]:]))  # rows not yet complete stay empty
            if variant == "gen2":
                ref2 = np.asarray(compress_keys(keys, cks, cst))
                np.testing.assert_allclose(np.asarray(lc.ck2[:, :ref2.shape[1]]), ref2, atol=1e-6, rtol=1e-6)
                assert not np.any(np.asarray(lc.ck2[:, ref2.shape[1]:]))
            else:
                assert lc.ck2 is None


@pytest.mark.parametrize("case", ["dense", "gen2_switch"])
def test_batched_generation_equals_each_alone(weights, case):
    variant, sp = CASES[case]
    eng = InferenceEngine(_model(weights, _cfg(variant, **sp)), prefill_chunk=32)
    prompts = [_ids(n, seed=10 + n) for n in (5, 140, 77)]
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)):
        batch = eng.generate(prompts, 12, sampling=sampling, seeds=[3, 4, 5])
        for i, p in enumerate(prompts):
            alone = eng.generate([p], 12, sampling=sampling, seeds=[3 + i])
            assert batch.tokens[i] == alone.tokens[0], (sampling, i)


@pytest.mark.parametrize("case", ["dense", "gen2_switch"])
def test_sequences_that_stop_early_leave_the_others_unchanged(weights, case):
    """The decode loop is pipelined (step i + 1 is dispatched before step i's tokens are read), so a sequence that
    stops runs one step more than it keeps: the others' tokens, the stop rules and the step count must not change."""
    variant, sp = CASES[case]
    eng = InferenceEngine(_model(weights, _cfg(variant, **sp)), prefill_chunk=32)
    prompts = [_ids(n, seed=20 + n) for n in (6, 126, 60)]
    sampling = SamplingParams(temperature=1.0)
    free = eng.generate(prompts, 12, sampling=sampling, seeds=[7, 8, 9])
    # a stop id that the first sequence draws early and the second never draws: one stops, one runs to length
    stop = next(t for t in free.tokens[0][1:6] if t not in free.tokens[1])
    batch = eng.generate(prompts, 12, sampling=sampling, seeds=[7, 8, 9], stop_ids=[stop])
    assert batch.finish_reasons[0] == "eos" and len(batch.tokens[0]) < 7
    assert batch.finish_reasons[1] == "length" and batch.tokens[1] == free.tokens[1]
    assert batch.decode_steps == 11  # the longest sequence's 11 steps after the prefill's token, no more
    for i, p in enumerate(prompts):
        alone = eng.generate([p], 12, sampling=sampling, seeds=[7 + i], stop_ids=[stop])
        assert batch.tokens[i] == alone.tokens[0] and batch.finish_reasons[i] == alone.finish_reasons[0], i
    one = eng.generate([prompts[0]], 12, sampling=sampling, seeds=[7], stop_ids=[stop])
    assert one.decode_steps == len(one.tokens[0])  # the kept tokens after the first, and the one discarded step
    seq = InferenceEngine(_model(weights, _cfg(variant, **sp)), prefill_chunk=32, pipelined=False)
    ref = seq.generate(prompts, 12, sampling=sampling, seeds=[7, 8, 9], stop_ids=[stop])
    assert ref.tokens == batch.tokens and ref.finish_reasons == batch.finish_reasons
    assert ref.attended_fraction == pytest.approx(batch.attended_fraction, rel=1e-6)
    alone = seq.generate([prompts[0]], 12, sampling=sampling, seeds=[7], stop_ids=[stop])
    assert alone.tokens == one.tokens and alone.decode_steps == len(one.tokens[0]) - 1


def test_engine_greedy_equals_uncached_reference(weights):
    from minicpm4_jax.generate import generate_ids, generate_ids_uncached

    model = _model(weights, BASE)
    prompt = _ids(30, seed=4)
    assert generate_ids(model, prompt, 20) == generate_ids_uncached(model, prompt, 20)
    # break test: the reference took prompt ids outside the vocabulary silently ([5, 500] gave [0, 0, 0]: the
    # embedding gather of id 500 is NaN; [5, -1] read the last row), and stop_ids=2 was a TypeError traceback; it
    # now refuses what the engine refuses, with the engine's messages
    for bad in (500, -1):
        with pytest.raises(ConfigError, match=rf"prompt 0 holds token id {bad}, outside the model's vocabulary"):
            generate_ids_uncached(model, [5, bad], 3)
    with pytest.raises(ConfigError, match=r"stop_ids=2 must be a list of token ids \(e.g. \[2\]\)"):
        generate_ids_uncached(model, [5, 6], 3, stop_ids=2)
    with pytest.raises(ConfigError, match=r"max_new_tokens=2.5 \(--max-new-tokens\) must be an integer"):
        generate_ids_uncached(model, [5, 6], 2.5)


def test_stop_ids_stop_strings_and_length(weights):
    eng = InferenceEngine(_model(weights, BASE), prefill_chunk=32)
    prompt = _ids(20, seed=5)
    free = eng.generate([prompt], 10, sampling=SamplingParams(temperature=1.0), seeds=[1])
    assert free.finish_reasons == ["length"] and len(free.tokens[0]) == 10
    target = free.tokens[0][4]
    first = free.tokens[0].index(target)
    stopped = eng.generate([prompt], 10, sampling=SamplingParams(temperature=1.0), seeds=[1], stop_ids=[target])
    assert stopped.finish_reasons == ["eos"] and stopped.tokens[0] == free.tokens[0][:first + 1]

    def detok(ids):
        return " ".join(f"t{i}" for i in ids)

    stop = f"t{free.tokens[0][2]} t{free.tokens[0][3]}"
    by_text = eng.generate([prompt], 10, sampling=SamplingParams(temperature=1.0), seeds=[1], stop_strings=[stop],
                           detokenize=detok)
    assert by_text.finish_reasons == ["stop"] and stop in detok(by_text.tokens[0])
    assert len(by_text.tokens[0]) <= 4


def test_streaming_calls_in_order(weights):
    eng = InferenceEngine(_model(weights, BASE), prefill_chunk=32)
    seen = []
    out = eng.generate([_ids(9), _ids(4, seed=9)], 6, on_token=lambda r, t: seen.append((r, t)))
    for r in (0, 1):
        assert [t for rr, t in seen if rr == r] == out.tokens[r]


def test_text_generate_stream_and_stop_cut(weights):
    from minicpm4_jax.generate import generate

    class Tok:
        bos_id, eos_id, vocab_size = 1, None, 97

        def encode(self, text):
            return [int(w[1:]) for w in text.split()]

        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    model = _model(weights, BASE)
    full = generate(model, Tok(), "t5 t6 t7", 8, temperature=1.0, seed=2)
    pieces = []
    stop = full[8:14]
    text = generate(model, Tok(), "t5 t6 t7", 8, temperature=1.0, seed=2, stop_strings=[stop], stream=pieces.append)
    assert text == full[:full.index(stop)]
    assert "".join(pieces) == text  # the stream never showed the stop string


class _FixedEngine:
    """The engine protocol ``generate`` uses, emitting fixed new tokens (as InferenceEngine does, via on_token)."""

    def __init__(self, new):
        self.new = list(new)

    def generate(self, prompts, max_new_tokens, *, on_token=None, **_kw):
        import types

        for t in self.new:
            if on_token is not None:
                on_token(0, t)
        return types.SimpleNamespace(tokens=[list(self.new)])


def test_generated_text_is_what_the_new_tokens_add_after_the_prompt():
    """Helper 90: ``generate`` decoded the new tokens alone, so a tokenizer whose decode drops the leading space of
    its text (SentencePiece add_dummy_prefix, Llama-style) streamed and returned ``os`` for ``import`` + ``▁os``
    ("importos"). The text (streamed and returned) is now decode(prompt + new) minus decode(prompt)."""
    from minicpm4_jax.generate import generate

    class DummyPrefixTok:  # SentencePiece with add_dummy_prefix: "▁" is a space, and decode strips the first one
        bos_id, eos_id, vocab_size = 0, None, 5
        pieces = ["<s>", "▁import", "▁os", "\n", "▁sys"]

        def encode(self, text):
            return [self.pieces.index(w) for w in ("▁" + text.replace(" ", " ▁")).split(" ")]

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids if i).replace("▁", " ").removeprefix(" ")

    tok = DummyPrefixTok()
    pieces: list[str] = []
    text = generate(None, tok, "import", 3, stream=pieces.append, engine=_FixedEngine([2, 3, 4]))
    assert text == "".join(pieces) == " os\n sys" == tok.decode([0, 1, 2, 3, 4])[len("import"):]


def test_a_prompt_ending_in_a_space_streams_the_tokens_text(official_tok):
    """Helper 90 (checked, not a fault of ours): with the official tokenizer, the prompt "import " ends in its own
    "▁" token and a model continuing it with "▁os" (the token of " os" after "import") shows two spaces, which
    are in the tokens: decode(prompt + new) is "import  os". The streamed text is exactly what the tokens add."""
    from minicpm4_jax.generate import generate

    tok = official_tok
    prompt_ids = [tok.bos_id] + tok.encode("import ")
    new = tok.encode("import os")[1:] + tok.encode("数据")  # "▁os", then multi-byte text
    pieces: list[str] = []
    text = generate(None, tok, "import ", len(new), stream=pieces.append, engine=_FixedEngine(new))
    want = tok.decode(prompt_ids + new)[len(tok.decode(prompt_ids)):]
    assert text == "".join(pieces) == want == " os数据"


def test_sampler_matches_softmax_distribution():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, 0.5]], jnp.float32)
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.vmap(lambda k: sample_tokens(logits, k[None], SamplingParams(temperature=0.7))[0])(keys)
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    p = np.asarray(jax.nn.softmax(logits[0] / 0.7))
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() * (1 - p.max()) / n)
    topk = jax.vmap(lambda k: sample_tokens(logits, k[None], SamplingParams(temperature=1.0, top_k=2))[0])(keys[:2000])
    assert set(np.asarray(topk).tolist()) == {0, 1}
    assert np.isfinite(np.asarray(top_k_filter(logits, 3))).tolist() == [[True, True, False, False, True]]
    assert int(sample_tokens(logits, keys[:1], SamplingParams())[0]) == 0


def test_greedy_tokens_is_argmax_with_its_tie_and_nan_rules():
    from minicpm4_jax.infer.sampling import greedy_tokens

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 257)).astype(np.float32)
    x[0, 1, [7, 100, 200]] = 9.0  # ties: the first index wins
    x[1, 2, :] = -np.inf  # a row with nothing allowed: index 0
    x[2, 0, [5, 30]] = np.nan  # NaN: the first NaN, as jnp.argmax
    x[2, 1, 40] = np.inf
    x[2, 1, 9] = np.nan
    x[2, 2, 200] = np.nan  # a NaN after the maximum, where XLA:CPU's vectorised max skipped it
    x[2, 2, 3] = 50.0
    got = np.asarray(jax.jit(greedy_tokens)(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == (3, 5)
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got[0, 1] == 7 and got[1, 2] == 0 and got[2, 0] == 5 and got[2, 1] == 9 and got[2, 2] == 200
    wide = np.zeros((2, 4097), np.float32)  # a vocabulary the vectorised max walks in many lanes
    wide[:, 3] = 1.0
    wide[0, 4096] = np.nan
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens)(jnp.asarray(wide))), [4096, 3])


def test_vocab_limit_is_respected():
    logits = jnp.asarray([[0.0, 1.0, 5.0]], jnp.float32)
    assert int(sample_tokens(logits, jax.random.split(jax.random.key(0), 1), SamplingParams(), vocab_limit=2)[0]) == 1


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_sparse_decode_attention_matches_stage2_reference(variant, split):
    rng = np.random.default_rng(7)
    b, nkv, g, d, cap, bs = 2, 2, 3, 16, 256, 32
    k = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, nkv * g, d)), jnp.float32)
    pos = jnp.asarray([200, 93], jnp.int32)
    params = select_params(SparseConfig(**{**GEOM, "variant": variant}))
    k_used = params.topk_cfg
    # a valid selection: ascending distinct causal blocks, -1 padded
    idx = np.full((b, nkv, k_used), -1, np.int32)
    for i in range(b):
        qb = int(pos[i]) // bs
        for h in range(nkv):
            pick = np.sort(rng.choice(qb + 1, size=min(k_used, qb + 1), replace=False))
            idx[i, h, :len(pick)] = pick
    window = params.local_blocks if variant == "gen1" else 0
    # split: forced init/window blocks read as contiguous slices, the other picks gathered in `width` columns
    extra = dict(init_blocks=1, window_blocks=window + 1, gather_width=k_used) if split else dict(window_blocks=window)
    got = sparse_decode_attention(q, k, v, jnp.asarray(idx), q_positions=pos, block_size=bs, **extra)
    ref = infllmv2_stage2(q[:, None], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.asarray(idx)[:, :, None],
                          q_positions=pos[:, None], kv_positions=jnp.broadcast_to(jnp.arange(cap), (b, cap)),
                          block_size=bs, **extra)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)
    dense = dense_decode_attention(q, k, v, q_positions=pos)
    dref = dense_attention(q[:, None], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q_positions=pos[:, None],
                           kv_positions=jnp.broadcast_to(jnp.arange(cap), (b, cap)))[:, 0]
    np.testing.assert_allclose(np.asarray(dense), np.asarray(dref), atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(got), np.asarray(dense), atol=1e-3)  # the selection matters here


def test_bad_requests_are_one_line_errors(weights):
    eng = InferenceEngine(_model(weights, BASE), prefill_chunk=32)
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        eng.generate([[]], 3)
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        eng.generate([[1]], 0)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=1024"):
        eng.generate([[1] * 1000], 30)
    with pytest.raises(ConfigError, match="top_p=0"):
        eng.generate([[1]], 3, sampling=SamplingParams(top_p=0.0))
    with pytest.raises(ConfigError, match="temperature=-1"):
        eng.generate([[1]], 3, sampling=SamplingParams(temperature=-1.0))
    with pytest.raises(ConfigError, match="top_k=-2"):
        eng.generate([[1]], 3, sampling=SamplingParams(top_k=-2))
    with pytest.raises(ConfigError, match="detokenize"):
        eng.generate([[1]], 3, stop_strings=["x"])
    with pytest.raises(ConfigError, match="2 seeds for 1 prompts"):
        eng.generate([[1]], 3, seeds=[1, 2])
    # found by the break test: seeds outside uint32, empty stop strings, non-finite / non-integer sampling values
    with pytest.raises(ConfigError, match=r"seed -1 is outside \[0, 4294967295\]"):
        eng.generate([[1]], 3, seeds=-1)
    with pytest.raises(ConfigError, match="seed 4294967296 is outside"):
        eng.generate([[1], [2]], 3, seeds=2**32 - 1)  # row 1 gets seed + 1
    with pytest.raises(ConfigError, match="stop string is empty"):
        eng.generate([[1]], 3, stop_strings=[""], detokenize=str)
    with pytest.raises(ConfigError, match="temperature=inf must be a finite number"):
        eng.generate([[1]], 3, sampling=SamplingParams(temperature=float("inf")))
    # twelfth-session break test: a temperature near float32's smallest normal number passed and logits/temperature
    # overflowed (NaN samples: newlines, <unk>); colder than 1e-5 is refused, naming greedy
    with pytest.raises(ConfigError, match=r"temperature=1e-40 is below 1e-05: .* use temperature=0 for greedy"):
        eng.generate([[1]], 3, sampling=SamplingParams(temperature=1e-40))
    with pytest.raises(ConfigError, match="top_k=2.5 must be an integer"):
        eng.generate([[1]], 3, sampling=SamplingParams(top_k=2.5))
    # second break test: out-of-range / non-integer prompt ids ran silently (ids clamped or truncated), a
    # vocab_limit of 0 was "respected" by producing id 0, numpy / non-integer seeds, string sampling values
    v = BASE.vocab_size
    for prompt, bad in (([50 + v, 2], 50 + v), ([-3, 2], -3)):
        with pytest.raises(ConfigError, match=rf"prompt 0 holds token id {bad}, outside the model's vocabulary"):
            eng.generate([[1], prompt][::-1], 3)
    with pytest.raises(ConfigError, match="prompt 0 must be a flat list of integer token ids"):
        eng.generate([[1.5, 2]], 3)
    for bad in (0, -2, 2.5):
        with pytest.raises(ConfigError, match=rf"vocab_limit={bad} must be an integer >= 1"):
            eng.generate([[1]], 3, vocab_limit=bad)
    for bad in (1.5, "ab", [1.5], None):
        with pytest.raises(ConfigError, match="must be one integer or a list of integers"):
            eng.generate([[1]], 3, seeds=bad)
    with pytest.raises(ConfigError, match=r"max_new_tokens=2.5 \(--max-new-tokens\) must be an integer"):
        eng.generate([[1]], 2.5)
    with pytest.raises(ConfigError, match="temperature='0.5' must be a finite number"):
        eng.generate([[1]], 3, sampling=SamplingParams(temperature="0.5"))
    with pytest.raises(ConfigError, match=r"top_p='1' must be in \(0, 1\] \(a number\)"):
        eng.generate([[1]], 3, sampling=SamplingParams(top_p="1"))
    sampled = SamplingParams(temperature=0.8)
    assert (eng.generate([[1, 2]], 3, sampling=sampled, seeds=np.int64(3)).tokens
            == eng.generate([[1, 2]], 3, sampling=sampled, seeds=3).tokens
            == eng.generate([np.asarray([1, 2])], 3, sampling=sampled, seeds=[np.int32(3)]).tokens)
    with pytest.raises(ConfigError, match="prefill_chunk=10"):
        InferenceEngine(_model(weights, BASE), prefill_chunk=10)
    # a float / str / None chunk passed the range check or failed it with a TypeError (32.0 at the first prefill)
    for bad in (32.0, "32", None, True):
        with pytest.raises(ConfigError, match=rf"prefill_chunk={bad!r} must be a positive multiple of 16"):
            InferenceEngine(_model(weights, BASE), prefill_chunk=bad)
    assert InferenceEngine(_model(weights, BASE), prefill_chunk=np.int64(32)).prefill_chunk == 32
    with pytest.raises(ConfigError, match="attention_impl='pallas'"):
        InferenceEngine(_model(weights, dataclasses.replace(BASE, attention_impl="pallas")))
    with pytest.raises(ConfigError, match="kernel_offby1_quirk"):
        InferenceEngine(_model(weights, _cfg("gen2", kernel_offby1_quirk=True)))
    with pytest.raises(ConfigError, match="attention='flash'"):
        with_attention(_model(weights, BASE), "flash")


def test_stop_lists_and_prompt_lists_of_the_wrong_shape_are_one_line_errors(weights):
    """Break test: ``stop_strings="t19 t75"`` (one string, not a list) was read as its characters and stopped at the
    first ``t`` (1 token of 12, reason "stop"), in the engine and in the text ``generate``; ``stop_ids=2``, a stop
    string that is an id, and one prompt not wrapped in a list (``generate(ids, n)``) were tracebacks."""
    from minicpm4_jax.generate import generate

    eng = InferenceEngine(_model(weights, BASE), prefill_chunk=32)
    prompt = _ids(20, seed=5)
    sampling = SamplingParams(temperature=1.0)

    def detok(ids):
        return " ".join(f"t{i}" for i in ids)

    free = eng.generate([prompt], 12, sampling=sampling, seeds=[1])
    stop = detok(free.tokens[0][8:10])  # its characters ("t", digits, " ") occur from the first token on
    assert stop not in detok(free.tokens[0][:9])
    listed = eng.generate([prompt], 12, sampling=sampling, seeds=[1], stop_strings=[stop], detokenize=detok)
    assert listed.finish_reasons == ["stop"] and listed.tokens[0] == free.tokens[0][:10]
    with pytest.raises(ConfigError, match=rf"stop_strings='{stop}' is one string, .* \['{stop}'\]"):
        eng.generate([prompt], 12, sampling=sampling, seeds=[1], stop_strings=stop, detokenize=detok)

    class Tok:
        bos_id, eos_id, vocab_size = 1, None, 97

        def encode(self, text):
            return [int(w[1:]) for w in text.split()]

        def decode(self, ids):
            return detok(ids)

    with pytest.raises(ConfigError, match="is one string"):
        generate(_model(weights, BASE), Tok(), "t5 t6", 4, stop_strings="t1")
    for kw, msg in ((dict(stop_ids=2), r"stop_ids=2 must be a list of token ids \(e.g. \[2\]\)"),
                    (dict(stop_ids=["x"]), "stop id 'x' is not an integer token id"),
                    (dict(stop_strings=[2], detokenize=detok), "stop string 2 is not text")):
        with pytest.raises(ConfigError, match=msg):
            eng.generate([prompt], 3, **kw)
    with pytest.raises(ConfigError, match=r"prompt 0 is 1 \(int\), not a list of token ids"):
        eng.generate([1, 2, 3], 3)
    with pytest.raises(ConfigError, match="prompts must be a list of token-id lists"):
        eng.generate("t1 t2", 3)
    assert eng.generate([prompt], 3, stop_ids=None, stop_strings=None).tokens == eng.generate([prompt], 3).tokens
    # ids of numpy / jax integer types are ids
    assert eng.generate([prompt], 12, sampling=sampling, seeds=[1],
                        stop_ids=(np.int64(free.tokens[0][3]), jnp.int32(free.tokens[0][3]))).tokens[0] == (
        free.tokens[0][:free.tokens[0].index(free.tokens[0][3]) + 1])


def test_stop_lists_that_are_not_iterable_are_one_line_errors():
    """Break test of check_stops (0297002): ``stop_strings=5`` (a number, not a list of texts) and ``stop_ids`` given as
    a 0-d array were ``TypeError`` tracebacks ("'int' object is not iterable", "iteration over a 0-d array"), and
    ``stop_ids=5.0`` suggested the fix ``[5.0]``, which is refused in turn. Lists of numpy / jax ids still pass."""
    from minicpm4_jax.infer.engine import check_stops

    for bad in (5, 3.5, np.array("x")):
        with pytest.raises(ConfigError, match=r"stop_strings=.* must be a list of stop texts \(token ids go in"):
            check_stops(None, bad)
    for bad in (jnp.asarray(2), np.array(2.0), 5.0):
        with pytest.raises(ConfigError, match=r"stop_ids=.* must be a list of token ids \(integers; texts go in"):
            check_stops(bad, None)
    with pytest.raises(ConfigError, match=r"stop_ids=2 must be a list of token ids \(e.g. \[2\]\)"):
        check_stops(2, None)
    assert check_stops(np.array([1, 2]), ["a"]) == ((1, 2), ("a",))
    assert check_stops([np.int64(3), jnp.int32(4)], None) == ((3, 4), ())


def test_check_stops_names_the_callers_parameter_and_its_empty_text_policy():
    """check_stops serves EvalModel.generate too (its ``stop=`` check was a near-copy): the caller's parameter name in
    every message, no token-id hint where the caller takes no ids, and empty texts refused (the engine: a stop that
    matches at once) or dropped (eval: lm-eval passes ``until=[""]``). Before, check_stops let ``""`` through (only
    validate_request refused it) and had no name or policy to give."""
    from minicpm4_jax.infer.engine import check_stops

    with pytest.raises(ConfigError, match=r"^a stop string is empty; give non-empty stop texts$"):
        check_stops((), ["END", ""])
    assert check_stops((), ["", "END", ""], name="stop", ids_name=None, empty="drop") == ((), ("END",))
    with pytest.raises(ConfigError, match=r"^stop='\\n' is one string, .*; pass a list of stop texts: \['\\n'\] "
                                          r"\(stop=\['\\n'\]\)$"):
        check_stops((), "\n", name="stop", ids_name=None, empty="drop")
    with pytest.raises(ConfigError, match=r"^stop=7 must be a list of stop texts \(or None for none\)$"):
        check_stops((), 7, name="stop", ids_name=None)
    with pytest.raises(ConfigError, match=r"^stop string 7 is not text; stop= takes texts$"):
        check_stops((), ["a", 7], name="stop", ids_name=None)
    with pytest.raises(ConfigError, match=r"^stop string 7 is not text; stop_strings= takes texts \(token ids go in "
                                          r"stop_ids\)$"):
        check_stops((), [7])
    with pytest.raises(ConfigError, match=r"^empty='keep'; use 'refuse' or 'drop'$"):
        check_stops((), ["a"], empty="keep")


def test_a_consumed_cache_is_a_one_line_error_and_a_copy_branches(weights):
    """Break test: ``prefill`` / ``extend`` donate the cache; extending the same cache twice (two continuations of one
    prefix) failed with jax's "Array has been deleted with shape=int32[1]", naming neither the cache nor the fix."""
    eng = InferenceEngine(_model(weights, BASE), prefill_chunk=32)
    prompt = _ids(20, seed=3)
    cache, _, _ = eng.prefill(eng.new_cache(1, 40), [prompt])
    branch = jax.tree.map(jnp.copy, cache)
    pos = jnp.asarray([[20]], jnp.int32)
    _, a, _ = eng.extend(cache, jnp.asarray([[4]], jnp.int32), pos)
    fix = r"consumed by an earlier prefill / extend .*\(jax.tree.map\(jnp.copy, cache\)\)"
    with pytest.raises(ValueError, match=fix):
        eng.extend(cache, jnp.asarray([[5]], jnp.int32), pos)
    with pytest.raises(ValueError, match="consumed by an earlier prefill"):
        eng.prefill(cache, [prompt])
    _, b, _ = eng.extend(branch, jnp.asarray([[5]], jnp.int32), pos)  # the copy: the other continuation
    _, full, _ = eng.prefill(eng.new_cache(1, 40), [prompt + [5]])
    np.testing.assert_allclose(np.asarray(b[0, 0]), np.asarray(full[0]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_extend_at_earlier_positions_rolls_the_sequence_back(weights):
    """Break test: ``extend`` documents that writing at earlier positions overwrites (speculative rollback), but the
    cached length stayed at its maximum, so the compressed keys of windows the overwritten tokens had completed were
    never recomputed: after 40 rejected tokens at 200..239 were rewritten, 48 of the 128 later logit rows differed
    from the run that never wrote them (up to 0.0055), through stale stage-1 scores of blocks 6-7, and the length
    stayed 240 while the true sequence was 208 .. 232 tokens long."""
    variant, sp = CASES["gen2_picks"]
    eng = InferenceEngine(_model(weights, _cfg(variant, **sp)), prefill_chunk=32)
    seq, wrong = _ids(330, seed=11), _ids(330, seed=12)

    def run(rejected):
        cache, _, _ = eng.prefill(eng.new_cache(1, 330), [seq[:200]])
        if rejected:
            for s in range(200, 240, 8):
                cache, _, _ = eng.extend(cache, jnp.asarray([wrong[s:s + 8]]), jnp.arange(s, s + 8)[None])
        lengths, out = [], []
        for s in range(200, 328, 8):
            cache, lg, _ = eng.extend(cache, jnp.asarray([seq[s:s + 8]]), jnp.arange(s, s + 8)[None])
            lengths.append(int(cache.lengths[0]))
            out.append(np.asarray(lg[0]))
        return np.concatenate(out), lengths

    clean, clean_lengths = run(False)
    rolled, lengths = run(True)
    np.testing.assert_allclose(rolled, clean, rtol=1e-5, atol=1e-5)
    assert lengths == clean_lengths == list(range(208, 329, 8))


@pytest.mark.parametrize("case", ["dense", "gen2"])
def test_extend_past_the_cache_capacity_is_refused(weights, case):
    """Break test: extend() wrote a token at a position beyond the cache (a 128-slot cache fed position 128): the
    write was dropped, the cached length went to 129 and the logits were silently off (0.0103 against the full
    forward, 1e-7 one step before). A cache that fills up now raises, naming the position and the capacity."""
    variant, sp = CASES[case]
    eng = InferenceEngine(_model(weights, _cfg(variant, **sp)), prefill_chunk=64)
    seq = _ids(130, seed=4)
    cache = eng.new_cache(1, 100)
    assert cache.capacity == 128
    cache, _, _ = eng.prefill(cache, [seq[:127]])
    cache, _, _ = eng.extend(cache, jnp.asarray([[seq[127]]], jnp.int32), jnp.asarray([[127]], jnp.int32))  # fits
    assert int(cache.lengths[0]) == 128
    for width in (1, 20):  # a decode step and a longer (prefill-mode) chunk
        with pytest.raises(ValueError, match=rf"position {127 + width} does not fit a cache of 128 slots"):
            eng.extend(cache, jnp.zeros((1, width), jnp.int32), jnp.asarray([128 + np.arange(width)], jnp.int32))
    # padding rows (-1) and positions inside the capacity still run
    _, lg, _ = eng.extend(cache, jnp.asarray([[seq[127], 0]], jnp.int32), jnp.asarray([[127, -1]], jnp.int32))
    assert np.isfinite(np.asarray(lg)).all()


def test_with_attention_switches_algorithm_keeps_weights(weights):
    model = _model(weights, BASE)
    sp = with_attention(model, "infllmv2")
    assert sp.cfg.attention == "infllmv2" and sp.cfg.sparse_config == SparseConfig()
    np.testing.assert_array_equal(np.asarray(sp.norm[...]), np.asarray(model.norm[...]))
    back = with_attention(sp, "dense")
    ids = jnp.asarray([_ids(40)], jnp.int32)
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_sparse_decode_attention_several_tokens_matches_stage2_reference(variant):
    """A verify chunk: 3 new tokens per sequence crossing a block boundary, each with its own selection."""
    rng = np.random.default_rng(8)
    b, nkv, g, d, cap, bs, t = 2, 2, 3, 16, 256, 32, 3
    k = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32)
    pos = jnp.asarray([[190, 191, 192], [62, 63, -1]], jnp.int32)  # the second sequence has one inactive row
    params = select_params(SparseConfig(**{**GEOM, "variant": variant}))
    k_used = params.topk_cfg
    idx = np.full((b, nkv, t, k_used), -1, np.int32)
    for i in range(b):
        for j in range(t):
            if pos[i, j] < 0:
                continue
            qb = int(pos[i, j]) // bs
            for h in range(nkv):
                pick = np.sort(rng.choice(qb + 1, size=min(k_used, qb + 1), replace=False))
                idx[i, h, j, :len(pick)] = pick
    window = params.local_blocks if variant == "gen1" else 0
    extra = dict(init_blocks=1, window_blocks=window + 1, gather_width=k_used)
    got = sparse_decode_attention(q, k, v, jnp.asarray(idx), q_positions=pos, block_size=bs, **extra)
    ref = infllmv2_stage2(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.asarray(idx), q_positions=pos,
                          kv_positions=jnp.broadcast_to(jnp.arange(cap), (b, cap)), block_size=bs, **extra)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(got[1, 2]))  # the inactive row is zeros
    one = sparse_decode_attention(q[:, 1], k, v, jnp.asarray(idx[:, :, 1]), q_positions=pos[:, 1], block_size=bs,
                                  **extra)
    np.testing.assert_allclose(np.asarray(got[:, 1]), np.asarray(one), atol=1e-6, rtol=1e-6)


def test_uncached_reference_sees_the_true_length_across_dense_len():
    """Break-test regression: the reference once padded its buffer, so a sparse model dispatched on the padded length."""
    from minicpm4_jax.generate import generate_ids_uncached

    # gen-1 with 1 top-k block and a 1-block window: sparse differs from dense below dense_len = 128; a larger
    # init makes the logits spread enough that the dispatch changes the argmax (checked below)
    cfg = dataclasses.replace(_cfg("gen1", dense_len=128, topk=1, window_size=32), initializer_range=0.5)
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    prompt = _ids(120, seed=3)
    exact = np.asarray(model(jnp.asarray([prompt], jnp.int32)))[0, -1]
    padded = np.asarray(model(jnp.asarray([prompt + [0] * 16], jnp.int32)))[0, 119]  # dispatches sparse
    assert exact.argmax() != padded.argmax()  # so a padded reference would give another first token
    ref = generate_ids_uncached(model, prompt, 16)
    assert ref[0] == int(exact.argmax())
    assert generate_ids_uncached(model, prompt, 1) == ref[:1]  # the first token does not depend on the budget
    assert InferenceEngine(model, prefill_chunk=64).generate([prompt], 16).tokens[0] == ref


def test_windowed_dense_decode_attention():
    """``window=W``: each query attends exactly its last W positions (dense attention with the rest masked)."""
    b, nkv, g, d, cap, w = 4, 2, 3, 16, 96, 20
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(ks[0], (b, nkv * g, d))
    k = jax.random.normal(ks[1], (b, nkv, cap, d))
    v = jax.random.normal(ks[2], (b, nkv, cap, d))
    pos = jnp.array([5, 57, 95, -1], jnp.int32)  # shorter than the window, middle, the last slot, inactive
    got = dense_decode_attention(q, k, v, q_positions=pos, window=w)
    kvp = jnp.broadcast_to(jnp.arange(cap), (b, cap))
    ref = dense_attention(q[:, None], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q_positions=pos[:, None],
                          kv_positions=kvp, kv_valid=kvp > pos[:, None] - w)[:, 0]
    np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(ref)[:3], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[3] == 0)  # the inactive row
    full = dense_decode_attention(q, k, v, q_positions=pos)
    np.testing.assert_allclose(np.asarray(got)[0], np.asarray(full)[0], atol=1e-6)  # position 5 < W: all of it
    assert not np.allclose(np.asarray(got)[1], np.asarray(full)[1], atol=1e-3)  # the window really cuts
    same = dense_decode_attention(q, k, v, q_positions=pos, window=cap)  # W >= capacity: the full path
    np.testing.assert_array_equal(np.asarray(same), np.asarray(full))
    with pytest.raises(ValueError, match="one token per sequence"):
        dense_decode_attention(q[:, None], k, v, q_positions=pos[:, None], window=w)
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        dense_decode_attention(q, k, v, q_positions=pos, window=0)


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_sparse_decode_of_a_cache_shorter_than_the_window(weights, impl):
    """The MiniCPM4.1 geometry (window 33 blocks of 64) over a 128-slot cache: the XLA decode refused a cache of
    fewer blocks than the window, so a short sparse generation failed without the native kernel."""
    cfg = dataclasses.replace(BASE, attention="infllmv2", sparse_config=SparseConfig(dense_len=-1),
                              attention_impl=impl)
    model = _model(weights, cfg)
    seq = _ids(90, seed=3)
    got, _ = _stepwise_logits(InferenceEngine(model), seq[:70], seq[70:])
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray([seq], jnp.int32)))[0, 69:-1]
    np.testing.assert_allclose(got, full, atol=1e-4, rtol=1e-4)


def test_top_p_keeps_the_smallest_set_with_ties():
    """Helper 66: top-p kept every token tied with the smallest kept logit ([2, 1, 1, 1] at 0.5 kept all four; HF
    keeps two). The kept set is now the nucleus's size, ties taken in index order; checked against a NumPy
    reference on integer logits (many ties)."""
    from minicpm4_jax.infer.sampling import top_p_filter

    rng = np.random.default_rng(0)
    for _ in range(200):
        lg = rng.integers(-3, 3, size=(1, 9)).astype(np.float32)
        p = float(rng.choice([0.1, 0.3, 0.5, 0.7, 0.9, 0.99]))
        order = np.lexsort((np.arange(9), -lg[0]))  # logit descending, then index
        probs = np.exp(lg[0][order] - lg[0].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        n = max(1, int(np.sum(before < p)))
        want = np.zeros(9, bool)
        want[order[:n]] = True
        got = np.isfinite(np.asarray(top_p_filter(jnp.asarray(lg), p)))[0]
        assert (got == want).all(), (lg, p, got, want)
    assert np.isfinite(np.asarray(top_p_filter(jnp.array([[2.0, 1.0, 1.0, 1.0]]), 0.5))).tolist() == [
        [True, True, False, False]]


@pytest.mark.parametrize("variant", ["gen1", "gen2_picks"])
def test_decode_switches_to_sparse_exactly_at_dense_len(weights, variant):
    """The dense-to-sparse switch of decode steps sits where prefill's does: a step whose sequence (the new
    token included) holds ``dense_len`` keys runs sparse, one key fewer dense (helper 70: ``n <= dense_len`` in
    :func:`decode_mode` passed every test, since the switch cases above put dense_len where sparse equals
    dense). Here ``dense_len`` = 200 > 4 blocks of 32: sparse and dense differ at the switch. One layer: its keys
    and values do not depend on the attention mode, so the cache (filled densely below the switch) equals a
    from-scratch forward's (sparse over the whole sequence) and the step's logits must match to 1e-4."""
    from minicpm4_jax.infer.engine import decode_mode

    v, sp = CASES[variant] if variant in CASES else (variant, {})
    cfg = _cfg(v, **{**sp, "dense_len": 200})
    assert [decode_mode(cfg, [n]) for n in (199, 200, 201)] == ["dense", "sparse", "sparse"]
    assert decode_mode(cfg, [199, 200]) == "mixed" and decode_mode(BASE, [500]) == "dense"
    one = dataclasses.replace(BASE, num_hidden_layers=1)
    w1 = nnx.state(MiniCPM4(one, rngs=nnx.Rngs(3)))
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: MiniCPM4(dataclasses.replace(cfg, num_hidden_layers=1),
                                                                   rngs=nnx.Rngs(0)))), w1)
    seq = _ids(204, seed=5)
    got, _ = _stepwise_logits(InferenceEngine(model, prefill_chunk=64), seq[:190], seq[190:])
    fwd = jax.jit(lambda m, x: m(x))
    dense_model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: MiniCPM4(one, rngs=nnx.Rngs(0)))), w1)
    for n in (199, 200, 201):  # got[i]: the logits after n = 190 + i tokens
        full = np.asarray(fwd(model, jnp.asarray([seq[:n]], jnp.int32)))[0, -1]
        np.testing.assert_allclose(got[n - 190], full, atol=1e-4, rtol=1e-4, err_msg=f"{n} tokens")
        if n >= 200:  # the guard: sparse really differs from dense here
            dense = np.asarray(fwd(dense_model, jnp.asarray([seq[:n]], jnp.int32)))[0, -1]
            assert np.abs(dense - full).max() > 1e-3, n


def test_generate_puts_the_prefix_ids_before_the_prompt():
    """``generate(prefix_ids=None)`` prompts after ``[bos_id]`` (the official convention), ``prefix_ids`` replaces
    it, ``[]`` puts nothing (helper 70: the default had no test). A stub engine records the ids it is given."""
    from types import SimpleNamespace

    from minicpm4_jax.generate import generate

    seen = []

    class Engine:
        def generate(self, prompts, max_new_tokens, **kw):
            seen.append(list(prompts[0]))
            return SimpleNamespace(tokens=[[]])

    tok = SimpleNamespace(bos_id=1, eos_id=2, vocab_size=97, encode=lambda s: [40 + len(s), 41], decode=lambda ids: "")
    for prefix, want in ((None, [1]), ([2], [2]), ([], [])):
        assert generate(None, tok, "ab", 3, prefix_ids=prefix, engine=Engine()) == ""
        assert seen[-1] == want + [42, 41], prefix


def test_generate_stops_at_every_eos_id_of_the_model(weights):
    """An imported official MiniCPM4 ends a chat turn with ``<|im_end|>`` (73440), the second of its
    ``eos_token_id`` [2, 73440] (the official ``generation_config.json``; our GGUF export makes llama.cpp stop on
    both). ``generate`` stopped only at the tokenizer's ``</s>``, so it ran on past the turn's end, streamed the
    ``<|im_end|>`` text and kept it in the result. A model eos id ends the text, is not shown, not streamed."""
    from minicpm4_jax.generate import generate

    class Tok:
        bos_id, eos_id, vocab_size = 1, 2, 97

        def encode(self, text):
            return [int(w[1:]) for w in text.split()]

        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    plain = generate(_model(weights, BASE), Tok(), "t5 t6 t7", 8, temperature=1.0, seed=2)
    ids = [int(x) for x in plain[1:-1].split("><")]
    end = next(i for i in ids[2:] if i not in (2, ids[0], ids[1]))  # a later token that is not one before it
    model = _model(weights, dataclasses.replace(BASE, eos_token_id=(2, end)))
    pieces = []
    text, out = generate(model, Tok(), "t5 t6 t7", 8, temperature=1.0, seed=2, stream=pieces.append,
                         return_output=True)
    cut = ids.index(end)
    assert out.finish_reasons == ["eos"] and out.tokens[0] == ids[:cut + 1]
    assert text == plain[:plain.index(f"<{end}>")] and "".join(pieces) == text


def _official_tokenizer(kind: str):
    """The MiniCPM4 tokenizer as its SentencePiece model (``"sentencepiece"``) or as the ``tokenizer.json`` form an
    ``import hf`` / ``export hf`` folder holds (``"hf"``: a ``ByteFallback`` decoder)."""
    import json

    from conftest import shared_path

    from minicpm4_jax.tokenizer import Tokenizer, load_tokenizer, sentencepiece_to_hf_json

    folder = shared_path("data", "minicpm4-0.5b")
    if kind == "sentencepiece":
        return load_tokenizer(folder / "tokenizer.model")
    added = json.loads((folder / "added_tokens.json").read_text())
    return Tokenizer(hf_json=sentencepiece_to_hf_json((folder / "tokenizer.model").read_bytes(),
                                                      {i: t for t, i in added.items()}))


class _ReplayEngine:
    """The engine protocol ``generate`` uses, replaying fixed new tokens through the engine's stop rules and streaming
    (:class:`~minicpm4_jax.infer.engine._Collector`)."""

    def __init__(self, ids):
        self.ids = ids

    def generate(self, prompts, max_new, *, stop_ids, stop_strings, detokenize, on_token, **_kw):
        from types import SimpleNamespace

        from minicpm4_jax.infer.engine import _Collector

        col = _Collector(1, max_new, stop_ids, stop_strings, detokenize, on_token)
        for i in self.ids:
            if col.active[0]:
                col.take(0, i)
        return SimpleNamespace(tokens=col.out, finish_reasons=col.reasons)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_streamed_text_equals_the_final_text_across_byte_fallback_runs(kind):
    """The streamed pieces of ``generate`` concatenate to its returned text with the real MiniCPM4 tokenizer, also when
    the model spells characters as byte-fallback tokens (a CJK or rare character, or sampled invalid bytes).

    The ``tokenizer.json`` form (an ``import hf`` / ``export hf`` folder) decodes a run of byte tokens as a whole
    (the ``ByteFallback`` decoder): one invalid byte turns every byte of the run into U+FFFD, also those already
    decoded to a valid character. The stream had shown ``"ༀ"`` from the first three bytes, the final text held
    U+FFFD there: the terminal showed other text than ``--no-stream`` prints."""
    from types import SimpleNamespace

    from minicpm4_jax.generate import generate

    tok = _official_tokenizer(kind)
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    runs = [
        [byte[b] for b in "ༀ".encode()] + [byte[0xE0]] + [byte[b] for b in "你".encode()] + tok.encode(" z\n\nfoo"),
        tok.encode("ok ") + [byte[b] for b in "€".encode()] + [byte[0xF0], byte[0x9F]] + tok.encode("好 end"),
        tok.encode("日本") + [byte[b] for b in "𓀀ab".encode()[:4]] + [2],
    ]

    model = SimpleNamespace(cfg=SimpleNamespace(eos_token_id=(2,)))
    for ids in runs:
        for stops in ((), ("foo",), ("end", "z")):
            pieces = []
            text = generate(model, tok, "p", len(ids), stop_strings=stops, stream=pieces.append,
                            engine=_ReplayEngine(ids))
            assert "".join(pieces) == text, (kind, stops, pieces, text)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_new_bytes_continuing_a_prompt_byte_run_cut_by_the_decode_window(kind):
    """Review of the merge of the byte-fallback hold with :func:`continuation_decoder`: the decoder reads the new text
    after the prompt's last 16 tokens; for a prompt ending in a byte-fallback run ("x" + 6 x "ༀ": 18 byte tokens)
    those began inside a character (its continuation bytes). A ``ByteFallback`` decoder turns such a run into U+FFFD
    as a whole, and new byte tokens continuing the run joined it: a generated "𝕐" was returned and streamed as four
    U+FFFD. The window now starts at the character's first byte, and the text is what the tokens add to the prompt."""
    from minicpm4_jax.generate import generate

    tok = _official_tokenizer(kind)
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    for prompt in ("x" + "ༀ" * 6, "𝕏" * 5 + "ༀ", "ab" + "ༀ" * 5):
        prompt_ids = [tok.bos_id] + tok.encode(prompt)
        for new in ([byte[b] for b in "𝕐".encode()] + tok.encode(" ok"), [byte[b] for b in "é".encode()]):
            want = tok.decode(prompt_ids + new)[len(tok.decode(prompt_ids)):]
            pieces: list[str] = []
            text = generate(None, tok, prompt, len(new), stream=pieces.append, engine=_FixedEngine(new))
            assert text == "".join(pieces) == want != "", (kind, prompt, text, pieces, want)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_incremental_text_equals_the_whole_decode_after_every_token(kind):
    """:class:`IncrementalText` (the stop-string check and the stream) decodes a window per token; its text after
    every token is the whole decode of the ids so far, for random ids of the real MiniCPM4 tokenizer: words, byte
    runs (valid, cut and invalid bytes), spaces, after a prompt or not. So a stop string is found at the same token
    as by decoding the whole output."""
    from minicpm4_jax.generate import continuation_decoder
    from minicpm4_jax.infer.detok import IncrementalText

    tok = _official_tokenizer(kind)
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    words = tok.encode("import os 数据 hello  world\n\n def é ok 日本 z") + [tok.token_to_id("▁")]
    utf8 = [byte[b] for b in "ༀ€𝕐é".encode()]
    rng = np.random.default_rng(0)
    for case in range(12):
        pool = [words, utf8, byte[0x80:], words + utf8][case % 4]
        ids = [int(pool[i]) for i in rng.integers(0, len(pool), 120)]
        prompt = [tok.bos_id] + tok.encode("x" + "ༀ" * (case % 3))
        decode = continuation_decoder(tok, prompt) if case % 2 else tok.decode
        text = IncrementalText(decode)
        for n, i in enumerate(ids, 1):
            text.push(i)
            assert text.text() == decode(ids[:n]), (kind, case, n)


class _CountingTokenizer:
    """The official tokenizer, recording the number of ids of every ``decode`` call."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []
        self.bos_id, self.eos_id, self.vocab_size = tok.bos_id, tok.eos_id, tok.vocab_size
        self.encode, self.id_to_token = tok.encode, tok.id_to_token

    def decode(self, ids):
        ids = list(ids)
        self.lengths.append(len(ids))
        return self.tok.decode(ids)


def test_detokenizing_costs_a_bounded_window_per_token():
    """Earlier sessions: the stop-string check (``_Collector.take``) and the stream (``_StreamPrinter``) decoded the
    whole generated output at every new token (quadratic: ~15 ms a token at a 32K-token output). Both now decode a
    bounded window per token; the text, the stream and where a stop string that spans several tokens stops are
    those of whole decodes."""
    from types import SimpleNamespace

    from minicpm4_jax.generate import generate

    tok = _CountingTokenizer(_official_tokenizer("sentencepiece"))
    byte = [tok.tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    chunk = tok.encode(" print(数据[i]) if x else None\n") + [byte[b] for b in "𝕐".encode()]
    new = chunk * 60  # 900 tokens
    model = SimpleNamespace(cfg=SimpleNamespace(eos_token_id=(2,)))
    prompt_ids = [tok.bos_id] + tok.encode("def f():")
    want = tok.tok.decode(prompt_ids + new)[len(tok.tok.decode(prompt_ids)):]
    pieces: list[str] = []
    tok.lengths.clear()
    text = generate(model, tok, "def f():", len(new), stop_strings=["never said"], stream=pieces.append,
                    engine=_ReplayEngine(new))
    assert text == "".join(pieces) == want
    # per token: the collector's and the printer's window (the prompt's last ids, <= 2 x 16 + 3 ids before the
    # pending ones, the pending ids: a byte run); once: the returned text
    long = [n for n in tok.lengths if n > 64]
    assert long == [len(prompt_ids[-16:]) + len(new)], long
    assert len(tok.lengths) < 3 * len(new) + 50

    stop = "x else None\n𝕐 print"  # spans several tokens, the byte run among them
    at = next(n for n in range(1, len(new) + 1) if stop in tok.tok.decode(new[:n]))  # the whole-decode rule
    out = _ReplayEngine(new).generate([prompt_ids], len(new), stop_ids=(2,), stop_strings=[stop],
                                      detokenize=tok.decode, on_token=None)
    assert out.finish_reasons == ["stop"] and len(out.tokens[0]) == at > len(chunk)


def test_incremental_text_without_byte_value_keeps_a_long_byte_run_whole():
    """A ``detokenize`` that is no tokenizer's bound ``decode`` (a lambda, as ``InferenceEngine.generate`` accepts)
    gives :class:`IncrementalText` no ``byte_value``. Earlier sessions: its window then moved to a start inside a
    byte-fallback run, where the ``ByteFallback`` decoder turned the whole cut run into U+FFFD; the text of a valid
    40-byte run ended in U+FFFD and a stop string after it was never found (finish reason "length", not "stop")."""
    from minicpm4_jax.infer.detok import IncrementalText
    from minicpm4_jax.infer.engine import _Collector

    tok = _official_tokenizer("hf")
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    ids = tok.encode("hello") + [byte[b] for b in ("中文字符" * 5).encode()] + tok.encode(" end")
    for tail in (1, 4, 16):
        text = IncrementalText(lambda x: tok.decode(x), tail=tail)
        for n, i in enumerate(ids, 1):
            text.push(i)
            assert text.text() == tok.decode(ids[:n]), (tail, n)
    col = _Collector(1, len(ids), (), ["符 end"], lambda x: tok.decode(x), None)
    for i in ids:
        if col.active[0]:
            col.take(0, i)
    assert col.reasons == ["stop"] and col.out[0] == ids


def test_incremental_text_window_never_starts_at_an_empty_decode():
    """A Llama-style ``tokenizer.json`` decoder (Replace, ByteFallback, Fuse, Strip one leading space) decodes a lone
    ``<0x20>`` to nothing. Earlier sessions: without ``byte_value`` the window could start at it (``tail=1``); that
    empty decode showed no change, so a next byte that made ``<0x20><0x8B>`` an invalid run (both U+FFFD in the
    whole decode) left the space in the text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from minicpm4_jax.infer.detok import IncrementalText
    from minicpm4_jax.tokenizer import Tokenizer

    hf = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1, "d": 2, "<0x20>": 3, "<0x8B>": 4}, unk_token="<unk>"))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(hf_json=hf.to_str())
    ids = [1, 1, 1, 2, 3, 4]
    assert tok.decode(ids) == "aaad\ufffd\ufffd" and tok.decode([3]) == ""
    for tail in (1, 2, 16):
        text = IncrementalText(lambda x: tok.decode(x), tail=tail)
        for n, i in enumerate(ids, 1):
            text.push(i)
            assert text.text() == tok.decode(ids[:n]), (tail, n, text.text())
