"""The one attention entry point of the model.

Two config switches choose what runs: ``model.attention`` (the algorithm: ``dense`` | ``infllmv2``)
and ``model.attention_impl`` (the implementation: ``xla`` | ``pallas`` | ``auto``, :mod:`minicpm4_jax.ops.dispatch`;
InfLLM v2 stage 2 has Pallas kernels; dense attention runs XLA: by blocks with its own backward under ``auto``
(and as InfLLM v2's dense fallback under ``pallas``), the materialising reference under ``xla``). Every decoder
layer calls :func:`attend`; no attention code is duplicated per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minicpm4_jax.config import ConfigError, ModelConfig
from minicpm4_jax.infllm.attention import infllmv2_attention
from minicpm4_jax.ops.attention_ref import dense_attention
from minicpm4_jax.ops.flash_xla import flash_attention
from minicpm4_jax.ops.dispatch import sparse_impl

__all__ = ["attend"]


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    cfg: ModelConfig,
    kv_valid: jax.Array | None = None,
    q_nope: jax.Array | None = None,
    k_nope: jax.Array | None = None,
    return_stats: bool = False,
) -> jax.Array | tuple[jax.Array, dict]:
    """Causal GQA attention dispatched on ``cfg.attention`` / ``cfg.attention_impl``.

    Args:
        q: ``[batch, q_len, num_attention_heads, head_dim]`` (post-RoPE).
        k, v: ``[batch, kv_len, num_key_value_heads, head_dim]`` (k post-RoPE).
        q_positions, kv_positions: int32 ``[batch, q_len]`` / ``[batch, kv_len]``.
        cfg: model config.
        kv_valid: optional bool ``[batch, kv_len]`` (False = padding / empty cache slot).
        q_nope, k_nope: pre-RoPE q / k, used for InfLLM v2 block selection when
            ``sparse_config.use_nope`` (stage 2 always uses the rotated q / k).
        return_stats: also return ``{"attended_fraction": float32 scalar}`` (mean attended / causal keys
            per query; exactly 1 for dense attention).

    Returns:
        ``[batch, q_len, num_attention_heads, head_dim]`` in ``q.dtype`` (and the stats when asked).

    Raises:
        ConfigError: an algorithm/implementation this build does not provide.
    """
    if cfg.attention == "dense":
        if cfg.attention_impl in ("xla", "auto"):
            dense_fn = flash_attention if cfg.attention_impl == "auto" else dense_attention
            out = dense_fn(q, k, v, q_positions=q_positions, kv_positions=kv_positions, kv_valid=kv_valid)
            return (out, {"attended_fraction": jnp.float32(1.0)}) if return_stats else out
        raise ConfigError(
            f"model.attention_impl={cfg.attention_impl!r} has no dense kernel in this version; use 'xla' or 'auto'"
        )
    if cfg.attention == "infllmv2":
        sc = cfg.sparse_config
        return infllmv2_attention(
            q, k, v, q_positions=q_positions, kv_positions=kv_positions, sparse_cfg=sc, kv_valid=kv_valid,
            q_sel=q_nope if sc.use_nope else None, k_sel=k_nope if sc.use_nope else None,
            kernel_offby1_quirk=sc.kernel_offby1_quirk, return_stats=return_stats,
            impl=sparse_impl(cfg.attention_impl, q.dtype), flash_dense=cfg.attention_impl != "xla",
        )
    raise ConfigError(f"model.attention={cfg.attention!r}; use 'dense' or 'infllmv2'")
