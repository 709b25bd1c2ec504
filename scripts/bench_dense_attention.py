"""Dense causal attention, forward + backward: the materialising reference against the blockwise XLA path.

    .venv/bin/python scripts/bench_dense_attention.py                    # cpu_tiny layout, T = 256 (x16) .. 4096
    .venv/bin/python scripts/bench_dense_attention.py --shape 1,8192,32,2,128 --repeats 2

``dense_attention`` (``attention_impl: xla``, the oracle: ``[batch, heads, T, T]`` float32 scores kept for the
backward) against ``flash_attention`` (``attention_impl: auto``: ``ops/flash_xla.py``, online softmax over key
blocks, fully masked block pairs skipped, its own backward). Per shape: the compiled program's temporaries
(XLA's memory analysis) and the best of ``--repeats`` timed calls of ``value_and_grad`` (q, k, v), the two
programs alternated call by call so that a machine's drift hits both; ratios are reference / blockwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from minicpm4_jax.argtypes import DefaultsHelpFormatter, int_range  # noqa: E402


class _Formatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the module docstring (the epilog) as written."""
from minicpm4_jax.ops.attention_ref import dense_attention  # noqa: E402
from minicpm4_jax.ops.flash_xla import flash_attention  # noqa: E402

DEFAULT_SHAPES = ["16,256,4,2,64", "4,1024,4,2,64", "1,4096,4,2,64", "1,4096,32,2,128"]


def _shape(text: str) -> tuple[int, ...]:
    try:
        b, t, nq, nkv, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: give batch,T,heads,kv_heads,head_dim (e.g. 1,4096,4,2,64)")
    if min(b, t, nq, nkv, d) < 1 or nq % nkv:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: sizes must be >= 1 and heads a multiple of kv_heads")
    return b, t, nq, nkv, d


def bench(shape, repeats: int, block_q: int, block_k: int, dtype) -> dict:
    b, t, nq, nkv, d = shape
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, nq, d), dtype)
    k = jax.random.normal(ks[1], (b, t, nkv, d), dtype)
    v = jax.random.normal(ks[2], (b, t, nkv, d), dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    impls = {
        "reference": lambda q, k, v: dense_attention(q, k, v, q_positions=pos, kv_positions=pos),
        "blockwise": lambda q, k, v: flash_attention(q, k, v, q_positions=pos, kv_positions=pos, block_q=block_q,
                                                     block_k=block_k),
    }
    compiled, res = {}, {}
    for name, fn in impls.items():
        loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        t0 = time.perf_counter()
        compiled[name] = f.lower(q, k, v).compile()
        ma = compiled[name].memory_analysis()
        res[name] = {"compile_s": time.perf_counter() - t0, "times": [],
                     "temp_bytes": None if ma is None else int(ma.temp_size_in_bytes)}
        jax.block_until_ready(compiled[name](q, k, v))  # warm-up
    for _ in range(repeats):
        for name, c in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(c(q, k, v))
            res[name]["times"].append(time.perf_counter() - t0)
    out = {"shape": dict(zip(("batch", "T", "heads", "kv_heads", "head_dim"), shape)), **res}
    out["time_ratio"] = min(res["reference"]["times"]) / min(res["blockwise"]["times"])
    if res["reference"]["temp_bytes"] and res["blockwise"]["temp_bytes"]:
        out["temp_ratio"] = res["reference"]["temp_bytes"] / res["blockwise"]["temp_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=_Formatter, epilog=__doc__)
    p.add_argument("--shape", type=_shape, action="append",
                   help="batch,T,heads,kv_heads,head_dim (repeatable; default: " + " ".join(DEFAULT_SHAPES) + ")")
    p.add_argument("--repeats", type=int_range(1), default=3, help="timed calls per program (best kept; default 3)")
    p.add_argument("--block-q", type=int_range(1), default=64, help="query tokens per block of the blockwise attention")
    p.add_argument("--block-k", type=int_range(1), default=128, help="key tokens per block of the blockwise attention")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of q, k, v")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    shapes = args.shape or [_shape(s) for s in DEFAULT_SHAPES]
    print(f"jax {jax.__version__} ({jax.default_backend()}), {args.dtype}, blocks {args.block_q} x {args.block_k}, "
          f"best of {args.repeats}; forward + backward (q, k, v)", flush=True)
    print(f"{'b,T,heads,kv,d':>18} {'reference ms':>13} {'blockwise ms':>13} {'speed-up':>9} "
          f"{'ref temp MiB':>13} {'blk temp MiB':>13} {'mem ratio':>10}")
    results = []
    for shape in shapes:
        r = bench(shape, args.repeats, args.block_q, args.block_k, getattr(jnp, args.dtype))
        results.append(r)
        mib = lambda x: float("nan") if x is None else x / 2**20  # noqa: E731
        print(f"{','.join(map(str, shape)):>18} {min(r['reference']['times']) * 1e3:13.1f} "
              f"{min(r['blockwise']['times']) * 1e3:13.1f} {r['time_ratio']:8.2f}x "
              f"{mib(r['reference']['temp_bytes']):13.1f} {mib(r['blockwise']['temp_bytes']):13.1f} "
              f"{r.get('temp_ratio', float('nan')):9.1f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(),
                                         "dtype": args.dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
