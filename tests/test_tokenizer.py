"""Tokenizer: official MiniCPM4 SentencePiece model, trained BPE tokenizer, tokenizer.json export, errors."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from conftest import shared_path

from minicpm4_jax.config import ConfigError
from minicpm4_jax.tokenizer import Tokenizer, load_tokenizer, sentencepiece_to_hf_json, train_tokenizer

SAMPLES = [
    "def foo(x):\n\tif x:\n        return x  + 1\n\n\n    # trailing   \n",
    "你好，世界！MiniCPM4 是一个高效的端侧大模型。",
    "mixed: naïve café — “quotes” 🙂 1234567890 0x1F  \r\n end",
    "   leading spaces and trailing spaces   ",
    "",
]


def _code_corpus(seed: int = 0, n_lines: int = 3000) -> list[str]:
    """Deterministic code-like documents (indentation, tabs, digits, a little Chinese)."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "data", "import", "class", "for", "in", "if", "else",
             "print", "x", "y", "0", "1", "42", "None", "True", "(", ")", ":", "=", "+", "[", "]",
             "'hello'", "你好", "name", "_private", "range", "len"]
    docs, lines = [], []
    for i in range(n_lines):
        indent = rng.choice(["", "    ", "        ", "\t"])
        lines.append(indent + " ".join(rng.choice(words) for _ in range(rng.randrange(2, 10))))
        if i % 100 == 99:
            docs.append("\n".join(lines) + "\n")
            lines = []
    return docs


# ------------------------------------------------------------------------------------------------
# official tokenizer
# ------------------------------------------------------------------------------------------------


def test_official_tokenizer_folder():
    d = shared_path("data", "minicpm4-0.5b")
    tok = load_tokenizer(d)
    assert tok.kind == "sentencepiece"
    assert tok.vocab_size == 73448  # 73440 pieces + 8 added chat/FIM tokens
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, None)
    assert tok.id_to_token(1) == "<s>" and tok.id_to_token(2) == "</s>"
    for text in SAMPLES:
        ids = tok.encode(text)
        assert 1 not in ids and 2 not in ids  # no BOS/EOS added
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\n你好<|im_end|>")
    assert ids[0] == 73441 and ids[-1] == 73440
    assert tok.decode(ids) == "<|im_start|>user\n你好<|im_end|>"


def test_official_tokenizer_model_file_alone(tmp_path):
    src = shared_path("data", "minicpm4-0.5b", "tokenizer.model")
    shutil.copy(src, tmp_path / "tokenizer.model")
    tok = load_tokenizer(tmp_path / "tokenizer.model")
    assert tok.vocab_size == 73440
    assert tok.encode("def f():\n    return 1") == load_tokenizer(src.parent).encode("def f():\n    return 1")


def test_official_tokenizer_export_tokenizer_json_matches(tmp_path):
    tok = load_tokenizer(shared_path("data", "minicpm4-0.5b"))
    written = {p.name for p in tok.save(tmp_path)}
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "added_tokens.json"} <= written
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "LlamaTokenizer"
    hf = load_tokenizer(tmp_path / "tokenizer.json")
    assert hf.kind == "hf" and hf.vocab_size == tok.vocab_size
    for text in SAMPLES + ["<|im_start|>assistant\nok<|im_end|>"] + _code_corpus(1, 300):
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
    # the saved folder reloads as the same SentencePiece tokenizer
    again = load_tokenizer(tmp_path)
    assert again.kind == "sentencepiece" and again.file_hash == tok.file_hash


# ------------------------------------------------------------------------------------------------
# trained tokenizer
# ------------------------------------------------------------------------------------------------


def test_train_tokenizer_recipe_roundtrip_and_ids(tmp_path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    tok = train_tokenizer(_code_corpus(), 400, tmp_path, seed=0, log=lambda s: None)
    assert tok.vocab_size == 400
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, None)
    m = pb.ModelProto()
    m.ParseFromString(open(tok.source, "rb").read())
    ts, ns = m.trainer_spec, m.normalizer_spec
    assert ts.model_type == pb.TrainerSpec.BPE and ts.byte_fallback and ts.split_digits
    assert ts.allow_whitespace_only_pieces and not ns.remove_extra_whitespaces and not ns.add_dummy_prefix
    assert ns.name == "identity"
    assert [p.piece for p in m.pieces[:5]] == ["<unk>", "<s>", "</s>", "\n", "\t"]
    for text in SAMPLES + ["unseen chars: ∮ ß Ω 🙂"]:
        assert tok.decode(tok.encode(text)) == text
    # digits are split one by one (unseen digits fall back to one byte piece each)
    assert len(tok.encode("4242")) == 4


def test_train_tokenizer_learns_from_lines_longer_than_the_trainers_limit(tmp_path):
    """Sixth break test: SentencePiece skips a sentence over max_sentence_length (16,384 bytes) without a word, so a
    corpus of long lines (JSON records, minified code) trained on its short lines only, or failed as "too small"
    when every line was long. Such lines are now given to the trainer in pieces."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    long_line = " ".join(words[(i * 7) % len(words)] + str(i % 10) for i in range(12000))  # ~90 KB, one line
    assert len(long_line.encode()) > 4 * 16384
    logs: list[str] = []
    tok = train_tokenizer([long_line], 300, tmp_path, seed=0, log=logs.append)
    assert any("on 6 lines" in m for m in logs), logs  # the line, in pieces of <= 16,384 bytes
    assert len(tok.encode("epsilon")) < 7  # merges learned from the long line (one piece per letter without)
    assert tok.decode(tok.encode(long_line)) == long_line


def test_a_vocabulary_smaller_than_the_corpus_characters_says_raise_it(tmp_path):
    """Break test: SentencePiece's "smaller than required_chars" was followed by "lower data.tokenizer_vocab_size"."""
    text = "".join(chr(0x4E00 + i) for i in range(120)) * 50  # 120 distinct characters
    with pytest.raises(ConfigError, match=r"raise data.tokenizer_vocab_size to >= \d+$"):
        train_tokenizer([text], 300, tmp_path, log=lambda m: None)


def test_train_tokenizer_deterministic_and_cached(tmp_path):
    corpus = _code_corpus()
    logs: list[str] = []
    a = train_tokenizer(corpus, 400, tmp_path / "a", seed=0, log=logs.append)
    b = train_tokenizer(corpus, 400, tmp_path / "b", seed=0, log=logs.append)
    assert open(a.source, "rb").read() == open(b.source, "rb").read()
    mtime = (tmp_path / "a").stat().st_mtime_ns
    c = train_tokenizer(corpus, 400, tmp_path / "a", seed=0, log=logs.append)
    assert c.source == a.source and c.file_hash == a.file_hash
    assert "reusing cached" in logs[-1] and (tmp_path / "a").stat().st_mtime_ns == mtime
    # a changed corpus or setting trains a new model under a new key
    d = train_tokenizer(corpus[:-1], 400, tmp_path / "a", seed=0, log=logs.append)
    e = train_tokenizer(corpus, 420, tmp_path / "a", seed=0, log=logs.append)
    assert len({a.source, d.source, e.source}) == 3


def test_train_tokenizer_sampling_is_seeded(tmp_path):
    corpus = _code_corpus()
    a = train_tokenizer(corpus, 400, tmp_path / "a", seed=1, max_sentences=1000, log=lambda s: None)
    b = train_tokenizer(corpus, 400, tmp_path / "b", seed=1, max_sentences=1000, log=lambda s: None)
    assert open(a.source, "rb").read() == open(b.source, "rb").read()


def test_train_tokenizer_from_files_and_export(tmp_path):
    files = []
    for i, doc in enumerate(_code_corpus()[:10]):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(doc, encoding="utf-8")
        files.append(p)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    files.append(tmp_path / "latin1.txt")
    tok = train_tokenizer(files, 300, tmp_path / "cache", log=lambda s: None)
    out = tmp_path / "export"
    names = {p.name for p in tok.save(out)}
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "LlamaTokenizer" and cfg["bos_token"] == "<s>" and cfg["eos_token"] == "</s>"
    hf = load_tokenizer(out / "tokenizer.json")
    assert (hf.bos_id, hf.eos_id, hf.unk_id, hf.vocab_size) == (1, 2, 0, 300)
    for text in SAMPLES + _code_corpus(7, 200):
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(hf.encode(text)) == text


def test_train_tokenizer_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_tokenizer(["abc"], 100, tmp_path)
    with pytest.raises(ConfigError, match="no text"):
        train_tokenizer(["", ""], 400, tmp_path)
    with pytest.raises(ConfigError, match="vocab_size=5000"):
        train_tokenizer(["tiny corpus\n"], 5000, tmp_path)
    assert not any(p.name.startswith("spm-") for p in tmp_path.iterdir())


def test_sentencepiece_to_hf_json_rejects_unigram(tmp_path):
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_code_corpus()[0].split("\n")), model_writer=buf, vocab_size=60,
        model_type="unigram", minloglevel=2, num_threads=1,
    )
    with pytest.raises(ConfigError, match="BPE"):
        sentencepiece_to_hf_json(buf.getvalue())


def test_tokenizer_json_adds_bos_as_tokenizer_config_says(tmp_path):
    """The converted tokenizer.json carries the BOS post-processor (transformers reads BOS insertion from it
    and ignores tokenizer_config.json's add_bos_token when the file exists); add_eos_token adds the EOS."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = train_tokenizer(_code_corpus(), 400, tmp_path / "spm", log=lambda s: None)
    tok.save(tmp_path / "saved")
    hf = HFTokenizer.from_file(str(tmp_path / "saved" / "tokenizer.json"))
    texts = ["def foo(x):", " leading space", "\nnewline first", "<|im_start|>user\nhi<|im_end|>"] + SAMPLES
    for text in texts:
        assert hf.encode(text).ids == [tok.bos_id] + tok.encode(text), text
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
    assert hf.encode("a", "b").ids == [1, *tok.encode("a"), 1, *tok.encode("b")]  # LlamaTokenizerFast's pair
    with_eos = json.loads(sentencepiece_to_hf_json(tok._sp_bytes, add_eos_token=True))["post_processor"]
    assert [next(iter(x.values()))["id"] for x in with_eos["single"]] == ["<s>", "A", "</s>"]
    with pytest.raises(ConfigError, match="'<nope>' is not in the tokenizer's vocabulary"):
        sentencepiece_to_hf_json(tok._sp_bytes, bos_token="<nope>")


def test_post_processor_replaced_for_another_bos(tmp_path):
    """``with_bos_eos_post_processor(replace=True)`` (the export of a run whose documents start after EOS): the EOS
    first, the way tokenizer_config.json names it; a TemplateProcessing is replaced, a ByteLevel kept before the
    template; a processor that adds its own specials is one-line refused; ``replace=False`` leaves one alone."""
    from tokenizers import Tokenizer as HFTokenizer

    from minicpm4_jax.tokenizer import with_bos_eos_post_processor

    tok = train_tokenizer(_code_corpus(), 400, tmp_path / "spm", log=lambda s: None)
    text = tok.to_hf_json()
    cfg = {"bos_token": "</s>", "eos_token": "</s>", "add_bos_token": True}
    assert with_bos_eos_post_processor(text, cfg) is None
    for old in (None, "template", {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                   "use_regex": False}):
        data = json.loads(text)
        if old != "template":
            data["post_processor"] = old
        new = with_bos_eos_post_processor(json.dumps(data), cfg, replace=True)
        hf = HFTokenizer.from_str(new)
        assert hf.encode("def foo(x):").ids == [tok.eos_id] + tok.encode("def foo(x):"), old
        assert hf.encode("a", "b").ids == [2, *tok.encode("a"), 2, *tok.encode("b")]
        assert {k: v for k, v in json.loads(new).items() if k != "post_processor"} == \
            {k: v for k, v in data.items() if k != "post_processor"}
    none = with_bos_eos_post_processor(text, {**cfg, "add_bos_token": False}, replace=True)
    assert HFTokenizer.from_str(none).encode("def").ids == tok.encode("def")
    data = json.loads(text)
    data["post_processor"] = {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1],
                              "trim_offsets": True, "add_prefix_space": False}
    with pytest.raises(ConfigError, match=r"^tokenizer.json's post_processor is RobertaProcessing, which adds its own"):
        with_bos_eos_post_processor(json.dumps(data), cfg, replace=True)


def test_official_tokenizer_json_adds_bos(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    tok = load_tokenizer(shared_path("data", "minicpm4-0.5b"))
    hf = HFTokenizer.from_str(tok.to_hf_json())
    for text in ["Hello world", " 你好", "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"]:
        assert hf.encode(text).ids == [1] + tok.encode(text), text


# ------------------------------------------------------------------------------------------------
# loading errors
# ------------------------------------------------------------------------------------------------


def test_load_tokenizer_errors(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(ConfigError, match=str(missing)) as e:
        load_tokenizer(missing)
    assert "\n" not in str(e.value) and "data.tokenizer=train" in str(e.value)
    with pytest.raises(ConfigError, match="neither tokenizer.model nor tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("a b c")
    with pytest.raises(ConfigError, match="neither a .model"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ConfigError, match="not a valid SentencePiece model"):
        load_tokenizer(tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer.json").write_text("{\"bogus\": 1}")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="config file"):
        load_tokenizer(tmp_path / "tokenizer_config.json")


def test_load_tokenizer_fix_replaces_only_the_training_hint(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(tmp_path, fix="pass --tokenizer")
    assert str(e.value).endswith("; pass --tokenizer") and "data.tokenizer" not in str(e.value)
    (tmp_path / "vocab.txt").write_text("a b c")
    with pytest.raises(ConfigError, match="; give one of those or its folder$"):  # a hint that is not training's
        load_tokenizer(tmp_path / "vocab.txt", fix="pass --tokenizer")


def test_tokenizer_class_requires_one_backend():
    with pytest.raises(ValueError):
        Tokenizer()
