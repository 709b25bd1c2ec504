"""EvalModel: log-likelihoods equal a brute-force forward (joint tokenisation, right offsets), rolling windows,
batched generation equal to one prompt at a time."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig, SparseConfig
from minicpm4_jax.eval.model import EvalModel, rolling_windows
from minicpm4_jax.generate import generate
from minicpm4_jax.nn import MiniCPM4

BASE = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, dim_model_base=16, scale_emb=12.0)
SPARSE = dataclasses.replace(BASE, attention="infllmv2", sparse_config=SparseConfig(
    kernel_size=32, kernel_stride=16, block_size=32, window_size=64, topk=2, dense_len=256))


class ToyTokenizer:
    """Characters, plus one merge: "ab" is a single token (so a boundary can merge)."""

    bos_id, eos_id, unk_id = 1, 2, 0
    vocab_size = 97
    _AB = 96
    source, file_hash = "toy", "0" * 64

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(self._AB)
                i += 2
            else:
                out.append(3 + (ord(text[i]) - 32) % 93)
                i += 1
        return out

    def decode(self, ids):
        return "".join("ab" if i == self._AB else chr(32 + i - 3) if i >= 3 else "" for i in ids)


TOK = ToyTokenizer()


@pytest.fixture(scope="module")
def dense_model():
    return MiniCPM4(BASE, rngs=nnx.Rngs(0))


def _brute(model, ctx_ids, cont_ids):
    """Sum of log P(cont | ctx) from one unpadded full forward, and whether every cont token is the argmax."""
    ids = np.asarray([ctx_ids + cont_ids], np.int32)
    logp = np.asarray(jax.nn.log_softmax(model(ids)[0], axis=-1))
    n = len(ctx_ids)
    lp = sum(logp[n - 1 + j, t] for j, t in enumerate(cont_ids))
    greedy = all(int(np.argmax(logp[n - 1 + j])) == t for j, t in enumerate(cont_ids))
    return lp, greedy


def test_encode_pair_joint_tokenisation():
    m = EvalModel.__new__(EvalModel)
    m.tokenizer = TOK
    # "xa" + "b c": jointly "x", "ab", " ", "c"; the merged "ab" belongs to the continuation.
    ctx, cont = m.encode_pair("xa", "b c")
    assert ctx == TOK.encode("x") and cont == TOK.encode("ab c")
    # Trailing whitespace of the context moves to the continuation.
    ctx, cont = m.encode_pair("Answer: ", "yes")
    assert ctx == TOK.encode("Answer:") and cont == TOK.encode(" yes")
    with pytest.raises(ConfigError, match="continuation is empty"):
        m.encode_pair("x", "")


def test_loglikelihood_equals_brute_force(dense_model):
    em = EvalModel(dense_model, TOK, batch_size=3, progress=False)
    reqs = [("The cat sat on the m", "at"), ("xa", "b c"), ("q", "uestion " * 5), ("Answer: ", "yes"),
            ("a" * 70, "bcd")]
    got = em.loglikelihood(reqs)
    for (c, x), (lp, greedy) in zip(reqs, got):
        ctx, cont = em.encode_pair(c, x)
        ref_lp, ref_greedy = _brute(dense_model, [TOK.eos_id] + ctx, cont)
        np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-4)
        assert greedy == ref_greedy
    # The merged boundary token is scored as a continuation token (field_faults B19 offset).
    lp_merge = got[1][0]
    wrong = _brute(dense_model, [TOK.eos_id] + TOK.encode("xa"), TOK.encode("b c"))[0]
    assert abs(lp_merge - wrong) > 1e-3
    # A greedy continuation is reported as greedy.
    ids = [TOK.eos_id] + TOK.encode("hello")
    nxt = int(np.argmax(np.asarray(dense_model(np.asarray([ids], np.int32))[0, -1])))
    assert em.loglikelihood_tokens([(TOK.encode("hello"), [nxt])])[0][1] is True


def test_loglikelihood_left_truncation_equals_brute_force(dense_model):
    """field_faults B19 under left truncation: a context longer than max_length is cut from the left (prefix token
    included), the input drops the last continuation token, and the scored rows are the last len(cont) ones of
    that truncated input; rows that are and are not truncated share a batch (different offsets per row)."""
    em = EvalModel(dense_model, TOK, batch_size=3, max_length=16, progress=False)
    rng = np.random.default_rng(7)
    reqs = [([int(t) for t in rng.integers(3, 96, n)], [int(t) for t in rng.integers(3, 96, c)])
            for n, c in ((40, 3), (9, 4), (15, 1), (30, 16))]
    got = em.loglikelihood_tokens(reqs)
    for (ctx, cont), (lp, greedy) in zip(reqs, got):
        whole = ([TOK.eos_id] + ctx + cont)[-17:]  # max_length + 1 tokens: 16 inputs, the last one only a target
        ref_lp, ref_greedy = _brute(dense_model, whole[:len(whole) - len(cont)], cont)
        np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-4)
        assert greedy == ref_greedy
    # the truncation really matters for the long rows: the untruncated score differs
    ctx, cont = reqs[0]
    assert abs(got[0][0] - _brute(dense_model, [TOK.eos_id] + ctx, cont)[0]) > 1e-3


def test_context_cut_is_reported_per_item_and_per_task(dense_model, tmp_path):
    """Twelfth-session break test: 5-shot MMLU on a model with max_length=128 was scored on the last 128 tokens of
    650-token prompts and reported as 5-shot with no notice. ``context_cut`` counts the tokens the left cut drops
    (what test_loglikelihood_left_truncation_equals_brute_force scores), score_mc records them per item and counts
    the items, and the bench entry, its log and the Markdown summary say so."""
    from minicpm4_jax.eval.bench.mc import score_mc
    from minicpm4_jax.eval.results import default_markdown

    em = EvalModel(dense_model, TOK, batch_size=3, max_length=16, progress=False)
    reqs = [("x" * 40, " y"), ("hello", " w"), ("q" * 14, " z"), ("q" * 15, " z")]
    want = [max(0, len([TOK.eos_id] + TOK.encode(c + x)) - 17) for c, x in reqs]  # max_length + 1 tokens are kept
    assert em.context_cut([em.encode_pair(c, x) for c, x in reqs]) == want
    assert want[0] > 0 and want[1] == 0 and want[2] == 0 and want[3] == 1
    items = [{"id": "long", "context": "x" * 40, "choices": [" A", " B"], "gold": 0},
             {"id": "short", "context": "hi", "choices": [" A", " B"], "gold": 1}]
    recs, agg = score_mc(em, items)
    assert agg["truncated"] == 1 and recs[0]["context_cut_tokens"] == 40 + 1 + 2 - 1 - 16
    # the same log-likelihoods as the string API (the requests are tokenized once, not twice)
    assert [r["loglikelihoods"] for r in recs] == [[lp for lp, _ in em.loglikelihood([(it["context"], c)
                                                                                   for c in it["choices"]])]
                                                   for it in items]
    assert "context_cut_tokens" not in recs[1]
    md = default_markdown({"kind": "bench", "created": "now", "model": {}, "scores": {
        "tasks": {"mmlu": {"metric": "acc", "score": 50.0, "n": 2, "truncated": 1}}}})
    assert "- mmlu: 1 of 2 items scored on a context cut to the model's max_length" in md


def test_generate_budget_counts_the_new_tokens(dense_model):
    """field_faults B20 for EvalModel.generate: the prompt alone fits max_length, prompt + max_new_tokens does
    not -> a one-line error naming both, never a silently shortened input or output; exactly at the limit runs."""
    em = EvalModel(dense_model, TOK, max_length=32, progress=False)
    prompt = "x = 12345678901234"  # 18 tokens + the EOS prefix = 19
    assert len(TOK.encode(prompt)) + 1 == 19
    out = em.generate([prompt], max_new_tokens=13)  # 19 + 13 = 32: fits exactly
    assert len(out) == 1
    with pytest.raises(ConfigError, match=r"prompt 0 has 19 tokens \+ max_new_tokens=14 > max_length=32"):
        em.generate([prompt], max_new_tokens=14)


def test_generate_refuses_one_stop_string_not_in_a_list(dense_model):
    """``stop="\\n\\n"`` was read as its characters, so a generation stopped at its first single newline; it is a
    one-line error naming the fix, and the same stop in a list runs."""
    em = EvalModel(dense_model, TOK, max_length=64, progress=False)
    with pytest.raises(ConfigError, match=r"stop='\\n\\n' is one string.*stop=\['\\n\\n'\]"):
        em.generate(["def f"], max_new_tokens=4, stop="\n\n")
    assert len(em.generate(["def f"], max_new_tokens=4, stop=["\n\n"])) == 1


def test_generate_stop_none_is_no_stop_and_a_number_is_one_line(dense_model):
    """Break test of 67ee359: ``stop=None`` (what the engine's ``stop_strings=None`` means: none, since abc8d5a) and
    ``stop=5`` were ``TypeError`` tracebacks ('NoneType' / 'int' object is not iterable) in EvalModel.generate; None
    now generates as ``stop=()`` does and a number is a one-line error."""
    em = EvalModel(dense_model, TOK, max_length=64, progress=False)
    assert em.generate(["def f"], max_new_tokens=4, stop=None) == em.generate(["def f"], max_new_tokens=4, stop=())
    with pytest.raises(ConfigError, match=r"stop=5 must be a list of stop texts \(or None for none\)"):
        em.generate(["def f"], max_new_tokens=4, stop=5)


def test_generate_stop_that_is_not_text_names_stop_and_empty_texts_are_dropped(dense_model):
    """EvalModel.generate's own ``stop`` check (now check_stops') let ``stop=[5]`` through to the engine, whose error
    named parameters this method does not have ("stop_strings are texts (token ids go in stop_ids)"); empty stop
    texts (lm-eval's ``until=[""]``) are still dropped, so they generate as no stop."""
    em = EvalModel(dense_model, TOK, max_length=64, progress=False)
    with pytest.raises(ConfigError, match=r"^stop string 5 is not text; stop= takes texts$"):
        em.generate(["def f"], max_new_tokens=4, stop=[5])
    assert em.generate(["def f"], max_new_tokens=4, stop=[""]) == em.generate(["def f"], max_new_tokens=4, stop=None)


def test_generation_prompts_are_cut_from_the_left_when_asked_and_counted(dense_model, capsys):
    """Thirteenth-session break test: a generation task whose prompt did not fit max_length - budget stopped the
    whole `eval bench` run (losing the tasks already scored) with a fix it cannot apply, and the lm-eval backend
    refused where lm-eval's HF backend cuts. Now the prompt keeps its last tokens after the prefix, the cut is
    counted per item and task, and RULER (no ``truncate``) still refuses."""
    from minicpm4_jax.eval.bench.gen import score_gen

    em = EvalModel(dense_model, TOK, max_length=32, progress=False)
    long, short = "y = " + "9" * 30 + " + 1", "x = 5"  # 38 and 5 tokens (+ the EOS prefix)
    assert len(TOK.encode(long)) == 38
    texts, cuts = em.generate([long, short], max_new_tokens=6, truncate=True, return_cuts=True)
    assert cuts == [38 - (32 - 6 - 1), 0]
    kept = TOK.decode(TOK.encode(long)[cuts[0]:])
    assert texts[0] == em.generate([kept], max_new_tokens=6)[0]  # the same text as the cut prompt given whole
    assert texts[1] == em.generate([short], max_new_tokens=6)[0]
    with pytest.raises(ConfigError, match=r"prompt 0 has 39 tokens \+ max_new_tokens=6 > max_length=32"):
        em.generate([long], max_new_tokens=6)
    with pytest.raises(ConfigError, match=r"max_new_tokens=31 > max_length=32"):  # no room left for any prompt
        em.generate([long], max_new_tokens=31, truncate=True)
    items = [{"id": "a", "prompt": long, "until": ["\n"], "max_new_tokens": 6, "extract": "gsm8k", "gold": "1"},
             {"id": "b", "prompt": short, "until": ["\n"], "max_new_tokens": 6, "extract": "gsm8k", "gold": "5"}]
    recs, agg = score_gen(em, items)
    assert agg["truncated"] == 1 and recs[0]["context_cut_tokens"] == cuts[0] and "context_cut_tokens" not in recs[1]


def test_loglikelihood_sparse_model_dispatches_per_row():
    model = MiniCPM4(SPARSE, rngs=nnx.Rngs(1))
    em = EvalModel(model, TOK, batch_size=2, progress=False)
    rng = np.random.default_rng(0)
    reqs = [([int(t) for t in rng.integers(3, 96, n)], [int(t) for t in rng.integers(3, 96, 7)]) for n in (200, 300)]
    got = em.loglikelihood_tokens(reqs)
    for (ctx, cont), (lp, _) in zip(reqs, got):
        # the short row (207 inputs < dense_len 256) is dense although it shares a batch padded past dense_len
        np.testing.assert_allclose(lp, _brute(model, [TOK.eos_id] + ctx, cont)[0], rtol=1e-5, atol=2e-4)
    # ... which matters: the same row run sparse (as a forward of the padded batch would) scores differently.
    ctx, cont = reqs[0]
    ids = np.asarray([[TOK.eos_id] + ctx + cont + [0] * 100], np.int32)
    logp = np.asarray(jax.nn.log_softmax(model(ids)[0], axis=-1))
    padded = sum(logp[len(ctx) + j, t] for j, t in enumerate(cont))
    assert abs(padded - got[0][0]) > 1e-3


def test_rolling_windows_cover_every_token_once(dense_model):
    toks = list(range(3, 3 + 90))
    wins = rolling_windows(toks, 2, 32)
    assert sum(len(c) for _, c in wins) == len(toks)
    assert [t for _, c in wins for t in c] == toks
    assert all(len(x) + len(c) <= 33 for x, c in wins)
    # a full window of 32 predictions has room for one context token; the last one fills up with context
    assert wins[0][0] == [2] and wins[1][0] == toks[31:32] and wins[2][0] == toks[57:64]
    em = EvalModel(dense_model, TOK, batch_size=2, max_length=32, progress=False)
    text = "def f(x):\n    return x * 2\n" * 4
    ids = TOK.encode(text)
    ref = sum(_brute(dense_model, ctx, cont)[0] for ctx, cont in rolling_windows(ids, TOK.eos_id, 32))
    np.testing.assert_allclose(em.loglikelihood_rolling([text])[0], ref, rtol=1e-5, atol=1e-3)
    # Within one window the rolling score is the plain full-text log-likelihood.
    full = EvalModel(dense_model, TOK, progress=False).loglikelihood_rolling([text])[0]
    np.testing.assert_allclose(full, _brute(dense_model, [TOK.eos_id], ids)[0], rtol=1e-5, atol=1e-3)


def test_generate_batching_and_stops(dense_model):
    prompts = ["def f", "import os\nimport sys\n", "x = 1"]
    em = EvalModel(dense_model, TOK, batch_size=2, progress=False)
    batched = em.generate(prompts, max_new_tokens=12)
    for p, text in zip(prompts, batched):
        assert text == generate(dense_model, TOK, p, 12, prefix_ids=[TOK.eos_id])
    sampled = em.generate(prompts, max_new_tokens=8, temperature=1.0, seed=5)
    alone = [EvalModel(dense_model, TOK, batch_size=1, progress=False).generate([p], max_new_tokens=8,
                                                                               temperature=1.0, seed=5 + i)[0]
             for i, p in enumerate(prompts)]
    assert sampled == alone
    stop = batched[0][3:5]
    cut = em.generate(prompts[:1], max_new_tokens=12, stop=[stop])[0]
    assert cut == batched[0][:batched[0].index(stop)]


def test_bad_input_is_one_line(dense_model):
    with pytest.raises(ConfigError, match="batch_size=0"):
        EvalModel(dense_model, TOK, batch_size=0)
    with pytest.raises(ConfigError, match="prefix='cls'"):
        EvalModel(dense_model, TOK, prefix="cls")
    with pytest.raises(ConfigError, match="max_length=4096"):
        EvalModel(dense_model, TOK, max_length=4096)
    big = type("BigTokenizer", (ToyTokenizer,), {"vocab_size": dense_model.cfg.vocab_size + 1})()
    with pytest.raises(ConfigError, match=f"has {dense_model.cfg.vocab_size + 1} tokens but the model's vocab_size"):
        EvalModel(dense_model, big)  # ids past the embedding table gave NaN log-likelihoods (lm-eval: acc 0.5)
    em = EvalModel(dense_model, TOK, progress=False)
    with pytest.raises(ConfigError, match="prompt 1 has"):
        em.generate(["a", "b" * 600], max_new_tokens=4)
    with pytest.raises(ConfigError, match="request 0 has an empty continuation"):
        em.loglikelihood_tokens([([5], [])])
    with pytest.raises(ConfigError, match="no context"):
        EvalModel(dense_model, TOK, prefix="none", progress=False).loglikelihood_tokens([([], [5])])
    with pytest.raises(ConfigError, match="attention='fast'"):
        EvalModel.from_checkpoint("/nonexistent", attention="fast")
    # the eval CLIs take the run as a positional argument: the error names it so, not as a --checkpoint flag they
    # do not have (tenth-session break test); lm-eval's model_args as checkpoint=...
    for option, shown in (("the checkpoint argument", "the checkpoint argument "), ("checkpoint", "checkpoint=")):
        with pytest.raises(ConfigError, match=f"^{shown}{__file__} is a file, not a folder"):
            EvalModel.from_checkpoint(__file__, path_option=option)


def test_generation_stops_at_every_eos_id_of_the_model(dense_model):
    """An official MiniCPM4 config names two end ids (``eos_token_id`` [2, 73440]: ``</s>`` and the chat turn's
    ``<|im_end|>``), and transformers stops at either. Generation stopped only at the tokenizer's ``</s>``: an
    imported chat model ran on past ``<|im_end|>`` (RULER scored the extra text; a HumanEval completion got the
    literal ``<|im_end|>`` and a syntax error)."""
    kw = dict(temperature=1.0, seed=5)  # sampled: varied tokens (greedy repeats one on these random weights)
    _, out = generate(dense_model, TOK, "def f", 12, prefix_ids=[TOK.eos_id], return_output=True, **kw)
    toks = [int(t) for t in out.tokens[0]]
    k = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i] and toks[i] != TOK.eos_id)
    two_ends = MiniCPM4(dataclasses.replace(BASE, eos_token_id=(TOK.eos_id, toks[k])), rngs=nnx.Rngs(0))
    want = TOK.decode(toks[:k])
    assert len(want) == k
    assert generate(two_ends, TOK, "def f", 12, prefix_ids=[TOK.eos_id], **kw) == want
    assert EvalModel(two_ends, TOK, batch_size=1, progress=False).generate(["def f"], max_new_tokens=12, **kw) == [want]
    # the tokenizer's own EOS still ends generation when the config names other ids only
    other = MiniCPM4(dataclasses.replace(BASE, eos_token_id=(toks[k],)), rngs=nnx.Rngs(0))
    assert generate(other, TOK, "def f", 12, prefix_ids=[TOK.eos_id], **kw) == want
