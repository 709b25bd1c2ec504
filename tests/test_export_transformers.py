"""Exports loaded by stock transformers (issue 7), in the Python 3.11 CPU-torch environment.

* Llama layout: ``AutoModelForCausalLM.from_pretrained(dir)`` with ``trust_remote_code=False`` loads
  the exported folder itself (sharded safetensors + index, longrope, folded μP scalars); its float32
  logits match the JAX model to <= 1e-4 and its greedy continuation equals ours token for token.
* Official layout: the exported ``MiniCPMForCausalLM`` folder is folded *inside the test* with plain
  numpy from its own ``config.json`` scalars (``test_convert_common.fold_official_dir_in_test``), loaded
  the same way and compared the same way: this proves names, shapes and scalars of the official
  export without remote code (export.md §7 row 2b).
* A run trained here (both layouts): ``AutoTokenizer(text)`` puts the EOS first, as the run saw every document,
  and the model's logits on those ids equal ours after ``[eos]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_convert_common import (  # noqa: F401
    fold_official_dir_in_test,
    greedy,
    jax_logits,
    random_params,
    tiny_cfg,
    tiny_tokenizer_dir,
    trained_run,
)

from minicpm4_jax.convert.hf_export import write_hf

TOL = 1e-4
NEW_TOKENS = 16
LENGTHS = (23, 64, 100)  # below, at and above original_max_position_embeddings (64)
# (max_position_embeddings above the original makes the LongRoPE attention scaling != 1: exercised)

CASES = {
    # name: (config kwargs, layout, parameter seed)
    "llama_untied_max2x_sharded": (dict(tied=False, max_pos=128, layers=3), "llama", 31),
    "llama_tied_mqa": (dict(tied=True, max_pos=128, heads=4, kv=1), "llama", 32),
    "official_tied_folded_in_test": (dict(tied=True, max_pos=128, scale_emb=12.0, scale_depth=1.4), "minicpm", 33),
    "official_untied_mha_max4x_folded_in_test": (dict(tied=False, max_pos=256, kv=4), "minicpm", 34),
    # the export itself, through its own configuration_minicpm.py / modeling_minicpm.py (auto_map)
    "official_tied_max2x_remote_code": (dict(tied=True, max_pos=128, scale_emb=12.0, scale_depth=1.4), "remote", 35),
    "official_untied_gqa_remote_code": (dict(tied=False, max_pos=64, layers=3), "remote", 36),
}


def _run_case(root: Path, name: str, tok_dir: Path) -> dict:
    from torch_env import run_torch_side

    kwargs, layout, seed = CASES[name]
    cfg = tiny_cfg(**kwargs)
    params = random_params(cfg, seed=seed)
    export = root / name / "export"
    write_hf(params, cfg, export, layout="minicpm" if layout == "remote" else layout, tokenizer_dir=tok_dir,
             max_shard_size="32KB")
    model_dir = export
    if layout == "minicpm":
        from safetensors.numpy import save_file

        tensors, hf_cfg = fold_official_dir_in_test(export)
        model_dir = root / name / "folded"
        model_dir.mkdir()
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        (model_dir / "config.json").write_text(json.dumps(hf_cfg))
    r = np.random.default_rng(7)
    inputs = {f"T{t}": r.integers(0, cfg.vocab_size, (2, t)).astype(np.int64) for t in LENGTHS}
    inputs["prompt"] = r.integers(3, cfg.vocab_size, (1, 9)).astype(np.int64)
    np.savez(root / name / "inputs.npz", **inputs)
    proc = run_torch_side("hf-check", str(model_dir), "--inputs", str(root / name / "inputs.npz"), "--out",
                          str(root / name / "torch.npz"), "--new-tokens", str(NEW_TOKENS),
                          *(["--trust-remote-code", "--save-to", str(root / name / "saved")] if layout == "remote"
                            else []), timeout=600)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    torch_out = dict(np.load(root / name / "torch.npz"))
    errs = {}
    for key in inputs:
        if key == "prompt":
            continue
        ref = jax_logits(cfg, params, inputs[key])
        assert float(np.max(np.abs(ref))) > 0.5
        errs[key] = float(np.max(np.abs(torch_out[f"logits_{key}"] - ref)))
    ours = greedy(cfg, params, [int(x) for x in inputs["prompt"][0]], NEW_TOKENS)
    return {"errs": errs, "greedy_torch": [int(x) for x in torch_out["greedy"]], "greedy_jax": ours,
            "class": info["class"], "cfg": cfg, "padded_batch_ok": bool(torch_out["padded_batch_ok"]),
            "static_cache_ok": bool(torch_out["static_cache_ok"]), "hidden_states": int(torch_out["hidden_states"])}


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_in_stock_transformers(tmp_path, tiny_tokenizer_dir, name):
    res = _run_case(tmp_path, name, tiny_tokenizer_dir)
    print(f"{name}: {res['class']}, max|dlogit| per length {res['errs']}, greedy {res['greedy_jax']}")
    assert res["class"] == ("MiniCPMForCausalLM" if CASES[name][1] == "remote" else "LlamaForCausalLM")
    bad = {k: e for k, e in res["errs"].items() if not e <= TOL}
    assert not bad, f"{name}: transformers vs JAX logits above {TOL}: {bad}"
    assert len(res["greedy_jax"]) == NEW_TOKENS
    assert res["greedy_torch"] == res["greedy_jax"], "greedy continuations differ"
    assert res["padded_batch_ok"], "a left-padded batch generated other tokens than each row alone"
    # break test 64: the remote-code model refused transformers' 4-D mask of a static cache, and dropped
    # output_hidden_states
    assert res["static_cache_ok"], "a static cache generated other tokens than the dynamic one"
    assert res["hidden_states"] == res["cfg"].num_hidden_layers + 1
    if CASES[name][1] == "remote":
        # break test 64: transformers 5's save_pretrained wrote LongRoPE only as rope_parameters, and `import hf` of
        # the saved folder dropped it silently (logits 0.24 off); the config class writes rope_scaling beside it
        from minicpm4_jax.convert.hf_import import import_hf

        saved = json.loads((tmp_path / name / "saved" / "config.json").read_text())
        assert saved["rope_scaling"]["rope_type"] == "longrope" and "rope_parameters" in saved
        del saved["rope_scaling"]  # a folder saved without it (before this fix) imports the same
        (tmp_path / name / "saved" / "config.json").write_text(json.dumps(saved))
        import_hf(tmp_path / name / "saved", tmp_path / name / "imp", no_tokenizer=True)
        got = json.loads((tmp_path / name / "imp" / "config.json").read_text())["model"]["rope_scaling"]
        assert got is not None and got["short_factor"] == list(res["cfg"].rope_scaling.short_factor)
        assert got["original_max_position_embeddings"] == res["cfg"].rope_scaling.original_max_position_embeddings


@pytest.mark.torch
@pytest.mark.parametrize("layout", ["llama", "minicpm"])
def test_trained_run_export_is_prompted_after_the_eos_in_transformers(trained_run, tmp_path, layout):
    """A consumer's default path, ``AutoTokenizer.from_pretrained(export)(text)`` then the model, conditions a run
    trained here as it was trained: the ids are ``[eos] + ours`` (before this fix: ``[1] + ours``, a <s> the model
    never saw at a document start) and the logits equal ours for ``[eos] + ids``; the tokenizer, config.json and
    generation_config.json all name the EOS id as BOS."""
    from torch_env import run_torch_side

    from minicpm4_jax.cli import main
    from minicpm4_jax.convert.hf_export import load_export_source
    from minicpm4_jax.tokenizer import load_tokenizer

    out = tmp_path / "export"
    assert main(["export", "hf", "--checkpoint", str(trained_run), "--out", str(out), "--layout", layout]) == 0
    texts = ["def f(x):\n    return x + 1\n", "print(value)", " a leading space"]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    proc = run_torch_side("prompt-logits", str(out), "--texts", str(tmp_path / "texts.json"), "--out",
                          str(tmp_path / "torch.npz"), *(["--trust-remote-code"] if layout == "minicpm" else []),
                          timeout=600)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = load_tokenizer(trained_run / "tokenizer")
    eos = tok.eos_id
    assert (info["tokenizer_bos"], info["config_bos"], info["generation_bos"]) == (eos, eos, eos), info
    src = load_export_source(trained_run)
    torch_out = np.load(tmp_path / "torch.npz")
    for i, text in enumerate(texts):
        ids = [eos] + tok.encode(text)
        assert info["ids"][i] == ids, (text, info["ids"][i])
        ref = jax_logits(src.cfg, src.params, np.asarray([ids], np.int64))
        err = float(np.max(np.abs(torch_out[f"logits_{i}"] - ref)))
        assert err <= TOL, f"{layout}: transformers vs JAX logits after [eos] differ by {err}"


@pytest.mark.torch
def test_hf_check_short_prompt(tmp_path, tiny_tokenizer_dir):
    """``torch_side.py hf-check`` with a 2- or 3-token prompt: its padded-batch check pads ``T - 1`` tokens (it
    padded 3 and generated from an empty tail: transformers' error on a [1, 0] input); 1 token is one line."""
    import subprocess

    from torch_env import TORCH_SIDE, ensure_torch_env, run_torch_side

    cfg = tiny_cfg(tied=True, max_pos=128)
    params = random_params(cfg, seed=41)
    write_hf(params, cfg, tmp_path / "export", layout="llama", tokenizer_dir=tiny_tokenizer_dir)
    r = np.random.default_rng(3)
    for t in (3, 2, 1):
        inputs, out = tmp_path / f"in{t}.npz", tmp_path / f"out{t}.npz"
        prompt = r.integers(3, cfg.vocab_size, (1, t)).astype(np.int64)
        np.savez(inputs, prompt=prompt)
        args = ["hf-check", str(tmp_path / "export"), "--inputs", str(inputs), "--out", str(out), "--new-tokens", "4"]
        if t > 1:
            run_torch_side(*args)
            res = np.load(out)
            assert bool(res["padded_batch_ok"]) and bool(res["static_cache_ok"])
            assert [int(x) for x in res["greedy"]] == greedy(cfg, params, [int(x) for x in prompt[0]], 4)
        else:
            proc = subprocess.run([str(ensure_torch_env()), str(TORCH_SIDE), *args], capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.strip().splitlines()[-1] == (
                f"error: {inputs}: 'prompt' has shape (1, 1); the padded-batch check needs [1, T] with T >= 2 (its "
                "second row is the prompt's tail after pads)")
    # its numeric options are bounded like the other scripts' (minicpm4_jax.argtypes): one line, exit 2
    proc = subprocess.run([str(ensure_torch_env()), str(TORCH_SIDE), "train-bench", "--model-dir", str(tmp_path),
                           "--batch", "0", "--seq", "8"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "error: argument --batch: 0 is out of range: give an integer >= 1"), proc.stderr
