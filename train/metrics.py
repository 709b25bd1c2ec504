"""Training metrics: TensorBoard logging (tensorboardX, process 0 only), the run's history file
(``metrics.jsonl``, carried across resumes), measured matmul peak, MFU.

tensorboardX is imported lazily (the GPU image has none; logging is then skipped with a note).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from minicpm4_jax.config import ModelConfig

__all__ = ["METRICS_FILE", "MetricsWriter", "RunHistory", "measure_matmul_peak_flops", "mfu", "mfu_above_peak_causes",
           "model_flops_per_second", "peak_devices", "ternary_scalars"]


METRICS_FILE = "metrics.jsonl"


class RunHistory:
    """The run's logged rows and evaluations, kept in ``out_dir/metrics.jsonl`` so that a resumed run's
    ``summary.json`` holds the whole run, not only the steps since the resume.

    One JSON object per line, appended and flushed as it happens (a kill loses at most the line being written):
    ``{"kind": "train", "step": N, <the logged row>}`` or ``{"kind": "val", "step": N, "loss": L}``. Process 0
    writes; the others keep the lists only.

    Args:
        path: the file (``out_dir/metrics.jsonl``).
        start: the step the run starts from: 0 for a new run (the file is started afresh), the checkpoint's step
            for a resume (rows after it were logged by the run that did not reach its next checkpoint: they are
            dropped from the file and the lists, the steps are trained again).
        write: whether this process writes the file (process 0).
        seed: rows that came before this run (a branch: the source run's history up to the branch step).
        log: where a write failure is reported (once; the run goes on without the file, as without TensorBoard).

    Attributes:
        history: the logged training rows, ``[{"step": N, "loss": ..., ...}]`` in step order.
        val_history: ``[(step, loss)]`` of every evaluation.
        skipped: lines of the file that could not be read (a line cut by a kill, another program's text).
    """

    def __init__(self, path: str | Path, *, start: int, write: bool, seed: "RunHistory | None" = None,
                 log: Callable[[str], None] = print):
        self.path = Path(path)
        self._write = write
        self._log = log
        self.history: list[dict[str, float]] = []
        self.val_history: list[tuple[int, float]] = []
        self.skipped = 0
        if seed is not None:
            self.history = [dict(h) for h in seed.history if h["step"] <= start]
            self.val_history = [v for v in seed.val_history if v[0] <= start]
        elif start > 0:
            self._read(start)
        self._rewrite()  # rows past `start` (never checkpointed) are gone

    def _failed(self, e: OSError) -> None:
        self._write = False
        self._log(f"warning: cannot write {self.path} ({e.strerror or e}); the run goes on without its history "
                  "file (summary.json still gets this run's rows)")

    def _rewrite(self) -> None:
        if not self._write:
            return
        tmp = self.path.with_name("." + self.path.name + ".tmp")  # a dotfile: never taken for a run entry
        try:
            with open(tmp, "w") as f:
                f.writelines(line + "\n" for line in self._lines())
            os.replace(tmp, self.path)  # atomically
        except OSError as e:
            self._failed(e)

    @classmethod
    def read(cls, path: str | Path, upto: int) -> "RunHistory":
        """The rows of the history file at ``path`` up to step ``upto`` (a branch's source run), read only."""
        h = cls.__new__(cls)
        h.path, h._write, h._log, h.history, h.val_history, h.skipped = Path(path), False, print, [], [], 0
        h._read(upto)
        return h

    def _read(self, upto: int) -> None:
        try:
            raw = self.path.read_bytes()
        except OSError:
            return  # a run from before this file existed (or an unreadable one): its history starts at the resume
        for line in raw.decode("utf-8", "replace").splitlines():  # a damaged line fails alone, below
            try:
                rec = json.loads(line)
                kind, step = rec.pop("kind"), rec["step"]
                if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                    raise TypeError(step)
            except (ValueError, KeyError, TypeError, AttributeError):
                self.skipped += line.strip() != ""
                continue
            if step > upto:
                continue
            if kind == "train":
                self.history.append(rec)
            elif kind == "val" and isinstance(rec.get("loss"), (int, float)):
                self.val_history.append((step, float(rec["loss"])))
            else:
                self.skipped += 1

    def _lines(self) -> list[str]:
        rows = [(h["step"], 0, {"kind": "train", **h}) for h in self.history]
        rows += [(s, 1, {"kind": "val", "step": s, "loss": v}) for s, v in self.val_history]
        return [json.dumps(r) for _, _, r in sorted(rows, key=lambda x: (x[0], x[1]))]

    def _append(self, rec: dict) -> None:
        if self._write:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            except OSError as e:
                self._failed(e)

    def log(self, row: dict[str, float]) -> None:
        """Record a logged training row (it holds ``step``)."""
        self.history.append(row)
        self._append({"kind": "train", **row})

    def evaluation(self, step: int, loss: float) -> None:
        """Record an evaluation; a second one at the same step (the final evaluation of a resumed run that had
        finished) replaces the first."""
        if self.val_history and self.val_history[-1][0] == step:
            self.val_history[-1] = (step, loss)
            self._rewrite()  # the file holds each evaluation once
            return
        self.val_history.append((step, loss))
        self._append({"kind": "val", "step": step, "loss": loss})

    def median_rate(self) -> float:
        """Median logged tokens/s over the whole run (NaN when nothing was logged)."""
        rates = [h["tokens_per_second"] for h in self.history
                 if isinstance(h.get("tokens_per_second"), (int, float)) and math.isfinite(h["tokens_per_second"])
                 and h["tokens_per_second"] > 0]
        return float(statistics.median(rates)) if rates else float("nan")


class MetricsWriter:
    """Scalars to a TensorBoard event file under ``log_dir`` (process 0 only; no-op elsewhere).

    Written synchronously with tensorboardX's ``EventsWriter`` (the writer its ``SummaryWriter`` runs in a background
    thread): a write that fails (disk full, a read-only remount) surfaces here, gives one warning through ``log``
    and turns TensorBoard logging off for the rest of the run, which goes on (``metrics.jsonl`` keeps the rows). With
    ``SummaryWriter`` the thread died with a traceback, a later ``close`` raised over the error in flight and a full
    queue could block the run. Flushed at most every ``flush_secs`` seconds and on :meth:`close`. (A folder removed
    while the file is open is not noticed on Linux: the writes go to the unlinked file.)

    ``purge_step``: a ``SessionLog.START`` event at that step, which makes TensorBoard drop the events of earlier
    files at steps ``>= purge_step`` (a resume passes its checkpoint step + 1: the steps a killed attempt logged past
    the checkpoint are trained again), as tensorboardX's ``purge_step`` does.

    ``enabled=False`` or a missing tensorboardX makes every call a no-op.
    """

    def __init__(self, log_dir: str | Path, *, enabled: bool = True, log: Callable[[str], None] = print,
                 flush_secs: float = 10.0, purge_step: int | None = None):
        self._writer = None
        self.log_dir = Path(log_dir)
        self._log = log
        self._flush_secs = flush_secs
        self._last_flush = time.monotonic()
        if not enabled or jax.process_index() != 0:
            return
        try:
            from tensorboardX import summary as tb_summary
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto import event_pb2
        except ImportError:
            log("tensorboardX is not installed; TensorBoard logging is off")
            return
        self._summary, self._event = tb_summary, event_pb2.Event
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = EventsWriter(str(self.log_dir / "events"))
            if purge_step is not None:  # TensorBoard drops earlier files' events at steps >= purge_step
                start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
                self._writer.write_event(self._event(wall_time=time.time(), step=int(purge_step), session_log=start))
        except OSError as e:
            self._failed(e)

    @property
    def enabled(self) -> bool:
        """Whether scalars are actually written."""
        return self._writer is not None

    def _failed(self, e: BaseException) -> None:
        self._log(f"warning: TensorBoard events cannot be written to {self.log_dir} ({e}); TensorBoard logging is "
                  "off for the rest of the run (metrics.jsonl keeps every row)")
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except (OSError, ValueError):
                pass

    def _write(self, step: int, summaries: list[Any]) -> None:
        if self._writer is None:
            return
        try:
            for s in summaries:
                self._writer.write_event(self._event(wall_time=time.time(), step=int(step), summary=s))
            if time.monotonic() - self._last_flush >= self._flush_secs:
                self.flush()
        except (OSError, ValueError) as e:
            self._failed(e)

    def scalars(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        """Write ``{name: value}`` at ``step`` (tag ``prefix/name``)."""
        if self._writer is not None:
            self._write(step, [self._summary.scalar(f"{prefix}/{k}" if prefix else k, float(v))
                               for k, v in values.items()])

    def text(self, step: int, tag: str, text: str) -> None:
        """Write a text blob (e.g. the generated sample)."""
        if self._writer is not None:
            self._write(step, [self._summary.text(tag, text)])

    def flush(self) -> None:
        """Flush pending events to disk (a failure is the one warning of :meth:`_failed`)."""
        if self._writer is None:
            return
        try:
            self._writer.flush()
            self._last_flush = time.monotonic()
        except (OSError, ValueError) as e:
            self._failed(e)

    def close(self) -> None:
        """Flush and close the event file; never raises (it runs while another error may be in flight)."""
        if self._writer is None:
            return
        self.flush()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except (OSError, ValueError) as e:
                self._log(f"warning: closing the TensorBoard event file in {self.log_dir} failed ({e})")


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


def peak_devices(devices: Any) -> int:
    """How many times the matmul peak of one device (:func:`measure_matmul_peak_flops`) the devices ``devices`` (a
    mesh's, e.g. ``mesh.devices.flat``) hold: each accelerator (GPU, TPU) is a chip of its own, so their count; CPU
    devices of one process (``JAX_NUM_CPU_DEVICES`` / ``--xla_force_host_platform_device_count``) share its host's
    cores, which one device's measurement already uses, so the number of processes among them. MFU divides the
    whole mesh's model FLOP/s by ``peak_devices * peak`` (a mesh of 8 GPUs against one GPU's peak read 8x too high).
    """
    devices = list(devices)
    if all(getattr(d, "platform", "cpu") == "cpu" for d in devices):
        return max(1, len({getattr(d, "process_index", 0) for d in devices}))
    return max(1, len(devices))


def model_flops_per_second(model_cfg: ModelConfig, seq_len: int, tokens_per_second: float, *, mtp_depth: int = 1,
                           mtp_distill: bool = False) -> float:
    """Achieved model FLOP/s: ``flops_per_token(seq_len, ...) * tokens/s`` (training, fwd+bwd; the MTP draft head's
    ``mtp_depth`` trained depths and ``mtp_distill`` included when ``model_cfg.mtp``)."""
    return model_cfg.flops_per_token(seq_len, mtp_depth=mtp_depth, mtp_distill=mtp_distill) * tokens_per_second


def mfu_above_peak_causes(model_cfg: ModelConfig, seq_len: int) -> list[str]:
    """Why this run's MFU may pass 100% with the machine as fast as when the fp32 peak was measured: clauses naming
    a sparse attention the FLOP count takes as dense (InfLLM v2 at ``seq_len`` >= ``sparse_config.dense_len``,
    or ``dense_len`` -1) and a compute ``dtype`` other than float32 (its matmuls outrun the fp32 peak); ``[]`` when
    neither applies (then only a peak measured on a busier machine explains it)."""
    out = []
    sc = model_cfg.sparse_config
    if model_cfg.attention == "infllmv2" and sc is not None and (sc.dense_len == -1 or seq_len >= sc.dense_len):
        out.append(f"the FLOP count takes attention as dense over all {seq_len} positions, which InfLLM v2 mostly "
                   "skips (see the attended fraction), so a sparse run's MFU overstates its work")
    if str(model_cfg.dtype) != "float32":
        out.append(f"the model computes in {model_cfg.dtype}, whose matmuls run faster than the fp32 peak measures")
    return out


def mfu(model_cfg: ModelConfig, seq_len: int, tokens_per_second: float, peak_flops: float, *, mtp_depth: int = 1,
        mtp_distill: bool = False) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s (:func:`model_flops_per_second`) over the measured peak (of all
    the devices that train: ``peak_devices(mesh devices) x`` one device's), in
    [0, 1] when the machine ran as fast while the peak was measured as while training and the FLOP count is the work
    done (above 1 when other jobs slowed the measurement, or for a cause of :func:`mfu_above_peak_causes`: a sparse
    InfLLM v2 attention counted as dense, a model dtype faster than the fp32 peak; the train loop then warns once)."""
    if peak_flops <= 0:
        return float("nan")
    return model_flops_per_second(model_cfg, seq_len, tokens_per_second, mtp_depth=mtp_depth,
                                  mtp_distill=mtp_distill) / peak_flops


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
