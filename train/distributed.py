"""Multi-host start-up and agreement: ``jax.distributed.initialize`` from the config, the agreed stop step.

* :func:`initialize` runs ``jax.distributed.initialize`` as ``cfg.distributed`` says (``off`` /
  ``auto`` / ``explicit``, see :class:`~minicpm4_jax.config.DistributedConfig`); it must run before
  any device is touched, and :func:`~minicpm4_jax.train.loop.run_training` calls it first.
* :class:`StopWatch` decides, at each step boundary, whether to stop and save, such that **all
  processes stop at the same step**:

  - one process without the JAX distributed runtime: SIGTERM / SIGINT set a Python flag;
  - with the runtime (``distributed.mode`` not ``off``): SIGTERM is the preemption notice that JAX's
    preemption service listens for (its C++ notifier owns the SIGTERM handler; Cloud TPU maintenance
    events, GKE, SLURM and most schedulers deliver the notice as SIGTERM). When any process gets it,
    the coordination service agrees on a step (the largest step any process has reached, plus one)
    and ``jax.experimental.multihost_utils.reached_preemption_sync_point(step)`` returns True at
    that same step on every process. SIGINT is forwarded to that notifier (``kill -TERM`` of the own
    process), so Ctrl-C also stops all processes at one step. Without the preemption service
    (``jax_enable_preemption_service=False``) the processes all-gather their Python stop flag at every
    step instead.

  A second SIGINT while stopping (Ctrl-C twice: do not wait for the checkpoint) raises
  :class:`SecondInterrupt` where the main thread is; any signal after that is ignored, so the clean-up
  (awaiting a checkpoint write already under way) and the one-line report are not interrupted in turn.

  Once the last step's checkpoint is saved, :meth:`StopWatch.finishing` starts the run's finishing phase
  (final evaluation, statistics, sample): with one process a SIGTERM / SIGINT then raises
  :class:`FinishInterrupt` at once, since there is nothing left to save. With several processes the phase
  runs collectives and a signal reaching one process cannot stop the others there, so it is ignored.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from typing import Any, Callable

import jax

from minicpm4_jax.config import ConfigError, DistributedConfig

__all__ = ["initialize", "is_distributed", "process_allgather", "broadcast_from_process_0", "StopWatch",
           "SecondInterrupt", "FinishInterrupt"]


def _cluster_methods() -> list[str] | None:
    try:
        from jax._src.clusters import ClusterEnv

        return sorted({c.name for c in ClusterEnv._cluster_types if getattr(c, "name", "")} | {"deactivate"})
    except Exception:  # noqa: BLE001 - private API; skip the check when it moves
        return None


def is_distributed() -> bool:
    """Whether the JAX distributed runtime is up in this process."""
    return bool(jax.distributed.is_initialized())


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # noqa: BLE001
        return False


def initialize(cfg: DistributedConfig, log: Callable[[str], None] = print) -> bool:
    """Start the JAX distributed runtime as ``cfg`` says; a no-op for ``mode: off`` or when already started.

    Returns:
        Whether the runtime is up (``False`` for ``mode: off``).

    Raises:
        ConfigError: a device was already used in this process (JAX cannot start the runtime then),
            ``auto`` found no cluster, ``explicit`` lacks the coordinator address, an unknown
            ``cluster_detection_method``, or the coordinator could not be reached in time.
    """
    if cfg.mode == "off":
        return is_distributed()
    if is_distributed():
        return True
    if _backends_initialized():
        raise ConfigError(f"distributed.mode={cfg.mode!r}: jax.distributed.initialize must run before any device is "
                          "used, but this process already used JAX devices; start training in a fresh process")
    methods = _cluster_methods()
    if cfg.cluster_detection_method is not None and methods is not None and cfg.cluster_detection_method not in methods:
        raise ConfigError(f"distributed.cluster_detection_method={cfg.cluster_detection_method!r}; this jax knows "
                          f"{methods} (or null: try them all)")
    kw: dict[str, Any] = {"initialization_timeout": cfg.initialization_timeout}
    for name in ("coordinator_address", "num_processes", "process_id", "cluster_detection_method"):
        if getattr(cfg, name) is not None:
            kw[name] = getattr(cfg, name)
    if cfg.local_device_ids is not None:
        kw["local_device_ids"] = list(cfg.local_device_ids)
    if cfg.mode == "explicit":
        if cfg.coordinator_address is None and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
            raise ConfigError("distributed.mode='explicit' needs distributed.coordinator_address (host:port of "
                              "process 0) or the JAX_COORDINATOR_ADDRESS environment variable")
        if cfg.local_device_ids is None:
            kw["cluster_detection_method"] = "deactivate"  # everything is given: do not probe the cluster
    try:
        jax.distributed.initialize(**kw)
    except ValueError as e:
        if cfg.mode == "auto":
            raise ConfigError(f"distributed.mode='auto' found no cluster to join ({str(e).strip()}); use "
                              "mode=explicit with coordinator_address, num_processes and process_id, or mode=off "
                              "for one process") from None
        raise ConfigError(f"distributed.mode={cfg.mode!r}: {str(e).strip()}; fix the distributed section") from None
    except Exception as e:  # noqa: BLE001 - e.g. a coordinator that never answers (DEADLINE_EXCEEDED)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"distributed: joining the coordinator {kw.get('coordinator_address', '(detected)')} as "
                          f"process {kw.get('process_id', '(detected)')} failed within "
                          f"{cfg.initialization_timeout}s ({type(e).__name__}: {first[:200]}); start all "
                          "distributed.num_processes processes with the same coordinator_address") from None
    if jax.process_index() == 0:
        log(f"distributed: {jax.process_count()} processes, {jax.device_count()} devices "
            f"({jax.local_device_count()} on this process)")
    return True


def process_allgather(value: Any) -> Any:
    """Every process's ``value`` (a scalar or array of one shape and dtype everywhere): a numpy array
    ``[process_count, *value.shape]`` of ``value``'s dtype (64-bit ones too, bit for bit), row ``i`` from process
    ``i``. Call it on every process.

    ``jax.experimental.multihost_utils.process_allgather`` returns once the first local device has its copy, while
    the other local devices' cross-process transfers (one Gloo context each on CPU) may still be under way. A
    process that then exits (a start-up refusal, the run's end) leaves its peers' transfers waiting on it: in a
    2-process test on a loaded 2-core machine the peer hung in interpreter teardown in 3 of 40 runs of
    "all-gather, then exit" (0 of 60 with this function), and a refused multi-process start lost process 0's error
    line. Here the result is awaited on every local device before it is read.

    Raises:
        ValueError: ``value`` differs in dtype or shape between processes (one line naming both; a different
            byte size fails in the collective itself).
    """
    import hashlib

    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    host = np.expand_dims(np.asarray(value), 0)
    if jax.process_count() == 1:
        return host
    # sent as its bytes: a 64-bit value (int64, float64, a Python int or float) would be narrowed to 32 bits
    # without jax_enable_x64 (2**40 arrived as 0), unlike the one-process result. Bytes alone would let values of
    # one size but another shape or dtype through silently ([2, 3] read as [3, 2], an int64 read as float64
    # bits), so each row starts with a header naming its dtype and shape, compared after the gather.
    desc = f"{host.dtype} {list(host.shape[1:])}".encode()
    head = (desc[:_HEADER - 20].ljust(_HEADER - 20, b" ") + hashlib.sha1(desc).digest())
    raw = np.concatenate([np.frombuffer(head, np.uint8),
                          np.ascontiguousarray(host).reshape(-1).view(np.uint8)]).reshape(1, -1)
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()),
                ("processes", "local_devices"))
    rows = jax.make_array_from_single_device_arrays(
        (jax.process_count(), raw.shape[1]), NamedSharding(mesh, PartitionSpec("processes")),
        [jax.device_put(raw, d) for d in jax.local_devices()])
    out = _replicate(NamedSharding(mesh, PartitionSpec()))(rows)
    out.block_until_ready()  # every local device, not only the one read below
    got = np.asarray(out.addressable_data(0))
    heads = [bytes(r[:_HEADER]) for r in got]
    odd = [i for i, h in enumerate(heads) if h != head]
    if odd:
        def name(h: bytes) -> str:
            return h[:_HEADER - 20].decode(errors="replace").rstrip()

        raise ValueError(f"process_allgather: process {odd[0]} gave a value of dtype and shape {name(heads[odd[0]])}, "
                         f"process {jax.process_index()} {name(head)}; give every process a value of one dtype and "
                         "shape (e.g. np.int32(x) everywhere)")
    return np.ascontiguousarray(got[:, _HEADER:]).view(host.dtype).reshape(jax.process_count(), *host.shape[1:])


_HEADER = 64  # bytes before each process's value in process_allgather: its dtype and shape, then their SHA-1


def _identity(x: Any) -> Any:
    return x


@functools.lru_cache(maxsize=8)
def _replicate(sharding: Any) -> Callable[[Any], Any]:
    """The jitted identity onto ``sharding`` (one per mesh: :class:`StopWatch` gathers at every step)."""
    return jax.jit(_identity, out_shardings=sharding)


def broadcast_from_process_0(value: Any) -> Any:
    """Process 0's ``value`` on every process (as :func:`process_allgather`, which it uses; call it everywhere)."""
    return process_allgather(value)[0]


def _preemption_service() -> bool:
    """Whether ``reached_preemption_sync_point`` works here (runtime up with its preemption sync manager)."""
    try:
        from jax._src import distributed as _d

        return _d.global_state.client is not None and _d.global_state.preemption_sync_manager is not None
    except Exception:  # noqa: BLE001
        return False


class SecondInterrupt(KeyboardInterrupt):
    """A second SIGINT while the run was already stopping for a signal: abort without the announced save.

    A :class:`KeyboardInterrupt` (``except Exception`` does not swallow it);
    :func:`~minicpm4_jax.train.loop.run_training` re-raises it with a one-line message naming the step that
    was not saved and the last complete checkpoint, which the CLI prints as ``error: ...`` (exit 130).
    """

    signum: int = int(signal.SIGINT)


class FinishInterrupt(SecondInterrupt):
    """SIGTERM / SIGINT during the finishing phase of a one-process run (after the last step's checkpoint was
    saved: final evaluation, statistics, sample); ``signum`` is the signal. The run stops at once, without
    ``summary.json``; :func:`~minicpm4_jax.train.loop.run_training` re-raises it with a one-line message naming
    the complete checkpoint, which the CLI prints as ``error: ...`` (exit 128 + ``signum``).
    """

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = int(signum)


class StopWatch:
    """When to stop for a signal / preemption notice; the same step on every process (module docs).

    :meth:`install` sets the handlers (main thread only), :meth:`should_stop` is called with the
    number of completed updates at every step boundary of every process, :meth:`restore` puts the
    old handlers back. ``signum`` is the signal that triggered the stop (SIGTERM for a notice that
    reached another process).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.aborted = False  # a second SIGINT raised SecondInterrupt; later signals are ignored
        self._finishing = False  # see finishing()
        self._saving = False  # see starting_save()
        self._abort_after_save = False
        self._old: dict[int, Any] = {}
        self.sync_point = _preemption_service()
        self.multi = jax.process_count() > 1

    @property
    def mode(self) -> str:
        """``preemption-service`` | ``allgather`` | ``local``: how the stop step is agreed."""
        return "preemption-service" if self.sync_point else ("allgather" if self.multi else "local")

    def install(self) -> None:
        """Set the SIGTERM / SIGINT handlers (SIGINT alone with the preemption service); main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return
        sigs = (signal.SIGINT,) if self.sync_point else (signal.SIGTERM, signal.SIGINT)
        for sig in sigs:
            self._old[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.aborted:  # already aborting: let the clean-up and its report finish
            return
        if self._finishing:  # the checkpoint is saved: nothing to wait for
            self.aborted, self.signum = True, signum
            raise FinishInterrupt(f"{signal.Signals(signum).name} during the finishing phase", signum)
        if self.signum is not None and signum == signal.SIGINT:
            if self._saving:  # inside the start of a save: raised once it has started (it then completes)
                self._abort_after_save = True
                return
            self.aborted = True
            raise SecondInterrupt("second interrupt")
        self.signum = signum
        if self.sync_point:  # hand Ctrl-C to JAX's notifier so all processes agree on the step
            os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def starting_save(self) -> Any:
        """Around the synchronous start of a checkpoint save: a second Ctrl-C there is held until the save has
        started, then raises :class:`SecondInterrupt` (the save under way completes before the run stops; raised
        inside orbax's start, it abandoned the save, a break test found)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
        if self._abort_after_save:
            self._abort_after_save = False
            self.aborted = True
            raise SecondInterrupt("second interrupt")

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop now, at ``step`` completed updates (call once per step on every process)."""
        if self.sync_point:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(int(step)):
                if self.signum is None:
                    self.signum = int(signal.SIGTERM)
                return True
            return False
        if not self.multi:
            return self.signum is not None
        import numpy as np

        flags = process_allgather(np.int32(self.signum or 0))
        hit = [int(f) for f in np.ravel(flags) if int(f)]
        if hit and self.signum is None:
            self.signum = hit[0]
        return bool(hit)

    def finishing(self) -> bool:
        """Start the finishing phase; call it on every process once the last step's checkpoint is saved.

        Returns whether a signal arrived since the last :meth:`should_stop` (one process only: the run then stops
        as for a signal at a step boundary). Otherwise, with one process, a later SIGTERM / SIGINT raises
        :class:`FinishInterrupt` where the main thread is. With several processes it returns False and signals
        stay flags nobody reads (module docs).
        """
        if self.multi or self.sync_point:
            return False
        self._finishing = True  # first: a signal from here on raises, one before it is seen below
        if self.signum is not None:
            self._finishing = False
            return True
        return False

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
