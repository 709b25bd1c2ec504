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


def _check_in_transformers(tok, tmp_path):
    d = tmp_path / "exported"
    tok.save(d)
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(TEXTS))
    out = json.loads(run_torch_side("tokenize", "--tokenizer-dir", str(d), "--texts", str(texts)).stdout.strip()
                     .splitlines()[-1])
    ours = [tok.encode(t) for t in TEXTS]
    assert out["fast"] == ours, out["classes"]
    assert out["slow"] == ours, out["classes"]
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
