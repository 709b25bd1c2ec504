"""Speculative decoding with the MTP head as the draft, and FR-Spec's frequency-ranked draft vocabulary.

Paper §4.1 (FR-Spec, speculative sampling), spec ``minicpm4_model.md`` §3.4 / §7 (the MTP / EAGLE head, the
FR-Spec token list). One round, per sequence with ``n`` cached tokens, a pending token ``x_n`` (sampled but
not yet cached) and the base hidden state ``h_{n-1}``:

1. **Draft** ``k`` tokens with the MTP head: step 1 reads ``(h_{n-1}, x_n)``; step ``j > 1`` reads the head's
   own previous output in place of the unknown base hidden state (EAGLE chaining). The draft layer has its own
   KV cache (dense attention over the draft inputs of earlier positions, the last ``draft_window`` of them).
   With FR-Spec the draft logits are computed over the ``V'`` most frequent tokens only (rows of the output head
   gathered once) and the draft index ``i`` maps to token ``ids[i]``.
2. **Verify** all ``k`` drafts with one forward of the target over ``[x_n, d_1 .. d_k]`` (``k + 1`` rows).
3. **Accept**: greedy keeps the drafts up to the first that differs from the target's argmax, then the
   target's argmax (identical tokens to plain greedy decoding). Sampling uses exact speculative rejection
   sampling (Leviathan et al. 2023; Chen et al. 2023): draft ``d_j`` drawn from ``q_j`` is accepted with
   probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from
   ``normalise(max(0, p_j - q_j))``; after ``k`` acceptances a bonus token from ``p_{k+1}``. ``p`` is the same
   processed distribution plain sampling draws from (temperature, top-k, top-p, vocabulary limit), so the
   output distribution equals the target's.
4. **Roll back** the rejected tokens by setting the cached lengths (never a reset): stale slots sit beyond the
   length where every reader masks them, and compressed-key rows they completed are recomputed when real
   tokens complete those windows (:func:`~minicpm4_jax.infer.cache.update_compressed` starts at the current
   length). The draft cache is refreshed at the accepted positions with the true base hidden states.

The verify chunk runs the engine's decode attention path, where every row dispatches on its own length
(dense below ``dense_len``, sparse at or above) exactly as token-by-token decoding does, so greedy output stays
identical also when a chunk crosses ``dense_len``.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig
from minicpm4_jax.infer.cache import LayerCache, init_cache, write_tokens
from minicpm4_jax.infer.engine import (GenerationOutput, InferenceEngine, _forward, checked_vocab, decode_mode,
                                       finish)
from minicpm4_jax.infer.sampling import (SamplingParams, greedy_tokens, is_integer, nonfinite_rows, row_keys,
                                         top_k_filter, top_p_filter)
from minicpm4_jax.nn.layers import dtype_of
from minicpm4_jax.nn.mtp import MTPHead, mtp_layer_config
from minicpm4_jax.nn.model import dense_rows
from minicpm4_jax.nn.rope import rope_tables
from minicpm4_jax.ops.decode_ref import dense_decode_attention
from minicpm4_jax.ops.dispatch import native_decode, resolve_impl
from minicpm4_jax.ops.pallas.decode import _MAX_T as PALLAS_MAX_TOKENS

__all__ = ["SpeculativeDecoder", "SpecState", "processed_logits", "build_frequency_ranking", "save_frequency_ranking",
           "load_frequency_ranking", "check_frequency_ranking", "run_ranking_file", "text_acceptance"]


# ----------------------------------------------------------------------------------------------------------
# FR-Spec token ranking
def build_frequency_ranking(token_streams: Iterable[Sequence[int]], size: int, vocab_size: int,
                            eos_id: int | None = None) -> np.ndarray:
    """The ``size`` most frequent token ids, most frequent first (FR-Spec, paper §4.1; spec §7).

    Args:
        token_streams: tokenized corpus (any iterable of id sequences).
        size: ``V'`` (the official files use 8192, 16384 or 32768).
        vocab_size: ids must lie in ``[0, vocab_size)``.
        eos_id: appended when missing, replacing the last entry so the length stays ``size`` (official rule).

    Returns:
        int32 ``[size]``; ties in frequency go to the lower id; ids never seen fill the tail in id order.

    Raises:
        ConfigError: ``size`` outside ``[1, vocab_size]``, an id outside the vocabulary, or ``eos_id`` neither
            ``None`` nor an id of the vocabulary (a tokenizer's "no EOS" ``-1`` became the ranking's last id).
    """
    if not 1 <= size <= vocab_size:
        raise ConfigError(f"FR-Spec vocabulary size {size} must be in [1, vocab_size={vocab_size}]")
    if eos_id is not None and (not is_integer(eos_id) or not 0 <= eos_id < vocab_size):
        raise ConfigError(f"eos_id={eos_id!r} is not an id of the vocabulary [0, {vocab_size}); pass the "
                          "tokenizer's EOS id, or None when it has none")
    counts = np.zeros(vocab_size, np.int64)
    for ids in token_streams:
        a = np.asarray(ids, np.int64)
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            raise ConfigError(f"token id {int(a.max() if a.max() >= vocab_size else a.min())} is outside the "
                              f"vocabulary of {vocab_size}; tokenize with the model's tokenizer")
        counts += np.bincount(a, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))[:size].astype(np.int32)  # count desc, then id asc
    if eos_id is not None and eos_id not in order:
        order[-1] = eos_id
    return order


def save_frequency_ranking(ids: np.ndarray, path: str | Path) -> Path:
    """Write the project's plain format: one decimal id per line (``.txt``), most frequent first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{int(i)}\n" for i in ids))
    tmp.replace(path)
    return path


def run_ranking_file(run_dir: str | Path, size: int) -> Path:
    """A run's FR-Spec ranking of ``size`` tokens: ``<run>/fr_spec/freq_<size>.txt`` (the plain format), else the
    official ``freq_<size>.pt`` beside it when only that exists (the ``.txt`` path when neither does)."""
    txt = Path(run_dir) / "fr_spec" / f"freq_{size}.txt"
    pt = txt.with_suffix(".pt")
    return pt if not txt.is_file() and pt.is_file() else txt


def load_frequency_ranking(path: str | Path, vocab_size: int) -> np.ndarray:
    """Read a ranking in the plain format (:func:`save_frequency_ranking`) or an official ``freq_*.pt``.

    The ``.pt`` file (a ``torch.save``-d list of ids) is read without torch: it is a zip holding a pickle of
    plain ints, unpickled here with a restricted unpickler that accepts nothing but builtins.

    Raises:
        ConfigError: missing or unreadable file, duplicate ids, or ids outside ``[0, vocab_size)``.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"FR-Spec ranking {path} is a directory; pass its freq_N.txt or the official freq_N.pt")
    if not path.is_file():
        raise ConfigError(f"FR-Spec ranking {path} does not exist; build one with "
                          "scripts/build_fr_spec.py or pass the official freq_*.pt")
    import pickle
    import zipfile

    try:
        if path.suffix == ".pt":
            ids = _read_torch_list(path)
        else:
            ids = [int(x) for x in path.read_text().split()]
    except (ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        raise ConfigError(f"cannot read FR-Spec ranking {path}: {e}") from None
    return check_frequency_ranking(ids, vocab_size, f"FR-Spec ranking {path}")


def check_frequency_ranking(ids, vocab_size: int, what: str = "fr_spec_ids") -> np.ndarray:
    """``ids`` as int32 ``[V']`` after checking it is a non-empty 1-D list of distinct integer ids in
    ``[0, vocab_size)``.

    Raises:
        ConfigError: naming ``what`` and the first problem found (a repeated id would make the draft's
        probabilities of that token wrong in sampled speculative decoding).
    """
    a = np.asarray(ids)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        hint = ("; a size is --fr-spec-vocab's: pass the ranking's first ids, load_frequency_ranking(path, "
                "vocab_size)[:size]") if a.ndim == 0 else ""
        raise ConfigError(f"{what} must be a non-empty flat list of integer token ids (got {a.dtype} of shape "
                          f"{a.shape}){hint}")
    if a.min() < 0 or a.max() >= vocab_size:
        raise ConfigError(f"{what} has ids outside [0, {vocab_size}); it was built for another tokenizer")
    if np.unique(a).size != a.size:
        raise ConfigError(f"{what} repeats token ids; each id may appear once (rebuild it)")
    return a.astype(np.int32)


def _read_torch_list(path: Path) -> list[int]:
    import pickle
    import zipfile

    class _Plain(pickle.Unpickler):
        def find_class(self, module, name):  # a list of ints needs no class at all
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a FR-Spec list")

    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
        if name is None:
            raise ValueError("no data.pkl inside: not a torch.save-d file")
        obj = _Plain(z.open(name)).load()
    if not isinstance(obj, list) or not all(isinstance(x, int) for x in obj):
        raise ValueError("expected a torch.save-d list of ints")
    return obj


# ----------------------------------------------------------------------------------------------------------
def text_acceptance(model, tokens, num_draft: int, fr_spec_ids=None, batch_size: int = 8) -> dict:
    """Greedy acceptance of the MTP draft on given text, teacher-forced: tokens per verify if the text were decoded.

    For every start position ``s`` of each row of ``tokens`` the k-draft chain from the true state ``h_s`` is run
    with the text's own tokens as the drafted ones (:meth:`~minicpm4_jax.nn.model.MiniCPM4.mtp_unrolled`, which
    attends exactly what the engine's draft cache holds); draft ``d`` counts while it and all before it equal the
    base model's greedy token at its position. A round of :class:`SpeculativeDecoder` that starts at ``s`` in text
    the model itself generated greedily accepts exactly that many drafts (``tests/test_mtp.py``), so on the model's
    own output this is the decoder's acceptance averaged over every start position instead of over the positions
    its rounds happened to start at; on held-out human text it measures the draft without the model's generation
    (repetition loops, which any draft predicts) in the way. One full forward per row. The equality holds in
    float32 and for text no longer than the decoder's ``draft_window`` (default 1024): the chain here attends all
    earlier positions, and in bfloat16 the cached and the full forward round differently, which flips a few near
    ties.

    Args:
        model: a :class:`~minicpm4_jax.nn.model.MiniCPM4` with its MTP module.
        tokens: int ``[rows, length]`` (``length > num_draft + 1``).
        num_draft: drafts per round ``k >= 1``.
        fr_spec_ids: optional FR-Spec ids (the draft's argmax over these only, as the decoder).
        batch_size: rows per forward.

    Returns:
        ``{"acceptance": mean tokens per verify (1 + accepted drafts), "rate": [P(draft d accepted | drafts before
        it accepted) for d = 1..k], "positions": start positions averaged}``.

    Raises:
        ConfigError: no MTP module, tokens not integer ids of the vocabulary ``[rows >= 1, length]``, rows longer
            than ``max_position_embeddings + 1``, ``num_draft < 1``, text too short for ``num_draft``, bad FR-Spec
            ids, ``batch_size < 1``.
    """
    cfg = model.cfg
    if not cfg.mtp:
        raise ConfigError("this model has no MTP module (model.mtp); text acceptance needs the draft")
    toks = np.asarray(tokens)
    if toks.ndim != 2 or not np.issubdtype(toks.dtype, np.integer) or toks.shape[0] == 0:
        raise ConfigError(f"text_acceptance: tokens must be integer ids [rows >= 1, length] (got {toks.dtype} of "
                          f"shape {toks.shape}); tokenize text first")
    if not is_integer(num_draft) or num_draft < 1 or toks.shape[1] <= num_draft + 1:
        raise ConfigError(f"text_acceptance: tokens {toks.shape} and num_draft={num_draft}: need length > "
                          "num_draft + 1 and an integer num_draft >= 1")
    if toks.min() < 0 or toks.max() >= cfg.vocab_size:
        bad = int(toks.min()) if toks.min() < 0 else int(toks.max())
        raise ConfigError(f"text_acceptance: token id {bad} is outside the model's vocabulary [0, {cfg.vocab_size}); "
                          "was the text tokenized with another tokenizer?")
    if toks.shape[1] - 1 > cfg.max_position_embeddings:
        raise ConfigError(f"text_acceptance: rows of {toks.shape[1]} tokens exceed the model's "
                          f"max_position_embeddings={cfg.max_position_embeddings}; cut the text")
    if not is_integer(batch_size) or batch_size < 1:
        raise ConfigError(f"text_acceptance: batch_size={batch_size!r} must be an integer >= 1")
    counts = chain_counts(model, toks, int(num_draft), fr_spec_ids, batch_size)  # [rows, n]
    k = int(num_draft)
    surv = np.array([counts.size] + [int((counts >= d).sum()) for d in range(1, k + 1)])
    return dict(acceptance=float(1.0 + counts.mean()),
                rate=[float(surv[d] / surv[d - 1]) if surv[d - 1] else float("nan") for d in range(1, k + 1)],
                positions=int(counts.size))


def chain_counts(model, tokens: np.ndarray, num_draft: int, fr_spec_ids=None, batch_size: int = 8) -> np.ndarray:
    """Accepted drafts of the teacher-forced chain started at each position (:func:`text_acceptance`).

    Returns int ``[rows, length - num_draft - 1]``: entry ``[i, r]`` is the number of leading drafts (of
    ``num_draft``) that equal the base model's greedy tokens for the round whose first draft is made from the
    state at position ``r`` (cached length ``r + 1``, pending token ``tokens[i, r + 1]``). Arguments as
    :func:`text_acceptance` (no checks here).
    """
    cfg = model.cfg
    mask = None
    if fr_spec_ids is not None:
        ids = check_frequency_ranking(fr_spec_ids, cfg.vocab_size)
        mask = jnp.full((cfg.padded_vocab_size,), -jnp.inf, jnp.float32).at[jnp.asarray(ids)].set(0.0)
    k = num_draft
    graphdef, state = nnx.split(model)

    @jax.jit
    def count(state, batch):
        m = nnx.merge(graphdef, state)
        h = m.hidden_states(batch[:, :-1])
        base = greedy_tokens(m.logits(h))  # position p's greedy token (x_{p+1})
        agree = []
        for d, o in enumerate(m.mtp_unrolled(h, batch[:, 1:], k), start=1):
            lg = m.logits(o)
            drafts = greedy_tokens(lg if mask is None else lg + mask)  # index r: position r + d - 1, drafts x_{p+2}
            agree.append(drafts[:, :-1] == base[:, d:])
        n = agree[-1].shape[1]
        alive = jnp.cumprod(jnp.stack([a[:, :n] for a in agree], axis=0).astype(jnp.int32), axis=0)  # [k, b, n]
        return alive.sum(axis=0)

    return np.concatenate([np.asarray(count(state, jnp.asarray(tokens[i:i + batch_size], jnp.int32)))
                           for i in range(0, len(tokens), batch_size)], axis=0)


def processed_logits(logits: jax.Array, params: SamplingParams, vocab_limit: int | None = None) -> jax.Array:
    """float32 ``[..., vocab]`` logits whose softmax is exactly what :func:`sample_tokens` draws from."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if params.greedy:
        return logits.astype(jnp.float32)
    scaled = top_k_filter(logits.astype(jnp.float32) / params.temperature, params.top_k)
    return top_p_filter(scaled, params.top_p) if params.top_p < 1.0 else scaled


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Draft:
    mtp: Any
    head_rows: jax.Array  # [V', hidden] output-head rows of the draft vocabulary
    ids: jax.Array  # [V'] draft index -> token id


def _draft_layer(mtp: MTPHead, lc: LayerCache, u, positions, cfg_mtp: ModelConfig, window: int | None = None):
    """One draft step of the MTP decoder layer: ``u [b, 1, H]`` at ``positions [b, 1]`` (``-1`` = inactive) with
    its own (dense) cache, attending only its last ``window`` positions when given. Returns ``(cache, out)``."""
    lc, q = _draft_write(mtp, lc, u, positions, cfg_mtp)
    lc = jax.lax.optimization_barrier(lc)
    decode = dense_decode_attention
    if native_decode(cfg_mtp.attention_impl, lc.k.dtype):
        from minicpm4_jax.ops import native  # noqa: PLC0415

        decode = native.dense_decode_attention
    a = decode(q[:, 0], lc.k, lc.v, q_positions=positions[:, 0], window=window)[:, None]
    return lc, mtp.layer.finish(u, a, cfg_mtp)


def _draft_write(mtp: MTPHead, lc: LayerCache, u, positions, cfg_mtp: ModelConfig):
    """The MTP layer's keys/values of ``u [b, T, H]`` written at ``positions [b, T]`` (``-1`` dropped); returns
    ``(cache, q)`` with the RoPE'd queries ``[b, T, heads, head_dim]``."""
    cos, sin = rope_tables(jnp.maximum(positions, 0), cfg_mtp)
    q, k, v, _, _ = mtp.layer.qkv(u, cos, sin, cfg_mtp)
    return write_tokens(lc, k, v, None, positions), q


def _draft_fill(weights, draft: _Draft, dcache: LayerCache, hidden, tokens, positions, *, cfg, graphdefs, mtp_gd):
    """Write draft-cache entries ``u_i = f(h_i, x_{i+1})`` for ``hidden/tokens/positions [b, T(, H)]``.

    Only the draft layer's keys and values of ``u_i`` go into its cache; they do not depend on attention, so no
    attention or MLP runs here (the layer's outputs at these positions are never read).
    """
    emb = nnx.merge(graphdefs[0], weights.embed)
    mtp = nnx.merge(mtp_gd, draft.mtp)
    dt = dtype_of(cfg.dtype)
    e = emb.encode(tokens, dt) * jnp.asarray(cfg.scale_emb, dt)
    u = mtp.inputs(e, hidden.astype(dt), cfg)
    return _draft_write(mtp, dcache, u, positions, mtp_layer_config(cfg))[0]


def _draft_propose(weights, draft: _Draft, dcache: LayerCache, h0, tok0, pos0, seeds, rnd, *, cfg, graphdefs,
                   mtp_gd, k, sampling, vocab_limit, window=None):
    """``k`` chained draft steps; returns (dcache, draft tokens ``[b, k]``, draft probs ``[b, k, vocab]`` or None).

    The steps run as one ``lax.scan`` over ``j = 0 .. k-1``: one compiled step instead of ``k`` unrolled copies
    (XLA:CPU sets up every operation and constant of a program on each launch: ``k`` copies made the host's part
    of a k = 7 round ~10% longer, ``docs/benchmarks.md``).
    """
    emb = nnx.merge(graphdefs[0], weights.embed)
    mtp = nnx.merge(mtp_gd, draft.mtp)
    cfg_m = mtp_layer_config(cfg)
    dt = dtype_of(cfg.dtype)
    b = tok0.shape[0]
    keys = row_keys(seeds, rnd)
    limit_r = None
    if vocab_limit is not None:
        limit_r = jnp.where(draft.ids < vocab_limit, 0.0, -jnp.inf)

    def step(carry, j):
        dcache, h, tok = carry
        pos = jnp.where(pos0 >= 0, pos0 + j, -1)[:, None]
        e = emb.encode(tok[:, None], dt) * jnp.asarray(cfg.scale_emb, dt)
        u = mtp.inputs(e, h[:, None], cfg)
        dcache, o = _draft_layer(mtp, dcache, u, pos, cfg_m, window)
        x = o[:, 0] / jnp.asarray(cfg.width_mult, dt)
        lr = dense_rows(x, draft.head_rows.astype(dt), out_dtype=jnp.float32)  # [b, V']
        if limit_r is not None:
            lr = lr + limit_r
        if sampling.greedy:
            idx, prob = greedy_tokens(lr), None
        else:
            pl = processed_logits(lr, sampling)
            sub = jax.vmap(lambda kk: jax.random.fold_in(kk, 1000 + j))(keys)
            idx = jax.vmap(jax.random.categorical)(sub, pl)
            q = jax.nn.softmax(pl, axis=-1)
            prob = jnp.zeros((b, cfg.padded_vocab_size), jnp.float32).at[:, draft.ids].set(q)
        tok = draft.ids[idx].astype(jnp.int32)
        return (dcache, o[:, 0], tok), (tok, prob)

    (dcache, _, _), (toks, probs) = jax.lax.scan(step, (dcache, h0.astype(dt), tok0),
                                                 jnp.arange(k, dtype=jnp.int32))
    return dcache, toks.T, (None if probs is None else jnp.swapaxes(probs, 0, 1))


def _accept(logits, drafts, q, seeds, rnd, *, sampling, vocab_limit):
    """Accepted draft count ``a [b]`` and the token after them ``[b]`` from target logits ``[b, k+1, V]``."""
    b, k1, _ = logits.shape
    k = k1 - 1
    pl = processed_logits(logits, sampling, vocab_limit)
    if sampling.greedy:
        t = greedy_tokens(pl)  # [b, k+1]
        ok = drafts == t[:, :k]
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        return a, jnp.take_along_axis(t, a[:, None], axis=1)[:, 0]
    p = jax.nn.softmax(pl, axis=-1)  # [b, k+1, V]
    keys = row_keys(seeds, rnd)
    ku = jax.vmap(lambda kk: jax.random.fold_in(kk, 2000))(keys)
    kr = jax.vmap(lambda kk: jax.random.fold_in(kk, 3000))(keys)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(ku)  # [b, k]
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    acc = u * qd < pd  # u < p/q without dividing (q(d) > 0 for a drawn d)
    a = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)
    pa = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [b, V]
    qa = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1), a[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(pa - qa, 0.0)  # a == k: q row is zero -> p itself (the bonus token)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    dist = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), pa)
    nxt = jax.vmap(lambda kk, d: jax.random.categorical(kk, jnp.log(d)))(kr, dist)
    return a, nxt.astype(jnp.int32)


def _round(weights, draft: _Draft, cache, dcache: LayerCache, h_last, tok, lengths, active, seeds, rnd, *, cfg,
           graphdefs, mtp_gd, k, sampling, vocab_limit, mode, draft_window=None, propose=None):
    """One whole round on the device (draft, verify, accept, draft-cache refresh; module docstring steps 1-4).

    ``lengths`` int32 ``[b]`` cached target tokens per row (setting them is the rollback of the last round's
    rejected tokens), ``active`` bool ``[b]`` (an inactive row's cache, state and length are left as they were).
    Returns ``(cache, dcache, h_last, next_tokens [b], lengths [b], packed)``: the lengths after the round
    (``lengths + accepted + 1`` on active rows, so the next round can start without the host reading this one) and
    int32 ``packed [b, 2k + 4]`` = (accepted drafts, the token after them, the ``k`` drafts, the first verified
    row whose logits hold NaN/Inf (``k + 1``: none), then the attended fraction of each of the ``k + 1`` verified
    rows as float32 bits) per row, so the host reads the round's result in one transfer. Row ``j`` of the verify is the step that produces the round's ``j``-th token, so the host
    averages the fractions of the rows whose tokens it keeps, as plain decoding would. One compiled program per round:
    each eager op between separate programs cost more host time than a draft step. ``propose``: the draft step
    traced into the round (default :func:`_draft_propose`; tests substitute known drafts).
    """
    cache = dataclasses.replace(cache, lengths=lengths)
    pos0 = jnp.where(active, lengths - 1, -1)
    propose = propose or _draft_propose
    dcache, drafts, q = propose(weights, draft, dcache, h_last, tok, pos0, seeds, rnd, cfg=cfg, graphdefs=graphdefs,
                                mtp_gd=mtp_gd, k=k, sampling=sampling, vocab_limit=vocab_limit, window=draft_window)
    chunk = jnp.concatenate([tok[:, None], drafts], axis=1)  # [b, k+1]
    vpos = jnp.where(pos0[:, None] >= 0, pos0[:, None] + 1 + jnp.arange(k + 1, dtype=jnp.int32)[None, :], -1)
    # the decode attention path with per-token dispatch (mode): each verified row sees exactly what a plain decode
    # step at its position would (dense below dense_len, sparse at or above)
    cache, lg, _, hid, rows = _forward(weights, cache, chunk, vpos, jnp.max(vpos, axis=1) + 1, cfg=cfg,
                                       graphdefs=graphdefs, all_rows=True, mode=mode, return_hidden=True,
                                       return_row_fractions=True)
    a, nxt = _accept(lg, drafts, q, seeds, rnd, sampling=sampling, vocab_limit=vocab_limit)
    bad = nonfinite_rows(lg, checked_vocab(cfg, vocab_limit))  # [b, k+1]
    first_bad = jnp.where(jnp.any(bad, axis=1), jnp.argmax(bad, axis=1), k + 1).astype(jnp.int32)
    # refresh the draft cache at the accepted positions n .. n+a-1 with the true hidden states
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    fpos = jnp.where(active[:, None] & (j < a[:, None]), lengths[:, None] + j, -1)
    dcache = _draft_fill(weights, draft, dcache, hid[:, :k], drafts, fpos, cfg=cfg, graphdefs=graphdefs,
                         mtp_gd=mtp_gd)
    h_new = jnp.take_along_axis(hid, a[:, None, None], axis=1)[:, 0]
    h_new = jnp.where(active[:, None], h_new, h_last.astype(h_new.dtype))
    nxt = jnp.where(active, nxt, tok)
    packed = jnp.concatenate([a[:, None], nxt[:, None], drafts, first_bad[:, None],
                              jax.lax.bitcast_convert_type(rows, jnp.int32)], axis=1).astype(jnp.int32)
    return cache, dcache, h_new, nxt, lengths + jnp.where(active, a + 1, 0), packed


@dataclasses.dataclass
class SpecState:
    """Between rounds: the target and draft caches, cached lengths (host ints), ``h_{n-1}`` ``[b, H]`` and the
    pending token ``x_n`` ``[b]`` of every sequence."""

    cache: Any
    dcache: Any
    lengths: list
    h_last: jax.Array
    tok: jax.Array


class SpeculativeDecoder:
    """Speculative generation for an :class:`~minicpm4_jax.infer.engine.InferenceEngine` with an MTP draft.

    Args:
        engine: the target's engine.
        mtp: the :class:`~minicpm4_jax.nn.mtp.MTPHead` trained with the target.
        num_draft: tokens drafted per round (``k``).
        fr_spec_ids: optional FR-Spec ranking (int ``[V']``, most frequent first): the draft head scores only
            these tokens.
        draft_window: the draft layer attends only the last ``draft_window`` positions while drafting (CPM.cu's
            ``spec_window_size``, default 1024 there and here; ``None`` = all). Its cost per draft step then stays
            constant at long contexts; any draft keeps the output exact (step 3), only acceptance can change.

    Raises:
        ConfigError: ``mtp`` not an MTP head (e.g. ``None``: the model was built without ``model.mtp``);
            ``num_draft`` not an integer, ``< 1`` or ``>= max_position_embeddings - 1`` (``> 29`` with
            ``attention_impl: pallas``, whose decode kernel verifies at most 30 tokens); a ranking
            that is empty, not a flat list of integers, repeats an id or has ids outside the vocabulary; or
            ``draft_window < 1``.
    """

    def __init__(self, engine: InferenceEngine, mtp: MTPHead, *, num_draft: int = 3,
                 fr_spec_ids: np.ndarray | None = None, draft_window: int | None = 1024):
        cfg = engine.cfg
        if not isinstance(mtp, MTPHead):
            raise ConfigError(f"SpeculativeDecoder needs the model's MTP draft head, got {type(mtp).__name__}; build "
                              "the model with model.mtp=true (and train it) and pass model.mtp")
        if draft_window is not None and (not is_integer(draft_window) or draft_window < 1):
            raise ConfigError(f"draft_window={draft_window!r} (--draft-window) must be a positive number of "
                              "positions, or None / 0 on the command line for the whole context")
        self._draft_window = None if draft_window is None else int(draft_window)
        if not is_integer(num_draft) or num_draft < 1:
            raise ConfigError(f"num_draft={num_draft!r} (--num-draft) must be an integer >= 1 (tokens drafted per "
                              "round)")
        num_draft = int(num_draft)
        if num_draft >= cfg.max_position_embeddings - 1:
            raise ConfigError(f"num_draft={num_draft} (--num-draft) leaves no room for a verify chunk within "
                              f"max_position_embeddings={cfg.max_position_embeddings}; draft a few tokens (1-8)")
        if resolve_impl(cfg.attention_impl) == "pallas" and num_draft + 1 > PALLAS_MAX_TOKENS:
            raise ConfigError(f"num_draft={num_draft} (--num-draft): with attention_impl='pallas' the verify of k "
                              f"drafts runs the Pallas decode kernel on k + 1 tokens, at most {PALLAS_MAX_TOKENS}; "
                              f"draft at most {PALLAS_MAX_TOKENS - 1} tokens")
        self.engine, self.cfg, self.k = engine, cfg, num_draft
        head = engine.weights.lm_head
        table = nnx.merge(engine._graphdefs[0], engine.weights.embed).embedding[...] if head is None else head.T
        if fr_spec_ids is None:
            ids = jnp.arange(cfg.vocab_size, dtype=jnp.int32)
        else:
            ids = jnp.asarray(check_frequency_ranking(fr_spec_ids, cfg.vocab_size))
        self.vocab_rows = int(ids.shape[0])
        mtp_gd, mtp_state = nnx.split(mtp)
        self._mtp_gd = mtp_gd
        self.draft = _Draft(mtp=mtp_state.to_pure_dict(), head_rows=jnp.take(table, ids, axis=0), ids=ids)
        kw = dict(cfg=cfg, graphdefs=engine._graphdefs, mtp_gd=mtp_gd)
        self._fill = jax.jit(partial(_draft_fill, **kw), donate_argnums=(2,))
        self._rounds = {}
        self._kw = kw
        # The verify's tied head as a [hidden, vocab] copy on CPU: XLA:CPU multiplies the 8 rows of a k = 7
        # verify by the row-major embedding (contracting both minor axes) ~1.6x slower than by its transpose
        # (docs/benchmarks.md); costs one vocab x hidden copy of memory. One-row steps gain nothing from it.
        self._verify_weights = engine.weights
        if head is None and jax.default_backend() == "cpu":
            self._verify_weights = dataclasses.replace(engine.weights, lm_head=jnp.asarray(table.T))

    @property
    def draft_window(self) -> int | None:
        """Positions the draft layer attends while drafting (``None`` = all); fixed at construction."""
        return self._draft_window

    def _round_fn(self, sampling: SamplingParams, vocab_limit: int | None, mode: str) -> Callable:
        key = (sampling, vocab_limit, mode)
        if key not in self._rounds:
            self._rounds[key] = jax.jit(partial(_round, k=self.k, sampling=sampling, vocab_limit=vocab_limit,
                                                mode=mode, draft_window=self.draft_window,
                                                propose=self._draft_step(), **self._kw),
                                        donate_argnums=(2, 3))
        return self._rounds[key]

    def _draft_step(self) -> Callable:
        """The draft proposal each round traces (:func:`_draft_propose`); a test hook for known drafts."""
        return _draft_propose

    def round(self, st: SpecState, active: list[bool], seeds: jax.Array, rnd: int, sampling: SamplingParams,
              vocab_limit: int | None = None) -> tuple:
        """One draft-verify-accept round for the ``active`` sequences (module docstring, steps 1-4), read at once.

        Returns ``(state, accepted, drafts, next_tokens, row_fractions)``: accepted drafts per row (host
        ints), the drafts ``[b, k]``, the token after the accepted ones ``[b]`` and the attended fraction of each
        verified row, float32 ``[b, k + 1]`` (row ``j``: the step that produced the round's ``j``-th token; host
        arrays). ``st`` is consumed: its caches are donated to the round (updated in place); continue from the
        returned state.

        Raises:
            ConfigError: ``active`` does not have one entry per sequence of ``st``, or an active sequence has no
                room for the round's ``k + 1`` tokens in the target or draft cache (size the caches for
                ``length + max_new_tokens + 2 k + 1`` tokens, as :meth:`generate` does).
        """
        b = len(active)
        if b != len(st.lengths) or b != st.tok.shape[0]:
            raise ConfigError(f"active has {b} entries for a state of {st.tok.shape[0]} sequences; give one flag "
                              "per sequence")
        n = list(st.lengths)
        room = min(st.cache.capacity, st.dcache.k.shape[2])
        full = [r for r in range(b) if active[r] and n[r] + self.k + 1 > room]
        if full:
            raise ConfigError(f"sequence {full[0]} holds {n[full[0]]} tokens: a round of {self.k + 1} does not fit "
                              f"in caches of {room} slots; prefill with room for length + max_new_tokens + "
                              f"2 * num_draft + 1 tokens")
        mode = self._mode([n[r] for r in range(b) if active[r]], 0)
        out, _, packed = self._launch(st.cache, st.dcache, st.h_last, st.tok, np.asarray(n, np.int32), active,
                                      seeds, rnd, sampling, vocab_limit, mode)
        acc, d_host, nxt_host, fractions, _ = self._unpack(np.asarray(packed))
        for r in range(b):
            if active[r]:
                n[r] += acc[r] + 1
        cache, dcache, h_last, nxt = out
        return SpecState(cache=cache, dcache=dcache, lengths=n, h_last=h_last, tok=nxt), acc, d_host, nxt_host, fractions

    def _mode(self, lengths: Sequence[int], slack: int) -> str:
        """The verify's :func:`decode_mode` for rows holding ``lengths[r] + [0, slack]`` cached tokens (``slack``:
        the unknown growth of a round still running): right for every length in that range."""
        return decode_mode(self.cfg, [x for n in lengths for x in (n + 1, n + slack + self.k + 1)])

    def _launch(self, cache, dcache, h_last, tok, lengths, active: Sequence[bool], seeds, rnd: int,
                sampling: SamplingParams, vocab_limit: int | None, mode: str) -> tuple:
        """Dispatch one round without waiting for it: ``((cache, dcache, h_last, tok), lengths [b], packed)``,
        all device arrays (:func:`_round`); ``lengths`` a host or a device int32 ``[b]``."""
        cache, dcache, h_last, nxt, new_lengths, packed = self._round_fn(sampling, vocab_limit, mode)(
            self._verify_weights, self.draft, cache, dcache, h_last, tok, lengths, np.asarray(active), seeds,
            np.int32(rnd))  # numpy: no per-argument dispatch on the host
        return (cache, dcache, h_last, nxt), new_lengths, packed

    def _unpack(self, packed: np.ndarray) -> tuple:
        """A round's host result ``packed [b, 2k + 4]`` -> ``(accepted [b] ints, drafts [b, k], next tokens [b],
        row fractions float32 [b, k + 1], first non-finite verify row [b] ints (k + 1: none))``."""
        k = self.k
        fractions = np.ascontiguousarray(packed[:, 3 + k:]).view(np.float32)
        return ([int(x) for x in packed[:, 0]], packed[:, 2:2 + k], packed[:, 1], fractions,
                [int(x) for x in packed[:, 2 + k]])

    def prefill(self, prompts: Sequence[Sequence[int]], tokens: int,
                first_token: Callable[[jax.Array], jax.Array]) -> SpecState:
        """Prefill the target cache (room for ``tokens`` positions) and the draft cache with ``prompts``.

        ``first_token`` maps the float32 logits ``[batch, vocab]`` at each prompt's end to the first new token
        ``[batch]`` (the sampler). Returns the state before the first round, that token pending.

        Raises:
            ConfigError: no prompt, an empty prompt, or a prompt longer than ``tokens``.
        """
        eng, cfg = self.engine, self.cfg
        lens = [len(p) for p in prompts]
        if not lens or min(lens) < 1:
            raise ConfigError("prefill needs at least one prompt and no empty prompt; give some text to continue")
        if max(lens) > tokens:
            raise ConfigError(f"a prompt of {max(lens)} tokens does not fit tokens={tokens}; pass at least the "
                              "longest prompt plus the tokens to generate")
        cache = eng.new_cache(len(prompts), tokens)
        cache, logits, _, hidden = eng.prefill(cache, prompts, return_hidden=True)
        dcache = init_cache(dataclasses.replace(cfg, num_hidden_layers=1, attention="dense"), len(prompts),
                            cache.capacity).layers[0]
        # draft cache entries for positions 0 .. n-2: u_i = f(h_i, x_{i+1})
        width = hidden.shape[1]
        ids = jnp.asarray([list(p[1:]) + [0] * (width - len(p) + 1) for p in prompts], jnp.int32)
        pos = jnp.where(jnp.arange(width)[None, :] < jnp.asarray(lens)[:, None] - 1, jnp.arange(width)[None, :], -1)
        c = eng.chunk_size(width)
        for i in range(-(-width // c)):
            sl = slice(i * c, (i + 1) * c)
            dcache = self._fill(eng.weights, self.draft, dcache, hidden[:, sl], ids[:, sl], pos[:, sl])
        h_last = jnp.take_along_axis(hidden, (jnp.asarray(lens) - 1)[:, None, None], axis=1)[:, 0]
        return SpecState(cache=cache, dcache=dcache, lengths=list(lens), h_last=h_last, tok=first_token(logits))

    def _plain_tail(self, st: SpecState, col: Any, seeds: jax.Array, sampling: SamplingParams,
                    vocab_limit: int | None, fracs: list) -> int:
        """Plain decode steps until every sequence is done (near ``max_position_embeddings``); returns the count.

        A sequence's step that produces its new token ``i`` (counted from 0, token 0 from the prefill) samples with
        ``row_keys(seeds, i)``, as plain decoding does: the keys depend on the sequence alone, not on the rounds its
        batch neighbours ran. The rounds never use these keys (theirs are folded with other constants), so the draws
        stay independent.
        """
        cache = dataclasses.replace(st.cache, lengths=jnp.asarray(st.lengths, jnp.int32))
        step0 = np.asarray([len(o) for o in col.out], np.int32)
        _, steps = self.engine.decode_loop(cache, st.tok, list(st.lengths), col, seeds, step0, sampling, vocab_limit,
                                           fracs)
        return steps

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampling: SamplingParams = SamplingParams(), seeds: Sequence[int] | int = 0,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 detokenize: Callable[[list[int]], str] | None = None, vocab_limit: int | None = None,
                 on_token: Callable[[int, int], None] | None = None, on_nonfinite: str = "raise") -> GenerationOutput:
        """Like :meth:`InferenceEngine.generate`, with draft-and-verify rounds.

        Non-finite logits end a sequence as in :meth:`InferenceEngine.generate` (``on_nonfinite`` the same): the
        prefill's flag comes with the first tokens, a round's with its packed result (the first verified row
        whose logits hold NaN/Inf). A round keeps the tokens its rows before that one produced (the drafts they
        accepted) and ends the sequence at that row's position, the one plain decoding would have stopped at;
        verified rows past the accepted drafts are never read, as plain decoding never computes them.

        The output's ``acceptance_length`` is the number of tokens kept per target forward over the speculative
        rounds (accepted drafts + 1, less any that a stop id, stop string or ``max_new_tokens`` discards);
        ``decode_steps`` counts target forwards after prefill; ``attended_fraction`` is the mean over the kept
        tokens of the fraction the step producing each attended (the verify rows of rejected drafts and discarded
        tokens do not count), so for one sequence it equals plain decoding's.

        Near ``max_position_embeddings`` (when a sequence's next verify chunk would write past the last position)
        that sequence takes no more rounds; its remaining tokens are decoded plainly once the other sequences' rounds
        are done, so a sequence's rounds and tokens do not depend on its batch neighbours (also when sampling).

        Pipelined (the engine's ``pipelined``, the default): round ``i + 1`` is dispatched before the result of round
        ``i`` is read; its lengths come from round ``i`` on the device, its attention mode is the one right for every
        length round ``i`` can leave (:meth:`_mode`). A sequence that stops in round ``i`` therefore runs one more
        round, whose tokens are discarded (counted in ``decode_steps``); a round that must finish a sequence (its
        budget) is not followed by another for it. Tokens, acceptance and fractions equal the sequential loop's.

        Raises:
            ConfigError: as :meth:`InferenceEngine.generate`.
            NonFiniteLogitsError: as :meth:`InferenceEngine.generate`.
        """
        cfg, eng, k = self.cfg, self.engine, self.k
        lens, seeds_arr, first, col = eng._start(prompts, max_new_tokens, sampling, seeds, stop_ids, stop_strings,
                                                 detokenize, vocab_limit, on_token, on_nonfinite)
        b = len(prompts)
        out, reasons, active, take = col.out, col.reasons, col.active, col.take

        t0 = time.perf_counter()
        first_bad = []  # the prefill logits' non-finite flags, read with the first tokens

        def first_token(lg):
            tok, bad = first(lg, seeds_arr)
            first_bad.append(bad)
            return tok

        # room for one round past a sequence's last tokens: the pipelined loop dispatches a round before it has read
        # whether the one before finished the sequence
        state = self.prefill(prompts, max(lens) + max_new_tokens + 2 * k + 1, first_token)
        # wait for the whole prefill (target and draft caches): its time is prefill time, not decode time
        jax.block_until_ready((state.cache, state.dcache, state.h_last))
        tok_host, bad_host = jax.device_get((state.tok, first_bad[0]))
        t1 = time.perf_counter()

        for r in range(b):
            col.take_checked(r, int(tok_host[r]), bool(bad_host[r]))
        rounds, tail_steps, spec_rounds, produced, fracs = 0, 0, 0, 0, []
        max_pos = cfg.max_position_embeddings
        lengths = list(state.lengths)  # cached tokens per row after the rounds read so far (host)
        carry, dev_lengths = (state.cache, state.dcache, state.h_last, state.tok), np.asarray(lengths, np.int32)
        pending = None  # (packed, rows) of the round dispatched and not read yet

        def collect(packed, rows):
            nonlocal spec_rounds, produced
            acc, d_host, nxt_host, row_frac, bad_row = self._unpack(np.asarray(packed))
            for r in range(b):
                if not (rows[r] and active[r]):  # a row that finished in the round before: its result is dropped
                    continue
                lengths[r] += acc[r] + 1
                spec_rounds += 1
                before = len(out[r])
                for j in range(min(acc[r], bad_row[r])):  # verify row j (finite) accepted draft j
                    take(r, int(d_host[r, j]))
                col.take_checked(r, int(nxt_host[r]), bad_row[r] <= acc[r])
                kept = len(out[r]) - before  # tokens after a stop or past max_new_tokens are discarded
                produced += kept
                fracs.extend(float(x) for x in row_frac[r, :kept])

        # rows whose next verify chunk would write past the last position (decided on exact lengths): they take no
        # more rounds and end with plain decode steps once the other rows' rounds are done, so that no row's rounds
        # (and sampled tokens) depend on its batch neighbours
        plain_rows = [False] * b
        while True:
            flying = [False] * b if pending is None else pending[1]
            slack = 0 if pending is None else k + 1  # the running round adds 1 .. k + 1 tokens to each of its rows
            # every round gives a row at least one token: a row the running round must finish is not sent again
            rows = [active[r] and not plain_rows[r] and len(out[r]) + int(flying[r]) < col.max_new for r in range(b)]
            # a row of the running round whose next chunk could write past the last position: read that round first,
            # then decide on the exact lengths
            hold = any(rows[r] and flying[r] and lengths[r] + slack + k >= max_pos for r in range(b))
            if hold:
                rows = [False] * b
            for r in range(b):
                if rows[r] and lengths[r] + k >= max_pos:  # not holding: lengths[r] is exact or far from the limit
                    plain_rows[r], rows[r] = True, False
            launched = None
            if any(rows):
                mode = self._mode([lengths[r] for r in range(b) if rows[r]], slack)
                carry, dev_lengths, packed = self._launch(*carry, dev_lengths, rows, seeds_arr, rounds + 1,
                                                          sampling, vocab_limit, mode)
                rounds += 1
                launched = (packed, rows)
            if pending is not None:  # the previous round's result, read while this one runs
                collect(*pending)
            pending = launched
            if pending is not None and not eng.pipelined:
                collect(*pending)
                pending = None
            if pending is None and not any(rows) and not hold:
                break
        if any(active):  # the rows near the position limit
            st = SpecState(cache=carry[0], dcache=carry[1], lengths=lengths, h_last=carry[2], tok=carry[3])
            tail_steps = self._plain_tail(st, col, seeds_arr, sampling, vocab_limit, fracs)
        t2 = time.perf_counter()
        return finish(GenerationOutput(
            tokens=out, finish_reasons=reasons, prompt_tokens=sum(lens), new_tokens=sum(len(o) for o in out),
            prefill_seconds=t1 - t0, decode_seconds=t2 - t1, decode_steps=rounds + tail_steps,
            attended_fraction=float(np.mean([float(f) for f in fracs])) if fracs else float("nan"),
            acceptance_length=produced / spec_rounds if spec_rounds else float("nan"), nonfinite=col.nonfinite),
            on_nonfinite)
