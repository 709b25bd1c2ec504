"""InfLLM v2 reference (spec ``minicpm4_model.md`` §5; field faults B02-B05, B23).

Oracles: ``tests/infllm_numpy.py`` (an independent NumPy transcription of §5.1-§5.5) for selection,
and a naive dense attention with the explicit token mask built from the same selection for stage 2
(output and gradients). CPU, float32, small dims.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import infllm_numpy as ref
from minicpm4_jax.config import SparseConfig
from minicpm4_jax import infllm
from minicpm4_jax.infllm import SENTINEL, compress_keys, num_kernels, select_params, visible_kernel_count
from minicpm4_jax.infllm import attention as infllm_attention
from minicpm4_jax.infllm.attention import native_stage2
from minicpm4_jax.ops import attention_ref, infllm_ref, native

# Everything under test is called through jit (one compile per shape instead of op-by-op dispatch).
_ATTN_STATIC = ("sparse_cfg", "kernel_offby1_quirk", "score_dtype", "select_q_tile", "attn_q_tile", "gather_tile", "remat",
                "return_selection", "return_stats", "scale", "impl")
infllmv2_attention = jax.jit(infllm_attention.infllmv2_attention, static_argnames=_ATTN_STATIC)
infllmv2_stage2 = jax.jit(infllm_ref.infllmv2_stage2,
                          static_argnames=("block_size", "window_blocks", "init_blocks", "gather_width", "scale",
                                           "q_tile", "gather_tile", "remat"))
select_blocks = jax.jit(infllm.select_blocks, static_argnames=("params", "scale", "q_tile"))
selection_scores = jax.jit(infllm.selection_scores, static_argnames=("params", "scale"))
selection_block_mask = jax.jit(infllm.selection_block_mask,
                               static_argnames=("num_blocks", "block_size", "window_blocks"))
dense_attention = jax.jit(attention_ref.dense_attention, static_argnames=("scale",))
compact_topk = jax.jit(infllm_ref.compact_topk, static_argnames=("block_size", "init_blocks", "window_blocks", "width"))
stage2_forced_split = infllm_attention.stage2_forced_split


def _grads(fn, gout, *args):
    """Jitted gradient of ``sum(fn(*args) * gout)`` w.r.t. every arg."""
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * gout), argnums=tuple(range(len(args)))))(*args)

# field_faults.md TINY attention layout: 8 query heads, 2 KV heads, head_dim 32, window 2 blocks, topk 4.
TINY = SparseConfig(kernel_size=32, kernel_stride=16, block_size=64, init_blocks=1, window_size=128, topk=4,
                    dense_len=0)
# Same family (ks = 2*stride, block = 4*stride) scaled down 4x, so short inputs have many blocks.
SMALL = SparseConfig(kernel_size=8, kernel_stride=4, block_size=16, init_blocks=1, window_size=32, topk=3,
                     dense_len=0)


def _rand(seed, *shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _qkv(seed, b, t, nq, nkv, d, n=None):
    n = t if n is None else n
    return _rand(seed, b, t, nq, d), _rand(seed + 1, b, n, nkv, d), _rand(seed + 2, b, n, nkv, d)


def _pos(b, t, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


def naive_masked_attention(q, k, v, mask, scale=None):
    """Oracle: ``mask`` bool ``[b, nkv, T, N]``; fp32 softmax; fully masked rows -> 0."""
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, nkv, g, d).astype(jnp.float32)
    lg = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
    lg = jnp.where(mask[:, :, None], lg, -jnp.inf)
    m = jnp.max(lg, -1, keepdims=True)
    pr = jnp.exp(lg - jnp.where(jnp.isfinite(m), m, 0.0))
    den = pr.sum(-1, keepdims=True)
    pr = pr / jnp.where(den == 0, 1.0, den)
    return jnp.einsum("bkgts,bskd->btkgd", pr, v.astype(jnp.float32)).reshape(b, t, nq, d)


def _np_selection(q, k, pos, cfg, *, quirk=False, kv_len=None):
    """NumPy oracle for every sequence of a batch -> dict of stacked arrays."""
    p = select_params(cfg)
    outs = []
    for bi in range(q.shape[0]):
        qn, kn, pn = np.asarray(q[bi]), np.asarray(k[bi]), np.asarray(pos[bi])
        s = ref.stage1(qn, kn, pn, ks=cfg.kernel_size, st=cfg.kernel_stride, variant=cfg.variant, quirk=quirk,
                       kv_len=kv_len)
        nb = -(-k.shape[1] // cfg.block_size)
        bs = ref.pool(s, pn, num_blocks=nb, block_size=cfg.block_size, st=cfg.kernel_stride,
                      init_blocks=cfg.init_blocks, local_blocks=p.local_blocks, variant=cfg.variant)
        idx, cnt = ref.topk(bs, pn, k_cfg=p.topk_cfg, block_size=cfg.block_size, variant=cfg.variant)
        outs.append(dict(scores=s, block_scores=bs, topk_idx=idx, counts=cnt))
    return {key: np.stack([o[key] for o in outs]) for key in outs[0]}


def _attended_mask_np(idx, pos, kv_pos, cfg, n):
    p = select_params(cfg)
    nb = -(-n // cfg.block_size)
    w = p.local_blocks if cfg.variant == "gen1" else 0
    return np.stack([
        ref.token_mask(ref.block_mask(idx[bi], np.asarray(pos[bi]), num_blocks=nb, block_size=cfg.block_size,
                                      window_blocks=w), np.asarray(pos[bi]), np.asarray(kv_pos[bi]), cfg.block_size)
        for bi in range(idx.shape[0])
    ])


# ----------------------------------------------------------------------------------------------- §5.1


@pytest.mark.parametrize("n", [1, 31, 32, 47, 48, 127, 128, 200])
def test_compress_keys_matches_numpy(n):
    k = _rand(0, 2, n, 2, 8)
    for ks, st in [(32, 16), (128, 64), (8, 4)]:
        got = compress_keys(k, ks, st)
        assert got.shape == (2, num_kernels(n, ks, st), 2, 8)
        want = np.stack([ref.compress(np.asarray(k[b]), ks, st) for b in range(2)])
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert num_kernels(10000, 32, 16) == 624 and num_kernels(10000, 128, 64) == 155


# ------------------------------------------------------------------------------------------ §5.2-§5.4

SEL_CASES = [
    # (cfg, T, group size, quirk)
    (TINY, 1, 2, False),     # T = 1
    (TINY, 20, 16, False),   # T < kernel_size
    (TINY, 79, 1, True),     # 79 = 15 mod 16 (quirk drops a fine kernel)
    (TINY, 191, 8, False),   # 191 = 63 mod 64 (and 15 mod 16)
    (TINY, 191, 8, True),
    (TINY, 256, 4, False),
    (SMALL, 63, 2, True),    # 63 = 15 mod 16 = 3 mod 4 for the scaled geometry
    (SMALL, 160, 16, False),
]


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
@pytest.mark.parametrize("cfg,t,g,quirk", SEL_CASES)
def test_selection_matches_numpy(cfg, t, g, quirk, variant):
    cfg = dataclasses.replace(cfg, variant=variant)
    nkv, d = 2, 16
    q, k, _ = _qkv(t * 7 + g, 2, t, nkv * g, nkv, d)
    pos = _pos(2, t)
    p = select_params(cfg, kernel_offby1_quirk=quirk)
    got = jax.jit(lambda q, k, pos: selection_scores(q, k, q_positions=pos, params=p))(q, k, pos)
    want = _np_selection(q, k, pos, cfg, quirk=quirk)
    for key in ("scores", "block_scores"):
        g_, w_ = np.asarray(got[key], np.float64), want[key]
        assert not np.isnan(g_).any()
        np.testing.assert_array_equal(np.isinf(g_), np.isinf(w_), err_msg=key)
        np.testing.assert_allclose(np.where(np.isinf(g_), 0, g_), np.where(np.isinf(w_), 0, w_), rtol=2e-5,
                                   atol=1e-6, err_msg=key)
    np.testing.assert_array_equal(np.asarray(got["topk_idx"]), want["topk_idx"])
    np.testing.assert_array_equal(np.asarray(got["counts"]), want["counts"])
    # the tiled production path gives the same selection (tile does not divide T)
    sel = select_blocks(q, k, q_positions=pos, params=p, q_tile=24)
    np.testing.assert_array_equal(np.asarray(sel.topk_idx), want["topk_idx"])
    np.testing.assert_array_equal(np.asarray(sel.counts), want["counts"])


def test_quirk_drops_exactly_one_kernel_at_15_mod_16():
    """§5.2: with the quirk, every row of an N = 15 mod 16 prefill loses its last visible fine kernel."""
    for n, drops in [(79, True), (80, False), (95, True), (96, False)]:
        pos = _pos(1, n)
        kvl = jnp.array([n])
        nk = num_kernels(n, 32, 16)
        clean = visible_kernel_count(pos, kvl, n, nk, 32, 16, False)
        quirk = visible_kernel_count(pos, kvl, n, nk, 32, 16, True)
        want = np.maximum(np.asarray(clean) - 1, 0) if drops else np.asarray(clean)
        np.testing.assert_array_equal(np.asarray(quirk), want)
        # decode (T = 1) is non-causal in the official code: every cached kernel, clean rule
        last = visible_kernel_count(pos[:, -1:], kvl, 1, nk, 32, 16, True)
        assert int(last[0, 0]) == nk
    # coarse 128/64: N = 63 mod 64
    n = 255
    pos = _pos(1, n)
    nk = num_kernels(n, 128, 64)
    c = visible_kernel_count(pos, jnp.array([n]), n, nk, 128, 64, False)
    qk = visible_kernel_count(pos, jnp.array([n]), n, nk, 128, 64, True)
    np.testing.assert_array_equal(np.asarray(qk), np.maximum(np.asarray(c) - 1, 0))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_quirk_counts_each_sequences_own_rows_in_a_padded_batch(impl):
    """§5.2 quirk per sequence (official varlen: ``Nq`` = the sequence's own rows): a 63-token sequence
    right-padded to 64 (positions ``-1``) selects as it does alone (63 = 15 mod 16 drops a kernel), and a
    1-token sequence padded to 64 keeps the decode (clean) rule. Counting the padded ``T = 64`` rows gave the
    63-token sequence the clean counts and other picks."""
    cfg = dataclasses.replace(SMALL, variant="gen1", topk=2, window_size=16, kernel_size=16, kernel_stride=8)
    p = select_params(cfg, kernel_offby1_quirk=True)
    n = 64
    q, k, _ = _qkv(71, 3, n, 4, 2, 16)
    pos = _pos(3, n).at[1, 63:].set(-1).at[2, 1:].set(-1)
    sel = infllm.select_blocks(q, k, q_positions=pos, params=p, q_tile=16, impl=impl)
    for bi, ln in [(0, 64), (1, 63), (2, 1)]:
        alone = infllm.select_blocks(q[bi:bi + 1, :ln], k[bi:bi + 1, :ln], q_positions=pos[bi:bi + 1, :ln], params=p,
                                     q_tile=16, impl=impl)
        want = _np_selection(q[bi:bi + 1, :ln], k[bi:bi + 1, :ln], pos[bi:bi + 1, :ln], cfg, quirk=True)
        np.testing.assert_array_equal(np.asarray(alone.topk_idx), want["topk_idx"])
        np.testing.assert_array_equal(np.asarray(sel.topk_idx[bi:bi + 1, :, :ln]), want["topk_idx"])
    # the input really exercises the quirk: the clean rule selects otherwise for the 63-token sequence
    clean = _np_selection(q[1:2, :63], k[1:2, :63], pos[1:2, :63], cfg, quirk=False)
    assert (clean["topk_idx"] != np.asarray(sel.topk_idx[1:2, :, :63])).any()
    cnt = visible_kernel_count(pos, jnp.array([64, 63, 1]), jnp.array([64, 63, 1]), num_kernels(n, 16, 8), 16, 8, True)
    np.testing.assert_array_equal(np.asarray(cnt[1, :63]), np.maximum(np.asarray(
        visible_kernel_count(pos[1:2, :63], jnp.array([63]), 63, num_kernels(63, 16, 8), 16, 8, False))[0] - 1, 0))


def test_selection_format_sorted_sentinel_counts():
    cfg = dataclasses.replace(SMALL, variant="gen2", topk=4)
    q, k, _ = _qkv(3, 2, 200, 4, 2, 16)
    pos = _pos(2, 200)
    sel = select_blocks(q, k, q_positions=pos, params=select_params(cfg))
    idx, cnt = np.asarray(sel.topk_idx), np.asarray(sel.counts)
    assert idx.dtype == np.int32 and idx.shape == (2, 2, 200, 4 + 2)
    cols = np.arange(idx.shape[-1])
    valid = cols < cnt[..., None]
    np.testing.assert_array_equal(idx >= 0, valid)  # valid entries first, then only the sentinel
    assert set(np.unique(idx[~valid])) <= {SENTINEL}
    vv = np.where(valid, idx, np.iinfo(np.int32).max)
    assert (np.diff(vv, axis=-1) > 0)[valid[..., 1:]].all()  # strictly ascending valid entries
    qb = np.asarray(pos)[:, None, :] // cfg.block_size
    assert (np.where(valid, idx, 0) <= qb[..., None]).all()


# --------------------------------------------------------------------------------------------- §5.5


@pytest.mark.parametrize("g,d,window", [(1, 8, 0), (2, 12, 2), (4, 16, 0), (8, 8, 3), (16, 4, 0)])
def test_stage2_matches_masked_oracle_fwd_and_grad(g, d, window):
    b, t, nkv, bs = 2, 45, 2, 8
    n = t + 5  # a few trailing keys no query may see
    q, k, v = _qkv(11 + g, b, t, nkv * g, nkv, d, n)
    pos = _pos(b, t, start=3)  # queries at 3..72 against 75 keys
    kvp = _pos(b, n)
    nb = -(-n // bs)
    rng = np.random.default_rng(g)
    kk = 5
    idx = np.full((b, nkv, t, kk), -1, np.int32)
    for bi in range(b):
        for h in range(nkv):
            for ti in range(t):
                c = rng.integers(0, kk + 1)
                idx[bi, h, ti, :c] = np.sort(rng.choice(nb, size=c, replace=False))  # incl. future blocks
    idx = jnp.asarray(idx)
    mask = jnp.asarray(np.stack([
        ref.token_mask(ref.block_mask(np.asarray(idx[bi]), np.asarray(pos[bi]), num_blocks=nb, block_size=bs,
                                      window_blocks=window), np.asarray(pos[bi]), np.asarray(kvp[bi]), bs)
        for bi in range(b)]))

    def f(q, k, v):
        return infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_positions=kvp, block_size=bs, window_blocks=window,
                               q_tile=16)

    def o(q, k, v):
        return naive_masked_attention(q, k, v, mask)

    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(o(q, k, v)), atol=1e-5, rtol=1e-5)
    gout = _rand(99, *q.shape)
    gf = _grads(f, gout, q, k, v)
    go = _grads(o, gout, q, k, v)
    for a, w in zip(gf, go):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("init,window,width,q_tile,sub,start", [
    (1, 3, None, 16, 2, 3),  # forced init + window as dense slices, unaligned tiles spanning 2-3 blocks
    (2, 1, 3, 8, 4, 0),  # a tight gather width (the picks outside the forced set fit in 3 columns)
    (0, 4, None, 5, 1, 7),  # window only, odd tile
    (3, 0, None, 45, 3, 3),  # init only, one tile for all queries
])
def test_stage2_forced_split_matches_masked_oracle(init, window, width, q_tile, sub, start):
    """Forced blocks (init + window) run as dense slices, other picks gathered: equal to the union's mask."""
    b, g, d, nkv, bs = 2, 4, 8, 2, 8
    t = 45
    n = t + start + 4
    q, k, v = _qkv(31 + init, b, t, nkv * g, nkv, d, n)
    pos = _pos(b, t, start=start)
    kvp = _pos(b, n)
    valid = jnp.asarray(np.arange(n)[None, :] < np.array([[n], [n - 6]]))  # batch 1 has unwritten slots
    nb = -(-n // bs)
    rng = np.random.default_rng(init * 10 + window)
    kk = 3 + init + window + 1  # up to 3 other picks + the listed forced ids
    idx = np.full((b, nkv, t, kk), -1, np.int32)
    for bi in range(b):
        for h in range(nkv):
            for ti in range(t):
                qb = int(pos[bi, ti]) // bs
                forced = set(range(min(init, nb))) | set(range(max(0, qb - window + 1), qb + 1))
                others = [x for x in range(nb) if x not in forced]  # incl. future blocks
                c = int(rng.integers(0, min(3, len(others)) + 1))
                picks = list(rng.choice(others, size=c, replace=False)) if c else []
                picks += [x for x in forced if rng.random() < 0.5]  # forced ids may or may not be listed
                idx[bi, h, ti, :len(picks)] = np.sort(picks)
    idx = jnp.asarray(idx)
    mask = jnp.asarray(np.stack([
        ref.token_mask(ref.block_mask(np.asarray(idx[bi]), np.asarray(pos[bi]), num_blocks=nb, block_size=bs,
                                      window_blocks=window, init_blocks=init), np.asarray(pos[bi]),
                       np.asarray(kvp[bi]), bs) & np.asarray(valid[bi])[None, None, :]
        for bi in range(b)]))

    def f(q, k, v):
        return infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_positions=kvp, kv_valid=valid, block_size=bs,
                               window_blocks=window, init_blocks=init, gather_width=width, q_tile=q_tile,
                               gather_tile=sub)

    def o(q, k, v):
        return naive_masked_attention(q, k, v, mask)

    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(o(q, k, v)), atol=1e-5, rtol=1e-5)
    gout = _rand(98, *q.shape)
    for a, w in zip(_grads(f, gout, q, k, v), _grads(o, gout, q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5, rtol=1e-5)


def test_stage2_forced_split_width_bounds_real_selections():
    """The gather widths infllmv2_attention passes never drop a pick of a real selection (both variants)."""
    for variant in ("gen1", "gen2"):
        cfg = dataclasses.replace(SMALL, variant=variant, init_blocks=2, topk=5)
        p = select_params(cfg)
        t = 300
        q, k, _ = _qkv(41, 1, t, 8, 2, 16)
        pos = _pos(1, t)
        sel = select_blocks(q, k, q_positions=pos, params=p)
        k_used = min(p.topk_cfg, -(-t // p.block_size))
        init, window, width = stage2_forced_split(p, k_used)
        assert 0 < width < k_used and init == 2
        full = np.asarray(compact_topk(sel.topk_idx[..., :k_used], pos, block_size=p.block_size, init_blocks=init,
                                       window_blocks=window, width=k_used))
        assert (full[..., width:] == -1).all() and (full[..., width - 1] >= 0).any()  # tight, and never cut


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_attended_fraction_counts_the_oracle_mask(variant):
    """``return_stats``: attended visible keys per query = the NumPy oracle's token mask, averaged / causal."""
    cfg = dataclasses.replace(SMALL, variant=variant)
    b, t = 2, 150
    q, k, v = _qkv(6, b, t, 8, 2, 16)
    pos = _pos(b, t)
    _, sel, stats = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg,
                                       return_selection=True, return_stats=True)
    mask = _attended_mask_np(np.asarray(sel.topk_idx), pos, pos, cfg, t)  # [b, kv, T, N]
    p = select_params(cfg)
    keys = infllm_attention.attended_keys(sel.topk_idx, pos, block_size=cfg.block_size,
                                          window_blocks=p.local_blocks if variant == "gen1" else 0)
    np.testing.assert_array_equal(np.asarray(keys), mask.sum(-1))
    want = (mask.sum(-1) / (np.arange(t) + 1.0)).mean()
    assert 0.2 < want < 0.9
    np.testing.assert_allclose(float(stats["attended_fraction"]), want, rtol=1e-6)
    # a sequence on the dense fallback counts as fully attended
    dl = dataclasses.replace(cfg, dense_len=t + 10)
    _, st = infllmv2_attention(q, jnp.pad(k, ((0, 0), (0, 20), (0, 0), (0, 0))),
                               jnp.pad(v, ((0, 0), (0, 20), (0, 0), (0, 0))), q_positions=pos,
                               kv_positions=_pos(b, t + 20), sparse_cfg=dl, return_stats=True)
    assert float(st["attended_fraction"]) == 1.0


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_full_attention_matches_oracle_on_numpy_selection(variant):
    """Entry point = naive attention with the token mask of the NumPy selection (gen-1 incl. window)."""
    cfg = dataclasses.replace(SMALL, variant=variant)
    b, t, nkv, g, d = 2, 150, 2, 4, 16
    q, k, v = _qkv(5, b, t, nkv * g, nkv, d)
    pos = _pos(b, t)
    out, sel = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, return_selection=True,
                                  attn_q_tile=32, select_q_tile=64)
    want = _np_selection(q, k, pos, cfg)
    np.testing.assert_array_equal(np.asarray(sel.topk_idx), want["topk_idx"])
    mask = _attended_mask_np(want["topk_idx"], pos, pos, cfg, t)
    # the sparse path really drops keys here
    assert mask.sum() < 0.8 * np.tril(np.ones((t, t))).sum() * b * nkv
    np.testing.assert_allclose(np.asarray(out), np.asarray(naive_masked_attention(q, k, v, jnp.asarray(mask))),
                               atol=1e-5, rtol=1e-5)
    jm = selection_block_mask(sel.topk_idx, q_positions=pos, num_blocks=-(-t // cfg.block_size),
                              block_size=cfg.block_size,
                              window_blocks=select_params(cfg).local_blocks if variant == "gen1" else 0)
    np.testing.assert_array_equal(np.asarray(jm)[..., np.arange(t) // cfg.block_size] & np.tril(np.ones((t, t), bool)),
                                  mask)


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_dense_equality_when_selection_covers_prefix(variant):
    cfg = dataclasses.replace(TINY, variant=variant, topk=64)
    q, k, v = _qkv(21, 1, 300, 6, 3, 16)
    pos = _pos(1, 300)
    out = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_attention(q, k, v, q_positions=pos, kv_positions=pos)),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_decode_and_cached_prefill_equal_full_forward(variant):
    """Queries at a cache offset (T = 1 decode and a T = 37 chunk) reproduce rows of the full forward."""
    cfg = dataclasses.replace(SMALL, variant=variant)
    n = 181
    q, k, v = _qkv(31, 2, n, 8, 2, 16)
    pos = _pos(2, n)
    full, fsel = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, return_selection=True)
    for start in (n - 1, n - 37):
        o, s = infllmv2_attention(q[:, start:], k, v, q_positions=pos[:, start:], kv_positions=pos, sparse_cfg=cfg,
                                  return_selection=True)
        np.testing.assert_array_equal(np.asarray(s.topk_idx), np.asarray(fsel.topk_idx[:, :, start:]))
        np.testing.assert_allclose(np.asarray(o), np.asarray(full[:, start:]), atol=1e-6, rtol=1e-6)


def test_dense_fallback_static_and_per_sequence():
    q, k, v = _qkv(41, 2, 256, 8, 2, 16)
    pos = _pos(2, 256)
    dense = dense_attention(q, k, v, q_positions=pos, kv_positions=pos)
    # kv axis shorter than dense_len: statically dense
    o = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos,
                           sparse_cfg=dataclasses.replace(TINY, dense_len=257))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(dense))
    # strict comparison: kv_len == dense_len -> sparse (init + own + previous block of 16: really drops keys)
    cfg = dataclasses.replace(SMALL, dense_len=256, topk=2, window_size=16)
    o_sparse = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos,
                                  sparse_cfg=dataclasses.replace(cfg, dense_len=-1))
    o_eq = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg)
    np.testing.assert_array_equal(np.asarray(o_eq), np.asarray(o_sparse))
    assert float(jnp.abs(o_sparse - dense).max()) > 1e-3
    # mixed batch: sequence 1 holds only 150 tokens (right-padded) -> dense; sequence 0 -> sparse
    cfg = dataclasses.replace(cfg, dense_len=200)
    qpos = pos.at[1, 150:].set(-1)
    valid = jnp.arange(256)[None, :] < jnp.array([[256], [150]])
    o = infllmv2_attention(q, k, v, q_positions=qpos, kv_positions=pos, kv_valid=valid, sparse_cfg=cfg)
    d1 = dense_attention(q[1:, :150], k[1:, :150], v[1:, :150], q_positions=pos[1:, :150], kv_positions=pos[1:, :150])
    np.testing.assert_allclose(np.asarray(o[1:, :150]), np.asarray(d1), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(o[:1]), np.asarray(o_sparse[:1]), atol=1e-6, rtol=1e-6)


def test_use_nope_requires_selection_inputs():
    q, k, v = _qkv(1, 1, 64, 4, 2, 8)
    pos = _pos(1, 64)
    with pytest.raises(ValueError, match="use_nope"):
        infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos,
                           sparse_cfg=dataclasses.replace(TINY, use_nope=True))
    # selection follows q_sel/k_sel (pre-RoPE stand-ins), stage 2 follows q/k
    cfg = dataclasses.replace(SMALL, use_nope=True)
    qs, ks_, _ = _qkv(2, 1, 64, 4, 2, 8)
    out, sel = infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, q_sel=qs, k_sel=ks_,
                                  return_selection=True)
    want = select_blocks(qs, ks_, q_positions=pos, params=select_params(cfg))
    np.testing.assert_array_equal(np.asarray(sel.topk_idx), np.asarray(want.topk_idx))
    np.testing.assert_allclose(np.asarray(out), np.asarray(infllmv2_stage2(q, k, v, sel.topk_idx, q_positions=pos,
                                                                           kv_positions=pos, block_size=16)),
                               atol=1e-6, rtol=1e-6)


def test_bad_positions_and_selection_shapes_are_one_line_errors():
    """The XLA references name a mismatched positions / kv_valid / topk_idx shape or a bad block size in one
    ValueError line. Before, ``infllmv2_stage2`` with ``q_positions`` ``[1, 3]`` for ``T = 40`` returned an
    output (broadcast positions, no error) and the others raised XLA's reshape/broadcast TypeErrors or a
    ZeroDivisionError."""
    from minicpm4_jax.ops import decode_ref  # noqa: PLC0415

    q, k, v = _qkv(3, 1, 40, 4, 2, 16)
    pos = _pos(1, 40)
    idx = jnp.zeros((1, 2, 40, 2), jnp.int32)
    st2 = dict(kv_positions=pos, block_size=16)
    cases = [
        (lambda: infllm_ref.infllmv2_stage2(q, k, v, idx, q_positions=pos[:, :3], **st2), r"q_positions shape \(1, 3\)"),
        (lambda: infllm_ref.infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_positions=pos[:, :30], block_size=16),
         r"kv_positions shape \(1, 30\)"),
        (lambda: infllm_ref.infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_valid=jnp.ones((1, 39), bool), **st2),
         r"kv_valid shape \(1, 39\)"),
        (lambda: infllm_ref.infllmv2_stage2(q, k, v, idx[..., 0], q_positions=pos, **st2), r"topk_idx shape \(1, 2, 40\)"),
        (lambda: infllm_ref.infllmv2_stage2(q, k, v, idx, q_positions=pos, kv_positions=pos, block_size=0),
         "block_size=0"),
        (lambda: infllm_attention.infllmv2_attention(q, k, v, q_positions=pos[:, :30], kv_positions=pos,
                                                     sparse_cfg=SMALL), r"q_positions shape \(1, 30\)"),
        (lambda: infllm_attention.infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos[:, :30],
                                                     sparse_cfg=SMALL), r"kv_positions shape \(1, 30\)"),
        (lambda: infllm_attention.infllmv2_attention(q, k[..., :8], v[..., :8], q_positions=pos, kv_positions=pos,
                                                     sparse_cfg=SMALL), "shape mismatch"),
        (lambda: attention_ref.dense_attention(q, k, v, q_positions=pos[:, :3], kv_positions=pos),
         r"q_positions shape \(1, 3\)"),
        (lambda: decode_ref.sparse_decode_attention(q[:, 0], k.transpose(0, 2, 1, 3)[:, :, :32],
                                                    v.transpose(0, 2, 1, 3)[:, :, :32], idx[:, :, 0],
                                                    q_positions=jnp.arange(2), block_size=16), r"q_positions shape \(2,\)"),
        (lambda: decode_ref.sparse_decode_attention(q[:, 0], k.transpose(0, 2, 1, 3)[:, :, :32],
                                                    v.transpose(0, 2, 1, 3)[:, :, :32], idx[:, :, 0],
                                                    q_positions=jnp.arange(1), block_size=0), "block_size=0"),
        (lambda: decode_ref.dense_decode_attention(q[:, :2], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                                   q_positions=jnp.arange(2)), r"q_positions shape \(2,\)"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            fn()
        assert len(str(e.value).splitlines()) == 1, str(e.value)


# ------------------------------------------------------------------------------- field faults B02-B23
# the XLA reference and the native CPU stage 2 (what attention_impl=auto runs on CPU in float32)
IMPLS = ["xla", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason=f"native kernel unavailable: {native.build_error()}"))]


@pytest.mark.parametrize("impl", IMPLS + [pytest.param("pallas", marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_b02_causality_sparse_forced(variant, impl):
    cfg = dataclasses.replace(TINY, variant=variant, dense_len=0)
    # 8 blocks of 64: K = 6 (gen-2: 4 forced, 2 picked by score; gen-1: the init block and 3 picks + 2 window
    # blocks), so later rows drop blocks and the picks depend on the scores a future token could perturb (at 256
    # tokens every block was attended and the selection could not leak)
    t_len = 512
    q, k, v = _qkv(50, 1, t_len, 8, 2, 32)
    q2, k2, v2 = _qkv(60, 1, t_len, 8, 2, 32)
    pos = _pos(1, t_len)
    f = jax.jit(lambda q, k, v: infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg,
                                                   impl=impl))
    sel = jax.jit(lambda q, k: select_blocks(q, k, q_positions=pos, params=select_params(cfg)).topk_idx)
    base, base_idx = np.asarray(f(q, k, v)), np.asarray(sel(q, k))
    att = np.asarray(selection_block_mask(base_idx, q_positions=pos, num_blocks=8, block_size=64,
                                          window_blocks=2 if variant == "gen1" else 0))
    assert att[:, :, 300:].sum(-1).max() == 6 and not att[:, :, 448:].all()  # blocks really dropped
    # pallas: the Pallas stage-1 and stage-2 kernels in interpret mode (~5 s a call here), fewer cut points; their
    # gradients equal the reference's (tests/test_pallas_sparse.py), so the Jacobian check below is not repeated
    for t in (63, 300, 447) if impl == "pallas" else (0, 31, 47, 63, 100, 255, 300, 447, 511):
        later = (jnp.arange(t_len) > t)[None, :, None, None]
        x2 = (jnp.where(later, q2, q), jnp.where(later, k2, k), jnp.where(later, v2, v))
        o = np.asarray(f(*x2))
        np.testing.assert_array_equal(o[:, : t + 1], base[:, : t + 1])
        np.testing.assert_array_equal(np.asarray(sel(*x2[:2]))[:, :, : t + 1], base_idx[:, :, : t + 1])
    # Jacobian of the output at t w.r.t. inputs after t is exactly zero
    for t in (47, 100) if impl != "pallas" else ():
        gt = jnp.zeros((1, t_len, 8, 32)).at[:, t].set(_rand(7, 1, 8, 32))
        gq, gk, gv = _grads(f, gt, q, k, v)
        for gr in (gq, gk, gv):
            assert np.all(np.asarray(gr)[:, t + 1:] == 0.0)
            assert np.any(np.asarray(gr)[:, : t + 1] != 0.0)
    # kernel j gets non-zero stage-1 weight for query t only if 16j + 31 <= t
    s = np.asarray(selection_scores(q, k, q_positions=pos, params=select_params(cfg))["scores"])
    j = np.arange(s.shape[-1])
    visible = 16 * j[None, :] + 31 <= np.arange(t_len)[:, None]
    assert np.all(s[:, :, ~visible] == 0.0) and np.all(s[:, :, visible] > 0.0)


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_b02_stage1_scores_of_a_row_ignore_later_tokens(variant):
    """B02 on the stage-1 scores themselves, not only through the top-k: the fine compressed keys a row can see,
    its kernel scores and its pooled block scores are bit-identical when every later token changes. A kernel that
    also averaged the token after its window (``k`` shifted by one before compression) leaked that token into the
    rows ending the window and, through gen-1's softmax / gen-2's coarse normaliser, into every score of the row,
    but test_b02_causality_sparse_forced still passed: no top-k pick flipped at its cut points (mutation testing,
    helper 105)."""
    cfg = dataclasses.replace(TINY, variant=variant, dense_len=0)
    p = select_params(cfg)
    t_len = 512
    q, k, _ = _qkv(52, 1, t_len, 8, 2, 32)
    q2, k2, _ = _qkv(62, 1, t_len, 8, 2, 32)
    pos = _pos(1, t_len)
    base = {key: np.asarray(x) for key, x in selection_scores(q, k, q_positions=pos, params=p).items()}
    for t in (31, 47, 63, 100, 127, 255, 447):  # 31 + 16 j: a fine kernel ends there; 127 + 64 j: a coarse one
        later = (jnp.arange(t_len) > t)[None, :, None, None]
        got = selection_scores(jnp.where(later, q2, q), jnp.where(later, k2, k), q_positions=pos, params=p)
        nk = (t + 1 - 32) // 16 + 1  # fine kernels ending at or before t
        np.testing.assert_array_equal(np.asarray(got["ck1"])[:, :nk], base["ck1"][:, :nk], err_msg=f"t={t}")
        for key in ("scores", "block_scores"):
            np.testing.assert_array_equal(np.asarray(got[key])[:, :, : t + 1], base[key][:, :, : t + 1],
                                          err_msg=f"{key}, t={t}")


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_b03_causal_mask_before_topk(variant):
    cfg = dataclasses.replace(TINY, variant=variant, dense_len=0)
    p = select_params(cfg)
    t_len, d = 512, 32
    q, k, _ = _qkv(70, 1, t_len, 8, 2, d)
    u = jnp.ones((d,)) / np.sqrt(d)
    q = q + 3.0 * u
    k = k.at[:, 448:512].add(40.0 * u)  # a very strong key signal in block 7 only
    pos = _pos(1, t_len)
    sel = select_blocks(q, k, q_positions=pos, params=p)
    idx, cnt = np.asarray(sel.topk_idx)[0], np.asarray(sel.counts)[0]
    tt = np.arange(t_len)
    qb = tt // 64
    valid = idx >= 0
    assert np.all(np.where(valid, 64 * idx, 0) <= tt[None, :, None])
    att = np.asarray(selection_block_mask(sel.topk_idx, q_positions=pos, num_blocks=8, block_size=64,
                                          window_blocks=p.local_blocks if variant == "gen1" else 0))[0]
    assert not att[:, tt < 448, 7].any() and att[:, tt >= 448, 7].all()
    assert np.all(64 * np.argwhere(att)[:, 2] <= tt[np.argwhere(att)[:, 1]])
    if variant == "gen2":
        np.testing.assert_array_equal(cnt, np.broadcast_to(np.minimum(p.topk_cfg, qb + 1), cnt.shape))
    else:  # candidates: init blocks and blocks outside the window, all before the current block
        cand = np.array([len({b for b in range(q + 1) if b < min(cfg.init_blocks, q) or b <= q - p.local_blocks})
                         for q in qb])
        np.testing.assert_array_equal(cnt, np.broadcast_to(np.minimum(p.topk_cfg, cand), cnt.shape))
    assert not np.array_equal(att[:, 100], att[:, 500])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ["gen1", "gen2"])
@pytest.mark.parametrize("t_len", [1, 31, 32, 63, 64, 65, 100, 129])
def test_b04_topk_larger_than_block_count(variant, t_len, impl):
    assert _b04_problems(variant, t_len, impl) == []


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
@pytest.mark.parametrize("t_len", [1, 64, 65, 129])
def test_b04_pallas_block_lists_are_checkify_clean(variant, t_len):
    """Thirteenth-session break test: the Pallas path's block lists scattered dropped entries out of bounds
    (``mode="drop"``), so B04's index check failed there although the output was right; the spare slot is now a
    real column."""
    assert _b04_problems(variant, t_len, "pallas") == []


def _b04_problems(variant, t_len, impl) -> list[str]:
    """What field fault B04 finds wrong with ``impl`` at ``t_len`` (empty when nothing)."""
    cfg = dataclasses.replace(TINY, variant=variant, topk=16, dense_len=0)
    p = select_params(cfg)
    q, k, v = _qkv(80 + t_len, 1, t_len, 8, 2, 32)
    pos = _pos(1, t_len)

    def f(q, k, v):
        return infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, return_selection=True,
                                  remat=False, impl=impl)  # checkify cannot trace jax.checkpoint (jax 0.12)

    err, (out, sel) = checkify.checkify(jax.jit(f), errors=checkify.index_checks)(q, k, v)
    idx = np.asarray(sel.topk_idx)
    ref = np.asarray(dense_attention(q, k, v, q_positions=pos, kv_positions=pos))
    checks = {
        f"checkify: {err.get()}": err.get() is None,
        f"shape {idx.shape}": idx.shape == (1, 2, t_len, 16 + (2 if variant == "gen2" else 0)),
        f"sentinels {set(np.unique(idx[idx < 0]).tolist())}": set(np.unique(idx[idx < 0])) <= {SENTINEL},
        f"block {idx.max()} past the last": idx.max() < -(-t_len // 64),
        "output != dense": np.allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5),
    }
    return [what for what, ok in checks.items() if not ok]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gen1", "gen2"])
@pytest.mark.parametrize("t_len", [1, 65, 129])
def test_b04_topk_larger_than_block_count_pallas(variant, t_len):
    """B04 through the Pallas stage-1 and stage-2 kernels (interpret mode): top-k above the block count of a short
    input selects no block past the input (no out-of-range block read) and equals dense attention."""
    cfg = dataclasses.replace(TINY, variant=variant, topk=16, dense_len=0)
    q, k, v = _qkv(80 + t_len, 1, t_len, 8, 2, 32)
    pos = _pos(1, t_len)
    out, sel = jax.jit(lambda q, k, v: infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg,
                                                          return_selection=True, impl="pallas"))(q, k, v)
    idx = np.asarray(sel.topk_idx)
    assert idx.max() < -(-t_len // 64) and set(np.unique(idx[idx < 0])) <= {SENTINEL}
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_attention(q, k, v, q_positions=pos, kv_positions=pos)),
                               atol=1e-5, rtol=1e-5)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_b05_sparse_backward(d, impl):
    t_len, nkv, g = 256, 2, 4
    q, k, v = _qkv(90 + d, 1, t_len, nkv * g, nkv, d)
    pos = _pos(1, t_len)
    gout = _rand(91, 1, t_len, nkv * g, d)

    def grads(fn):
        return _grads(fn, gout, q, k, v)

    # (a) every block selected -> dense causal attention
    cfg = dataclasses.replace(TINY, topk=16, dense_len=0)
    ga = grads(lambda *a: infllmv2_attention(*a, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, impl=impl))
    gd = grads(lambda *a: dense_attention(*a, q_positions=pos, kv_positions=pos))
    for a, w in zip(ga, gd):
        assert _rel(a, w) <= 1e-4
        assert abs(float(jnp.linalg.norm(a)) / float(jnp.linalg.norm(w)) - 1) < 0.01
    # (b) a fixed selection: all causal blocks except two dropped per query (keeping the current block)
    rng = np.random.default_rng(d)
    nb = t_len // 64
    idx = np.full((1, nkv, t_len, nb), -1, np.int32)
    for h in range(nkv):
        for t in range(t_len):
            qb = t // 64
            keep = [b for b in range(qb)]
            for b in rng.choice(qb, size=min(2, qb), replace=False) if qb else []:
                keep.remove(b)
            keep = sorted(keep + [qb])
            idx[0, h, t, : len(keep)] = keep
    idx_j = jax.lax.stop_gradient(jnp.asarray(idx))
    tok = ref.token_mask(ref.block_mask(idx[0], np.arange(t_len), num_blocks=nb, block_size=64, window_blocks=0),
                         np.arange(t_len), np.arange(t_len), 64)[None]
    if impl == "native":  # the same selection through the native forward and its custom VJP
        gb = grads(lambda *a: native_stage2(*a, idx_j, pos, pos, (64, 0, 0, nb, None, 64)))
    else:
        gb = grads(lambda *a: infllmv2_stage2(*a, idx_j, q_positions=pos, kv_positions=pos, block_size=64))
    go = grads(lambda *a: naive_masked_attention(*a, jnp.asarray(tok)))
    for a, w in zip(gb, go):
        assert _rel(a, w) <= 1e-4
        assert abs(float(jnp.linalg.norm(a)) / float(jnp.linalg.norm(w)) - 1) < 0.01


@pytest.mark.parametrize("variant", ["gen1", "gen2"])
def test_b23_early_queries_no_nan(variant):
    cfg = dataclasses.replace(TINY, variant=variant, dense_len=0)
    p = select_params(cfg)
    t_len = 64
    q, k, v = _qkv(100, 1, t_len, 8, 2, 32)
    pos = _pos(1, t_len)
    sc = selection_scores(q, k, q_positions=pos, params=p)
    for key in ("scores", "block_scores"):
        assert not np.isnan(np.asarray(sc[key])).any()
    att = np.asarray(selection_block_mask(sc["topk_idx"], q_positions=pos, num_blocks=1, block_size=64,
                                          window_blocks=p.local_blocks if variant == "gen1" else 0))
    assert att.all()  # t = 0..63: exactly the init block (= the current block), nothing else exists
    idx = np.asarray(sc["topk_idx"])
    assert set(np.unique(idx)) <= ({0, -1} if variant == "gen2" else {-1})
    # longer input: gen-2 rows before the first coarse kernel (t < 127) see +inf scores, never NaN. At T = 64
    # above no coarse kernel exists at all, so only here does a row have coarse kernels none of which it sees
    # (an all -inf softmax); the forcing hides those rows' scores from block_scores, so check the scores too.
    q, k, v = _qkv(101, 1, 200, 8, 2, 32)
    pos = _pos(1, 200)
    sc = selection_scores(q, k, q_positions=pos, params=p)
    for key in ("scores", "block_scores"):
        assert not np.isnan(np.asarray(sc[key])).any(), key
    if variant == "gen2":
        assert np.isinf(np.asarray(sc["scores"])[:, :, 31:127]).any()  # the documented +inf, reached
    # bf16 selection scores (score_dtype, the 8B bf16 training setting): the same rows, no NaN, same early picks
    bf = selection_scores(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), q_positions=pos,
                          params=select_params(cfg, score_dtype="bfloat16"))
    for key in ("scores", "block_scores"):
        assert not np.isnan(np.asarray(bf[key], np.float32)).any(), key
    np.testing.assert_array_equal(np.asarray(bf["topk_idx"])[:, :, :64], np.asarray(sc["topk_idx"])[:, :, :64])

    def f(q, k, v):
        return infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg)

    out = f(q, k, v)
    grads = _grads(f, out, q, k, v)
    assert np.isfinite(np.asarray(out)).all() and all(np.isfinite(np.asarray(x)).all() for x in grads)
    # the same selection with and without jit, and tiled vs untiled
    s2 = select_blocks(q, k, q_positions=pos, params=p, q_tile=7)
    np.testing.assert_array_equal(np.asarray(s2.topk_idx), np.asarray(sc["topk_idx"]))


def test_bf16_smoke():
    cfg = dataclasses.replace(TINY, topk=2, dense_len=0)
    q, k, v = _qkv(110, 1, 320, 8, 2, 32)
    pos = _pos(1, 320)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    o16, sel = infllmv2_attention(*bf, q_positions=pos, kv_positions=pos, sparse_cfg=cfg, return_selection=True,
                                  score_dtype="bfloat16")
    assert o16.dtype == jnp.bfloat16 and np.isfinite(np.asarray(o16, np.float32)).all()
    o32 = infllmv2_stage2(q, k, v, sel.topk_idx, q_positions=pos, kv_positions=pos, block_size=64)
    assert float(jnp.abs(o16.astype(jnp.float32) - o32).max()) < 2e-2
    # bf16 gradients of q, k, v (XLA path) against float32 ones of the same inputs and selection (B05 in bf16:
    # the check was only "finite"); errors relative to the largest entry, the bf16 bound
    gout = _rand(111, 1, 320, 8, 32)
    g16 = _grads(lambda q, k, v: infllmv2_attention(q, k, v, q_positions=pos, kv_positions=pos, sparse_cfg=cfg,
                                                    score_dtype="bfloat16").astype(jnp.float32), gout, *bf)
    f32 = [x.astype(jnp.float32) for x in bf]
    g32 = _grads(lambda q, k, v: infllmv2_stage2(q, k, v, sel.topk_idx, q_positions=pos, kv_positions=pos,
                                                 block_size=64), gout, *f32)
    for a, w in zip(g16, g32):
        assert a.dtype == jnp.bfloat16 and _rel(a.astype(jnp.float32), w) <= 2e-2


def test_stage2_out_of_range_picks_are_unused():
    """Picks at or beyond the key blocks count as unused (the kernels drop them; the reference used to clip them
    onto the last block)."""
    from minicpm4_jax.ops.infllm_ref import infllmv2_stage2

    t, bs = 40, 16  # 3 blocks
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(ks[0], (1, t, 4, 8))
    k = jax.random.normal(ks[1], (1, t, 2, 8))
    v = jax.random.normal(ks[2], (1, t, 2, 8))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    good = jnp.broadcast_to(jnp.array([0, 2, -1], jnp.int32), (1, 2, t, 3))
    bad = jnp.broadcast_to(jnp.array([0, 2, 5], jnp.int32), (1, 2, t, 3))
    kw = dict(q_positions=pos, kv_positions=pos, block_size=bs)
    np.testing.assert_array_equal(np.asarray(infllmv2_stage2(q, k, v, bad, **kw)),
                                  np.asarray(infllmv2_stage2(q, k, v, good, **kw)))


@pytest.mark.parametrize("quirk", [False, True])
def test_stage1_causal_chunks_equal_full_scores(quirk):
    """stage1_scores_causal (gen-2, only the kernels a tile can see, in chunks) equals stage1_scores exactly in
    its 0 / +inf pattern and to rounding elsewhere, for chunks that do and do not divide the kernel count."""
    from minicpm4_jax.infllm.select import stage1_scores, stage1_scores_causal

    rng = np.random.default_rng(5)
    p = select_params(dataclasses.replace(SparseConfig(), dense_len=-1, kernel_size=8, kernel_stride=4,
                                          block_size=8), kernel_offby1_quirk=quirk)
    for b, t, nq, nkv, d, s, off in [(1, 24, 8, 2, 32, 900, 600), (2, 17, 4, 2, 16, 700, 0), (1, 9, 2, 1, 16, 420, 0)]:
        q = jnp.asarray(rng.standard_normal((b, t, nq, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, s, nkv, d)), jnp.float32)
        ck1 = compress_keys(k, p.kernel_size, p.kernel_stride)
        ck2 = compress_keys(k, p.coarse_size, p.coarse_stride)
        pos = jnp.asarray(np.tile(np.arange(off, off + t), (b, 1)), jnp.int32).at[0, -1].set(-1)
        kw = dict(q_positions=pos, kv_len=jnp.full((b,), off + t, jnp.int32), params=p, num_q=t)
        full = np.asarray(stage1_scores(q, ck1, ck2, **kw))
        assert np.isinf(full).any() or off > 0  # rows without a visible coarse kernel occur at the start
        for chunk in (7, 100, 1000):
            got = np.asarray(stage1_scores_causal(q, ck1, ck2, chunk=chunk, **kw))
            np.testing.assert_array_equal(np.isinf(got), np.isinf(full))
            np.testing.assert_array_equal(got == 0, full == 0)
            fin = np.isfinite(full)
            np.testing.assert_allclose(got[fin], full[fin], rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="gen-2"):
        stage1_scores_causal(q, ck1, None, **kw)


def test_select_blocks_with_causal_stage1_equals_untiled_selection():
    """Over 256 fine kernels select_blocks' XLA stage 1 runs by causal chunks; its selection equals the untiled
    stage1_scores -> pooling -> top-k of selection_scores."""
    from minicpm4_jax.infllm.select import select_blocks, selection_scores

    rng = np.random.default_rng(6)
    p = select_params(dataclasses.replace(SparseConfig(), dense_len=-1, kernel_size=8, kernel_stride=4,
                                          block_size=8, topk=6, window_size=16))
    t = 1200  # 299 fine kernels
    q = jnp.asarray(rng.standard_normal((1, t, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    assert compress_keys(k, p.kernel_size, p.kernel_stride).shape[1] > 256
    got = select_blocks(q, k, q_positions=pos, params=p, q_tile=128).topk_idx
    want = selection_scores(q, k, q_positions=pos, params=p)["topk_idx"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_zero_window_is_refused_for_gen1_by_the_api():
    """Thirteenth-session break test: ``window_size=0`` with gen-1 passed the Python API (the YAML validation refuses
    any zero window): the block-0 queries selected nothing (gen-1 invalidates a query's own block) while stage 2
    still forced the init block, so the output did not follow the selection. Gen-2 without a window is consistent
    (test_native_decode covers it)."""
    with pytest.raises(ValueError, match=r"window_size=0 with variant='gen1': gen-1 needs a local window"):
        select_params(SparseConfig(window_size=0, topk=2, variant="gen1", dense_len=0))
    assert select_params(SparseConfig(window_size=0, topk=2, variant="gen2", dense_len=0)).local_blocks == 0
    assert select_params(SparseConfig(window_size=64, topk=2, variant="gen1", dense_len=0)).local_blocks == 1


def test_b23_forced_blocks_win_over_infinite_early_scores():
    """B23, gen-2 rows before the first coarse kernel: their fine-kernel scores are +inf (lse = -inf), tying with
    the forced blocks' +inf; the pooled scores are clamped below +inf so the init, window and own blocks always
    make the top-k (helper 70: without the clamp only the native kernel's comparison test failed). Reference
    only: 7 blocks score +inf at position 100, K = 5, so lax.top_k's lower-index tie rule would drop the own
    block and a window block."""
    cfg = SparseConfig(kernel_size=32, kernel_stride=16, block_size=16, init_blocks=1, window_size=32, topk=3,
                       variant="gen2", dense_len=0)
    p = select_params(cfg)
    q, k, _ = _qkv(7, 1, 112, 4, 2, 32)
    pos = _pos(1, 112)
    sc = selection_scores(q, k, q_positions=pos, params=p)
    t = 100  # no coarse kernel (128 keys) visible yet; fine kernels 0..4 cover blocks 0..5
    assert np.isposinf(np.asarray(sc["scores"])[0, :, t, :5]).all()
    qb = t // cfg.block_size
    forced = {0, *range(qb - p.local_blocks, qb + 1)}
    assert p.topk_cfg < 7 and len(forced) <= p.topk_cfg  # the ties would push forced blocks out
    for h in range(2):
        picked = set(np.asarray(sc["topk_idx"])[0, h, t].tolist())
        assert forced <= picked, (h, sorted(picked), sorted(forced))
