"""The MTP module as an EAGLE draft folder (issue 5: "laid out like the released EAGLE draft heads, so that
it exports as one"): ``minicpm4 export eagle`` and ``minicpm4 import hf --eagle``.

* Names, shapes and config of the folder (CPM.cu's loader rules, export.md §3), and a bit-identical round trip.
* The consumer: ``scripts/torch_side.py eagle-logits`` loads the folder with CPM.cu's file and name rules and
  runs the draft as CPM.cu does (stock transformers layers, the base model as a folded Llama in stock
  ``LlamaForCausalLM``); its draft logits equal our ``mtp_logits``. CPM.cu itself needs CUDA.
* The CLI end to end: a trained run's head exported, imported next to the base model, and used by the
  speculative decoder; bad inputs get one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from test_convert_common import (  # noqa: F401
    fold_official_dir_in_test,
    model_from_flat,
    random_params,
    read_json,
    tiny_cfg,
    tiny_tokenizer_dir,
)

from minicpm4_jax.cli import main
from minicpm4_jax.config import ConfigError
from minicpm4_jax.convert.eagle import eagle_config, eagle_param_shapes, read_eagle, write_eagle
from minicpm4_jax.convert.hf_export import write_hf
from minicpm4_jax.convert.io import MANIFEST_NAME, ConvertError

TOL = 1e-4


def _mtp_cfg(**kw):
    return dataclasses.replace(tiny_cfg(**kw), mtp=True)


def _mtp_params(cfg, seed: int) -> dict[str, np.ndarray]:
    p = random_params(cfg, seed)
    r = np.random.default_rng(seed + 1)
    for k in ("mtp/input_norm1", "mtp/input_norm2"):  # not all ones, so a swapped norm shows
        p[k] = (p[k] * r.uniform(0.5, 1.5, p[k].shape)).astype(np.float32)
    return p


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_eagle_folder_layout_config_and_bit_identical_round_trip(tmp_path):
    cfg = _mtp_cfg(tied=False, layers=3)
    params = _mtp_params(cfg, 41)
    res = write_eagle(params, cfg, tmp_path / "draft")
    files = sorted(p.name for p in (tmp_path / "draft").iterdir())
    assert files == ["config.json", MANIFEST_NAME, "model.safetensors"], files  # one weights file: CPM.cu's rule
    t = _tensors(tmp_path / "draft")
    assert {k: v.shape for k, v in t.items()} == eagle_param_shapes(cfg)
    h = cfg.hidden_size
    assert t["fc.weight"].shape == (h, 2 * h)
    np.testing.assert_array_equal(t["fc.weight"][:, :h], params["mtp/fc"][:h].T)  # embedding half first
    np.testing.assert_array_equal(t["fc.weight"][:, h:], params["mtp/fc"][h:].T)
    np.testing.assert_array_equal(t["layers.0.self_attn.q_proj.weight"],
                                  params["mtp/layer/q_proj"].reshape(h, -1).T)
    assert not any("embed_tokens" in k or "lm_head" in k for k in t)  # shared with the base model
    ec = read_json(tmp_path / "draft" / "config.json")
    base = cfg.to_hf_config()
    assert ec["num_hidden_layers"] == 1 and ec["head_dim"] == cfg.resolved_head_dim
    for k in ("scale_emb", "scale_depth", "dim_model_base", "hidden_size", "intermediate_size",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_scaling", "vocab_size"):
        assert ec[k] == base[k], k
    assert ec["mup_denominator"] == cfg.num_hidden_layers + 1  # vLLM's rule then gives CPM.cu's residual scale
    # the draft layer's residual multiplier as written: scale_depth / sqrt(L_base + 1) = 1.9 / 2 (field_faults B10;
    # mutation testing, helper 105: scale_depth / sqrt(L_base) in this key passed every test)
    assert ec["residual_scale"] == pytest.approx(cfg.scale_depth / np.sqrt(ec["mup_denominator"]), rel=1e-12)
    assert "sparse_config" not in ec
    assert res.manifest["format"] == "eagle-minicpm4"

    read, warnings = read_eagle(tmp_path / "draft", cfg)
    assert warnings == []
    for k, v in params.items():
        if k.startswith("mtp/"):
            back = read(k, v.shape)
            assert back.dtype == np.float32 and np.array_equal(back, v), k


@pytest.mark.torch
def test_eagle_draft_runs_in_the_cpmcu_transcription_with_our_logits(tmp_path):
    from torch_env import run_torch_side

    cfg = _mtp_cfg(tied=False, layers=3, max_pos=128)  # max_pos > original: LongRoPE's attention scaling != 1
    params = _mtp_params(cfg, 42)
    write_hf({k: v for k, v in params.items() if not k.startswith("mtp/")}, cfg, tmp_path / "base",
             no_tokenizer=True)
    tensors, hf_cfg = fold_official_dir_in_test(tmp_path / "base")
    (tmp_path / "folded").mkdir()
    save_file(tensors, str(tmp_path / "folded" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "folded" / "config.json").write_text(json.dumps(hf_cfg))
    write_eagle(params, cfg, tmp_path / "draft")
    r = np.random.default_rng(3)
    inputs = {f"T{t}": r.integers(0, cfg.vocab_size, (2, t)).astype(np.int64) for t in (9, 70)}
    np.savez(tmp_path / "inputs.npz", **inputs)
    proc = run_torch_side("eagle-logits", "--base", str(tmp_path / "folded"), "--base-config",
                          str(tmp_path / "base" / "config.json"), "--eagle", str(tmp_path / "draft"),
                          "--inputs", str(tmp_path / "inputs.npz"), "--out", str(tmp_path / "torch.npz"))
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["residual_scale"] == pytest.approx(cfg.scale_depth / np.sqrt(cfg.num_hidden_layers + 1))
    out = dict(np.load(tmp_path / "torch.npz"))

    model = model_from_flat(cfg, params)
    graphdef, state = nnx.split(model)

    @jax.jit
    def draft_logits(s, ids):
        m = nnx.merge(graphdef, s)
        hidden = m.hidden_states(ids)
        return m.mtp_logits(hidden[:, :-1], ids[:, 1:])

    for key, ids in inputs.items():
        ref = np.asarray(draft_logits(state, jnp.asarray(ids, jnp.int32)))
        got = out[f"draft_logits_{key}"]
        assert got.shape == ref.shape == (2, ids.shape[1] - 1, cfg.vocab_size)
        assert float(np.max(np.abs(ref))) > 0.5
        err = float(np.max(np.abs(got - ref)))
        print(f"{key}: max|d draft logit| {err:.2e}")
        assert err <= TOL, f"{key}: CPM.cu-transcription draft logits differ from mtp_logits by {err}"


def test_read_eagle_refuses_drafts_that_do_not_fit(tmp_path):
    cfg = _mtp_cfg()
    params = _mtp_params(cfg, 43)
    write_eagle(params, cfg, tmp_path / "d")

    def variant(name: str, edit_cfg=None, edit_tensors=None) -> Path:
        d = tmp_path / name
        d.mkdir()
        c = read_json(tmp_path / "d" / "config.json")
        if edit_cfg:
            edit_cfg(c)
        (d / "config.json").write_text(json.dumps(c))
        t = _tensors(tmp_path / "d")
        if edit_tensors:
            edit_tensors(t)
        save_file(t, str(d / "model.safetensors"))
        return d

    cases = {
        "scale": (variant("scale", edit_cfg=lambda c: c.update(scale_emb=c["scale_emb"] + 1)), "scale_emb"),
        "noscalar": (variant("noscalar", edit_cfg=lambda c: c.pop("dim_model_base")), "dim_model_base"),
        "layers": (variant("layers", edit_cfg=lambda c: c.update(num_hidden_layers=2)), "num_hidden_layers"),
        "width": (variant("width", edit_cfg=lambda c: c.update(intermediate_size=8)), "intermediate_size"),
        "missing": (variant("missing", edit_tensors=lambda t: t.pop("input_norm2.weight")), "input_norm2.weight"),
        "vllm": (variant("vllm", edit_tensors=lambda t: t.update({"model.fc.weight": t.pop("fc.weight")})),
                 "vLLM"),
        "shape": (variant("shape", edit_tensors=lambda t: t.update({"fc.weight": t["fc.weight"][:, :8]})),
                  "fc.weight"),
    }
    int32 = variant("int32", edit_tensors=lambda t: t.update(
        {"input_norm1.weight": t["input_norm1.weight"].astype(np.int32)}))
    cases["int32"] = (int32, "I32")  # would otherwise import as truncated weights
    for name, edit, needle in [
        ("cfg_list", None, "not an object"),
        ("nhl_str", lambda c: c.update(num_hidden_layers="one"), "num_hidden_layers"),
        ("scale_null", lambda c: c.update(scale_emb=None), "scale_emb"),
        ("quant_str", lambda c: c.update(quantization_config="gptq"), "quantized"),
        ("vocab", lambda c: c.update(vocab_size=c["vocab_size"] * 2), "vocab_size"),
        ("act", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        ("base", lambda c: c.update(num_hidden_layers=3, architectures=["MiniCPMForCausalLM"]), "base model"),
    ]:
        d = variant(name, edit_cfg=edit)
        if name == "cfg_list":
            (d / "config.json").write_text("[1, 2]")
        cases[name] = (d, needle)
    for name, (folder, needle) in cases.items():
        with pytest.raises(ConvertError) as e:
            read_eagle(folder, cfg)
        msg = str(e.value)
        assert "\n" not in msg and needle in msg, (name, msg)
    # a draft for a base of another depth (no private key to say so): a warning naming mup_denominator
    _, warns = read_eagle(variant("depth", edit_cfg=lambda c: (c.pop("base_num_hidden_layers"),
                                                               c.update(mup_denominator=7))), cfg)
    assert len(warns) == 1 and "mup_denominator 7" in warns[0], warns
    # an embed_tokens copy in the folder is ignored, as CPM.cu does
    ok = variant("embed", edit_tensors=lambda t: t.update({"embed_tokens.weight": np.zeros((4, 4), np.float32)}))
    read_eagle(ok, cfg)
    # a draft with a non-finite weight is refused when read
    nan = variant("nan", edit_tensors=lambda t: t["fc.weight"].__setitem__((0, 0), np.nan))
    read, _ = read_eagle(nan, cfg)
    with pytest.raises(ConvertError, match="non-finite"):
        read("mtp/fc", params["mtp/fc"].shape)


def test_write_eagle_refuses_no_mtp_module_float16_overflow_and_the_current_directory(tmp_path, monkeypatch):
    cfg = tiny_cfg()
    with pytest.raises(ConvertError, match="no MTP module"):
        write_eagle(random_params(cfg, 1), cfg, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    cfg = _mtp_cfg()
    params = _mtp_params(cfg, 2)
    params["mtp/fc"][0, 0] = 1e6  # above float16's largest finite value
    with pytest.raises(ConvertError, match="fc.weight does not fit float16"):
        write_eagle(params, cfg, tmp_path / "x", dtype="float16")
    assert not (tmp_path / "x").exists()
    write_eagle(params, cfg, tmp_path / "x", dtype="bfloat16")  # bfloat16 holds it
    # `--out ""` (an unset shell variable) or the working directory itself is never replaced, even with force
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("data")
    monkeypatch.chdir(work)
    for out in ("", ".", str(work), str(tmp_path)):
        with pytest.raises(ConvertError, match="current directory|empty"):
            write_eagle(params, cfg, out, force=True)
    assert (work / "keep.txt").read_text() == "data"
    assert eagle_config(_mtp_cfg())["num_hidden_layers"] == 1


def test_cli_export_eagle_then_import_next_to_the_base_and_draft(tmp_path, tiny_tokenizer_dir, capsys):
    """A run with an MTP head -> export hf + export eagle -> import hf --eagle -> the same draft parameters,
    and the speculative decoder drafts with them (greedy tokens equal plain greedy decoding)."""
    from minicpm4_jax.infer import InferenceEngine
    from minicpm4_jax.infer.spec import SpeculativeDecoder
    from minicpm4_jax.train.checkpoint import load_params_for_inference

    cfg = _mtp_cfg(tied=True)
    params = _mtp_params(cfg, 44)
    # a run folder with the MTP head: import the base, then add the head through --eagle (what a user of a
    # released checkpoint does), export both again and import the exports
    write_hf({k: v for k, v in params.items() if not k.startswith("mtp/")}, cfg, tmp_path / "base",
             tokenizer_dir=tiny_tokenizer_dir)
    write_eagle(params, cfg, tmp_path / "draft")
    assert main(["import", "hf", str(tmp_path / "base"), "--out", str(tmp_path / "run"), "--eagle",
                 str(tmp_path / "draft")]) == 0
    n_draft = sum(int(np.prod(s)) for s in eagle_param_shapes(cfg).values())
    assert f"+ an EAGLE draft head of {n_draft:,} parameters" in capsys.readouterr().out
    man = read_json(tmp_path / "run" / MANIFEST_NAME)
    assert man["eagle_draft"]["folder"] == str((tmp_path / "draft").resolve())
    assert main(["export", "eagle", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "draft2")]) == 0
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "draft2" / f).read_bytes() == (tmp_path / "draft" / f).read_bytes(), f
    # a run trained here (data.json: its documents start after EOS): the draft's config.json names the EOS as BOS,
    # as the base model's export does (hf_export.with_document_start)
    import shutil

    trained = tmp_path / "trained"
    shutil.copytree(tmp_path / "run", trained)
    (trained / MANIFEST_NAME).unlink()
    (trained / "data.json").write_text("{}")
    assert main(["export", "eagle", "--checkpoint", str(trained), "--out", str(tmp_path / "draft_t")]) == 0
    assert main(["export", "hf", "--checkpoint", str(trained), "--out", str(tmp_path / "base_t")]) == 0
    got, want = read_json(tmp_path / "draft_t" / "config.json"), read_json(tmp_path / "draft" / "config.json")
    assert got["bos_token_id"] == 2 == read_json(tmp_path / "base_t" / "config.json")["bos_token_id"]
    del got["bos_token_id"], want["bos_token_id"]
    assert got == want
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "base2")]) == 0
    man2 = read_json(tmp_path / "base2" / MANIFEST_NAME)
    assert "minicpm4 export eagle" in man2["mtp_draft"]
    t2 = _tensors(tmp_path / "base2")
    assert not any(k.startswith("mtp") or "fc.weight" == k for k in t2)

    train_cfg, model = load_params_for_inference(tmp_path / "run" / "checkpoints", 0)
    assert train_cfg.model.mtp
    for k, v in nnx.to_flat_state(nnx.state(model.mtp, nnx.Param)):
        path = "mtp/" + "/".join(str(p) for p in k)
        assert np.array_equal(np.asarray(v.get_value()), params[path]), path
    engine = InferenceEngine(model, prefill_chunk=64)
    prompt = [5, 9, 17, 3, 11, 40, 2, 8]
    plain = engine.generate([prompt], 12)  # greedy by default
    spec = SpeculativeDecoder(engine, model.mtp, num_draft=3).generate([prompt], 12)
    assert spec.tokens == plain.tokens and len(plain.tokens[0]) == 12

    # a ternary (QAT) checkpoint: QAT leaves the MTP module in float, and the manifest says so (twelfth-session
    # break test: it claimed "fake-quantized ternary weights")
    import minicpm4_jax.convert.hf_export as hf_export_mod

    real_load = hf_export_mod.load_export_source

    def as_ternary(*a, **k):
        src = real_load(*a, **k)
        return dataclasses.replace(src, ternary="qat", provenance={**src.provenance, "params": "fake-quantized"})

    hf_export_mod.load_export_source = as_ternary
    try:
        assert main(["export", "eagle", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "dq")]) == 0
    finally:
        hf_export_mod.load_export_source = real_load
    assert read_json(tmp_path / "dq" / MANIFEST_NAME)["source"]["params"].startswith(
        "the MTP module's weights as trained (not ternary")

    # bad input: one line, exit 2, nothing written
    capsys.readouterr()
    assert main(["export", "eagle", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "draft2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0]
    plain_run = tmp_path / "plain_run"
    assert main(["import", "hf", str(tmp_path / "base"), "--out", str(plain_run)]) == 0
    capsys.readouterr()
    assert main(["export", "eagle", "--checkpoint", str(plain_run), "--out", str(tmp_path / "d3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no MTP module" in err[0] and "model.mtp=true" in err[0], err
    assert not (tmp_path / "d3").exists()
    bad = tmp_path / "baddraft"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**read_json(tmp_path / "draft" / "config.json"), "scale_depth": 9.0}))
    (bad / "model.safetensors").write_bytes((tmp_path / "draft" / "model.safetensors").read_bytes())
    assert main(["import", "hf", str(tmp_path / "base"), "--out", str(tmp_path / "r3"), "--eagle", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scale_depth" in err[0], err
    assert not (tmp_path / "r3").exists()
    with pytest.raises(ConfigError):
        read_eagle(tmp_path / "nope", cfg)


def test_import_with_a_draft_counts_it_in_the_disk_space_it_needs(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """``import hf --eagle`` writes the base model and the draft head; its free-disk check counted the base's
    parameters only (``num_params``), not the head's (``mtp_params``: 270.5M of an 8B's, about 1 GiB in fp32)."""
    import minicpm4_jax.convert.hf_import as hi
    from minicpm4_jax.convert.hf_import import import_hf

    cfg = _mtp_cfg(tied=True)
    params = _mtp_params(cfg, 45)
    write_hf({k: v for k, v in params.items() if not k.startswith("mtp/")}, cfg, tmp_path / "base",
             tokenizer_dir=tiny_tokenizer_dir)
    write_eagle(params, cfg, tmp_path / "draft")
    asked: list[int] = []

    def staged_output(out, *, needed_bytes=0, **_kw):
        asked.append(needed_bytes)
        raise ConvertError("stop here")

    monkeypatch.setattr(hi, "staged_output", staged_output)
    with pytest.raises(ConvertError, match="stop here"):
        import_hf(tmp_path / "base", tmp_path / "run", eagle=tmp_path / "draft")
    weights = 4 * sum(int(np.prod(v.shape)) for v in params.values())  # the base's and the head's, fp32
    tokenizer = sum((tmp_path / "base" / n).stat().st_size for n in hi._TOKENIZER_FILES
                    if (tmp_path / "base" / n).is_file())
    assert cfg.mtp_params() > 0 and asked == [weights + tokenizer + (1 << 20)], (asked, weights, tokenizer)
