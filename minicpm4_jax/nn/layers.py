"""Small pure functions and parameter helpers shared by the MiniCPM4 modules.

Spec ``minicpm4_model.md`` §2 (RMSNorm, SwiGLU) and §3.2 (μP init scales).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from minicpm4_jax.config import ModelConfig

__all__ = ["rms_norm", "swiglu", "param", "hidden_init_std", "dtype_of"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str) -> jnp.dtype:
    """``"bfloat16"`` -> ``jnp.bfloat16`` etc."""
    return _DTYPES[name]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as the official code computes it.

    ``y = (x * rsqrt(mean(x^2) + eps))`` with statistics in float32, cast back to ``x.dtype``, then
    multiplied by ``weight`` (cast to ``x.dtype``). ``x``: ``[..., hidden]``; ``weight``: ``[hidden]``.
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return y * weight.astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` (``hidden_act`` = silu)."""
    return jax.nn.silu(gate) * up


def hidden_init_std(cfg: ModelConfig) -> float:
    """μP init std of hidden 2-D matrices: ``initializer_range / sqrt(width_mult)`` (spec §3.2)."""
    return cfg.initializer_range / math.sqrt(cfg.width_mult)


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], std: float | None, names: tuple[str, ...], dtype) -> nnx.Param:
    """An ``nnx.Param`` with logical axis names; normal(0, std) init, or ones when ``std`` is None.

    Logical names (``embed``, ``q_heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``norm``;
    ``layers`` is prepended by the layer stack) are mapped to mesh axes by the sharding rules.
    Eager sharding is off: shardings are applied by ``jax.jit`` out_shardings, not at construction.
    """
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)
