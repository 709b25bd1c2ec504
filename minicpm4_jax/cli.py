"""The ``minicpm4`` command line: ``train``, ``generate``, ``import hf``, ``export hf|gguf|eagle``, ``eval``.

Errors in the user's input (:class:`~minicpm4_jax.config.ConfigError`) print ``error: <message>``
on stderr and exit with status 2, without a traceback. A diverged run or a failed checkpoint write
(e.g. disk full) prints one ``error: <message>`` line and exits with status 1; a run
stopped by SIGTERM/SIGINT (after saving a checkpoint) exits with ``128 + signal number``.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

def _train_epilog() -> str:
    """The ``train --help`` epilog: the override syntax and every config section and top-level key, listed from
    :class:`~minicpm4_jax.config.TrainConfig` itself (a hand-kept list missed ``distributed`` and every key added
    later)."""
    import dataclasses
    import textwrap

    from minicpm4_jax.config import TrainConfig

    fields = dataclasses.fields(TrainConfig)
    sections = [f.name for f in fields if dataclasses.is_dataclass(f.default_factory)]
    keys = [f.name for f in fields if f.name not in sections]
    lines = textwrap.wrap(f"sections: {', '.join(sections)} (e.g. qat.enabled=true qat.init_from=runs/cpu_tiny); "
                          f"top-level keys: {', '.join(keys)};", 116)
    return ("overrides are dotted config keys with YAML values, e.g.\n"
            "  minicpm4 train --config cpu_tiny steps=200 optimizer.learning_rate=0.005 data.batch_size=8\n"
            "  minicpm4 train --config configs/cpu_tiny.yaml --resume log_every=5   # continue; logging may change\n"
            + "\n".join(lines) + "\nevery key, its type and default: minicpm4_jax/config.py (one dataclass per "
            "section).\n")


class _Once(argparse.Action):
    """A value option that may be given once: argparse keeps the last of repeated ones without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice; generate continues one prompt per run")
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``minicpm4`` command (``train``, ``generate``, ``import``, ``export``, ``eval``)."""
    p = argparse.ArgumentParser(
        prog="minicpm4",
        description="MiniCPM4 in JAX/Flax NNX: train a model, sample text from a checkpoint, import or export "
                    "checkpoints (Hugging Face, GGUF, EAGLE draft) and evaluate them (RULER, benchmarks).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train a model from a config preset (the main job)",
        description="Train MiniCPM4 from a YAML preset with dotted key=value overrides; writes checkpoints, "
        "TensorBoard logs, the tokenizer and summary.json under out_dir.",
        epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", "-c", metavar="PRESET_OR_PATH", default="cpu_tiny",
                   help="a preset name from configs/ (e.g. cpu_tiny) or a path to a YAML file (default: cpu_tiny)")
    when = t.add_mutually_exclusive_group()
    when.add_argument("--resume", action="store_true",
                      help="continue from the latest checkpoint of the run (train state and data order), bitwise "
                           "identical to an uninterrupted run on the same mesh; the config must match the checkpoint's "
                           "except the keys that change neither the math nor the data order: log_every, eval_every, "
                           "eval_batches, tensorboard, max_train_minutes, sample_*, checkpoint.*, out_dir, "
                           "data.cache_dir, logits_chunk_size, gradient_accumulation_steps, model.remat, "
                           "model.attention_impl, branch_from, branch_step, profile_*, mesh.* and distributed.*")
    when.add_argument("--auto-resume", action="store_true",
                      help="--resume when the run's checkpoint folder holds a complete step, else start the run: one "
                           "command for a job that is requeued after preemption (SLURM --requeue, GKE, Cloud TPU)")
    t.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override (repeatable); same as a positional override")
    t.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. steps=100 model.hidden_size=128 (values parsed as YAML)")

    g = sub.add_parser(
        "generate",
        help="sample text from a trained checkpoint",
        description="Continue a prompt with a trained model (KV cache, chunked prefill, jitted decode steps; "
                    "InfLLM v2 sparse attention when the model is sparse or with --sparse). Streams the text and "
                    "prints tokens/s and the attended fraction at the end (to stderr).",
    )
    g.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a training run's out_dir or its checkpoints folder (the latest step unless --step); the "
                        "tokenizer is read from <out_dir>/tokenizer")
    g.add_argument("--step", type=int, default=None, metavar="N", help="the saved step to load (default: the latest)")
    g.add_argument("--prompt", required=True, metavar="TEXT", action=_Once,
                   help="the text to continue (must not be empty; one prompt per run)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="how many tokens to add (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy, deterministic (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with probability >= P (default 1.0 = all)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep only the K most likely tokens when sampling (default 0 = all)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the continuation contains TEXT (repeatable; the text is cut before it; taken "
                        "literally: in bash write a newline as $'\\n')")
    g.add_argument("--sparse", action=argparse.BooleanOptionalAction, default=None,
                   help="run with InfLLM v2 attention (the model's sparse_config, else the MiniCPM4.1 defaults; "
                        "a sequence shorter than its dense_len, 8192 for those defaults, stays dense) or, with "
                        "--no-sparse, dense attention (default: as the model was trained)")
    g.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prompt tokens per prefill step (a multiple of 16; default 512)")
    g.add_argument("--no-stream", action="store_true", help="print the text only when generation ends")
    g.add_argument("--prefix", choices=("auto", "eos", "bos", "none"), default="auto",
                   help="document-start token before the prompt: auto (default) = the run's own (eos for a run "
                        "trained here, whose documents follow an EOS; bos for an imported official checkpoint)")
    g.add_argument("--spec-decode", action="store_true",
                   help="speculative decoding with the checkpoint's MTP head as the draft (model.mtp=true); greedy "
                        "output is identical, sampling keeps the model's distribution")
    g.add_argument("--num-draft", type=int, default=None, metavar="K",
                   help="tokens drafted per round with --spec-decode (default 3)")
    g.add_argument("--fr-spec-vocab", type=int, default=None, metavar="N",
                   help="FR-Spec: the draft scores only the N most frequent tokens, from <run>/fr_spec/freq_N.txt "
                        "(or .pt; build it with scripts/build_fr_spec.py) or from --fr-spec FILE")
    g.add_argument("--fr-spec", default=None, metavar="FILE",
                   help="an FR-Spec ranking (freq_*.txt of this project or the official freq_*.pt)")
    g.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="the draft layer attends only the last N positions (CPM.cu's spec_window_size; default "
                        "1024, 0 = the whole context)")
    _add_interchange_parsers(sub)
    from minicpm4_jax.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return p


def _add_interchange_parsers(sub: argparse._SubParsersAction) -> None:
    """``minicpm4 import hf`` and ``minicpm4 export hf|gguf|eagle`` (checkpoint interchange, minicpm4_jax/convert/)."""
    imp = sub.add_parser(
        "import", help="import an official MiniCPM4 Hugging Face checkpoint",
        description="Import a checkpoint from another format into a run folder of this project.")
    isub = imp.add_subparsers(dest="source_format", metavar="FORMAT", required=True)
    ih = isub.add_parser(
        "hf", help="an official-layout MiniCPMForCausalLM folder (safetensors, single or sharded)",
        description="Read an official MiniCPM4 Hugging Face folder (config.json with MiniCPMForCausalLM, "
                    "model.safetensors or shards + index, tokenizer files) tensor by tensor and write OUT/checkpoints/0 "
                    "(orbax), OUT/config.json, OUT/tokenizer and minicpm4_manifest.json. Every check (architecture, "
                    "tensor names/shapes, truncated files, tokenizer and vocabulary, OUT, disk space) runs before "
                    "anything is written; every tensor is checked to be finite while it is read; the output appears "
                    "only when complete. Then: minicpm4 generate --checkpoint OUT ...")
    ih.add_argument("dir", metavar="DIR", help="the Hugging Face model folder")
    ih.add_argument("--out", required=True, metavar="OUT",
                    help="output run folder (must be absent or empty, and outside DIR)")
    ih.add_argument("--force", action="store_true", help="replace OUT when it holds an earlier output (a minicpm4_manifest.json listing all its files)")
    ih.add_argument("--no-tokenizer", action="store_true",
                    help="import the weights without a tokenizer (default: DIR must hold tokenizer.model or "
                         "tokenizer.json); recorded in the manifest")
    ih.add_argument("--eagle", default=None, metavar="EAGLE_DIR",
                    help="also import this EAGLE draft folder (e.g. openbmb/MiniCPM4-8B-Eagle-FRSpec, or one written "
                         "by `minicpm4 export eagle`) as the model's MTP module, for generate --spec-decode")
    ih.add_argument("--sparse-variant", choices=("gen1", "gen2"), default=None,
                    help="the InfLLM v2 generation of config.json's sparse_config, which official folders do not "
                         "name: gen1 (MiniCPM4-8B, June 2025) or gen2 (MiniCPM4.1; the default, with a warning, "
                         "when config.json names none)")

    exp = sub.add_parser(
        "export", help="export a trained checkpoint to Hugging Face, GGUF or an EAGLE draft folder",
        description="Export a checkpoint (a run's out_dir or its checkpoints folder) to another runtime's format.")
    esub = exp.add_subparsers(dest="target_format", metavar="FORMAT", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--checkpoint", required=True, metavar="DIR",
                       help="a training run's out_dir (or an import's OUT) or its checkpoints folder")
        q.add_argument("--out", required=True, metavar="OUT",
                       help="output folder (must be absent or empty, and outside the run, checkpoints and tokenizer "
                            "folders being read)")
        q.add_argument("--step", type=int, default=None, metavar="N", help="checkpoint step (default: the latest)")
        q.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="tokenizer folder (default: <out_dir>/tokenizer next to the checkpoint)")
        q.add_argument("--force", action="store_true", help="replace OUT when it holds an earlier output (a minicpm4_manifest.json listing all its files)")
        q.add_argument("--allow-dense", action="store_true",
                       help="export a sparse (InfLLM v2) model to a dense-only format anyway (--layout llama, GGUF): "
                            "sparse_config is dropped and the output runs dense attention; recorded in the manifest "
                            "(default: refused)")

    eh = esub.add_parser(
        "hf", help="a Hugging Face folder (official MiniCPM layout or a μP-folded Llama)",
        description="Write a Hugging Face model folder. --layout minicpm: the official MiniCPMForCausalLM layout "
                    "(μP scalars, LongRoPE and sparse_config in config.json, unfolded weights; for CPM.cu, llama.cpp's "
                    "converter, GPTQModel). --layout llama: a plain LlamaForCausalLM with the μP scalars folded into the "
                    "weights, loadable by stock transformers / vLLM without remote code; dense attention only (a "
                    "sparse model needs --allow-dense). Sharded "
                    "safetensors with an index, tokenizer files, generation_config.json and minicpm4_manifest.json. "
                    "A ternary (QAT) checkpoint is written fake-quantized, each weight q*scale (the BitCPM4 release "
                    "convention; --dtype bfloat16 as released). "
                    "The MTP draft head is not part of this folder: write it with `minicpm4 export eagle`.")
    common(eh)
    eh.add_argument("--layout", default="minicpm", metavar="{minicpm,llama}",
                    help="minicpm (official, default) or llama (μP folded)")
    eh.add_argument("--dtype", default="float32", metavar="{float32,bfloat16,float16}",
                    help="stored dtype (default float32, lossless; bfloat16 as the official release)")
    eh.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest safetensors shard, e.g. 5GB, 500MB (default 5GB; one shard is model.safetensors)")
    eh.add_argument("--no-tokenizer", action="store_true",
                    help="export the weights and config without a tokenizer (default: a tokenizer is required); "
                         "recorded in the manifest")
    eg = esub.add_parser(
        "gguf", help="a llama.cpp GGUF (arch minicpm; F32/F16/BF16/Q8_0, ternary TQ1_0/TQ2_0)",
        description="Write OUT/minicpm4-<outtype>.gguf (llama.cpp architecture 'minicpm': the three scale keys, "
                    "LongRoPE factor tensors, q/k rows permuted for ggml's rope, the SentencePiece vocabulary) and "
                    "minicpm4_manifest.json into the folder OUT. Dense attention only (a sparse model needs "
                    "--allow-dense). The vocabulary needs the tokenizer's tokenizer.model. tq1_0/tq2_0: a ternary "
                    "(QAT) model with per-tensor or per-row scales and rows that are multiples of 256; anything "
                    "they cannot hold exactly is refused, naming the tensor.")
    common(eg)
    eg.add_argument("--outtype", default="f16", metavar="{f32,f16,bf16,q8_0,tq1_0,tq2_0}",
                    help="tensor type of the weight matrices (norms and rope factors stay f32; with tq1_0/tq2_0 "
                         "the embedding and head stay f16; default f16)")
    ee = esub.add_parser(
        "eagle", help="the MTP module as an EAGLE draft folder (CPM.cu --draft-model-path)",
        description="Write the checkpoint's MTP module as a MiniCPM4 EAGLE-1 draft folder, laid out like "
                    "openbmb/MiniCPM4-8B-Eagle-FRSpec: config.json (the base model's μP scalars, num_hidden_layers 1, "
                    "head_dim) and model.safetensors with fc.weight [H, 2H] (embedding half first), input_norm1/2 and "
                    "layers.0.*; embed_tokens and lm_head are shared with the base model (export it with "
                    "`minicpm4 export hf --layout minicpm`). Pair it with an FR-Spec file from "
                    "scripts/build_fr_spec.py for CPM.cu's --frspec-path.")
    ee.add_argument("--checkpoint", required=True, metavar="DIR",
                    help="a training run's out_dir (trained with model.mtp=true) or its checkpoints folder")
    ee.add_argument("--out", required=True, metavar="OUT", help="output folder (absent or empty, outside the run)")
    ee.add_argument("--step", type=int, default=None, metavar="N", help="checkpoint step (default: the latest)")
    ee.add_argument("--force", action="store_true", help="replace OUT when it holds an earlier output (a minicpm4_manifest.json listing all its files)")
    ee.add_argument("--dtype", default="float32", metavar="{float32,bfloat16,float16}",
                    help="stored dtype (default float32, lossless; bfloat16 as the official release)")


def _cmd_import(args: argparse.Namespace) -> int:
    from minicpm4_jax.convert.hf_import import import_hf

    res = import_hf(args.dir, args.out, force=args.force, no_tokenizer=args.no_tokenizer,
                    log=lambda m: print(m, file=sys.stderr), eagle=args.eagle,
                    sparse_variant=args.sparse_variant)
    draft = ""
    if args.eagle:
        from minicpm4_jax.convert.eagle import eagle_param_shapes

        n = sum(math.prod(s) for s in eagle_param_shapes(res.cfg).values())
        draft = f" + an EAGLE draft head of {n:,} parameters"
    print(f"imported {args.dir} -> {res.path} ({res.cfg.num_params():,} parameters{draft})")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if args.target_format == "hf":
        from minicpm4_jax.convert.hf_export import export_hf

        res = export_hf(args.checkpoint, args.out, layout=args.layout, dtype=args.dtype, step=args.step,
                        tokenizer=args.tokenizer, force=args.force, max_shard_size=args.max_shard_size, log=log,
                        no_tokenizer=args.no_tokenizer, allow_dense=args.allow_dense)
    elif args.target_format == "eagle":
        from minicpm4_jax.convert.eagle import export_eagle

        res = export_eagle(args.checkpoint, args.out, dtype=args.dtype, step=args.step, force=args.force)
    else:
        from minicpm4_jax.convert.gguf_export import export_gguf

        res = export_gguf(args.checkpoint, args.out, outtype=args.outtype, step=args.step, tokenizer=args.tokenizer,
                          force=args.force, log=log, allow_dense=args.allow_dense)
    print(f"exported {res.manifest['format']} -> {res.path} ({', '.join(res.files[:4])}"
          f"{', ...' if len(res.files) > 4 else ''})")
    return 0


def _drop_orbax_tracebacks() -> None:
    """Drop orbax's background-thread error logs that carry a traceback (a failed checkpoint write
    logs several hundred lines from its worker threads); the failure itself reaches the main thread as
    :class:`~minicpm4_jax.train.checkpoint.CheckpointWriteError` and is printed as one ``error:`` line."""
    import logging

    class _NoOrbaxTracebacks(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.exc_info and "orbax" in (record.pathname or ""))

    logger = logging.getLogger("absl")
    if not any(type(f).__name__ == "_NoOrbaxTracebacks" for f in logger.filters):
        logger.addFilter(_NoOrbaxTracebacks())


def _quiet_abandoned_writes() -> None:
    """After a failed checkpoint write (one ``error:`` line naming the step): orbax's other write tasks of that save
    fail the same way, and asyncio logs each one with a traceback when it is collected at exit ("Task exception was
    never retrieved"; a full disk gave hundreds of lines after the error line). Drop those records."""
    import logging

    class _Abandoned(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("Task exception was never retrieved")

    logging.getLogger("asyncio").addFilter(_Abandoned())


def _cmd_train(args: argparse.Namespace) -> int:
    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.distributed import SecondInterrupt
    from minicpm4_jax.train.loop import CheckpointWriteError, RunFileWriteError, TrainingDiverged, run_training

    cfg = load_config(args.config, list(args.overrides) + list(args.set_overrides))
    _drop_orbax_tracebacks()
    try:
        summary = run_training(cfg, resume="auto" if args.auto_resume else args.resume,
                               progress=not args.no_progress)
    except (TrainingDiverged, CheckpointWriteError, RunFileWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, CheckpointWriteError):
            _quiet_abandoned_writes()
        return 1
    except SecondInterrupt as e:  # Ctrl-C twice, or a signal after the final save: the message names what was saved
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C outside the training loop's handlers (start-up, clean-up): no traceback
        from minicpm4_jax.train.checkpoint import checkpoint_dir_of, holds_checkpoint_steps

        ckpt_dir = checkpoint_dir_of(cfg)
        if holds_checkpoint_steps(ckpt_dir):
            print(f"error: interrupted; no further checkpoint was saved (the complete ones in {ckpt_dir} are intact: "
                  "resume with --resume)", file=sys.stderr)
        else:
            print(f"error: interrupted before the first checkpoint; nothing to resume in {ckpt_dir}: train again "
                  "without --resume", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    if summary.get("stop_reason") == "signal":
        return 128 + int(signal.Signals[summary["signal"]])
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from minicpm4_jax.generate import generate
    from minicpm4_jax.infer.engine import InferenceEngine, NonFiniteLogitsError, without_prefill_quirk
    from minicpm4_jax.config import ConfigError
    from minicpm4_jax.tokenizer import check_tokenizer_vocab, document_start, load_run_tokenizer
    from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference

    _check_utf8("--prompt", args.prompt)
    for stop in args.stop:
        _check_utf8("--stop", stop)
    _check_draft_options(args)
    ckpt_dir = find_checkpoint_dir(args.checkpoint)
    tokenizer = load_run_tokenizer(args.checkpoint, ckpt_dir)  # before the parameters: a bad one fails fast
    # what the run's documents start after: a run trained here saw each after an EOS (the data pipeline joins
    # documents with EOS), an imported official checkpoint after BOS
    start = document_start(args.checkpoint, ckpt_dir, tokenizer) if args.prefix == "auto" else args.prefix
    prefix_id = None if start == "none" else getattr(tokenizer, f"{start}_id", None)
    prefix_id = None if prefix_id is None or prefix_id < 0 else prefix_id
    if args.prefix not in ("auto", "none") and prefix_id is None:
        raise ConfigError(f"--prefix {args.prefix}: the tokenizer has no {start.upper()} token; pass --prefix none "
                          "or another token")
    prefix = [] if prefix_id is None else [prefix_id]
    _cfg, model = load_params_for_inference(ckpt_dir, args.step)
    check_tokenizer_vocab(tokenizer, model.cfg.vocab_size)  # ids past the embedding table
    if args.sparse is not None:
        from minicpm4_jax.infer.engine import with_attention

        model = with_attention(model, "infllmv2" if args.sparse else "dense")
    model, note = without_prefill_quirk(model)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    sc = model.cfg.sparse_config if model.cfg.attention == "infllmv2" else None
    if sc is not None and 0 < sc.dense_len and model.cfg.max_position_embeddings <= sc.dense_len:
        # as `eval` (helper 73): no request this model takes gets past dense_len, so nothing runs sparse
        print(f"warning: sparse attention with dense_len={sc.dense_len} >= max_position_embeddings="
              f"{model.cfg.max_position_embeddings}: a sequence shorter than dense_len runs dense attention, so "
              "every request to this model runs dense (a model with a lower sparse_config.dense_len decodes sparsely)",
              file=sys.stderr)
    engine = InferenceEngine(model, prefill_chunk=args.prefill_chunk)
    speculative = _speculative_decoder(args, model, engine, ckpt_dir, tokenizer)
    stream = None
    shown = [False]  # the prompt is echoed with the first streamed piece: a refused request prints nothing
    if not args.no_stream:
        def stream(piece: str) -> None:
            if not shown[0]:
                print(args.prompt, end="", flush=True)
                shown[0] = True
            print(piece, end="", flush=True)

    try:
        text, out = generate(model, tokenizer, args.prompt, args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, seed=args.seed, prefix_ids=prefix, top_k=args.top_k,
                             stop_strings=args.stop, stream=stream, engine=engine, speculative=speculative,
                             return_output=True)
    except NonFiniteLogitsError:  # main prints "error: non-finite logits for sequence 0 at position ..." (status 2)
        if shown[0]:
            print(flush=True)  # the streamed text left the line open
        raise
    print("" if shown[0] else args.prompt + text, flush=True)
    attn = model.cfg.attention
    if out.decode_steps == 0:  # every token came from the prefill: no decode to measure
        decode = ("no decode steps (the only new token came from the prefill); attention "
                  f"{attn}")
    else:
        decode = (f"decode {out.decode_tokens_per_second:.1f} tokens/s (compilation included: "
                  f"scripts/bench_decode.py measures warm); attention {attn}, "
                  f"attended fraction {out.attended_fraction:.3f}"
                  # the longest cache a step attended, a verify chunk's drafts included (helper 74)
                  + (f" (dense throughout: the sequence stayed below dense_len={sc.dense_len})"
                     if sc is not None and 0 < sc.dense_len and out.prompt_tokens + out.new_tokens
                     + (speculative.k if speculative else 0) <= sc.dense_len else "")
                  + (f"; acceptance length {out.acceptance_length:.2f} (drafts {speculative.k})"
                     if speculative and math.isfinite(out.acceptance_length) else "")
                  + ("; no speculative round ran (every token was decoded one at a time, e.g. too close to "
                     "the model's maximum positions for the drafts)"
                     if speculative and not math.isfinite(out.acceptance_length) else ""))
    print(f"[{out.new_tokens} new tokens ({out.finish_reasons[0]}); prefill {out.prompt_tokens} tokens in "
          f"{out.prefill_seconds:.2f} s; {decode}]", file=sys.stderr)
    return 0


def _check_utf8(flag: str, value: str) -> None:
    """Refuse a command-line text that is not valid UTF-8: Python hands such bytes over as lone surrogates
    (``surrogateescape``), which the tokenizer cannot encode and no decoded text can match."""
    from minicpm4_jax.config import ConfigError

    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code, offset = ord(value[e.start]), len(value[:e.start].encode("utf-8"))
        where = f" (byte 0x{code - 0xDC00:02x} at offset {offset})" if 0xDC80 <= code <= 0xDCFF else ""
        raise ConfigError(f"{flag} is not valid UTF-8 text{where}; give UTF-8 text (check the terminal's or "
                          "the script's encoding)") from None


def _check_draft_options(args: argparse.Namespace) -> None:
    """Refuse draft options given without ``--spec-decode`` (they would be ignored), before anything is loaded."""
    from minicpm4_jax.config import ConfigError

    if args.draft_window is not None and args.draft_window < 0:
        raise ConfigError(f"--draft-window={args.draft_window} must be >= 0 (0 = the whole context)")
    if not args.spec_decode:
        given = [flag for flag, val in (("--num-draft", args.num_draft), ("--fr-spec-vocab", args.fr_spec_vocab),
                                        ("--fr-spec", args.fr_spec), ("--draft-window", args.draft_window))
                 if val is not None]
        if given:
            raise ConfigError(f"{'/'.join(given)} shape{'s' if len(given) == 1 else ''} the draft of --spec-decode; "
                              "add --spec-decode")


def _speculative_decoder(args: argparse.Namespace, model, engine, ckpt_dir, tokenizer=None):
    """The :class:`SpeculativeDecoder` asked for by ``--spec-decode`` (``None`` without it)."""
    from pathlib import Path

    from minicpm4_jax.config import ConfigError

    if not args.spec_decode:
        return None
    if not getattr(model.cfg, "mtp", False):
        raise ConfigError("--spec-decode needs a model trained with its MTP draft head (model.mtp=true); this "
                          "checkpoint has none")
    from minicpm4_jax.infer.spec import SpeculativeDecoder, load_frequency_ranking, run_ranking_file

    ids = None
    vocab = model.cfg.vocab_size
    if args.fr_spec_vocab is not None and not 1 <= args.fr_spec_vocab <= vocab:
        raise ConfigError(f"--fr-spec-vocab={args.fr_spec_vocab} must be in [1, vocab_size={vocab}]")
    if args.fr_spec is not None or args.fr_spec_vocab is not None:
        path = Path(args.fr_spec) if args.fr_spec else None
        if path is None:
            path = run_ranking_file(args.checkpoint, args.fr_spec_vocab)
        # ids of the model's padded rows (at or above the tokenizer's size) are never produced: a file holding
        # them was built for another tokenizer
        limit = getattr(tokenizer, "vocab_size", None) or model.cfg.vocab_size
        ids = load_frequency_ranking(path, min(limit, model.cfg.vocab_size))
        if args.fr_spec_vocab is not None:
            if not 1 <= args.fr_spec_vocab <= len(ids):
                raise ConfigError(f"--fr-spec-vocab={args.fr_spec_vocab} must be in [1, {len(ids)}] for {path}")
            ids = ids[:args.fr_spec_vocab]
    return SpeculativeDecoder(engine, model.mtp, num_draft=3 if args.num_draft is None else args.num_draft,
                              fr_spec_ids=ids,
                              draft_window=1024 if args.draft_window is None else (args.draft_window or None))


class Terminated(KeyboardInterrupt):
    """SIGTERM as an interruption (``signum``) in the commands other than ``train`` (which has its own handlers):
    ``finally`` blocks run (temporary files, sandbox workers) and the command ends with one line."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``minicpm4`` console script; returns the exit status.

    Ctrl-C (or SIGTERM) outside ``train`` ends the command with one ``error: interrupted by ...`` line and status
    128 + the signal number (130 / 143); ``eval bench`` also says which finished tasks its ``--out`` kept.

    Every subcommand first switches on JAX's persistent compilation cache
    (:func:`minicpm4_jax.compilation_cache.configure_compilation_cache`: ``$MINICPM4_JAX_CACHE/xla`` unless
    ``JAX_COMPILATION_CACHE_DIR`` is set; ``MINICPM4_JAX_COMPILATION_CACHE=0`` turns it off)."""
    from minicpm4_jax.config import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come before and after options (``train steps=12 --resume out_dir=x``)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or args.command != "train"]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + list(extra)
    # an empty path would resolve to the current folder (`--eagle ""` read the working directory); `eval` has
    # its own parsers, where an empty optional CHECKPOINT means "none"
    if args.command in ("generate", "import", "export"):
        for name in ("dir", "out", "eagle", "checkpoint", "tokenizer"):
            val = getattr(args, name, None)
            if isinstance(val, str) and not val.strip():
                parser.error(f"{'DIR' if name == 'dir' else '--' + name} is an empty path; give a folder")
    # SIGTERM as Terminated outside train (which has its own handlers), unless a caller embedding main() set one
    own_sigterm = (args.command != "train" and _main_thread()
                   and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if own_sigterm:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        from minicpm4_jax.compilation_cache import configure_compilation_cache

        configure_compilation_cache()  # before anything compiles: a rerun loads the programs (README)
        from minicpm4_jax.ops import native

        native.check_settings()  # a bad MINICPM4_JAX_NATIVE_LINGER_US stops here, not mid-output
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "import":
            return _cmd_import(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "eval":
            from minicpm4_jax.eval.cli import run_eval

            return run_eval(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout went away (`minicpm4 generate ... | head`): end quietly
        _silence_stdout()
        return 128 + int(signal.SIGPIPE)
    except KeyboardInterrupt as e:  # train handles its own; generate / import / export / eval: no traceback
        signum = int(getattr(e, "signum", signal.SIGINT))
        lead = "\n" if args.command == "generate" else ""  # streamed text may have left the line open
        print(f"{lead}error: {args.command} interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        if own_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 2


def _silence_stdout() -> None:
    """Point stdout at ``os.devnull`` after a broken pipe, so that the interpreter's final flush of what is still
    buffered does not print an "Exception ignored ... BrokenPipeError" line (Python's ``signal`` docs)."""
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stdout (tests, an embedding caller)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
