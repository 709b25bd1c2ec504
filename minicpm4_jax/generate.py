"""Text generation from a trained model: the KV-cache engine, and the uncached reference path.

:func:`generate` / :func:`generate_ids` run :class:`~minicpm4_jax.infer.engine.InferenceEngine` (chunked
prefill, cached decode steps, dense or InfLLM v2 sparse attention). :func:`generate_ids_uncached` keeps the
original engine-free path (one jitted full forward per token over a fixed-length buffer), the reference the
engine is tested against.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm4_jax.config import ConfigError

from minicpm4_jax.infer.detok import IncrementalText, byte_value, char_start
from minicpm4_jax.infer.sampling import SamplingParams, greedy_tokens, top_p_filter

__all__ = ["generate", "generate_ids", "generate_ids_uncached", "top_p_filter", "sample_next", "stop_token_ids"]


class _Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def stop_token_ids(model_cfg: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's ``eos_id`` and every id of ``model_cfg.eos_token_id``.

    An official MiniCPM4 config names two (``[2, 73440]``: ``</s>`` and the chat turn's ``<|im_end|>``, as its
    ``generation_config.json``, which transformers stops at); a run trained here has its tokenizer's EOS there.
    Ids outside the tokenizer (``>= tokenizer.vocab_size``) are left out: they are never sampled.
    """
    limit = getattr(tokenizer, "vocab_size", None)
    eos = getattr(tokenizer, "eos_id", None)
    ids = ([eos] if eos is not None else []) + [int(i) for i in getattr(model_cfg, "eos_token_id", ()) or ()]
    return tuple(dict.fromkeys(int(i) for i in ids if i >= 0 and (limit is None or i < limit)))


def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Next token id (int32 ``[...]``) from float32 ``logits [..., vocab]``.

    ``temperature == 0`` is greedy (argmax; ``key`` unused); otherwise ``jax.random.categorical``
    on ``logits / temperature`` after :func:`top_p_filter`.
    """
    if temperature == 0.0:
        return greedy_tokens(logits)
    scaled = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        scaled = top_p_filter(scaled, top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "temperature", "top_p", "vocab_limit"))
def _step(graphdef: nnx.GraphDef, params: Any, ids: jax.Array, key: jax.Array,
          temperature: float, top_p: float, vocab_limit: int | None) -> jax.Array:
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(ids)  # [1, L, h]: exactly the sequence so far (no padding: the InfLLM v2
    logits = model.logits(hidden[:, -1:])[:, 0]  # dispatch depends on the length), [1, vocab] float32
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    return sample_next(logits, key, temperature, top_p)[0]


def generate_ids_uncached(model: Any, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                          top_p: float = 1.0, seed: int = 0, stop_ids: tuple[int, ...] = (),
                          vocab_limit: int | None = None) -> list[int]:
    """Reference without a KV cache: one full forward of exactly the sequence so far per new token.

    Extends ``prompt_ids`` by up to ``max_new_tokens`` ids (stops after any id in ``stop_ids``). The forward
    sees the true length (never a padded buffer), so an InfLLM v2 model dispatches dense/sparse as at
    that length.

    ``vocab_limit``: only ids below it are produced (a tokenizer smaller than the model's padded
    vocabulary).

    Returns only the new ids. Deterministic for a given ``seed`` (greedy ignores it).

    Raises:
        ConfigError: empty prompt, non-positive ``max_new_tokens``, bad ``temperature``/``top_p``,
            ``len(prompt) + max_new_tokens`` above the model's ``max_position_embeddings``, prompt ids outside the
            vocabulary, ``stop_ids`` not a list of ids, a bad ``seed`` or ``vocab_limit`` (the engine's checks,
            :func:`~minicpm4_jax.infer.engine.validate_request`).
    """
    from minicpm4_jax.infer.engine import check_prompt_list, check_stops, validate_request

    lens = check_prompt_list([prompt_ids])
    stop_ids, _ = check_stops(stop_ids, ())
    validate_request(model.cfg, lens, max_new_tokens, SamplingParams(temperature=temperature, top_p=top_p), [seed],
                     (), None, prompts=[prompt_ids], vocab_limit=vocab_limit)
    graphdef, params = nnx.split(model, nnx.Param)
    key = jax.random.key(seed)
    out: list[int] = []
    seq = [int(i) for i in prompt_ids]
    for _ in range(max_new_tokens):  # one compilation per length: a reference, not a fast path
        key, sub = jax.random.split(key)
        tok_i = int(_step(graphdef, params, jnp.asarray([seq], jnp.int32), sub, float(temperature), float(top_p),
                          vocab_limit))
        out.append(tok_i)
        if tok_i in stop_ids:
            break
        seq.append(tok_i)
    return out


def generate_ids(model: Any, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_ids: tuple[int, ...] = (),
                 vocab_limit: int | None = None, engine: Any = None) -> list[int]:
    """Extend ``prompt_ids`` by up to ``max_new_tokens`` ids with the KV-cache engine (stops after a ``stop_ids`` id).

    ``vocab_limit``: only ids below it are produced. ``engine``: a reusable
    :class:`~minicpm4_jax.infer.engine.InferenceEngine` of ``model`` (default: a new one). Greedy output equals
    :func:`generate_ids_uncached`; sampled output is deterministic for a given ``seed``.

    Returns only the new ids.

    Raises:
        ConfigError: empty prompt, non-positive ``max_new_tokens``, bad sampling values, or a request longer
            than ``max_position_embeddings``.
        NonFiniteLogitsError: (a ``ConfigError``) the logits held NaN/Inf at some step (bad weights, a bfloat16
            overflow); its ``output`` holds the tokens before that step.
    """
    from minicpm4_jax.infer.engine import InferenceEngine

    eng = InferenceEngine(model) if engine is None else engine
    out = eng.generate([list(prompt_ids)], max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p),
                       seeds=[seed], stop_ids=stop_ids, vocab_limit=vocab_limit)
    return out.tokens[0]


def continuation_decoder(tokenizer: _Tokenizer, context_ids: Sequence[int], tail: int = 16
                         ) -> Callable[[Sequence[int]], str]:
    """``new_ids -> text``: the text ``new_ids`` add after ``context_ids``, ``decode(last + new)`` minus
    ``decode(last)`` with ``last`` the context's last ``tail`` ids (the whole context's decode would cost O(prompt)
    per streamed token).

    ``decode(new)`` alone loses the space a first new piece starts with when the tokenizer's decode strips the
    leading space of its text (SentencePiece ``add_dummy_prefix``, Llama-style: ``"import"`` + ``▁os`` showed
    ``importos``). Falls back to ``decode(new)`` when ``decode(last)`` is not a prefix of ``decode(last + new)``.

    ``last`` starts at a character's first byte: a window starting on the continuation bytes of a byte-fallback
    (``<0xNN>``) character takes up to 3 more ids before it. A Hugging Face ``ByteFallback`` decoder turns a whole
    run with an invalid byte into U+FFFD, so new byte tokens continuing a prompt's run cut there decoded as U+FFFD.

    The returned function has a ``byte_value`` attribute (id -> its byte for a ``<0xNN>`` piece, else ``None``), which
    :class:`~minicpm4_jax.infer.detok.IncrementalText` uses to keep a byte-fallback run pending until it ends.
    """
    ctx = [int(i) for i in context_ids]
    byte_of = partial(byte_value, tokenizer)
    last = ctx[char_start(ctx, max(len(ctx) - tail, 0) if tail > 0 else len(ctx), byte_of):]
    base = tokenizer.decode(last)

    def decode(new_ids: Sequence[int]) -> str:
        full = tokenizer.decode(last + [int(i) for i in new_ids])
        return full[len(base):] if full.startswith(base) else tokenizer.decode(list(new_ids))

    decode.byte_value = byte_of  # type: ignore[attr-defined]  # for IncrementalText
    return decode


class _StreamPrinter:
    """``on_token`` callback emitting the newly decoded text of row 0 as it grows (``decode``: new ids -> text).

    Holds back an incomplete UTF-8 character and the last ``len(longest stop string) - 1`` characters (which
    may start a stop string); :meth:`finish` emits the rest of the final, cut text. ``stop_ids`` (those of
    :func:`stop_token_ids`) are never shown. Nothing is emitted while the last token is a byte-fallback piece
    (``<0xNN>``): a Hugging Face ``ByteFallback`` decoder decodes a run of them as a whole (one invalid byte
    makes every byte of the run U+FFFD), so the text of a run is final only once the run has ended. The text is
    decoded incrementally (:class:`~minicpm4_jax.infer.detok.IncrementalText`): a bounded window per token, not
    the whole output.
    """

    def __init__(self, tokenizer: _Tokenizer, emit: Callable[[str], None], stop_strings: Sequence[str],
                 stop_ids: Sequence[int] = (), decode: Callable[[Sequence[int]], str] | None = None):
        self.tokenizer, self.emit = tokenizer, emit
        self.text = IncrementalText(tokenizer.decode if decode is None else decode, partial(byte_value, tokenizer))
        self.stops = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.shown = 0
        self.unsearched = 0  # text before it was searched for the stop strings and has not changed since
        self.stop_at: int | None = None  # where the first stop string starts
        self.stop_ids = set(stop_ids)

    def __call__(self, row: int, tok: int) -> None:
        if row != 0 or tok in self.stop_ids:
            return
        self.unsearched = min(self.unsearched, self.text.push(tok))
        if byte_value(self.tokenizer, tok) is not None:
            return
        n = len(self.text)
        if self.text.text_from(n - 1) == "\ufffd":
            return
        if self.stops and self.stop_at is None:
            lo = max(self.unsearched - self.hold, 0)
            region = self.text.text_from(lo)
            cut = [region.index(s) for s in self.stops if s in region]
            self.stop_at = lo + min(cut) if cut else None
            self.unsearched = n
        upto = self.stop_at if self.stop_at is not None else n - self.hold
        if upto > self.shown:
            self.emit(self.text.text_from(self.shown)[:upto - self.shown])
            self.shown = upto

    def finish(self, final_text: str) -> None:
        if len(final_text) > self.shown:
            self.emit(final_text[self.shown:])


def generate(model: Any, tokenizer: _Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, prefix_ids: Sequence[int] | None = None, *, top_k: int = 0,
             stop_strings: Sequence[str] = (), stream: Callable[[str], None] | None = None, engine: Any = None,
             speculative: Any = None, return_output: bool = False) -> str | tuple[str, Any]:
    """Continue ``prompt`` with up to ``max_new_tokens`` tokens and return the decoded continuation.

    The prompt is encoded with ``tokenizer`` (no specials) and prefixed with ``prefix_ids``;
    ``None`` means ``[tokenizer.bos_id]`` (the official MiniCPM convention, ``add_bos_token``). A
    model trained on EOS-separated documents (this project's data pipeline) is best prompted with
    ``[tokenizer.eos_id]``: a new document follows an EOS there. Generation stops early at
    ``tokenizer.eos_id`` or another id of the model's ``eos_token_id`` (:func:`stop_token_ids`; an official
    MiniCPM4 also ends at ``<|im_end|>``), which is not included in the returned text, or at the first of ``stop_strings``
    (the text is cut before it); ids at or above ``tokenizer.vocab_size`` (model vocabulary padding) are
    never sampled. The text is that of the new tokens as it reads after the prompt
    (:func:`continuation_decoder`). ``stream``: called with each new piece of text as it is generated. ``speculative``: a
    :class:`~minicpm4_jax.infer.spec.SpeculativeDecoder` to draft and verify with (same output for greedy; the
    target distribution when sampling). ``return_output``: also return the
    :class:`~minicpm4_jax.infer.engine.GenerationOutput` (timings, attended fraction, acceptance length).

    Raises:
        ConfigError: empty prompt, bad sampling values, a prompt (+ new tokens) longer than
            ``max_position_embeddings``, or ``stop_strings`` not a list of texts (a bare string is refused: it
            would stop at any of its characters).
        NonFiniteLogitsError: (a ``ConfigError``) the logits held NaN/Inf at some step: one line naming the
            position and the likely cause (:class:`~minicpm4_jax.infer.engine.NonFiniteLogitsError`; before, the
            step's token was decoded silently: greedy gave the first NaN's id).
    """
    from minicpm4_jax.infer.engine import InferenceEngine, check_stops

    if not prompt:
        raise ConfigError("the prompt is empty; give some text to continue")
    _, stop_strings = check_stops((), stop_strings)  # a bare string would be cut at any of its characters
    if prefix_ids is None:
        bos = getattr(tokenizer, "bos_id", None)
        prefix_ids = [bos] if bos is not None and bos >= 0 else []
    ids = [int(i) for i in prefix_ids] + list(tokenizer.encode(prompt))
    eng = InferenceEngine(model) if engine is None else engine
    stop = stop_token_ids(model.cfg if model is not None else getattr(eng, "cfg", None), tokenizer)
    limit = getattr(tokenizer, "vocab_size", None)
    detokenize = continuation_decoder(tokenizer, ids)  # the new text as it reads after the prompt
    printer = None if stream is None else _StreamPrinter(tokenizer, stream, stop_strings, stop, detokenize)
    gen = eng.generate if speculative is None else speculative.generate
    out = gen([ids], max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p), seeds=[seed],
                       stop_ids=stop, stop_strings=tuple(stop_strings), detokenize=detokenize,
                       vocab_limit=limit, on_token=printer)
    new = out.tokens[0]
    if new and new[-1] in stop:
        new = new[:-1]
    text = detokenize(new)
    cut = [text.index(s) for s in stop_strings if s and s in text]
    if cut:
        text = text[:min(cut)]
    if printer is not None:
        printer.finish(text)
    return (text, out) if return_output else text
