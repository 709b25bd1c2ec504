"""Straightforward NumPy transcription of InfLLM v2 selection, spec ``minicpm4_model.md`` §5.1-§5.5.

Written from the spec text with explicit loops, sharing no code with ``minicpm4_jax.infllm``. It
assumes the official geometry family ``kernel_size == 2 * kernel_stride`` (so the spec's literal
formulas apply: pooling window ``[r*b - 1, r*b + r - 1]``, quirk formula of §5.2). float64 math.

Conventions fixed by this project (documented in ``minicpm4_jax/infllm/select.py``): ``topk_idx`` rows
hold the valid block ids ascending, then ``-1``; a pick is invalid if it is late (gen-2 ``b > q_blk``,
gen-1 ``b >= q_blk``) or its pooled score is ``-inf``; top-k ties go to the lower block index.
"""

from __future__ import annotations

import math

import numpy as np


def compress(k: np.ndarray, ks: int, st: int) -> np.ndarray:
    """``k`` ``[N, h, d]`` -> ``[Nc, h, d]``, ``ck[j] = mean(k[st*j : st*j + ks])`` over complete windows."""
    n = k.shape[0]
    out = []
    j = 0
    while st * j + ks <= n:
        out.append(k[st * j : st * j + ks].astype(np.float64).mean(axis=0))
        j += 1
    if not out:
        return np.zeros((0,) + k.shape[1:], np.float64)
    return np.stack(out)


def visible(p: int, nk: int, ks: int, st: int, *, quirk: bool, num_q: int, kv_len: int) -> np.ndarray:
    """Bool ``[nk]``: kernel ``j`` visible to a query at absolute position ``p`` (§5.2)."""
    j = np.arange(nk)
    if quirk and num_q > 1:
        # official kernel: j < max(0, floor((r+1)/s) - 1 + Nk - floor((Nq - s + 1)/s)), row r bottom-right aligned
        r = p - (kv_len - num_q)
        nk_seq = max(0, (kv_len - ks) // st + 1)
        lim = max(0, (r + 1) // st - 1 + nk_seq - (num_q - st + 1) // st)
        return (j < lim) & (j < nk_seq)
    return st * j + ks - 1 <= p


def stage1(q: np.ndarray, k: np.ndarray, pos: np.ndarray, *, ks: int, st: int, variant: str, quirk: bool = False,
           kv_len: int | None = None) -> np.ndarray:
    """One sequence. ``q`` ``[T, nq, d]``, ``k`` ``[N, nkv, d]``, ``pos`` ``[T]`` -> ``S`` ``[nkv, T, Nc1]``."""
    t_len, nq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    kv_len = int(pos.max()) + 1 if kv_len is None else kv_len
    scale = 1.0 / math.sqrt(d)
    ck1 = compress(k, ks, st)
    ck2 = compress(k, 4 * ks, 4 * st)
    nc1, nc2 = ck1.shape[0], ck2.shape[0]
    out = np.zeros((nkv, t_len, nc1))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for t in range(t_len):
            p = int(pos[t])
            vis1 = visible(p, nc1, ks, st, quirk=quirk, num_q=t_len, kv_len=kv_len)
            vis2 = visible(p, nc2, 4 * ks, 4 * st, quirk=quirk, num_q=t_len, kv_len=kv_len)
            for h in range(nkv):
                for gg in range(g):
                    qv = q[t, h * g + gg].astype(np.float64)
                    z1 = scale * (ck1[:, h] @ qv)
                    if variant == "gen1":
                        zs = z1[vis1]
                    else:
                        zs = (scale * (ck2[:, h] @ qv))[vis2]
                    if zs.size:
                        mx = zs.max()
                        lse = mx + math.log(np.exp(zs - mx).sum())
                    else:
                        lse = -math.inf
                    for j in range(nc1):
                        if vis1[j]:
                            out[h, t, j] += math.exp(z1[j] - lse) if lse > -math.inf else math.inf
    return out


def pool(s: np.ndarray, pos: np.ndarray, *, num_blocks: int, block_size: int, st: int, init_blocks: int,
         local_blocks: int, variant: str) -> np.ndarray:
    """``S`` ``[nkv, T, Nc1]`` -> block scores ``[nkv, T, NB]`` (§5.3)."""
    nkv, t_len, nc1 = s.shape
    r = block_size // st
    out = np.full((nkv, t_len, num_blocks), -np.inf)
    for h in range(nkv):
        for t in range(t_len):
            qb = int(pos[t]) // block_size
            for b in range(num_blocks):
                if b < init_blocks:
                    out[h, t, b] = np.inf
                    continue
                if variant == "gen2" and qb - local_blocks <= b <= qb:
                    out[h, t, b] = np.inf
                    continue
                if variant == "gen1" and qb - local_blocks < b <= qb:
                    out[h, t, b] = -np.inf
                    continue
                cand = [j for j in range(r * b - 1, r * b + r) if 0 <= j < nc1]
                if cand:  # clamped to the largest finite value: a forced (+inf) block wins every tie
                    out[h, t, b] = min(max(s[h, t, j] for j in cand), np.finfo(np.float32).max)
    return out


def topk(bs: np.ndarray, pos: np.ndarray, *, k_cfg: int, block_size: int, variant: str):
    """Block scores ``[nkv, T, NB]`` -> (``topk_idx`` ``[nkv, T, k_cfg]`` int, ``counts`` ``[nkv, T]``) (§5.4)."""
    nkv, t_len, nb = bs.shape
    k = min(k_cfg, nb)
    idx = np.full((nkv, t_len, k_cfg), -1, np.int64)
    cnt = np.zeros((nkv, t_len), np.int64)
    for h in range(nkv):
        for t in range(t_len):
            qb = int(pos[t]) // block_size
            order = sorted(range(nb), key=lambda b: (-bs[h, t, b], b))[:k]
            keep = []
            for b in order:
                late = b > qb if variant == "gen2" else b >= qb
                if not late and bs[h, t, b] != -np.inf:
                    keep.append(b)
            keep.sort()
            idx[h, t, : len(keep)] = keep
            cnt[h, t] = len(keep)
    return idx, cnt


def block_mask(idx: np.ndarray, pos: np.ndarray, *, num_blocks: int, block_size: int, window_blocks: int,
               init_blocks: int = 0) -> np.ndarray:
    """Attended blocks ``[nkv, T, NB]`` bool: top-k picks plus the window ``q_blk-W+1 .. q_blk`` and the first
    ``init_blocks`` blocks (§5.5; gen-1's window is ``W = L``)."""
    nkv, t_len, _ = idx.shape
    m = np.zeros((nkv, t_len, num_blocks), bool)
    for h in range(nkv):
        for t in range(t_len):
            for b in idx[h, t]:
                if b >= 0:
                    m[h, t, b] = True
            if window_blocks and pos[t] >= 0:
                qb = int(pos[t]) // block_size
                for b in range(max(0, qb - window_blocks + 1), qb + 1):
                    m[h, t, b] = True
            if pos[t] >= 0:
                m[h, t, :init_blocks] = True
    return m


def token_mask(bmask: np.ndarray, pos: np.ndarray, kv_pos: np.ndarray, block_size: int) -> np.ndarray:
    """``[nkv, T, NB]`` block mask -> ``[nkv, T, N]`` token mask with ``kv_pos <= pos`` (§5.5)."""
    n = kv_pos.shape[0]
    blk = np.arange(n) // block_size
    return bmask[:, :, blk] & (kv_pos[None, None, :] <= pos[None, :, None])
