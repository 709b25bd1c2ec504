"""KV-cache inference engine: chunked prefill, jitted decode steps, dense and InfLLM v2 sparse attention.

Spec ``minicpm4_model.md`` §2 (forward), §5.0 (dense/sparse dispatch), §5.5 (stage 2 with a KV cache),
§5.7 (cache and incremental compression).

* **Prefill** runs the prompts in chunks of ``prefill_chunk`` tokens (one compiled program per chunk
  shape): each chunk writes its keys/values into the cache, adds the compressed-key rows it completes, and
  attends the whole cache. Sequences of a batch may have different lengths (their chunk rows past the
  prompt are padding at position ``-1``, never written).
* **Decode** runs one token per sequence per step under one ``jax.jit`` program for the whole generation
  (static shapes, cache donated so it is updated in place); sampling happens inside the same program.
* **Dispatch** (§5.0, strict ``<``) is decided per sequence on its total length: the whole prompt length
  for every prefill chunk (so chunked prefill equals single-pass prefill), the length including the new
  token at each decode step. A sequence below ``dense_len`` attends densely; at or above, stage 1 scores the
  query against the cached compressed keys and stage 2 reads only the selected blocks
  (:func:`~minicpm4_jax.ops.decode_ref.sparse_decode_attention`).

A cached decode step of a token equals a full forward of the same prefix whenever both make the same
dispatch decision for every earlier token: always for dense models and for sparse models that do not
cross ``dense_len`` after the prompt; across the switch only when the selection covers every causal block
below ``dense_len`` (``dense_len <= K * block_size``), because sparse attention then equals dense there. The
official MiniCPM4.1 settings (``dense_len`` 8192 > 96 * 64) do not: there, as in the official code, tokens
generated between 6144 and 8192 were attended densely, while a fresh forward of the whole sequence would
attend them sparsely.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm4_jax.config import ConfigError, ModelConfig, validate_model
from minicpm4_jax.infer.cache import KVCache, LayerCache, cache_capacity, init_cache, update_compressed, write_tokens
from minicpm4_jax.infer.detok import IncrementalText
from minicpm4_jax.infer.sampling import SamplingParams, is_integer, nonfinite_rows, row_keys, sample_tokens
from minicpm4_jax.infllm.attention import attended_keys, infllmv2_attention, stage2_forced_split
from minicpm4_jax.infllm.select import select_blocks_compressed, select_params
from minicpm4_jax.nn.layers import dtype_of, rms_norm
from minicpm4_jax.nn.model import head_logits
from minicpm4_jax.nn.rope import rope_tables
from minicpm4_jax.ops.attention_ref import dense_attention
from minicpm4_jax.ops.decode_ref import dense_decode_attention, sparse_decode_attention
from minicpm4_jax.ops.dispatch import native_decode, pallas_target, resolve_impl, sparse_impl
from minicpm4_jax.ops.flash_xla import flash_attention
from minicpm4_jax.ops.pallas.decode import dense_decode_attention_pallas, sparse_decode_attention_pallas

__all__ = ["InferenceEngine", "GenerationOutput", "NonFiniteLogitsError", "check_generation_request", "decode_mode",
           "with_attention", "without_prefill_quirk"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Weights:
    embed: Any
    layers: tuple
    norm: jax.Array
    lm_head: jax.Array | None


@dataclasses.dataclass
class GenerationOutput:
    """What :meth:`InferenceEngine.generate` returns.

    Attributes:
        tokens: per sequence, the new token ids (an EOS / stop id that ended it included; for a ``"nonfinite"``
            sequence the tokens before the step whose logits were not finite).
        finish_reasons: per sequence ``"eos"`` (a stop id), ``"stop"`` (a stop string), ``"length"``, or
            ``"nonfinite"`` (its logits held NaN/Inf: it ended there, see :class:`NonFiniteLogitsError`).
        prompt_tokens: tokens prefilled (all sequences).
        new_tokens: tokens generated (all sequences).
        prefill_seconds, decode_seconds: wall time of the two phases (the first call includes compilation).
        decode_steps: decode steps run (each one token for every unfinished sequence; the pipelined loop runs a
            sequence that stopped one step more, see :meth:`InferenceEngine.decode_loop`).
        attended_fraction: mean over the decoded tokens kept (the first token, from prefill, excluded), layers
            and KV heads of attended keys / causal keys (1.0 for dense attention; NaN when no decode step ran).
        acceptance_length: speculative decoding only: tokens produced per sequence per verify forward
            (accepted drafts + 1), averaged over rounds and sequences; NaN otherwise.
        nonfinite: per sequence, the position whose logits held NaN/Inf (the input token's position: the
            logits there would have given new token ``len(tokens[r])``), or ``None`` (all finite).
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    attended_fraction: float
    acceptance_length: float = float("nan")
    nonfinite: list = dataclasses.field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens per second of the decode phase (the first token comes from prefill)."""
        n = self.new_tokens - len(self.tokens)
        return n / self.decode_seconds if self.decode_seconds > 0 and n > 0 else float("nan")


class NonFiniteLogitsError(ConfigError):
    """A sequence's logits held NaN or Inf: its next token would have been garbage (greedy: the first NaN's index).

    Raised by :meth:`InferenceEngine.generate` (and the speculative decoder's) after the whole batch has run; one
    line naming the first such sequence, its position and the likely cause and fix. ``output`` is the complete
    :class:`GenerationOutput`: every other sequence's tokens as if it had run alone, and the refused ones' tokens up
    to the step that failed (finish reason ``"nonfinite"``). ``sequences``: ``[(row, position), ...]``.
    A :class:`~minicpm4_jax.config.ConfigError`: the CLI prints ``error: <message>`` and exits with status 2.
    """

    def __init__(self, output: "GenerationOutput", label: str = "sequence", names: Sequence[int] | None = None):
        """``label``/``names``: how the message names row ``r`` (``f"{label} {names[r]}"``; default its row)."""
        self.output = output
        self.sequences = [(r, p) for r, p in enumerate(output.nonfinite) if p is not None]
        name = (lambda r: r) if names is None else (lambda r: names[r])
        r, p = self.sequences[0]
        rest = [str(name(x)) for x, _ in self.sequences[1:]]
        more = (f" (and {label}{'s' if len(rest) > 1 else ''} {', '.join(rest[:8])}{', ...' if len(rest) > 8 else ''}"
                ")") if rest else ""
        super().__init__(f"non-finite logits for {label} {name(r)} at position {p} (new token "
                         f"{len(output.tokens[r])}){more}: the weights or the activations hold NaN/Inf (check the "
                         "checkpoint; bf16 overflow: try dtype=float32)")


def check_generation_request(cfg: ModelConfig, prompt_lens: Sequence[int], max_new_tokens: int) -> None:
    """Raises :class:`ConfigError` for an empty prompt, ``max_new_tokens < 1`` or a too long request."""
    if not prompt_lens:
        raise ConfigError("no prompts given; pass at least one prompt")
    for i, n in enumerate(prompt_lens):
        if n < 1:
            raise ConfigError(f"prompt {i} is empty; give some text to continue")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} (--max-new-tokens) must be >= 1")
    total = max(prompt_lens) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ConfigError(
            f"prompt ({max(prompt_lens)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}; shorten the prompt or generate fewer tokens"
        )


def with_attention(model: Any, attention: str) -> Any:
    """The same weights under ``model.attention = attention`` (``"dense"`` | ``"infllmv2"``), for inference.

    Switching a dense model to ``infllmv2`` uses its ``sparse_config`` if it has one, else the MiniCPM4.1
    defaults (:class:`~minicpm4_jax.config.SparseConfig`); the InfLLM v2 selection has no parameters, so any
    trained weights run under either algorithm (spec §5.5: dense and sparse share weights and cache).

    Raises:
        ConfigError: an unknown ``attention``, or a sparse geometry the model cannot run (validation message).
    """
    from minicpm4_jax.config import SparseConfig

    if attention not in ("dense", "infllmv2"):
        raise ConfigError(f"attention={attention!r}; use 'dense' or 'infllmv2'")
    cfg = model.cfg
    sc = cfg.sparse_config if cfg.sparse_config is not None else SparseConfig()
    new = dataclasses.replace(cfg, attention=attention, sparse_config=sc if attention == "infllmv2" else cfg.sparse_config)
    return _with_config(model, new)


def _with_config(model: Any, cfg: ModelConfig) -> Any:
    """``model``'s weights under another (validated) config of the same parameter shapes."""
    from minicpm4_jax.nn.model import MiniCPM4

    validate_model(cfg)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: MiniCPM4(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def without_prefill_quirk(model: Any) -> tuple[Any, str | None]:
    """``(model, note)``: a model with ``sparse_config.kernel_offby1_quirk`` set, under the clean causal rule, and a
    one-line note saying so (``(model, None)`` unchanged otherwise).

    The quirk reproduces one official single-pass prefill (spec §5.2: rows lose their last visible kernel at
    lengths ≡ 15 mod 16 / 63 mod 64); official decode steps (``T = 1``) see every complete kernel, as the clean
    rule does. :class:`InferenceEngine` caches and refuses the quirk, so a run trained with it samples, generates
    and evaluates through this.
    """
    cfg = model.cfg
    if cfg.attention != "infllmv2" or cfg.sparse_config is None or not cfg.sparse_config.kernel_offby1_quirk:
        return model, None
    clean = dataclasses.replace(cfg, sparse_config=dataclasses.replace(cfg.sparse_config, kernel_offby1_quirk=False))
    return _with_config(model, clean), ("the model's sparse_config.kernel_offby1_quirk (the official single-pass "
                                        "prefill's stage-1 mask) cannot be cached: generating with the clean causal "
                                        "rule, as official decode steps select")


def decode_mode(cfg: ModelConfig, dispatch_lens: Sequence[int]) -> str:
    """Static attention mode of a decode step from the active sequences' lengths (incl. the new token).

    ``"dense"`` (a dense model, or every sequence below ``dense_len``), ``"sparse"`` (every sequence at or above
    it) or ``"mixed"`` (both kinds in the batch: both paths run and each row takes its own). Chosen on the host
    so the compiled step holds no ``lax.cond`` around the cache (a conditional made XLA copy the whole cache
    every step).
    """
    if cfg.attention != "infllmv2":
        return "dense"
    dl = cfg.sparse_config.dense_len
    if dl <= 0:
        return "sparse"
    below = [n < dl for n in dispatch_lens]
    if not below or all(below):
        return "dense"
    return "sparse" if not any(below) else "mixed"


def _check_prompt_ids(cfg: ModelConfig, prompts: Sequence[Sequence[int]]) -> None:
    """Every prompt is a 1-D sequence of integer ids in ``[0, vocab_size)`` (one-line :class:`ConfigError`)."""
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ConfigError(f"prompt {i} must be a flat list of integer token ids (got {a.dtype} of shape "
                              f"{a.shape}); tokenize text first")
        if a.size and (a.min() < 0 or a.max() >= cfg.vocab_size):
            bad = int(a.min()) if a.min() < 0 else int(a.max())
            raise ConfigError(f"prompt {i} holds token id {bad}, outside the model's vocabulary [0, "
                              f"{cfg.vocab_size}); was it tokenized with another tokenizer?")


def check_prompt_list(prompts: Any) -> list[int]:
    """The length of every prompt of ``prompts`` (a list of token-id lists); one-line :class:`ConfigError` for a
    flat list of ids (one prompt not wrapped in a list), a string, or a prompt that is not a sequence."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ConfigError(f"prompts must be a list of token-id lists, one per sequence (got {type(prompts).__name__}); "
                          "tokenize text first and pass [ids]")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise ConfigError(f"prompt {i} is {p!r} ({type(p).__name__}), not a list of token ids: prompts must be "
                              "a list of token-id lists (pass one prompt as [ids], not ids)")
    return [len(p) for p in prompts]


def check_stops(stop_ids: Any, stop_strings: Any, *, name: str = "stop_strings", ids_name: str | None = "stop_ids",
                empty: str = "refuse") -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(stop_ids, stop_strings)`` as tuples after checking them (one-line :class:`ConfigError`).

    ``stop_ids``: integer token ids; ``stop_strings``: texts. A bare string given as ``stop_strings`` is
    refused: as a sequence it is its characters, so ``stop_strings="END"`` stopped at the first ``E``, ``N`` or ``D``.
    A bare integer given as ``stop_ids`` is refused too (wrap it: ``[2]``), and so is one given as
    ``stop_strings`` (it was a ``TypeError`` traceback). ``None`` means none.

    Args:
        name: the caller's name of ``stop_strings`` in the messages (``EvalModel.generate``: ``"stop"``).
        ids_name: where token ids go instead, named in the messages (``None``: the caller takes no ids).
        empty: an empty stop text is ``"refuse"``-d (it would stop at once) or ``"drop"``-ped (lm-eval passes them
            for "no stop": ``EvalModel.generate``).

    Raises:
        ConfigError: as above, naming ``name``; an empty text with ``empty="refuse"``; a bad ``empty``.
    """
    if empty not in ("refuse", "drop"):
        raise ConfigError(f"empty={empty!r}; use 'refuse' or 'drop'")
    ids_hint = f"(token ids go in {ids_name})" if ids_name else ""
    stop_ids = () if stop_ids is None else stop_ids
    stop_strings = () if stop_strings is None else stop_strings
    if isinstance(stop_strings, (str, bytes)):
        raise ConfigError(f"{name}={stop_strings!r} is one string, which would stop at any of its characters; "
                          f"pass a list of stop texts: [{stop_strings!r}] ({name}=[{stop_strings!r}])")
    try:  # a bare number (or a 0-d array) was a TypeError traceback here
        texts = tuple(stop_strings)
    except TypeError:
        raise ConfigError(f"{name}={stop_strings!r} must be a list of stop texts "
                          f"{ids_hint or '(or None for none)'}") from None  # eval: stop=None is none
    bad = [s for s in texts if not isinstance(s, str)]
    if bad:
        raise ConfigError(f"stop string {bad[0]!r} is not text; {name}= takes texts {ids_hint}".rstrip())
    if empty == "drop":
        texts = tuple(s for s in texts if s)
    elif any(not s for s in texts):
        raise ConfigError("a stop string is empty; give non-empty stop texts")
    try:  # a bare integer (also a 0-d array: iterating it was a TypeError traceback) or a string is no list
        items = None if is_integer(stop_ids) or isinstance(stop_ids, (str, bytes)) else tuple(stop_ids)
    except TypeError:
        items = None
    if items is None:
        hint = f" (e.g. [{stop_ids!r}])" if is_integer(stop_ids) else " (integers; texts go in stop_strings)"
        raise ConfigError(f"stop_ids={stop_ids!r} must be a list of token ids{hint}")
    ids = []
    for i in items:
        try:
            if isinstance(i, (bool, np.bool_)):
                raise TypeError
            ids.append(operator.index(i))  # ints, numpy / 0-d jax integers
        except TypeError:
            raise ConfigError(f"stop id {i!r} is not an integer token id; stop_ids are ids (texts go in "
                              "stop_strings)") from None
    return tuple(ids), texts


def validate_request(cfg: ModelConfig, prompt_lens: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                     seeds: Sequence[int] | int, stop_strings: Sequence[str],
                     detokenize: Callable | None, prompts: Sequence[Sequence[int]] | None = None,
                     vocab_limit: int | None = None) -> jax.Array:
    """Check a generation request (one-line :class:`ConfigError`); return the per-sequence seeds ``uint32 [batch]``.

    Checks the prompt lengths and ``max_new_tokens`` (:func:`check_generation_request`), the prompts' ids when
    given, the sampling values, ``vocab_limit`` (an integer >= 1), the stop strings (a list of non-empty texts,
    :func:`check_stops`) and the seeds (one integer per prompt in ``[0, 2**32)``, or one integer ``s`` giving row
    ``i`` the seed ``s + i``).
    """
    if not is_integer(max_new_tokens):
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} (--max-new-tokens) must be an integer >= 1")
    check_generation_request(cfg, prompt_lens, max_new_tokens)
    if prompts is not None:
        _check_prompt_ids(cfg, prompts)
    sampling.validate()
    if vocab_limit is not None and (not is_integer(vocab_limit) or vocab_limit < 1):
        raise ConfigError(f"vocab_limit={vocab_limit!r} must be an integer >= 1 (ids at or above it are never "
                          "produced; usually the tokenizer's vocabulary size) or None")
    _, stop_strings = check_stops((), stop_strings)  # also refuses an empty stop text
    if stop_strings and detokenize is None:
        raise ConfigError("stop_strings need a detokenize function (the tokenizer's decode)")
    b = len(prompt_lens)
    if is_integer(seeds):
        seed_list = [int(seeds) + i for i in range(b)]
    elif isinstance(seeds, (str, bytes)) or not all(is_integer(x) for x in np.asarray(seeds, dtype=object).ravel()):
        raise ConfigError(f"seeds={seeds!r} must be one integer or a list of integers, one per prompt")
    else:
        seed_list = [int(x) for x in seeds]
    if len(seed_list) != b:
        raise ConfigError(f"{len(seed_list)} seeds for {b} prompts; give one per prompt or a single int")
    bad = [x for x in seed_list if not 0 <= x < 2**32]
    if bad:
        raise ConfigError(f"seed {bad[0]} is outside [0, {2**32 - 1}] (an int seed s gives row i the seed s + i); "
                          "pick a smaller non-negative seed")
    return jnp.asarray(seed_list, jnp.uint32)


class _Collector:
    """New tokens per sequence with the stop rules (stop ids, stop strings, length) and streaming.

    The stop strings are looked for in each sequence's text decoded incrementally (:class:`IncrementalText`, with
    ``detokenize``'s ``byte_value`` attribute when it has one): a bounded window per token, and only the text a
    token changed plus the ``len(longest stop string) - 1`` characters before it.
    """

    def __init__(self, b: int, max_new_tokens: int, stop_ids, stop_strings, detokenize, on_token,
                 prompt_lens: Sequence[int] | None = None):
        self.out: list[list[int]] = [[] for _ in range(b)]
        self.prompt_lens = list(prompt_lens) if prompt_lens is not None else [0] * b
        self.nonfinite: list[int | None] = [None] * b
        self.reasons = ["length"] * b
        self.active = [True] * b
        self.max_new, self.stop_set = max_new_tokens, set(int(i) for i in stop_ids)
        self.stop_strings, self.detokenize, self.on_token = tuple(stop_strings), detokenize, on_token
        self.texts = [IncrementalText(detokenize) for _ in range(b)] if self.stop_strings else []
        self.overlap = max((len(s) for s in self.stop_strings), default=1) - 1

    def take(self, row: int, t: int) -> None:
        """Append token ``t`` to sequence ``row`` unless it has finished; apply the stop rules."""
        if not self.active[row]:
            return
        self.out[row].append(t)
        if self.on_token is not None:
            self.on_token(row, t)
        if t in self.stop_set:
            self.reasons[row], self.active[row] = "eos", False
        elif self.stop_strings and self._stop_string_in(row, t):
            self.reasons[row], self.active[row] = "stop", False
        if self.active[row] and len(self.out[row]) >= self.max_new:
            self.active[row] = False

    def fail(self, row: int) -> None:
        """End sequence ``row`` at its next token, whose logits were not finite (the token is dropped); records the
        position of those logits (``prompt + kept tokens - 1``)."""
        if not self.active[row]:
            return
        self.nonfinite[row] = self.prompt_lens[row] + len(self.out[row]) - 1
        self.reasons[row], self.active[row] = "nonfinite", False

    def take_checked(self, row: int, t: int, bad: bool) -> None:
        """:meth:`take` ``t``, or :meth:`fail` when the logits that gave it were not finite (``bad``)."""
        if bad:
            self.fail(row)
        else:
            self.take(row, t)

    def _stop_string_in(self, row: int, t: int) -> bool:
        """Whether the text of sequence ``row`` holds a stop string once ``t`` is added (searching what changed)."""
        text = self.texts[row]
        region = text.text_from(text.push(t) - self.overlap)
        return any(s in region for s in self.stop_strings)


def finish(output: GenerationOutput, on_nonfinite: str) -> GenerationOutput:
    """``output``, or a :class:`NonFiniteLogitsError` carrying it when a sequence ended on non-finite logits and
    ``on_nonfinite`` is ``"raise"``."""
    if on_nonfinite == "raise" and any(p is not None for p in output.nonfinite):
        raise NonFiniteLogitsError(output)
    return output


def _check_unconsumed(cache: KVCache) -> None:
    """Raise a one-line ``ValueError`` when ``cache``'s buffers were donated to an earlier call (jax's own error,
    "Array has been deleted with shape=int32[1]", named neither the cache nor the fix)."""
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(cache)):
        raise ValueError("this KV cache was consumed by an earlier prefill / extend (its buffers are donated: updated "
                         "in place); continue from the cache that call returned, or pass a copy "
                         "(jax.tree.map(jnp.copy, cache)) to branch")


def _attention(q, q_nope, lc: LayerCache, positions, dispatch_len, cfg: ModelConfig, mode: str):
    """One layer's attention of the chunk's queries over the cache; returns ``(out, fractions)`` with the attended
    fraction of every query row, float32 ``[batch, T]`` (mean over KV heads; a prefill chunk's InfLLM v2 statistic
    is one value for the whole chunk).

    ``mode``: ``"prefill"`` (chunks; per-sequence dispatch on ``dispatch_len`` inside
    :func:`infllmv2_attention`, over a KV-major -> token-major view of the cache) or a decode mode of
    :func:`decode_mode` (a few tokens per sequence, e.g. a decode step or a speculative verify chunk; each row
    dispatches on its own ``position + 1``, reads the KV-major cache directly).
    """
    b, t, nq, d = q.shape
    cap = lc.k.shape[2]
    one = jnp.ones((b, t), jnp.float32)
    impl = resolve_impl(cfg.attention_impl)
    native_select = None  # selection + stage 2 in one native call (decode on CPU, see below)
    if impl == "pallas":
        backend, interpret = pallas_target()
        blk = cfg.sparse_config.block_size if cfg.attention == "infllmv2" else 64
        dense_decode = partial(dense_decode_attention_pallas, block_size=blk, backend=backend, interpret=interpret)
        sparse_decode = partial(sparse_decode_attention_pallas, backend=backend, interpret=interpret)
    elif mode != "prefill" and native_decode(cfg.attention_impl, lc.k.dtype):
        from minicpm4_jax.ops import native  # noqa: PLC0415

        blk = cfg.sparse_config.block_size if cfg.attention == "infllmv2" else 64
        dense_decode = partial(native.dense_decode_attention, block_size=blk)
        sparse_decode = native.decode_attention
        native_select = native.select_decode_attention
    else:
        dense_decode, sparse_decode = dense_decode_attention, sparse_decode_attention
    if mode == "prefill":
        kvp = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (b, cap))
        kt, vt = lc.k.transpose(0, 2, 1, 3), lc.v.transpose(0, 2, 1, 3)
        if cfg.attention == "dense":
            # by blocks (auto): key blocks past the chunk's last position are skipped, not masked
            dense_fn = dense_attention if cfg.attention_impl == "xla" else flash_attention
            return dense_fn(q, kt, vt, q_positions=positions, kv_positions=kvp), one
        sc = cfg.sparse_config
        out, stats = infllmv2_attention(
            q, kt, vt, q_positions=positions, kv_positions=kvp, sparse_cfg=sc, kv_len=dispatch_len,
            q_sel=q_nope if sc.use_nope else None, compressed=(lc.ck1, lc.ck2), remat=False, return_stats=True,
            impl=sparse_impl(cfg.attention_impl, q.dtype), flash_dense=cfg.attention_impl != "xla")
        return out, jnp.broadcast_to(stats["attended_fraction"].astype(jnp.float32), (b, t))
    # decode modes: every query row dispatches on its own length (position + 1), as token-by-token decoding does
    if mode == "dense":
        return dense_decode(q, lc.k, lc.v, q_positions=positions), one
    sc = cfg.sparse_config
    active = positions >= 0  # [b, t]
    dl = sc.dense_len
    use_dense = (positions + 1 < dl) if (dl > 0 and mode == "mixed") else jnp.zeros((b, t), bool)
    params = select_params(sc)
    nb = cap // sc.block_size
    k_used = min(params.topk_cfg, nb)
    window = params.local_blocks if params.variant == "gen1" else 0
    q_sel = q_nope if sc.use_nope else q
    init, win, width = stage2_forced_split(params, k_used)
    if native_select is not None and native.supports_selection(params):
        # rows decoded densely get position -1 here: no picks, zero output (replaced below); their attended
        # fraction is 1 whatever their picks
        out, idx = native_select(q, lc.k, lc.v, lc.ck1, lc.ck2, q_positions=jnp.where(use_dense, -1, positions),
                                 params=params, init_blocks=init, window_blocks=win, gather_width=width,
                                 q_sel=q_sel if sc.use_nope else None)
        idx = idx[..., :k_used]
    else:
        sel = select_blocks_compressed(q_sel, lc.ck1, lc.ck2, q_positions=positions, params=params, num_blocks=nb,
                                       kv_len=jnp.max(positions, axis=1) + 1, q_tile=t, impl=impl)
        idx = sel.topk_idx[..., :k_used]  # [b, kv, t, K]
        out = sparse_decode(q, lc.k, lc.v, idx, q_positions=jnp.where(use_dense, -1, positions),
                            block_size=sc.block_size, window_blocks=win, init_blocks=init, gather_width=width)
    keys = attended_keys(idx, positions, block_size=sc.block_size, window_blocks=window).astype(jnp.float32)
    if mode == "mixed":
        dense = dense_decode(q, lc.k, lc.v, q_positions=jnp.where(use_dense, positions, -1))
        out = jnp.where(use_dense[:, :, None, None], dense, out)
    per_row = jnp.where(use_dense[:, None, :], 1.0,
                        keys / jnp.maximum(positions + 1, 1).astype(jnp.float32)[:, None, :])  # [b, kv, t]
    return out, jnp.where(active, jnp.mean(per_row, axis=1), 0.0)


def _forward(weights: _Weights, cache: KVCache, ids: jax.Array, positions: jax.Array, dispatch_len: jax.Array, *,
             cfg: ModelConfig, graphdefs: tuple, all_rows: bool = False, mode: str = "prefill",
             return_hidden: bool = False, return_row_fractions: bool = False):
    """Run ``ids [batch, T]`` at ``positions [batch, T]`` (``-1`` = padding) through the cached model.

    Returns ``(cache, logits, attended_fraction)``: logits float32 ``[batch, vocab]`` of each sequence's last
    non-padding row (``[batch, T, vocab]`` with ``all_rows``) and the attended fraction averaged over the layers
    and the non-padding rows; with ``return_hidden`` also the final-norm hidden states ``[batch, T, hidden]`` of
    every row (the MTP draft's input); with ``return_row_fractions`` last the fraction of every row, float32
    ``[batch, T]`` (0 for padding).
    """
    emb_gd, layer_gd = graphdefs
    dt = dtype_of(cfg.dtype)
    b, t = ids.shape
    embed = nnx.merge(emb_gd, weights.embed)
    x = embed.encode(ids, dt) * jnp.asarray(cfg.scale_emb, dt)
    cos, sin = rope_tables(jnp.maximum(positions, 0), cfg)
    valid = positions >= 0
    old_len = cache.lengths
    new_len = jnp.maximum(old_len, jnp.max(jnp.where(valid, positions + 1, 0), axis=1)).astype(jnp.int32)
    sparse = cfg.attention == "infllmv2"
    new_layers, fracs = [], []
    for lstate, lc in zip(weights.layers, cache.layers):
        layer = nnx.merge(layer_gd, lstate)
        q, k, v, q_nope, k_nope = layer.qkv(x, cos, sin, cfg)
        # Materialise each in-place update before anything reads the cache: without the barriers XLA fuses the
        # update into its readers (attention, the compressed-key windows) and copies the whole cache every
        # step (decode 4-6x slower at 16K).
        lc = jax.lax.optimization_barrier(write_tokens(lc, k, v, k_nope if lc.k_sel is not None else None, positions))
        if sparse:
            lc = jax.lax.optimization_barrier(update_compressed(lc, cfg, old_len, new_len, t))
        a, frac = _attention(q, q_nope, lc, positions, dispatch_len, cfg, mode)
        x = layer.finish(x, a, cfg)
        new_layers.append(lc)
        fracs.append(frac)
    hidden = rms_norm(x, weights.norm, cfg.rms_norm_eps)
    h = hidden
    if not all_rows:
        last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = head_logits(h, cfg, embed, weights.lm_head)
    rows = jnp.mean(jnp.stack(fracs), axis=0)  # [b, t]
    frac = jnp.sum(jnp.where(valid, rows, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    out = (KVCache(layers=tuple(new_layers), lengths=new_len), logits, frac)
    out = out + (hidden,) if return_hidden else out
    return out + (rows,) if return_row_fractions else out


def _decode_step(weights, cache, tokens, active, seeds, step, *, cfg, graphdefs, sampling, vocab_limit, mode):
    pos = jnp.where(active, cache.lengths, -1)[:, None]
    cache, logits, _, rows = _forward(weights, cache, tokens[:, None], pos, cache.lengths + 1, cfg=cfg,
                                      graphdefs=graphdefs, mode=mode, return_row_fractions=True)
    nxt = sample_tokens(logits, row_keys(seeds, step), sampling, vocab_limit)
    return cache, jnp.where(active, nxt, 0), rows[:, 0], active & nonfinite_rows(logits, checked_vocab(cfg, vocab_limit))


def checked_vocab(cfg: ModelConfig, vocab_limit: int | None) -> int:
    """The ids whose logits must be finite: below ``vocab_limit`` and ``cfg.vocab_size`` (the padding columns of a
    padded vocabulary are ``-inf`` by design, :func:`~minicpm4_jax.nn.model.head_logits`)."""
    return cfg.vocab_size if vocab_limit is None else min(int(vocab_limit), cfg.vocab_size)


def _first_tokens(logits, seeds, *, sampling, vocab_limit, checked):
    """The first new token of every sequence int32 ``[b]`` and whether its logits (ids below ``checked``) were not
    finite, bool ``[b]``."""
    return sample_tokens(logits, row_keys(seeds, 0), sampling, vocab_limit), nonfinite_rows(logits, checked)


class InferenceEngine:
    """Generation with a KV cache for a :class:`~minicpm4_jax.nn.model.MiniCPM4` (dense or InfLLM v2).

    Args:
        model: the model; its weights are split per layer once (the engine keeps its own references).
        prefill_chunk: prompt tokens per prefill step (a multiple of 16; shorter prompts use one smaller
            chunk rounded up to 16).
        pipelined: dispatch each decode step before reading the previous one's tokens (:meth:`decode_loop`);
            ``False`` reads every step's tokens before the next is dispatched (the benchmark's baseline).

    Raises:
        ConfigError: an invalid model config (``validate_model``, e.g. Pallas with dense attention), the
            prefill-parity ``kernel_offby1_quirk`` (it describes one single-pass official prefill, not a
            cache), or a bad ``prefill_chunk``.
    """

    def __init__(self, model: Any, *, prefill_chunk: int = 512, pipelined: bool = True):
        cfg: ModelConfig = model.cfg
        validate_model(cfg)  # e.g. attention_impl='pallas' with dense attention, before any work
        if cfg.attention == "infllmv2" and cfg.sparse_config.kernel_offby1_quirk:
            raise ConfigError("sparse_config.kernel_offby1_quirk=true reproduces one official single-pass prefill "
                              "and cannot be cached; generate with model.sparse_config.kernel_offby1_quirk=false "
                              "(without_prefill_quirk(model))")
        if not is_integer(prefill_chunk) or prefill_chunk < 16 or prefill_chunk % 16:
            raise ConfigError(f"prefill_chunk={prefill_chunk!r} must be a positive multiple of 16")
        self.cfg = cfg
        self.prefill_chunk = int(prefill_chunk)
        self.pipelined = pipelined
        emb_gd, emb_state = nnx.split(model.embed_tokens)
        layer_gd, stacked = nnx.split(model.layers)
        layers = tuple(jax.tree.map(lambda a, i=i: a[i], stacked).to_pure_dict()
                       for i in range(cfg.num_hidden_layers))
        lm_head = None if cfg.tie_word_embeddings else model.lm_head[...]
        # plain dicts of arrays (nnx.merge takes them): every jitted call flattens its arguments on the host,
        # and nnx States flatten in Python (~60 us per decode step for cpu_tiny, ~13 us as dicts)
        self.weights = _Weights(emb_state.to_pure_dict(), layers, model.norm[...], lm_head)
        self._graphdefs = (emb_gd, layer_gd)
        self._forward = jax.jit(partial(_forward, cfg=cfg, graphdefs=self._graphdefs),
                                static_argnames=("all_rows", "mode", "return_hidden"), donate_argnums=(1,))
        self._decode = {}
        self._first = {}

    # -- building blocks ---------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, tokens: int) -> KVCache:
        """An empty cache for ``batch_size`` sequences of up to ``tokens`` positions (rounded up)."""
        return init_cache(self.cfg, batch_size, cache_capacity(self.cfg, tokens))

    def chunk_size(self, longest_prompt: int) -> int:
        """Prefill chunk length used for prompts of at most ``longest_prompt`` tokens."""
        return min(self.prefill_chunk, -(-longest_prompt // 16) * 16)

    def prefill(self, cache: KVCache, prompts: Sequence[Sequence[int]], chunk: int | None = None,
                all_rows: bool = False, return_hidden: bool = False) -> tuple:
        """Feed ``prompts`` (one per cache row, any lengths) into an empty ``cache`` in chunks.

        ``cache`` is consumed (donated: updated in place); continue from the returned cache.

        Returns:
            ``(cache, logits, attended_fraction)``: float32 logits ``[batch, vocab]`` at each prompt's last
            token (``[batch, max_prompt, vocab]`` with ``all_rows``, padding rows undefined), and the mean
            attended fraction of the chunks (per chunk: over layers and non-padding query rows); with
            ``return_hidden`` also the final-norm hidden states ``[batch, max_prompt, hidden]``.
        """
        _check_unconsumed(cache)
        b = cache.batch_size
        if len(prompts) != b:
            raise ValueError(f"{len(prompts)} prompts for a cache of batch {b}")
        lens = [len(p) for p in prompts]
        longest = max(lens)
        if longest > cache.capacity:
            raise ValueError(f"a prompt of {longest} tokens does not fit a cache of {cache.capacity} slots")
        c = self.chunk_size(longest) if chunk is None else chunk
        n_chunks = -(-longest // c)
        width = n_chunks * c
        ids = jnp.asarray([list(p) + [0] * (width - len(p)) for p in prompts], jnp.int32)
        plen = jnp.asarray(lens, jnp.int32)
        ar = jnp.arange(width, dtype=jnp.int32)[None, :]
        pos = jnp.where(ar < plen[:, None], ar, -1)
        last, rows, fracs, hid = None, [], [], []
        for i in range(n_chunks):
            sl = slice(i * c, (i + 1) * c)
            cache, logits, frac, *h = self._forward(self.weights, cache, ids[:, sl], pos[:, sl], plen,
                                                    all_rows=all_rows, return_hidden=return_hidden)
            fracs.append(frac)
            hid.extend(h)
            if all_rows:
                rows.append(logits)
            else:
                here = (plen - 1 >= i * c) & (plen - 1 < (i + 1) * c)
                last = logits if last is None else jnp.where(here[:, None], logits, last)
        out = jnp.concatenate(rows, axis=1)[:, :longest] if all_rows else last
        if return_hidden:
            return cache, out, jnp.mean(jnp.stack(fracs)), jnp.concatenate(hid, axis=1)[:, :longest]
        return cache, out, jnp.mean(jnp.stack(fracs))

    def extend(self, cache: KVCache, ids: jax.Array, positions: jax.Array, return_hidden: bool = False) -> tuple:
        """Append ``ids [batch, T]`` at ``positions`` (``-1`` = skip) and return all rows' logits ``[batch, T, vocab]``.

        The dispatch length of every row is its sequence's length after the append. Returns ``(cache, logits,
        attended_fraction)`` (and the hidden states ``[batch, T, hidden]`` with ``return_hidden``). Positions
        need not follow the cached length: writing at an earlier position rolls the sequence back to it (speculative
        rollback): its cached length becomes the last written position + 1 and the compressed keys (InfLLM v2) of
        every window from the first written position on are recomputed from the new keys.
        ``cache`` is consumed (donated: updated in place); continue from the returned cache, and to branch (two
        continuations of one prefix) extend a copy, ``jax.tree.map(jnp.copy, cache)``, for all but the last.

        Raises:
            ValueError: a position at or beyond the cache's capacity (its keys would be dropped and the cached
                length would pass the capacity: silently wrong logits); make the cache with room for them; or a
                cache already consumed by an earlier ``prefill`` / ``extend``.
        """
        _check_unconsumed(cache)
        p = np.asarray(jax.device_get(positions))
        if p.size and int(p.max()) >= cache.capacity:
            raise ValueError(f"position {int(p.max())} does not fit a cache of {cache.capacity} slots (positions "
                             f"0 .. {cache.capacity - 1}); make the cache with new_cache(batch, tokens) for every "
                             "position it will hold")
        if p.size:  # the rollback: a row's length drops to its first written position (rows writing nothing keep it)
            first = np.where(p >= 0, p, cache.capacity).reshape(p.shape[0], -1).min(axis=1)
            cache = dataclasses.replace(cache, lengths=jnp.minimum(cache.lengths, jnp.asarray(first, jnp.int32)))
        valid = positions >= 0
        dispatch = jnp.maximum(cache.lengths, jnp.max(jnp.where(valid, positions + 1, 0), axis=1))
        mode = "prefill"
        if ids.shape[1] <= 16:  # a decode step or a verify chunk: per-token dispatch, the decode attention path
            mode = decode_mode(self.cfg, [int(x) + 1 for x in p.reshape(-1) if x >= 0])
        return self._forward(self.weights, cache, ids, positions, dispatch, all_rows=True, mode=mode,
                             return_hidden=return_hidden)

    def decode_fn(self, sampling: SamplingParams, vocab_limit: int | None = None, mode: str = "sparse") -> Callable:
        """The jitted ``(weights, cache, tokens, active, seeds, step) -> (cache, next_tokens, fractions, nonfinite)``.

        ``tokens``/``next_tokens`` int32 ``[batch]`` (0 for an inactive row), ``active`` bool ``[batch]``,
        ``fractions`` float32 ``[batch]``: each active row's attended fraction, averaged over the layers (0 for
        an inactive row), ``nonfinite`` bool ``[batch]``: an active row whose logits held NaN/Inf
        (:func:`~minicpm4_jax.infer.sampling.nonfinite_rows`; its token is meaningless). ``mode``:
        :func:`decode_mode` of the step (a dense model always runs ``"dense"``).
        """
        if self.cfg.attention != "infllmv2":
            mode = "dense"
        key = (sampling, vocab_limit, mode)
        if key not in self._decode:
            self._decode[key] = jax.jit(partial(_decode_step, cfg=self.cfg, graphdefs=self._graphdefs,
                                                sampling=sampling, vocab_limit=vocab_limit, mode=mode),
                                        donate_argnums=(1,))
        return self._decode[key]

    def _first_fn(self, sampling: SamplingParams, vocab_limit: int | None) -> Callable:
        key = (sampling, vocab_limit)
        if key not in self._first:
            self._first[key] = jax.jit(partial(_first_tokens, sampling=sampling, vocab_limit=vocab_limit,
                                               checked=checked_vocab(self.cfg, vocab_limit)))
        return self._first[key]

    # -- the generation loop -----------------------------------------------------------------------------
    def decode_loop(self, cache: KVCache, tok: jax.Array, lengths: list[int], col: _Collector, seeds: jax.Array,
                    step0: int, sampling: SamplingParams, vocab_limit: int | None,
                    fractions: list[float]) -> tuple[KVCache, int]:
        """Plain decode steps until every sequence of ``col`` has finished; returns ``(cache, steps run)``.

        Args:
            cache: the cache holding ``lengths[r]`` tokens of sequence ``r`` (donated step by step).
            tok: int32 ``[batch]``, each sequence's last sampled token (already given to ``col``).
            lengths: cached tokens per sequence (host ints; updated in place).
            col: the token collector (stop rules, ``max_new_tokens``, streaming).
            seeds: uint32 ``[batch]``; step ``i`` (counted from ``step0``) samples with ``row_keys(seeds, i)``;
                ``step0`` an int, or int ``[batch]`` (one per sequence: ``row_keys`` takes a step per row).
            fractions: receives the attended fraction of the step that produced every kept token.

        Pipelined (the engine's ``pipelined``, the default): step ``i + 1`` is dispatched before the tokens of step
        ``i`` are read, so the host's work (reading the tokens, the stop rules, streaming) overlaps the device's
        instead of idling it between steps.
        A sequence that stops at step ``i`` therefore runs one more step, whose token is discarded; no sequence
        runs more steps than its remaining ``max_new_tokens`` (the cache's capacity). A sequence's tokens do not
        depend on this: its sampling key depends only on its seed and the step, and every row attends by its own
        length whatever the batch's :func:`decode_mode`.
        A step whose logits hold NaN/Inf for a sequence ends that sequence there (``col.fail``: the token is dropped,
        its finish reason is ``"nonfinite"``); the flag is read with the step's tokens, in the same transfer.
        """
        def collect(tok_dev, frac_dev, bad_dev, rows):
            # one read of the step's results (the non-finite flags come with the tokens)
            tok_host, frac_host, bad_host = jax.device_get((tok_dev, frac_dev, bad_dev))
            for r in range(b):
                if rows[r] and col.active[r]:
                    if bad_host[r]:
                        col.fail(r)
                        continue
                    col.take(r, int(tok_host[r]))
                    fractions.append(float(frac_host[r]))

        b = len(lengths)
        budget = [col.max_new - len(col.out[r]) if col.active[r] else 0 for r in range(b)]
        sent = [0] * b
        pending, steps = None, 0
        while True:
            rows = [col.active[r] and sent[r] < budget[r] for r in range(b)]
            launched = None
            if any(rows):
                mode = decode_mode(self.cfg, [lengths[r] + 1 for r in range(b) if rows[r]])
                for r in range(b):
                    lengths[r] += int(rows[r])
                    sent[r] += int(rows[r])
                # numpy inputs: the jitted call takes them without a dispatch of their own
                cache, tok, frac, bad = self.decode_fn(sampling, vocab_limit, mode)(
                    self.weights, cache, tok, np.asarray(rows), seeds, np.asarray(step0 + steps, np.int32))
                steps += 1
                launched = (tok, frac, bad, rows)
            if pending is not None:  # the previous step's tokens, read while this step runs
                collect(*pending)
            if launched is None:
                return cache, steps
            pending = launched
            if not self.pipelined:
                collect(*pending)
                pending = None

    def _start(self, prompts, max_new_tokens, sampling, seeds, stop_ids, stop_strings, detokenize, vocab_limit,
               on_token, on_nonfinite: str = "raise") -> tuple:
        """Validate a request; ``(prompt lengths, seeds uint32 [b], first-token sampler, token collector)``."""
        if on_nonfinite not in ("raise", "keep"):
            raise ConfigError(f"on_nonfinite={on_nonfinite!r}; use 'raise' (refuse a sequence whose logits hold "
                              "NaN/Inf) or 'keep' (return it with finish reason 'nonfinite')")
        lens = check_prompt_list(prompts)
        stop_ids, stop_strings = check_stops(stop_ids, stop_strings)
        seeds_arr = validate_request(self.cfg, lens, max_new_tokens, sampling, seeds, stop_strings, detokenize,
                                     prompts=prompts, vocab_limit=vocab_limit)
        col = _Collector(len(prompts), max_new_tokens, stop_ids, stop_strings, detokenize, on_token, lens)
        return lens, seeds_arr, self._first_fn(sampling, vocab_limit), col

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampling: SamplingParams = SamplingParams(), seeds: Sequence[int] | int = 0,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 detokenize: Callable[[list[int]], str] | None = None, vocab_limit: int | None = None,
                 on_token: Callable[[int, int], None] | None = None, on_nonfinite: str = "raise") -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens after each prompt (a batch of any lengths).

        Non-finite logits (NaN/Inf in the weights or activations: a bad checkpoint, a bfloat16 overflow) are
        noticed at every step, prefill included, per sequence (the flag comes back with the step's tokens: no
        extra transfer, the pipelined loop stays pipelined). Such a sequence ends at that step: the token is
        dropped, its finish reason is ``"nonfinite"`` and ``output.nonfinite[row]`` its position. The other
        sequences of the batch run on unchanged (their tokens never depend on their neighbours), so one bad prompt
        does not cost the batch's results: with ``on_nonfinite="raise"`` (the default) a
        :class:`NonFiniteLogitsError` is raised once the batch has finished, carrying the whole output
        (``error.output``); with ``"keep"`` the output is returned and the caller looks at ``finish_reasons``.

        Args:
            prompts: token id lists.
            max_new_tokens: new tokens per sequence at most.
            sampling: :class:`SamplingParams`.
            seeds: one seed per sequence, or an int ``s`` meaning ``s + row``; a sequence's tokens depend only
                on its prompt and seed (batching never changes them).
            stop_ids: ids that end a sequence (kept as its last token).
            stop_strings: texts that end a sequence once its decoded continuation contains one (needs
                ``detokenize``; the tokens are kept, the caller cuts the text).
            detokenize: ids -> text, for ``stop_strings``.
            vocab_limit: never produce ids at or above it.
            on_token: called as ``on_token(row, token_id)`` for every new token, in order (streaming).
            on_nonfinite: ``"raise"`` or ``"keep"`` (above).

        Returns:
            :class:`GenerationOutput`: ``tokens`` (one list of new ids per prompt, a stop id kept as the last),
            ``finish_reasons``, token counts, prefill / decode seconds, decode steps and the mean attended fraction.

        Raises:
            ConfigError: empty prompt, ``max_new_tokens < 1``, bad sampling values, too long a request,
                ``stop_strings`` without ``detokenize``, prompts that are not a list of id lists or hold ids outside
                ``[0, vocab_size)``, a seed list whose length is not the number of prompts, a ``vocab_limit``
                below 1, stop ids / stop strings that are not a list of ids / texts (:func:`check_stops`), or a bad
                ``on_nonfinite``.
            NonFiniteLogitsError: (a ``ConfigError``) a sequence's logits held NaN/Inf, with ``on_nonfinite="raise"``.
        """
        lens, seeds_arr, first, col = self._start(prompts, max_new_tokens, sampling, seeds, stop_ids, stop_strings,
                                                  detokenize, vocab_limit, on_token, on_nonfinite)
        b = len(prompts)
        out, reasons = col.out, col.reasons

        t0 = time.perf_counter()
        cache = self.new_cache(b, max(lens) + max_new_tokens - 1)
        cache, logits, _ = self.prefill(cache, prompts)
        tok, bad = first(logits, seeds_arr)
        tok_host, bad_host = jax.device_get((tok, bad))
        t1 = time.perf_counter()

        for r in range(b):
            col.take_checked(r, int(tok_host[r]), bool(bad_host[r]))
        fracs: list[float] = []
        cache, steps = self.decode_loop(cache, tok, list(lens), col, seeds_arr, 1, sampling, vocab_limit, fracs)
        t2 = time.perf_counter()
        return finish(GenerationOutput(tokens=out, finish_reasons=reasons, prompt_tokens=sum(lens),
                                       new_tokens=sum(len(o) for o in out), prefill_seconds=t1 - t0,
                                       decode_seconds=t2 - t1, decode_steps=steps,
                                       attended_fraction=float(np.mean(fracs)) if fracs else float("nan"),
                                       nonfinite=col.nonfinite), on_nonfinite)
