#!/usr/bin/env python
"""Training throughput: the JAX train step vs the same model trained with PyTorch, one invocation.

Measures tokens/s and MFU of ``minicpm4_jax``'s jitted train step (μP AdamW + WSD, the real
``make_train_step``) for a preset, then the same model folded into transformers'
``LlamaForCausalLM`` (``minicpm4_jax.convert.llama_fold``) trained with ``torch.optim.AdamW`` on
CPU PyTorch (a subprocess in the Python 3.11 ``.venv-torch``, ``scripts/torch_side.py
train-bench``), on the same machine, batch and sequence length, and prints the ratio.
Both sides train on random token batches (the data pipeline is not part of the step).

MFU is measured against a matmul peak measured in the same process (``measure_matmul_peak_flops``),
with ``ModelConfig.flops_per_token`` (6N + attention) as the model FLOPs.

Usage::

    .venv/bin/python scripts/bench_train.py --config configs/cpu_tiny.yaml --steps 10
    .venv/bin/python scripts/bench_train.py --config cpu_tiny --set data.batch_size=8 --no-torch

Record results in ``docs/benchmarks.md`` (date, machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bench_jax(cfg, steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from minicpm4_jax.train.metrics import measure_matmul_peak_flops, mfu
    from minicpm4_jax.train.step import init_train_state, make_train_step

    graphdef, state = init_train_state(cfg, cfg.seed)
    step_fn = make_train_step(cfg, graphdef)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(cfg.seed)
    batches = [rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32) for _ in range(4)]
    t0 = time.perf_counter()
    state, m = step_fn(state, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
        state, m = step_fn(state, batches[i % 4])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = step_fn(state, batches[i % 4])
    jax.block_until_ready(m)
    dt = time.perf_counter() - t0
    tps = steps * b * t / dt
    peak = measure_matmul_peak_flops()
    return {
        "framework": "jax",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "params": cfg.model.num_params(),
        "compile_s": compile_s,
        "step_time_s": dt / steps,
        "tokens_per_s": tps,
        "peak_flops": peak,
        "mfu": mfu(cfg.model, t, tps, peak),
        "final_loss": float(m["loss"]),
    }


def bench_torch(cfg, steps: int, warmup: int, threads: int) -> dict:
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from minicpm4_jax.convert.llama_fold import fold_to_llama
    from minicpm4_jax.train.step import init_model

    subprocess.run(["bash", str(REPO / "scripts" / "bootstrap_torch_env.sh")], check=True, cwd=REPO)
    model = init_model(cfg.model, cfg.seed)
    tensors, hf_cfg = fold_to_llama(nnx.state(model, nnx.Param), cfg.model)
    with tempfile.TemporaryDirectory() as d:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
        Path(d, "config.json").write_text(json.dumps(hf_cfg))
        cmd = [str(REPO / ".venv-torch" / "bin" / "python"), str(REPO / "scripts" / "torch_side.py"), "train-bench",
               "--model-dir", d, "--batch", str(cfg.data.batch_size), "--seq", str(cfg.data.seq_len),
               "--steps", str(steps), "--warmup", str(warmup), "--lr", str(cfg.optimizer.learning_rate),
               "--threads", str(threads), "--seed", str(cfg.seed)]
        if cfg.model.remat != "none":
            cmd.append("--grad-checkpointing")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu_tiny", help="preset name in configs/ or a YAML path")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.metrics import mfu

    cfg = load_config(args.config, args.set)
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}")
    print(f"preset {args.config}: {cfg.model.num_params() / 1e6:.2f}M params, batch {cfg.data.batch_size} x "
          f"{cfg.data.seq_len} tokens, dtype {cfg.model.dtype}, remat {cfg.model.remat}")
    jx = bench_jax(cfg, args.steps, args.warmup)
    print(f"jax   {jx['jax']} ({jx['backend']}): {jx['tokens_per_s']:8.0f} tokens/s  step {jx['step_time_s'] * 1e3:7.1f} ms  "
          f"MFU {100 * jx['mfu']:.1f}% of a measured {jx['peak_flops'] / 1e9:.0f} GFLOP/s matmul peak  "
          f"(compile {jx['compile_s']:.1f} s)")
    results = {"config": args.config, "overrides": args.set, "jax": jx}
    if not args.no_torch:
        th = bench_torch(cfg, args.steps, args.warmup, args.threads)
        th["mfu_vs_jax_peak"] = mfu(cfg.model, cfg.data.seq_len, th["tokens_per_s"], jx["peak_flops"])
        print(f"torch {th['torch']} ({th['threads']} threads): {th['tokens_per_s']:8.0f} tokens/s  "
              f"step {th['step_time_s'] * 1e3:7.1f} ms  MFU {100 * th['mfu_vs_jax_peak']:.1f}% (same peak)")
        ratio = jx["tokens_per_s"] / th["tokens_per_s"]
        print(f"ratio jax/torch tokens/s: {ratio:.2f}x")
        results["torch"] = th
        results["ratio_jax_over_torch"] = ratio
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
