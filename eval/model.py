"""The model behind every evaluation: a checkpoint, its tokenizer and the inference engine (issue 6).

:class:`EvalModel` offers what RULER, the standard benchmarks and the lm-evaluation-harness backend need,
and nothing evaluation-specific lives in the model or the engine:

* :meth:`EvalModel.generate` -- greedy or sampled continuations through
  :class:`~minicpm4_jax.infer.engine.InferenceEngine` (the project's one KV cache), batched, stop strings and
  EOS honoured, each prompt's tokens depending only on the prompt and its seed (never on the batch).
* :meth:`EvalModel.loglikelihood` / :meth:`EvalModel.loglikelihood_tokens` -- log P(continuation | context) and
  whether the continuation is the greedy one, from one full forward per batch of right-padded rows. The
  context/continuation boundary follows lm-evaluation-harness's ``TemplateLM._encode_pair``
  (:meth:`EvalModel.encode_pair`): the continuation is scored on the *joint* tokenisation of context +
  continuation, so a first continuation token that merges with the context's last characters is scored as
  the model would see it (``field_faults.md`` B19: the logits of continuation token ``j`` are read at input
  position ``len(context) + j - 1``).
* :meth:`EvalModel.loglikelihood_rolling` -- the whole-text log-likelihood over disjoint windows of at most
  ``max_length`` predicted tokens (lm-eval's rolling windows with one token of context).

Documents start with a prefix token: this project's data pipeline separates documents with EOS, so a
checkpoint trained here is prompted after ``[eos_id]`` (``prefix="eos"``); an imported official MiniCPM4
checkpoint expects ``[bos_id]`` (``prefix="bos"``). :meth:`EvalModel.from_checkpoint` (``prefix="auto"``, the
default, as ``minicpm4 generate`` and ``eval``) takes the run's own (:func:`~minicpm4_jax.tokenizer.document_start`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minicpm4_jax.config import ConfigError
from minicpm4_jax.tokenizer import check_tokenizer_vocab

__all__ = ["EvalModel", "joint_encode_pair", "params_hash", "rolling_windows"]

_PREFIXES = ("eos", "bos", "none")


def params_hash(model: Any) -> str:
    """SHA-256 of a model's parameters: sorted paths, dtypes, shapes and bytes (what is evaluated).

    Hashing the loaded arrays rather than the checkpoint files identifies the evaluated weights whatever the
    storage layout (orbax keeps optimizer state in the same files) and sees a ternary checkpoint's
    fake-quantized weights.
    """
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(state), key=lambda kv: jax.tree_util.keystr(kv[0])):
        arr = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def rolling_windows(tokens: Sequence[int], prefix_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Disjoint scoring windows covering ``tokens`` (lm-eval's rolling windows with one context token).

    Every token is predicted exactly once. The first window predicts ``tokens[:max_length]`` after
    ``prefix_id``; each later window predicts up to ``max_length`` further tokens with as much preceding text
    as fits in a ``max_length`` input as its context.

    Args:
        tokens: the text's ids (no prefix).
        prefix_id: the document-start id the first token is predicted from.
        max_length: the model's input length (tokens per forward).

    Returns:
        ``[(context_ids, continuation_ids), ...]`` with ``len(context) + len(continuation) <= max_length + 1``
        and the last context id feeding the first continuation prediction.

    Raises:
        ValueError: ``max_length < 1``.
    """
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be >= 1")
    toks = list(tokens)
    out: list[tuple[list[int], list[int]]] = []
    if not toks:
        return out
    first = min(max_length, len(toks))
    out.append(([prefix_id], toks[:first]))
    done = first
    while done < len(toks):
        n = min(len(toks) - done, max_length)
        end = done + n
        ctx_start = max(0, end - max_length - 1)
        out.append((toks[ctx_start:done], toks[done:end]))
        done = end
    return out


def joint_encode_pair(encode: Callable[[str], Sequence[int]], context: str,
                      continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``(context, continuation)`` on their joint tokenisation (lm-eval ``TemplateLM``).

    Trailing whitespace of the context moves to the front of the continuation; then ``whole =
    encode(context + continuation)``, ``context_ids = encode(context)`` and ``continuation_ids =
    whole[len(context_ids):]``. When the joint tokenisation merges across the boundary so that ``whole``
    does not start with ``context_ids``, the boundary is the longest common prefix instead (the continuation
    then covers every token that differs), so no continuation text is ever scored as context.
    """
    n_space = len(context) - len(context.rstrip())
    if n_space:
        continuation = context[-n_space:] + continuation
        context = context[:-n_space]
    whole = list(encode(context + continuation))
    ctx = list(encode(context)) if context else []
    cut = len(ctx)
    if whole[:cut] != ctx:
        cut = 0
        while cut < min(len(ctx), len(whole)) and ctx[cut] == whole[cut]:
            cut += 1
    return whole[:cut], whole[cut:]


def _bucket(n: int, quantum: int) -> int:
    """``n`` rounded up to a power of two, then to a multiple of ``quantum`` (few distinct jit shapes)."""
    p = 1 << max(0, (n - 1).bit_length())
    return -(-p // quantum) * quantum


@partial(jax.jit, static_argnames=("graphdef", "vocab_limit"))
def _score(graphdef, state, hidden, gather_pos, targets, mask, *, vocab_limit):
    """Per-row sum of target log-probs and all-greedy flags.

    hidden ``[b, L, H]`` final-norm states; gather_pos/targets/mask ``[b, C]``: the position whose logits predict
    each target.
    """
    from flax import nnx

    model = nnx.merge(graphdef, state)
    h = jnp.take_along_axis(hidden, gather_pos[..., None], axis=1)  # [b, C, H]
    logits = model.logits(h).astype(jnp.float32)  # [b, C, V]
    if vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    tok_lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    total = jnp.sum(jnp.where(mask, tok_lp, 0.0), axis=-1)
    all_greedy = jnp.all(greedy | ~mask, axis=-1)
    return total, all_greedy


class EvalModel:
    """A checkpoint of this project ready for evaluation (generation and log-likelihoods).

    Construct with :meth:`from_checkpoint`, or directly from a model and tokenizer.

    Args:
        model: a :class:`~minicpm4_jax.nn.model.MiniCPM4`.
        tokenizer: :class:`~minicpm4_jax.tokenizer.Tokenizer` (``encode`` adds no specials).
        name: a label for reports.
        batch_size: sequences per generation batch / per log-likelihood forward.
        prefill_chunk: the engine's prefill chunk (tokens, a multiple of 16).
        prefix: document-start token: ``"eos"`` (this project's training convention, default), ``"bos"``
            (official MiniCPM ``add_bos_token``) or ``"none"``.
        max_length: the longest input scored/generated (tokens); default ``max_position_embeddings``.
        checkpoint: where the weights came from (for reports).
        progress: show tqdm progress bars.

    Raises:
        ConfigError: bad ``batch_size``, ``prefix`` (or a prefix token the tokenizer lacks), ``max_length``; a
            tokenizer with more tokens than the model's ``vocab_size``.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "minicpm4-jax", batch_size: int = 8,
                 prefill_chunk: int = 512, prefix: str = "eos", max_length: int | None = None,
                 checkpoint: str = "", progress: bool = True):
        from minicpm4_jax.infer.engine import InferenceEngine

        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        if prefix not in _PREFIXES:
            raise ConfigError(f"prefix={prefix!r}; use one of {', '.join(_PREFIXES)}")
        prefix_id = None if prefix == "none" else getattr(tokenizer, f"{prefix}_id", None)
        if prefix != "none" and (prefix_id is None or prefix_id < 0):
            raise ConfigError(f"prefix={prefix!r} but the tokenizer has no {prefix.upper()} token; "
                              "use prefix='none' or another prefix")
        cfg = model.cfg
        check_tokenizer_vocab(tokenizer, cfg.vocab_size)  # ids past the embedding: NaN log-likelihoods
        limit = cfg.max_position_embeddings
        if max_length is not None and not 2 <= max_length <= limit:
            raise ConfigError(f"max_length={max_length} must be in [2, max_position_embeddings={limit}]")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.batch_size = batch_size
        self.prefix_ids: list[int] = [] if prefix_id is None else [int(prefix_id)]
        self.prefix = prefix
        self.max_length = limit if max_length is None else max_length
        self.checkpoint = checkpoint
        self.progress = progress
        self.engine = InferenceEngine(model, prefill_chunk=prefill_chunk)
        self.vocab_limit = min(int(getattr(tokenizer, "vocab_size", cfg.vocab_size)), cfg.vocab_size)
        self._hash: str | None = None
        #: ``(prompt index, position)`` of every generation prompt whose logits went non-finite (:meth:`generate`)
        self.nonfinite_prompts: list[tuple[int, int]] = []
        self._finite_seen = False  # a generation prompt decoded with finite logits throughout
        #: index of every log-likelihood request (of its call) whose score came out NaN/Inf (:meth:`loglikelihood`)
        self.nonfinite_requests: list[int] = []
        self._finite_score_seen = False  # a log-likelihood request scored finite

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, step: int | None = None, attention: str | None = None,
                        batch_size: int = 8, prefill_chunk: int = 512, prefix: str = "auto",
                        max_length: int | None = None, progress: bool = True,
                        path_option: str = "--checkpoint") -> "EvalModel":
        """Load a training run (its ``out_dir`` or ``checkpoints`` folder) and the tokenizer saved beside it.

        Args:
            step: the checkpoint step (default the latest).
            attention: ``None`` (as trained), ``"dense"`` or ``"sparse"`` (InfLLM v2 with the model's
                ``sparse_config``), to evaluate one checkpoint both ways.
            prefix: ``"auto"`` (default): what the run's documents start after
                (:func:`~minicpm4_jax.tokenizer.document_start`: EOS for a run trained here, BOS for an imported
                official checkpoint); or ``"eos"`` / ``"bos"`` / ``"none"`` as :class:`EvalModel`.
            path_option: how the caller's user gave ``path``, named in the errors (``"--checkpoint"``, a
                positional argument's ``"the checkpoint argument"``, lm-eval's ``"checkpoint"`` model argument).

        Raises:
            ConfigError: no checkpoint/tokenizer there, a bad ``attention`` value, or the arguments of
                :class:`EvalModel`.
        """
        from minicpm4_jax.infer.engine import with_attention
        from minicpm4_jax.tokenizer import document_start, load_run_tokenizer
        from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference

        if attention not in (None, "dense", "sparse"):
            raise ConfigError(f"attention={attention!r}; use 'dense', 'sparse' or leave it unset (as trained)")
        if prefix != "auto" and prefix not in _PREFIXES:
            raise ConfigError(f"prefix={prefix!r}; use auto, {', '.join(_PREFIXES)}")
        ckpt_dir = find_checkpoint_dir(path, path_option=path_option)
        tokenizer = load_run_tokenizer(path, ckpt_dir)  # before the parameters: a bad one fails fast
        if prefix == "auto":  # the run's own; nothing when its tokenizer lacks that token (as `generate`)
            prefix = document_start(path, ckpt_dir, tokenizer)
        _cfg, model = load_params_for_inference(ckpt_dir, step)
        own_sparse = model.cfg.sparse_config is not None
        if attention is not None:
            model = with_attention(model, "infllmv2" if attention == "sparse" else "dense")
        out = cls(model, tokenizer, name=Path(path).resolve().name, batch_size=batch_size,
                  prefill_chunk=prefill_chunk, prefix=prefix, max_length=max_length,
                  checkpoint=str(Path(path).resolve()), progress=progress)
        sc = model.cfg.sparse_config
        sparse = attention == "sparse" or (attention is None and model.cfg.attention == "infllmv2")
        if sparse and sc.dense_len > 0 and out.max_length <= sc.dense_len:
            # InfLLM v2 switches per sequence at dense_len: no input this model takes gets past it (helper 65: a
            # `--sparse` RULER run equal to the dense one, labelled sparse)
            print(f"warning: sparse attention with dense_len={sc.dense_len} >= max_length={out.max_length}: a "
                  "sequence shorter than dense_len runs dense attention, so these inputs run dense (at most a "
                  f"last token reaches dense_len); the model has {'its own' if own_sparse else 'no'} sparse_config "
                  "(without one, the MiniCPM4.1 defaults)", file=sys.stderr)
        return out

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def checkpoint_hash(self) -> str:
        """:func:`params_hash` of the evaluated weights (computed once)."""
        if self._hash is None:
            self._hash = params_hash(self.model)
        return self._hash

    def info(self) -> dict[str, Any]:
        """What a results file records about the model."""
        cfg = self.model.cfg
        return {
            "name": self.name, "checkpoint": self.checkpoint, "checkpoint_hash": self.checkpoint_hash,
            "tokenizer": getattr(self.tokenizer, "source", ""),
            "tokenizer_hash": getattr(self.tokenizer, "file_hash", ""),
            "attention": cfg.attention, "max_length": self.max_length, "prefix": self.prefix,
            # the InfLLM v2 settings (dense_len: a sequence shorter than it runs dense attention)
            "sparse_config": (dataclasses.asdict(cfg.sparse_config) if cfg.attention == "infllmv2" else None),
            "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
        }

    # -- generation --------------------------------------------------------------------------------------
    def _bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, disable=not self.progress, leave=False)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] | None = (),
                 temperature: float = 0.0, seed: int = 0, top_p: float = 1.0, top_k: int = 0,
                 truncate: bool = False, return_cuts: bool = False) -> list[str] | tuple[list[str], list[int]]:
        """Continue each prompt; returns the continuation texts (cut before the first stop string, no EOS).

        A sequence ends at the tokenizer's EOS or any other id of the model's ``eos_token_id``
        (:func:`~minicpm4_jax.generate.stop_token_ids`: an official MiniCPM4 also at ``<|im_end|>``, as transformers).

        Prompts are batched longest first (``batch_size`` per batch); prompt ``i`` uses seed ``seed + i``, so
        its text depends only on the prompt and the seed, never on the batching.

        Non-finite logits (NaN/Inf: a bad checkpoint, a bfloat16 overflow; noticed per prompt at every step by the
        engine): while no prompt of this model has yet decoded with finite logits throughout, a batch in which
        every prompt fails raises :class:`~minicpm4_jax.infer.engine.NonFiniteLogitsError` (broken weights fail
        on the first batch, not after thousands of prompts). Otherwise a failing prompt costs only itself: its
        continuation ends before the bad step (scored as it is, usually wrong), a ``warning: prompt i: ...`` line
        goes to stderr, ``(prompt index, position)`` is appended to ``nonfinite_prompts``, and the other prompts
        are unaffected (the engine's rows never depend on their neighbours).

        Args:
            truncate: a prompt longer than ``max_length - max_new_tokens`` tokens keeps its last tokens (after
                the prefix token), as lm-eval's Hugging Face backend cuts ``generate_until`` contexts; without it
                such a prompt is refused (RULER: a needle is never cut away silently).
            return_cuts: also return the prompt tokens cut from each prompt (0 when it fit).

        Raises:
            ConfigError: ``stop`` given as one string or a number instead of a list of texts (``None``: none;
                empty texts are dropped), a stop that is not text, an empty prompt, a prompt +
                ``max_new_tokens`` longer than ``max_length`` (without ``truncate``, or when ``max_new_tokens``
                alone leaves no room), or bad sampling values (one line naming the prompt index).
            NonFiniteLogitsError: (a ``ConfigError``) every prompt of a batch had non-finite logits before any
                prompt of this model decoded cleanly (above).
        """
        from minicpm4_jax.generate import stop_token_ids
        from minicpm4_jax.infer.engine import check_stops
        from minicpm4_jax.infer.sampling import SamplingParams

        # one string refused (as a sequence it is its characters: "\n\n" stopped at the first newline), None = none,
        # a number refused (a TypeError traceback), empty texts dropped (lm-eval passes them)
        _, stop = check_stops((), stop, name="stop", ids_name=None, empty="drop")
        encoded, cuts = [], []
        room = self.max_length - max_new_tokens - len(self.prefix_ids)  # prompt tokens that fit
        for i, p in enumerate(prompts):
            body = list(self.tokenizer.encode(p))
            ids = self.prefix_ids + body
            if not ids:
                raise ConfigError(f"prompt {i} is empty and there is no prefix token; give some text")
            cut = 0
            if len(ids) + max_new_tokens > self.max_length:
                if not truncate or room < 1:
                    raise ConfigError(f"prompt {i} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > "
                                      f"max_length={self.max_length}; shorten it or lower max_new_tokens")
                cut = len(body) - room
                ids = self.prefix_ids + body[cut:]
            encoded.append(ids)
            cuts.append(cut)
        stop_ids = stop_token_ids(self.model.cfg, self.tokenizer)  # the tokenizer's EOS and the model's end ids
        sampling = SamplingParams(temperature, top_k, top_p)
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
        texts: list[str] = [""] * len(encoded)
        with self._bar(len(encoded), "generate") as bar:
            for lo in range(0, len(order), self.batch_size):
                rows = order[lo:lo + self.batch_size]
                out = self.engine.generate([encoded[i] for i in rows], max_new_tokens, sampling=sampling,
                                           seeds=[seed + i for i in rows], stop_ids=stop_ids, stop_strings=stop,
                                           detokenize=self.tokenizer.decode, vocab_limit=self.vocab_limit,
                                           on_nonfinite="keep")
                self._check_finite(out, rows)
                for r, toks in zip(rows, out.tokens):
                    toks = list(toks)
                    if toks and toks[-1] in stop_ids:
                        toks = toks[:-1]
                    text = self.tokenizer.decode(toks)
                    at = [text.index(s) for s in stop if s in text]
                    texts[r] = text[:min(at)] if at else text
                bar.update(len(rows))
        return (texts, cuts) if return_cuts else texts

    def _check_finite(self, out: Any, rows: list[int]) -> None:
        """Apply :meth:`generate`'s non-finite policy to one batch's output (``rows``: the prompts' indices)."""
        from minicpm4_jax.infer.engine import NonFiniteLogitsError

        bad = [(i, p) for i, p in zip(rows, out.nonfinite) if p is not None]
        seen = self._finite_seen
        if bad and len(bad) == len(rows) and not seen:
            raise NonFiniteLogitsError(out, label="prompt", names=rows)
        self._finite_seen = seen or len(bad) < len(rows)
        for (i, p), r in zip(bad, [r for r, q in enumerate(out.nonfinite) if q is not None]):
            self.nonfinite_prompts.append((i, p))
            print(f"warning: prompt {i}: non-finite logits at position {p} (new token {len(out.tokens[r])}): the "
                  "weights or the activations hold NaN/Inf (bf16 overflow: try dtype=float32); its continuation ends "
                  "there and is scored as it is", file=sys.stderr, flush=True)

    # -- log-likelihoods ---------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of ``(context, continuation)`` on their joint tokenisation (:func:`joint_encode_pair`).

        Raises:
            ConfigError: an empty continuation.
        """
        if not continuation:
            raise ConfigError("the continuation is empty; a log-likelihood request needs text to score")
        return joint_encode_pair(self.tokenizer.encode, context, continuation)

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), continuation is greedy)`` per ``(context, continuation)`` pair.

        A NaN/Inf score (non-finite logits) is returned as it is, with a ``warning: ... request i`` line on stderr
        and ``i`` appended to ``nonfinite_requests``; while no request has yet scored finite, a batch whose every
        score is NaN/Inf raises instead (broken weights fail on the first batch).

        Raises:
            ConfigError: an empty continuation, or one that alone exceeds ``max_length``; every score of the first
                batch NaN/Inf.
        """
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in requests])

    def loglikelihood_tokens(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
                             ) -> list[tuple[float, bool]]:
        """Like :meth:`loglikelihood` on token ids; the prefix token is put before each context.

        Inputs longer than ``max_length`` keep their last ``max_length`` tokens (the context is cut from the
        left, as lm-eval does); the log-probs are float32 sums over the continuation tokens, with ids at or
        above the tokenizer's vocabulary (model padding rows) excluded from the softmax.

        Raises:
            ConfigError: an empty continuation, a request with no context and no prefix token, or a
                continuation that alone needs more than ``max_length`` inputs.
        """
        full = []
        for i, (ctx, cont) in enumerate(requests):
            ctx = self.prefix_ids + [int(t) for t in ctx]
            if not cont:
                raise ConfigError(f"request {i} has an empty continuation")
            if not ctx:
                raise ConfigError(f"request {i} has no context and the model has no prefix token "
                                  "(prefix='none'): nothing predicts its first token")
            full.append((ctx, [int(t) for t in cont]))
        return self._loglikelihood(full, "loglikelihood")

    def context_cut(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
        """Context tokens :meth:`loglikelihood_tokens` drops from the left of each ``(context ids, continuation
        ids)`` pair (as :meth:`encode_pair` gives them) to fit ``max_length`` (0 when it fits), so a caller can
        report scores computed on cut contexts."""
        # the last continuation token is only predicted, never an input
        return [max(0, len(self.prefix_ids) + len(ctx) + len(cont) - 1 - self.max_length) for ctx, cont in requests]

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """Log-likelihood of each whole text (every token predicted once; windows of ``max_length``).

        Raises:
            ConfigError: ``prefix='none'`` (the first token needs something to be predicted from).
        """
        if not self.prefix_ids:
            raise ConfigError("loglikelihood_rolling needs a document-start token; use prefix='eos' or 'bos'")
        windows, owner = [], []
        for i, text in enumerate(texts):
            for w in rolling_windows(self.tokenizer.encode(text), self.prefix_ids[0], self.max_length):
                windows.append(w)
                owner.append(i)
        scores = self._loglikelihood(windows, "loglikelihood_rolling") if windows else []
        totals = [0.0] * len(texts)
        for i, (lp, _) in zip(owner, scores):
            totals[i] += lp
        return totals

    def _loglikelihood(self, pairs: list[tuple[list[int], list[int]]], desc: str) -> list[tuple[float, bool]]:
        """Score ``(context_with_prefix, continuation)`` pairs, batched longest first."""
        from flax import nnx

        rows = []
        for i, (ctx, cont) in enumerate(pairs):
            if len(cont) > self.max_length:
                raise ConfigError(f"request {i}: the continuation has {len(cont)} tokens > max_length="
                                  f"{self.max_length}; it cannot be scored in one input")
            whole = (ctx + cont)[-(self.max_length + 1):]
            rows.append((whole[:-1], len(cont)))  # inputs; the targets are whole[1:]
        graphdef, state = nnx.split(self.model)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        with self._bar(len(rows), desc) as bar:
            for lo in range(0, len(order), self.batch_size):
                idx = order[lo:lo + self.batch_size]
                width = _bucket(max(len(rows[i][0]) for i in idx), 16)
                cwidth = _bucket(max(rows[i][1] for i in idx), 1)
                b = self.batch_size
                prompts = [rows[i][0] for i in idx] + [[0]] * (b - len(idx))  # fixed batch: few jit shapes
                pos = np.zeros((b, cwidth), np.int32)
                tgt = np.zeros((b, cwidth), np.int32)
                mask = np.zeros((b, cwidth), bool)
                for r, i in enumerate(idx):
                    inputs, n = rows[i]
                    targets = (pairs[i][0] + pairs[i][1])[-(len(inputs)):]  # whole[1:]
                    start = len(inputs) - n
                    pos[r, :n] = np.arange(start, len(inputs))
                    tgt[r, :n] = targets[start:]
                    mask[r, :n] = True
                # The engine's prefill: each row dispatches dense/sparse on its own length (as a lone forward).
                cache = self.engine.new_cache(b, width)
                _, _, _, hidden = self.engine.prefill(cache, prompts, chunk=min(width, self.engine.prefill_chunk),
                                                      return_hidden=True)
                hidden = jnp.pad(hidden, ((0, 0), (0, width - hidden.shape[1]), (0, 0)))
                total, greedy = _score(graphdef, state, hidden, jnp.asarray(pos), jnp.asarray(tgt),
                                       jnp.asarray(mask), vocab_limit=self.vocab_limit)
                total, greedy = np.asarray(total), np.asarray(greedy)
                for r, i in enumerate(idx):
                    results[i] = (float(total[r]), bool(greedy[r]))
                self._check_finite_scores(idx, total[:len(idx)], desc)
                bar.update(len(idx))
        return results

    def _check_finite_scores(self, idx: list[int], total: np.ndarray, desc: str) -> None:
        """:meth:`generate`'s non-finite policy for one batch of log-likelihood scores (``idx``: request indices):
        while no request has scored finite, a batch of only NaN/Inf scores raises; otherwise each one is a warning
        line and an entry of ``nonfinite_requests``, its score returned as it is."""
        bad = [(i, float(v)) for i, v in zip(idx, total) if not np.isfinite(v)]
        if bad and len(bad) == len(idx) and not self._finite_score_seen:
            first = bad[0][0]
            raise ConfigError(f"{desc}: every request of the first batch ({len(idx)}, e.g. request {first}) scored "
                              "NaN/Inf: the weights or the activations hold NaN/Inf (check the checkpoint; bf16 "
                              "overflow: try dtype=float32)")
        self._finite_score_seen = self._finite_score_seen or len(bad) < len(idx)
        for i, v in bad:
            self.nonfinite_requests.append(i)
            print(f"warning: {desc} request {i}: the score is {v} (non-finite logits: the weights "
                  "or the activations hold NaN/Inf; bf16 overflow: try dtype=float32)", file=sys.stderr, flush=True)
