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

``tokenize --tokenizer-dir DIR --texts FILE``
    Load ``DIR`` (a saved tokenizer: ``tokenizer.model``/``tokenizer.json``/``tokenizer_config.json``)
    with ``transformers.AutoTokenizer`` both fast and slow, encode each string of the JSON list in
    ``FILE`` without special tokens, and print one JSON object: ``{"fast": [[ids]...], "slow": [[ids]...],
    "fast_decoded": [...], "classes": [...]}``.

``hf-check MODEL_DIR --inputs NPZ --out NPZ [--new-tokens N]``
    Load ``MODEL_DIR`` with stock ``transformers.AutoModelForCausalLM.from_pretrained`` (float32,
    CPU, eager attention, ``trust_remote_code=False``; missing/unexpected weights are an error), and
    write to ``--out``: ``logits_<key>`` (float32 ``[batch, seq, vocab]``) for every int array of
    ``--inputs``, and for its ``prompt`` array (``[1, T]``) ``greedy`` = the ``N`` tokens of
    ``generate(do_sample=False)``. Prints a JSON line with the model class and versions.

``convert-gguf CONVERTER_DIR MODEL_DIR OUTFILE [--outtype f32]``
    Run llama.cpp's own ``convert_hf_to_gguf.py`` (from ``CONVERTER_DIR``, as fetched by
    ``scripts/fetch_llamacpp_converter.sh``; it needs torch) on an official-layout folder.

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
    from transformers import AutoTokenizer

    texts = json.loads(Path(args.texts).read_text())
    out: dict = {"classes": []}
    for name, fast in (("fast", True), ("slow", False)):
        tok = AutoTokenizer.from_pretrained(args.tokenizer_dir, use_fast=fast)
        out["classes"].append(type(tok).__name__)
        out[name] = [tok.encode(t, add_special_tokens=False) for t in texts]
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
        local_files_only=True, trust_remote_code=False,
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
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            out["greedy"] = gen[0, ids.shape[1]:].numpy()
    np.savez(args.out, **out)
    print(json.dumps({"class": type(model).__name__, "torch": torch.__version__,
                      "transformers": transformers.__version__}))
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
    lg.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    lg.set_defaults(func=cmd_logits)
    tb = sub.add_parser("train-bench", help="time AdamW training steps of a folded Llama; prints JSON")
    tb.add_argument("--model-dir", required=True, help="directory with config.json (+ model.safetensors)")
    tb.add_argument("--batch", type=int, required=True, help="sequences per step")
    tb.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    tb.add_argument("--steps", type=int, default=10, help="timed steps")
    tb.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    tb.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    tb.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    tb.add_argument("--seed", type=int, default=0, help="seed of init and random batches")
    tb.add_argument("--grad-checkpointing", action="store_true", help="enable activation checkpointing")
    tb.set_defaults(func=cmd_train_bench)
    tk = sub.add_parser("tokenize", help="encode texts with transformers' AutoTokenizer (fast and slow)")
    tk.add_argument("--tokenizer-dir", required=True, help="a saved tokenizer directory")
    tk.add_argument("--texts", required=True, help="JSON file with a list of strings")
    tk.set_defaults(func=cmd_tokenize)
    hc = sub.add_parser("hf-check", help="AutoModelForCausalLM logits and greedy tokens of an HF folder")
    hc.add_argument("model_dir", help="a Hugging Face model folder loadable without remote code")
    hc.add_argument("--inputs", required=True, help="npz of int token arrays [batch, seq] (+ 'prompt' [1, T])")
    hc.add_argument("--out", required=True, help="npz to write")
    hc.add_argument("--new-tokens", type=int, default=16, help="greedy tokens generated after 'prompt'")
    hc.set_defaults(func=cmd_hf_check)
    cg = sub.add_parser("convert-gguf", help="run llama.cpp's convert_hf_to_gguf.py on an official-layout folder")
    cg.add_argument("converter_dir", help="folder with convert_hf_to_gguf.py, conversion/ and gguf-py/")
    cg.add_argument("model_dir", help="official-layout MiniCPM folder")
    cg.add_argument("outfile", help="the .gguf to write")
    cg.add_argument("--outtype", default="f32", help="f32 | f16 | bf16 | q8_0")
    cg.set_defaults(func=cmd_convert_gguf)
    fr = sub.add_parser("fr-spec-pt", help="write an FR-Spec ranking as the official torch-saved freq_*.pt")
    fr.add_argument("--ids-txt", required=True, help="the ranking in the project's plain format (one id per line)")
    fr.add_argument("--out", required=True, help="the .pt file to write")
    fr.set_defaults(func=cmd_fr_spec_pt)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
