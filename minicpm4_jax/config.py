"""Typed, frozen configuration for MiniCPM4 models and training runs.

One place holds every knob: frozen dataclasses (model, sparse attention, optimizer/schedule, data,
mesh, checkpoint, train), YAML presets in ``configs/``, dotted ``key=value`` overrides from the
command line, and :func:`validate`, the single place where a configuration is checked.

``ModelConfig.from_hf_config`` / ``ModelConfig.to_hf_config`` bridge the official MiniCPM
``config.json`` (spec ``minicpm4_model.md`` §1, incl. the constructor defaults that apply when a key
is missing: ``tie_word_embeddings`` True, ``rope_theta`` 10000).
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ConfigError",
    "MIN_TEMPERATURE",
    "check_temperature",
    "RopeScalingConfig",
    "SparseConfig",
    "ModelConfig",
    "OptimizerConfig",
    "DataConfig",
    "check_mixture",
    "MeshConfig",
    "CheckpointConfig",
    "DistributedConfig",
    "QATConfig",
    "TrainConfig",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "validate",
    "diff_configs",
    "same_sources",
    "CONFIG_DIR",
]

#: Where presets are looked up by name: the repository's ``configs/`` (a source checkout or an editable
#: install) or the copy installed as ``minicpm4_jax/configs`` (a wheel).
CONFIG_DIR = next(
    (d for d in (Path(__file__).resolve().parent.parent / "configs", Path(__file__).resolve().parent / "configs")
     if d.is_dir()),
    Path(__file__).resolve().parent.parent / "configs",
)

_DTYPES = ("float32", "bfloat16", "float16")
#: ternary scale granularities and STE gradient rules (``train.qat``; see ``minicpm4_jax/quant/ternary.py``)
QAT_GRANULARITIES = ("per_tensor", "per_row", "per_group")
QAT_STE_MODES = ("identity", "clipped")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value and the fix in one line."""


#: the smallest sampling temperature > 0 accepted (vLLM's sampling epsilon): colder is greedy decoding in all but
#: name, and dividing float32 logits by a temperature near float32's smallest normal number overflows (NaN samples)
MIN_TEMPERATURE = 1e-5


def check_temperature(value: Any, name: str = "temperature") -> None:
    """Raise ConfigError unless ``value`` is 0 (greedy) or a finite number >= :data:`MIN_TEMPERATURE`; the message
    names ``name`` (the option, e.g. ``--code-temperature``) and the value."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a finite number >= 0 (0 = greedy)")
    if 0 < value < MIN_TEMPERATURE:
        raise ConfigError(f"{name}={value!r} is below {MIN_TEMPERATURE:g}: sampling that cold is greedy decoding (and "
                          f"logits/temperature overflow float32 below about 1e-36); use {name}=0 for greedy")


@dataclass(frozen=True)
class RopeScalingConfig:
    """LongRoPE scaling (spec §4).

    ``short_factor``/``long_factor`` hold ``head_dim // 2`` per-frequency divisors. The factor set is
    chosen once from the configured lengths: long iff ``max_position_embeddings >
    original_max_position_embeddings`` (as the official MiniCPM code does), so a KV cache never mixes
    rotations. ``rope_type`` must be ``"longrope"``; anything else raises rather than silently falling
    back to plain RoPE (field fault B09).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    rope_type: str = "longrope"


@dataclass(frozen=True)
class SparseConfig:
    """InfLLM v2 block-sparse attention settings (spec §1.3, the official ``sparse_config`` block).

    ``variant`` picks the official generation: ``"gen2"`` (MiniCPM4.1, LSE-approximated stage 1,
    topk + window//block selected blocks) or ``"gen1"`` (MiniCPM4 June 2025, exact stage-1 softmax,
    in-kernel local window). ``dense_len``: sequences with total KV length ``< dense_len`` use dense
    attention; ``-1`` forces the sparse path. ``kernel_offby1_quirk`` reproduces the official
    stage-1 kernel's dropped kernel at lengths ≡ 15 mod 16 / ≡ 63 mod 64 (spec §5.2); off by default
    (the clean causal rule, which keeps cached decoding equal to a full forward).
    """

    kernel_size: int = 32
    kernel_stride: int = 16
    init_blocks: int = 1
    block_size: int = 64
    window_size: int = 2048
    topk: int = 64
    use_nope: bool = False
    dense_len: int = 8192
    variant: str = "gen2"
    kernel_offby1_quirk: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """MiniCPM4 architecture (spec §1-§4).

    Field names follow the official ``config.json``. ``head_dim`` ``None`` means
    ``hidden_size // num_attention_heads`` (the official configs carry no ``head_dim`` key).
    ``dtype`` is the compute dtype of activations and matmuls; parameters are kept in
    ``param_dtype`` (float32); softmax, norm statistics and logits are always float32.
    ``attention`` selects the algorithm (``dense`` | ``infllmv2``), ``attention_impl`` the
    implementation (``xla`` | ``pallas`` | ``auto``). ``remat``: ``none`` | ``full`` |
    ``dots`` (save matmul outputs only). ``mtp``: add the multi-token-prediction module
    (:class:`~minicpm4_jax.nn.mtp.MTPHead`, the EAGLE draft layout; spec §3.4/§7), trained with
    ``TrainConfig.mtp_loss_weight`` and used as the speculative draft by ``minicpm4 generate --spec-decode``.
    ``vocab_pad_multiple``: the embedding and head hold :attr:`padded_vocab_size` rows (``vocab_size`` rounded
    up to this multiple, independent of the mesh, so a checkpoint restores onto any mesh and the vocabulary
    axis divides the tensor axis); the padding rows start at zero, their logits are ``-inf`` (out of every
    softmax, loss and sample) and exports drop them. 1 = no padding (the released configs).
    """

    vocab_size: int = 73448
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig | None = None
    tie_word_embeddings: bool = True
    scale_emb: float = 12.0
    dim_model_base: int = 256
    scale_depth: float = 1.4
    initializer_range: float = 0.1
    hidden_act: str = "silu"
    bos_token_id: int = 1
    eos_token_id: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    attention: str = "dense"
    attention_impl: str = "auto"
    sparse_config: SparseConfig | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: str = "none"
    mtp: bool = False
    vocab_pad_multiple: int = 1

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        """Per-head width d (``head_dim`` or ``hidden_size // num_attention_heads``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding / columns of the head: ``vocab_size`` rounded up to ``vocab_pad_multiple``."""
        m = max(1, self.vocab_pad_multiple)
        return -(-self.vocab_size // m) * m

    @property
    def width_mult(self) -> float:
        """μP width multiplier ``hidden_size / dim_model_base`` (spec §3.2); logits are divided by it."""
        return self.hidden_size / self.dim_model_base

    @property
    def residual_scale(self) -> float:
        """Residual-branch multiplier ``scale_depth / sqrt(num_hidden_layers)`` (spec §2)."""
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    def _layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v/o projections, the gated MLP's three matrices, two norms."""
        h, d = self.hidden_size, self.resolved_head_dim
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        attn = h * nq * d + 2 * h * nkv * d + nq * d * h
        return attn + 3 * h * self.intermediate_size + 2 * h

    def mtp_params(self) -> int:
        """Exact parameter count of the MTP draft head (:class:`~minicpm4_jax.nn.mtp.MTPHead`; 0 without ``mtp``):
        two input norms ``[H]``, ``fc`` ``[2H, H]`` and one decoder layer (it shares the base's embedding and head).
        A run with ``mtp`` trains, checkpoints and moment-tracks these besides :meth:`num_params`."""
        if not self.mtp:
            return 0
        h = self.hidden_size
        return 2 * h + 2 * h * h + self._layer_params()

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of the dense model (no MTP head: :meth:`mtp_params`)."""
        h = self.hidden_size
        total = self.num_hidden_layers * self._layer_params() + h
        v = self.padded_vocab_size
        if include_embedding:
            total += v * h * (1 if self.tie_word_embeddings else 2)
        elif not self.tie_word_embeddings:
            total += v * h
        return total

    def flops_per_token(self, seq_len: int, *, mtp_depth: int = 1, mtp_distill: bool = False) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls incl. attention scores.

        Standard 6N + 12·L·d_attn·T (PaLM appendix B, causal attention counted as full as MaxText does). With the
        MTP draft head (``mtp``) each of the ``mtp_depth`` trained draft depths (``mtp_train_depth``) adds its
        module the same way: 6·(``fc`` 2H·H + one decoder layer's matrices + the output head V·H) + 12·d_attn·T
        (cpu_tiny: +43%), and ``mtp_distill`` the forward of the base's head on the positions it distils
        (2·V·H per depth). The draft runs in every step, so MFU counts it (without it, cpu_tiny's MTP run read
        MFU 32% where its FLOPs give 45%).
        """
        n = self.num_params(include_embedding=False)
        if self.tie_word_embeddings:
            n += self.vocab_size * self.hidden_size  # the head matmul still runs
        d_attn = self.num_attention_heads * self.resolved_head_dim
        attn = 12 * self.num_hidden_layers * d_attn * seq_len
        total = 6.0 * n + attn
        if self.mtp:
            h, v = self.hidden_size, self.padded_vocab_size
            layer = self._layer_params() - 2 * h  # its matrices (not the norms)
            draft = 6.0 * (2 * h * h + layer + v * h) + 12 * d_attn * seq_len + (2.0 * v * h if mtp_distill else 0.0)
            total += mtp_depth * draft
        return total

    # ---- Hugging Face bridge ------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from an official MiniCPM ``config.json`` dict (spec §1.1 constructor defaults).

        A ``head_dim`` equal to ``hidden_size // num_attention_heads`` (what transformers' ``save_pretrained`` adds to
        a folder that had none) is read as ``None``, the same width, so a re-imported export equals its source.

        Raises:
            ConfigError: unsupported ``hidden_act``, unknown ``rope_scaling.rope_type``, a ``rope_scaling``
                that is not a mapping or lacks ``short_factor`` / ``long_factor``, a ``sparse_config`` that is not
                a mapping or holds a value of the wrong type; any field of the wrong JSON type (``"hidden_size":
                "256"``, ``"num_hidden_layers": 2.5``, ``"scale_emb": true``, ``"tie_word_embeddings": "false"``),
                named with the type it needs (typed like a YAML config, never cast silently).
        """
        hints = typing.get_type_hints(cls)

        def get(key: str, default: Any, field: str | None = None) -> Any:
            value = hf.get(key, default)
            if isinstance(value, str):  # JSON has numbers and booleans ('1e-5' is a YAML 1.1 accident, not JSON's)
                raise ConfigError(f"{key}={value!r} is a string; config.json needs a JSON number or boolean here")
            return _coerce(value, hints[field or key], key)

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported; MiniCPM4 uses 'silu'")
        rs = hf.get("rope_scaling")
        rp = hf.get("rope_parameters")  # transformers 5's save_pretrained writes LongRoPE here, not rope_scaling
        if rs is None and isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) not in (None, "default"):
            rs = {k: v for k, v in rp.items() if k != "rope_theta"}
        rope_scaling = None
        if rs is not None:
            if not isinstance(rs, dict):
                raise ConfigError(f"rope_scaling={rs!r} is not a mapping; give the LongRoPE settings "
                                  "(rope_type, short_factor, long_factor) or remove rope_scaling")
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype != "longrope":
                raise ConfigError(
                    f"rope_scaling.rope_type={rtype!r} is not supported; use 'longrope' or remove rope_scaling"
                )
            missing = [k for k in ("short_factor", "long_factor") if k not in rs]
            if missing:
                raise ConfigError(f"rope_scaling has no {' or '.join(map(repr, missing))}; LongRoPE needs both "
                                  "factor lists (head_dim/2 values each): add them or remove rope_scaling")
            orig = rs.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
            rope_scaling = _from_dict(RopeScalingConfig, {
                "short_factor": rs["short_factor"], "long_factor": rs["long_factor"],
                "original_max_position_embeddings": orig}, "rope_scaling")
        eos_t = get("eos_token_id", 2)
        sparse = hf.get("sparse_config")
        sparse_cfg = None
        if sparse is not None:
            if not isinstance(sparse, dict):
                raise ConfigError(f"sparse_config={sparse!r} is not a mapping; give the InfLLM v2 settings "
                                  "(kernel_size, block_size, topk, ...) or remove sparse_config")
            known = {f.name for f in dataclasses.fields(SparseConfig)}
            # typed like a YAML config: a bad value names its field (sparse_config.topk='x' must be an integer)
            sparse_cfg = _from_dict(SparseConfig, {k: v for k, v in sparse.items() if k in known}, "sparse_config")
        nq = get("num_attention_heads", 32)
        kw: dict[str, Any] = dict(
            vocab_size=get("vocab_size", 32000),
            hidden_size=get("hidden_size", 4096),
            intermediate_size=get("intermediate_size", 11008),
            num_hidden_layers=get("num_hidden_layers", 32),
            num_attention_heads=nq,
            num_key_value_heads=nq if hf.get("num_key_value_heads") is None else get("num_key_value_heads", None),
            head_dim=get("head_dim", None),
            max_position_embeddings=get("max_position_embeddings", 2048),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            # transformers 5 configs may keep the base only in rope_parameters (was: silently 10000)
            rope_theta=get("rope_theta", rp.get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=get("tie_word_embeddings", True),
            scale_emb=get("scale_emb", 1),
            dim_model_base=get("dim_model_base", 1),
            scale_depth=get("scale_depth", 1),
            initializer_range=get("initializer_range", 0.02),
            bos_token_id=get("bos_token_id", 1),
            eos_token_id=eos_t,
            pad_token_id=get("pad_token_id", None),
            attention="infllmv2" if sparse_cfg is not None else "dense",
            sparse_config=sparse_cfg,
        )
        hd = kw["head_dim"]
        if (isinstance(hd, int) and isinstance(kw["hidden_size"], int) and isinstance(nq, int) and nq > 0
                and kw["hidden_size"] % nq == 0 and hd == kw["hidden_size"] // nq):
            # the width implied by hidden/heads, as transformers' save_pretrained writes it: the model of a folder
            # without the key (a re-import of an export equals the exported config)
            kw["head_dim"] = None
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict[str, Any]:
        """The official MiniCPM ``config.json`` dict for this model (inverse of ``from_hf_config``)."""
        out: dict[str, Any] = {
            "architectures": ["MiniCPMForCausalLM"],
            "model_type": "minicpm",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0],
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "scale_emb": _int_if_integral(self.scale_emb),
            "dim_model_base": self.dim_model_base,
            "scale_depth": self.scale_depth,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16" if self.dtype == "bfloat16" else "float32",
        }
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        if self.rope_scaling is not None:
            out["rope_scaling"] = {
                "rope_type": self.rope_scaling.rope_type,
                "long_factor": list(self.rope_scaling.long_factor),
                "short_factor": list(self.rope_scaling.short_factor),
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        if self.attention == "infllmv2" and self.sparse_config is not None:
            out["sparse_config"] = dataclasses.asdict(self.sparse_config)
        return out


def _int_if_integral(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with MiniCPM μP learning-rate rules and the WSD schedule (spec §3.2-§3.3).

    ``learning_rate`` is the base (peak) LR: embedding, head and norms train at it, hidden
    matrices at ``learning_rate / width_mult`` when ``mup`` is on. Schedule: linear warmup over
    ``warmup_steps``, stable, then decay over ``decay_steps`` (or ``decay_fraction`` of the run when
    ``decay_steps`` is ``None``) to ``min_lr_ratio * learning_rate`` with shape ``decay_style``
    (``exponential`` | ``linear``).
    """

    learning_rate: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 100
    decay_steps: int | None = None
    decay_fraction: float = 0.1
    decay_style: str = "exponential"
    min_lr_ratio: float = 0.1
    mup: bool = True


@dataclass(frozen=True)
class DataConfig:
    """Training data: sources, tokenizer, windows.

    ``sources``: ``stdlib`` (the CPython standard library of the running interpreter), or paths to
    ``.txt``/``.jsonl``/``.parquet`` files, folders of them, or a Hugging Face ``save_to_disk``
    dataset folder. ``tokenizer``: ``train`` (SentencePiece BPE with byte fallback trained on the
    corpus, ``tokenizer_vocab_size`` pieces) or a path to ``tokenizer.model`` / ``tokenizer.json``.
    ``cache_dir`` ``None`` means ``<repo>/.cache/data`` (gitignored).

    ``weights``: ``None`` (default) reads every source into one corpus; a list of numbers >= 0, one per
    ``sources`` entry, makes each entry a component of a data mixture, served in those proportions (each
    component with its own validation split, token cache and validation loss; one tokenizer, trained on the
    union of the components' training documents when ``tokenizer: train``; ``train.data``, "Mixtures").
    ``decay_weights``: the mixture from the first step of the learning-rate schedule's decay phase on (MiniCPM's
    recipe: the high-quality data annealed in during the decay; with ``qat.enabled`` the QAT stage's own decay,
    ``train.step.decay_start_step``; ``None`` = ``weights`` throughout).
    """

    sources: tuple[str, ...] = ("stdlib",)
    text_field: str = "text"
    tokenizer: str = "train"
    tokenizer_vocab_size: int = 8192
    seq_len: int = 512
    batch_size: int = 16
    val_fraction: float = 0.02
    seed: int = 0
    cache_dir: str | None = None
    weights: tuple[float, ...] | None = None
    decay_weights: tuple[float, ...] | None = None


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh ``(data, fsdp, tensor)``; ``-1`` on one axis takes the remaining devices.

    ``axis_types``: ``"auto"``, the only supported value (``AxisType.Auto`` axes: the train step places arrays
    through jit shardings and sharding constraints, not sharding-in-types).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    axis_types: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    """orbax checkpointing: ``directory`` ``None`` means ``<out_dir>/checkpoints``."""

    directory: str | None = None
    save_every: int = 200
    keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start-up: when and how ``jax.distributed.initialize`` runs (``train/distributed.py``).

    ``mode``:

    * ``off`` (default): one process; ``jax.distributed.initialize`` is not called.
    * ``auto``: ``jax.distributed.initialize()`` detects the cluster (Cloud TPU, SLURM, Open MPI,
      Kubernetes/GKE JobSet, or ``mpi4py`` with ``cluster_detection_method: mpi4py``); the fields
      below that are set override what it detects.
    * ``explicit``: ``coordinator_address`` (``host:port`` of process 0; falls back to the
      ``JAX_COORDINATOR_ADDRESS`` environment variable), ``num_processes`` and ``process_id`` (give
      each process its own, e.g. ``distributed.process_id=$RANK`` on the command line).

    ``local_device_ids``: the accelerators this process uses (``null``: all it sees).
    ``initialization_timeout``: seconds to wait for all processes to connect.

    It runs at the start of ``run_training``, before any device is touched. All processes then run
    the same program: each reads only its rows of every global batch, process 0 alone prints, writes
    TensorBoard, ``config.json``, ``tokenizer/`` and ``summary.json``; checkpoints are written by all
    (orbax) into one folder that every process must see (a shared file system or a bucket). These
    fields never change the math, so a ``--resume`` may change them (another process layout).
    """

    mode: str = "off"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cluster_detection_method: str | None = None
    initialization_timeout: int = 300


@dataclass(frozen=True)
class QATConfig:
    """Ternary quantization-aware training, BitCPM4 (paper §3.3; spec ``export.md`` §5).

    Weights only: the attention and MLP projections (and, if asked, the embedding / untied head)
    are fake-quantized to ``{-1, 0, +1} * s`` in the forward of the loss with absmean scales
    ``s = mean|W|`` per ``granularity`` (``per_tensor`` | ``per_row``: per output feature |
    ``per_group``: per ``group_size`` input columns of a row); activations, norms and the
    optimizer state stay high precision; the latent float weights are what is trained and saved.

    Two ways to get "high precision first, then QAT":

    * ``init_from``: start from a trained checkpoint (a run's ``out_dir``/checkpoints folder or the
      ``OUT`` of ``minicpm4 import hf``; step ``init_step``, default the latest). The whole run is
      QAT (``token_share`` must stay 1) with a fresh optimizer and the run's own schedule, so the
      learning rate is re-warmed. With ``continue_data`` the data order continues where that
      checkpoint stopped (when it is a run of this project with the same data settings).
    * ``token_share < 1`` in one run: the first ``steps - round(token_share * steps)`` steps are
      high precision, on the run's WSD schedule (``optimizer``) cut off at the switch; the rest are
      QAT with the learning rate re-warmed and a WSD schedule of their own (optimizer state kept).

    The QAT part's schedule is the optimizer's WSD (decay ``decay_steps`` or ``decay_fraction`` of
    the QAT steps) with ``warmup_steps`` / ``learning_rate`` overriding the optimizer's when set.
    ``ste``: the straight-through gradient, ``identity`` (everywhere) or ``clipped`` (zero where
    ``|W/s| > 1``; the bounds ``|W/s| == 1`` keep their gradient).
    """

    enabled: bool = False
    init_from: str | None = None
    init_step: int | None = None
    token_share: float = 1.0
    granularity: str = "per_row"
    group_size: int = 128
    quantize_embeddings: bool = False
    quantize_lm_head: bool = False
    ste: str = "identity"
    warmup_steps: int | None = None
    learning_rate: float | None = None
    continue_data: bool = True


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run.

    ``mtp_loss_weight``: λ of ``L = L_NTP + λ·L_MTP`` when ``model.mtp`` is on (spec §3.4; default 0.1).
    ``mtp_distill``: α in [0, 1] of ``L_MTP = (1 - α)·CE(q_i, x_{i+2}) + α·KL(p_{i+1} || q_i)``: the draft learns
    the base model's own next-token distribution (:func:`~minicpm4_jax.nn.mtp.mtp_distill_loss`; 0 = the paper's
    token loss alone). ``mtp_feature_weight``: β of ``+ β·SmoothL1(o_i, h_{i+1})``, EAGLE-1's feature regression
    (:func:`~minicpm4_jax.nn.mtp.mtp_feature_loss`; 0 = off). ``mtp_train_depth``: D >= 1 chain depths trained,
    each on the draft's own stand-in states from the depth before (:meth:`~minicpm4_jax.nn.mtp.MTPHead.unrolled`),
    every term above averaged over them (1 = the paper's single-depth MTP). ``mtp_detach``: the MTP module reads
    the base's final states without training them (``stop_gradient``; EAGLE's frozen-base draft): the draft's losses
    then reach the base only through the shared embedding / head (default false: the paper's joint MTP, whose loss
    also trains the base). These four only shape the draft for speculative decoding; without ``model.mtp`` they do
    nothing (the training log says so) and a resume ignores them (:data:`MTP_DRAFT_FIELDS`).

    ``logits_chunk_size``: sequence positions whose output-head logits exist at once in the losses (the
    next-token loss, every MTP term, the eval loss): per device ``local batch × chunk × vocab`` float32 logits
    and as much again for their gradient, instead of the whole sequence's (``train.step.token_sums``: a
    rematerialised scan over chunks, the blockwise loss of Levanter / MaxText's vocabulary tiling). The losses
    are unchanged up to float32 summation order; the head's matmul runs once more in the backward. ``0`` (the
    default): the whole sequence at once.

    ``gradient_accumulation_steps``: A >= 1 microbatches per optimizer step. ``data.batch_size`` stays the global
    batch of one update (the same data order, the same tokens per step, the same learning-rate schedule); the
    step splits it into A microbatches of ``batch_size / A`` sequences, runs the forward and backward of one at a
    time in a ``lax.scan`` and averages their gradients (float32) before the single optimizer update, so the
    activations held for the backward are one microbatch's (``train.step.split_microbatches``). Every sequence
    has the same number of targets, so the averaged loss and gradient equal the whole batch's up to float32
    summation order; a resume may change A. ``batch_size`` must divide into A microbatches of whole
    ``data * fsdp`` shards (a multiple of ``A * data * fsdp``). The eval step splits its batches the same way.

    ``branch_from`` / ``branch_step``: start this run as a **decay branch** of another run (its ``out_dir`` or
    checkpoints folder) at its checkpoint ``branch_step`` (default: its latest): the train state, optimizer
    state and data order continue from there, so with the WSD schedule one stable phase serves decays to several
    lengths (MiniCPM's WSD recipe; ``train.branch``). Everything but ``steps``, the decay's shape
    (``optimizer.decay_steps`` / ``decay_fraction`` / ``decay_style`` / ``min_lr_ratio``),
    ``data.decay_weights`` and what a resume may change must equal the source's, and both schedules must give
    the same learning rate at every step before ``branch_step`` (the branch point lies before both decays).
    The source's folder is only read (it may still be training).

    ``profile_start_step``: trace training steps ``profile_start_step .. profile_start_step + profile_steps - 1``
    (numbered as in the log, from 1) with ``jax.profiler`` into ``<out_dir>/profile/process_<i>`` (every process
    its own folder; TensorBoard's profile plugin / XProf / Perfetto read it); ``None`` (default): no trace. The
    traced steps' tokens/s include the tracer's overhead.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    steps: int = 1000
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    out_dir: str = "runs/default"
    tensorboard: bool = True
    max_train_minutes: float | None = None
    sample_prompt: str = "def "
    sample_tokens: int = 64
    sample_temperature: float = 0.8
    sample_top_p: float = 0.95
    qat: QATConfig = field(default_factory=QATConfig)
    mtp_loss_weight: float = 0.1
    mtp_distill: float = 0.0
    mtp_feature_weight: float = 0.0
    mtp_train_depth: int = 1
    mtp_detach: bool = False
    logits_chunk_size: int = 0
    gradient_accumulation_steps: int = 1
    branch_from: str | None = None
    branch_step: int | None = None
    profile_start_step: int | None = None
    profile_steps: int = 3

    @property
    def qat_start_step(self) -> int | None:
        """The first step trained ternary (``None`` without QAT): ``steps - round(qat.token_share * steps)``."""
        if not self.qat.enabled:
            return None
        return self.steps - self.qat_steps

    @property
    def qat_steps(self) -> int:
        """Number of QAT steps of the run (0 without QAT)."""
        if not self.qat.enabled:
            return 0
        return int(round(self.qat.token_share * self.steps))


# TrainConfig fields that shape only the MTP draft head (no effect without model.mtp), with their "off" defaults
MTP_DRAFT_FIELDS = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                    if f.name in ("mtp_distill", "mtp_feature_weight", "mtp_train_depth", "mtp_detach")}


def inactive_draft_options(cfg: TrainConfig) -> list[str]:
    """``name=value`` of the draft options set away from their defaults in a run without ``model.mtp``."""
    if cfg.model.mtp:
        return []
    return [f"{k}={getattr(cfg, k)}" for k, off in MTP_DRAFT_FIELDS.items() if getattr(cfg, k) != off]


def check_training_selection(cfg: TrainConfig) -> None:
    """Refuse an InfLLM v2 ``topk`` / ``init_blocks`` above the number of blocks in ``max_position_embeddings``
    for training (one-line ConfigError naming the count).

    The selection keeps ``topk`` (+ window) columns per query whatever the length (field fault B04's shape), so a
    huge ``topk`` meant as "all blocks" ran out of memory (35 GiB at ``topk=1e6``) instead of selecting every
    block. Training only: inference and imports may run a model with more top-k than blocks (the MiniCPM4.1
    defaults, topk 64, on a short-context model) at no such cost.
    """
    s = cfg.model.sparse_config
    if cfg.model.attention != "infllmv2" or s is None:
        return
    n_blocks = -(-cfg.model.max_position_embeddings // s.block_size)
    for nm in ("topk", "init_blocks"):
        if getattr(s, nm) > n_blocks:
            raise ConfigError(
                f"model.sparse_config.{nm}={getattr(s, nm)} exceeds the {n_blocks} blocks of "
                f"max_position_embeddings={cfg.model.max_position_embeddings} (block_size={s.block_size}); "
                f"{nm}={n_blocks} already covers every block")


def inactive_qat_options(cfg: TrainConfig) -> list[str]:
    """``qat.name=value`` of the QAT settings away from their defaults in a run with ``qat.enabled=false`` (a QAT
    preset trained in high precision, or a forgotten ``qat.enabled=true``): they have no effect."""
    if cfg.qat.enabled:
        return []
    default = QATConfig()
    return [f"qat.{f.name}={getattr(cfg.qat, f.name)}" for f in dataclasses.fields(QATConfig)
            if f.name != "enabled" and getattr(cfg.qat, f.name) != getattr(default, f.name)]


def qat_warmup_warning(cfg: TrainConfig) -> str | None:
    """A warning line when ``qat.token_share`` leaves a high-precision stage shorter than ``optimizer.warmup_steps``
    (the stage ends inside its warmup: its last update runs at ``hp / warmup_steps`` of the peak learning rate, and
    QAT starts from a model never trained at the peak), else ``None``. The QAT stage's own re-warmup is checked by
    :func:`validate` (an error when it does not fit)."""
    hp, warm = cfg.qat_start_step or 0, cfg.optimizer.warmup_steps
    if not 0 < hp < warm:
        return None
    return (f"warning: qat.token_share={cfg.qat.token_share} x steps={cfg.steps} leaves {hp} high-precision steps, "
            f"fewer than optimizer.warmup_steps={warm}: that stage ends inside its warmup (at {hp / warm:.0%} of "
            f"the peak learning rate) before QAT starts; lower optimizer.warmup_steps to {hp} or less, lower "
            "qat.token_share, or set qat.token_share=1 for a QAT-only run")


# ------------------------------------------------------------------------------------------------
# dict <-> dataclass
# ------------------------------------------------------------------------------------------------


def _suggest(key: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    base, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        if base is str:  # `key=` and `key: null` are YAML's null; an empty string is written ''
            raise ConfigError(f"{where} has no value (YAML null); give a string, or {where}=\"''\" for an empty one")
        raise ConfigError(f"{where}=None is not allowed; give a value of type {getattr(base, '__name__', base)}")
    if dataclasses.is_dataclass(base):
        if isinstance(value, base):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return _from_dict(base, value, where)
    origin = typing.get_origin(base)
    if origin is tuple:
        (elem, *_rest) = typing.get_args(base)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value))
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if base is int:
        if isinstance(value, str):  # YAML 1.1 reads '1e3' as a string; a whole number in E notation is one
            try:
                exact = decimal.Decimal(value.strip())
            except decimal.InvalidOperation:
                exact = None
            if exact is not None and exact.is_finite() and exact.adjusted() > 18:  # 1e5000 hung / crashed int()
                raise ConfigError(f"{where}={value!r} is too large for an integer setting (at most 19 digits)")
            if exact is not None and exact.is_finite() and exact == exact.to_integral_value():
                return int(exact)
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return int(value)
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads '3e-3' as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if base is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a string")
        return str(value)
    return value


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if not isinstance(key, str):  # YAML reads `1:`, `3.5:`, `off:` as a number / boolean
            hint = " (YAML reads on/off/yes/no as booleans)" if isinstance(key, bool) else ""
            raise ConfigError(f"config key {path!r} ({type(key).__name__}{hint}) is not a field name; the keys of "
                              f"{where or 'the config'} are names such as {names[0]!r}")
        if key not in names:
            raise ConfigError(f"unknown config key {path!r}{_suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        label = where or "the config"
        raise ConfigError(f"{label} lacks {', '.join(repr(m) for m in missing)}; a mapping given for {label} must "
                          "hold every required field (or give null where that is allowed)")
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from a nested dict (YAML layout); unknown keys raise ConfigError."""
    return _from_dict(TrainConfig, data or {}, "")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-Python dict (tuples as lists) of a config dataclass, for YAML/JSON."""

    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        return x

    return conv(cfg)


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides (values parsed as YAML) to a nested config dict.

    Raises:
        ConfigError: a malformed override or a key that does not exist (with the closest match).
    """
    data = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. model.hidden_size=256)")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() != "" else None
        except yaml.YAMLError as e:
            what = getattr(e, "problem", None) or e.__class__.__name__
            raise ConfigError(f"override {item!r}: value is not valid YAML ({what})") from None
        parts = key.split(".")
        cls: Any = TrainConfig
        node = data
        for i, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                prefix = ".".join(parts[:i])
                where = f" in section {prefix!r}" if prefix else ""
                raise ConfigError(f"unknown config key {key!r}{where}{_suggest(part, names)}")
            ftype, _ = _unwrap_optional(typing.get_type_hints(cls)[part])
            if i == len(parts) - 1:
                node[part] = value
            else:
                if not dataclasses.is_dataclass(ftype):
                    raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section")
                if not isinstance(node.get(part), dict):
                    node[part] = {} if node.get(part) is None else node[part]
                node = node[part]
                cls = ftype
    return data


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def resolve_preset(path_or_name: str) -> Path:
    """A preset path, or a bare name looked up in ``configs/`` (``cpu_tiny`` -> ``configs/cpu_tiny.yaml``).

    Raises:
        ConfigError: no such file (lists the presets available).
    """
    p = Path(path_or_name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / path_or_name, CONFIG_DIR / f"{path_or_name}.yaml"):
        if cand.is_file():
            return cand
    names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
    if p.is_dir():  # helper 69: `--config configs` said "not found"
        raise ConfigError(f"config {path_or_name!r} is a folder; give a YAML file in it or one of the presets "
                          f"{names}")
    raise ConfigError(f"config {path_or_name!r} not found; give a YAML path or one of the presets {names}")


def load_config(path_or_name: str | None = None, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Load a YAML preset (path or name in ``configs/``), apply overrides, validate.

    A preset may name another with ``base: <preset>``; its keys are merged over the base.

    Raises:
        ConfigError: unreadable preset, unknown key, bad value or inconsistent settings.
    """
    data: dict[str, Any] = {}
    if path_or_name is not None:
        data = _load_yaml_with_base(resolve_preset(path_or_name), seen=())
    data = apply_overrides(data, overrides)
    cfg = config_from_dict(data)
    validate(cfg)
    return cfg


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            # merge keys (``<<:``) may be overridden by design, and non-scalar keys are PyYAML's own error
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node, deep=deep)
            ident = (type(key), key)  # 1 and true are different keys, though equal in Python
            if ident in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {seen[ident] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[ident] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _load_yaml_with_base(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path in seen:
        raise ConfigError(f"preset {path} includes itself through 'base'")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"preset {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"preset {path} cannot be read ({e.strerror or e}); check the path and its permissions") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"preset {path} is not valid YAML{where}: {what}; fix the file") from None
    if data is None or data == {}:  # an empty file (or one of comments): a wrong file, or one not saved yet
        raise ConfigError(f"preset {path} is empty (no sections); fill it in, or give a preset such as cpu_tiny")
    if not isinstance(data, dict):
        raise ConfigError(f"preset {path} must be a YAML mapping of sections")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"preset {path}: base: {base!r} must be a preset name or a path to a YAML file (a string)")
    if base is not None:
        base_path = resolve_preset(base) if not (path.parent / base).is_file() else path.parent / base
        data = _merge(_load_yaml_with_base(base_path, seen + (path,)), data)
    return data


# ------------------------------------------------------------------------------------------------
# validation: the one place
# ------------------------------------------------------------------------------------------------


def gen2_topk_reason(s: SparseConfig) -> str:
    """Why a gen-2 ``topk < init_blocks + 1`` cannot work, and the fix (one line; spec ``minicpm4_model.md`` §1.3)."""
    local = s.window_size // s.block_size
    return (f"gen2 forces init_blocks + window_size//block_size + 1 = {s.init_blocks + local + 1} blocks into its "
            f"topk + window_size//block_size = {s.topk + local}, so a query would lose its own block; use topk >= "
            f"{s.init_blocks + 1}")


def validate_model(m: ModelConfig) -> None:
    """Check a model config's internal consistency. Raises ConfigError with the fix."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "dim_model_base"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.head_dim is not None and m.head_dim <= 0:
        raise ConfigError(f"model.head_dim={m.head_dim} must be positive (or null: hidden_size / num_attention_heads)")
    if m.vocab_pad_multiple < 1:
        raise ConfigError(f"model.vocab_pad_multiple={m.vocab_pad_multiple} must be >= 1 (1 = no padding; e.g. 256)")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads}; pick kv heads that divide the query heads"
        )
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; change one or set model.head_dim"
        )
    if m.resolved_head_dim % 2:
        raise ConfigError(f"head_dim={m.resolved_head_dim} must be even for rotary embeddings")
    if not (math.isfinite(m.rms_norm_eps) and m.rms_norm_eps > 0):
        raise ConfigError(f"model.rms_norm_eps={m.rms_norm_eps} must be a finite number > 0 (e.g. 1e-6)")
    if not (math.isfinite(m.rope_theta) and m.rope_theta > 0):
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be a finite number > 0 (e.g. 10000.0)")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        if rs.rope_type != "longrope":
            raise ConfigError(f"model.rope_scaling.rope_type={rs.rope_type!r} is not supported; use 'longrope'")
        half = m.resolved_head_dim // 2
        for nm in ("short_factor", "long_factor"):
            lst = getattr(rs, nm)
            if len(lst) != half:
                hd = (f"model.head_dim={m.head_dim}" if m.head_dim is not None else
                      f"head_dim = model.hidden_size / model.num_attention_heads = {m.hidden_size}/{m.num_attention_heads}")
                raise ConfigError(
                    f"model.rope_scaling.{nm} has {len(lst)} values but {hd} needs head_dim/2={half}: give one "
                    "factor per frequency, or restore the head layout the factors were made for"
                )
            if any(not (f > 0) for f in lst):
                raise ConfigError(f"model.rope_scaling.{nm} must be all positive")
        if rs.original_max_position_embeddings <= 0:
            raise ConfigError("model.rope_scaling.original_max_position_embeddings must be positive")
        if m.max_position_embeddings < rs.original_max_position_embeddings:
            raise ConfigError(
                f"model.max_position_embeddings={m.max_position_embeddings} is below "
                f"rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings}; raise it"
            )
    if m.hidden_act != "silu":
        raise ConfigError(f"model.hidden_act={m.hidden_act!r} is not supported; use 'silu'")
    if m.attention not in ("dense", "infllmv2"):
        raise ConfigError(f"model.attention={m.attention!r}; use 'dense' or 'infllmv2'")
    if m.attention_impl not in ("xla", "pallas", "auto"):
        raise ConfigError(f"model.attention_impl={m.attention_impl!r}; use 'xla', 'pallas' or 'auto'")
    if m.attention == "infllmv2" and m.sparse_config is None:
        raise ConfigError("model.attention='infllmv2' needs a model.sparse_config section")
    if m.attention_impl == "pallas" and m.attention == "dense":  # the dispatch's message, before any work
        raise ConfigError(
            f"model.attention_impl={m.attention_impl!r} has no dense kernel in this version; use 'xla' or 'auto'"
        )
    if m.sparse_config is not None:
        s = m.sparse_config
        if s.variant not in ("gen1", "gen2"):
            raise ConfigError(f"model.sparse_config.variant={s.variant!r}; use 'gen1' or 'gen2'")
        for nm in ("kernel_size", "kernel_stride", "block_size", "window_size", "topk"):
            if getattr(s, nm) <= 0:
                raise ConfigError(f"model.sparse_config.{nm}={getattr(s, nm)} must be positive")
        if s.init_blocks < 0:
            raise ConfigError(f"model.sparse_config.init_blocks={s.init_blocks} must be >= 0")
        if s.block_size % s.kernel_stride:
            raise ConfigError(
                f"model.sparse_config.block_size={s.block_size} must be a multiple of kernel_stride={s.kernel_stride}"
            )
        if s.kernel_size % s.kernel_stride:
            raise ConfigError(
                f"model.sparse_config.kernel_size={s.kernel_size} must be a multiple of kernel_stride={s.kernel_stride}"
            )
        if s.window_size % s.block_size:
            raise ConfigError(
                f"model.sparse_config.window_size={s.window_size} must be a multiple of block_size={s.block_size}"
            )
        if s.dense_len < -1:
            raise ConfigError(f"model.sparse_config.dense_len={s.dense_len}; use -1 (always sparse) or a length >= 0")
        if s.variant == "gen2" and s.topk < s.init_blocks + 1:
            raise ConfigError(f"model.sparse_config.topk={s.topk} with init_blocks={s.init_blocks}: {gen2_topk_reason(s)}")

        if m.attention_impl == "pallas" and (s.block_size < 16 or s.block_size & (s.block_size - 1)):
            raise ConfigError(f"model.sparse_config.block_size={s.block_size}: the Pallas kernels need a power of two "
                              ">= 16 (MiniCPM4: 64); change it or use model.attention_impl='xla'")
    for nm in ("dtype", "param_dtype"):
        if getattr(m, nm) not in _DTYPES:
            raise ConfigError(f"model.{nm}={getattr(m, nm)!r}; use one of {list(_DTYPES)}")
    if m.remat not in ("none", "full", "dots"):
        raise ConfigError(f"model.remat={m.remat!r}; use 'none', 'full' or 'dots'")
    if not m.eos_token_id:
        raise ConfigError("model.eos_token_id must name at least one token id")
    for nm in ("scale_emb", "scale_depth", "initializer_range"):  # 0 silences the input / the residual branches
        v = getattr(m, nm)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"model.{nm}={v} must be a finite number > 0 (MiniCPM4: scale_emb 12, scale_depth "
                              "1.4, initializer_range 0.1)")
    for nm, ids in (("bos_token_id", [m.bos_token_id]), ("eos_token_id", list(m.eos_token_id))):
        bad = [i for i in ids if not 0 <= i < m.vocab_size]
        if bad:
            raise ConfigError(f"model.{nm} holds {bad[0]}, outside the vocabulary [0, {m.vocab_size}); use the "
                              "tokenizer's id")


def check_mixture(d: DataConfig) -> None:
    """Check ``data.weights`` / ``data.decay_weights`` (see :class:`DataConfig`); one-line ConfigError."""
    if d.weights is None:
        if d.decay_weights is not None:
            raise ConfigError(f"data.decay_weights={list(d.decay_weights)} needs data.weights (one weight per "
                              "data.sources entry: the mixture before the decay phase)")
        return
    for key, ws in (("weights", d.weights), ("decay_weights", d.decay_weights)):
        if ws is None:
            continue
        if len(ws) != len(d.sources):
            raise ConfigError(f"data.{key} has {len(ws)} entries for {len(d.sources)} data.sources; give one weight "
                              "per source")
        if not all(math.isfinite(w) and w >= 0 for w in ws) or not 0 < sum(ws) < math.inf:
            raise ConfigError(f"data.{key}={list(ws)} must be finite numbers >= 0 with a positive, finite sum (the mixture's "
                              "proportions)")


def validate(cfg: TrainConfig) -> None:
    """Check a whole run's configuration. Raises :class:`ConfigError` naming the bad value and the fix."""
    validate_model(cfg.model)
    d, o = cfg.data, cfg.optimizer
    if d.seq_len <= 0 or d.batch_size <= 0:
        raise ConfigError(f"data.seq_len={d.seq_len} and data.batch_size={d.batch_size} must be positive")
    if d.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={d.seq_len} is above model.max_position_embeddings={cfg.model.max_position_embeddings}; "
            "lower data.seq_len or raise the model's maximum"
        )
    if not d.sources:
        raise ConfigError("data.sources is empty; give 'stdlib' or paths to .txt/.jsonl/.parquet files")
    if not 0.0 < d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")
    check_mixture(d)
    if d.tokenizer == "train" and d.tokenizer_vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer_vocab_size={d.tokenizer_vocab_size} exceeds model.vocab_size={cfg.model.vocab_size}"
        )
    if not 0 < cfg.steps < 2**31:
        raise ConfigError(f"steps={cfg.steps} must be in [1, {2**31 - 1}] (the step counter is int32)")
    if not (math.isfinite(cfg.mtp_loss_weight) and cfg.mtp_loss_weight >= 0):
        raise ConfigError(f"mtp_loss_weight={cfg.mtp_loss_weight} must be a finite number >= 0 (the λ of "
                          "L_NTP + λ·L_MTP)")
    if not 0.0 <= cfg.mtp_distill <= 1.0:
        raise ConfigError(f"mtp_distill={cfg.mtp_distill} must be in [0, 1] (the KL share of the MTP loss)")
    # the default depth 1 is inactive without the MTP head (a seq_len of 1 then trains next-token prediction
    # alone); a value set on purpose is checked either way
    if cfg.model.mtp and d.seq_len < 2:
        raise ConfigError(f"data.seq_len={d.seq_len} must be >= 2 with the MTP head (model.mtp): it predicts the token "
                          "after next")
    if cfg.mtp_train_depth < 1 or (cfg.mtp_train_depth >= d.seq_len and (cfg.model.mtp or cfg.mtp_train_depth > 1)):
        raise ConfigError(f"mtp_train_depth={cfg.mtp_train_depth} must be in [1, data.seq_len={d.seq_len}) "
                          "(1 = the paper's MTP; 2-3 train the chained drafts too)")
    if cfg.profile_start_step is not None and not 1 <= cfg.profile_start_step <= cfg.steps:
        raise ConfigError(f"profile_start_step={cfg.profile_start_step} must be in [1, steps={cfg.steps}] (the first "
                          "traced step, numbered as in the log; null = no trace)")
    if cfg.profile_steps < 1:
        raise ConfigError(f"profile_steps={cfg.profile_steps} must be >= 1 (steps traced from profile_start_step)")
    if cfg.branch_step is not None and cfg.branch_from is None:
        raise ConfigError(f"branch_step={cfg.branch_step} needs branch_from (the run whose checkpoint the decay "
                          "branch starts from)")
    if cfg.branch_from is not None:
        if not str(cfg.branch_from).strip():
            raise ConfigError("branch_from is empty; give the source run's out_dir or checkpoints folder, or null")
        if cfg.branch_step is not None and not 1 <= cfg.branch_step < cfg.steps:
            raise ConfigError(f"branch_step={cfg.branch_step} must be in [1, steps={cfg.steps}) (a checkpoint step "
                              "of the source run before this run's end)")
        if cfg.qat.enabled:
            raise ConfigError("branch_from with qat.enabled: a QAT run starts from another run with qat.init_from; "
                              "drop branch_from")
    if cfg.model.param_dtype == "float16":  # (inference may hold float16 weights; training cannot)
        raise ConfigError("model.param_dtype='float16' cannot be trained: the AdamW state in float16 underflows "
                          "(eps 1e-8 rounds to 0; the loss turns NaN within steps); use float32 or bfloat16")
    if cfg.gradient_accumulation_steps < 1 or d.batch_size % cfg.gradient_accumulation_steps:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be >= 1 and divide "
                          f"data.batch_size={d.batch_size} (the global batch of one update is split into that many "
                          "microbatches)")
    if cfg.logits_chunk_size < 0:
        raise ConfigError(f"logits_chunk_size={cfg.logits_chunk_size} must be >= 0 (sequence positions whose logits "
                          "are computed at once in the loss; 0 = the whole sequence)")
    if not (math.isfinite(cfg.mtp_feature_weight) and cfg.mtp_feature_weight >= 0):
        raise ConfigError(f"mtp_feature_weight={cfg.mtp_feature_weight} must be a finite number >= 0 (0 = off)")
    if not (math.isfinite(o.learning_rate) and o.learning_rate > 0):
        raise ConfigError(f"optimizer.learning_rate={o.learning_rate} must be a finite number > 0")
    if not (math.isfinite(o.weight_decay) and o.weight_decay >= 0):
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay} must be a finite number >= 0 (0 = none)")
    for nm, v in (("beta1", o.beta1), ("beta2", o.beta2)):
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"optimizer.{nm}={v} must be in [0, 1) (AdamW's moment decay; e.g. 0.9 / 0.95)")
    if not (math.isfinite(o.eps) and o.eps > 0):
        raise ConfigError(f"optimizer.eps={o.eps} must be a finite number > 0 (AdamW's denominator term, e.g. 1e-8)")
    if not (math.isfinite(o.grad_clip) and o.grad_clip >= 0):
        raise ConfigError(f"optimizer.grad_clip={o.grad_clip} must be a finite number >= 0 (0 = no clipping)")
    for nm, v in (("seed", cfg.seed), ("data.seed", d.seed)):
        if not 0 <= v < 2**32:
            raise ConfigError(f"{nm}={v} must be in [0, {2**32 - 1}]")
    if cfg.max_train_minutes is not None and not cfg.max_train_minutes > 0:
        raise ConfigError(f"max_train_minutes={cfg.max_train_minutes} must be > 0 minutes (or null: no time limit)")
    if not 0.0 <= o.decay_fraction <= 1.0:
        raise ConfigError(f"optimizer.decay_fraction={o.decay_fraction} must be in [0, 1]")
    if o.decay_style not in ("exponential", "linear"):
        raise ConfigError(f"optimizer.decay_style={o.decay_style!r}; use 'exponential' or 'linear'")
    if not 0.0 < o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.min_lr_ratio={o.min_lr_ratio} must be in (0, 1]")
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    if o.decay_steps is not None and o.decay_steps < 0:
        raise ConfigError(f"optimizer.decay_steps={o.decay_steps} must be >= 0 (or null: decay_fraction x steps)")
    decay = o.decay_steps if o.decay_steps is not None else int(round(o.decay_fraction * cfg.steps))
    # a run that is QAT from its first step with its own qat.warmup_steps never uses optimizer.warmup_steps
    # (validate_qat checks that schedule)
    qat_only = cfg.qat.enabled and cfg.qat.token_share == 1.0 and cfg.qat.warmup_steps is not None
    if decay < 0 or (o.warmup_steps + decay > cfg.steps and not qat_only):
        src = "optimizer.decay_steps" if o.decay_steps is not None else f"optimizer.decay_fraction={o.decay_fraction} x steps"
        raise ConfigError(
            f"optimizer.warmup_steps={o.warmup_steps} + decay steps={decay} ({src}) exceed steps={cfg.steps}; "
            "lower optimizer.warmup_steps / the decay length or raise steps"
        )
    mesh = cfg.mesh
    if mesh.axis_types != "auto":
        raise ConfigError(f"mesh.axis_types={mesh.axis_types!r} is not supported; use 'auto' (the train step places "
                          "arrays through jit shardings and sharding constraints on Auto mesh axes)")
    sizes = (mesh.data, mesh.fsdp, mesh.tensor)
    if sum(1 for s in sizes if s == -1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh sizes {sizes} invalid: positive sizes, at most one -1")
    if cfg.checkpoint.keep < 1 or cfg.checkpoint.save_every < 1:
        raise ConfigError("checkpoint.keep and checkpoint.save_every must be >= 1")
    validate_distributed(cfg.distributed)
    # (nan passed `< 0` and failed only when the end-of-run sample was drawn, after the whole training)
    check_temperature(cfg.sample_temperature, "sample_temperature")
    if cfg.sample_tokens < 0:
        raise ConfigError(f"sample_tokens={cfg.sample_tokens} must be >= 0 (0 = no end-of-run sample)")
    if not 0.0 < cfg.sample_top_p <= 1.0:
        raise ConfigError(f"sample_top_p={cfg.sample_top_p} must be in (0, 1]")
    if cfg.log_every < 1 or cfg.eval_every < 1 or cfg.eval_batches < 1:
        raise ConfigError("log_every, eval_every and eval_batches must be >= 1")
    validate_qat(cfg)


#: ``distributed.mode`` values (``cluster_detection_method`` is checked against the installed jax at start-up).
DISTRIBUTED_MODES = ("off", "auto", "explicit")


def validate_distributed(d: DistributedConfig) -> None:
    """Check the ``distributed`` section. Raises :class:`ConfigError` (one line naming the value and the fix)."""
    if d.mode not in DISTRIBUTED_MODES:
        raise ConfigError(f"distributed.mode={d.mode!r}; use 'off' (one process), 'auto' (let JAX detect Cloud TPU / "
                          "SLURM / Open MPI / Kubernetes) or 'explicit' (coordinator_address, num_processes, process_id)")
    if d.num_processes is not None and d.num_processes < 1:
        raise ConfigError(f"distributed.num_processes={d.num_processes} must be >= 1 (the number of processes of the job)")
    if d.process_id is not None and (d.process_id < 0 or (d.num_processes is not None and d.process_id >= d.num_processes)):
        raise ConfigError(f"distributed.process_id={d.process_id} must be in [0, distributed.num_processes="
                          f"{d.num_processes}); give each process its own id, 0 on the coordinator")
    if d.coordinator_address is not None and (":" not in d.coordinator_address
                                              or not d.coordinator_address.rsplit(":", 1)[1].isdigit()):
        raise ConfigError(f"distributed.coordinator_address={d.coordinator_address!r} must be host:port of process 0 "
                          "(e.g. 10.0.0.1:1234)")
    if d.initialization_timeout < 1:
        raise ConfigError(f"distributed.initialization_timeout={d.initialization_timeout} must be >= 1 (seconds)")
    if d.local_device_ids is not None and (not d.local_device_ids or any(i < 0 for i in d.local_device_ids)):
        raise ConfigError(f"distributed.local_device_ids={list(d.local_device_ids)} must list device ids >= 0 "
                          "(or be null: all devices this process sees)")
    if d.mode == "off":
        set_ = [n for n in ("coordinator_address", "num_processes", "process_id", "local_device_ids",
                            "cluster_detection_method") if getattr(d, n) is not None]
        if set_:
            raise ConfigError(f"distributed.{set_[0]} is set but distributed.mode='off' ignores it; set "
                              "distributed.mode=explicit (or auto) to run several processes, or remove it")
    if d.mode == "explicit":
        missing = [n for n in ("num_processes", "process_id") if getattr(d, n) is None]
        if missing:
            raise ConfigError(f"distributed.mode='explicit' needs distributed.{missing[0]}; give num_processes and a "
                              "per-process process_id (0 on the coordinator), or use mode=auto on a detected cluster")


def _decay_len(o: OptimizerConfig, steps: int) -> int:
    return o.decay_steps if o.decay_steps is not None else int(round(o.decay_fraction * steps))


def validate_qat(cfg: TrainConfig) -> None:
    """Check the ``qat`` section against the model and the run. Raises :class:`ConfigError` (one line)."""
    q, m, o = cfg.qat, cfg.model, cfg.optimizer
    if q.granularity not in QAT_GRANULARITIES:
        raise ConfigError(f"qat.granularity={q.granularity!r}; use one of {list(QAT_GRANULARITIES)}")
    if q.ste not in QAT_STE_MODES:
        raise ConfigError(f"qat.ste={q.ste!r}; use 'identity' (gradient everywhere) or 'clipped' (zero where |W/s| > 1)")
    # each value's own range first, whether QAT is on or not: a QAT preset run with qat.enabled=false keeps its
    # (valid) settings, but a nonsense value is refused either way
    if not 0.0 < q.token_share <= 1.0:
        raise ConfigError(f"qat.token_share={q.token_share} must be in (0, 1]: the share of the run's steps trained "
                          "ternary (1 = the whole run)")
    if q.init_step is not None and q.init_step < 0:
        raise ConfigError(f"qat.init_step={q.init_step} must be >= 0")
    if q.learning_rate is not None and not (math.isfinite(q.learning_rate) and q.learning_rate > 0):
        raise ConfigError(f"qat.learning_rate={q.learning_rate} must be a finite number > 0 (or null: "
                          "optimizer.learning_rate)")
    if q.warmup_steps is not None and q.warmup_steps < 0:
        raise ConfigError(f"qat.warmup_steps={q.warmup_steps} must be >= 0 (or null: optimizer.warmup_steps)")
    if q.group_size <= 0:
        raise ConfigError(f"qat.group_size={q.group_size} must be positive")
    if not q.enabled:
        if q.init_from is not None:
            raise ConfigError(f"qat.init_from={q.init_from!r} is set but qat.enabled is false; set qat.enabled=true "
                              "(or remove qat.init_from)")
        return
    if cfg.qat_steps < 1:
        raise ConfigError(f"qat.token_share={q.token_share} x steps={cfg.steps} rounds to 0 QAT steps; raise "
                          "qat.token_share or steps")
    if q.init_from is not None and q.token_share != 1.0:
        raise ConfigError(f"qat.token_share={q.token_share} with qat.init_from: a run started from a checkpoint is "
                          "all QAT; set qat.token_share=1 (or drop qat.init_from to switch to QAT inside the run)")
    if q.init_step is not None and q.init_from is None:
        raise ConfigError(f"qat.init_step={q.init_step} needs qat.init_from (the checkpoint to start from)")
    n_qat = cfg.qat_steps
    warm = o.warmup_steps if q.warmup_steps is None else q.warmup_steps
    decay = _decay_len(o, n_qat)
    if warm + decay > n_qat:
        raise ConfigError(
            f"the QAT stage has {n_qat} steps but its re-warmup ({warm}) + decay ({decay}) steps exceed them; lower "
            "qat.warmup_steps / optimizer.decay_steps or raise qat.token_share / steps"
        )
    if m.tie_word_embeddings and q.quantize_lm_head != q.quantize_embeddings:
        raise ConfigError(
            f"qat.quantize_lm_head={str(q.quantize_lm_head).lower()} but the head is tied to the embedding "
            "(model.tie_word_embeddings=true), so both are one table: set qat.quantize_embeddings to the same value"
        )
    if q.granularity == "per_group":
        ins = {"q/k/v_proj, gate/up_proj (hidden_size)": m.hidden_size,
               "o_proj (num_attention_heads*head_dim)": m.num_attention_heads * m.resolved_head_dim,
               "down_proj (intermediate_size)": m.intermediate_size}
        if q.quantize_embeddings or q.quantize_lm_head:
            ins["embedding/lm_head (hidden_size)"] = m.hidden_size
        for what, n in ins.items():
            if n % q.group_size:
                raise ConfigError(
                    f"qat.group_size={q.group_size} does not divide the {n} input columns of {what}; pick a group "
                    "size that divides every layer's input width, or qat.granularity=per_row"
                )


def _source_key(src: str) -> str:
    """A ``data.sources`` entry as the file or folder it names: resolved, ``~`` expanded (``stdlib`` as is)."""
    return src if src == "stdlib" else str(Path(os.path.expanduser(src)).resolve())


def same_sources(a: typing.Sequence[str], b: typing.Sequence[str]) -> bool:
    """Whether two ``data.sources`` lists name the same files and folders in the same order (``data/x.txt`` and
    ``/abs/data/x.txt`` from ``/abs``: the same), whatever their spelling."""
    return len(a) == len(b) and all(x == y or _source_key(x) == _source_key(y) for x, y in zip(a, b))


def diff_configs(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two config dataclasses, with both values."""
    out: list[str] = []
    da, db = config_to_dict(a), config_to_dict(b)

    def walk(x: Any, y: Any, p: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{p}.{k}" if p else k)
        elif x != y:
            out.append(f"{p}: {x!r} != {y!r}")

    walk(da, db, prefix)
    return out
