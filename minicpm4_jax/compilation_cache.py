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

Multi-device CPU programs are kept out of the cache (they compile in the process, as without a cache): with jax
0.12.0.1, an XLA:CPU executable with collectives loaded back from the persistent cache deadlocked in 12 of 13 runs
of the 8-device MTP + QAT train step (README, "Persistent compilation cache and multi-device CPU programs";
``tests/conftest.py`` does the same for the test suite). Single-device CPU programs and every GPU / TPU program are
cached. Several processes of one distributed run may share a folder: JAX writes entries from process 0 only.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["cache_root", "configure_compilation_cache", "MIN_COMPILE_TIME_SECS"]

#: the minimum compile time (seconds) of a program written to the command's cache (see the module docstring)
MIN_COMPILE_TIME_SECS = 0.0
_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")


def cache_root() -> Path:
    """The project's cache root: ``$MINICPM4_JAX_CACHE``, default ``~/.cache/minicpm4_jax`` (a path; not created)."""
    return Path(os.environ.get("MINICPM4_JAX_CACHE") or Path.home() / ".cache" / "minicpm4_jax")


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


def _keep_cpu_collectives_out() -> bool:
    """Wrap JAX's cache-key function so that a CPU program over more than one device gets no key (JAX then compiles
    it and neither reads nor writes the cache); idempotent. ``False`` when this jax lacks the function."""
    try:
        from jax._src import compiler
    except ImportError:  # pragma: no cover - private module moved
        return False
    orig = getattr(compiler, "_get_cache_key", None)
    if orig is None:  # pragma: no cover
        return False
    if getattr(orig, "_minicpm4_cpu_collectives_out", False):
        return True

    def cache_key(options, backend, computation, devices, *args, **kwargs):
        if getattr(backend, "platform", "") == "cpu" and getattr(devices, "size", 1) > 1:
            return None
        return orig(options, backend, computation, devices, *args, **kwargs)

    cache_key._minicpm4_cpu_collectives_out = True
    compiler._get_cache_key = cache_key
    return True


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
    if user:
        return str(user)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    return str(folder)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
