"""The ``minicpm4`` command's persistent XLA compilation cache: JAX's own cache, switched on by default.

A resumed training run, a second ``minicpm4 generate`` on the same checkpoint or an eval re-run then loads the
compiled programs from disk instead of compiling them again (as MaxText's ``jax_cache_dir`` and Levanter do).
Nothing here reads or writes cache entries: JAX does (``jax_compilation_cache_dir``, its file cache, its key over
the program, the compile options, the devices and the jax/jaxlib versions; source: JAX's documentation, "Persistent
compilation cache", and ``jax/_src/compilation_cache.py``; the project's specs do not cover it).

Where, in this order:

1. ``MINICPM4_JAX_COMPILATION_CACHE=0`` (or ``false`` / ``off`` / ``no``): the command configures nothing (JAX's
   own settings, if any, still apply).
2. A cache the user configured wins and is left as it is: ``JAX_COMPILATION_CACHE_DIR`` (or
   ``jax_compilation_cache_dir`` already set in the process, e.g. by the test suite's ``conftest.py`` or a
   program embedding :func:`minicpm4_jax.cli.main`), and ``JAX_ENABLE_COMPILATION_CACHE=false``.
3. Otherwise ``$MINICPM4_JAX_CACHE/xla`` (default ``~/.cache/minicpm4_jax/xla``, beside the native kernel's
   ``native/`` build cache, ``ops/native``).

A local folder (the user's or the default) that cannot be created or written is one ``warning:`` line naming it
and the fix; the command then runs uncached (for the user's folder by ``jax_enable_compilation_cache=False``:
a read-only cache is not used).

Minimum compile time in the default folder: ``0`` s (every program is written; JAX's default skips programs that
compile in under 1 s), unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set (a folder the user configured
keeps JAX's threshold, or theirs). Measured on the 2-core CPU VM (2026-12-05, jax
0.12.0.1): ``minicpm4 generate`` on a 4-step ``cpu_tiny`` run compiles 47 programs in 6.0-7.4 s, of which only 2
(3.1 s) take 1 s or more and 33 take under 0.1 s (0.8 s together); loading all 47 from the cache took 0.27-0.30 s
(6 ms each on average, 400 KiB on disk). Warm wall time of the whole command: 4.2-4.9 s with threshold 0, 4.5-4.7 s
with 0.02 s, 5.2-5.9 s with 0.1 s, against 10.6-12.0 s cold; with a threshold above 0 the programs near it were
written on some runs and not on others (18 entries after four runs at 0.1 s, growing each run), so what a run finds
depended on the machine's load. ``minicpm4 train`` on ``cpu_tiny``: 58 programs, 30.9 s, 34 of them under 0.1 s
(1.2 s). A cache on a slow network file system may want a higher threshold: set the variable.

Entries are written whole or not at all, and a damaged one is replaced (:class:`_SafeFileCache`): JAX itself
writes an entry in place and never replaces one that exists, so a run killed mid-write or a full disk left a
truncated entry that every later run failed to read (two warning lines per program) and compiled again.

Multi-device CPU programs are kept out of the cache (they compile in the process, as without a cache): with jax
0.12.0.1, an XLA:CPU executable with collectives loaded back from the persistent cache deadlocked in 12 of 13 runs
of the 8-device MTP + QAT train step (README, "Persistent compilation cache and multi-device CPU programs";
``tests/conftest.py`` does the same for the test suite). Single-device CPU programs and every GPU / TPU program are
cached. Several processes of one distributed run may share a folder: JAX writes entries from process 0 only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["cache_root", "configure_compilation_cache", "MIN_COMPILE_TIME_SECS"]

#: the minimum compile time (seconds) of a program written to the command's cache (see the module docstring)
MIN_COMPILE_TIME_SECS = 0.0
_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")
_state: dict = {"warn": None}  # where _SafeFileCache's warnings go (configure_compilation_cache's ``warn``)


def cache_root() -> Path:
    """The project's cache root: ``$MINICPM4_JAX_CACHE``, default ``~/.cache/minicpm4_jax`` (an absolute path; not
    created). A leading ``~`` is the home folder, as in a shell (a value from a systemd unit, a Dockerfile ``ENV``
    or a quoted ``'~/x'`` reaches the process unexpanded: it made a folder named ``~`` in the current one); a
    relative path is taken from the current folder; an empty or blank value is the default."""
    value = os.environ.get("MINICPM4_JAX_CACHE", "")
    return (Path(value).expanduser() if value.strip() else Path.home() / ".cache" / "minicpm4_jax").absolute()


def _writable(folder: Path) -> str | None:
    """``None`` when ``folder`` exists (created if needed) and a file can be written in it, else the reason."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _wrap_jax(module: str, name: str, make: Callable) -> bool:
    """Replace the function ``name`` of JAX's private module ``module`` by ``make(original)`` (idempotent: a
    function already wrapped by ``make`` is kept); ``False`` when this jax lacks the module or the function."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:  # pragma: no cover - private module moved
        return False
    orig = getattr(mod, name, None)
    if orig is None:  # pragma: no cover
        return False
    if getattr(orig, "_minicpm4_wrapper", None) is make:
        return True
    wrapped = make(orig)
    wrapped._minicpm4_wrapper = make
    setattr(mod, name, wrapped)
    return True


def _cpu_collectives_out(orig: Callable) -> Callable:
    def cache_key(options, backend, computation, devices, *args, **kwargs):
        if getattr(backend, "platform", "") == "cpu" and getattr(devices, "size", 1) > 1:
            return None
        return orig(options, backend, computation, devices, *args, **kwargs)

    return cache_key


def _keep_cpu_collectives_out() -> bool:
    """Wrap JAX's cache-key function so that a CPU program over more than one device gets no key (JAX then compiles
    it and neither reads nor writes the cache); idempotent. ``False`` when this jax lacks the function."""
    return _wrap_jax("jax._src.compiler", "_get_cache_key", _cpu_collectives_out)


class _SafeFileCache:
    """JAX's file cache (``jax._src.lru_cache.LRUCache``, wrapped) with entries that are written atomically and a
    damaged entry that is replaced instead of read again on every run.

    JAX writes an entry with ``Path.write_bytes`` and never replaces one that exists: a run killed mid-write or
    a full disk left a truncated (or empty) ``*-cache`` file, and every later run warned twice per such program
    (``Error reading persistent compilation cache entry ...: incomplete or truncated stream``) and compiled it,
    for ever, even after space was freed (measured: 15 programs of ``minicpm4 generate``, 30 warning lines per
    run, with the cache on a full 80 KiB tmpfs). Here:

    * ``put`` writes a temporary file in the folder (its name does not end in ``-cache``, so JAX never reads it)
      and renames it over the entry, so a reader sees a whole entry or none (a temporary file that a killed
      process left is removed by the first run an hour later); a failed write (``ENOSPC``,
      ``EACCES``) removes the temporary file and is one ``warning:`` line per process, the program runs
      uncached;
    * ``put`` also writes the entry's SHA-256 beside it (``<key>-sha256``), and ``get`` treats an entry that
      does not match it as missing: it is removed, JAX compiles the program and ``put`` writes the entry again
      (one ``warning:`` line per process, naming the first such file). JAX's zlib has its own check, its zstd
      (Python 3.14's ``compression.zstd``, or ``zstandard`` installed) has none: an entry with flipped bytes
      that still decompressed was loaded and killed the process (SIGILL, ``minicpm4 generate`` with every entry
      of a warm cache so damaged and recompressed). An entry without a digest (written by JAX itself) must
      decompress instead. A digest whose entry is gone (JAX's eviction removes entries only) is removed after an
      hour. An entry that passes but does not deserialize is warned about by JAX and replaced by ``put``.
    """

    #: a temporary file older than this (seconds) is left over from a process killed mid-write: removed
    STALE_TMP_SECS = 3600.0

    def __init__(self, base, warn: Callable[[str], None]):
        self._base, self._warn, self._warned = base, warn, set()
        self._path = base._path
        cutoff, folder = time.time() - self.STALE_TMP_SECS, Path(self._path)
        left = [*folder.glob(".*.tmp"), *(p for p in folder.glob("*-sha256")
                                          if not p.with_name(p.name[: -len("sha256")] + "cache").exists())]
        for tmp in left:
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:  # removed by another process meanwhile, or a read-only folder
                pass

    def _once(self, what: str, line: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._warn(line)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool):
        """Hold the folder's ``.minicpm4-lock`` (shared to read an entry and its digest, exclusive to write them):
        without it, processes writing one key at once left one's entry beside another's digest (3 parallel
        ``minicpm4 generate`` on a fresh folder: the next run found a mismatch; serialized executables are not
        byte-identical across processes). Without ``fcntl`` or where the lock cannot be made: no lock."""
        fd = None
        try:
            import fcntl

            fd = os.open(Path(self._path) / ".minicpm4-lock", os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except (ImportError, OSError):
            pass
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def get(self, key: str) -> bytes | None:
        """The entry of ``key`` (bytes as JAX wrote them), or ``None``: missing, or damaged (then removed)."""
        path, digest = Path(self._path) / f"{key}-cache", Path(self._path) / f"{key}-sha256"
        with self._locked(exclusive=False):
            value = self._base.get(key)
            if value is None:
                return None
            try:
                want = digest.read_text().strip()
            except OSError:  # none: an entry JAX itself wrote
                want = None
        if want is not None:
            if hashlib.sha256(value).hexdigest() == want:
                return value
            reason = f"its SHA-256 is not the {want[:12]}... written with it"
        else:
            from jax._src import compilation_cache as jcc

            try:
                jcc.decompress_executable(value)
                return value
            except Exception as e:  # noqa: BLE001 (zlib.error, zstd's errors: the entry is damaged)
                reason = f"{type(e).__name__}: {e}"
        with self._locked(exclusive=True):
            for damaged in (path, digest):
                try:
                    damaged.unlink()
                except OSError:
                    pass
        self._once("read", f"warning: compilation cache entry {path} is damaged ({len(value)} bytes; {reason}); "
                   "removed: its program compiles again and is rewritten (other damaged entries of this run are "
                   "replaced without a warning)")
        return None

    def _write(self, path: Path, data: bytes) -> None:
        """Write ``path`` by a temporary file in its folder and a rename (a reader sees all of it or none)."""
        # not mkstemp: its mode 0600 would hide the file from the other users of a shared folder
        tmp = path.parent / f".{path.name[:80]}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except OSError:  # renamed (the usual case), or never created
                pass

    def put(self, key: str, value: bytes) -> None:
        """Write the entry of ``key`` atomically (replacing a damaged one); a failed write is one warning line."""
        base = self._base
        if getattr(base, "eviction_enabled", False) and len(value) > base.max_size:
            return base.put(key, value)  # JAX's own warning that the entry exceeds the size limit
        path = Path(self._path) / f"{key}-cache"
        if getattr(base, "eviction_enabled", False):
            base.lock.acquire(timeout=base.lock_timeout_secs)
        try:
            if getattr(base, "eviction_enabled", False):
                base._evict_if_needed(additional_size=len(value))
            with self._locked(exclusive=True):
                self._write(path.with_name(f"{key}-sha256"), hashlib.sha256(value).hexdigest().encode())
                self._write(path, value)
            if getattr(base, "eviction_enabled", False):
                (path.parent / f"{key}-atime").write_bytes(time.time_ns().to_bytes(8, "little"))
        except OSError as e:
            try:  # a digest without its entry
                path.with_name(f"{key}-sha256").unlink()
            except OSError:
                pass
            self._once("write", f"warning: cannot write to the compilation cache folder {path.parent} "
                       f"({e.strerror or type(e).__name__}); programs that are not cached yet compile again on "
                       "the next run: free space, or set MINICPM4_JAX_CACHE to another folder")
        finally:
            if getattr(base, "eviction_enabled", False):
                base.lock.release()

    def clear(self) -> None:  # pragma: no cover - JAX's tests only
        self._base.clear()


def _use_safe_file_cache(warn: Callable[[str], None]) -> bool:
    """Make JAX open its local file cache through :class:`_SafeFileCache` when it opens it, at the first
    compilation (idempotent; a cache JAX opened before stays as it is); ``False`` when this jax lacks the hook."""
    _state["warn"] = warn
    return _wrap_jax("jax._src.compilation_cache", "get_file_cache", _safe_file_cache)


def _safe_file_cache(orig: Callable) -> Callable:
    def get_file_cache(path: str):
        opened = orig(path)
        if opened is None or "://" in str(path) or type(opened[0]).__name__ != "LRUCache":
            return opened  # a remote folder, or JAX's content verification: as JAX opens it
        return _SafeFileCache(opened[0], _state["warn"]), opened[1]

    return get_file_cache


def configure_compilation_cache(warn: Callable[[str], None] | None = None) -> str | None:
    """Switch on JAX's persistent compilation cache for this process as the module docstring says; call it before
    the first compilation (the ``minicpm4`` command does, for every subcommand).

    Args:
        warn: receives the one warning line when the folder (the user's or the default) is unusable (default:
            print to stderr).

    Returns:
        The cache folder JAX uses from now on (the user's or the default), or ``None``: switched off
        (``MINICPM4_JAX_COMPILATION_CACHE=0``, ``JAX_ENABLE_COMPILATION_CACHE=false``) or the folder unusable
        (then the cache is off in this process).

    Raises:
        ConfigError: ``MINICPM4_JAX_COMPILATION_CACHE`` is neither on (``1``/``true``/``on``/``yes``/empty) nor off
            (``0``/``false``/``off``/``no``).
    """
    switch = os.environ.get("MINICPM4_JAX_COMPILATION_CACHE", "").strip().lower()
    if switch in _OFF:
        return None
    if switch not in _ON:
        from minicpm4_jax.config import ConfigError

        raise ConfigError(f"MINICPM4_JAX_COMPILATION_CACHE={os.environ['MINICPM4_JAX_COMPILATION_CACHE']!r}: give 1 "
                          "(the default: cache compiled programs) or 0 (no cache)")
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return None
    user = jax.config.jax_compilation_cache_dir
    if user and "://" not in str(user):  # a local folder (JAX also takes gs:// and other etils paths: not probed)
        reason = _writable(Path(user))
        if reason is not None:  # JAX would warn in two lines at the first compilation, then run uncached
            jax.config.update("jax_enable_compilation_cache", False)
            (warn or _stderr)(f"warning: compilation cache folder {user} is not writable ({reason}); running "
                              "without it: make it writable, or set JAX_COMPILATION_CACHE_DIR to a writable folder "
                              "(or unset it: the command's default is $MINICPM4_JAX_CACHE/xla)")
            return None
    if not user:
        folder = cache_root() / "xla"
        reason = _writable(folder)
        if reason is not None:
            (warn or _stderr)(f"warning: compilation cache folder {folder} is not writable ({reason}); running "
                              "without it: set MINICPM4_JAX_CACHE to a writable folder (or "
                              "MINICPM4_JAX_COMPILATION_CACHE=0)")
            return None
    if not _keep_cpu_collectives_out():  # pragma: no cover - a jax without the private hook
        if not user:
            (warn or _stderr)(f"warning: jax {jax.__version__} has no jax._src.compiler._get_cache_key to keep "
                              "multi-device CPU programs out of the compilation cache; running without the cache")
            return None
    _use_safe_file_cache(warn or _stderr)
    if user:
        return str(user)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    return str(folder)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
