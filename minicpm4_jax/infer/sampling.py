"""Token sampling for generation: greedy, temperature, top-k and top-p (nucleus), seeded per sequence."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minicpm4_jax.config import ConfigError, check_temperature

__all__ = ["SamplingParams", "top_p_filter", "top_k_filter", "sample_tokens", "row_keys", "greedy_tokens", "is_integer",
           "nonfinite_rows"]


def is_integer(x) -> bool:
    """``x`` is a Python or numpy integer (not a bool): the check every integer option of generation uses."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn from the float32 logits.

    Attributes:
        temperature: ``0`` = greedy (argmax); else (``>= config.MIN_TEMPERATURE``) logits are divided by it before sampling.
        top_k: keep the ``top_k`` most likely tokens (``0`` = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (``1`` = all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> None:
        """Raises :class:`~minicpm4_jax.config.ConfigError` naming a bad value and its valid range."""
        def real(x) -> bool:
            return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))

        check_temperature(self.temperature)
        if not is_integer(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = no top-k filter)")
        if not real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1] (a number)")

    @property
    def greedy(self) -> bool:
        """True when sampling is the argmax."""
        return self.temperature == 0.0


def top_p_filter(logits: jax.Array, top_p: float | jax.Array) -> jax.Array:
    """Nucleus filtering: keep the smallest set of top tokens whose probability reaches ``top_p``.

    ``logits`` float ``[..., vocab]``; removed entries become ``-inf``; ``top_p`` a float or an array
    broadcastable against ``[..., 1]`` (one value per row: ``[batch, 1]``). The most likely token is
    always kept; ``top_p >= 1`` keeps everything. Tokens tied at the smallest kept logit are taken in index
    order until the set holds its size (HF ``TopPLogitsWarper`` keeps a sorted prefix too; keeping every tied
    token, as before, gave ``[2, 1, 1, 1]`` at ``top_p = 0.5`` all four tokens instead of two).
    """
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    keep_sorted = before < top_p
    keep_sorted = keep_sorted.at[..., 0].set(True)
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)  # smallest kept logit
    above = logits > threshold
    tied = logits == threshold
    room = n_keep - jnp.sum(above, axis=-1, keepdims=True)  # how many of the tied tokens the set takes
    keep = above | (tied & (jnp.cumsum(tied, axis=-1) <= room))
    return jnp.where(keep, logits, -jnp.inf)


def top_k_filter(logits: jax.Array, top_k: int) -> jax.Array:
    """Keep the ``top_k`` largest logits of ``[..., vocab]`` (ties at the threshold kept); others ``-inf``."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32 ``[...]`` for float ``logits [..., vocab]``: the first index of
    the maximum, or of the first NaN when a row has one (as ``jnp.argmax``).

    Plain reductions (a max, then the first index holding it; the first NaN found on its own, since XLA:CPU's
    vectorised max does not always return a NaN it meets) instead of XLA's variadic (value, index) reduce, which
    XLA:CPU runs 3-7x slower: 49 -> 17 us for one 8192-token row, 147-200 -> 30 us for the 4 rows of a
    speculative verify (``docs/benchmarks.md``).
    """
    v = logits.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    first_nan = jnp.min(jnp.where(jnp.isnan(logits), iota, v), axis=-1)
    m = jnp.max(logits, axis=-1, keepdims=True)
    first_max = jnp.min(jnp.where(logits == m, iota, v), axis=-1)
    return jnp.where(first_nan < v, first_nan, first_max)


def nonfinite_rows(logits: jax.Array, vocab_limit: int | None = None) -> jax.Array:
    """bool ``[...]``: whether each row of float ``logits [..., vocab]`` holds a NaN or an infinity.

    Only ids below ``vocab_limit`` count (the ids :func:`sample_tokens` may draw; the rows of a vocabulary padded
    beyond the tokenizer's are never sampled). A model's logits are finite unless its weights or activations hold
    NaN/Inf (a bad checkpoint, a bfloat16 overflow); greedy decoding then returns the first NaN's index and
    sampling a meaningless id, so the engine reads this flag with each step's tokens and refuses the sequence
    (:class:`~minicpm4_jax.infer.engine.NonFiniteLogitsError`). One elementwise pass and a reduction over the
    row, in the same program as the sampling.
    """
    ok = jnp.isfinite(logits)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        ok = ok | (jnp.arange(logits.shape[-1]) >= vocab_limit)
    return ~jnp.all(ok, axis=-1)


def row_keys(seeds: jax.Array, step: jax.Array | int) -> jax.Array:
    """PRNG keys ``[batch]`` for sampling step ``step`` (an int, or int ``[batch]``: a step per sequence) of
    sequences seeded with ``seeds`` (int ``[batch]``).

    A sequence's draws depend only on its own seed and the step, never on its batch neighbours.
    """
    seeds = seeds.astype(jnp.uint32)
    steps = jnp.broadcast_to(jnp.asarray(step), seeds.shape)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)


def sample_tokens(logits: jax.Array, keys: jax.Array, params: SamplingParams,
                  vocab_limit: int | None = None) -> jax.Array:
    """Next token ids int32 ``[batch]`` from float32 ``logits [batch, vocab]`` and ``keys [batch]``.

    ``vocab_limit``: ids at or above it (a model vocabulary padded beyond the tokenizer's) are never drawn.
    Greedy ignores ``keys``. Otherwise temperature, then top-k, then top-p, then a categorical draw.
    """
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if params.greedy:
        return greedy_tokens(logits)
    scaled = logits.astype(jnp.float32) / params.temperature
    scaled = top_k_filter(scaled, params.top_k)
    if params.top_p < 1.0:
        scaled = top_p_filter(scaled, params.top_p)
    return jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys, scaled).astype(jnp.int32)
