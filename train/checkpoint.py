"""orbax checkpoints of a training run: train state, config and data-iterator state, keep-last-N.

One checkpoint step directory holds these items (an ``ocp.args.Composite``):

* ``state``: ``{"step", "params", "opt_state"}`` of the :class:`~minicpm4_jax.train.step.TrainState`
  (``ocp.args.StandardSave``; restored into abstract targets from ``jax.eval_shape``);
* ``config``: the whole :class:`~minicpm4_jax.config.TrainConfig` as JSON (``config_to_dict``);
* ``checksums``: :func:`~minicpm4_jax.train.checksums.checksum_record` of ``state`` as JSON: per array two
  32-bit sums that do not depend on its sharding (written by process 0);
* ``data``: the grain iterator state (``grain.checkpoint.CheckpointSave``), when an iterator is given:
  one ``process_<i>-of-<n>.json`` per process. The state counts *global* batches
  (:func:`~minicpm4_jax.train.data.train_iterator`), so it is the same on every process and restores
  on any process count (:meth:`Checkpointer.restore` reads this process's file, or any when the
  process count changed, after checking they agree).

Sharded saves and restores: every process writes its shards (orbax, asynchronously: the training
continues while the arrays are written; :meth:`Checkpointer.wait` / the next save await it).
:meth:`Checkpointer.restore` takes an abstract target whose ``jax.ShapeDtypeStruct`` leaves carry the
*current* shardings (:func:`sharded_abstract_state`), so a checkpoint saved on one mesh restores onto
another mesh, device count or process count, each device reading only its slices; the stored
sharding is never replayed.

Crash safety: orbax writes each step into a temporary directory and renames it into place only
after every item is written (and only then deletes checkpoints beyond ``keep``), so a kill during
a save leaves the previous checkpoint intact; an unfinished temporary directory is never reported
as a step by :meth:`CheckpointManager.latest_step`. A failed write (disk full, I/O error), whether
it surfaces in :meth:`Checkpointer.save` or later when the async write is awaited, raises one
:class:`CheckpointWriteError` that names the step, the folder, the cause and the last complete
checkpoint (which is left intact).

Damage after the save: TensorStore keeps no checksum of the array data, so every load
(:meth:`Checkpointer.restore`, :func:`load_params_for_inference`) recomputes the checksums on the restored
arrays (on device, each device over its shards) and refuses a step whose arrays differ from them with the
one-line damaged-step :class:`ConfigError`. A step saved before the checksums existed (no ``checksums`` item)
loads unverified, with a warning.

Resuming (:meth:`Checkpointer.check_compatible`): every field of the checkpoint's config must equal
the current one, except :data:`RESUME_MAY_CHANGE` (fields that change neither the math nor the
data order).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable

import jax

from minicpm4_jax.config import (MTP_DRAFT_FIELDS, ConfigError, TrainConfig, config_from_dict, config_to_dict,
                                 diff_configs, same_sources)
from minicpm4_jax.train.checksums import ChecksumMismatch, checksum_record, on_mesh_of, verify_checksums

__all__ = ["Checkpointer", "CheckpointWriteError", "RESUME_MAY_CHANGE", "checkpoint_dir_of", "sharded_abstract_state",
           "checkpoint_write_error", "load_params_for_inference", "find_checkpoint_dir", "CheckpointSource",
           "is_checkpoint_step", "holds_checkpoint_steps",
           "resolve_source", "params_all_finite",
           "resume_differences", "restore_data_iterator", "state_save_args", "CHECKSUM_ITEM"]

#: Config fields that a ``--resume`` may change: they affect neither the math nor the data order.
RESUME_MAY_CHANGE = frozenset({
    "log_every", "eval_every", "eval_batches", "tensorboard", "max_train_minutes", "sample_prompt",
    "sample_tokens", "sample_temperature", "sample_top_p", "checkpoint.save_every", "checkpoint.keep",
    "checkpoint.async_save", "checkpoint.directory", "out_dir", "data.cache_dir",
    # how many positions' logits exist at once: the same losses up to float32 summation order
    "logits_chunk_size",
    # memory and kernel choices of the same model (qat.MODEL_FIELDS_MAY_DIFFER: neither the parameters nor the
    # math change): rematerialisation (a resume onto fewer or smaller devices that runs out of memory) and the
    # attention implementation (a run started with attention_impl=pallas on a GPU resumed where it does not run)
    "model.remat", "model.attention_impl",
    # where a decay branch started (train.branch): a resume continues the branch's own checkpoints
    "branch_from", "branch_step",
    # the global batch split into microbatches: the same averaged gradient up to float32 summation order
    "gradient_accumulation_steps",
    "profile_start_step", "profile_steps",
    # the process layout and the mesh: a checkpoint restores onto any mesh / device / process count
    # (same math; float sums may then differ in the last bits, so bitwise equality holds only for the same mesh)
    "mesh.data", "mesh.fsdp", "mesh.tensor", "distributed.mode", "distributed.coordinator_address",
    "distributed.num_processes", "distributed.process_id", "distributed.local_device_ids",
    "distributed.cluster_detection_method", "distributed.initialization_timeout",
})


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (e.g. disk full): one line with the step, folder, cause and last complete step."""


def _cause_line(e: BaseException) -> str:
    """The first line of the most telling cause: an ``OSError`` in the chain if any, else ``e`` itself."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            e = x
            break
        x = x.__cause__ or x.__context__
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}" if first and not isinstance(e, OSError) else (first or type(e).__name__)


def checkpoint_write_error(step: int | None, directory: str | Path, cause: BaseException,
                           last_complete: int | None) -> CheckpointWriteError:
    """A :class:`CheckpointWriteError` for a failed save of ``step`` into ``directory``."""
    which = f"step {step}" if step is not None else "(pending)"
    last = f"step {last_complete} in {directory}" if last_complete is not None else "none"
    return CheckpointWriteError(
        f"saving checkpoint {which} to {directory} failed: {_cause_line(cause)}; last complete checkpoint: {last}"
    )


def _field_of(diff: str) -> str:
    return diff.split(":", 1)[0]


def resume_differences(saved: TrainConfig, current: TrainConfig) -> tuple[list[str], list[str]]:
    """``(allowed, refused)`` differences (``"name: checkpoint value != current value"``) for a resume."""
    diffs = diff_configs(saved, current)
    if not saved.model.mtp and not current.model.mtp:  # the draft's options changed nothing in such a run
        diffs = [d for d in diffs if _field_of(d) not in MTP_DRAFT_FIELDS]
    # data.sources spelled otherwise (relative / absolute, ~) naming the same files: the corpus check
    # (check_run_data) still refuses other files behind the same names
    respelled = same_sources(saved.data.sources, current.data.sources)

    def may_change(d: str) -> bool:
        return _field_of(d) in RESUME_MAY_CHANGE or (respelled and _field_of(d) == "data.sources")

    allowed = [d for d in diffs if may_change(d)]
    refused = [d for d in diffs if not may_change(d)]
    return allowed, refused


def checkpoint_dir_of(cfg: TrainConfig) -> Path:
    """``cfg.checkpoint.directory`` or ``<out_dir>/checkpoints`` (absolute)."""
    d = cfg.checkpoint.directory or str(Path(cfg.out_dir) / "checkpoints")
    return Path(d).expanduser().resolve()


def _with_default_sharding(tree: Any) -> Any:
    """Give ``ShapeDtypeStruct`` leaves without a sharding the first local device's sharding."""
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def fix(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and getattr(x, "sharding", None) is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev)
        return x

    return jax.tree.map(fix, tree)


def sharded_abstract_state(cfg: TrainConfig, mesh: Any) -> Any:
    """The :class:`~minicpm4_jax.train.step.TrainState` of ``jax.ShapeDtypeStruct`` s with their shardings
    on ``mesh`` (the logical-axis rules): the restore target for a run on that mesh."""
    from minicpm4_jax.train.step import abstract_train_state, train_state_shardings

    from flax import nnx

    def one(a: Any, s: Any) -> Any:
        if isinstance(a, nnx.Variable):
            value = a.get_value()
            if not jax.tree.leaves(value):  # e.g. optax.MaskedNode: the moments of another μP group
                return a
            return a.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=s.get_value()))
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(one, abstract_train_state(cfg), train_state_shardings(cfg, mesh), is_leaf=is_var)


def _read_data_state(data_dir: Path) -> Any:
    """The iterator state of this process from a checkpoint's ``data`` folder (see the module docs).

    Raises:
        ConfigError: no state file, or the processes' states differ and this process's file is absent.
    """
    import json

    own = data_dir / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    if own.exists():
        return json.loads(own.read_text())
    files = sorted(data_dir.glob("process_*-of-*.json"))
    if not files:
        raise ConfigError(f"checkpoint data folder {data_dir} holds no iterator state; re-save the checkpoint")
    states = [json.loads(f.read_text()) for f in files]
    if any(st != states[0] for st in states[1:]):
        raise ConfigError(f"checkpoint data folder {data_dir} holds different iterator states for its "
                          f"{len(files)} processes, so it cannot be resumed on {jax.process_count()} processes; "
                          f"resume with the saved process count ({files[0].name.split('-of-')[1][:-5]})")
    return states[0]


def _state_dict(state: Any) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


#: The checkpoint item holding the checksums of the ``state`` item's arrays.
CHECKSUM_ITEM = "checksums"


def state_save_args(state: dict[str, Any], cfg: TrainConfig, step: int) -> dict[str, Any]:
    """The orbax save args of checkpoint step ``step``'s ``state``, ``config`` and ``checksums`` items.

    Computes the checksums of ``state`` (a collective: call it on every process) and records ``step`` with them;
    the three items are committed together (one orbax step), so no complete step lacks its checksums.
    """
    import orbax.checkpoint as ocp

    return {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config_to_dict(cfg)),
            CHECKSUM_ITEM: ocp.args.JsonSave(checksum_record(state, step))}


def _has_checksums(step_dir: Path) -> bool:
    """Whether the step was saved with a checksum item: its folder exists, or the step's orbax metadata
    names it (a step whose checksum folder was removed is then refused, not loaded unverified)."""
    import json

    if (step_dir / CHECKSUM_ITEM).exists():
        return True
    try:
        meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and CHECKSUM_ITEM in (meta.get("item_handlers") or {})


def _restore_verified(manager: Any, directory: Path, step: int, state_args: Any,
                      corrupt: Callable[[BaseException], ConfigError]) -> Any:
    """Restore the ``state`` item of ``step`` with ``state_args`` and check it against the step's checksums.

    Args:
        corrupt: ``exception -> ConfigError``, the caller's damaged-step error.

    Returns:
        The restored ``state`` item (all of it or the part ``state_args`` asks for).

    Raises:
        ConfigError: ``corrupt(e)``: the restore failed, or a restored array differs from its checksum.
    """
    import orbax.checkpoint as ocp

    items = {"state": state_args}
    checked = _has_checksums(directory / str(step))
    if checked:
        items[CHECKSUM_ITEM] = ocp.args.JsonRestore()
    try:
        out = manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a damaged step
        raise corrupt(e) from None
    if not checked:
        import warnings

        warnings.warn(f"checkpoint step {step} in {directory} has no checksums (saved before they were added): "
                      "its arrays are loaded unverified", stacklevel=3)
        return out["state"]
    try:
        verify_checksums(out["state"], out[CHECKSUM_ITEM])
        saved_step = out[CHECKSUM_ITEM].get("step")
        if saved_step is not None and saved_step != step:
            raise ChecksumMismatch(f"the folder holds the checkpoint saved as step {saved_step} (a moved or copied "
                                   "step folder)")
    except ChecksumMismatch as e:
        raise corrupt(e) from None
    return out["state"]


def short_cause(e: BaseException, limit: int = 220) -> str:
    """The error type and the tail of its first line (orbax/tensorstore nest ``"outer: inner:
    innermost"`` and append a long JSON spec). An orbax read error that only points at "full TensorStore
    details" (a pybind method's repr) is replaced by its cause, which names the array and the damage."""
    while "See full TensorStore details" in str(e) and (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec", 1)[0]
    text = text.split(" See full TensorStore details", 1)[0]
    # tensorstore's chain: drop the driver layers and the file paths (the checkpoint folder is named by the caller)
    # so that the array's name and the damage fit the line
    text = re.sub(r'Error opening "\w+" driver: |(?: in OCDBT database at| of) local file "[^"]*"', "", text).strip()
    if len(text) > limit:
        parts, tail = text.split(": "), ""
        while parts and len(tail) + len(parts[-1]) + 2 <= limit:
            tail = parts.pop() + (": " + tail if tail else "")
        text = "..." + (tail or text[-limit:])
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _drop_closed_loop_reports() -> None:
    """Drop (installed once, for good) the "Event loop is closed" reports of a failing save's or restore's
    in-flight operations.

    A restore that fails on one array leaves tensorstore reads of the others in flight, and a write that fails
    leaves its other fragments; as they finish (during the call and after it) they post to orbax's closed event
    loop, and Python prints a traceback for each through ``sys.unraisablehook`` (hundreds of lines, helpers 69 and
    71) after the failure was already reported as one ``ConfigError`` / :class:`CheckpointWriteError` line.
    """
    import sys

    prev = sys.unraisablehook
    if getattr(prev, "_minicpm4_closed_loop", False):
        return

    def hook(u: Any) -> None:
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            prev(u)

    hook._minicpm4_closed_loop = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class _OrbaxErrorsReported(logging.Filter):
    """Drop orbax's ERROR records (with their tracebacks): every failed save or restore the project waits on is
    raised as one :class:`~minicpm4_jax.train.checkpoint.CheckpointWriteError` / ``ConfigError`` line naming the
    step and the cause, and a full disk printed ~100 lines of orbax tracebacks before it (helper 69)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname.replace("\\", "/").split("/"))


class _UnretrievedFuturesOfAFailedCheckpointIO(logging.Filter):
    """Drop asyncio's "exception was never retrieved" reports (installed once a save or a restore failed:
    :func:`_drop_unretrieved_future_reports`): the failed write's other fragments, or the failed restore's other
    reads, end with the same error, already raised as one line (helper 71; a restore's "Task exception was never
    retrieved ... async_deserialize" traceback printed at exit after the one-line error, when the task was collected
    late)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


def _add_filter(logger: str, kind: type[logging.Filter]) -> None:
    """Add a ``kind`` filter to ``logger`` unless it has one."""
    lg = logging.getLogger(logger)
    if not any(isinstance(f, kind) for f in lg.filters):
        lg.addFilter(kind())


def _drop_unretrieved_future_reports() -> None:
    """Install :class:`_UnretrievedFuturesOfAFailedCheckpointIO` on asyncio's logger (once): after a failed save or
    restore, before its one-line error is raised."""
    _add_filter("asyncio", _UnretrievedFuturesOfAFailedCheckpointIO)


def _install_orbax_error_filter() -> None:
    for name in ("absl", "orbax"):
        _add_filter(name, _OrbaxErrorsReported)
    # a failing write's in-flight operations report on a closed event loop as they finish, from the first
    # failure on (before the loop learns of it): dropped from the start (helper 71)
    _drop_closed_loop_reports()


def _quiet_failed_write() -> None:
    """After a failed save: its unfinished fragments' asyncio reports and never-awaited coroutines say nothing the
    one-line :class:`CheckpointWriteError` does not."""
    import warnings

    _drop_unretrieved_future_reports()
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


_TMP_MARK = ".orbax-checkpoint-tmp"


def _await_tmp_cleanup(manager: Any, directory: Path, *, attempts: int = 5) -> None:
    """Finish the removal of interrupted saves' temporary folders that ``manager`` started.

    orbax (0.12) removes ``*.orbax-checkpoint-tmp`` folders in a background future and awaits it only
    at the first save; ``close`` does not. A second manager on the same directory (a resume after a
    query, a test) then started a second ``rmtree`` of the same folder, and the loser failed with
    ``FileNotFoundError`` at its first save. Awaiting here makes start-up deterministic: once a
    :class:`Checkpointer` exists, no temporary folder of an earlier save is left.

    A removal that fails (``OSError``: the folder is still being written by the threads of a failed async
    save of this process, or another process removes it too) is retried here ``attempts`` times; a folder
    that still cannot be removed only warns: orbax never lists a temporary folder as a checkpoint.
    """
    wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if wait is None:
        return
    try:
        wait()
        return
    except OSError as e:
        first = e
    if jax.process_index() != 0:  # orbax removes them on the primary host only
        return
    import shutil
    import time
    import warnings

    left: list[Path] = []
    for attempt in range(attempts):
        left = [p for p in directory.iterdir() if _TMP_MARK in p.name] if directory.is_dir() else []
        if not left:
            return
        if attempt:
            time.sleep(0.1 * attempt)
        for p in left:
            shutil.rmtree(p, ignore_errors=True)
    left = [p for p in directory.iterdir() if _TMP_MARK in p.name]
    if left:
        warnings.warn(f"could not remove the temporary folders of interrupted checkpoint saves "
                      f"{[p.name for p in left]} in {directory} ({first}); they are ignored, remove them by hand",
                      stacklevel=3)


class Checkpointer:
    """A run's orbax ``CheckpointManager`` (async, keep-last-``cfg.checkpoint.keep``).

    The training loop decides *when* to save (``save_every``, the end, a signal); this class only
    writes and reads. Call :meth:`close` (waits for pending async writes) before the process exits.
    """

    def __init__(self, cfg: TrainConfig, directory: str | Path | None = None, *, read_only: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.cfg = cfg
        self.read_only = read_only
        self.directory = Path(directory).resolve() if directory is not None else checkpoint_dir_of(cfg)
        # read_only (another run's checkpoints, e.g. a decay branch's source, which may still be training):
        # nothing is created, and its in-progress saves' temporary folders are left alone
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        _install_orbax_error_filter()
        if not read_only:
            _await_tmp_cleanup(self.manager, self.directory)
        self._pending: int | None = None  # step of a started save not yet awaited
        self._last_complete: int | None = self.manager.latest_step()

    # ---- queries ------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest complete checkpoint step, or ``None``."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """All complete checkpoint steps, ascending."""
        return sorted(self.manager.all_steps())

    def steps_on_disk(self) -> list[int]:
        """The complete steps as the folder shows them now (orbax renames a step's temporary folder to its number
        when the write is finalized), read from disk rather than the manager's cache: after an interrupt cut a
        wait short the cache can miss a save that completed since."""
        try:
            return sorted(int(c.name) for c in self.directory.iterdir() if is_checkpoint_step(c))
        except OSError:
            return []

    def last_complete_step(self) -> int | None:
        """The newest step whose write is known to have completed (for error messages)."""
        return self._last_complete

    # ---- save ---------------------------------------------------------------------------------
    def save(self, step: int, state: Any, data_iterator: Any = None, *, force: bool = True) -> bool:
        """Start an (async) save of ``state`` (+ config, + checksums, + iterator state) as checkpoint ``step``.

        Waits for a previous pending save first; the checksums of ``state`` are computed before the save
        starts (on device, a few integer operations per element). Returns whether a save was started
        (``False`` when that step already exists).

        Raises:
            CheckpointWriteError: this write, or the previous pending one, failed.
            RuntimeError: the checkpointer was opened ``read_only``.
        """
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read-only; no checkpoint is written there")
        ocp = self._ocp
        if step in self.manager.all_steps():
            return False
        self._finish_pending()
        items = state_save_args(_state_dict(state), self.cfg, step)
        if data_iterator is not None:
            import grain

            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        try:
            started = bool(self.manager.save(step, args=ocp.args.Composite(**items), force=force))
        except Exception as e:
            raise checkpoint_write_error(step, self.directory, e, self._last_complete) from e
        if started:
            self._pending = step
        return started

    def _finish_pending(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            _quiet_failed_write()  # the failed write's other operations report the same failure again
            step, self._pending = self._pending, None
            raise checkpoint_write_error(step, self.directory, e, self._last_complete) from e
        if self._pending is not None:
            self._last_complete, self._pending = self._pending, None

    def poll(self) -> None:
        """Settle the pending async save if it has finished, without waiting for one still running.

        A training loop calls this every step, so that a failed background write (a full disk) stops the run at
        the first step after orbax gives the write up, instead of at the next save, ``save_every`` steps later
        (helper 69; with steps much shorter than the write, a few more steps may run first). Single-process only:
        settling is a collective in a multi-process run, whose processes may see their writes finish at different
        steps.

        Raises:
            CheckpointWriteError: the pending write failed.
        """
        if self._pending is None or self.manager.is_saving_in_progress():
            return
        self._finish_pending()

    def wait(self) -> None:
        """Block until pending async saves are committed.

        Raises:
            CheckpointWriteError: the pending write failed.
        """
        self._finish_pending()

    def close(self, *, quiet: bool = False) -> None:
        """Wait for pending saves and release the manager.

        Args:
            quiet: swallow a failure of the pending write (used while another error propagates).

        Raises:
            CheckpointWriteError: the pending write failed (unless ``quiet``).
        """
        try:
            self._finish_pending()
        except CheckpointWriteError:
            self._release()
            if not quiet:
                raise
            return
        self._release()

    def _release(self) -> None:
        try:
            self.manager.close()
        except Exception:  # a failed async write re-raises here; the error was already reported
            pass

    # ---- restore ------------------------------------------------------------------------------
    def _corrupt(self, step: int, e: BaseException) -> ConfigError:
        others = [s for s in self.all_steps() if s != step]
        if self.read_only:  # another run's checkpoint this one starts from (branch_from, qat.init_from): left as is
            fix = (f"start from another of its saved steps ({', '.join(map(str, others))})" if others else
                   "start from another run")
        else:
            fix = (f"move that step folder aside to resume from the previous saved step (saved steps: "
                   f"{', '.join(map(str, others))}), or re-save it" if others else "re-save it or start a new out_dir")
        _drop_unretrieved_future_reports()  # the failed restore's other reads
        return ConfigError(f"checkpoint step {step} in {self.directory} is incomplete or corrupt ({short_cause(e)}); "
                           f"{fix}")

    def saved_config(self, step: int) -> TrainConfig:
        """The :class:`TrainConfig` stored with checkpoint ``step``.

        Raises:
            ConfigError: the step's config item is missing or unreadable (one line, with the fix).
        """
        ocp = self._ocp
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
            return config_from_dict(out["config"])
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax raises many types for a damaged step
            raise self._corrupt(step, e) from None

    def check_compatible(self, step: int) -> list[str]:
        """Raise :class:`ConfigError` unless the current config may resume checkpoint ``step``.

        Every field must equal the checkpoint's except :data:`RESUME_MAY_CHANGE` (logging, eval,
        sampling, checkpoint frequency/location, time limit, out_dir, data cache, mesh sizes, the
        ``distributed`` process layout, and the memory / kernel choices ``gradient_accumulation_steps``,
        ``logits_chunk_size``, ``model.remat``, ``model.attention_impl``): a different model, optimizer, data, ``steps`` or ``seed``
        would silently change the math, the LR schedule or the token stream. A different mesh or
        process count computes the same math (the restore reshards, the data order does not depend
        on the process count); its float sums may differ in the last bits.

        Returns:
            The tolerated differences, ``"name: checkpoint value != current value"``.
        """
        saved = self.saved_config(step)
        allowed, refused = resume_differences(saved, self.cfg)
        if refused:
            model = [d for d in refused if d.startswith("model.")]
            other = [d for d in refused if not d.startswith("model.")]
            where = f"checkpoint {self.directory}/{step}"
            if model:
                msg = f"{where} was written for a different model config: " + "; ".join(model)
                if other:
                    msg += "; and a different run config: " + "; ".join(other)
            else:
                msg = f"{where} was written for a different run config: " + "; ".join(other)
            raise ConfigError(
                f"--resume: {msg} (checkpoint value != current value); a resumed run must keep the model, "
                "optimizer, data, steps and seed of its checkpoint (the mesh and process layout may change): "
                "start a new out_dir to change them"
            )
        return allowed

    def restore(self, abstract_state: Any, step: int | None = None, data_iterator: Any = None, *,
                check: bool = True) -> tuple[int, Any]:
        """Restore checkpoint ``step`` (default: the latest) into ``abstract_state``'s structure.

        Args:
            abstract_state: a ``TrainState`` of ``jax.ShapeDtypeStruct``; leaves with a ``sharding``
                (:func:`sharded_abstract_state`) are restored with exactly that sharding, whatever mesh
                the checkpoint was saved on; leaves without one go to the first local device.
            step: which checkpoint; ``None`` for the latest.
            data_iterator: a grain ``DatasetIterator`` whose state is set in place, if given (this
                process's saved state, or the common state of all processes when the process count
                changed).
            check: run :meth:`check_compatible` first (skip only when the caller already did).

        Returns:
            ``(step, state)`` with ``state`` of the same type as ``abstract_state``.

        Raises:
            ConfigError: no checkpoint, or one from a different config (lists the fields).
        """
        ocp = self._ocp
        if step is None:
            step = self.latest_step()
        if step is None:
            raise ConfigError(f"--resume: no checkpoint found in {self.directory}; train without --resume first")
        if check:
            self.check_compatible(step)
        target = _with_default_sharding(_state_dict(abstract_state))
        data_state = None
        data_dir = self.directory / str(step) / "data"
        if data_iterator is not None and data_dir.is_dir():
            try:
                data_state = _read_data_state(data_dir)
            except ValueError as e:  # a damaged state file (JSONDecodeError)
                raise self._corrupt(step, e) from None
        elif data_iterator is not None:
            import warnings

            warnings.warn(f"checkpoint step {step} in {self.directory} holds no data-iterator state (no data/ "
                          "folder): the data order restarts from the beginning, so the resumed run differs from an "
                          "uninterrupted one", stacklevel=2)
        _drop_closed_loop_reports()
        s = _restore_verified(self.manager, self.directory, step, ocp.args.StandardRestore(target),
                              lambda e: self._corrupt(step, e))
        if data_state is not None:
            data_iterator.set_state(data_state)
        state = type(abstract_state)(step=s["step"], params=s["params"], opt_state=s["opt_state"])
        return step, state


#: what an orbax step folder (``<checkpoints>/<step>``) holds (any one of them marks it)
_STEP_MARKERS = ("_CHECKPOINT_METADATA", "state", "config")


def is_checkpoint_step(path: Path) -> bool:
    """Whether ``path`` is one orbax checkpoint step's folder (a number, holding a step's items)."""
    return path.name.isdigit() and path.is_dir() and any((path / n).exists() for n in _STEP_MARKERS)


def holds_checkpoint_steps(path: Path) -> bool:
    """Whether ``path`` is a checkpoints folder: it holds at least one orbax step folder (:func:`is_checkpoint_step`)."""
    try:
        return any(is_checkpoint_step(c) for c in path.iterdir() if c.name.isdigit())
    except OSError:  # not a folder, or unreadable
        return False


def recorded_checkpoint_directory(run: Path) -> Path | None:
    """The ``checkpoint.directory`` recorded in the ``config.json`` of the run folder ``run`` (resolved: a run records
    the folder it wrote to; a relative one, from a run before that, is read against the working directory), or
    ``None`` when there is none (the run's checkpoints are ``run/checkpoints``) or the file is absent or unreadable."""
    try:
        recorded = json.loads((run / "config.json").read_text()).get("checkpoint", {}).get("directory")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(recorded).expanduser().resolve() if isinstance(recorded, str) and recorded.strip() else None


def find_checkpoint_dir(path: str | Path, *, step_option: str | None = "--step",
                        path_option: str = "--checkpoint") -> Path:
    """Resolve ``path`` (a run's ``out_dir`` or its checkpoint folder) to the checkpoint folder.

    A run folder's checkpoints are ``path/checkpoints``, or the ``checkpoint.directory`` its ``config.json`` records
    when they lie elsewhere (:func:`recorded_checkpoint_directory`).

    Args:
        path: what the user gave as ``--checkpoint``.
        step_option: the command's option choosing a step (named in the message for a step folder);
            ``None`` for a command without one (``generate`` reads the latest step).
        path_option: the option that gave ``path`` (named in the messages); a config key (no leading ``--``,
            e.g. ``branch_from`` with ``step_option="branch_step"``) is written ``key=value``, a phrase (holding a
            space, e.g. ``"the checkpoint argument"`` for a positional argument) ``phrase value``.

    Raises:
        ConfigError: the path does not exist, is a file, is one step's folder (names the run folder
            and the step to give instead) or holds no checkpoint.
    """
    def opt(name: str, value: Any) -> str:  # `--checkpoint DIR` / `the checkpoint argument DIR`, `branch_from=DIR`
        return f"{name} {value}" if name.startswith("--") or " " in name else f"{name}={value}"

    p = Path(path).expanduser().resolve()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{opt(path_option, path)} is a file, not a folder; give the training run's folder "
                          "(its out_dir, holding checkpoints/) or its checkpoints folder")
    if not p.is_dir():
        raise ConfigError(f"checkpoint directory {str(path)!r} does not exist")
    if is_checkpoint_step(p):
        # one orbax step folder (<checkpoints>/<step>), not a run or checkpoints folder
        run = p.parent.parent if p.parent.name == "checkpoints" else p.parent
        how = (f"{opt(path_option, run)} {opt(step_option, int(p.name))}" if step_option
               else f"{opt(path_option, run)} (the latest step is used)")
        raise ConfigError(f"{opt(path_option, path)} is the folder of one checkpoint step ({int(p.name)}), not a run; "
                          f"give the run folder instead: {how}")
    recorded = None if holds_checkpoint_steps(p) else recorded_checkpoint_directory(p)
    if (recorded is not None and recorded != p and holds_checkpoint_steps(recorded)
            and not holds_checkpoint_steps(p / "checkpoints")):
        # a run trained with checkpoint.directory outside its out_dir (helper 99: "no checkpoint found in" the run)
        p = recorded
    elif (p / "checkpoints").is_dir() and not holds_checkpoint_steps(p):
        # a folder that holds step folders is a checkpoints folder even with a checkpoints/ inside it (a run
        # trained into it by mistake): resolving it again must not step into that other run's checkpoints
        p = p / "checkpoints"
    if not any(c.is_dir() and c.name.isdigit() for c in p.iterdir()):
        hint = ""
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            hint = f" (it is a Hugging Face folder: make a run of it first with 'minicpm4 import hf {path} --out RUN')"
        elif any(p.glob("*.gguf")):
            hint = " (it holds a GGUF file, which this project writes for llama.cpp but does not read)"
        raise ConfigError(f"no checkpoint found in {str(path)!r}; give a run's out_dir or its checkpoints folder{hint}")
    return p


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """A resolved checkpoint of another run that a run starts from (``branch_from``, ``qat.init_from``).

    Attributes:
        directory: the source's checkpoint folder (absolute; ``<out_dir>/checkpoints``, the ``checkpoint.directory``
            of a run that wrote elsewhere, or an ``import hf`` OUT's).
        step: the chosen saved step.
        cfg: the :class:`TrainConfig` saved with ``step``.
        saved_steps: every complete step of ``directory`` when it was resolved, ascending (for messages).
        run_dir: the source's run folder (its ``tokenizer/``, ``data.json``, ``metrics.jsonl``): the folder given
            when it was a run folder, else ``directory``'s parent; ``None`` reads as ``directory.parent``.
    """

    directory: Path
    step: int
    cfg: TrainConfig
    saved_steps: tuple[int, ...] = ()
    run_dir: Path | None = None

    @property
    def run_folder(self) -> Path:
        """:attr:`run_dir`, or ``directory.parent`` when it is not set."""
        return self.run_dir if self.run_dir is not None else self.directory.parent


def resolve_source(path: str | Path, step: int | None, *, path_option: str, step_option: str,
                   check_dir: Callable[[Path], None] | None = None) -> CheckpointSource:
    """Find the checkpoint folder of ``path`` and read the config saved with ``step`` (``None``: the latest step).

    Only the step list and the (small) config item are read. The folder is opened read-only: nothing is
    created there and the temporary folders of saves in progress are left alone (the source may still be
    training). What the saved config may be is the caller's check.

    Args:
        path: the source run's ``out_dir`` or its checkpoint folder, as the config gives it.
        step: the step to read, or ``None`` for the newest complete one.
        path_option: the config key that gave ``path`` (e.g. ``branch_from``, ``qat.init_from``); named in the
            messages, which begin with it.
        step_option: the config key that gave ``step`` (e.g. ``branch_step``, ``qat.init_step``); named in the
            messages.
        check_dir: optional ``directory -> None`` called with the checkpoint folder before its steps are read:
            a caller's refusal of a folder (e.g. the run's own), raising :class:`ConfigError`.

    Raises:
        ConfigError: (one line, naming the bad value and the fix) no such folder, a file or one step's folder
            (:func:`find_checkpoint_dir`); no complete checkpoint; ``step`` is not a saved step; the step's
            config item is missing or unreadable.
    """
    import orbax.checkpoint as ocp

    try:
        directory = find_checkpoint_dir(path, step_option=step_option, path_option=path_option)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith(path_option) else f"{path_option}: {e}") from None
    if check_dir is not None:
        check_dir(directory)
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        create=False, cleanup_tmp_directories=False))
    try:
        steps = tuple(sorted(mngr.all_steps()))
        if not steps:
            raise ConfigError(f"{path_option}={str(path)!r}: no complete checkpoint in {directory}; give a run that "
                              "has saved one")
        chosen = steps[-1] if step is None else int(step)
        if chosen not in steps:
            raise ConfigError(f"{step_option}={chosen} is not a checkpoint in {directory} (saved steps: "
                              f"{', '.join(map(str, steps))}); pick one of those")
        try:
            raw = mngr.restore(chosen, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            saved = config_from_dict(raw)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax raises many types for a damaged step
            others = [s for s in steps if s != chosen]
            fix = (f"pick another {step_option} (saved steps: {', '.join(map(str, others))})" if others
                   else f"re-save it or give another {path_option}")
            raise ConfigError(f"{path_option}: checkpoint step {chosen} in {directory} has no readable config "
                              f"({short_cause(e)}); {fix}") from None
    finally:
        mngr.close()
    given = Path(path).expanduser().resolve()
    run_dir = given if given != directory and given not in directory.parents else directory.parent
    return CheckpointSource(directory=directory, step=chosen, cfg=saved, saved_steps=steps, run_dir=run_dir)


def load_params_for_inference(checkpoint_dir: str | Path, step: int | None = None, *,
                              check_config: Any = None, step_option: str | None = "--step",
                              ternary: bool | None = None, shardings: Any = None) -> tuple[TrainConfig, Any]:
    """Load a trained model for generation: ``(cfg, model)``.

    ``checkpoint_dir`` is a run's ``out_dir`` or its ``checkpoints`` folder; the latest step is used
    unless ``step`` is given. Only the params are read (no optimizer state, no data iterator).

    A checkpoint of a ternary QAT run (``qat.enabled`` and a step past the QAT start,
    ``minicpm4_jax.quant.checkpoint_is_ternary``) stores the latent float weights; its model is the
    ternary one: by default the returned model holds ``minicpm4_jax.quant.ternarize`` of them
    (weights ``q * s``, paper §3.3), so generation, evaluation and export see what was trained.

    Args:
        ternary: ``None`` (default): fake-quantize exactly when the checkpoint is ternary; ``False``:
            return the latent weights (to continue training from them, ``qat.init_from``).
        check_config: optional ``cfg -> None`` called with the stored :class:`TrainConfig` after the
            (small) config item is read and before any parameter is: a caller's checks that depend on
            the model config (it raises :class:`ConfigError` to stop).
        step_option: the command's option choosing a step, named in the messages (``None``: the
            command has none).
        shardings: where each parameter is read to: a tree of ``jax.sharding.Sharding`` with the structure of the
            stored model's ``nnx.State`` of Params (e.g. a training run's ``train_state_shardings(cfg, mesh).params``,
            which may span processes: every process reads only its shards); ``None``: the first local device (the
            whole model there).

    Raises:
        ConfigError: no checkpoint there, or the step is incomplete/corrupt (a file of it is missing
            or unreadable): one line naming the step, the folder, the short cause and the fix.
    """
    import orbax.checkpoint as ocp
    from flax import nnx

    from minicpm4_jax.train.step import init_model

    directory = find_checkpoint_dir(checkpoint_dir, step_option=step_option)
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))

    def corrupt(e: BaseException) -> ConfigError:
        others = [s for s in sorted(mngr.all_steps()) if s != step]
        if step_option:
            fix = f"pass {step_option} N for another saved step or re-save it"
            if others:
                fix += f" (saved steps: {', '.join(map(str, others))})"
        else:
            fix = ("move that step folder aside to use the previous saved step, or re-save it" if others
                   else "re-save it")
        _drop_unretrieved_future_reports()  # the failed restore's other reads
        return ConfigError(f"checkpoint step {step} in {directory} is incomplete or corrupt ({short_cause(e)}); {fix}")

    try:
        _drop_closed_loop_reports()
        if step is None:
            step = mngr.latest_step()
        elif step not in mngr.all_steps():
            saved = ", ".join(map(str, sorted(mngr.all_steps()))) or "none"
            raise ConfigError(f"no checkpoint step {step} in {directory} (saved steps: {saved}); pick one of those")
        if step is None:
            raise ConfigError(f"no complete checkpoint in {directory}")
        try:
            saved = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            cfg = config_from_dict(saved)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a damaged step
            raise corrupt(e) from None
        if check_config is not None:
            check_config(cfg)
        abstract_model = nnx.eval_shape(lambda: init_model(cfg.model, 0))
        graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
        if shardings is not None:  # each array straight into its shards (no whole copy on one device)
            abstract_params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                           abstract_params, shardings)
        target = _with_default_sharding({"params": abstract_params})
        # Partial restore: only the params subtree of the saved state (verified against its checksums).
        restored = _restore_verified(mngr, directory, step, ocp.args.PyTreeRestore(
            item=target,
            restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target),
            partial_restore=True,
        ), corrupt)
        params = restored["params"]
    finally:
        mngr.close()
    from minicpm4_jax.quant import checkpoint_is_ternary, ternarize, ternary_spec

    if ternary is None:
        ternary = checkpoint_is_ternary(cfg, step)
    if ternary:
        if not cfg.qat.enabled:
            raise ConfigError(f"checkpoint step {step} in {directory} was not trained with qat.enabled: it has no "
                              "ternary quantization settings")
        params = ternarize(params, cfg.model, ternary_spec(cfg.qat))
    model = nnx.merge(graphdef, params)
    return cfg, model


def _data_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return find_checkpoint_dir(checkpoint_dir, step_option=None) / str(int(step)) / "data"


def has_data_iterator_state(checkpoint_dir: str | Path, step: int) -> bool:
    """Whether checkpoint ``step`` holds a data-iterator item (an ``import hf`` checkpoint has none)."""
    return _data_dir(checkpoint_dir, step).exists()


def restore_data_iterator(checkpoint_dir: str | Path, step: int, data_iterator: Any) -> bool:
    """Set ``data_iterator`` (a grain ``DatasetIterator``) to the state saved with checkpoint ``step``.

    Returns:
        ``False`` when that step holds no data-iterator item (e.g. an ``import hf`` checkpoint),
        ``True`` after restoring it.
    """
    data_dir = _data_dir(checkpoint_dir, step)
    if not data_dir.exists():
        return False
    data_iterator.set_state(_read_data_state(data_dir))  # any process count (see the module docs)
    return True


def params_all_finite(params: Any) -> bool:
    """Whether every parameter value is finite (checked before a checkpoint is written).

    The answer is replicated on the parameters' mesh, so every process reads the same value.
    """
    return bool(jax.device_get(on_mesh_of(_all_finite, params)(params)))


def _all_finite(tree: Any) -> jax.Array:
    import jax.numpy as jnp

    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)
