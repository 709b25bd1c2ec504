"""File plumbing shared by import and export: atomic output folders, disk-space checks, manifests,
content hashes and (sharded) safetensors reading/writing.

* :func:`staged_output` writes everything into a hidden sibling folder and renames it into place
  only when the whole output is complete, so a failure (or a kill) never leaves a folder that looks
  complete; a non-empty target is refused without ``force``.
* :class:`SafetensorsSource` opens an HF weight folder (one ``model.safetensors``, or shards with
  ``model.safetensors.index.json``), validates every header against the file size (a truncated file
  is reported before anything is read) and reads tensors lazily through ``safetensors.safe_open``.
* :func:`write_safetensors_shards` writes the HF sharding convention (spec ``export.md`` §6) with
  ``safetensors.numpy.save_file`` one shard at a time.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minicpm4_jax.config import ConfigError

__all__ = [
    "ConvertError",
    "staged_output",
    "check_disk_space",
    "check_output_target",
    "atomic_write",
    "default_dir_mode",
    "default_file_mode",
    "refuse_output_over_source",
    "params_sha256",
    "file_sha256",
    "write_manifest",
    "SafetensorsSource",
    "write_safetensors_shards",
    "check_float16_range",
    "plan_shards",
    "parse_size",
    "MANIFEST_NAME",
    "quantization_method",
]

#: name of the manifest every import/export writes
MANIFEST_NAME = "minicpm4_manifest.json"

_ST_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ConvertError(ConfigError):
    """Bad input to an import/export (one line: the bad value and the fix). A :class:`ConfigError`,
    so the CLI prints it as ``error: ...`` with exit status 2."""


def quantization_method(hf_config: Mapping[str, Any]) -> str | None:
    """The ``quant_method`` of a Hugging Face ``config.json``'s ``quantization_config`` (GPTQ, AWQ, Marlin, FP8...),
    ``"?"`` when it names none, or ``None`` for an unquantized config (no such key)."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    return str(q.get("quant_method", "?")) if isinstance(q, Mapping) else str(q)


# ------------------------------------------------------------------------------------------------
# output folders
# ------------------------------------------------------------------------------------------------


def _is_nonempty_dir(p: Path) -> bool:
    return p.is_dir() and any(p.iterdir())


def _replace_check(out: Path, importing: bool) -> None:
    """With ``--force``: the earlier output in ``out`` may be replaced only if it holds nothing its manifest does
    not list (notes or files added since would be deleted silently), and an imported run folder (checkpoints,
    possibly trained further) only by another import, and only while it holds nothing but what its import wrote."""
    try:
        earlier = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict):
        raise ConvertError(f"output folder {out} has an unreadable {MANIFEST_NAME}; pick another --out, or empty "
                           "it yourself") from None
    was_import = str(earlier.get("format", "")).startswith("import")
    if was_import and not importing:
        raise ConvertError(f"output folder {out} holds an imported model run ({earlier.get('format')}), which "
                           "--force does not replace with an export: pick another --out")
    if was_import:  # only what the import wrote: a run trained on since (new steps, logs) is not replaced
        step = str(earlier.get("step", 0))
        tok = set(earlier.get("tokenizer_files") or [])

        def imported(rel: Path) -> bool:
            parts = rel.parts
            return (len(parts) == 1 and parts[0] in ("config.json", MANIFEST_NAME)
                    or parts[0] == "tokenizer" and len(parts) == 2 and parts[1] in tok
                    or parts[0] == "checkpoints" and len(parts) >= 3 and parts[1] == step)

        extra = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                       if p.is_file() and not imported(p.relative_to(out)))
        if extra:
            raise ConvertError(f"output folder {out} holds an imported model run with {len(extra)} file(s) the import "
                               f"did not write (e.g. {extra[0]}: trained on since?); --force would delete them: "
                               "move them away or pick another --out")
        return
    # every export lists its files; a manifest without the list (hand-made, damaged) vouches for none of them
    listed = earlier.get("files")
    listed = listed if isinstance(listed, (dict, list)) else {}
    extra = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME and str(p.relative_to(out)) not in listed)
    if extra:
        raise ConvertError(f"output folder {out} holds {len(extra)} file(s) its manifest does not list (e.g. "
                           f"{extra[0]}); --force would delete them: move them away or pick another --out")


def folder_write_error(folder: Path) -> str | None:
    """Why nothing can be created in the existing folder ``folder`` (the OS's reason), or ``None`` when it can.

    Creates and removes an empty probe folder: permission bits say nothing to root, and read-only or virtual
    file systems (``/proc``, ``/sys``, a read-only mount) refuse only the real call.
    """
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=folder))
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_output_target(out: Path, force: bool, importing: bool = False) -> None:
    """Refuse an ``out`` that cannot become the output folder: an empty string, the current directory or a
    folder holding it (the output replaces the folder), a file there, a file above it (the folder could not be
    created), a non-writable parent, or a non-empty folder unless ``force``; even with ``force``, a non-empty
    folder that is not an earlier output (no ``minicpm4_manifest.json``: a typo of a parent folder would
    otherwise delete everything in it), an earlier output holding files its manifest does not list, or an
    imported run folder when ``importing`` is false (an export would replace its checkpoints).

    Raises:
        ConvertError: as above (one line naming the path and the fix).
    """
    if str(out).strip() == "":
        raise ConvertError("--out is empty; give the output folder (an unset shell variable?)")
    out = Path(out).expanduser().absolute()
    cwd = Path.cwd().absolute()
    if out == cwd or out in cwd.parents:
        raise ConvertError(f"--out {out} is the current directory or holds it; the output replaces that folder: "
                           "pick a new folder for --out")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out {out} exists and is a file, not a folder; pick another --out")
    if out.is_dir() and os.path.ismount(out):  # the finished output is renamed into place: a mount point cannot be
        raise ConvertError(f"--out {out} is a mount point, which the output cannot replace (it is built beside --out "
                           f"and renamed into place); give a new folder inside it, e.g. --out {out / 'model'}")
    probe = out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConvertError(f"--out {out} cannot be created: {probe} is a file, not a folder; pick another --out")
    why = folder_write_error(probe)
    if why:
        raise ConvertError(f"--out {out} cannot be created: {probe} is not writable ({why}); pick another --out")
    if _is_nonempty_dir(out) and not (out / MANIFEST_NAME).is_file():
        raise ConvertError(f"output folder {out} is not empty and is not an earlier output (no {MANIFEST_NAME}; "
                           "--force replaces only those): pick another --out, or empty it yourself")
    if _is_nonempty_dir(out) and not force:
        raise ConvertError(f"output folder {out} is not empty (an earlier output); pass --force to replace it or pick "
                           "another --out")
    if _is_nonempty_dir(out):
        _replace_check(out, importing)


def check_float16_range(src: np.ndarray, name: str, option: str) -> None:
    """Raise when a float16 cast of ``src`` would overflow (|w| > 65504 turns into inf, silently in numpy).

    Args:
        src: the tensor before the cast (any float dtype).
        name: the tensor's name in the output format (for the message).
        option: the option that chose float16 (``--dtype float16``, ``--outtype f16``).

    Raises:
        ConvertError: naming the tensor, its largest magnitude and the fix.
    """
    big = float(np.max(np.abs(src), initial=0.0)) if src.size else 0.0
    if big > float(np.finfo(np.float16).max) and np.isfinite(big):
        raise ConvertError(f"{name} does not fit float16 ({option}): its largest magnitude {big:.6g} is above "
                           "65504 and would be written as inf; export as float32 or bfloat16")


def refuse_output_over_source(out: Path, sources: Path | Iterable[tuple[str, Path]]) -> None:
    """Raise :class:`ConvertError` when ``out`` overlaps a folder being read: ``out`` is that
    folder, holds it, or lies inside it (a ``--force`` there would delete the source, or mix the
    output into it). Checked before the "not empty" check, with or without ``--force``.

    Args:
        out: the output folder.
        sources: ``[(what, folder)]`` (e.g. ``("run folder", R)``, ``("checkpoints folder", R/checkpoints)``,
            ``("tokenizer folder", R/tokenizer)``), or one folder.
    """
    items = [("folder", Path(sources))] if isinstance(sources, (str, os.PathLike)) else list(sources)
    o = Path(out).expanduser().resolve()
    hits: list[tuple[int, int, str, str, Path]] = []  # (priority, -depth, how, what, folder)
    for what, src in items:
        s = Path(src).expanduser().resolve()
        if o == s:
            hits.append((0, 0, "is", what, s))
        elif s in o.parents:
            hits.append((1, -len(s.parts), "is inside", what, s))  # the innermost source folder first
        elif o in s.parents:
            hits.append((2, 0, "contains", what, s))
    if not hits:
        return
    _p, _d, how, what, s = min(hits, key=lambda h: h[:2])
    harm = ("writing there would mix the output into it, and --force could replace part of it" if how == "is inside"
            else "replacing it (--force) would delete the source")
    raise ConvertError(f"--out {out} overlaps the source: it {how} the {what} {s} being read; {harm}: pick an "
                       f"--out outside {s}")


def check_disk_space(folder: Path, needed_bytes: int) -> None:
    """Raise :class:`ConvertError` unless ``folder``'s file system has ``needed_bytes`` (+1% + 16 MiB) free."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(needed_bytes * 1.01) + (16 << 20)
    if free < need:
        raise ConvertError(
            f"not enough disk space in {probe}: the output needs about {need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free; free some space or pick another --out"
        )


def _owner_alive(stage: Path) -> bool:
    """Whether the process named in staging folder ``stage``'s owner file (``host pid``) may still be writing it."""
    import socket

    try:
        host, pid = stage.with_name(stage.name + ".owner").read_text().split()
    except (OSError, ValueError):  # no owner file yet (a folder just made) or unreadable: a young folder is alive
        try:
            return _dt.datetime.now().timestamp() - stage.stat().st_mtime < 60
        except OSError:
            return False
    if host != socket.gethostname():
        return True  # another machine's process: cannot tell, leave it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def recover_interrupted(out: Path, log: Any = print) -> None:
    """Clean up after an earlier run on ``out`` that was killed (SIGKILL, power loss) inside :func:`staged_output`.

    * ``.<name>.partial-<tag>`` staging folders whose owner process is gone are deleted (said in one line each);
    * a ``.<name>.old-<tag>`` folder (the previous output, moved aside by ``--force``) whose run died before the new
      output took its place is renamed back to ``out`` when ``out`` is missing, otherwise deleted.
    """
    parent = out.parent
    if not parent.is_dir():
        return
    import glob

    name = glob.escape(out.name)  # an --out named 'm[1]' must not match another output's leftovers
    for stage in sorted(parent.glob(f".{name}.partial-*")):
        if stage.name.endswith(".owner") or not stage.is_dir():
            continue
        if _owner_alive(stage):
            continue
        shutil.rmtree(stage, ignore_errors=True)
        stage.with_name(stage.name + ".owner").unlink(missing_ok=True)
        log(f"removed {stage}: the staging folder of an earlier run on {out} that was killed before it finished")
    for marker in parent.glob(f".{name}.partial-*.owner"):  # a run killed after its rename, before the unlink
        if not marker.with_name(marker.name[: -len(".owner")]).exists():
            marker.unlink(missing_ok=True)
    for old in sorted(parent.glob(f".{name}.old-*")):
        tag = old.name.rsplit("-", 1)[-1]
        if _owner_alive(parent / f".{out.name}.partial-{tag}"):
            continue
        if not out.exists():
            old.rename(out)
            log(f"restored {out} from {old}: an earlier --force run was killed between moving the previous output "
                "aside and putting the new one in place")
        else:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Inside: SIGTERM (a scheduler's kill, ``timeout``) raises SystemExit, so cleanups run (main thread only).
    A handler already set (the ``minicpm4`` command's, which raises its one-line ``Terminated``) is kept."""
    import signal
    import threading

    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, *, force: bool = False, needed_bytes: int = 0,
                  importing: bool = False) -> Iterator[Path]:
    """Context manager yielding a fresh staging folder that becomes ``out`` on success.

    The staging folder is ``<parent>/.<name>.partial-<random>`` (its owner, ``host pid``, in a sibling
    ``.owner`` file). On a clean exit it is renamed to ``out`` (an existing empty ``out`` is removed first; with
    ``force`` a non-empty one is moved aside, replaced, then deleted). On an exception, or SIGTERM, it is deleted
    and ``out`` is untouched. What a SIGKILL leaves behind is cleaned up by the next run on the same ``out``
    (:func:`recover_interrupted`).

    Raises:
        ConvertError: ``out`` is non-empty without ``force``, is a file, or the disk is too full for
            ``needed_bytes`` (all checked before anything is written).
    """
    import socket

    out = Path(out).expanduser().absolute()
    recover_interrupted(out)
    check_output_target(out, force, importing)
    check_disk_space(out.parent, needed_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    stage = out.parent / f".{out.name}.partial-{tag}"
    marker = stage.with_name(stage.name + ".owner")
    stage.mkdir()
    old = None
    try:
        marker.write_text(f"{socket.gethostname()} {os.getpid()}\n")
        with _sigterm_raises():
            yield stage
            if out.exists():
                if _is_nonempty_dir(out):
                    old = out.parent / f".{out.name}.old-{tag}"
                    out.rename(old)
                else:
                    out.rmdir()
            stage.rename(out)
    except BaseException:
        if old is not None and old.exists() and not out.exists():  # stopped between the two renames
            old.rename(out)
        shutil.rmtree(stage, ignore_errors=True)
        marker.unlink(missing_ok=True)
        raise
    marker.unlink(missing_ok=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# hashes and manifests
# ------------------------------------------------------------------------------------------------


def params_sha256(flat: Mapping[str, Any]) -> str:
    """SHA-256 of parameters: for each name in sorted order, the name, dtype, shape and raw bytes.

    Independent of how the checkpoint is stored (orbax layout, sharding), so two checkpoints with
    the same parameter values have the same hash.
    """
    h = hashlib.sha256()
    for name in sorted(flat):
        a = np.ascontiguousarray(np.asarray(flat[name]))
        h.update(f"{name}|{a.dtype.name}|{list(a.shape)}\n".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_manifest(folder: Path, manifest: dict[str, Any], *, hash_files: bool = True) -> Path:
    """Write ``folder/minicpm4_manifest.json``: ``manifest`` plus the tool version, a UTC time stamp
    and (``hash_files``) every file's size and SHA-256. Written last, so its presence means complete."""
    from minicpm4_jax import __version__

    files = {}
    if hash_files:
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.name != MANIFEST_NAME:
                files[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    body = {
        "tool": f"minicpm4-jax {__version__}",
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **manifest,
        "files": files,
    }
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")
    return path


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: ``file`` (a path), safetensors ``dtype`` string and ``shape``."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header and check that the file holds every byte the header promises.

    Raises:
        ConvertError: unreadable file, bad header, or a truncated file (names the bytes missing).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path} is truncated ({size} bytes, not even a safetensors header); "
                                   "download or copy it again")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise ConvertError(f"{path} is truncated or not safetensors (header claims {n} bytes, file has "
                                   f"{size}); download or copy it again")
            header = json.loads(f.read(n))
    except ConvertError:
        raise
    except OSError as e:
        raise ConvertError(f"cannot read {path} ({e.strerror}); check the path and its permissions") from None
    except (ValueError, UnicodeDecodeError):
        raise ConvertError(f"{path} has a corrupt safetensors header; download or copy it again") from None
    out: dict[str, TensorEntry] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b0, b1) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: corrupt header entry for tensor {name!r}; download or copy it again") from None
        if dtype in _ST_DTYPES and (b1 - b0) != _ST_DTYPES[dtype] * int(np.prod(shape, dtype=np.int64)):
            raise ConvertError(f"{path}: tensor {name!r} header size does not match its shape; the file is corrupt")
        end = max(end, int(b1))
        out[name] = TensorEntry(path, dtype, shape)
    if 8 + n + end > size:
        raise ConvertError(
            f"{path} is truncated: its header needs {8 + n + end} bytes but the file has {size} "
            f"({8 + n + end - size} missing); download or copy it again"
        )
    return out


class SafetensorsSource:
    """The tensors of an HF weight folder, read lazily.

    Accepts ``model.safetensors.index.json`` + shards, or exactly one ``*.safetensors`` file.
    Every file's header is validated on construction (truncation, corrupt header, index entries
    pointing at missing files or tensors), before any tensor data is read.

    Attributes:
        entries: ``{name: TensorEntry}`` of every tensor in the folder.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        self.entries: dict[str, TensorEntry] = {}
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise ConvertError(f"{index} is not a valid safetensors index (needs a 'weight_map'); fix or remove it") from None
            headers: dict[str, dict[str, TensorEntry]] = {}
            for name, fname in wm.items():
                p = self.folder / fname
                if fname not in headers:
                    if not p.is_file():
                        raise ConvertError(f"{index} maps tensor {name!r} to {fname}, which does not exist; "
                                           "copy the missing shard")
                    headers[fname] = read_safetensors_header(p)
                if name not in headers[fname]:
                    raise ConvertError(f"{index} maps tensor {name!r} to {fname}, which does not contain it; "
                                       "the index and the shards do not belong together")
                self.entries[name] = headers[fname][name]
            for fname, hd in headers.items():
                for name in hd:
                    if name not in wm:
                        raise ConvertError(f"tensor {name!r} in {fname} is not listed in {index.name}; "
                                           "the index and the shards do not belong together")
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in self.folder.glob("*.bin"))
                hint = (f" (found PyTorch {bins[:3]}: convert them to safetensors first)" if bins else "")
                raise ConvertError(f"no model.safetensors or model.safetensors.index.json in {self.folder}{hint}")
            if len(files) > 1:
                raise ConvertError(f"{self.folder} holds {len(files)} .safetensors files but no "
                                   "model.safetensors.index.json; add the index or keep one file")
            self.entries = read_safetensors_header(files[0])
        self._open: dict[Path, Any] = {}

    def _handle(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="np")
        return self._open[path]

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a numpy array (bf16 as ``ml_dtypes.bfloat16``), read from disk now."""
        e = self.entries[name]
        return self._handle(e.file).get_tensor(name)

    def close(self) -> None:
        """Release the open files."""
        self._open.clear()

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parse_size(text: str | int, option: str = "size") -> int:
    """``"5GB"``/``"500MB"``/``"2GiB"``/``"1000"`` -> bytes (decimal units as transformers' ``max_shard_size``).

    Raises:
        ConvertError: not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ConvertError(f"{option} {text!r} must be positive; write e.g. 5GB, 500MB or 2GiB")
        return text
    t = str(text).strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            t, mult = t[: -len(u)], m
            break
    else:
        mult = 1
    try:
        v = float(t)
    except ValueError:
        raise ConvertError(f"{option} {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB") from None
    if not math.isfinite(v) or v * mult < 1:
        raise ConvertError(f"{option} {text!r} must be a positive, finite size; write e.g. 5GB, 500MB or 2GiB")
    return int(v * mult)


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy in-order split of ``(name, nbytes)`` into shards of at most ``max_shard_bytes``
    (a tensor larger than the limit gets a shard of its own), as transformers' ``save_pretrained``."""
    shards: list[list[str]] = [[]]
    cur = 0
    for name, nb in sizes:
        if shards[-1] and cur + nb > max_shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(name)
        cur += nb
    return shards


def _umask() -> int:
    """The process umask, read without changing it where possible (``os.umask`` sets it, for every thread)."""
    try:  # Linux
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file here: ``0o666`` minus the process umask.

    ``safetensors`` and ``tempfile.mkstemp`` create their files ``0o600``; the writers chmod them to this so every
    file of an export or a run has the same mode as the ``config.json`` beside it.
    """
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """The mode ``os.mkdir(path)`` gives a new folder here: ``0o777`` minus the process umask (``tempfile.mkdtemp``
    makes ``0o700`` folders: one renamed into place would shut other users out of a shared run or cache)."""
    return 0o777 & ~_umask()


def atomic_write(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a hidden temporary file beside it and ``os.replace``: a kill or a full disk
    during the write leaves the earlier file (or none), never one cut short. The file gets
    :func:`default_file_mode` (``mkstemp``'s ``0o600`` would shut other users of a shared run or cache out)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_safetensors_shards(folder: Path, tensors: Iterable[tuple[str, np.ndarray]],
                             plan: list[list[str]]) -> list[Path]:
    """Write ``tensors`` (consumed lazily, in ``plan`` order) into ``folder`` following ``plan``.

    One shard: ``model.safetensors``. Several: ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``; transformers
    requires both, export.md §6). Each shard carries ``metadata={"format": "pt"}``. Only one shard's
    tensors are held in memory at a time.

    Raises:
        ValueError: the tensors do not arrive in ``plan`` order.
    """
    from safetensors.numpy import save_file

    n = len(plan)
    mode = default_file_mode()
    it = iter(tensors)
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(plan):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        shard: dict[str, np.ndarray] = {}
        for expected in names:
            name, arr = next(it)
            if name != expected:
                raise ValueError(f"tensor {name!r} arrived where the shard plan expects {expected!r}")
            shard[name] = arr
            weight_map[name] = fname
            total += arr.nbytes
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        os.chmod(folder / fname, mode)
        written.append(folder / fname)
        del shard
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(folder / "model.safetensors.index.json")
    return written
