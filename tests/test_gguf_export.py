"""GGUF export (issue 7): structure read back with ``gguf.GGUFReader``, round trips and logits from the
dequantized file, the q/k permutation against ggml's rope convention, llama.cpp's own converter as an
independent oracle (torch env), and an opt-in run in llama.cpp itself.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import shared_path
from test_convert_common import (  # noqa: F401
    jax_logits,
    random_params,
    read_json,
    tiny_cfg,
    tiny_tokenizer_dir,
    trained_run,
)

from minicpm4_jax.cli import main
from minicpm4_jax.convert.gguf_export import (
    gguf_tensor_types,
    permute_qk,
    read_gguf_params,
    unpermute_qk,
    write_gguf,
    write_gguf_dir,
)
from minicpm4_jax.convert.hf_export import write_hf
from minicpm4_jax.convert.io import MANIFEST_NAME, ConvertError
from minicpm4_jax.nn.rope import attention_scaling

REPO = Path(__file__).resolve().parent.parent


def _fields(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


def _ids(cfg, seed: int, t: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, t)).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# structure
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outtype,mat", [("f32", "F32"), ("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_gguf_structure(tmp_path, tiny_tokenizer_dir, outtype, mat):
    cfg = tiny_cfg(tied=outtype != "f16", max_pos=128 if outtype == "q8_0" else 64)
    params = random_params(cfg, seed=20)
    res = write_gguf_dir(params, cfg, tmp_path / "g", outtype=outtype, tokenizer_dir=tiny_tokenizer_dir)
    path = tmp_path / "g" / f"minicpm4-{outtype}.gguf"
    kv, tens = _fields(path)
    L = cfg.num_hidden_layers
    expect = {
        "general.architecture": "minicpm", "minicpm.block_count": L, "minicpm.context_length": cfg.max_position_embeddings,
        "minicpm.embedding_length": 64, "minicpm.feed_forward_length": 96, "minicpm.attention.head_count": 4,
        "minicpm.attention.head_count_kv": 2, "minicpm.rope.freq_base": 10000.0, "minicpm.rope.scaling.type": "longrope",
        "minicpm.rope.scaling.original_context_length": 64, "general.file_type": gguf.LlamaFileType[
            {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}[outtype]].value,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
    }
    for k, v in expect.items():
        assert kv.get(k) == v, (k, kv.get(k), v)
    # all three MiniCPM scale keys (llama.cpp's legacy defaults differ: 12, 1.4/sqrt(L), 256/n_embd)
    assert kv["minicpm.embedding_scale"] == pytest.approx(7.0, rel=1e-7)
    assert kv["minicpm.residual_scale"] == pytest.approx(1.9 / math.sqrt(L), rel=1e-7)
    assert kv["minicpm.logit_scale"] == pytest.approx(64 / 16, rel=1e-7)
    assert kv["minicpm.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5, rel=1e-6)
    if cfg.max_position_embeddings > 64:
        assert attention_scaling(cfg) > 1.05
        assert kv["minicpm.rope.scaling.attn_factor"] == pytest.approx(attention_scaling(cfg), rel=1e-7)
    else:
        assert "minicpm.rope.scaling.attn_factor" not in kv
    assert len(kv["tokenizer.ggml.tokens"]) == cfg.vocab_size == len(kv["tokenizer.ggml.token_type"])
    # tensor names, reversed (ggml ne[0] = in_features) shapes and types
    names = {"token_embd.weight", "output_norm.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
    for i in range(L):
        names |= {f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                                   "ffn_gate", "ffn_up", "ffn_down")}
    if not cfg.tie_word_embeddings:
        names.add("output.weight")
    assert set(tens) == names
    shapes = {"token_embd.weight": [64, 320], "output.weight": [64, 320], "blk.0.attn_q.weight": [64, 64],
              "blk.0.attn_k.weight": [64, 32], "blk.1.attn_output.weight": [64, 64], "blk.1.ffn_down.weight": [96, 64],
              "blk.0.ffn_gate.weight": [64, 96], "output_norm.weight": [64], "rope_factors_long.weight": [8]}
    for n, s in shapes.items():
        if n in tens:
            assert list(tens[n].shape) == s, (n, list(tens[n].shape))
    types = gguf_tensor_types(cfg, outtype)
    for n, t in tens.items():
        want = "F32" if (n.endswith("norm.weight") or n.startswith("rope_factors")) else mat
        assert t.tensor_type.name == want == types[n], n
    np.testing.assert_array_equal(tens["rope_factors_long.weight"].data, np.asarray(cfg.rope_scaling.long_factor, np.float32))
    man = read_json(tmp_path / "g" / MANIFEST_NAME)
    assert man["format"] == "gguf" and man["outtype"] == outtype and man["file"] == path.name
    assert res.files == [path.name]


def test_gguf_vocabulary_of_the_official_tokenizer(tmp_path):
    """Added chat/FIM tokens are control tokens, the chat template and special ids are carried."""
    tok_dir = shared_path("data", "minicpm4-0.5b")
    cfg = tiny_cfg(vocab=73448, layers=1)
    write_gguf(random_params(cfg, seed=21), cfg, tmp_path / "v.gguf", outtype="f16", tokenizer_dir=tok_dir)
    kv, _ = _fields(tmp_path / "v.gguf")
    toks, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(toks) == 73448
    assert (toks[0], toks[1], toks[2]) == ("<unk>", "<s>", "</s>")
    assert toks[73440] == "<|im_end|>" and toks[73441] == "<|im_start|>" and toks[73447] == "<|fim_suffix|>"
    assert types[73440] == gguf.TokenType.CONTROL and types[1] == gguf.TokenType.CONTROL
    # <unk> is listed as special in tokenizer_config.json's added_tokens_decoder: CONTROL, as the converter does
    assert types[0] == gguf.TokenType.CONTROL and types[100] in (gguf.TokenType.NORMAL, gguf.TokenType.BYTE)
    assert "<|im_start|>" in kv["tokenizer.chat_template"]
    assert kv["tokenizer.ggml.bos_token_id"] == 1 and kv["tokenizer.ggml.add_bos_token"] is True


def _spm_proto(tok_dir: Path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString((tok_dir / "tokenizer.model").read_bytes())
    return m


@pytest.mark.parametrize("which", ["trained", "trained_dummy_prefix", "official"])
def test_gguf_add_space_prefix_follows_the_sentencepiece_model(tmp_path, tiny_tokenizer_dir, which):
    """llama.cpp prepends "▁" to SPM text unless tokenizer.ggml.add_space_prefix says otherwise (its default is
    true); MiniCPM4's model (and ours) has add_dummy_prefix = false, so the key must be written, as the flag."""
    cfg = tiny_cfg()
    if which == "official":
        tok_dir, cfg = shared_path("data", "minicpm4-0.5b"), tiny_cfg(vocab=73448, layers=1, eos=(2, 73440))
    elif which == "trained_dummy_prefix":  # the same pieces with a dummy prefix: the key follows the model
        tok_dir = tmp_path / "tok"
        tok_dir.mkdir()
        m = _spm_proto(tiny_tokenizer_dir)
        m.normalizer_spec.add_dummy_prefix = True
        (tok_dir / "tokenizer.model").write_bytes(m.SerializeToString())
    else:
        tok_dir = tiny_tokenizer_dir
    want = bool(_spm_proto(tok_dir).normalizer_spec.add_dummy_prefix)
    assert want is (which == "trained_dummy_prefix")
    write_gguf(random_params(cfg, seed=21), cfg, tmp_path / "v.gguf", outtype="f16", tokenizer_dir=tok_dir)
    kv, _ = _fields(tmp_path / "v.gguf")
    assert kv.get("tokenizer.ggml.add_space_prefix") is want


@pytest.mark.parametrize("which", ["trained_model_only", "official", "official_trained_here"])
def test_gguf_special_ids_when_the_eos_is_a_list(tmp_path, tiny_tokenizer_dir, which):
    """A folder without tokenizer.json (an imported official one) and a list model.eos_token_id: gguf.SpecialVocab
    resolves no eos/unk there, and llama.cpp would assume eos 2 only. The GGUF names eos (the tokenizer_config's
    eos_token, as llama.cpp's converter reads our HF export, which has tokenizer.json), unk, and the other eos id as
    eot, so llama.cpp ends generation on every id of model.eos_token_id. A run trained here on the official
    tokenizer (document_start eos: </s> written as the BOS) still stops on </s> (helper 74: it had lost its eot)."""
    start = "bos"
    if which.startswith("official"):
        tok_dir, eos = shared_path("data", "minicpm4-0.5b"), (2, 73440)
        cfg = tiny_cfg(vocab=73448, layers=1, eos=eos)
        want = {"eos": 73440, "eot": 2, "unknown": 0, "bos": 1}  # eos_token <|im_end|>; </s> as eot
        if which == "official_trained_here":
            start, want["bos"] = "eos", 2
    else:
        tok_dir = tmp_path / "tok"
        tok_dir.mkdir()
        for n in ("tokenizer.model", "tokenizer_config.json"):
            (tok_dir / n).write_bytes((tiny_tokenizer_dir / n).read_bytes())
        eos = (2, 3)
        cfg = tiny_cfg(eos=eos)
        want = {"eos": 2, "eot": 3, "unknown": 0, "bos": 1}
    warnings = write_gguf(random_params(cfg, seed=21), cfg, tmp_path / "v.gguf", outtype="f16", tokenizer_dir=tok_dir,
                          document_start=start)
    kv, _ = _fields(tmp_path / "v.gguf")
    got = {k: kv.get(f"tokenizer.ggml.{k}_token_id") for k in want}
    assert got == want
    assert {got["eos"], got["eot"]} == set(eos) and not warnings
    toks = kv["tokenizer.ggml.tokens"]
    assert toks[got["unknown"]] == "<unk>" and toks[got["bos"]] == ("</s>" if start == "eos" else "<s>")


def test_gguf_third_eos_id_is_a_warning(tmp_path, tiny_tokenizer_dir):
    cfg = tiny_cfg(eos=(2, 3, 4))
    warnings = write_gguf(random_params(cfg, seed=21), cfg, tmp_path / "v.gguf", outtype="f16",
                          tokenizer_dir=tiny_tokenizer_dir)
    kv, _ = _fields(tmp_path / "v.gguf")
    assert (kv["tokenizer.ggml.eos_token_id"], kv["tokenizer.ggml.eot_token_id"]) == (2, 3)
    assert any("llama.cpp stops on eos 2 and eot 3 only; [4]" in w for w in warnings), warnings


# ------------------------------------------------------------------------------------------------
# contents: round trip and logits from the dequantized file
# ------------------------------------------------------------------------------------------------


def test_gguf_round_trip_and_logits(tmp_path, tiny_tokenizer_dir):
    cfg = tiny_cfg(tied=False)
    params = random_params(cfg, seed=22)
    ids = _ids(cfg, 1)
    ref = jax_logits(cfg, params, ids)
    scale = float(np.max(np.abs(ref)))
    assert scale > 1.0
    errs = {}
    for outtype in ("f32", "f16", "bf16", "q8_0"):
        p = tmp_path / f"{outtype}.gguf"
        write_gguf(params, cfg, p, outtype=outtype, tokenizer_dir=tiny_tokenizer_dir)
        back = read_gguf_params(p, cfg)
        if outtype == "f32":  # lossless: bit-identical parameters, identical logits
            for k in params:
                assert np.array_equal(back[k].view(np.uint32), params[k].view(np.uint32)), k
        logits = jax_logits(cfg, back, ids)
        errs[outtype] = float(np.max(np.abs(logits - ref)))
        top1 = float(np.mean(np.argmax(logits, -1) == np.argmax(ref, -1)))
        print(f"{outtype}: max|dlogit| {errs[outtype]:.3e} (max|logit| {scale:.2f}), top-1 agreement {top1:.3f}")
        if outtype == "f32":
            assert errs[outtype] == 0.0
        elif outtype in ("f16", "bf16"):
            assert errs[outtype] <= 1e-2 * scale and errs[outtype] > 0
        else:
            assert top1 >= 0.95 and errs[outtype] <= 5e-2 * scale
    assert errs["f16"] < errs["bf16"]  # 10 vs 7 mantissa bits: the file really holds what it says


def test_qk_permutation_matches_ggml_norm_rope():
    """HF rotate-half rope on the original rows == ggml NORM (adjacent-pair) rope on the permuted rows."""
    rng = np.random.default_rng(0)
    n_head, d, h = 3, 8, 5
    w = rng.standard_normal((n_head * d, h))
    x = rng.standard_normal(h)
    theta = rng.uniform(0.1, 3.0, d // 2)
    q = (w @ x).reshape(n_head, d)
    c, s = np.cos(theta), np.sin(theta)
    # HF / MiniCPM: pairs (j, j + d/2)
    a, b = q[:, : d // 2], q[:, d // 2:]
    hf = np.concatenate([a * c - b * s, b * c + a * s], axis=1)
    # ggml LLAMA_ROPE_TYPE_NORM: pairs (2j, 2j+1) on the permuted weight
    qp = (permute_qk(w, n_head) @ x).reshape(n_head, d)
    e, o = qp[:, 0::2], qp[:, 1::2]
    norm = np.empty_like(qp)
    norm[:, 0::2], norm[:, 1::2] = e * c - o * s, o * c + e * s
    np.testing.assert_allclose(norm.reshape(-1), permute_qk((hf.reshape(-1, 1)), n_head).reshape(-1), rtol=1e-12)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    assert not np.array_equal(permute_qk(w, n_head), w)


def test_gguf_bad_input(tmp_path, tiny_tokenizer_dir):
    cfg = tiny_cfg(vocab=300)
    params = random_params(cfg, seed=23)
    with pytest.raises(ConvertError, match="has 320 tokens but the model's vocab_size is 300"):
        write_gguf_dir(params, cfg, tmp_path / "a", outtype="f16", tokenizer_dir=tiny_tokenizer_dir)
    with pytest.raises(ConvertError, match="needs the vocabulary"):
        write_gguf_dir(params, cfg, tmp_path / "a", outtype="f16", tokenizer_dir=None)
    json_only = tmp_path / "tok"
    json_only.mkdir()
    (json_only / "tokenizer.json").write_bytes((tiny_tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ConvertError, match="no tokenizer.model"):
        write_gguf_dir(params, tiny_cfg(), tmp_path / "a", outtype="f16", tokenizer_dir=json_only)
    with pytest.raises(ConvertError, match="--outtype 'q4_k_m' is not supported"):
        write_gguf_dir(params, cfg, tmp_path / "a", outtype="q4_k_m", tokenizer_dir=tiny_tokenizer_dir)
    assert not (tmp_path / "a").exists()
    sparse = tiny_cfg(sparse=True)
    with pytest.raises(ConvertError, match=r"sparse attention \(model.attention=infllmv2\).*--allow-dense"):
        write_gguf_dir(random_params(sparse, seed=24), sparse, tmp_path / "s", outtype="f16",
                       tokenizer_dir=tiny_tokenizer_dir)
    assert not (tmp_path / "s").exists()
    res = write_gguf_dir(random_params(sparse, seed=24), sparse, tmp_path / "s", outtype="f16",
                         tokenizer_dir=tiny_tokenizer_dir, allow_dense=True)
    assert any("dense attention only" in w for w in res.warnings)
    assert read_json(tmp_path / "s" / MANIFEST_NAME)["dropped"] == ["sparse_config"]
    assert read_json(tmp_path / "s" / MANIFEST_NAME)["allow_dense"] is True


@pytest.mark.parametrize("outtype", ["q8_0", "tq2_0", "tq1_0"])
def test_gguf_block_scale_overflow_is_refused(tmp_path, tiny_tokenizer_dir, outtype):
    """Q8_0 stores max|block|/127, TQ1_0/TQ2_0 max|block| as one float16 per block: past 65504 numpy writes inf and
    the block dequantizes to inf/NaN. Refused in one line naming the tensor (as --outtype f16 refuses |w| > 65504),
    nothing left behind; a weight just inside the range is written and read back finite."""
    if outtype == "q8_0":
        cfg = tiny_cfg()
        params = random_params(cfg, seed=28)
        name, big, ok = "layers/q_proj", 1e7, 8.0e6  # 1e7/127 = 78740 > 65504; 8e6/127 = 62992
    else:  # a ternary model (one magnitude per 256-block) whose ffn_up scale is out of float16's range
        cfg = tiny_cfg(hidden=256, inter=256)
        params = {k: (np.where(v >= 0, 0.01, -0.01).astype(np.float32) if v.ndim >= 2 and "embed" not in k else v)
                  for k, v in random_params(cfg, seed=28).items()}
        name, big, ok = "layers/up_proj", 1e6, 6.0e4
    key = name
    gguf_name = "blk.0.attn_q.weight" if outtype == "q8_0" else "blk.0.ffn_up.weight"
    bad = dict(params)
    bad[key] = params[key].copy()
    if outtype == "q8_0":
        bad[key][0, 0, 0, 5] = big  # layer 0, one weight of attn_q
    else:
        bad[key][0] = params[key][0] / 0.01 * big  # layer 0: ternary with scale 1e6
    with pytest.raises(ConvertError, match=rf"^{gguf_name} does not fit {outtype.upper()} \(--outtype {outtype}\): its "
                       r"largest magnitude 1e\+0[67] .*float16's 65504.*--outtype f32 or bf16$"):
        write_gguf_dir(bad, cfg, tmp_path / "g", outtype=outtype, tokenizer_dir=tiny_tokenizer_dir)
    assert not (tmp_path / "g").exists()
    fine = dict(bad)
    fine[key] = bad[key] / big * ok
    write_gguf_dir(fine, cfg, tmp_path / "g", outtype=outtype, tokenizer_dir=tiny_tokenizer_dir)
    back = read_gguf_params(tmp_path / "g" / f"minicpm4-{outtype}.gguf", cfg)
    assert all(np.isfinite(v).all() for v in back.values())
    assert float(np.max(np.abs(back[key]))) == pytest.approx(ok, rel=1e-3)


def test_cli_export_gguf(tmp_path, tiny_tokenizer_dir, capsys):
    cfg = tiny_cfg(tied=True)
    params = random_params(cfg, seed=25)
    write_hf(params, cfg, tmp_path / "src", tokenizer_dir=tiny_tokenizer_dir)
    assert main(["import", "hf", str(tmp_path / "src"), "--out", str(tmp_path / "run")]) == 0
    assert main(["export", "gguf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "g"),
                 "--outtype", "f32"]) == 0
    back = read_gguf_params(tmp_path / "g" / "minicpm4-f32.gguf", cfg)
    for k in params:
        assert np.array_equal(back[k], params[k]), k
    man = read_json(tmp_path / "g" / MANIFEST_NAME)
    assert man["source"]["step"] == 0 and len(man["source"]["params_sha256"]) == 64
    capsys.readouterr()
    assert main(["export", "gguf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "g")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_gguf_of_a_run_trained_here_prepends_the_eos(trained_run, tmp_path, tiny_tokenizer_dir, capsys):
    """A run trained here saw every document after an EOS: its GGUF says bos = the EOS id with add_bos_token true,
    so llama.cpp prepends the EOS by itself (before: bos 1, <s>, which the model never saw at a document start).
    ``document_start="none"`` writes add_bos_token false; ``"bos"`` (the official models) keeps <s>."""
    assert main(["export", "gguf", "--checkpoint", str(trained_run), "--out", str(tmp_path / "g"),
                 "--outtype", "f32"]) == 0, capsys.readouterr().err
    kv, _ = _fields(tmp_path / "g" / "minicpm4-f32.gguf")
    assert kv["tokenizer.ggml.bos_token_id"] == 2 == kv["tokenizer.ggml.eos_token_id"]
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_eos_token"] is False
    assert kv["tokenizer.ggml.tokens"][2] == "</s>"
    man = read_json(tmp_path / "g" / MANIFEST_NAME)
    assert man["source"]["document_start"] == "eos" and man["warnings"] == []
    cfg = tiny_cfg()
    params = random_params(cfg, seed=28)
    for start, bos, add in (("none", 1, False), ("bos", 1, True), ("eos", 2, True)):
        write_gguf(params, cfg, tmp_path / f"{start}.gguf", outtype="f32", tokenizer_dir=tiny_tokenizer_dir,
                   document_start=start)
        kv, _ = _fields(tmp_path / f"{start}.gguf")
        assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.add_bos_token"]) == (bos, add), start
    with pytest.raises(ConvertError, match="document_start 'cls' is not one of"):
        write_gguf(params, cfg, tmp_path / "bad.gguf", outtype="f32", tokenizer_dir=tiny_tokenizer_dir,
                   document_start="cls")
    assert not (tmp_path / "bad.gguf").exists()


# ------------------------------------------------------------------------------------------------
# independent oracle: llama.cpp's own convert_hf_to_gguf.py (torch env)
# ------------------------------------------------------------------------------------------------


def _converter_dir() -> Path:
    """llama.cpp's converter from the llama-cpp-python sdist (cached under .cache/); skip if PyPI is unreachable."""
    from torch_env import TORCH_PY, ensure_torch_env

    ensure_torch_env()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "fetch_llamacpp_converter.sh")], cwd=REPO,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PIP": f"{TORCH_PY} -m pip"})
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return REPO / proc.stdout.strip().splitlines()[-1]


#: keys the converter derives from the folder name / parameter count (not model facts)
_NAMING_KEYS = {"general.name", "general.size_label", "general.basename", "general.finetune"}
#: keys only our writer adds (documented in gguf_export: llama.cpp reads them, the converter omits them)
_OUR_EXTRA_KEYS = {"minicpm.rope.scaling.original_context_length", "minicpm.rope.scaling.attn_factor",
                   "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.eot_token_id"}


@pytest.mark.torch
@pytest.mark.parametrize("case", ["tiny_tok_untied", "official_tok_tied"])
def test_gguf_equals_llamacpp_converter(tmp_path, tiny_tokenizer_dir, case):
    from torch_env import run_torch_side

    if case == "official_tok_tied":
        tok_dir, cfg = shared_path("data", "minicpm4-0.5b"), tiny_cfg(tied=True, vocab=73448, layers=1, eos=(2, 73440))
    else:
        tok_dir, cfg = tiny_tokenizer_dir, tiny_cfg(tied=False, layers=3, max_pos=256)
    params = random_params(cfg, seed=26)
    conv = _converter_dir()
    write_hf(params, cfg, tmp_path / "hf", layout="minicpm", tokenizer_dir=tok_dir, max_shard_size="64KB")
    theirs = tmp_path / "theirs.gguf"
    run_torch_side("convert-gguf", str(conv), str(tmp_path / "hf"), str(theirs), "--outtype", "f32", timeout=600)
    write_gguf(params, cfg, tmp_path / "ours.gguf", outtype="f32", tokenizer_dir=tok_dir)
    n_t, n_k = _assert_same_as_converter(tmp_path / "ours.gguf", theirs)
    print(f"{case}: {n_t} tensors and {n_k} keys identical to convert_hf_to_gguf.py")


def _assert_same_as_converter(ours: Path, theirs: Path) -> tuple[int, int]:
    """Our GGUF's keys (but the naming keys and our documented extras) and tensors equal the converter's."""
    kv_o, t_o = _fields(ours)
    kv_t, t_t = _fields(theirs)
    assert set(kv_t) - _NAMING_KEYS == set(kv_o) - _NAMING_KEYS - _OUR_EXTRA_KEYS
    for k in set(kv_t) - _NAMING_KEYS:
        assert kv_o[k] == kv_t[k], (k, kv_o[k] if not isinstance(kv_o[k], list) else len(kv_o[k]))
    assert set(t_o) == set(t_t)
    for n in t_t:
        a, b = t_o[n], t_t[n]
        assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)), n
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), f"{n}: tensor bytes differ from llama.cpp's converter"
    return len(t_t), len(set(kv_t) - _NAMING_KEYS)


@pytest.mark.torch
def test_gguf_of_a_trained_run_equals_llamacpp_converter_on_its_hf_export(tmp_path, trained_run):
    """llama.cpp's converter, run on the official-layout export of a run trained here, also writes bos = the EOS id
    with add_bos_token true (it reads the export's tokenizer_config.json / tokenizer.json / config.json), and
    every key and tensor of ours equals its."""
    from torch_env import run_torch_side

    conv = _converter_dir()
    assert main(["export", "hf", "--checkpoint", str(trained_run), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", "gguf", "--checkpoint", str(trained_run), "--out", str(tmp_path / "g"),
                 "--outtype", "f32"]) == 0
    theirs = tmp_path / "theirs.gguf"
    run_torch_side("convert-gguf", str(conv), str(tmp_path / "hf"), str(theirs), "--outtype", "f32", timeout=600)
    kv_t, _ = _fields(theirs)
    assert kv_t["tokenizer.ggml.bos_token_id"] == 2 and kv_t["tokenizer.ggml.add_bos_token"] is True
    _assert_same_as_converter(tmp_path / "g" / "minicpm4-f32.gguf", theirs)


# ------------------------------------------------------------------------------------------------
# opt-in: run the GGUF in llama.cpp itself (builds llama-cpp-python from source: 15-30 min)
# ------------------------------------------------------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.skipif(os.environ.get("MINICPM4_LLAMACPP") != "1",
                    reason="opt-in: set MINICPM4_LLAMACPP=1 (builds llama-cpp-python from source, 15-30 min) "
                           "and run with -m llamacpp")
def test_gguf_logits_in_llamacpp(tmp_path, tiny_tokenizer_dir):
    cfg = tiny_cfg(tied=False, layers=2)
    params = random_params(cfg, seed=27)
    write_gguf(params, cfg, tmp_path / "m.gguf", outtype="f32", tokenizer_dir=tiny_tokenizer_dir)
    ids = _ids(cfg, 2, t=24)[:1]
    np.save(tmp_path / "ids.npy", ids[0])
    proc = subprocess.run(["bash", str(REPO / "scripts" / "verify_gguf_llamacpp.sh"), str(tmp_path / "m.gguf"),
                           str(tmp_path / "ids.npy"), str(tmp_path / "scores.npy")], cwd=REPO, capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    scores = np.load(tmp_path / "scores.npy")
    ref = jax_logits(cfg, params, ids)[0]
    err = float(np.max(np.abs(scores - ref)))
    print(f"llama.cpp F32 vs JAX: max|dlogit| {err:.3e}")
    assert err <= 1e-3


@pytest.mark.parametrize("max_pos_mult", [2, 1])
def test_distinct_factor_lists_are_written_as_the_list_the_model_uses(tmp_path, tiny_tokenizer_dir, max_pos_mult):
    """llama.cpp takes rope_factors_long only when its context exceeds the original length; this model picks one
    list from the configured lengths. Both tensors hold the list the model uses, with a warning; equal lists (every
    released config) are written unchanged and silently (test_gguf_structure)."""
    import dataclasses

    base = tiny_cfg(tied=False, max_pos=max_pos_mult * 64)
    rs = base.rope_scaling
    assert rs.original_max_position_embeddings == 64
    short = tuple(float(x) for x in np.linspace(1.0, 2.0, len(rs.long_factor)))
    cfg = dataclasses.replace(base, rope_scaling=dataclasses.replace(rs, short_factor=short))
    used = np.asarray(rs.long_factor if max_pos_mult > 1 else short, np.float32)
    warnings = write_gguf(random_params(cfg, seed=3), cfg, tmp_path / "m.gguf", outtype="f32",
                          tokenizer_dir=tiny_tokenizer_dir)
    _, tens = _fields(tmp_path / "m.gguf")
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        np.testing.assert_array_equal(tens[name].data, used, err_msg=name)
    assert any("short_factor and long_factor differ" in w and "llama.cpp" in w for w in warnings), warnings
