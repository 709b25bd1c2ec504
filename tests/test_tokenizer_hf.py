"""Exported tokenizer files read back by their real consumer: transformers' AutoTokenizer.

A trained tokenizer (and the official MiniCPM4 one, when ``../shared`` is present) is saved with
:meth:`Tokenizer.save`; transformers (Python 3.11 side env, fast and slow tokenizers) must encode
every sample to the same ids and decode back to the same text.
"""

import json

import pytest

from conftest import shared_path
from minicpm4_jax.tokenizer import load_tokenizer, train_tokenizer
from test_tokenizer import _code_corpus
from torch_env import run_torch_side

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "\tindented with a tab\n\n\nthree newlines",
    "  leading spaces and trailing   ",
    "numbers 1234567 and 3.14159",
    "unicode: 你好, 世界 — café ñ ü 🙂",
    "class Foo(Bar):\n    '''doc'''\n    pass\n",
]


#: texts whose start matters for BOS / dummy-prefix handling (a word, a space, a newline, ChatML)
START_TEXTS = [
    "def foo(x):",
    "Hello world",
    " starts with a space",
    "\nstarts with a newline",
    "<|im_start|>user\nwrite a function<|im_end|>\n<|im_start|>assistant\n",
]


def _transformers_ids(d, texts, tmp_path, *flags) -> dict:
    f = tmp_path / "texts.json"
    f.write_text(json.dumps(texts))
    return json.loads(run_torch_side("tokenize", "--tokenizer-dir", str(d), "--texts", str(f), *flags).stdout.strip()
                      .splitlines()[-1])


def _check_in_transformers(tok, tmp_path, d=None, texts=TEXTS + START_TEXTS, flags=((),)):
    """``tok``'s files (saved to ``d``, or the folder ``d`` as exported) read by AutoTokenizer give ``tok``'s ids:
    without special tokens, and as ``tokenizer(text).input_ids`` = [BOS] + ids (tokenizer_config.json says
    add_bos_token: true, as ``minicpm4 generate`` and the GGUF do)."""
    if d is None:
        d = tmp_path / "exported"
        tok.save(d)
    ours = [tok.encode(t) for t in texts]
    for f in flags:
        out = _transformers_ids(d, texts, tmp_path, *f)
        assert out["fast"] == ours, (f, out["classes"])
        assert out["slow"] == ours, (f, out["classes"])
        assert out["fast_call"] == [[tok.bos_id] + i for i in ours], f
        assert out["slow_call"] == [[tok.bos_id] + i for i in ours], f
        assert out["fast_decoded"] == [tok.decode(i) for i in ours]
        # the exported tokenizer_config names the EOS transformers uses (the chat EOS for the official one)
        eos_name = tok.tokenizer_config()["eos_token"]
        assert out["fast_bos_eos"] == [tok.bos_id, tok.token_to_id(eos_name)]


@pytest.mark.torch
def test_trained_tokenizer_files_load_in_transformers(tmp_path):
    tok = train_tokenizer(_code_corpus(), 400, tmp_path / "spm", log=lambda *_: None)
    _check_in_transformers(tok, tmp_path)


@pytest.mark.torch
def test_official_tokenizer_reexport_loads_in_transformers(tmp_path):
    d = shared_path("data", "minicpm4-0.5b")
    _check_in_transformers(load_tokenizer(d), tmp_path)


@pytest.mark.torch
def test_exported_import_of_the_official_tokenizer_gives_our_ids_in_transformers(tmp_path):
    """``import hf`` of a folder with the official tokenizer.model but no tokenizer.json, then ``export hf --layout
    llama`` (AutoTokenizer reads config.json too, and transformers has no ``minicpm`` model type): the
    export writes tokenizer.json (and add_prefix_space false), so transformers, with sentencepiece or without it,
    gives this project's ids (copied as they were, transformers prepended "▁" or failed without sentencepiece)."""
    import shutil

    from minicpm4_jax.convert.hf_export import export_hf, write_hf
    from minicpm4_jax.convert.hf_import import import_hf
    from test_convert_common import random_params, tiny_cfg

    official = shared_path("data", "minicpm4-0.5b")
    cfg = tiny_cfg(vocab=73448, layers=1, eos=(2, 73440))
    write_hf(random_params(cfg, seed=42), cfg, tmp_path / "src", no_tokenizer=True)
    for n in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        shutil.copy(official / n, tmp_path / "src" / n)
    assert not (tmp_path / "src" / "tokenizer.json").exists()
    import_hf(tmp_path / "src", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf", layout="llama")  # the layout transformers loads without remote code
    tok = load_tokenizer(official)
    texts = START_TEXTS + [
        "你好，世界！MiniCPM4 是一个高效的端侧大模型。",
        "def f(x):\n\tif x:\n        return x + 1  # 注释\n",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n写一首诗<|im_end|>\n",
        "<|tool_call|>{\"name\": \"f\"}<|execute_start|>print(1)<|execute_end|>",
        "<|fim_prefix|>def a():<|fim_suffix|>\n    return 1<|fim_middle|>",
        "mixed: naïve café — “quotes” 🙂 1234567890  \r\n end",
    ]
    assert tok.encode("Hello world") == [15934, 2809]
    _check_in_transformers(tok, tmp_path, d=tmp_path / "hf", texts=texts, flags=((), ("--no-sentencepiece",)))
