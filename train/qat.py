"""Ternary QAT in the training job (BitCPM4, paper §3.3): where a QAT run starts from, and what it logs.

* :func:`resolve_init` / :func:`load_init_params`: ``qat.init_from``, a checkpoint of this project
  (a run or an ``import hf`` output). Checked before anything is written (the model must have the
  same parameters and μP constants); loaded as the **latent** weights (never fake-quantized), into
  the run's shardings; the optimizer starts fresh, so the schedule re-warms the learning rate.
* :func:`continue_data_order`: with ``qat.continue_data`` the data iterator resumes where the
  initial checkpoint's run stopped (same data settings required), so "high precision for k steps,
  then QAT" sees the token stream of one uninterrupted run.
* :func:`stats_summary` / :func:`stats_lines`: the fraction of zero codes and the per-layer scales
  for the terminal (TensorBoard tags come from ``metrics.ternary_scalars``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from minicpm4_jax.config import ConfigError, ModelConfig, TrainConfig, config_to_dict, diff_configs, same_sources
from minicpm4_jax.train.checkpoint import CheckpointSource, resolve_source

__all__ = ["InitSource", "resolve_init", "rotary_differences", "load_init_params", "continue_data_order",
           "MODEL_FIELDS_MAY_DIFFER", "stats_summary", "stats_lines", "SHORT_NAMES"]

#: Model config fields an init checkpoint may differ in: they change neither the parameters nor the math
#: of a training forward at ``data.seq_len`` (compute dtype and attention kernel aside). ``max_position_embeddings``
#: and ``rope_scaling`` do where they change the rotary tables (the LongRoPE factor list chosen, its attention
#: scaling): :func:`resolve_init` compares those (:func:`rotary_differences`).
MODEL_FIELDS_MAY_DIFFER = frozenset({
    "dtype", "param_dtype", "attention", "attention_impl", "sparse_config", "scan_layers", "remat",
    "max_position_embeddings", "rope_scaling", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
})

#: short names of the ternary matrices in log lines
SHORT_NAMES = {"layers/q_proj": "q", "layers/k_proj": "k", "layers/v_proj": "v", "layers/o_proj": "o",
               "layers/gate_proj": "gate", "layers/up_proj": "up", "layers/down_proj": "down",
               "embed_tokens/embedding": "embed", "lm_head": "head"}


#: A resolved ``qat.init_from``: checkpoint folder, step and the config it was saved with
#: (:class:`~minicpm4_jax.train.checkpoint.CheckpointSource`).
InitSource = CheckpointSource


def rotary_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """How the rotary embedding of ``current`` differs from that of ``saved`` (``[]``: the same tables at every
    position): the LongRoPE factor list each uses and its attention scaling ``sqrt(1 + ln(max/orig) / ln(orig))``
    (:mod:`minicpm4_jax.nn.rope`; spec ``minicpm4_model.md`` §4), which ``rope_scaling`` and
    ``max_position_embeddings`` choose. ``rope_theta`` and the head size are compared as fields by the caller.

    Returns:
        ``"name: checkpoint value != current value"`` lines (``model.rope_factors`` as min..max of the list,
        ``model.rope_attention_scaling`` to 6 digits).
    """
    from minicpm4_jax.nn.rope import attention_scaling, longrope_factors

    if saved.resolved_head_dim != current.resolved_head_dim:
        return []  # another head size: the field difference names it
    out = []
    fa, fb = longrope_factors(saved), longrope_factors(current)
    if not np.array_equal(fa, fb):
        def span(f: np.ndarray) -> str:
            return f"{float(f.min()):.6g}..{float(f.max()):.6g}" if f.min() != f.max() else f"all {float(f[0]):.6g}"

        out.append(f"model.rope_factors: {span(fa)} != {span(fb)}")
    sa, sb = attention_scaling(saved), attention_scaling(current)
    if sa != sb:
        out.append(f"model.rope_attention_scaling: {sa:.6g} != {sb:.6g}")
    return out


def resolve_init(cfg: TrainConfig) -> CheckpointSource:
    """Find ``cfg.qat.init_from`` (step ``qat.init_step`` or the latest) and check its model fits ``cfg``.

    Reads only the checkpoint's stored config.

    Raises:
        ConfigError: (one line, with the fix) no such folder / no checkpoint / no such step or an unreadable
            saved config (:func:`~minicpm4_jax.train.checkpoint.resolve_source`), or a model whose parameters,
            μP constants or rotary tables differ (the differing fields are listed; ``rope_scaling`` /
            ``max_position_embeddings`` may differ only where they give the same tables, :func:`rotary_differences`).
    """
    q = cfg.qat
    src = resolve_source(q.init_from, q.init_step, path_option="qat.init_from", step_option="qat.init_step")
    bad = [d for d in diff_configs(src.cfg.model, cfg.model, "model")
           if d.split(":", 1)[0].split(".")[1] not in MODEL_FIELDS_MAY_DIFFER]
    if bad:
        raise ConfigError(
            f"qat.init_from={q.init_from!r} (step {src.step}) holds a different model: " + "; ".join(bad)
            + " (checkpoint value != current value); give the model section of that checkpoint (its config.json)"
        )
    rope = rotary_differences(src.cfg.model, cfg.model)
    if rope:
        fields = [f"model.{n}" for n in ("rope_scaling", "max_position_embeddings")
                  if getattr(src.cfg.model, n) != getattr(cfg.model, n)]
        raise ConfigError(
            f"qat.init_from={q.init_from!r} (step {src.step}) was trained with another rotary embedding: "
            + "; ".join(rope) + f" (checkpoint value != current value, from {' and '.join(fields)}): its weights "
            "would see other position encodings; give the rope_scaling and max_position_embeddings of that "
            "checkpoint (its config.json)"
        )
    return src


def load_init_params(src: InitSource, param_shardings: Any, like: Any = None) -> Any:
    """The latent float parameters of ``src`` (an ``nnx.State``), each read straight into its sharding of
    ``param_shardings`` (the run's, which may span processes). They were read whole onto the first local device and
    then ``jax.device_put``: a multi-process run failed there (``device_put`` cannot reach another process's
    devices), and one device held the whole model.

    ``like``: the run's parameters (arrays or ``jax.ShapeDtypeStruct`` s, the same tree): the loaded ones are cast
    to their dtypes (``model.param_dtype`` may differ from the source's, :data:`MODEL_FIELDS_MAY_DIFFER`; kept in
    the source's, the parameters no longer matched the optimizer state and the compiled train step, which failed at
    the second step with a TypeError).
    """
    import jax
    from flax import nnx

    from minicpm4_jax.train.checkpoint import load_params_for_inference

    _cfg, model = load_params_for_inference(src.directory, src.step, step_option="qat.init_step", ternary=False,
                                            shardings=param_shardings)
    params = nnx.state(model, nnx.Param)
    if like is not None:
        params = jax.tree.map(lambda p, ref: p if p.dtype == ref.dtype else p.astype(ref.dtype), params, like)
    return params


def _data_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The data settings but ``cache_dir`` and ``sources`` (compared by :func:`same_sources`: a relative and an
    absolute spelling of the same files are the same corpus, as for a resume)."""
    d = config_to_dict(cfg.data)
    d.pop("cache_dir", None)
    d.pop("sources", None)
    return d


def check_init_tokenizer(src: InitSource, tok: Any, log: Callable[[str], None]) -> bool:
    """Warn when this run's tokenizer differs from the one ``qat.init_from`` was trained with.

    The init weights' embedding rows index the init run's vocabulary; a tokenizer retrained on other
    ``data.sources`` maps the same ids to other pieces. Compares ``tok`` with the ``tokenizer/`` folder
    next to the init run's checkpoints (a run or ``import hf`` folder); nothing is compared when that
    folder is absent. A warning, not a refusal: a tokenizer loaded from a ``tokenizer.json`` may be
    re-serialised differently while meaning the same.

    Returns:
        whether the tokenizers are known to be the same.
    """
    from minicpm4_jax.tokenizer import load_tokenizer

    folder = src.run_folder / "tokenizer"
    if not folder.is_dir():
        return False
    # the file of the same kind as this run's tokenizer (a folder holds both tokenizer.model and the
    # tokenizer.json written from it, whose hashes differ)
    name = "tokenizer.model" if tok.kind == "sentencepiece" else "tokenizer.json"
    path = folder / name if (folder / name).is_file() else folder
    try:
        init_tok = load_tokenizer(path)
    except ConfigError:
        return False
    if init_tok.file_hash == tok.file_hash:
        return True
    log(f"warning: qat: this run's tokenizer differs from {folder}, which qat.init_from was trained with: the "
        "init weights' embedding rows would index other pieces. Train on the init run's data.sources, or pass "
        f"data.tokenizer={folder}")
    return False


def continue_data_order(cfg: TrainConfig, src: InitSource, data_iterator: Any, log: Callable[[str], None]) -> bool:
    """With ``qat.continue_data``, set ``data_iterator`` to where ``src``'s run stopped.

    Only when ``src`` was saved with a data-iterator state and the same data settings
    (``cache_dir`` aside; ``sources`` naming the same files, however spelled); otherwise the data order starts from the beginning, and the reason is
    logged. Returns whether the order was continued.
    """
    from minicpm4_jax.train.checkpoint import has_data_iterator_state, restore_data_iterator

    if not cfg.qat.continue_data:
        return False
    # no data state first: an `import hf` folder has none, and its config's data section is only the defaults
    # (a list of "differences" from them would name settings that run never had)
    if not has_data_iterator_state(src.directory, src.step):
        log(f"qat: data order starts from the beginning (checkpoint step {src.step} holds no data-iterator state)")
        return False
    respelled = same_sources(src.cfg.data.sources, cfg.data.sources)
    if _data_fields(src.cfg) != _data_fields(cfg) or not respelled:
        diffs = [d for d in diff_configs(src.cfg.data, cfg.data, "data") if not d.startswith("data.cache_dir")
                 and not (respelled and d.startswith("data.sources"))]
        log(f"qat: data order starts from the beginning (init checkpoint's data settings differ: {'; '.join(diffs)})")
        return False
    restore_data_iterator(src.directory, src.step, data_iterator)
    log(f"qat: data order continues from step {src.step} of {src.directory}")
    return True


def stats_summary(stats: dict[str, dict[str, np.ndarray]]) -> tuple[float, float]:
    """``(fraction of zero codes, mean scale)`` over every ternary matrix and layer (unweighted mean)."""
    zeros = [float(np.mean(v["zero_fraction"])) for v in stats.values()]
    scales = [float(np.mean(v["scale_mean"])) for v in stats.values()]
    return (float(np.mean(zeros)) if zeros else float("nan"), float(np.mean(scales)) if scales else float("nan"))


def stats_lines(stats: dict[str, dict[str, np.ndarray]], model_cfg: ModelConfig) -> list[str]:
    """One terminal line per decoder layer: zero fraction and mean scale of each ternary matrix."""
    out = []
    order = {k: i for i, k in enumerate(SHORT_NAMES)}
    stats = dict(sorted(stats.items(), key=lambda kv: order.get(kv[0], len(order))))
    stacked = {k: v for k, v in stats.items() if np.ndim(v["zero_fraction"]) == 1}
    for i in range(model_cfg.num_hidden_layers):
        parts = [f"{SHORT_NAMES.get(k, k)} {100 * float(v['zero_fraction'][i]):4.1f}%/{float(v['scale_mean'][i]):.2e}"
                 for k, v in stacked.items()]
        out.append(f"  layer {i:>2d} zeros/scale: " + "  ".join(parts))
    for k, v in stats.items():
        if k not in stacked:
            out.append(f"  {SHORT_NAMES.get(k, k)} zeros/scale: {100 * float(v['zero_fraction']):4.1f}%/"
                       f"{float(v['scale_mean']):.2e}")
    return out
