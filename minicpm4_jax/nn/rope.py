"""Rotary position embeddings with MiniCPM's LongRoPE (spec ``minicpm4_model.md`` §4).

Pure functions of arrays. Layout is NeoX "rotate_half": frequency ``i`` rotates the pair
``(i, i + head_dim/2)``.

LongRoPE policy (as the official MiniCPM code): the factor set is chosen **once** from the
configured lengths, long iff ``max_position_embeddings > original_max_position_embeddings``,
so a KV cache never mixes rotations. The attention (magnitude) scaling
``s = sqrt(1 + ln(max/orig) / ln(orig))`` multiplies cos and sin when ``max > orig`` and is 1
otherwise. Runtimes that switch factors by the current sequence length (transformers,
llama.cpp; :func:`longrope_factors` with ``seq_len``) agree whenever the short and long lists are
equal, as in every released config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from minicpm4_jax.config import ConfigError, ModelConfig

__all__ = ["inv_frequencies", "longrope_factors", "attention_scaling", "rope_tables", "apply_rope", "rotate_half"]


def inv_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """``[head_dim/2]`` float32 ``1 / theta^(2i/head_dim)``."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)


def longrope_factors(cfg: ModelConfig, seq_len: int | None = None) -> np.ndarray:
    """Per-frequency divisors ``ext`` (``[head_dim/2]`` float32).

    ``seq_len=None`` applies this project's (and official MiniCPM's) static rule: long iff
    ``max_position_embeddings > original_max_position_embeddings``. With ``seq_len`` given, the
    dynamic rule of transformers / llama.cpp: long iff ``seq_len > original_max_position_embeddings``
    (so exactly the original length still uses the short list).
    """
    half = cfg.resolved_head_dim // 2
    rs = cfg.rope_scaling
    if rs is None:
        return np.ones((half,), np.float32)
    if rs.rope_type != "longrope":
        raise ConfigError(f"rope_scaling.rope_type={rs.rope_type!r} is not supported; use 'longrope'")
    length = cfg.max_position_embeddings if seq_len is None else seq_len
    factors = rs.long_factor if length > rs.original_max_position_embeddings else rs.short_factor
    if len(factors) != half:
        raise ConfigError(f"rope_scaling factor list has {len(factors)} values, head_dim/2 is {half}")
    return np.asarray(factors, dtype=np.float32)


def dynamic_runtime_factor_lists(cfg: ModelConfig) -> tuple[tuple[float, ...], tuple[float, ...], str | None]:
    """``(short_factor, long_factor, note)`` to write for a runtime that switches lists by sequence length.

    transformers (``LlamaForCausalLM``) and llama.cpp pick ``long_factor`` only for inputs (or contexts) longer
    than ``original_max_position_embeddings``; this model picks one list once from the configured lengths
    (:func:`longrope_factors`). Where the two lists differ, the list this model uses is written as both, so the
    runtime rotates exactly as the model was trained at every length, and ``note`` says so (``None`` when the
    lists are equal, as in every released config). Spec ``export.md`` §1.3, ``minicpm4_model.md`` (LongRoPE).

    Raises:
        ValueError: the config has no ``rope_scaling``.
    """
    rs = cfg.rope_scaling
    if rs is None:
        raise ValueError("dynamic_runtime_factor_lists needs a config with rope_scaling")
    short, long_ = tuple(float(x) for x in rs.short_factor), tuple(float(x) for x in rs.long_factor)
    if short == long_:
        return short, long_, None
    use_long = cfg.max_position_embeddings > rs.original_max_position_embeddings
    used = long_ if use_long else short
    note = (f"rope_scaling: short_factor and long_factor differ; this model uses "
            f"{'long_factor' if use_long else 'short_factor'} at every length (max_position_embeddings "
            f"{cfg.max_position_embeddings} {'>' if use_long else '<='} original_max_position_embeddings "
            f"{rs.original_max_position_embeddings}), a runtime that switches by sequence length does not: that "
            "list is written as both so the export rotates as the model was trained")
    return used, used, note


def attention_scaling(cfg: ModelConfig) -> float:
    """LongRoPE magnitude factor ``sqrt(1 + ln(max/orig)/ln(orig))`` (1.0 when ``max <= orig``)."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    orig, mx = rs.original_max_position_embeddings, cfg.max_position_embeddings
    if mx <= orig:
        return 1.0
    return math.sqrt(1.0 + math.log(mx / orig) / math.log(orig))


def rope_tables(positions: jax.Array, cfg: ModelConfig, seq_len: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for given positions.

    Args:
        positions: int ``[..., seq]`` absolute token positions.
        cfg: model config (head_dim, rope_theta, rope_scaling, max_position_embeddings).
        seq_len: ``None`` for the static factor rule (the model's); an int for the dynamic rule.

    Returns:
        ``(cos, sin)``, each float32 ``[..., seq, head_dim]``, already multiplied by the attention
        scaling. Angles are ``(p * (1/ext_i)) * inv_freq_i`` in float32 (HF association order).
    """
    d = cfg.resolved_head_dim
    inv_freq = jnp.asarray(inv_frequencies(d, cfg.rope_theta))
    inv_ext = jnp.asarray(1.0 / longrope_factors(cfg, seq_len))
    pos = positions.astype(jnp.float32)[..., None]
    freqs = (pos * inv_ext) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    s = jnp.float32(attention_scaling(cfg))
    return jnp.cos(emb) * s, jnp.sin(emb) * s


def rotate_half(x: jax.Array) -> jax.Array:
    """``concat(-x[..., d/2:], x[..., :d/2])``."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` with tables ``[batch, seq, head_dim]``.

    Computed in float32, returned in ``x.dtype`` (spec §2: RoPE in fp32, cast back).
    """
    xf = x.astype(jnp.float32)
    c = cos[:, :, None, :]
    s = sin[:, :, None, :]
    return (xf * c + rotate_half(xf) * s).astype(x.dtype)
