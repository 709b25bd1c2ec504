"""lm-evaluation-harness backend: the context/continuation boundary, continuation logits at the
right offset (field fault B19), equality with a brute-force per-token computation, and an offline
``simple_evaluate`` over local task YAMLs that point at the shared benchmark files."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_path

_REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", str(_REPO / ".cache" / "hf_datasets"))

from minicpm4_jax.eval.lm_eval_backend import HAVE_LM_EVAL, score_tokens_with_logits  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent / "data" / "lm_eval_tasks"
V = 512
PAD, BOS, EOS = 0, 1, 2
MERGES = ["ab", " A", " B", " C", " D", "Answer:", "Question:", "\n\n", " the", "th", "he", "in", " a"]


# ------------------------------------------------------------------------------ B19 offsets
def test_b19_continuation_logits_at_the_right_offset():
    seen = []

    def stub(shift):
        def logits_fn(inp):
            seen.append(list(inp))
            whole = [5, 6, 7, 8, 9]
            out = np.full((len(inp), 16), -30.0)
            for i in range(len(inp)):
                # row i predicts the token after input position i (shifted: one further)
                j = whole.index(inp[i]) + 1 + shift
                if j < len(whole):
                    out[i, whole[j]] = 30.0
            return out
        return logits_fn

    (lp, greedy), = score_tokens_with_logits(stub(0), [([5, 6, 7], [8, 9])], max_length=16)
    assert seen[-1] == [5, 6, 7, 8]  # the last continuation token is not an input
    assert lp == pytest.approx(0.0, abs=1e-9) and greedy
    (lp_bad, g_bad), = score_tokens_with_logits(stub(1), [([5, 6, 7], [8, 9])], max_length=16)
    assert lp_bad < -50 and not g_bad
    # left truncation keeps the continuation and the same offsets
    (lp_t, g_t), = score_tokens_with_logits(stub(0), [([5, 6, 7], [8, 9])], max_length=3)
    assert seen[-1] == [6, 7, 8] and lp_t == pytest.approx(0.0, abs=1e-9) and g_t
    assert score_tokens_with_logits(stub(0), [([5], [])], max_length=4) == [(0.0, True)]


# ------------------------------------------------------------------------ scripted eval model
class ToyTokenizer:
    """Greedy longest match over a few merged tokens, one token per other character."""

    eos_id, bos_id, pad_id, vocab_size = EOS, BOS, PAD, V

    def __init__(self):
        self.merge_ids = {m: 3 + i for i, m in enumerate(MERGES)}

    def _char(self, c):
        return 100 + ord(c) % (V - 100)

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            for m in sorted(MERGES, key=len, reverse=True):
                if text.startswith(m, i):
                    ids.append(self.merge_ids[m])
                    i += len(m)
                    break
            else:
                ids.append(self._char(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        inv = {v: k for k, v in self.merge_ids.items()}
        return "".join(inv.get(i, chr(i - 100) if i >= 100 else "") for i in ids)


_W = np.random.default_rng(0).normal(size=(V, V)).astype(np.float64) * 3.0
_P = np.random.default_rng(1).normal(size=(4096, V)).astype(np.float64)


def toy_logits(inp):
    """Depends on the token and its position in the input, so an offset error changes the score."""
    inp = np.asarray(inp)
    return _W[inp] + _P[np.arange(len(inp))]


def brute_force(ctx, cont, max_length, prefix=(EOS,)):
    """Per-token: each continuation token from its own forward over the (truncated) prefix."""
    whole = (list(prefix) + list(ctx) + list(cont))[-(max_length + 1):]
    start = len(whole) - len(cont)
    total, greedy = 0.0, True
    for j in range(start, len(whole)):
        row = toy_logits(whole[:j])[-1]
        logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        total += logp[whole[j]]
        greedy &= int(row.argmax()) == whole[j]
    return total, greedy


class ScriptedEvalModel:
    """The EvalModel protocol over ``toy_logits`` (document prefix EOS, as this project trains)."""

    name = "scripted"
    prefix_ids = [EOS]

    def __init__(self, max_length=512):
        self.tokenizer = ToyTokenizer()
        self.max_length = max_length
        self.calls = []

    def loglikelihood_tokens(self, requests):
        self.calls.append([(list(c), list(x)) for c, x in requests])
        return score_tokens_with_logits(toy_logits, requests, max_length=self.max_length, prefix=self.prefix_ids)

    def loglikelihood_rolling(self, texts):
        return [score_tokens_with_logits(toy_logits, [([], self.tokenizer.encode(t))], max_length=self.max_length,
                                         prefix=self.prefix_ids)[0][0] for t in texts]

    def generate(self, prompts, *, max_new_tokens, stop=(), temperature=0.0, seed=0):
        self.calls.append(("generate", max_new_tokens, tuple(stop), temperature))
        return [f" {len(p) % 7} apples.\n#### {len(p) % 7}\n\nQuestion: more" for p in prompts]


needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval is not installed")


def _inst(kind, args, idx=0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


@needs_lm_eval
def test_boundary_merge_whitespace_and_empty_context():
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = ScriptedEvalModel()
    lm = MiniCPM4LM(model=m)
    tok = m.tokenizer
    # "a" + "b" merge into one token: both parts come from the joint tokenisation "x|ab|c"
    ctx, cont = lm._encode_pair("xa", "bc")
    assert ctx + cont == tok.encode("xabc") and ctx == tok.encode("x")
    assert cont == [tok.merge_ids["ab"], tok.encode("c")[0]]
    # trailing whitespace of the context moves to the continuation (" A" is one token)
    ctx, cont = lm._encode_pair("Answer: ", "A")
    assert ctx == [tok.merge_ids["Answer:"]] and cont == [tok.merge_ids[" A"]]
    reqs = [("xa", "bc"), ("Answer: ", "A"), ("The moon is", " a rock"), ("", "hello there")]
    got = lm.loglikelihood([_inst("loglikelihood", r, i) for i, r in enumerate(reqs)], disable_tqdm=True)
    sent = m.calls[-1]
    assert sent[3][0] == []  # empty context: the model adds its own prefix, not a second one
    for (c, x), (lp, g) in zip(sent, got):
        blp, bg = brute_force(c, x, m.max_length)
        assert lp == pytest.approx(blp, abs=1e-9) and g == bg
    # left truncation when context + continuation exceed max_length
    short = ScriptedEvalModel(max_length=8)
    lm2 = MiniCPM4LM(model=short)
    (lp, _), = lm2.loglikelihood([_inst("loglikelihood", ("a long context of many characters", " the end"))],
                                 disable_tqdm=True)
    c, x = short.calls[-1][0]
    assert lp == pytest.approx(brute_force(c, x, 8)[0], abs=1e-9)


@needs_lm_eval
def test_rolling_and_generate_until():
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = ScriptedEvalModel()
    lm = MiniCPM4LM(model=m, max_gen_toks=17)
    texts = ["hello the world", "in a  moment"]
    got = lm.loglikelihood_rolling([_inst("loglikelihood_rolling", (t,), i) for i, t in enumerate(texts)])
    for t, lp in zip(texts, got):
        assert lp == pytest.approx(brute_force([], m.tokenizer.encode(t), m.max_length)[0], abs=1e-9)
    reqs = [_inst("generate_until", ("Q1", {"until": ["\n\n"], "max_gen_toks": 5}), 0),
            _inst("generate_until", ("Q22", {"until": "apples"}), 1),
            _inst("generate_until", ("Q333", {"until": ["\n\n"], "max_gen_toks": 5}), 2)]
    outs = lm.generate_until(reqs)
    assert outs == [" 2 apples.\n#### 2", " 3 ", " 4 apples.\n#### 4"]
    gens = [c for c in m.calls if c[0] == "generate"]
    assert ("generate", 5, ("\n\n",), 0.0) in gens and ("generate", 17, ("apples",), 0.0) in gens


class SamplingEvalModel(ScriptedEvalModel):
    """The protocol with EvalModel's sampling settings, recorded per call."""

    def generate(self, prompts, *, max_new_tokens, stop=(), temperature=0.0, seed=0, top_p=1.0, top_k=0):
        self.calls.append(("generate", temperature, top_p, top_k))
        return [" x"] * len(prompts)


@needs_lm_eval
def test_generate_until_passes_top_p_and_top_k_when_sampling():
    """Break test (helper 87): do_sample with top_p / top_k sampled from the whole distribution (both dropped)."""
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = SamplingEvalModel()
    lm = MiniCPM4LM(model=m)
    lm.generate_until([_inst("generate_until", ("Q1", {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                                                      "top_k": 40}), 0),
                       _inst("generate_until", ("Q2", {"do_sample": True, "temperature": 0.5}), 1),
                       _inst("generate_until", ("Q3", {"do_sample": False, "temperature": 0.7, "top_p": 0.9}), 2)])
    assert sorted(c[1:] for c in m.calls) == [(0.0, 1.0, 0), (0.5, 1.0, 50), (0.7, 0.9, 40)]


@needs_lm_eval
def test_generate_until_sampling_settings_follow_lm_evals_hf_backend():
    """Break test (helper 90): ``temperature`` without ``do_sample`` was greedy (lm-eval's HF backend samples),
    ``do_sample: true`` without a temperature was silently greedy (transformers raises), and an absent ``top_k`` was
    no cut (transformers' GenerationConfig default is 50; ``None`` / 0 is no cut there too)."""
    from minicpm4_jax.config import ConfigError
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = SamplingEvalModel()
    lm = MiniCPM4LM(model=m)
    lm.generate_until([_inst("generate_until", ("Q1", {"temperature": 0.6}), 0),
                       _inst("generate_until", ("Q2", {"temperature": 0.0}), 1),
                       _inst("generate_until", ("Q3", {"do_sample": True, "temperature": 0.4, "top_k": 0}), 2),
                       _inst("generate_until", ("Q4", {"do_sample": False, "temperature": 0.9}), 3)])
    assert sorted(c[1:] for c in m.calls) == [(0.0, 1.0, 0), (0.4, 1.0, 0), (0.6, 1.0, 50)]
    for kw in ({"do_sample": True}, {"do_sample": True, "temperature": 0.0}, {"temperature": "warm"}):
        m.calls.clear()
        with pytest.raises(ConfigError, match="^generate_until gen_kwargs: .*temperature") as e:
            lm.generate_until([_inst("generate_until", ("Q0", {"do_sample": False}), 0),
                               _inst("generate_until", ("Q1", kw), 1)])
        assert "\n" not in str(e.value) and m.calls == []


@needs_lm_eval
def test_generate_until_top_p_zero_is_refused_not_dropped():
    """Break test (helper 88): ``top_p: 0`` (Hugging Face: only the top token; vLLM: refused) was read as absent, so
    the request sampled from the whole distribution; it is one ConfigError naming the value, before any generation.
    ``None`` values are absent, a float ``top_k`` of an integer value is that integer."""
    from minicpm4_jax.config import ConfigError
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = SamplingEvalModel()
    lm = MiniCPM4LM(model=m)
    lm.generate_until([_inst("generate_until", ("Q1", {"do_sample": True, "temperature": 0.7, "top_p": None,
                                                      "top_k": None}), 0),
                       _inst("generate_until", ("Q2", {"do_sample": True, "temperature": 0.5, "top_k": 40.0}), 1)])
    assert sorted(c[1:] for c in m.calls) == [(0.5, 1.0, 40), (0.7, 1.0, 0)]
    for kw, bad in (({"top_p": 0}, r"top_p=0\.0 must be in \(0, 1\]"), ({"top_p": 1.5}, "top_p=1.5 must"),
                    ({"top_k": -1}, "top_k=-1 must be an integer >= 0")):
        m.calls.clear()
        with pytest.raises(ConfigError, match=f"^generate_until gen_kwargs: {bad}.*generation_kwargs") as e:
            lm.generate_until([_inst("generate_until", ("Q0", {"do_sample": False}), 0),
                               _inst("generate_until", ("Q1", {"do_sample": True, "temperature": 0.7, **kw}), 1)])
        assert "\n" not in str(e.value) and m.calls == []


class CuttingEvalModel(ScriptedEvalModel):
    """The protocol with EvalModel's left cut of generation prompts: every prompt over 4 characters is cut."""

    def generate(self, prompts, *, max_new_tokens, stop=(), temperature=0.0, seed=0, truncate=False,
                 return_cuts=False):
        self.calls.append(("generate", max_new_tokens, truncate))
        texts = [f" {len(p) % 7} apples." for p in prompts]
        cuts = [max(0, len(p) - 4) for p in prompts]
        return (texts, cuts) if return_cuts else texts


@needs_lm_eval
def test_generate_until_cuts_long_contexts_like_the_hf_backend_and_says_so(capsys):
    """Thirteenth-session break test: generate_until refused a context longer than max_length - max_gen_toks
    (lm-eval's HF backend keeps its last tokens); the backend now asks the model to cut and reports it."""
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = CuttingEvalModel(max_length=64)
    lm = MiniCPM4LM(model=m, max_gen_toks=9)
    outs = lm.generate_until([_inst("generate_until", ("Q1", {"until": ["\n\n"]}), 0),
                              _inst("generate_until", ("Question 22", {"until": ["\n\n"]}), 1)])
    assert outs == [" 2 apples.", " 4 apples."] and ("generate", 9, True) in m.calls
    err = capsys.readouterr().err
    assert "generate_until cut 1 of 2 contexts from the left to max_length=64 - max_gen_toks=9 tokens (up to 7" in err


def _local_tasks(tmp_path):
    bench = shared_path("data", "benchmarks")
    out = tmp_path / "tasks"
    out.mkdir()
    for y in TASK_DIR.glob("*.yaml"):
        # the shipped paths are relative to the repository root (README); absolute here, for any working directory
        (out / y.name).write_text(y.read_text().replace('"../shared/data/benchmarks/', f'"{bench}/'))
    return out


@needs_lm_eval
def test_simple_evaluate_offline_with_local_task_yamls(tmp_path):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from minicpm4_jax.eval.lm_eval_backend import MODEL_NAME, MiniCPM4LM

    assert get_model(MODEL_NAME) is MiniCPM4LM
    task_dir = _local_tasks(tmp_path)
    m = ScriptedEvalModel(max_length=1024)
    lm = MiniCPM4LM(model=m)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["minicpm4_mmlu_local", "minicpm4_arc_local", "minicpm4_gsm8k_local", "minicpm4_rolling_local"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), limit=4, log_samples=True,
        random_seed=0,
        numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, bootstrap_iters=0)
    r = res["results"]
    assert set(r) >= {"minicpm4_mmlu_local", "minicpm4_arc_local", "minicpm4_gsm8k_local", "minicpm4_rolling_local"}
    tok = m.tokenizer
    n_ll = 0
    for task in ("minicpm4_mmlu_local", "minicpm4_arc_local"):
        for s in res["samples"][task]:
            for args, resp in zip(s["arguments"], s["resps"]):
                ctx, cont = (args["arg_0"], args["arg_1"]) if isinstance(args, dict) else args[:2]
                c_ids, x_ids = lm._encode_pair(ctx, cont)
                assert c_ids + x_ids == tok.encode(ctx + cont)
                blp, bg = brute_force(c_ids, x_ids, m.max_length)
                lp, g = resp[0]
                assert float(lp) == pytest.approx(blp, abs=1e-6) and bool(g) == bg
                n_ll += 1
        assert len(res["samples"][task]) == 4
    assert n_ll >= 4 * 4 + 4 * 3
    mmlu_ctx = res["samples"]["minicpm4_mmlu_local"][0]["arguments"][0]
    mmlu_ctx = mmlu_ctx["arg_0"] if isinstance(mmlu_ctx, dict) else mmlu_ctx[0]
    assert mmlu_ctx.startswith("The following are multiple choice questions (with answers) about astronomy.")
    assert mmlu_ctx.count("Answer:") == 2  # 1-shot from dev + the question
    # generation: cut at the stop strings, scored by the task's own filter
    for s in res["samples"]["minicpm4_gsm8k_local"]:
        out = s["resps"][0][0]
        assert "\n\n" not in out and re.fullmatch(r" \d apples\.\n#### \d", out)
    assert 0.0 <= r["minicpm4_gsm8k_local"]["exact_match,strict-match"] <= 1.0
    # rolling: the whole question's log-likelihood, as brute force
    for s in res["samples"]["minicpm4_rolling_local"]:
        text = s["doc"]["question"]
        blp = brute_force([], tok.encode(text), m.max_length)[0] if len(tok.encode(text)) < m.max_length else None
        if blp is not None:
            assert float(s["resps"][0][0]) == pytest.approx(blp, abs=1e-6)
    assert r["minicpm4_rolling_local"]["word_perplexity,none"] > 1.0


def test_readme_lm_eval_example_names_shipped_tasks_whose_files_exist():
    """The README's minicpm4-lm-eval command runs as written from the repository root: its --include_path folder
    holds its --tasks, and every data file they name exists from there (the YAMLs held an @BENCH@ placeholder:
    datasets' FileNotFoundError)."""
    import yaml

    shared_path("data", "benchmarks")
    cmd = re.search(r"minicpm4-lm-eval (.*?)\n```", (_REPO / "README.md").read_text(), re.S).group(1)
    cmd = cmd.replace("\\\n", " ")
    folder = _REPO / re.search(r"--include_path (\S+)", cmd).group(1)
    tasks = {}
    for p in folder.glob("*.yaml"):
        y = yaml.safe_load(p.read_text())
        tasks[y["task"]] = y
    assert set(re.search(r"--tasks (\S+)", cmd).group(1).split(",")) <= set(tasks), (cmd, sorted(tasks))
    for name, y in tasks.items():
        for f in y["dataset_kwargs"]["data_files"].values():
            assert (_REPO / f).is_file(), (name, f)


@needs_lm_eval
def test_missing_task_data_file_is_one_line(monkeypatch, capsys):
    import lm_eval.__main__

    from minicpm4_jax.eval.lm_eval_backend import main

    def missing():
        raise FileNotFoundError("Unable to find '/nowhere/test.jsonl'")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", missing)
    with pytest.raises(SystemExit) as e:
        main(["--model", "minicpm4-jax", "--tasks", "t"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: Unable to find '/nowhere/test.jsonl'; ")


@needs_lm_eval
@pytest.mark.parametrize("args, message", [
    (["--model_args", "checkpoint=/x,batch_size=0"], "error: batch_size in --model_args: lm-eval passes its own "
                                                     "--batch_size to the model too; give it as --batch_size VALUE"),
    (["-a", "device=cpu,checkpoint=/x"], "error: device in --model_args"),
    (["--limit", "0"], "error: --limit 0.0: give a number > 0"),
    (["--num_fewshot", "-1"], "error: --num_fewshot -1: give an integer >= 0"),
    # the re-break test: lm-eval's abbreviations, JSON model_args and inf went past a parser of our own
    (["--lim", "0"], "error: --limit 0.0: give a number > 0"),
    (["-L", "inf"], "error: --limit inf: give a number > 0"),
    (["--num_few", "-1"], "error: --num_fewshot -1: give an integer >= 0"),
    (["--model_arg", "checkpoint=/x,device=cpu"], "error: device in --model_args"),
    (["--model_args", '{"checkpoint": "/x", "batch_size": 2}'], "error: batch_size in --model_args"),
    # helper 87: lm-eval's NotImplementedError traceback after the model had loaded
    (["--apply_chat_template"], "error: --apply_chat_template: minicpm4-jax has no chat template"),
    (["--fewshot_as_multiturn"], "error: --fewshot_as_multiturn: minicpm4-jax has no chat template"),
])
def test_launcher_refuses_bad_arguments_in_one_line(monkeypatch, capsys, args, message):
    """Third break test: these ended in lm-eval tracebacks (a duplicated keyword argument, "did not find any docs")
    or ran with n-shot -1; huge --num_fewshot ("Sample larger than population") is reworded."""
    import lm_eval.__main__

    from minicpm4_jax.eval.lm_eval_backend import main

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval ran"))
    with pytest.raises(SystemExit) as e:
        main(["--model", "minicpm4-jax", "--tasks", "t", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(message), err

    def too_many():
        raise ValueError("Sample larger than population or is negative")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", too_many)
    with pytest.raises(SystemExit) as e:
        main(["--model", "minicpm4-jax", "--tasks", "t", "--num_fewshot", "100000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "lower --num_fewshot" in err[0], err


@needs_lm_eval
def test_constructor_needs_a_checkpoint_and_launcher_registers():
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    with pytest.raises(ValueError, match="checkpoint=PATH"):
        MiniCPM4LM()
    lm = MiniCPM4LM.create_from_arg_string("max_gen_toks=9", {"model": ScriptedEvalModel(), "batch_size": "auto"})
    assert lm.max_gen_toks == 9 and lm.prefix_token_id == EOS and lm.eot_token_id == EOS and lm.max_length == 512
    # second break test: unknown model_args (a typo, or an option the backend did not pass on) ran silently
    from minicpm4_jax.config import ConfigError

    with pytest.raises(ConfigError, match="unknown --model_args bogus_opt for --model minicpm4-jax; known: "):
        MiniCPM4LM.create_from_arg_string("checkpoint=/x,bogus_opt=3", {"batch_size": 1, "device": None})
    with pytest.raises(ConfigError, match="checkpoint directory '/nonexistent' does not exist"):
        MiniCPM4LM.create_from_arg_string("checkpoint=/nonexistent,max_length=64,prefix=bos", {"batch_size": 1})


@needs_lm_eval
@pytest.mark.parametrize("arg, message", [
    ("max_gen_toks=abc", "max_gen_toks='abc' in --model_args must be an integer >= 1"),
    ("max_gen_toks=-5", "max_gen_toks=-5 in --model_args must be an integer >= 1"),
    ("max_gen_toks=0", "max_gen_toks=0 in --model_args must be an integer >= 1"),
    ("seed=x", "seed='x' in --model_args must be an integer"),
    ("checkpoint=/nonexistent,step=x", "step='x' in --model_args must be an integer >= 0"),
    ("checkpoint=/nonexistent,prefill_chunk=abc", "prefill_chunk='abc' in --model_args must be an integer >= 1"),
    ("checkpoint=/nonexistent,max_length=x", "max_length='x' in --model_args must be an integer >= 1"),
])
def test_model_args_that_are_not_integers_are_one_config_error(arg, message):
    """A non-integer value (int('abc')) was a ValueError traceback from the launcher; max_gen_toks <= 0 generated
    nothing for every request whose task names no max_gen_toks."""
    from minicpm4_jax.config import ConfigError
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    extra = {} if arg.startswith("checkpoint=") else {"model": ScriptedEvalModel()}
    with pytest.raises(ConfigError) as e:
        MiniCPM4LM.create_from_arg_string(arg, {"batch_size": 1, **extra})
    assert str(e.value).startswith(message), str(e.value)


@needs_lm_eval
def test_backend_over_a_real_tiny_model_equals_a_full_forward():
    """A randomly initialised minicpm4_jax model behind EvalModel: the backend's scores equal one
    unpadded full forward per request (prefix EOS + context + continuation)."""
    import jax
    from flax import nnx

    import minicpm4_jax.eval.model as em_mod
    from minicpm4_jax.config import ModelConfig
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM
    from minicpm4_jax.nn import MiniCPM4

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, dim_model_base=16, scale_emb=12.0)
    net = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    em = em_mod.EvalModel(net, ToyTokenizer(), batch_size=4, progress=False)
    lm = MiniCPM4LM(model=em)
    reqs = [("xa", "bc"), ("Answer: ", "A"), ("", "the end"), ("Question: in the", " a moon")]
    got = lm.loglikelihood([_inst("loglikelihood", r, i) for i, r in enumerate(reqs)], disable_tqdm=True)
    for (c, x), (lp, g) in zip(reqs, got):
        c_ids, x_ids = lm._encode_pair(c, x) if c else ([], ToyTokenizer().encode(x))
        ids = [EOS] + c_ids + x_ids
        logp = np.asarray(jax.nn.log_softmax(net(np.asarray([ids], np.int32))[0].astype(np.float32), axis=-1))
        n = 1 + len(c_ids)
        want = sum(float(logp[n - 1 + j, t]) for j, t in enumerate(x_ids))
        assert lp == pytest.approx(want, abs=1e-3), (c, x)
        assert g == all(int(np.argmax(logp[n - 1 + j])) == t for j, t in enumerate(x_ids))


@needs_lm_eval
def test_generate_until_reads_lm_evals_max_token_aliases():
    """Break test (helper 95): lm-eval's Hugging Face backend takes the number of new tokens from ``max_gen_toks``,
    else ``max_new_tokens``, ``max_tokens`` or ``max_completion_tokens`` (``normalize_gen_kwargs``); this backend
    read only ``max_gen_toks`` and generated its default 17 for the others, and ``max_gen_toks: None`` (lm-eval: the
    default) was a TypeError traceback."""
    from minicpm4_jax.config import ConfigError
    from minicpm4_jax.eval.lm_eval_backend import MiniCPM4LM

    m = ScriptedEvalModel()
    lm = MiniCPM4LM(model=m, max_gen_toks=17)
    lm.generate_until([_inst("generate_until", ("Q1", {"until": ["\n\n"], "max_new_tokens": 5}), 0),
                       _inst("generate_until", ("Q22", {"until": ["\n\n"], "max_tokens": 6}), 1),
                       _inst("generate_until", ("Q333", {"until": ["\n\n"], "max_completion_tokens": 7.0}), 2),
                       _inst("generate_until", ("Q1", {"until": ["\n\n"], "max_gen_toks": None, "max_tokens": 8}), 3),
                       _inst("generate_until", ("Q22", {"until": ["\n\n"], "max_gen_toks": None}), 4)])
    assert sorted(c[1] for c in m.calls if c[0] == "generate") == [5, 6, 7, 8, 17]
    for bad in ("many", 0, 2.5, True):
        with pytest.raises(ConfigError, match=f"^generate_until gen_kwargs: max_new_tokens={bad!r} is not a whole") \
                as e:
            lm.generate_until([_inst("generate_until", ("Q1", {"max_new_tokens": bad}), 0)])
        assert "\n" not in str(e.value)
