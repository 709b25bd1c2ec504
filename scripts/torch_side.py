"""PyTorch side of the parity tests and the training benchmark (runs under ``.venv-torch/bin/python``).

Python 3.11 + CPU torch 2.13 + transformers; never imports jax. The JAX side writes "Llama-folded"
model directories (``config.json`` + ``model.safetensors``, see ``minicpm4_jax/convert/llama_fold.py``)
and this script loads them into the native ``transformers.LlamaForCausalLM`` (no remote code).

Subcommands:

``logits CASE_DIR [CASE_DIR ...]``
    For each case directory holding ``config.json``, ``model.safetensors`` and ``inputs.npz``
    (int arrays of token ids ``[batch, seq]``, any keys): load the model in float32 on CPU with
    ``attn_implementation="eager"`` (missing or unexpected weights are an error), run each input and
    write ``logits.npz`` (same keys, float32 ``[batch, seq, vocab]``) plus ``torch_info.json``
    (the rotary attention scaling and inverse frequencies transformers computed, versions).
    All cases run in one process so torch is imported once.

``train-bench --model-dir DIR --batch B --seq T [--steps N] [--warmup W] ...``
    Time ``N`` AdamW training steps (after ``W`` untimed warm-up steps) of the Llama in ``DIR``
    (``config.json``; weights from ``model.safetensors`` when present, else random init) on random
    token batches, and print one JSON line: tokens/s, seconds per step, final loss, threads.

``tokenize --tokenizer-dir DIR --texts FILE [--no-sentencepiece]``
    Load ``DIR`` (a saved tokenizer: ``tokenizer.model``/``tokenizer.json``/``tokenizer_config.json``)
    with ``transformers.AutoTokenizer`` both fast and slow, encode each string of the JSON list in
    ``FILE`` without special tokens and as ``tokenizer(text).input_ids`` (the defaults, i.e. with
    BOS/EOS as the folder says), and print one JSON object: ``{"fast": [[ids]...], "slow": [[ids]...],
    "fast_call": [[ids]...], "slow_call": [[ids]...], "fast_decoded": [...], "classes": [...]}``.
    ``--no-sentencepiece``: make the ``sentencepiece`` package unimportable first (transformers
    without it, as on a machine that lacks it).

``hf-check MODEL_DIR --inputs NPZ --out NPZ [--new-tokens N]``
    Load ``MODEL_DIR`` with stock ``transformers.AutoModelForCausalLM.from_pretrained`` (float32,
    CPU, eager attention, ``trust_remote_code=False``; missing/unexpected weights are an error), and
    write to ``--out``: ``logits_<key>`` (float32 ``[batch, seq, vocab]``) for every int array of
    ``--inputs``, and for its ``prompt`` array (``[1, T]``) ``greedy`` = the ``N`` tokens of
    ``generate(do_sample=False)``, ``padded_batch_ok`` (the prompt batched with its tail left-padded by
    ``min(3, T - 1)`` pads generates what each row does alone; ``T >= 2``), ``static_cache_ok`` and
    ``hidden_states``. Prints a JSON line with the model class and versions.

``prompt-logits MODEL_DIR --texts FILE --out NPZ [--trust-remote-code]``
    A consumer's default path from text to logits: ``AutoTokenizer.from_pretrained(MODEL_DIR)`` encodes each
    string of the JSON list in ``FILE`` as ``tokenizer(text)`` (with the special tokens the folder says), and
    ``AutoModelForCausalLM`` (float32, CPU, eager attention) runs those ids; writes ``logits_<i>`` (float32
    ``[1, seq, vocab]``) to ``--out`` and prints a JSON line with the ``ids`` and the BOS id of the tokenizer,
    the model config and the generation config.

``convert-gguf CONVERTER_DIR MODEL_DIR OUTFILE [--outtype f32]``
    Run llama.cpp's own ``convert_hf_to_gguf.py`` (from ``CONVERTER_DIR``, as fetched by
    ``scripts/fetch_llamacpp_converter.sh``; it needs torch) on an official-layout folder.

``eagle-logits --base DIR --base-config FILE --eagle DIR --inputs NPZ --out NPZ``
    Run an EAGLE draft folder the way CPM.cu loads and runs it (``cpmcu/speculative/eagle.py``,
    ``src/model/minicpm4/minicpm4_eagle.cuh``; CPM.cu itself needs CUDA): the checkpoint file by CPM.cu's
    discovery rule (one ``*.safetensors.index.json``, else exactly one ``*.safetensors``/``*.bin``/``*.pt``),
    ``embed_tokens`` skipped, ``fc.weight`` split into its embedding half ``fc1`` (columns ``[:H]``) and hidden
    half ``fc2``, ``input_norm1/2``, ``layers.N.*`` (any other name is an error, as in CPM.cu), and the config
    check CPM.cu asserts (``scale_emb``/``scale_depth``/``dim_model_base`` present in both configs and equal;
    ``--base-config`` is the base model's official ``config.json``). The base model is the μP-folded Llama
    folder ``--base`` in stock ``LlamaForCausalLM``: it gives the final-norm hidden states ``h``, the scaled
    embedding and the (÷ width) head. Draft: ``u = fc1(RMSNorm1(e_{i+1})) + fc2(RMSNorm2(h_i))``, one stock
    ``LlamaDecoderLayer`` with the draft weights and CPM.cu's residual scale
    ``scale_depth/sqrt(L_base + 1)`` on both branches, the base model's rotary table at positions ``i``, no
    final norm, then the base head. Writes ``draft_logits_<key>`` ``[batch, seq-1, vocab]`` per input.

``fr-spec-pt --ids-txt FILE --out FILE.pt``
    Write an FR-Spec ranking (one id per line) as the official ``freq_{V}.pt`` (``torch.save`` of a plain
    list), load it back with ``torch.load(weights_only=True)`` as CPM.cu does, and print JSON (count,
    equality, first ids).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its standard-library-only helper
from minicpm4_jax.argtypes import float_range, int_range  # noqa: E402


def _load_llama(model_dir: Path, *, weights: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if weights:
        model, info = LlamaForCausalLM.from_pretrained(
            str(model_dir),
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
            local_files_only=True,
        )
        problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if problems:
            raise SystemExit(f"error: {model_dir}: weights do not match LlamaForCausalLM: {problems}")
    else:
        config = LlamaConfig.from_pretrained(str(model_dir), local_files_only=True)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).to(torch.float32)
    return model


def cmd_logits(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    for case in args.case_dirs:
        case = Path(case)
        model = _load_llama(case).eval()
        if model.config.tie_word_embeddings:
            raise SystemExit(f"error: {case}: a folded Llama must be untied (tie_word_embeddings false)")
        inputs = np.load(case / "inputs.npz")
        out: dict[str, np.ndarray] = {}
        with torch.no_grad():
            for key in inputs.files:
                ids = torch.from_numpy(np.asarray(inputs[key], dtype=np.int64))
                logits = model(input_ids=ids, use_cache=False).logits
                out[key] = logits.to(torch.float32).numpy()
        np.savez(case / "logits.npz", **out)
        rot = model.model.rotary_emb
        info = {
            "attention_scaling": float(rot.attention_scaling),
            "original_inv_freq": [float(x) for x in rot.original_inv_freq.tolist()],
            "rope_parameters": {k: v for k, v in dict(model.config.rope_parameters or {}).items()
                                if k not in ("short_factor", "long_factor")},
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        (case / "torch_info.json").write_text(json.dumps(info, indent=1))
    return 0


def cmd_train_bench(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    model = _load_llama(model_dir, weights=(model_dir / "model.safetensors").exists()).train()
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)

    def step() -> float:
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    loss = float("nan")
    for _ in range(args.steps):
        loss = step()
    dt = time.perf_counter() - t0
    tokens = args.steps * args.batch * args.seq
    result = {
        "framework": "torch",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "seconds": dt,
        "step_time_s": dt / max(args.steps, 1),
        "tokens_per_s": tokens / dt if dt > 0 else float("inf"),
        "final_loss": loss,
    }
    print(json.dumps(result))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    if args.no_sentencepiece:
        if "transformers" in sys.modules:
            raise SystemExit("--no-sentencepiece: transformers is already imported")
        sys.modules["sentencepiece"] = None  # type: ignore[assignment]  # importlib then finds no such package
    from transformers import AutoTokenizer

    texts = json.loads(Path(args.texts).read_text())
    out: dict = {"classes": []}
    for name, fast in (("fast", True), ("slow", False)):
        tok = AutoTokenizer.from_pretrained(args.tokenizer_dir, use_fast=fast)
        out["classes"].append(type(tok).__name__)
        out[name] = [tok.encode(t, add_special_tokens=False) for t in texts]
        out[f"{name}_call"] = [tok(t).input_ids for t in texts]
        if fast:
            out["fast_decoded"] = [tok.decode(ids) for ids in out[name]]
            out["fast_bos_eos"] = [tok.bos_token_id, tok.eos_token_id]
    print(json.dumps(out))
    return 0


def cmd_hf_check(args: argparse.Namespace) -> int:
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    model, info = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
        local_files_only=True, trust_remote_code=args.trust_remote_code,
    )
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SystemExit(f"error: {args.model_dir}: weights do not match {type(model).__name__}: {problems}")
    model.eval()
    inputs = np.load(args.inputs)
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for key in inputs.files:
            ids = torch.from_numpy(np.asarray(inputs[key], dtype=np.int64))
            out[f"logits_{key}"] = model(input_ids=ids, use_cache=False).logits.to(torch.float32).numpy()
        if "prompt" in inputs.files and args.new_tokens > 0:
            ids = torch.from_numpy(np.asarray(inputs["prompt"], dtype=np.int64))
            if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
                raise SystemExit(f"error: {args.inputs}: 'prompt' has shape {tuple(ids.shape)}; the padded-batch check "
                                 f"needs [1, T] with T >= 2 (its second row is the prompt's tail after pads)")
            pads = min(3, ids.shape[1] - 1)  # a 2- or 3-token prompt keeps a 1-token tail
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            out["greedy"] = gen[0, ids.shape[1]:].numpy()
            # a left-padded batch (the prompt, and its last tokens after `pads` pads) equals each row generated alone
            short = ids[:, pads:]
            alone = model.generate(short, attention_mask=torch.ones_like(short), do_sample=False,
                                   max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   eos_token_id=None, pad_token_id=0)[0, short.shape[1]:]
            batch = torch.cat([ids, torch.cat([torch.zeros_like(ids[:, :pads]), short], 1)])
            mask = torch.ones_like(batch)
            mask[1, :pads] = 0
            both = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
            out["padded_batch_ok"] = np.asarray(bool(torch.equal(both[0], gen[0, ids.shape[1]:])
                                                     and torch.equal(both[1], alone)))
            # the same batch through a static (fixed-length, 4-D masked) cache; hidden states of every layer
            static = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=args.new_tokens,
                                    min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0,
                                    cache_implementation="static")[:, ids.shape[1]:]
            out["static_cache_ok"] = np.asarray(bool(torch.equal(static, both)))
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            out["hidden_states"] = np.asarray(len(hs) if hs is not None else 0)
    np.savez(args.out, **out)
    if args.save_to:
        model.save_pretrained(args.save_to)
    print(json.dumps({"class": type(model).__name__, "torch": torch.__version__,
                      "transformers": transformers.__version__}))
    return 0


def cmd_prompt_logits(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=args.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True, trust_remote_code=args.trust_remote_code)
    model.eval()
    texts = json.loads(Path(args.texts).read_text())
    out: dict[str, np.ndarray] = {}
    ids = []
    with torch.no_grad():
        for i, text in enumerate(texts):
            enc = tok(text, return_tensors="pt")
            ids.append([int(x) for x in enc.input_ids[0]])
            out[f"logits_{i}"] = model(input_ids=enc.input_ids, use_cache=False).logits.to(torch.float32).numpy()
    np.savez(args.out, **out)
    print(json.dumps({"ids": ids, "tokenizer_bos": tok.bos_token_id, "config_bos": model.config.bos_token_id,
                      "generation_bos": model.generation_config.bos_token_id, "class": type(model).__name__}))
    return 0


def _cpmcu_checkpoint_files(path: Path) -> list[Path]:
    """CPM.cu's ``LLM._load_from_ckpt`` file discovery (an index, else exactly one weights file)."""
    for suffix in ("bin.index.json", "safetensors.index.json"):
        found = sorted(path.glob(f"*.{suffix}"))
        if len(found) > 1:
            raise SystemExit(f"error: multiple files with suffix {suffix} in {path} (CPM.cu refuses this)")
        if found:
            return [path / f for f in sorted(set(json.loads(found[0].read_text())["weight_map"].values()))]
    for suffix in ("bin", "safetensors", "pt"):
        found = sorted(path.glob(f"*.{suffix}"))
        if len(found) > 1:
            raise SystemExit(f"error: multiple files with suffix {suffix} in {path} (CPM.cu refuses this)")
        if found:
            return found
    raise SystemExit(f"error: no supported checkpoint file in {path} (CPM.cu needs an index, .bin, .safetensors or .pt)")


def cmd_eagle_logits(args: argparse.Namespace) -> int:
    import math

    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    torch.manual_seed(0)
    eagle_dir, base_dir = Path(args.eagle), Path(args.base)
    base = _load_llama(base_dir).eval()
    bcfg = json.loads(Path(args.base_config).read_text())
    ecfg = json.loads((eagle_dir / "config.json").read_text())
    for attr in ("scale_depth", "dim_model_base", "scale_emb"):  # CPM.cu's assertions
        if (attr in bcfg) != (attr in ecfg):
            raise SystemExit(f"error: {attr} presence mismatch between base and eagle config")
        if attr in bcfg and bcfg[attr] != ecfg[attr]:
            raise SystemExit(f"error: {attr} in base config and eagle config should be the same")
    residual = bcfg["scale_depth"] / math.sqrt(bcfg["num_hidden_layers"] + 1)
    n_layers = int(ecfg.get("num_hidden_layers", 1))
    head_dim = ecfg.get("head_dim", ecfg["hidden_size"] // ecfg["num_attention_heads"])
    hidden = ecfg["hidden_size"]

    weights: dict[str, torch.Tensor] = {}
    for f in _cpmcu_checkpoint_files(eagle_dir):
        ckpt = torch.load(f, map_location="cpu") if f.suffix in (".bin", ".pt") else load_file(str(f))
        for name, p in ckpt.items():  # LLM_with_eagle._load + MiniCPM4EagleImpl::load_to_storage
            if "embed_tokens" in name or name == "token_id_remap":
                continue
            if "fc" in name and name.split(".")[0] == "fc":
                if not name.endswith("weight"):
                    raise SystemExit(f"error: {name}: only an unquantized fc.weight is handled here")
                weights["fc1.weight"] = p[..., : p.shape[-1] // 2].float()
                weights["fc2.weight"] = p[..., p.shape[-1] // 2:].float()
            elif name.startswith(("input_norm1", "input_norm2")) or name.split(".")[0] == "layers":
                weights[name] = p.float()
            else:
                raise SystemExit(f"error: Unsupported name (layer_idx not found): eagle.{name}")

    lcfg = base.config.__class__.from_dict({**base.config.to_dict(), "num_hidden_layers": n_layers,
                                            "head_dim": head_dim})
    lcfg._attn_implementation = "eager"
    layers = []
    for i in range(n_layers):
        layer = LlamaDecoderLayer(lcfg, layer_idx=i).float().eval()
        sd = {k[len(f"layers.{i}."):]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        sd = {k: (v * residual if k in ("self_attn.o_proj.weight", "mlp.down_proj.weight") else v) for k, v in sd.items()}
        missing, unexpected = layer.load_state_dict(sd, strict=False)
        missing = [m for m in missing if "rotary" not in m]
        if missing or unexpected:
            raise SystemExit(f"error: eagle layer {i}: missing {missing}, unexpected {unexpected}")
        layers.append(layer)
    eps = float(ecfg.get("rms_norm_eps", bcfg["rms_norm_eps"]))
    norm1, norm2 = LlamaRMSNorm(hidden, eps=eps), LlamaRMSNorm(hidden, eps=eps)
    norm1.weight.data.copy_(weights["input_norm1.weight"])
    norm2.weight.data.copy_(weights["input_norm2.weight"])

    inputs = np.load(args.inputs)
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for key in inputs.files:
            ids = torch.from_numpy(np.asarray(inputs[key], dtype=np.int64))
            b, t = ids.shape
            h = base.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]  # final-norm output, h_i
            e = base.model.embed_tokens(ids)[:, 1:]  # folded: embed x scale_emb, of x_{i+1}
            u = norm1(e) @ weights["fc1.weight"].T + norm2(h) @ weights["fc2.weight"].T
            pos = torch.arange(t - 1).unsqueeze(0).expand(b, -1)
            cos_sin = base.model.rotary_emb(u, pos)
            mask = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None].expand(b, 1, -1, -1)
            x = u
            for layer in layers:
                r = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
                x = r[0] if isinstance(r, tuple) else r
            out[f"draft_logits_{key}"] = base.lm_head(x).to(torch.float32).numpy()  # folded head: ÷ width inside
    np.savez(args.out, **out)
    print(json.dumps({"residual_scale": residual, "draft_layers": n_layers, "tensors": sorted(weights)}))
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    import subprocess

    script = Path(args.converter_dir) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"error: {script} does not exist; run scripts/fetch_llamacpp_converter.sh")
    proc = subprocess.run([sys.executable, str(script), args.model_dir, "--outfile", args.outfile,
                           "--outtype", args.outtype], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: convert_hf_to_gguf.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    print(json.dumps({"outfile": args.outfile, "log_tail": proc.stderr[-2000:]}))
    return 0


def cmd_fr_spec_pt(args: argparse.Namespace) -> int:
    """Write an FR-Spec ranking (one id per line) as the official ``freq_*.pt`` and load it back like CPM.cu."""
    import torch

    ids = [int(x) for x in Path(args.ids_txt).read_text().split()]
    tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
    torch.save(ids, tmp)  # a plain Python list, as scripts/fr_spec/gen_fr_index.py writes it
    tmp.replace(args.out)
    back = torch.load(args.out, weights_only=True)  # how cpmcu loads it (then as an int32 token_id_remap)
    remap = torch.tensor(back, dtype=torch.int32)
    print(json.dumps({"n": len(back), "equal": back == ids, "head": remap[:8].tolist(), "torch": torch.__version__}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="float32 logits of folded Llama model dirs (one process for all)")
    lg.add_argument("case_dirs", nargs="+", help="directories with config.json, model.safetensors, inputs.npz")
    lg.add_argument("--threads", type=int_range(0), default=0, help="torch intra-op threads (0: torch default)")
    lg.set_defaults(func=cmd_logits)
    tb = sub.add_parser("train-bench", help="time AdamW training steps of a folded Llama; prints JSON")
    tb.add_argument("--model-dir", required=True, help="directory with config.json (+ model.safetensors)")
    tb.add_argument("--batch", type=int_range(1), required=True, help="sequences per step")
    tb.add_argument("--seq", type=int_range(1), required=True, help="tokens per sequence")
    tb.add_argument("--steps", type=int_range(1), default=10, help="timed steps")
    tb.add_argument("--warmup", type=int_range(0), default=2, help="untimed warm-up steps")
    tb.add_argument("--lr", type=float_range(0, lo_open=True), default=1e-3, help="AdamW learning rate")
    tb.add_argument("--threads", type=int_range(0), default=0, help="torch intra-op threads (0: torch default)")
    tb.add_argument("--seed", type=int_range(0), default=0, help="seed of init and random batches")
    tb.add_argument("--grad-checkpointing", action="store_true", help="enable activation checkpointing")
    tb.set_defaults(func=cmd_train_bench)
    tk = sub.add_parser("tokenize", help="encode texts with transformers' AutoTokenizer (fast and slow)")
    tk.add_argument("--tokenizer-dir", required=True, help="a saved tokenizer directory")
    tk.add_argument("--texts", required=True, help="JSON file with a list of strings")
    tk.add_argument("--no-sentencepiece", action="store_true", help="run transformers without the sentencepiece package")
    tk.set_defaults(func=cmd_tokenize)
    hc = sub.add_parser("hf-check", help="AutoModelForCausalLM logits and greedy tokens of an HF folder")
    hc.add_argument("model_dir", help="a Hugging Face model folder")
    hc.add_argument("--save-to", help="also write the loaded model with save_pretrained to this folder")
    hc.add_argument("--trust-remote-code", action="store_true",
                    help="load the folder's own code (auto_map; an official-layout export's modeling_minicpm.py)")
    hc.add_argument("--inputs", required=True, help="npz of int token arrays [batch, seq] (+ 'prompt' [1, T])")
    hc.add_argument("--out", required=True, help="npz to write")
    hc.add_argument("--new-tokens", type=int_range(0), default=16, help="greedy tokens generated after 'prompt'")
    hc.set_defaults(func=cmd_hf_check)
    pl = sub.add_parser("prompt-logits", help="AutoTokenizer(text) ids and AutoModelForCausalLM logits of an HF folder")
    pl.add_argument("model_dir", help="a Hugging Face model folder with its tokenizer files")
    pl.add_argument("--texts", required=True, help="JSON file with a list of strings")
    pl.add_argument("--out", required=True, help="npz to write (logits_<i>)")
    pl.add_argument("--trust-remote-code", action="store_true", help="load the folder's own code (auto_map)")
    pl.set_defaults(func=cmd_prompt_logits)
    cg = sub.add_parser("convert-gguf", help="run llama.cpp's convert_hf_to_gguf.py on an official-layout folder")
    cg.add_argument("converter_dir", help="folder with convert_hf_to_gguf.py, conversion/ and gguf-py/")
    cg.add_argument("model_dir", help="official-layout MiniCPM folder")
    cg.add_argument("outfile", help="the .gguf to write")
    cg.add_argument("--outtype", default="f32", help="f32 | f16 | bf16 | q8_0")
    cg.set_defaults(func=cmd_convert_gguf)
    eg = sub.add_parser("eagle-logits", help="run an EAGLE draft folder as CPM.cu loads it (torch transcription)")
    eg.add_argument("--base", required=True, help="the base model as a μP-folded Llama folder")
    eg.add_argument("--base-config", required=True, help="the base model's official config.json (μP scalars)")
    eg.add_argument("--eagle", required=True, help="the EAGLE draft folder")
    eg.add_argument("--inputs", required=True, help="npz of int token arrays [batch, seq]")
    eg.add_argument("--out", required=True, help="npz to write (draft_logits_<key>)")
    eg.set_defaults(func=cmd_eagle_logits)
    fr = sub.add_parser("fr-spec-pt", help="write an FR-Spec ranking as the official torch-saved freq_*.pt")
    fr.add_argument("--ids-txt", required=True, help="the ranking in the project's plain format (one id per line)")
    fr.add_argument("--out", required=True, help="the .pt file to write")
    fr.set_defaults(func=cmd_fr_spec_pt)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
