"""Training metrics: TensorBoard logging (tensorboardX, process 0 only), measured matmul peak, MFU.

tensorboardX is imported lazily (the GPU image has none; logging is then skipped with a note).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from minicpm4_jax.config import ModelConfig

__all__ = ["MetricsWriter", "measure_matmul_peak_flops", "mfu", "model_flops_per_second", "ternary_scalars"]


class MetricsWriter:
    """Scalars to TensorBoard event files under ``log_dir`` (process 0 only; no-op elsewhere).

    ``enabled=False`` or a missing tensorboardX makes every call a no-op.
    """

    def __init__(self, log_dir: str | Path, *, enabled: bool = True, log: Callable[[str], None] = print):
        self._writer = None
        self.log_dir = Path(log_dir)
        if not enabled or jax.process_index() != 0:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            log("tensorboardX is not installed; TensorBoard logging is off")
            return
        self._writer = SummaryWriter(str(self.log_dir))

    @property
    def enabled(self) -> bool:
        """Whether scalars are actually written."""
        return self._writer is not None

    def scalars(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        """Write ``{name: value}`` at ``step`` (tag ``prefix/name``)."""
        if self._writer is None:
            return
        for k, v in values.items():
            self._writer.add_scalar(f"{prefix}/{k}" if prefix else k, float(v), step)

    def text(self, step: int, tag: str, text: str) -> None:
        """Write a text blob (e.g. the generated sample)."""
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        """Flush pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def measure_matmul_peak_flops(n: int | None = None, repeats: int = 5, dtype: Any = jnp.float32) -> float:
    """Measured matmul throughput (FLOP/s) of the default backend: the best of ``repeats`` timed runs.

    Times a jitted ``[n, n] @ [n, n]`` (``2 n^3`` FLOPs) in ``dtype`` after one warm-up run;
    ``n`` defaults to 1024 on CPU and 8192 on accelerators. This is the denominator of MFU: an
    achievable peak of this machine, not the vendor's datasheet number.
    """
    if n is None:
        n = 1024 if jax.default_backend() == "cpu" else 8192
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def model_flops_per_second(model_cfg: ModelConfig, seq_len: int, tokens_per_second: float) -> float:
    """Achieved model FLOP/s: ``flops_per_token(seq_len) * tokens/s`` (training, fwd+bwd)."""
    return model_cfg.flops_per_token(seq_len) * tokens_per_second


def mfu(model_cfg: ModelConfig, seq_len: int, tokens_per_second: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved model FLOP/s over the measured peak."""
    if peak_flops <= 0:
        return float("nan")
    return model_flops_per_second(model_cfg, seq_len, tokens_per_second) / peak_flops


def ternary_scalars(stats: dict[str, dict[str, Any]]) -> dict[str, float]:
    """TensorBoard scalars of ternary QAT statistics (``minicpm4_jax.quant.ternary_stats``).

    ``{"zero_fraction/<matrix>/layer_<i>", "scale/<matrix>/layer_<i>"}`` per decoder layer (``<matrix>``
    like ``q_proj``), the same without ``/layer_<i>`` for the unstacked embedding / head, and
    ``zero_fraction`` / ``scale`` means over everything. Write them with ``prefix="qat"``.
    """
    import numpy as np

    out: dict[str, float] = {}
    zs, ss = [], []
    for path, d in stats.items():
        name = path.split("/")[-1]
        z, s = np.asarray(d["zero_fraction"]), np.asarray(d["scale_mean"])
        zs.append(float(z.mean()))
        ss.append(float(s.mean()))
        if z.ndim == 0:
            out[f"zero_fraction/{name}"], out[f"scale/{name}"] = float(z), float(s)
            continue
        for i in range(z.shape[0]):
            out[f"zero_fraction/{name}/layer_{i}"] = float(z[i])
            out[f"scale/{name}/layer_{i}"] = float(s[i])
    if zs:
        out["zero_fraction"] = float(np.mean(zs))
        out["scale"] = float(np.mean(ss))
    return out
