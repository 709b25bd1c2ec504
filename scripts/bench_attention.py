"""Benchmark one InfLLM v2 attention layer against a fair tiled causal dense attention (issue 3).

Layout: MiniCPM4-8B attention (32 query heads, 2 KV heads, head_dim 128), batch 1, random post-RoPE
q/k/v, positions ``0 .. T-1``, CPU. Compared per length:

* **sparse**: the real entry :func:`minicpm4_jax.infllm.attention.infllmv2_attention` with the MiniCPM4.1
  defaults (gen-2, topk 64 + window 2048 -> 96 blocks of 64) and ``dense_len=-1`` (always sparse):
  stage-1 selection + stage-2 block-sparse attention, exactly as the model runs it with
  ``attention_impl: auto`` (``--impl``, default ``auto``: on the CPU in float32 the non-forced picks of
  stage 2 run in the native kernel, :func:`~minicpm4_jax.infllm.attention.native_stage2`; ``xla`` forces the
  references). The native kernel's scratch (a few KiB per thread) is outside XLA's memory analysis.
* **dense**: :func:`causal_flash_attention` below, a query-tiled causal attention in XLA that never
  does upper-triangle work: ``lax.map`` over query tiles, and inside a ``lax.scan`` over key tiles whose
  ``lax.switch`` skips tiles that are fully masked, runs fully visible tiles without a mask and masks only
  diagonal tiles (online softmax, fp32 statistics). Tile sizes (128 queries x 512 keys) were picked by
  measurement on the 2-core CPU.
* **naive**: :func:`minicpm4_jax.ops.attention_ref.dense_attention` ([T, T] scores) - memory from the
  compiled analysis only, never run (256 GiB of temporaries at 32K).

Times are the median of ``--repeats`` runs of the ahead-of-time compiled function (compile excluded).
Peak memory = ``temp + argument + output`` bytes of ``jax.jit(f).lower(...).compile().memory_analysis()``;
the arguments and outputs (q, k, v, the output; in the backward also the cotangent and the three gradients)
are the same for every method, so the working memory of the attention itself is the ``temp`` column,
printed separately with its own ratio.
The attended fraction is (mean visible selected keys per query) / (mean causal keys per query), averaged
over tokens and KV heads. The theoretical speed bound is mean causal keys per query divided by
(mean selected keys per query + stage-1 cost in key equivalents), where stage 1 costs one q.k product
per visible fine and coarse kernel, i.e. (visible fine + visible coarse kernels) / 2 key equivalents
(attention does two products per key: q.k and p.v).

Run (the full default takes roughly 20-30 minutes on 2 cores; it needs ~10 GiB of RAM at 32K)::

    .venv/bin/python scripts/bench_attention.py                       # 4K..32K fwd, fwd+bwd up to 16K
    .venv/bin/python scripts/bench_attention.py --lengths 4096 8192 --bwd-max 8192 --repeats 1
    .venv/bin/python scripts/bench_attention.py --dtype bfloat16 --json out.json

Options: ``--lengths`` (forward lengths), ``--bwd-max`` (forward+backward for lengths up to this),
``--dtype`` (float32 | bfloat16), ``--repeats`` (timed runs per case), ``--attn-q-tile`` / ``--gather-tile`` (stage-2
tiles), ``--json`` (write all numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from minicpm4_jax.argtypes import DefaultsHelpFormatter, int_range
from minicpm4_jax.config import SparseConfig
from minicpm4_jax.infllm.attention import infllmv2_attention
from minicpm4_jax.infllm.select import select_blocks, select_params
from minicpm4_jax.ops.attention_ref import dense_attention
from minicpm4_jax.ops.dispatch import sparse_impl

NQ, NKV, D = 32, 2, 128
GIB = 1024**3


def causal_flash_attention(q, k, v, *, q_positions, kv_positions, q_tile=128, k_tile=512):
    """Causal GQA attention by query tiles x key tiles, skipping fully masked tiles (the fair dense baseline).

    q ``[b, T, nq, d]``, k/v ``[b, S, nkv, d]``; T and S must be multiples of the tiles. Key tile ``j`` is
    skipped for query tile ``i`` when its smallest key position exceeds the tile's largest query position,
    computed without a mask when its largest key position is at most the tile's smallest query position,
    and masked otherwise. Differentiable (each query tile is ``jax.checkpoint``-ed).
    """
    b, t, nq, d = q.shape
    s, nkv = k.shape[1], k.shape[2]
    g = nq // nkv
    tq, tk = min(q_tile, t), min(k_tile, s)
    nqt, nkt = t // tq, s // tk
    assert nqt * tq == t and nkt * tk == s, "lengths must be multiples of the tiles"
    qt = q.reshape(b, nqt, tq, nkv, g, d).transpose(1, 0, 3, 4, 2, 5).reshape(nqt, b, nkv, g * tq, d)
    kt = k.reshape(b, nkt, tk, nkv, d).transpose(1, 0, 3, 2, 4)  # [nkt, b, nkv, tk, d]
    vt = v.reshape(b, nkt, tk, nkv, d).transpose(1, 0, 3, 2, 4)
    qpt = q_positions.astype(jnp.int32).reshape(b, nqt, tq).swapaxes(0, 1)
    kpt = kv_positions.astype(jnp.int32).reshape(b, nkt, tk).swapaxes(0, 1)
    kmin, kmax = kpt.min(axis=(1, 2)), kpt.max(axis=(1, 2))
    scale = d**-0.5

    def q_body(q_i, qp_i):
        qmin, qmax = qp_i.min(), qp_i.max()

        def update(masked, k_j, v_j, kp_j):
            def f(c):
                m, l, acc = c
                sc = jnp.einsum("bkrd,bksd->bkrs", q_i, k_j, preferred_element_type=jnp.float32) * scale
                if masked:
                    ok = kp_j[:, None, :] <= qp_i[:, :, None]  # [b, tq, tk]
                    ok = jnp.broadcast_to(ok[:, None, None], (b, nkv, g, tq, tk)).reshape(b, nkv, g * tq, tk)
                    sc = jnp.where(ok, sc, -jnp.inf)
                mn = jnp.maximum(m, sc.max(-1, keepdims=True))
                ms = jnp.where(jnp.isfinite(mn), mn, 0.0)
                p = jnp.exp(sc - ms)
                corr = jnp.exp(m - ms)
                pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32)
                return mn, l * corr + p.sum(-1, keepdims=True), acc * corr + pv
            return f

        def k_step(carry, xs):
            k_j, v_j, kp_j, kmn, kmx = xs
            branch = jnp.where(kmn > qmax, 0, jnp.where(kmx <= qmin, 1, 2))
            carry = lax.switch(branch, [lambda c: c, update(False, k_j, v_j, kp_j), update(True, k_j, v_j, kp_j)],
                               carry)
            return carry, None

        init = (jnp.full((b, nkv, g * tq, 1), -jnp.inf, jnp.float32), jnp.zeros((b, nkv, g * tq, 1), jnp.float32),
                jnp.zeros((b, nkv, g * tq, d), jnp.float32))
        (_, l, acc), _ = lax.scan(k_step, init, (kt, vt, kpt, kmin, kmax))
        return (acc / jnp.where(l == 0.0, 1.0, l)).astype(q.dtype)

    body = jax.checkpoint(q_body)
    out = lax.map(lambda a: body(*a), (qt, qpt))  # [nqt, b, nkv, g*tq, d]
    return out.reshape(nqt, b, nkv, g, tq, d).transpose(1, 0, 4, 2, 3, 5).reshape(b, t, nq, d)


def _inputs(t, dtype):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (1, t, NQ, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (1, t, NKV, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (1, t, NKV, D), jnp.float32).astype(dtype)
    gout = jax.random.normal(ks[3], (1, t, NQ, D), jnp.float32).astype(dtype)
    return q, k, v, gout


def _peak(compiled) -> tuple[int, int]:
    """(temp + argument + output bytes, temp bytes) of a compiled function."""
    ma = compiled.memory_analysis()
    return int(ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes), int(ma.temp_size_in_bytes)


def _time(compiled, args, repeats) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _fns(t, cfg, attn_q_tile, gather_tile, impl):
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def sparse(q, k, v):
        return infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, attn_q_tile=attn_q_tile,
                                  gather_tile=gather_tile, impl=impl)

    def dense(q, k, v):
        return causal_flash_attention(q, k, v, q_positions=pos, kv_positions=pos)

    def naive(q, k, v):
        return dense_attention(q, k, v, q_positions=pos, kv_positions=pos)

    return dict(sparse=sparse, dense=dense, naive=naive)


def _fwd_bwd(f):
    def g(q, k, v, gout):
        return jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * gout).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    return g


def _attended(t, q, k, cfg):
    """(attended fraction, mean selected keys/query, mean causal keys/query, bound) from the real selection."""
    p = select_params(cfg)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    idx = jax.jit(lambda q, k: select_blocks(q, k, q_positions=pos, params=p).topk_idx)(q, k)
    idx = np.asarray(idx)[0]  # [nkv, T, K]
    tpos = np.arange(t)[None, :, None]
    keys = np.where(idx >= 0, np.clip(tpos - 64 * idx + 1, 0, 64), 0).sum(-1)  # visible selected keys
    causal = np.arange(1, t + 1, dtype=np.float64)
    sel_mean, causal_mean = float(keys.mean()), float(causal.mean())
    fine = np.clip((np.arange(t) + 1 - cfg.kernel_size) // cfg.kernel_stride + 1, 0, None)
    coarse = np.clip((np.arange(t) + 1 - 4 * cfg.kernel_size) // (4 * cfg.kernel_stride) + 1, 0, None)
    stage1 = float((fine + coarse).mean()) / 2
    return sel_mean / causal_mean, sel_mean, causal_mean, causal_mean / (sel_mean + stage1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--lengths", type=int_range(1), nargs="+", default=[4096, 8192, 16384, 32768],
                    help="sequence lengths (tokens) of the forward comparison")
    ap.add_argument("--bwd-max", type=int_range(0), default=16384, help="forward+backward for lengths up to this")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of q, k, v and the layer")
    ap.add_argument("--repeats", type=int_range(1), default=3, help="timed calls per method and length (best kept)")
    ap.add_argument("--attn-q-tile", type=int_range(1), default=64, help="stage-2 query tile (dense forced part)")
    ap.add_argument("--gather-tile", type=int_range(1), default=None,
                    help="stage-2 sub-tile of the gathered top-k part (default: automatic, 2 for this layout)")
    ap.add_argument("--impl", default="auto", choices=["auto", "xla", "native", "pallas"],
                    help="sparse implementation: auto = what attention_impl=auto runs here (ops.dispatch.sparse_impl)")
    ap.add_argument("--json", default=None, help="write the results to this file")
    a = ap.parse_args(argv)
    for t in a.lengths:  # the dense baseline's tiles (causal_flash_attention: 128 queries x 512 keys) must divide T
        if t % min(128, t) or t % min(512, t):
            ap.error(f"--lengths {t}: the dense baseline tiles T by 128 and 512; give a length up to 128, a multiple "
                     f"of 128 up to 512, or a multiple of 512")
    dtype = jnp.dtype(a.dtype)
    impl = sparse_impl("auto", dtype) if a.impl == "auto" else a.impl
    cfg = dataclasses.replace(SparseConfig(), dense_len=-1)  # MiniCPM4.1 defaults, always sparse
    print(f"jax {jax.__version__} {jax.devices()[0].platform}, 8B head layout (32 q / 2 kv heads, d 128), batch 1, "
          f"{a.dtype}, gen2 topk {cfg.topk} + window {cfg.window_size}, sparse impl {impl}, repeats {a.repeats}",
          flush=True)
    results = []
    for mode in ("fwd", "fwd+bwd"):
        lens = [t for t in a.lengths if mode == "fwd" or t <= a.bwd_max]
        if not lens:
            continue
        print(f"\n== {mode} ==")
        print(f"{'T':>6} {'sparse s':>9} {'dense s':>9} {'speedup':>8} {'bound':>6} {'attended':>8} "
              f"{'sparse GiB':>10} {'dense GiB':>9} {'mem ratio':>9} {'sp temp':>8} {'dn temp':>8} {'temp ratio':>10} "
              f"{'naive GiB':>9}", flush=True)
        for t in lens:
            q, k, v, gout = _inputs(t, dtype)
            frac, sel_mean, causal_mean, bound = _attended(t, q, k, cfg)
            fns = _fns(t, cfg, a.attn_q_tile, a.gather_tile, impl)
            args = (q, k, v) if mode == "fwd" else (q, k, v, gout)
            row = dict(mode=mode, T=t, dtype=a.dtype, impl=impl, attended_fraction=frac, selected_keys_per_query=sel_mean,
                       causal_keys_per_query=causal_mean, bound=bound)
            for name in ("sparse", "dense", "naive"):
                f = fns[name] if mode == "fwd" else _fwd_bwd(fns[name])
                t0 = time.perf_counter()
                compiled = jax.jit(f).lower(*args).compile()
                row[f"{name}_compile_s"] = time.perf_counter() - t0
                row[f"{name}_peak_bytes"], row[f"{name}_temp_bytes"] = _peak(compiled)
                if name != "naive":
                    row[f"{name}_s"] = _time(compiled, args, a.repeats)
                del compiled
            row["speedup"] = row["dense_s"] / row["sparse_s"]
            row["mem_ratio"] = row["sparse_peak_bytes"] / row["dense_peak_bytes"]
            row["temp_ratio"] = row["sparse_temp_bytes"] / row["dense_temp_bytes"]
            results.append(row)
            print(f"{t:>6} {row['sparse_s']:>9.2f} {row['dense_s']:>9.2f} {row['speedup']:>7.2f}x {bound:>5.2f}x "
                  f"{frac:>8.3f} {row['sparse_peak_bytes'] / GIB:>10.3f} {row['dense_peak_bytes'] / GIB:>9.3f} "
                  f"{row['mem_ratio']:>9.3f} {row['sparse_temp_bytes'] / GIB:>8.3f} {row['dense_temp_bytes'] / GIB:>8.3f} "
                  f"{row['temp_ratio']:>10.3f} {row['naive_peak_bytes'] / GIB:>9.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
