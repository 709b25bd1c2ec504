"""Text generation from a trained model without a KV cache (greedy or temperature / top-p sampling).

Each new token runs one jitted full forward over a fixed-length buffer ``[1, prompt + max_new]``
(one compilation for the whole call) and reads the logits at the cursor. Attention is causal, so
the padding after the cursor does not change the logits at or before it. The inference issue
replaces this with the shared KV-cache engine; this path stays as its reference.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm4_jax.config import ConfigError

__all__ = ["generate", "generate_ids", "top_p_filter", "sample_next"]


class _Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def top_p_filter(logits: jax.Array, top_p: float | jax.Array) -> jax.Array:
    """Nucleus filtering: keep the smallest set of top tokens whose probability reaches ``top_p``.

    ``logits`` float ``[..., vocab]``; removed entries become ``-inf``. The most likely token is
    always kept; ``top_p >= 1`` keeps everything.
    """
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    keep_sorted = before < top_p
    keep_sorted = keep_sorted.at[..., 0].set(True)
    # threshold = smallest kept logit
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Next token id (int32 ``[...]``) from float32 ``logits [..., vocab]``.

    ``temperature == 0`` is greedy (argmax; ``key`` unused); otherwise ``jax.random.categorical``
    on ``logits / temperature`` after :func:`top_p_filter`.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        scaled = top_p_filter(scaled, top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "temperature", "top_p", "vocab_limit"))
def _step(graphdef: nnx.GraphDef, params: Any, buf: jax.Array, cursor: jax.Array, key: jax.Array,
          temperature: float, top_p: float, vocab_limit: int | None) -> jax.Array:
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(buf)  # [1, L, h]
    h = jax.lax.dynamic_slice_in_dim(hidden, cursor - 1, 1, axis=1)  # the last filled position
    logits = model.logits(h)[:, 0]  # [1, vocab] float32
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    return sample_next(logits, key, temperature, top_p)[0]


def generate_ids(model: Any, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_ids: tuple[int, ...] = (),
                 vocab_limit: int | None = None) -> list[int]:
    """Extend ``prompt_ids`` by up to ``max_new_tokens`` ids (stops after any id in ``stop_ids``).

    ``vocab_limit``: only ids below it are produced (a tokenizer smaller than the model's padded
    vocabulary).

    Returns only the new ids. Deterministic for a given ``seed`` (greedy ignores it).

    Raises:
        ConfigError: empty prompt, non-positive ``max_new_tokens``, bad ``temperature``/``top_p``, or
            ``len(prompt) + max_new_tokens`` above the model's ``max_position_embeddings``.
    """
    cfg = model.cfg
    if not prompt_ids:
        raise ConfigError("the prompt is empty; give some text to continue")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1]")
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ConfigError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}; shorten the prompt or generate fewer tokens"
        )
    graphdef, params = nnx.split(model, nnx.Param)
    buf = jnp.zeros((1, total), jnp.int32).at[0, : len(prompt_ids)].set(jnp.asarray(prompt_ids, jnp.int32))
    key = jax.random.key(seed)
    out: list[int] = []
    cursor = len(prompt_ids)
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok = _step(graphdef, params, buf, jnp.int32(cursor), sub, float(temperature), float(top_p), vocab_limit)
        tok_i = int(tok)
        out.append(tok_i)
        if tok_i in stop_ids:
            break
        buf = buf.at[0, cursor].set(tok)
        cursor += 1
    return out


def generate(model: Any, tokenizer: _Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, prefix_ids: Sequence[int] | None = None) -> str:
    """Continue ``prompt`` with up to ``max_new_tokens`` tokens and return the decoded continuation.

    The prompt is encoded with ``tokenizer`` (no specials) and prefixed with ``prefix_ids``;
    ``None`` means ``[tokenizer.bos_id]`` (the official MiniCPM convention, ``add_bos_token``). A
    model trained on EOS-separated documents (this project's data pipeline) is best prompted with
    ``[tokenizer.eos_id]``: a new document follows an EOS there. Generation stops early at
    ``tokenizer.eos_id``, which is not included in the returned text; ids at or above
    ``tokenizer.vocab_size`` (model vocabulary padding) are never sampled.

    Raises:
        ConfigError: empty prompt, or a prompt (+ new tokens) longer than ``max_position_embeddings``.
    """
    if not prompt:
        raise ConfigError("the prompt is empty; give some text to continue")
    if prefix_ids is None:
        bos = getattr(tokenizer, "bos_id", None)
        prefix_ids = [bos] if bos is not None and bos >= 0 else []
    ids = [int(i) for i in prefix_ids] + list(tokenizer.encode(prompt))
    eos = getattr(tokenizer, "eos_id", None)
    stop = (eos,) if eos is not None and eos >= 0 else ()
    limit = getattr(tokenizer, "vocab_size", None)
    new = generate_ids(model, ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_ids=stop,
                       vocab_limit=limit)
    if new and new[-1] in stop:
        new = new[:-1]
    return tokenizer.decode(new)
