"""GPU check of the InfLLM v2 Pallas kernels (issue 4, "On a GPU"): correctness compiled on the GPU + benchmarks.

Run by ``scripts/gpu_check.sh`` (one part per process, each under its own ``timeout``); usable alone::

    PYTHONPATH=. python3 scripts/gpu_kernel_check.py --part correctness --out DIR
    PYTHONPATH=. python3 scripts/gpu_kernel_check.py --part decode --out DIR [--quick]
    PYTHONPATH=. python3 scripts/gpu_kernel_check.py --part prefill --out DIR [--quick]
    PYTHONPATH=. python3 scripts/gpu_kernel_check.py --part prefill-bwd --out DIR
    PYTHONPATH=. python3 scripts/gpu_kernel_check.py --part summary --out DIR
    .venv/bin/python scripts/gpu_kernel_check.py --cpu-dry-run          # every part, CPU, interpret=True, tiny

Parts (each writes ``DIR/<part>.json`` after every case, so a part killed by its timeout keeps what it measured):

* ``correctness``: the Pallas kernels with ``backend="triton"``, ``interpret=False`` (compiled for the GPU)
  against their XLA references on small shapes: stage 2 (:func:`block_sparse_attention` vs
  :func:`infllmv2_stage2`, forward and the gradients of q, k, v), decode (sparse / dense flash-decoding vs
  ``ops.decode_ref``) and stage-1 scoring (vs ``infllm.select.stage1_scores``). fp32 (run under
  ``jax.default_matmul_precision("highest")`` so that neither side uses TF32): forward <= 1e-5 absolute,
  gradients <= 1e-4 relative to the largest reference gradient; bf16 (reference = fp32 computation on the
  bf16-rounded inputs): forward <= 2e-2, gradients <= 5e-2 relative.
* ``prefill`` / ``prefill-bwd``: one attention layer with the MiniCPM4-8B head layout (32 query heads, 2 KV
  heads, head_dim 128), batch 1, bf16, random q/k/v, positions ``0 .. T-1``, the MiniCPM4.1 selection
  (gen-2, block 64, topk 64 + window 2048 -> 96 blocks per token incl. the forced init block and the 33 local
  blocks; :func:`select_blocks` on the same q/k). Times: dense ``jax.nn.dot_product_attention(is_causal=True)``
  (``implementation="cudnn"``, else XLA where it fits), the sparse stage-2 kernel, the selection (XLA, and the
  Pallas stage 1 when ``select_blocks`` has ``impl=``). Ratios: dense / stage 2 ("kernel") and dense /
  (selection + stage 2) ("end to end"). At the shortest length the stage-2 output is checked against the XLA
  reference (bf16 <= 2e-2).
* ``decode``: one new token per sequence against a KV cache of ``N`` tokens (same layout/selection); sparse =
  stage 1 (+ pooling/top-k) + :func:`sparse_decode_attention_pallas` (also with the XLA selection, and with the
  single-kernel stage 1), the selection alone and the stage-2 kernel alone; dense =
  ``jax.nn.dot_product_attention`` (cuDNN or XLA) and the Pallas :func:`dense_decode_attention_pallas`.
  One timed call runs ``--decode-layers`` layers (default 8, each with its own KV cache, each layer's output
  the next layer's query) unrolled in one jit, like a model's decode step; times are per layer (call time /
  layers, mean of ``iters`` back-to-back calls). A single layer per call measures the host's dispatch time,
  not the GPU: the first H200 run (2026-11-29) timed one-layer dense and stage-2 calls at 0.054-0.107 ms
  whatever the cache length.
* ``env``: ``minicpm4_jax.ops`` imports as the environment stands (with ``PYTHONPATH=.`` and no install the
  pyproject mapping of ``minicpm4_jax.ops`` onto ``ops/`` is missing: reported as a FAIL, then worked around so
  the other parts still run), the model / engine / ops import, nothing imported grain or tensorboardX, backend.
* ``summary``: reads the part files (and the driver's ``steps.tsv``) and writes ``summary.json`` and
  ``summary.txt``.

Timing: ``warmup`` untimed calls after compilation, then ``iters`` timed calls each ended by
``block_until_ready`` (median; :func:`bench_attention._time`). Attended fraction: mean over (KV head, query)
of visible selected keys / causal keys (:func:`attended_keys`); "tile blocks" is the mean per-tile union the
kernel really walks (:func:`build_block_lists` counts; a Triton tile = 4 tokens x 16 heads since 2026-11-29, 8
tokens in the first two H200 runs). Random q/k make
neighbouring tokens' selections uncorrelated (larger tile unions than real text would give).

``--cpu-dry-run``: the same code paths on CPU with ``interpret=True`` and tiny sizes (a small selection
geometry, lengths of a few hundred tokens), to check this script, not the kernels' speed. Nothing here imports
grain or tensorboardX; works on jax 0.11.2 and 0.12.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import os
import platform
import sys
import time
import traceback
import warnings

# the dry run must pin the CPU before jax is imported
if "--cpu-dry-run" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)


def _package_layout() -> bool:
    """True if ``minicpm4_jax.ops`` imports as the environment stands. pyproject maps ``minicpm4_jax.{ops,train,eval,
    configs}`` onto top-level directories, which only an install (editable or not) provides; with ``PYTHONPATH=.``
    alone they are missing, so this script then appends the repository root to ``minicpm4_jax.__path__`` (the
    ``env`` part reports it as a FAIL: the issue asks for imports with ``PYTHONPATH=.``)."""
    import importlib.util

    try:
        if importlib.util.find_spec("minicpm4_jax.ops") is not None:
            return True
    except ModuleNotFoundError:
        pass
    import minicpm4_jax

    minicpm4_jax.__path__.append(_ROOT)
    return False


PLAIN_IMPORT_OK = _package_layout()
from bench_attention import _fwd_bwd, _inputs, _time, causal_flash_attention  # noqa: E402  (shared helpers)

from minicpm4_jax.argtypes import float_range, int_range  # noqa: E402
from minicpm4_jax.config import SparseConfig  # noqa: E402
from minicpm4_jax.infllm.attention import attended_keys, stage2_forced_split  # noqa: E402
from minicpm4_jax.infllm.compress import compress_keys  # noqa: E402
from minicpm4_jax.infllm.select import (pool_block_scores, select_blocks, select_blocks_compressed,  # noqa: E402
                                        select_params, selection_scores, stage1_scores, topk_blocks)
from minicpm4_jax.ops.attention_ref import dense_attention  # noqa: E402
from minicpm4_jax.ops.decode_ref import dense_decode_attention, sparse_decode_attention  # noqa: E402
from minicpm4_jax.ops.flash_xla import flash_attention  # noqa: E402
from minicpm4_jax.ops.infllm_ref import infllmv2_stage2  # noqa: E402
from minicpm4_jax.ops.pallas.block_lists import build_block_lists, max_blocks_bound  # noqa: E402
from minicpm4_jax.ops.pallas.decode import dense_decode_attention_pallas, sparse_decode_attention_pallas  # noqa: E402
from minicpm4_jax.ops.pallas.sparse_attention import block_sparse_attention, default_tokens_per_tile  # noqa: E402
from minicpm4_jax.ops.pallas.stage1 import stage1_scores_pallas  # noqa: E402

PARTS = ("env", "correctness", "decode", "prefill", "prefill-bwd")
BACKEND = "triton"  # the GPU lowering; interpreted on CPU in the dry run
NQ, NKV, D = 32, 2, 128
GOALS = {"prefill": 5.0, "decode": 7.0}  # issue 4 stretch goals at 128K
SELECT_HAS_IMPL = "impl" in inspect.signature(select_blocks).parameters
STAGE1_HAS_SPLIT = "split_chunks" in inspect.signature(stage1_scores_pallas).parameters


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _device_info() -> dict:
    dev = jax.devices()[0]
    try:
        import jaxlib

        jaxlib_v = jaxlib.__version__
    except Exception:  # noqa: BLE001
        jaxlib_v = "?"
    return dict(platform=dev.platform, device_kind=dev.device_kind, device_count=jax.device_count(),
                jax=jax.__version__, jaxlib=jaxlib_v, python=platform.python_version(), host=platform.node())


class Report:
    """One part's results: PASS/FAIL checks, benchmark rows, notes; rewritten to ``<out>/<part>.json`` on every
    change so a killed process leaves what it had."""

    def __init__(self, out_dir: str, part: str, args):
        self.path = os.path.join(out_dir, f"{part.replace('-', '_')}.json")
        self.t0 = time.perf_counter()
        self.data = dict(part=part, started_utc=_now(), finished_utc=None, dry_run=bool(args.cpu_dry_run),
                         quick=bool(args.quick), device=_device_info(), checks=[], bench=[], notes=[],
                         complete=False)
        self.save()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1, default=float)
        os.replace(tmp, self.path)

    def check(self, name: str, ok: bool, detail: str = "", **info):
        status = "PASS" if ok else "FAIL"
        print(f"{status} {name}" + (f"  ({detail})" if detail else ""), flush=True)
        self.data["checks"].append(dict(name=name, status=status, detail=detail, **info))
        self.save()

    def error(self, name: str, exc: BaseException):
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        print(f"FAIL {name}  (exception {msg})", flush=True)
        traceback.print_exc(limit=6)
        self.data["checks"].append(dict(name=name, status="FAIL", detail=f"exception {msg}"))
        self.save()

    def note(self, text: str):
        print(f"NOTE {text}", flush=True)
        self.data["notes"].append(text)
        self.save()

    def row(self, row: dict):
        self.data["bench"].append(row)
        self.save()

    def finish(self) -> int:
        self.data["finished_utc"] = _now()
        self.data["complete"] = True
        self.data["elapsed_s"] = self.elapsed()
        self.save()
        n_fail = sum(c["status"] == "FAIL" for c in self.data["checks"])
        return 1 if n_fail else 0


# ----------------------------------------------------------------------------------------------- helpers
def random_selection(rng, b, nkv, t, k, positions, bs):
    """Valid ``topk_idx`` ``[b, nkv, t, k]``: per live token up to ``k`` distinct causal blocks ascending, -1 padded."""
    positions = np.asarray(positions)
    idx = np.full((b, nkv, t, k), -1, np.int32)
    for bi in range(b):
        for i in range(t):
            p = int(positions[bi, i])
            if p < 0:
                continue
            for h in range(nkv):
                pick = np.sort(rng.choice(p // bs + 1, size=min(k, p // bs + 1), replace=False))
                idx[bi, h, i, :len(pick)] = pick
    return jnp.asarray(idx)


def _fwd_and_grads(fn, q, k, v):
    """``(out, (dq, dk, dv))`` of a fixed projection of the output, one jit."""
    w = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32) * 0.37)

    def loss(q_, k_, v_):
        o = fn(q_, k_, v_)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return jax.block_until_ready((out, grads))


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))) if np.size(a) else 0.0


def _rel(a, r) -> float:
    r = np.asarray(r, np.float32)
    return _max_abs(a, r) / max(float(np.max(np.abs(r))) if r.size else 0.0, 1e-30)


def _precision(dtype):
    """fp32 checks run at "highest" matmul precision (no TF32 on either side); bf16 as configured (production)."""
    return jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()


def _pipelined_ms(fn, args, iters: int) -> float:
    """Mean ms of ``iters`` back-to-back dispatches (one ``block_until_ready`` at the end): for microsecond kernels."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def _median_ms(fn, args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return _time(fn, args, iters) * 1e3


def _compile(fn, args):
    """``(compiled, seconds)`` of ``jax.jit(fn)`` for these args (compile time kept out of the timings)."""
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*args).compile()
    return c, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------- env
def part_env(rep, args):
    """Imports without an install and without grain/tensorboardX; the backend."""
    rep.check("minicpm4_jax.ops imports as the environment stands (GPU machine: PYTHONPATH=. only, no install)",
              PLAIN_IMPORT_OK,
              "" if PLAIN_IMPORT_OK else "ModuleNotFoundError: pyproject maps minicpm4_jax.ops/train/eval/configs onto "
              "top-level dirs; this run appended the repo root to minicpm4_jax.__path__ to continue")
    import importlib

    mods = ["minicpm4_jax.ops.pallas.sparse_attention", "minicpm4_jax.ops.pallas.decode",
            "minicpm4_jax.ops.pallas.stage1",
            "minicpm4_jax.infllm.select", "minicpm4_jax.infllm.attention", "minicpm4_jax.nn.model",
            "minicpm4_jax.infer.engine"]
    failed = []
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{m}: {type(e).__name__}: {e}")
    rep.check("model, infer engine and ops/ import", not failed, "; ".join(failed)[:500])
    bad = sorted(m for m in sys.modules if m.split(".")[0] in ("grain", "tensorboardX"))
    rep.check("nothing imported grain or tensorboardX", not bad, ", ".join(bad[:10]))
    be = jax.default_backend()
    rep.check("jax backend is gpu" + (" (dry run: cpu accepted)" if args.cpu_dry_run else ""),
              args.cpu_dry_run or be == "gpu", f"backend {be}, devices {jax.devices()}")


# ----------------------------------------------------------------------------------------------- correctness
def _stage2_case(rep, name, *, dtype, b, t, s, nkv, g, d, bs, kk, init, win, pad, interp, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, nkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, nkv, d)), jnp.float32)
    qpos = np.tile(np.arange(s - t, s), (b, 1)).astype(np.int32)  # T < S: the last T positions (a decode-like chunk)
    kvp = np.tile(np.arange(s), (b, 1)).astype(np.int32)
    valid = None
    if pad and b > 1:  # second sequence: padding rows and invalid keys past n2
        n2 = s - t + (2 * t) // 3
        qpos[1] = np.where(qpos[1] < n2, qpos[1], -1)
        valid = jnp.asarray(np.stack([np.arange(s) != 5] + [np.arange(s) < n2] * (b - 1)))
    idx = random_selection(rng, b, nkv, t, kk, qpos, bs)
    kw = dict(q_positions=jnp.asarray(qpos), kv_positions=jnp.asarray(kvp), block_size=bs, window_blocks=win,
              init_blocks=init, kv_valid=valid)
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
    with _precision(dtype):
        got = _fwd_and_grads(lambda *a: block_sparse_attention(*a, idx, backend=BACKEND, interpret=interp, **kw),
                             qd, kd, vd)
    with _precision(jnp.float32):  # reference: fp32 on the (rounded) inputs
        want = _fwd_and_grads(lambda *a: infllmv2_stage2(*a, idx, **kw), *(x.astype(jnp.float32) for x in (qd, kd, vd)))
    fwd_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 5e-2)
    fwd = _max_abs(got[0], want[0])
    grads = {f"d{n}": _rel(a, r) for n, a, r in zip("qkv", got[1], want[1])}
    ok = fwd <= fwd_tol and max(grads.values()) <= grad_tol and got[0].dtype == dtype
    ok = ok and bool(np.all(np.isfinite(np.asarray(got[0], np.float32))))
    rep.check(name, ok, f"fwd max|err| {fwd:.2e} <= {fwd_tol:g}; grad rel " +
              ", ".join(f"{n} {e:.2e}" for n, e in grads.items()) + f" <= {grad_tol:g}",
              fwd_err=fwd, fwd_tol=fwd_tol, grad_rel_err=grads, grad_tol=grad_tol)


def _decode_case(rep, name, *, dtype, b, t, nkv, g, d, bs, cap, kk, init, win, width, dense, interp, seed):
    rng = np.random.default_rng(seed)
    shape_q = (b, nkv * g, d) if t is None else (b, t, nkv * g, d)
    q = jnp.asarray(rng.standard_normal(shape_q), jnp.float32).astype(dtype)
    kc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((b, nkv, cap, d)), jnp.float32).astype(dtype)
    tt = 1 if t is None else t
    last = cap - 1 - 7  # not a block boundary
    pos = np.stack([np.arange(last - tt + 1, last + 1)] + [np.full(tt, -1)] * (b - 1)).astype(np.int32)
    if b > 1 and tt > 1:
        pos[1, 1:] = np.arange(40, 40 + tt - 1)  # second sequence: an inactive row, then live tokens
    f32 = [x.astype(jnp.float32) for x in (q, kc, vc)]
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    if dense:
        qp = jnp.asarray(pos[:, 0] if t is None else pos)
        with _precision(dtype):
            out = jax.jit(lambda *a: dense_decode_attention_pallas(*a, q_positions=qp, block_size=bs, backend=BACKEND,
                                                                   interpret=interp))(q, kc, vc)
        with _precision(jnp.float32):
            ref = jax.jit(lambda *a: dense_decode_attention(*a, q_positions=qp))(*f32)
    else:
        idx = random_selection(rng, b, nkv, tt, kk, pos, bs)
        qp = jnp.asarray(pos[:, 0] if t is None else pos)
        idx = idx[:, :, 0] if t is None else idx
        kw = dict(q_positions=qp, block_size=bs, init_blocks=init, window_blocks=win, gather_width=width)
        with _precision(dtype):
            out = jax.jit(lambda *a: sparse_decode_attention_pallas(*a, backend=BACKEND, interpret=interp,
                                                                    **kw))(q, kc, vc, idx)
        with _precision(jnp.float32):
            ref = jax.jit(lambda *a: sparse_decode_attention(*a, **kw))(*f32, idx)
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = _max_abs(o, r)
    bound = float(np.max(np.abs(o - r) - tol * np.abs(r)))  # |err| <= tol + tol * |ref| (the tests' atol=rtol)
    ok = bound <= tol and out.dtype == dtype and out.shape == q.shape and bool(np.all(np.isfinite(o)))
    ok = ok and bool(np.all(o.reshape(b, tt, -1)[pos < 0] == 0))  # inactive rows are zeros
    rep.check(name, ok, f"max|err| {err:.2e} (atol=rtol={tol:g})", err=err, tol=tol)


def _stage1_case(rep, name, *, variant, dtype, g, d, t, n, geometry, interp, seed, b=2, nkv=2):
    score_dtype = "float32" if dtype == jnp.float32 else "bfloat16"
    p = select_params(SparseConfig(variant=variant, **geometry), score_dtype=score_dtype)
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((b, n, nkv, d)), jnp.float32).astype(dtype)
    q = jnp.asarray(rng.standard_normal((b, t, nkv * g, d)), jnp.float32).astype(dtype)
    ck1 = compress_keys(k, p.kernel_size, p.kernel_stride)
    ck2 = compress_keys(k, p.coarse_size, p.coarse_stride) if variant == "gen2" else None
    if t == 1:
        pos = np.array([[n - 1], [n // 2 + 3]], np.int32)[:b]
    else:  # sequence 0 spread from early rows (no visible kernel) to late; sequence 1: tail + padding rows
        rows = [np.arange(t) * (n // t) + 3, np.concatenate([np.arange(n - t + 2, n), [-1, -1]])]
        pos = np.stack(rows[:b]).astype(np.int32)
    kw = dict(q_positions=jnp.asarray(pos), kv_len=jnp.full((b,), n, jnp.int32), params=p)
    with _precision(dtype):
        out = jax.jit(lambda *a: stage1_scores_pallas(*a, backend=BACKEND, interpret=interp, **kw))(q, ck1, ck2)
        ref = jax.jit(lambda *a: stage1_scores(*a, **kw))(q, ck1, ck2)
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    fin = np.isfinite(r)
    err = _max_abs(o[fin], r[fin])
    ok = (out.shape == ref.shape and out.dtype == ref.dtype and not np.isnan(o).any()
          and np.array_equal(np.isposinf(o), np.isposinf(r)) and np.array_equal(o == 0, r == 0)
          and bool(np.all(np.abs(o[fin] - r[fin]) <= tol + tol * np.abs(r[fin]))))
    rep.check(name, ok, f"max|err| {err:.2e} (atol=rtol={tol:g}; +inf/0 patterns equal)", err=err, tol=tol)


_TINY = dict(kernel_size=32, kernel_stride=16, block_size=64, window_size=128, init_blocks=1, dense_len=0)


def _short_input_case(rep, name, *, variant, t, seed, g=8, d=64, nkv=2):
    """field_faults B04 compiled: the whole InfLLM v2 layer with ``impl="pallas"`` on an input shorter than top-k
    blocks (T in 1..129, topk 16) equals dense attention; interpret mode hides out-of-range block reads that a
    compiled kernel makes."""
    from minicpm4_jax.infllm.attention import infllmv2_attention

    cfg = SparseConfig(variant=variant, topk=16, **_TINY)
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.float32) for h in (nkv * g, nkv, nkv))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    with _precision(jnp.float32):
        out = jax.jit(lambda *a: infllmv2_attention(*a, q_positions=pos, kv_positions=pos, sparse_cfg=cfg,
                                                    impl="pallas"))(q, k, v)
        ref = jax.jit(lambda *a: dense_attention(*a, q_positions=pos, kv_positions=pos))(q, k, v)
    o, r = np.asarray(out), np.asarray(ref)
    err = _max_abs(o, r)
    ok = bool(np.all(np.isfinite(o))) and bool(np.all(np.abs(o - r) <= 1e-5 + 1e-5 * np.abs(r)))
    rep.check(name, ok, f"max|err| vs dense {err:.2e} (atol=rtol=1e-5)", err=err)


def _selection_case(rep, name, *, variant, t, seed, g=8, d=64, nkv=2):
    """field_faults B23 across backends: the block selection on this device (Pallas stage 1, XLA pooling and top-k)
    equals the CPU reference's, early rows (no visible kernel, +inf forced scores, ties) included. A differing
    pick counts as a near tie (not a failure) only when the two picked blocks' CPU scores are within 1e-4."""
    p = select_params(SparseConfig(variant=variant, topk=4, **_TINY))
    rng = np.random.default_rng(seed)
    q = np.asarray(rng.standard_normal((1, t, nkv * g, d)), np.float32)
    k = np.asarray(rng.standard_normal((1, t, nkv, d)), np.float32)
    pos = np.arange(t, dtype=np.int32)[None]
    kw = dict(impl="pallas") if SELECT_HAS_IMPL else {}
    with _precision(jnp.float32):
        got = np.asarray(jax.jit(lambda q, k: select_blocks(q, k, q_positions=jnp.asarray(pos), params=p,
                                                            **kw).topk_idx)(q, k))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = jax.jit(lambda q, k: selection_scores(q, k, q_positions=jnp.asarray(pos), params=p))(q, k)
        want, scores = np.asarray(ref["topk_idx"]), np.asarray(ref["block_scores"])
    rows = np.argwhere(np.any(got != want, axis=-1))  # [n, 3]: (batch, kv head, row)
    hard = 0
    for bi, h, row in rows:
        sc = scores[bi, h, row]
        a = sorted(sc[i] for i in set(got[bi, h, row]) - set(want[bi, h, row]) if i >= 0)
        b = sorted(sc[i] for i in set(want[bi, h, row]) - set(got[bi, h, row]) if i >= 0)
        tie = len(a) == len(b) and all(abs(x - y) <= 1e-4 * (1 + abs(y)) or x == y for x, y in zip(a, b))
        hard += not tie
    early = p.coarse_size if variant == "gen2" else p.kernel_size  # rows before the first (coarse) kernel ends
    ok = got.shape == want.shape and hard == 0 and np.array_equal(got[:, :, :early], want[:, :, :early])
    rep.check(name, ok, f"{len(rows)} of {want.shape[1] * t} rows differ, {hard} not near ties (early rows "
              f"< {early} identical)", rows_differing=int(len(rows)), not_ties=int(hard))


def part_correctness(rep, args):
    interp = args.cpu_dry_run
    small = dict(kernel_size=8, kernel_stride=4, block_size=16, window_size=32, topk=4)
    full = dict()  # MiniCPM4.1 defaults (kernels 32/16, coarse 128/64)
    t8 = 136 if interp else 200  # not a multiple of the 64-token block either way
    cases = [
        # stage 2, forward + gradients
        ("stage2 fp32 G8 d64 bs16 padding+kv_valid+init+window",
         lambda: _stage2_case(rep, _n, dtype=jnp.float32, b=2, t=70, s=70, nkv=2, g=8, d=64, bs=16, kk=3, init=1,
                              win=1, pad=True, interp=interp, seed=1)),
        (f"stage2 fp32 G16 d128 bs64 T{t8} (8B group, block 64)",
         lambda: _stage2_case(rep, _n, dtype=jnp.float32, b=1, t=t8, s=t8, nkv=2, g=16, d=128, bs=64, kk=2,
                              init=1, win=2, pad=False, interp=interp, seed=2)),
        ("stage2 fp32 T1 G16 d64 bs32 (decode-like, sparse)",
         lambda: _stage2_case(rep, _n, dtype=jnp.float32, b=1, t=1, s=150, nkv=1, g=16, d=64, bs=32, kk=1, init=0,
                              win=1, pad=False, interp=interp, seed=3)),
        (f"stage2 bf16 G16 d128 bs64 T{t8}",
         lambda: _stage2_case(rep, _n, dtype=jnp.bfloat16, b=1, t=t8, s=t8, nkv=2, g=16, d=128, bs=64, kk=2,
                              init=1, win=2, pad=False, interp=interp, seed=4)),
        ("stage2 bf16 G8 d64 bs16 padding",
         lambda: _stage2_case(rep, _n, dtype=jnp.bfloat16, b=2, t=48, s=64, nkv=2, g=8, d=64, bs=16, kk=2, init=1,
                              win=1, pad=True, interp=interp, seed=5)),
        # decode
        ("decode sparse fp32 single-token G16 d128 bs64 init1 win2",
         lambda: _decode_case(rep, _n, dtype=jnp.float32, b=2, t=None, nkv=2, g=16, d=128, bs=64, cap=640, kk=5,
                              init=1, win=2, width=None, dense=False, interp=interp, seed=6)),
        ("decode sparse fp32 T4 verify G8 d64 bs16 width3",
         lambda: _decode_case(rep, _n, dtype=jnp.float32, b=2, t=4, nkv=2, g=8, d=64, bs=16, cap=176, kk=5, init=0,
                              win=0, width=3, dense=False, interp=interp, seed=7)),
        ("decode dense fp32 T3 G16 d128 bs64",
         lambda: _decode_case(rep, _n, dtype=jnp.float32, b=2, t=3, nkv=2, g=16, d=128, bs=64, cap=512, kk=0, init=0,
                              win=0, width=None, dense=True, interp=interp, seed=8)),
        ("decode sparse bf16 single-token G16 d128 bs64",
         lambda: _decode_case(rep, _n, dtype=jnp.bfloat16, b=2, t=None, nkv=2, g=16, d=128, bs=64, cap=640, kk=5,
                              init=1, win=2, width=None, dense=False, interp=interp, seed=9)),
        ("decode dense bf16 single-token G16 d128 bs64",
         lambda: _decode_case(rep, _n, dtype=jnp.bfloat16, b=1, t=None, nkv=2, g=16, d=128, bs=64, cap=1024, kk=0,
                              init=0, win=0, width=None, dense=True, interp=interp, seed=10)),
        # stage 1
        ("stage1 gen2 fp32 G16 d128 (small geometry)",
         lambda: _stage1_case(rep, _n, variant="gen2", dtype=jnp.float32, g=16, d=128, t=24, n=200, geometry=small,
                              interp=interp, seed=11)),
        ("stage1 gen1 fp32 G8 d64 (small geometry)",
         lambda: _stage1_case(rep, _n, variant="gen1", dtype=jnp.float32, g=8, d=64, t=24, n=200, geometry=small,
                              interp=interp, seed=12)),
        ("stage1 gen2 fp32 decode T1 G16 d128 (default geometry)",
         lambda: _stage1_case(rep, _n, variant="gen2", dtype=jnp.float32, g=16, d=128, t=1,
                              n=1000 if interp else 4000, geometry=full, interp=interp, seed=13)),
        ("stage1 gen2 bf16 G16 d128 (default geometry)",
         lambda: _stage1_case(rep, _n, variant="gen2", dtype=jnp.bfloat16, g=16, d=128, t=16 if interp else 64,
                              n=600 if interp else 4000, geometry=full, interp=interp, seed=14)),
        ("stage2 fp32 G4 d32 bs16 (head_dim 32 gradients)",
         lambda: _stage2_case(rep, _n, dtype=jnp.float32, b=1, t=96, s=96, nkv=2, g=4, d=32, bs=16, kk=3, init=1,
                              win=1, pad=False, interp=interp, seed=15)),
        # the layer end to end, compiled: short inputs (B04) and the selection against the CPU's (B23)
        ("layer pallas gen2 T1/31/65/129 topk 16 = dense",
         lambda: [_short_input_case(rep, f"{_n} [T={t}]", variant="gen2", t=t, seed=16 + t) for t in (1, 31, 65, 129)]),
        ("layer pallas gen1 T65 topk 16 = dense",
         lambda: _short_input_case(rep, _n, variant="gen1", t=65, seed=17)),
        ("selection gen2 T200 = CPU reference", lambda: _selection_case(rep, _n, variant="gen2", t=200, seed=18)),
        ("selection gen1 T200 = CPU reference", lambda: _selection_case(rep, _n, variant="gen1", t=200, seed=19)),
    ]
    if args.quick:  # dry run + quick: one case per kernel family (the script's own test)
        keep = (0, 5, 10) if interp else (0, 1, 3, 5, 8, 10, 13, 15, 17)
        cases = [c for i, c in enumerate(cases) if i in keep]
    for _n, fn in cases:
        if rep.elapsed() > args.deadline_s:
            rep.check(_n, False, "not run: part time budget exhausted")
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            rep.error(_n, e)
        rep.data["checks"][-1]["seconds"] = time.perf_counter() - t0
        rep.save()


# ----------------------------------------------------------------------------------------------- benchmarks
def _bench_cfg(args) -> SparseConfig:
    if args.cpu_dry_run:  # tiny geometry so that a few hundred tokens are sparse (block 16, window 2 blocks, topk 4)
        return SparseConfig(kernel_size=16, kernel_stride=8, block_size=16, window_size=32, topk=4, dense_len=-1)
    return dataclasses.replace(SparseConfig(), dense_len=-1)  # MiniCPM4.1: gen2, block 64, topk 64 + window 2048


def _bench_setup(args):
    """``(selection params, block size, interpret?, dtype)`` shared by the benchmark parts."""
    params = select_params(_bench_cfg(args))
    return params, params.block_size, args.cpu_dry_run, jnp.dtype(args.dtype)


def _dense_fn(impl, causal):
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    return f


def _pick_dense(rep, label, args_, *, causal, grad, t, xla_max, tiled_ok=False):
    """Compile the dense baseline: cuDNN first (GPU), else XLA when ``t <= xla_max``, else (prefill) the tiled causal
    flash attention of ``bench_attention`` in XLA; returns ``(compiled, impl name, compile s)``."""
    impls = ["cudnn", "xla"] if jax.default_backend() == "gpu" else [None]
    if tiled_ok:
        impls.append("xla-tiled")
    last = None
    for impl in impls:
        if impl == "xla" and t > xla_max:
            rep.note(f"{label}: XLA dense skipped at T={t} (materialises [heads, T, T] scores; limit {xla_max})")
            continue
        if impl == "xla-tiled":
            pos = jnp.arange(t, dtype=jnp.int32)[None]
            f = functools.partial(causal_flash_attention, q_positions=pos, kv_positions=pos)
        else:
            f = _dense_fn(impl, causal)
        f = _fwd_bwd(f) if grad else f
        try:
            c, sec = _compile(f, args_)
            jax.block_until_ready(c(*args_))
            return c, impl or "xla(default)", sec
        except Exception as e:  # noqa: BLE001
            last = e
            rep.note(f"{label}: dense implementation={impl!r} unavailable: {type(e).__name__}: {str(e)[:300]}")
    return None, f"none ({type(last).__name__ if last else 'skipped'})", 0.0


def _selection_stats(idx, pos, bs, t, g, init, window, tq=None):
    """Attended fraction (mean per-query ratio and ratio of means) and the kernel's per-tile union size (tiles of
    ``tq`` tokens, default the kernel's)."""
    keys = np.asarray(attended_keys(idx, pos, block_size=bs), np.float64)[0]  # [nkv, T]
    causal = np.arange(1, t + 1, dtype=np.float64)
    nb = -(-t // bs)
    tq = default_tokens_per_tile(t, g, BACKEND) if tq is None else tq
    m = max_blocks_bound(tq, idx.shape[-1], nb, init_blocks=init, window_blocks=window)
    lists = jax.jit(lambda i, p: build_block_lists(i, p, block_size=bs, num_blocks=nb, tokens_per_tile=tq,
                                                   init_blocks=init, window_blocks=window, max_blocks=m))(idx, pos)
    counts = np.asarray(lists.counts, np.float64)
    tiles = np.arange(counts.shape[-1])
    causal_blocks = np.minimum(((tiles + 1) * tq - 1) // bs + 1, nb)  # blocks up to the tile's last token
    return dict(attended_fraction=float(np.mean(keys / causal)), selected_keys_per_query=float(keys.mean()),
                causal_keys_per_query=float(causal.mean()),
                attended_fraction_of_means=float(keys.mean() / causal.mean()),
                tokens_per_tile=tq, tile_blocks_mean=float(counts.mean()), tile_blocks_max=int(counts.max()),
                kernel_block_fraction=float(counts.sum() / (causal_blocks.sum() * counts.shape[0] * counts.shape[1])))


def part_prefill(rep, args, bwd: bool):
    params, bs, interp, dtype = _bench_setup(args)
    g = NQ // NKV
    mode = "fwd+bwd" if bwd else "fwd"
    lengths = args.bwd_lengths if bwd else args.lengths
    sel_iters = max(1, min(3, args.iters))
    print(f"prefill {mode}: 8B layout ({NQ} q / {NKV} kv heads, d {D}), batch 1, {args.dtype}, block {bs}, "
          f"topk_cfg {params.topk_cfg} (init {params.init_blocks} + local {params.local_blocks + 1} forced), "
          f"lengths {lengths}, warmup {args.warmup}, iters {args.iters}", flush=True)
    for i, t in enumerate(lengths):
        label = f"prefill {mode} T={t}"
        if rep.elapsed() > args.deadline_s:
            rep.note(f"{label}: skipped, part time budget ({args.deadline_s:.0f} s) exhausted")
            rep.row(dict(mode=mode, T=t, skipped="time budget"))
            continue
        row = dict(mode=mode, T=t, dtype=args.dtype, block_size=bs, topk_cfg=params.topk_cfg)
        rep.row(row)  # saved again after every measurement (a step killed by its timeout keeps them)
        try:
            q, k, v, gout = _inputs(t, dtype)
            pos = jnp.arange(t, dtype=jnp.int32)[None]
            nb = -(-t // bs)
            k_used = min(params.topk_cfg, nb)
            init, window, width = stage2_forced_split(params, k_used)
            row.update(init_blocks=init, window_blocks=window, gather_width=width)
            sel_tile = 128 if interp else 512

            def select(q, k, impl="xla"):
                kw = dict(impl=impl) if SELECT_HAS_IMPL else {}
                return select_blocks(q, k, q_positions=pos, params=params, q_tile=sel_tile, **kw).topk_idx[..., :k_used]

            c_sel, row["select_xla_compile_s"] = _compile(select, (q, k))
            idx = jax.block_until_ready(c_sel(q, k))
            row.update(_selection_stats(idx, pos, bs, t, g, init, window))
            rep.save()

            def sparse(q, k, v, idx):
                return block_sparse_attention(q, k, v, idx, q_positions=pos, kv_positions=pos, block_size=bs,
                                              window_blocks=window, init_blocks=init, backend=BACKEND, interpret=interp)

            sp = sparse if not bwd else (lambda q, k, v, idx, gout: _fwd_bwd(lambda a, b_, c: sparse(a, b_, c, idx))(
                q, k, v, gout))
            sp_args = (q, k, v, idx) if not bwd else (q, k, v, idx, gout)
            c_sp, row["sparse_compile_s"] = _compile(sp, sp_args)
            out = jax.block_until_ready(c_sp(*sp_args))
            row["sparse_stage2_ms"] = _median_ms(c_sp, sp_args, args.warmup, args.iters)
            rep.save()
            if i == 0:  # the kernel on the benchmark's own inputs against the XLA reference
                def ref(q, k, v, idx):
                    return infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_positions=pos, block_size=bs,
                                           window_blocks=window, init_blocks=init, gather_width=width)
                rf = ref if not bwd else (lambda q, k, v, idx, gout: _fwd_bwd(lambda a, b_, c: ref(a, b_, c, idx))(
                    q, k, v, gout))
                want = jax.block_until_ready(jax.jit(rf)(*sp_args))
                if bwd:
                    errs = [_rel(a, r) for a, r in zip(out, want)]
                    tol = 5e-2 if dtype == jnp.bfloat16 else 1e-4
                    rep.check(f"{label}: stage-2 grads vs XLA reference", max(errs) <= tol,
                              "rel " + ", ".join(f"{e:.2e}" for e in errs) + f" <= {tol:g}", errs=errs)
                else:
                    err = _max_abs(out, want)
                    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
                    rep.check(f"{label}: stage-2 output vs XLA reference", err <= tol, f"max|err| {err:.2e} <= {tol:g}",
                              err=err)
                del want
            del out
            dn_args = (q, k, v) if not bwd else (q, k, v, gout)
            c_dn, row["dense_impl"], row["dense_compile_s"] = _pick_dense(rep, label, dn_args, causal=True, grad=bwd,
                                                                         t=t, xla_max=args.xla_dense_max, tiled_ok=True)
            if c_dn is not None:
                row["dense_ms"] = _median_ms(c_dn, dn_args, args.warmup, args.iters)
                row["speedup_kernel"] = row["dense_ms"] / row["sparse_stage2_ms"]
            rep.save()
            del c_dn
            if not bwd:
                row["select_xla_ms"] = _median_ms(c_sel, (q, k), 1, sel_iters)
                rep.save()
                if SELECT_HAS_IMPL:
                    try:
                        c_sp2, row["select_pallas_compile_s"] = _compile(lambda q, k: select(q, k, "pallas"), (q, k))
                        idx_p = jax.block_until_ready(c_sp2(q, k))
                        row["select_pallas_ms"] = _median_ms(c_sp2, (q, k), 1, sel_iters)
                        row["select_pallas_xla_idx_agreement"] = float(np.mean(np.asarray(idx_p) == np.asarray(idx)))
                        del c_sp2, idx_p
                    except Exception as e:  # noqa: BLE001
                        rep.note(f"{label}: Pallas selection failed: {type(e).__name__}: {str(e)[:300]}")
                if "dense_ms" in row:
                    sel_ms = min(row.get("select_xla_ms", np.inf), row.get("select_pallas_ms", np.inf))
                    row["speedup_end_to_end"] = row["dense_ms"] / (sel_ms + row["sparse_stage2_ms"])
            rep.save()
            print(f"{label}: dense[{row['dense_impl']}] {row.get('dense_ms', float('nan')):9.3f} ms | sparse stage2 "
                  f"{row['sparse_stage2_ms']:9.3f} ms | select xla {row.get('select_xla_ms', float('nan')):9.3f} ms "
                  f"pallas {row.get('select_pallas_ms', float('nan')):9.3f} ms | kernel x"
                  f"{row.get('speedup_kernel', float('nan')):.2f} "
                  f"e2e x{row.get('speedup_end_to_end', float('nan')):.2f} | attended {row['attended_fraction']:.4f} "
                  f"tile blocks {row['tile_blocks_mean']:.1f} (kernel fraction {row['kernel_block_fraction']:.4f})",
                  flush=True)
            del q, k, v, gout, idx, c_sp, c_sel
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rep.save()


def _decode_layer_fns(params, pos, *, bs, n, k_used, init, window, width, interp, dense_impl):
    """Per-layer decode functions ``f(q, kc, vc, kt, vt, ck1, ck2) -> [b, NQ, D]`` (or the selection) by name."""
    nb = n // bs

    def select(q, ck1, ck2, impl="pallas", split=None):
        if impl == "xla" or split is None:  # the engine's own call (Pallas: through ops.dispatch, automatic split)
            return select_blocks_compressed(q[:, None], ck1, ck2, q_positions=pos[:, None], params=params,
                                            num_blocks=nb, kv_len=pos + 1, impl=impl).topk_idx[:, :, 0, :k_used]
        kw = dict(split_chunks=split) if STAGE1_HAS_SPLIT else {}
        s = stage1_scores_pallas(q[:, None], ck1, ck2, q_positions=pos[:, None], kv_len=pos + 1, params=params,
                                 backend=BACKEND, interpret=interp, **kw)
        bsc = pool_block_scores(s, q_positions=pos[:, None], num_blocks=nb, params=params)
        return topk_blocks(bsc, q_positions=pos[:, None], params=params).topk_idx[:, :, 0, :k_used]

    def stage2(q, kc, vc, idx):
        return sparse_decode_attention_pallas(q, kc, vc, idx, q_positions=pos, block_size=bs, init_blocks=init,
                                              window_blocks=window, gather_width=width, backend=BACKEND,
                                              interpret=interp)

    fns = {
        "dense": lambda q, kc, vc, kt, vt, ck1, ck2: jax.nn.dot_product_attention(
            q[:, None], kt, vt, implementation=dense_impl)[:, 0],
        "dense_pallas": lambda q, kc, vc, kt, vt, ck1, ck2: dense_decode_attention_pallas(
            q, kc, vc, q_positions=pos, block_size=bs, backend=BACKEND, interpret=interp),
        "sparse_full": lambda q, kc, vc, kt, vt, ck1, ck2: stage2(q, kc, vc, select(q, ck1, ck2)),
        "sparse_xla_select": lambda q, kc, vc, kt, vt, ck1, ck2: stage2(q, kc, vc, select(q, ck1, ck2, "xla")),
    }
    if STAGE1_HAS_SPLIT:
        fns["sparse_nosplit"] = lambda q, kc, vc, kt, vt, ck1, ck2: stage2(q, kc, vc, select(q, ck1, ck2, split=0))
    # the pure-XLA sparse decode (what attention_impl xla/auto runs): XLA selection + ops.decode_ref
    fns["sparse_xla"] = lambda q, kc, vc, kt, vt, ck1, ck2: sparse_decode_attention(
        q, kc, vc, select(q, ck1, ck2, "xla"), q_positions=pos, block_size=bs, init_blocks=init,
        window_blocks=window, gather_width=width)
    return fns, select, stage2


def _chain(fn, n_layers):
    """``L`` layers unrolled in one jit, each layer's output the next layer's query (a decode step's data
    dependence); per-layer arrays are separate arguments (no slicing copies of a stacked cache)."""
    def run(q, kcs, vcs, kts, vts, ck1s, ck2s):
        x = q
        for li in range(n_layers):
            x = fn(x, kcs[li], vcs[li], kts[li], vts[li], ck1s[li], ck2s[li]).astype(q.dtype)
        return x
    return run


def _decode_cases(args) -> list[tuple[int, int]]:
    """``(N, batch)`` decode cases: every length at ``--decode-batch``, and the longest (the goal length) also at
    ``--decode-big-batch``, right after it (batch 1 is latency-bound on a big GPU; a batch shows the bandwidth-bound
    regime the bound describes)."""
    cases = [(n, args.decode_batch) for n in args.decode_lengths]
    big = args.decode_big_batch
    if big and big != args.decode_batch:
        longest = max(args.decode_lengths)
        at = [n for n, _ in cases].index(longest) + 1
        cases.insert(at, (longest, big))
    return cases


def part_decode(rep, args):
    params, bs, interp, dtype = _bench_setup(args)
    n_layers = args.decode_layers
    dense_impl = "cudnn" if jax.default_backend() == "gpu" else None
    cases = _decode_cases(args)
    print(f"decode: 8B layout ({NQ} q / {NKV} kv heads, d {D}), {args.dtype}, one new token per sequence at position "
          f"N-1 of an N-token cache, block {bs}, topk_cfg {params.topk_cfg}, (N, batch) {cases}; "
          f"{n_layers} layers (separate caches) per timed call, unrolled in one jit, mean of {args.decode_iters} "
          f"back-to-back calls; per-layer ms = call ms / {n_layers}", flush=True)
    for i, (n, b) in enumerate(cases):
        label = f"decode N={n}" + (f" batch {b}" if b != 1 else "")
        if rep.elapsed() > args.deadline_s:
            rep.note(f"{label}: skipped, part time budget ({args.deadline_s:.0f} s) exhausted")
            rep.row(dict(mode="decode", N=n, batch=b, skipped="time budget"))
            continue
        row = dict(mode="decode", N=n, batch=b, dtype=args.dtype, block_size=bs, layers=n_layers)
        rep.row(row)  # saved again after every measurement
        try:
            pos = jnp.full((b,), n - 1, jnp.int32)
            nb = n // bs
            k_used = min(params.topk_cfg, nb)
            init, window, width = stage2_forced_split(params, k_used)
            row.update(init_blocks=init, window_blocks=window, gather_width=width)

            @jax.jit
            def make_layer(key):  # generated on the device in the benchmark dtype (no fp32 copy of the cache)
                ks = jax.random.split(key, 2)
                kc = jax.random.normal(ks[0], (b, NKV, n, D), dtype)
                vc = jax.random.normal(ks[1], (b, NKV, n, D), dtype)
                kt, vt = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)  # [b, N, kv, d] for cuDNN
                return (kc, vc, kt, vt, compress_keys(kt, params.kernel_size, params.kernel_stride),
                        compress_keys(kt, params.coarse_size, params.coarse_stride))

            layers = [make_layer(jax.random.PRNGKey(1000 * n + li)) for li in range(n_layers)]
            stacked = tuple([lay[j] for lay in layers] for j in range(6))  # kcs, vcs, kts, vts, ck1s, ck2s
            del layers
            q = jax.random.normal(jax.random.PRNGKey(n), (b, NQ, D), jnp.float32).astype(dtype)
            fns, select, stage2 = _decode_layer_fns(params, pos, bs=bs, n=n, k_used=k_used, init=init,
                                                    window=window, width=width, interp=interp,
                                                    dense_impl=dense_impl)
            kc0, vc0, kt0, vt0, ck10, ck20 = (s[0] for s in stacked)
            idx = jax.block_until_ready(jax.jit(select)(q, ck10, ck20))
            keys = np.asarray(attended_keys(idx[:, :, None], pos[:, None], block_size=bs), np.float64)
            row["attended_fraction"] = float(keys.mean() / n)
            row["selected_keys"] = float(keys.mean())
            if i == 0 or b != args.decode_batch:  # layer 0 of the benchmark's own inputs against the XLA references
                with _precision(dtype):
                    got = jax.jit(fns["sparse_full"])(q, kc0, vc0, kt0, vt0, ck10, ck20)
                    want = jax.jit(lambda q, kc, vc, idx: sparse_decode_attention(
                        q, kc, vc, idx, q_positions=pos, block_size=bs, init_blocks=init, window_blocks=window,
                        gather_width=width))(q, kc0, vc0, idx)
                    got_d = jax.jit(fns["dense_pallas"])(q, kc0, vc0, kt0, vt0, ck10, ck20)
                    dref = jax.jit(lambda q, kc, vc: dense_decode_attention(q, kc, vc, q_positions=pos))(q, kc0, vc0)
                tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
                e1, e2 = _max_abs(got, want), _max_abs(got_d, dref)
                rep.check(f"{label}: sparse decode (Pallas selection + kernel) vs XLA reference", e1 <= tol,
                          f"max|err| {e1:.2e} <= {tol:g}", err=e1)
                rep.check(f"{label}: dense Pallas decode vs XLA reference", e2 <= tol, f"max|err| {e2:.2e} <= {tol:g}",
                          err=e2)
                if STAGE1_HAS_SPLIT:  # the split stage-1 path must select the same blocks as the single kernel
                    idx_ns = jax.jit(functools.partial(select, split=0))(q, ck10, ck20)
                    agree = float(np.mean(np.asarray(idx_ns) == np.asarray(idx)))
                    rep.check(f"{label}: split and single-kernel Pallas stage 1 select the same blocks", agree == 1.0,
                              f"agreement {agree:.4f}", agreement=agree)
            it = args.decode_iters
            args_all = (q,) + stacked
            for name, fn in fns.items():
                if name == "dense" and dense_impl is None and n > args.xla_dense_max:
                    continue
                try:
                    c, row[f"{name}_compile_s"] = _compile(_chain(fn, n_layers), args_all)
                except Exception as e:  # noqa: BLE001
                    rep.note(f"{label}: {name} unavailable: {type(e).__name__}: {str(e)[:300]}")
                    continue
                row[f"{name}_ms"] = _pipelined_ms(c, args_all, it) / n_layers
                rep.save()
                del c
            row["dense_impl"] = (dense_impl or "xla(default)") if "dense_ms" in row else "none"
            # breakdown: the selection alone and the stage-2 kernel alone on precomputed selections
            c, _ = _compile(lambda q, ck1s, ck2s: [select(q, a, c2) for a, c2 in zip(ck1s, ck2s)],
                            (q, stacked[4], stacked[5]))
            idxs = c(q, stacked[4], stacked[5])
            row["select_ms"] = _pipelined_ms(c, (q, stacked[4], stacked[5]), it) / n_layers
            del c

            def stage2_chain(q, kcs, vcs, idxs):
                x = q
                for kc, vc, ix in zip(kcs, vcs, idxs):
                    x = stage2(x, kc, vc, ix).astype(q.dtype)
                return x

            c, _ = _compile(stage2_chain, (q, stacked[0], stacked[1], idxs))
            row["sparse_stage2_ms"] = _pipelined_ms(c, (q, stacked[0], stacked[1], idxs), it) / n_layers
            del c, idxs
            for base in ("dense", "dense_pallas"):
                if f"{base}_ms" in row and "sparse_full_ms" in row:
                    sfx = "" if base == "dense" else "_pallas"
                    row[f"speedup_full_vs_dense{sfx}"] = row[f"{base}_ms"] / row["sparse_full_ms"]
                    row[f"speedup_stage2_vs_dense{sfx}"] = row[f"{base}_ms"] / row["sparse_stage2_ms"]
            kv_bytes = 2 * b * NKV * n * D * dtype.itemsize
            if "dense_ms" in row:
                row["dense_gb_per_s"] = kv_bytes / (row["dense_ms"] * 1e-3) / 1e9
            rep.save()

            def f(key):
                return _fmt(row.get(key), ".4f")
            print(f"{label}: per layer ms: dense[{row['dense_impl']}] {f('dense_ms')}, dense pallas "
                  f"{f('dense_pallas_ms')} | sparse full {f('sparse_full_ms')} (select {f('select_ms')}, stage2 "
                  f"{f('sparse_stage2_ms')}; xla select {f('sparse_xla_select_ms')}, no split "
                  f"{f('sparse_nosplit_ms')}, all xla {f('sparse_xla_ms')}) | full x{_fmt(row.get('speedup_full_vs_dense'), '.2f')} vs dense, x"
                  f"{_fmt(row.get('speedup_full_vs_dense_pallas'), '.2f')} vs dense pallas | attended "
                  f"{row['attended_fraction']:.4f}", flush=True)
            del q, stacked, kc0, vc0, kt0, vt0, ck10, ck20, idx
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rep.save()


def part_tune(rep, args):
    """Kernel-parameter sweep (not part of the gpu_check verdict): the XLA references, dense attention forward +
    backward at 8K (cuDNN, the materialising reference, the blockwise XLA path over block sizes) and, at 32K, the stage-2
    forward and forward+backward over tokens per tile / warps / stages and the stage-1 kernel over query tile /
    key chunk / warps; at 128K the selection's query tile, stage 2 over tokens per tile, and the decode kernel's
    flash-decoding split at batch 1 and 16. Each prefill config's ms is the median of ``iters`` calls, each
    decode config's the per-layer mean of back-to-back calls; the table says which defaults to change."""
    params, bs, interp, dtype = _bench_setup(args)
    g = NQ // NKV
    t = args.tune_length
    iters = max(1, min(args.iters, 3))
    q, k, v, gout = _inputs(t, dtype)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    nb = -(-t // bs)
    k_used = min(params.topk_cfg, nb)
    init, window, width = stage2_forced_split(params, k_used)
    idx = jax.block_until_ready(jax.jit(lambda q, k: select_blocks(q, k, q_positions=pos, params=params).topk_idx[
        ..., :k_used])(q, k))
    print(f"tune: T={t}, {args.dtype}, 8B layout, block {bs}, default tokens per tile "
          f"{default_tokens_per_tile(t, g, BACKEND)}, iters {iters}", flush=True)
    grid1 = [(qt, kc, w) for qt in (1, 2, 4, 8) for kc in (32, 64, 128) for w in (4, 8)]
    grid2 = [(tq, w, st) for tq in (1, 2, 4, 8) for w in (4, 8) for st in (2, 3)]
    gridb = [(tq, w, 2) for tq in (2, 4, 8) for w in (4, 8)]
    if interp:
        grid1, grid2, gridb = grid1[:1], grid2[:2], gridb[:1]
    # stage 1 first: it is the larger share of the end-to-end prefill time at 128K (first H200 run)
    # the query tile of select_blocks (its lax.map over tiles; each tile one stage-1 grid), at the longest length
    t_sel = 1024 if interp else 131072
    grids = [(qt,) for qt in ((128, 512) if interp else (512, 2048, 8192, 16384))]
    sel_inputs, sel_pos, long_sel, dec_data = None, jnp.arange(t_sel, dtype=jnp.int32)[None], None, {}
    # the XLA references at the same length (the attention_impl=xla/auto path), for the kernels' tables
    # stage 2 at the longest length too: there the per-tile union (0.37 of the causal blocks with 8 tokens per
    # tile against 0.19 attended, first H200 run) weighs most, so fewer tokens per tile may win
    grid2_long = [(tq, 4, 3) for tq in ((1, 2) if interp else (4, 8, 2, 1))]  # the slowest last (time budget)
    # the decode kernel's flash-decoding split at the goal length, batch 1 and 16 (stage 2 alone, 4 layers chained)
    dec_n = 1024 if interp else 131072
    grid_dec = [(b_, ns) for b_ in (1, 16 if not interp else 2) for ns in ((0, 4) if interp else (0, 33, 65, 130))]
    # dense attention forward + backward at 8K (the model's dense layers): cuDNN, the materialising reference
    # (attention_impl: xla) and the blockwise XLA path (auto) at several block sizes; its GPU default is unmeasured
    t_dense = 256 if interp else 8192
    grid_dense = [("cudnn",), ("reference",)] + [("blockwise", bq, bk) for bq, bk in (
        ((16, 32),) if interp else ((512, 1024), (256, 512), (1024, 1024), (512, 2048), (128, 256)))]
    dense_inputs = None
    cases = ([("xla reference", ("select",)), ("xla reference", ("stage2",))]
             + [("dense fwd+bwd", c) for c in grid_dense]
             + [("select q_tile", c) for c in grids] + [("stage2 fwd long", c) for c in grid2_long]
             + [("decode splits", c) for c in grid_dec]
             + [("stage1", c) for c in grid1]
             + [("stage2 fwd", c) for c in grid2] + [("stage2 fwd+bwd", c) for c in gridb])
    ck1 = compress_keys(k, params.kernel_size, params.kernel_stride)
    ck2 = compress_keys(k, params.coarse_size, params.coarse_stride)
    for kind, c in cases:
        label = f"{kind} {c}"
        if rep.elapsed() > args.deadline_s:
            rep.row(dict(kind=kind, config=list(c), skipped="time budget"))
            continue
        row = dict(kind=kind, T=t_sel if kind in ("select q_tile", "stage2 fwd long") else dec_n
                   if kind == "decode splits" else t_dense if kind == "dense fwd+bwd" else t, config=list(c))
        rep.row(row)
        try:
            if kind == "xla reference":
                if c[0] == "select":
                    fn = lambda q, k: select_blocks(q, k, q_positions=pos, params=params).topk_idx  # noqa: E731
                    fargs = (q, k)
                else:
                    fn = functools.partial(lambda q, k, v, idx: infllmv2_stage2(
                        q, k, v, idx, q_positions=pos, kv_positions=pos, block_size=bs, window_blocks=window,
                        init_blocks=init, gather_width=width), idx=idx)
                    fargs = (q, k, v)
            elif kind == "dense fwd+bwd":
                if dense_inputs is None:
                    dense_inputs = _inputs(t_dense, dtype)
                pos_d = jnp.arange(t_dense, dtype=jnp.int32)[None]
                if c[0] == "cudnn":
                    f = _dense_fn("cudnn", True)
                elif c[0] == "reference":
                    f = functools.partial(dense_attention, q_positions=pos_d, kv_positions=pos_d)
                else:
                    f = functools.partial(flash_attention, q_positions=pos_d, kv_positions=pos_d, block_q=c[1],
                                          block_k=c[2])
                fn, fargs = _fwd_bwd(f), dense_inputs
            elif kind == "select q_tile":
                if sel_inputs is None:
                    sel_inputs = _inputs(t_sel, dtype)[:3]
                row["q_tile"] = c[0]
                fn = functools.partial(lambda q, k, qt: select_blocks(
                    q, k, q_positions=sel_pos, params=params, q_tile=qt, impl="pallas").topk_idx, qt=c[0])
                fargs = sel_inputs[:2]
            elif kind == "decode splits":  # config (batch, num_splits); 0 = the kernel's default split
                b_, ns = c
                if dec_data.get("batch") != b_:
                    dec_data.clear()
                    dec_data["batch"] = b_
                    nb_d = dec_n // bs
                    k_d = min(params.topk_cfg, nb_d)
                    init_d, win_d, width_d = stage2_forced_split(params, k_d)
                    key = jax.random.PRNGKey(7)
                    kcs = [jax.random.normal(jax.random.fold_in(key, 2 * i), (b_, NKV, dec_n, D), dtype)
                           for i in range(4)]
                    vcs = [jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (b_, NKV, dec_n, D), dtype)
                           for i in range(4)]
                    # forced blocks of the last token plus random distinct picks below them (a selection's shape)
                    qb = (dec_n - 1) // bs
                    forced = np.r_[np.arange(init_d), np.arange(qb - win_d + 1, qb + 1)]
                    rng = np.random.default_rng(0)
                    pool = np.setdiff1d(np.arange(qb + 1), forced)
                    picks = np.stack([np.r_[forced, np.sort(rng.choice(pool, max(0, k_d - len(forced)),
                                                                       replace=False))][:k_d]
                                      for _ in range(b_ * NKV)]).reshape(b_, NKV, k_d).astype(np.int32)
                    dec_data.update(kcs=kcs, vcs=vcs, idx=jnp.asarray(picks), forced=(init_d, win_d, width_d),
                                    q=jax.random.normal(key, (b_, NQ, D), jnp.float32).astype(dtype),
                                    pos=jnp.full((b_,), dec_n - 1, jnp.int32))
                init_d, win_d, width_d = dec_data["forced"]
                row.update(batch=b_, num_splits=ns or "default", layers=4)

                def chain(q, kcs, vcs, idx, ns=ns, init_d=init_d, win_d=win_d, width_d=width_d):
                    x = q
                    for kc_, vc_ in zip(kcs, vcs):
                        x = sparse_decode_attention_pallas(
                            x, kc_, vc_, idx, q_positions=dec_data["pos"], block_size=bs, init_blocks=init_d,
                            window_blocks=win_d, gather_width=width_d, backend=BACKEND, interpret=interp,
                            num_splits=ns or None).astype(q.dtype)
                    return x
                fn = chain
                fargs = (dec_data["q"], dec_data["kcs"], dec_data["vcs"], dec_data["idx"])
            elif kind == "stage2 fwd long":
                if sel_inputs is None:
                    sel_inputs = _inputs(t_sel, dtype)[:3]
                if long_sel is None:  # the model's own Pallas selection at the longest length, computed once
                    k_long = min(params.topk_cfg, -(-t_sel // bs))
                    long_sel = (jax.block_until_ready(jax.jit(lambda q, k: select_blocks(
                        q, k, q_positions=sel_pos, params=params, impl="pallas").topk_idx[..., :k_long])(
                        *sel_inputs[:2])), stage2_forced_split(params, k_long))
                idx_l, (init_l, win_l, _) = long_sel
                tq, w, st = c
                row.update(tokens_per_tile=tq, num_warps=w, num_stages=st)
                row["tile_blocks_mean"] = _selection_stats(idx_l, sel_pos, bs, t_sel, g, init_l, win_l,
                                                           tq)["tile_blocks_mean"]
                fn = functools.partial(lambda q, k, v, tq, w, st: block_sparse_attention(
                    q, k, v, idx_l, q_positions=sel_pos, kv_positions=sel_pos, block_size=bs, window_blocks=win_l,
                    init_blocks=init_l, backend=BACKEND, interpret=interp, tokens_per_tile=tq, num_warps=w,
                    num_stages=st), tq=tq, w=w, st=st)
                fargs = sel_inputs
            elif kind == "stage1":
                qt, kc, w = c
                row.update(q_tile=qt, kernel_chunk=kc, num_warps=w)
                fn = functools.partial(stage1_scores_pallas, q_positions=pos, kv_len=jnp.array([t], jnp.int32),
                                       params=params, backend=BACKEND, interpret=interp, q_tile=qt, kernel_chunk=kc,
                                       num_warps=w)
                fargs = (q, ck1, ck2)
            else:
                tq, w, st = c
                row.update(tokens_per_tile=tq, num_warps=w, num_stages=st)
                row["tile_blocks_mean"] = _selection_stats(idx, pos, bs, t, g, init, window, tq)["tile_blocks_mean"]

                def sparse(q, k, v, tq=tq, w=w, st=st):
                    return block_sparse_attention(q, k, v, idx, q_positions=pos, kv_positions=pos, block_size=bs,
                                                  window_blocks=window, init_blocks=init, backend=BACKEND,
                                                  interpret=interp, tokens_per_tile=tq, num_warps=w, num_stages=st)
                fn = sparse if kind == "stage2 fwd" else _fwd_bwd(sparse)
                fargs = (q, k, v) if kind == "stage2 fwd" else (q, k, v, gout)
            comp, row["compile_s"] = _compile(fn, fargs)
            if kind == "decode splits":  # microsecond calls: mean of back-to-back dispatches, per layer
                row["ms"] = _pipelined_ms(comp, fargs, 2 if interp else 30) / 4
            else:
                row["ms"] = _median_ms(comp, fargs, 1, iters)
            rep.save()
            print(f"{label}: {row['ms']:9.3f} ms" + (f"  tile blocks {row['tile_blocks_mean']:.1f}"
                                                    if "tile_blocks_mean" in row else "")
                  + f"  (compile {row['compile_s']:.1f} s)", flush=True)
            del comp
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rep.note(f"{label}: {row['error']}")
            rep.save()
    rep.check("tune sweep ran", any("ms" in r for r in rep.data["bench"]), "at least one config timed")


# ----------------------------------------------------------------------------------------------- summary
def _fmt(x, spec=".3f"):
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def part_summary(out_dir: str) -> int:
    lines, parts, n_fail, n_pass = [], {}, 0, 0
    for p in PARTS:
        path = os.path.join(out_dir, f"{p.replace('-', '_')}.json")
        if os.path.exists(path):
            with open(path) as fh:
                parts[p] = json.load(fh)
    steps = []
    steps_path = os.path.join(out_dir, "steps.tsv")
    if os.path.exists(steps_path):
        with open(steps_path) as fh:
            steps = [ln.rstrip("\n").split("\t") for ln in fh if ln.strip()]
    dev = next((d["device"] for d in parts.values()), {})
    lines.append(f"gpu_check summary  {_now()}  device: {dev.get('device_kind', '?')} x{dev.get('device_count', '?')} "
                 f"({dev.get('platform', '?')}), jax {dev.get('jax', '?')}, jaxlib {dev.get('jaxlib', '?')}, "
                 f"python {dev.get('python', '?')}" + ("  [CPU DRY RUN: timings meaningless]"
                                                        if any(d.get("dry_run") for d in parts.values()) else ""))
    if steps:
        lines.append("\nsteps:")
        for s in steps:
            lines.append("  " + "  ".join(s))
            if len(s) > 2 and s[2] not in ("PASS", "SKIPPED"):
                n_fail += 1
    lines.append("\nchecks:")
    for p, d in parts.items():
        if not d.get("complete"):
            lines.append(f"  FAIL {p}: part did not finish (killed by its timeout or crashed); partial results kept")
            n_fail += 1
        for c in d["checks"]:
            lines.append(f"  {c['status']} [{p}] {c['name']}  {c.get('detail', '')}")
            n_fail += c["status"] == "FAIL"
            n_pass += c["status"] == "PASS"
    for p in PARTS:
        if p not in parts:
            lines.append(f"  MISSING {p}: no result file")
    if "prefill" in parts or "prefill-bwd" in parts:
        lines.append("\nprefill (one layer, ms; kernel = dense / sparse stage 2; e2e = dense / (selection + stage 2)):")
        lines.append(f"  {'mode':8} {'T':>7} {'dense impl':>12} {'dense':>10} {'stage2':>10} {'sel xla':>9} "
                     f"{'sel pallas':>10} {'kernel x':>8} {'e2e x':>6} {'attended':>8} {'tile blk':>8}")
        for p in ("prefill", "prefill-bwd"):
            for r in parts.get(p, {}).get("bench", []):
                if "skipped" in r or "error" in r:
                    lines.append(f"  {r.get('mode', p):8} {r['T']:>7} {r.get('skipped') or r.get('error')}")
                    continue
                lines.append(f"  {r['mode']:8} {r['T']:>7} {r.get('dense_impl', '?'):>12} "
                             f"{_fmt(r.get('dense_ms')):>10} "
                             f"{_fmt(r.get('sparse_stage2_ms')):>10} {_fmt(r.get('select_xla_ms')):>9} "
                             f"{_fmt(r.get('select_pallas_ms')):>10} {_fmt(r.get('speedup_kernel'), '.2f'):>8} "
                             f"{_fmt(r.get('speedup_end_to_end'), '.2f'):>6} "
                             f"{_fmt(r.get('attended_fraction'), '.4f'):>8} "
                             f"{_fmt(r.get('tile_blocks_mean'), '.1f'):>8}")
    if "decode" in parts:
        lines.append("\ndecode (ms per layer, from calls of several layers unrolled in one jit; full = Pallas selection"
                     " + sparse kernel; xla sel = XLA selection + sparse kernel; no split = single-kernel stage 1; all xla = XLA selection + XLA decode reference, the attention_impl=xla path):")
        lines.append(f"  {'N':>7} {'B':>3} {'dense impl':>12} {'dense':>9} {'dense pl':>9} {'full':>9} {'select':>9} "
                     f"{'stage2':>9} {'xla sel':>9} {'no split':>9} {'all xla':>9} {'x dense':>7} {'x dense pl':>10} "
                     f"{'attended':>8}")
        for r in parts["decode"].get("bench", []):
            if "skipped" in r or "error" in r:
                lines.append(f"  {r['N']:>7} {r.get('batch', '?'):>3} {r.get('skipped') or r.get('error')}")
                continue
            lines.append(f"  {r['N']:>7} {r.get('batch', 1):>3} {r.get('dense_impl', '?'):>12} "
                         f"{_fmt(r.get('dense_ms'), '.4f'):>9} "
                         f"{_fmt(r.get('dense_pallas_ms'), '.4f'):>9} {_fmt(r.get('sparse_full_ms'), '.4f'):>9} "
                         f"{_fmt(r.get('select_ms'), '.4f'):>9} {_fmt(r.get('sparse_stage2_ms'), '.4f'):>9} "
                         f"{_fmt(r.get('sparse_xla_select_ms'), '.4f'):>9} {_fmt(r.get('sparse_nosplit_ms'), '.4f'):>9} "
                         f"{_fmt(r.get('sparse_xla_ms'), '.4f'):>9} "
                         f"{_fmt(r.get('speedup_full_vs_dense'), '.2f'):>7} "
                         f"{_fmt(r.get('speedup_full_vs_dense_pallas'), '.2f'):>10} "
                         f"{_fmt(r.get('attended_fraction'), '.4f'):>8}")
    tune_path = os.path.join(out_dir, "tune.json")
    if os.path.exists(tune_path):  # the optional sweep (not part of the verdict): the 3 fastest configs per kernel
        with open(tune_path) as fh:
            tune = json.load(fh)
        lines.append(f"\ntune sweep (--part tune; not part of the verdict), fastest configs per kernel:")
        for kind in ("xla reference", "dense fwd+bwd", "select q_tile", "stage2 fwd long", "decode splits", "stage1", "stage2 fwd",
                     "stage2 fwd+bwd"):
            rows = sorted((r for r in tune.get("bench", []) if r.get("kind") == kind and "ms" in r),
                          key=lambda r: r["ms"])
            best = ", ".join(f"{tuple(r['config'])} {r['ms']:.3f} ms" for r in rows[:3])
            lines.append(f"  {kind} T={rows[0]['T'] if rows else '?'}: {best or 'none timed'} ({len(rows)} timed)")
    goals = {}
    pre = [r for r in parts.get("prefill", {}).get("bench", []) if r.get("T") == 131072 and "speedup_kernel" in r]
    dec = sorted((r for r in parts.get("decode", {}).get("bench", [])
                  if r.get("N") == 131072 and "speedup_full_vs_dense" in r), key=lambda r: r.get("batch", 1))
    if pre:
        goals["prefill_128k_kernel_speedup"] = pre[0]["speedup_kernel"]
        goals["prefill_128k_end_to_end_speedup"] = pre[0].get("speedup_end_to_end")
    if dec:
        goals["decode_128k_speedup"] = dec[0]["speedup_full_vs_dense"]  # the smallest batch (1 by default)
        goals["decode_128k_batch"] = dec[0].get("batch", 1)
        for r in dec[1:]:
            goals[f"decode_128k_speedup_batch{r['batch']}"] = r["speedup_full_vs_dense"]
    lines.append("\nissue-4 stretch goals at 128K (informational, not a PASS/FAIL): prefill >= 5x, decode >= 7x")

    def times(v) -> str:  # "n/a" without the "x" (helper 75: the dry run printed "n/ax")
        text = _fmt(v, ".2f")
        return text if text == "n/a" else text + "x"

    lines.append("  prefill kernel " + times(goals.get("prefill_128k_kernel_speedup")) + ", end to end "
                 + times(goals.get("prefill_128k_end_to_end_speedup")) + "; decode "
                 + times(goals.get("decode_128k_speedup")) + f" at batch {goals.get('decode_128k_batch', '?')}"
                 + "".join(f", {v:.2f}x at batch {k.rsplit('batch', 1)[1]}" for k, v in goals.items()
                           if k.startswith("decode_128k_speedup_batch")))
    skipped = [f"{p} {r.get('T', r.get('N'))}" for p, d in parts.items() for r in d.get("bench", []) if "skipped" in r]
    skipped += [f"step {s[0]}" for s in steps if len(s) > 2 and s[2] == "SKIPPED"]
    overall = "PASS" if n_fail == 0 and n_pass > 0 and parts else "FAIL"
    incomplete = f" (INCOMPLETE: not run for time: {', '.join(skipped)})" if skipped else ""
    lines.append(f"\nOVERALL {overall}: {n_pass} checks passed, {n_fail} failures{incomplete}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as fh:
        json.dump(dict(overall=overall, checks_passed=n_pass, failures=n_fail, not_run=skipped, device=dev, goals=goals,
                       steps=steps,
                       parts=parts, written_utc=_now()), fh, indent=1, default=float)
    return 0 if overall == "PASS" else 1


# ----------------------------------------------------------------------------------------------- main
def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=PARTS + ("tune", "summary", "all"), default="all")
    ap.add_argument("--out", default=None, help="output directory (default $OUT, else runs/gpu_check; dry run: "
                                                 ".cache/gpu_check_dry_run)")
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases and iterations")
    ap.add_argument("--cpu-dry-run", action="store_true", help="CPU, interpret=True, tiny sizes (checks the script)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="benchmark dtype")
    ap.add_argument("--lengths", type=int_range(1), nargs="+", default=None, help="prefill forward lengths")
    ap.add_argument("--bwd-lengths", type=int_range(1), nargs="+", default=None,
                    help="prefill forward+backward lengths")
    ap.add_argument("--decode-lengths", type=int_range(1), nargs="+", default=None)
    ap.add_argument("--decode-batch", type=int_range(1), default=1, help="decode batch at every length (default 1)")
    ap.add_argument("--decode-big-batch", type=int_range(0), default=None,
                    help="also time the longest decode length at this batch (default 16; dry run 2; 0 = off)")
    ap.add_argument("--tune-length", type=int_range(1), default=None,
                    help="prefill length of --part tune (default 32768)")
    ap.add_argument("--warmup", type=int_range(0), default=None)
    ap.add_argument("--iters", type=int_range(1), default=None, help="timed prefill calls (median)")
    ap.add_argument("--decode-iters", type=int_range(1), default=None, help="back-to-back decode calls (mean)")
    ap.add_argument("--decode-layers", type=int_range(1), default=None,
                    help="layers (separate KV caches) per timed decode call, unrolled in one jit (default 8)")
    ap.add_argument("--xla-dense-max", type=int_range(0), default=16384,
                    help="longest T for the XLA dense fallback when cuDNN is unavailable ([heads, T, T] scores)")
    ap.add_argument("--deadline-s", type=float_range(0, lo_open=True), default=1e9,
                    help="a part starts no new case after this many seconds (its driver timeout kills it later)")
    ap.add_argument("--allow-cpu", action="store_true", help="run compiled kernels on a non-GPU backend (debug)")
    a = ap.parse_args(argv)
    dry, quick = a.cpu_dry_run, a.quick
    big = [8192, 32768, 131072]
    defaults = dict(lengths=[256, 512] if dry else big, bwd_lengths=[256] if dry else big,
                    decode_lengths=[512, 1024] if dry else big[::-1],  # longest first: the goal length
                    tune_length=256 if dry else 32768, warmup=1 if dry else (1 if quick else 2),
                    iters=1 if dry else (2 if quick else 5), decode_iters=2 if dry else (10 if quick else 30),
                    decode_layers=2 if dry else 8, decode_big_batch=2 if dry else 16)
    for key, val in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, val)
    if a.out is None:
        a.out = os.environ.get("OUT") or (".cache/gpu_check_dry_run" if dry else "runs/gpu_check")
    return a


def main(argv=None) -> int:
    a = _parse(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.part == "summary":
        return part_summary(a.out)
    if not a.cpu_dry_run and a.part != "env" and jax.default_backend() != "gpu" and not a.allow_cpu:
        print(f"FAIL no GPU: jax.default_backend() = {jax.default_backend()!r}, devices {jax.devices()} "
              "(use --cpu-dry-run to check the script on CPU)", flush=True)
        return 2
    cache = os.environ.get("GPU_CHECK_JAX_CACHE")
    if cache:  # a rerun on the same machine skips recompilation
        try:
            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        except Exception as e:  # noqa: BLE001
            print(f"NOTE compilation cache not enabled: {e}", flush=True)
    info = _device_info()
    print(f"device {info['device_kind']} ({info['platform']}) x{info['device_count']}, jax {info['jax']}, jaxlib "
          f"{info['jaxlib']}, python {info['python']}, backend {BACKEND}, interpret={a.cpu_dry_run}, "
          f"select_blocks impl= {'yes' if SELECT_HAS_IMPL else 'no'}", flush=True)
    parts = PARTS if a.part == "all" else (a.part,)
    rc = 0
    for p in parts:
        print(f"\n=== {p} ===", flush=True)
        rep = Report(a.out, p, a)
        try:
            if p == "env":
                part_env(rep, a)
            elif p == "correctness":
                part_correctness(rep, a)
            elif p == "decode":
                part_decode(rep, a)
            elif p == "tune":
                part_tune(rep, a)
            else:
                part_prefill(rep, a, bwd=p == "prefill-bwd")
        except Exception as e:  # noqa: BLE001
            rep.error(f"{p} (part crashed)", e)
        rc_p = rep.finish()
        rc = max(rc, rc_p)
        print(f"=== {p}: {'PASS' if rc_p == 0 else 'FAIL'} in {rep.elapsed():.1f} s ===", flush=True)
    if a.part == "all":
        rc = max(rc, part_summary(a.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
