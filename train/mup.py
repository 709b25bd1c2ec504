"""μP coordinate check (issue 5, "μP evidence"; spec ``jax_stack.md`` §5.3, ``minicpm4_model.md`` §3.2).

The standard μP verification (Yang et al., Tensor Programs V, "coord check"): train models that differ only
in width for a few Adam steps on the same batch and record the typical size of each layer's activation
change ``mean |h_t - h_0|``. Under μP the change is O(1) in width (the curves are flat); under the standard
parameterisation (SP) it grows with width, which is why SP's best learning rate shifts as models widen.

Here "μP" is MiniCPM's recipe with ``dim_model_base`` fixed at the base width (``width_mult = hidden /
base``: hidden-matrix init ``initializer_range / sqrt(width_mult)``, hidden learning rate ``lr /
width_mult``, logits ÷ ``width_mult``) and "SP" the same model widened without it (``dim_model_base =
hidden_size`` so ``width_mult = 1`` at every width, ``optimizer.mup = false``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["coord_check_config", "coord_check"]


def coord_check_config(width: int, *, mup: bool, base_width: int = 64, head_dim: int = 32, layers: int = 2,
                       vocab: int = 256, seq_len: int = 64, batch_size: int = 8, lr: float = 1e-2,
                       steps: int = 4) -> Any:
    """The :class:`~minicpm4_jax.config.TrainConfig` of one coordinate-check model (cpu_tiny otherwise).

    ``width`` = ``hidden_size``; heads = ``width // head_dim`` (KV heads half of them), SwiGLU width ``2 *
    width``, float32, constant learning rate (no warmup/decay), no weight decay, no gradient clipping (a
    global-norm clip would couple the widths), no MTP.

    Raises:
        ConfigError: ``width`` not a multiple of ``2 * head_dim``.
    """
    from minicpm4_jax.config import ConfigError, load_config

    if width % (2 * head_dim):
        raise ConfigError(f"width={width} must be a multiple of 2 * head_dim = {2 * head_dim}")
    heads = width // head_dim
    return load_config("cpu_tiny", [
        f"model.hidden_size={width}", f"model.intermediate_size={2 * width}", f"model.num_hidden_layers={layers}",
        f"model.num_attention_heads={heads}", f"model.num_key_value_heads={max(1, heads // 2)}",
        f"model.head_dim={head_dim}", "model.rope_scaling=null", f"model.vocab_size={vocab}", f"data.tokenizer_vocab_size={vocab}",
        f"model.dim_model_base={base_width if mup else width}", "model.mtp=false", "mtp_feature_weight=0",
        "mtp_detach=false", "model.dtype=float32",
        f"optimizer.mup={'true' if mup else 'false'}", f"optimizer.learning_rate={lr}", "optimizer.warmup_steps=0",
        "optimizer.decay_fraction=0.0", "optimizer.weight_decay=0.0", "optimizer.grad_clip=0.0",
        f"data.seq_len={seq_len}", f"data.batch_size={batch_size}", f"steps={steps}"])


def _activations(graphdef, params, ids):
    """Mean |.| is taken by the caller; returns the activations ``{name: array}`` of one forward."""
    from flax import nnx

    from minicpm4_jax.nn.layers import rms_norm

    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    x, positions, cos, sin = model._embed(ids, None)
    out = {"embedding": x}
    layer_gd, stacked = nnx.split(model.layers)
    for i in range(cfg.num_hidden_layers):
        layer = nnx.merge(layer_gd, jax.tree.map(lambda a, i=i: a[i], stacked))
        x = layer(x, cos, sin, positions, cfg)
        out[f"layer{i}"] = x
    out["logits"] = model.logits(rms_norm(x, model.norm[...], cfg.rms_norm_eps))
    return out


def coord_check(widths: Sequence[int], *, mup: bool, steps: int = 4, seed: int = 0,
                **cfg_kwargs: Any) -> dict[int, dict[str, list[float]]]:
    """Activation changes ``mean |h_t - h_0|`` after each of ``steps`` Adam steps, per width and layer.

    Every width trains on the same random token batch ``[batch_size, seq_len + 1]`` (seed ``seed``) and is
    measured on it.

    Args:
        widths: hidden sizes, e.g. ``(64, 128, 256, 512)``.
        mup: MiniCPM's μP (``True``) or the standard parameterisation (``False``); see the module docs.
        steps: Adam steps.
        **cfg_kwargs: :func:`coord_check_config` options (``base_width``, ``head_dim``, ``layers``, ``lr``...).

    Returns:
        ``{width: {"embedding" | "layer<i>" | "logits": [change after step 1, ..., after step steps]}}`` (float).
    """
    from flax import nnx

    from minicpm4_jax.train.step import init_train_state, make_train_step

    out: dict[int, dict[str, list[float]]] = {}
    for w in widths:
        cfg = coord_check_config(w, mup=mup, steps=steps, **cfg_kwargs)
        rng = np.random.default_rng(seed)
        batch = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1)),
                            jnp.int32)
        graphdef, state = init_train_state(cfg, seed)
        step = make_train_step(cfg, graphdef)
        acts = jax.jit(lambda p, gd=graphdef: _activations(gd, p, batch[:, :-1]))
        h0 = acts(nnx.State(state.params) if not isinstance(state.params, nnx.State) else state.params)
        rows: dict[str, list[float]] = {k: [] for k in h0}
        for _ in range(steps):
            state, _m = step(state, batch)
            ht = acts(state.params)
            for k in h0:
                rows[k].append(float(jnp.mean(jnp.abs(ht[k] - h0[k]))))
        out[w] = rows
    return out
