#!/usr/bin/env python
"""Training throughput: the JAX train step vs the same model trained with PyTorch, one invocation.

Measures tokens/s and MFU of ``minicpm4_jax``'s jitted train step (μP AdamW + WSD, the real
``make_train_step``) for a preset, then the same model folded into transformers'
``LlamaForCausalLM`` (``minicpm4_jax.convert.llama_fold``) trained with ``torch.optim.AdamW`` on
CPU PyTorch (a subprocess in the Python 3.11 ``.venv-torch``, ``scripts/torch_side.py
train-bench``), on the same machine, batch and sequence length, and prints the ratio.
Both sides train on random token batches (the data pipeline is not part of the step).

MFU is measured against a matmul peak measured in the same process (``measure_matmul_peak_flops``),
with ``ModelConfig.flops_per_token`` (6N + attention, the MTP draft head included) as the model FLOPs.

Sharded runs (issue 5), on fake CPU devices (``JAX_NUM_CPU_DEVICES`` is set by the script):

* ``--mesh D,F,T``: the same JAX train step on the single-device mesh and on a ``(data, fsdp,
  tensor)`` mesh of ``D*F*T`` fake CPU devices, one invocation, with the sharded/single ratios of
  step time and MFU (on CPU the fake devices share the host's cores, so this measures the overhead
  of partitioning and collectives, not a speed-up).
* ``--memory-8b``: compile (nothing is allocated) the train step of the ``minicpm4_8b`` preset
  (its sequence length and remat policy) on a 256-device mesh (``--memory-mesh``, default 4,32,2;
  one sequence per ``data*fsdp`` shard unless ``--memory-batch`` says otherwise) and print XLA's
  memory analysis, bytes per device.

Usage::

    .venv/bin/python scripts/bench_train.py --config configs/cpu_tiny.yaml --steps 10
    .venv/bin/python scripts/bench_train.py --config cpu_tiny --set data.batch_size=8 --no-torch
    .venv/bin/python scripts/bench_train.py --config cpu_tiny --no-torch --mesh 2,2,2
    .venv/bin/python scripts/bench_train.py --memory-8b --no-jax

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

from minicpm4_jax.argtypes import DefaultsHelpFormatter, int_range

REPO = Path(__file__).resolve().parent.parent


def _parse_mesh(text: str) -> tuple[int, int, int]:
    sizes = tuple(int(x) for x in text.split(","))
    if len(sizes) != 3 or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--mesh wants three positive sizes D,F,T (data, fsdp, tensor), got {text!r}")
    return sizes  # type: ignore[return-value]


def _mesh_for(cfg, sizes: tuple[int, int, int] | None):
    """``(cfg with mesh sizes, Mesh)`` on the first ``D*F*T`` devices (``None``: the single-device mesh)."""
    import dataclasses
    import math

    import jax

    from minicpm4_jax.config import MeshConfig
    from minicpm4_jax.sharding import make_mesh

    if sizes is None:
        return cfg, make_mesh(cfg.mesh)
    n = math.prod(sizes)
    if jax.device_count() < n:
        raise SystemExit(f"mesh {sizes} needs {n} devices but jax has {jax.device_count()} "
                         f"(JAX_NUM_CPU_DEVICES must be set before jax is imported)")
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(*sizes))
    return cfg, make_mesh(cfg.mesh, jax.devices()[:n])


def bench_jax(cfg, steps: int, warmup: int, mesh_sizes: tuple[int, int, int] | None = None,
              peak: float | None = None) -> dict:
    import jax
    import numpy as np

    from minicpm4_jax.train.metrics import measure_matmul_peak_flops, mfu, peak_devices
    from minicpm4_jax.train.step import init_train_state, make_train_step

    cfg, mesh = _mesh_for(cfg, mesh_sizes)
    graphdef, state = init_train_state(cfg, cfg.seed, mesh)
    step_fn = make_train_step(cfg, graphdef, mesh)
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
    peak = measure_matmul_peak_flops() if peak is None else peak
    return {
        "framework": "jax",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "mesh": list(mesh.devices.shape),
        "devices": int(mesh.devices.size),
        "params": cfg.model.num_params(),
        "compile_s": compile_s,
        "step_time_s": dt / steps,
        "tokens_per_s": tps,
        "peak_flops": peak,
        # against every device's peak (one device's for fake CPU devices, which share the host's cores)
        "mfu": mfu(cfg.model, t, tps, peak * peak_devices(mesh.devices.flat), mtp_depth=cfg.mtp_train_depth,
                   mtp_distill=cfg.mtp_distill > 0),
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


def memory_8b(preset: str, sizes: tuple[int, int, int], batch: int | None, overrides: list[str]) -> dict:
    """Compile (abstract inputs, nothing allocated) the train step of ``preset`` on a ``sizes`` mesh and
    return XLA's memory analysis, bytes per device (plus what the state alone takes per device)."""
    import jax
    import jax.numpy as jnp

    from minicpm4_jax.config import load_config
    from minicpm4_jax.sharding import batch_sharding
    from minicpm4_jax.train.step import _graphdef, abstract_train_state, make_train_step, train_state_shardings

    batch = batch or sizes[0] * sizes[1]
    cfg = load_config(preset, [f"data.batch_size={batch}"] + overrides)
    cfg, mesh = _mesh_for(cfg, sizes)
    sh = train_state_shardings(cfg, mesh)
    # the shardings tree is a prefix of the state (optax's MaskedNode subtrees hold no arrays)
    state = jax.tree.map(lambda s, sub: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub), sh, abstract_train_state(cfg))
    tokens = jax.ShapeDtypeStruct((batch, cfg.data.seq_len + 1), jnp.int32, sharding=batch_sharding(mesh))
    step = make_train_step(cfg, _graphdef(cfg), mesh)
    t0 = time.perf_counter()
    compiled = step.trace(state, tokens).lower().compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    out = {"preset": preset, "overrides": overrides, "mesh": list(sizes), "devices": int(mesh.devices.size),
           "batch": batch, "seq_len": cfg.data.seq_len, "remat": cfg.model.remat, "params": cfg.model.num_params(),
           "compile_s": compile_s, "backend": jax.default_backend(), "jax": jax.__version__}
    for f in ("argument", "output", "alias", "temp", "generated_code"):
        v = getattr(ma, f"{f}_size_in_bytes", None) if ma is not None else None
        out[f"{f}_bytes"] = None if v is None else int(v)
    if ma is not None:
        # arguments are donated (aliased to the outputs): live peak ~ arguments + temporaries
        out["argument_plus_temp_bytes"] = out["argument_bytes"] + out["temp_bytes"]
    return out


def _gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.3f} GiB ({x:,} B)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--config", default="cpu_tiny", help="preset name in configs/ or a YAML path")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument("--steps", type=int_range(1), default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int_range(0), default=2, help="untimed steps after compilation")
    p.add_argument("--threads", type=int_range(0), default=0, help="torch intra-op threads (0: torch default)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--mesh", type=_parse_mesh, metavar="D,F,T",
                   help="also run the JAX step on a (data, fsdp, tensor) mesh of D*F*T fake CPU devices and "
                        "print sharded/single-device ratios")
    p.add_argument("--no-jax", action="store_true", help="skip the JAX throughput run (e.g. with --memory-8b only)")
    p.add_argument("--memory-8b", action="store_true",
                   help="compile the 8B preset's train step on a 256-device mesh and print its memory analysis")
    p.add_argument("--memory-preset", default="minicpm4_8b", help="preset of --memory-8b")
    p.add_argument("--memory-mesh", type=_parse_mesh, default=(4, 32, 2), metavar="D,F,T",
                   help="mesh of --memory-8b (default 4,32,2 = 256 devices)")
    p.add_argument("--memory-batch", type=int_range(1), default=None,
                   help="global batch of --memory-8b (default: one sequence per data*fsdp shard)")
    p.add_argument("--memory-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of the --memory-8b preset")
    args = p.parse_args(argv)
    if args.no_jax and args.mesh:
        p.error("--mesh runs the JAX step on a mesh, which --no-jax skips: drop one of them")
    if args.no_jax and not args.memory_8b:
        p.error("--no-jax skips the JAX run and with it the PyTorch comparison: nothing is measured; add --memory-8b "
                "or drop --no-jax")

    import math

    need = max([1] + ([math.prod(args.mesh)] if args.mesh else []) + ([math.prod(args.memory_mesh)] if args.memory_8b else []))
    if need > 1 and "jax" not in sys.modules:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(max(need, int(os.environ.get("JAX_NUM_CPU_DEVICES", "1") or 1)))
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.metrics import mfu

    cfg = load_config(args.config, args.set)
    compare_torch = not args.no_torch and not args.no_jax
    if compare_torch and cfg.model.mtp:
        # like for like: the folded LlamaForCausalLM has no draft head, so the JAX step trains without it too
        # (with it, cpu_tiny's step took ~1.5x as long: helper 75); --no-torch measures the preset as it is
        cfg = load_config(args.config, list(args.set) + ["model.mtp=false"])
        print("# model.mtp=false on the JAX side: the PyTorch model has no draft head (--no-torch keeps the preset's)")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}")
    results: dict = {"config": args.config, "overrides": args.set}
    if not args.no_jax:
        print(f"preset {args.config}: {cfg.model.num_params() / 1e6:.2f}M params, batch {cfg.data.batch_size} x "
              f"{cfg.data.seq_len} tokens, dtype {cfg.model.dtype}, remat {cfg.model.remat}")
        jx = bench_jax(cfg, args.steps, args.warmup)
        print(f"jax   {jx['jax']} ({jx['backend']}): {jx['tokens_per_s']:8.0f} tokens/s  step {jx['step_time_s'] * 1e3:7.1f} ms  "
              f"MFU {100 * jx['mfu']:.1f}% of a measured {jx['peak_flops'] / 1e9:.0f} GFLOP/s matmul peak  "
              f"(compile {jx['compile_s']:.1f} s)")
        results["jax"] = jx
        if args.mesh:
            sh = bench_jax(cfg, args.steps, args.warmup, args.mesh, peak=jx["peak_flops"])
            print(f"jax on mesh (data, fsdp, tensor)={tuple(args.mesh)} ({sh['devices']} fake CPU devices): "
                  f"{sh['tokens_per_s']:8.0f} tokens/s  step {sh['step_time_s'] * 1e3:7.1f} ms  MFU {100 * sh['mfu']:.1f}% "
                  f"(same peak; compile {sh['compile_s']:.1f} s)")
            ratios = {"step_time_sharded_over_single": sh["step_time_s"] / jx["step_time_s"],
                      "mfu_sharded_over_single": sh["mfu"] / jx["mfu"],
                      "final_loss_diff": abs(sh["final_loss"] - jx["final_loss"])}
            print(f"ratio sharded/single: step time {ratios['step_time_sharded_over_single']:.2f}x, "
                  f"MFU {ratios['mfu_sharded_over_single']:.2f}x (final loss differs by {ratios['final_loss_diff']:.2e})")
            results["jax_mesh"] = sh
            results["mesh_ratios"] = ratios
    if args.memory_8b:
        mem = memory_8b(args.memory_preset, tuple(args.memory_mesh), args.memory_batch, args.memory_set)
        print(f"memory analysis, {mem['preset']} train step ({mem['params'] / 1e9:.2f}B params, seq {mem['seq_len']}, "
              f"remat {mem['remat']}, global batch {mem['batch']}) on mesh {tuple(mem['mesh'])} = {mem['devices']} "
              f"{mem['backend']} devices (compile {mem['compile_s']:.0f} s), per device:")
        for f in ("argument", "output", "alias", "temp", "generated_code", "argument_plus_temp"):
            print(f"  {f:20s} {_gib(mem.get(f + '_bytes'))}")
        results["memory_8b"] = mem
    if compare_torch:
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
    from minicpm4_jax.config import ConfigError

    try:
        sys.exit(main())
    except ConfigError as e:  # a bad preset, override or run: one line, no traceback
        sys.exit(f"error: {e}")
