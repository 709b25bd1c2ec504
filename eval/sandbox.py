"""Sandboxed execution of untrusted Python programs (HumanEval / MBPP completions).

This module is a security boundary. Every program runs in its own process tree that

* sits in new mount, network, PID, IPC and UTS namespaces: the network namespace has only a
  loopback device that is down (no connection to anything, 127.0.0.1 included); every mount is
  re-bound read-only except a private temporary directory, which is the program's cwd, HOME and
  TMPDIR, a tmpfs of ``disk_mb`` (all its files together; the file-size limit caps each);
  ``/proc`` is a fresh one for the PID namespace;
* runs as a private unprivileged uid (``UID_BASE + pid of its launcher``, no supplementary
  groups, gid ``nogroup``), so the process-count limit holds (root ignores ``RLIMIT_NPROC``) and
  it cannot signal or read anything of the harness;
* has ``setrlimit`` limits on CPU time, address space, file size, open files, process count and
  core dumps;
* is killed on a wall-clock timeout: the whole process group is SIGKILLed, the PID namespace dies
  with its init, and a final sweep kills anything still running under the private uid.

Setup happens in a fresh helper process (``python -I -S -c _BOOT``), never with ``preexec_fn`` in
the (multi-threaded) harness. When the machine cannot provide this isolation (not Linux, not
root, no namespaces), :func:`check_isolation` raises :class:`SandboxUnavailable` with a one-line
reason and nothing is executed.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

#: private uids are ``UID_BASE + launcher pid`` (pids are < 2**22): far above any real account.
UID_BASE = 3_000_000_000


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate untrusted code; the message is one line."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  #: wall clock for the whole program
    cpu_s: int | None = None  #: RLIMIT_CPU per process (default: ceil(timeout) + 1)
    memory_mb: int = 1024  #: RLIMIT_AS per process
    file_size_mb: int = 16  #: RLIMIT_FSIZE (also caps captured stdout/stderr)
    #: RLIMIT_NPROC for the private uid (processes + threads); with ``memory_mb`` it bounds one
    #: program's memory to about ``nproc * memory_mb``
    nproc: int = 4
    nofile: int = 64  #: RLIMIT_NOFILE
    max_output_chars: int = 20_000  #: stdout/stderr kept in the result
    #: the private directory (cwd, HOME, TMPDIR) is a tmpfs of this size: all the program's files together
    disk_mb: int = 64

    def __post_init__(self) -> None:
        """Raises ValueError (one line) for a timeout or CPU limit that is not a finite number > 0, or a ``disk_mb``
        below 1."""
        for name in ("timeout_s", "cpu_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SandboxLimits.{name}={v} must be a finite number of seconds > 0")
        if not (isinstance(self.disk_mb, int) and self.disk_mb >= 1):
            raise ValueError(f"SandboxLimits.disk_mb={self.disk_mb} must be an integer >= 1 (MiB)")


@dataclass
class ExecResult:
    status: str  #: "passed" | "failed" | "timeout"
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    uid: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


# The launcher: runs as root in a fresh single-threaded interpreter in its own session.
# argv[1] = JSON config. It unshares the namespaces, forks the namespace init, which sets up
# mounts, limits and the uid and execs the program; the launcher waits and exits with its status.
_BOOT = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]  # setup errors go here; closed before the program starts
def fail(msg):
    os.write(status_fd, (msg + "\n").encode()); os._exit(121)
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
# If the harness dies, the launcher dies (and with it, below, the namespace init and everything in it).
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
if os.getppid() != cfg["harness_pid"]:
    os._exit(121)
uid = cfg["uid_base"] + os.getpid(); gid = cfg["gid"]; work = cfg["workdir"]
try:
    os.chown(work, uid, gid); os.chmod(work, 0o700)
    for name in os.listdir(work):
        os.chown(os.path.join(work, name), uid, gid)
except OSError as e:
    fail("chown of the work directory: %s" % e)
flags = os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWPID | os.CLONE_NEWIPC | os.CLONE_NEWUTS
try:
    os.unshare(flags)
except OSError as e:
    fail("unshare(mount, net, pid, ipc, uts namespaces): %s" % e)
# SIGTERM from the harness (wall-clock timeout): SIGKILL the namespace init, which takes every
# process of the namespace with it, then reap it here, so nothing is left to the machine's init.
child = [None, False]
def on_term(*_):
    child[1] = True
    if child[0]:
        try:
            os.kill(child[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, on_term)
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
if pid:
    child[0] = pid
    if child[1]:
        on_term()
    while True:
        try:
            _, st = os.waitpid(pid, 0); break
        except InterruptedError:
            continue
    os._exit(os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st))
# --- namespace init (pid 1) ---
lim0 = cfg["limits"]
try:
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
    MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
    def mount(src, tgt, fstype, fl, data=None):
        if libc.mount(src and src.encode(), tgt.encode(), fstype and fstype.encode(), fl, data and data.encode()) != 0:
            e = ctypes.get_errno(); raise OSError(e, os.strerror(e), tgt)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # The interpreter may live under a directory others cannot enter (e.g. /root/.pyenv): show the
    # private uid that prefix alone, on a small tmpfs over the first closed ancestor.
    prefix = cfg["prefix"]; cur = "/"
    for part in prefix.strip("/").split("/"):
        if not os.stat(cur).st_mode & 0o001:
            stage = os.path.join(cfg["root"], "py"); os.mkdir(stage, 0o755)
            mount(prefix, stage, None, MS_BIND | MS_REC)
            mount("tmpfs", cur, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
            os.makedirs(prefix, 0o755, exist_ok=True)
            mount(stage, prefix, None, MS_BIND | MS_REC)
            break
        cur = os.path.join(cur, part)
    # the private directory: a size-capped tmpfs (files under the file-size limit could otherwise fill the disk),
    # holding the program, owned by the private uid
    with open(cfg["program"], "rb") as f:
        source = f.read()
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dk,nr_inodes=%d,mode=700,uid=%d,gid=%d" % (lim0["disk"] << 10, 8192, uid, gid))
    with open(cfg["program"], "wb") as f:
        f.write(source)
    os.chown(cfg["program"], uid, gid)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            p = line.split()[4]
            for a, b in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                p = p.replace(a, b)
            points.append(p)
    # Bind-remounts change only this namespace's view of a mount, never the filesystem itself.
    for p in points:
        if p in (work, "/proc") or p.startswith("/proc/"):
            continue
        try:
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        except OSError as e:
            if p == "/":
                raise
    probe = os.path.join("/", ".sandbox-probe-%d" % os.getpid())
    try:
        open(probe, "w").close(); os.unlink(probe); fail("/ is still writable after the read-only remount")
    except OSError:
        pass
except OSError as e:
    fail("read-only mounts: %s" % e)
lim = cfg["limits"]
try:
    for res, v in ((resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1)),
                   (resource.RLIMIT_AS, (lim["as"], lim["as"])),
                   (resource.RLIMIT_FSIZE, (lim["fsize"], lim["fsize"])),
                   (resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"])),
                   (resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"])),
                   (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, v)
    os.setgroups([]); os.setgid(gid); os.setuid(uid)
except OSError as e:
    fail("limits / dropping privileges: %s" % e)
try:
    os.setuid(0)
    fail("could regain root after dropping privileges")
except PermissionError:
    pass
if os.getuid() != uid or os.geteuid() != uid or os.getgroups():
    fail("uid/groups not dropped")
# (changing the uid cleared it) the namespace init dies with the launcher
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
os.chdir(work); os.umask(0o077)
os.close(status_fd)
env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
       "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
os.execve(cfg["python"], [cfg["python"], "-I", "-B", cfg["program"]], env)
"""


def _nogroup_gid() -> int:
    import grp

    for name in ("nogroup", "nobody"):
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            pass
    return 65534


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(d))
                        break
        except OSError:
            continue
    return out


def _sweep_uid(uid: int, python: str) -> int:
    """Kill every process of the private ``uid``; returns how many were still there."""
    left = _pids_of_uid(uid)
    if not left:
        return 0
    for _ in range(5):
        # kill(-1) from a process running as ``uid`` reaches exactly that uid's processes.
        subprocess.run(
            [python, "-I", "-S", "-c",
             "import os,signal,sys; os.setgroups([]); os.setgid(int(sys.argv[2])); "
             "os.setuid(int(sys.argv[1])); os.kill(-1, signal.SIGKILL)",
             str(uid), str(_nogroup_gid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )
        time.sleep(0.05)
        if not _pids_of_uid(uid):
            break
    return len(left)


def _read_head(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit * 4 + 4)
    except OSError:
        return ""
    return data.decode("utf-8", "replace")[:limit]


def _python() -> str:
    return os.path.realpath(sys.executable)


def _contains(path: Path, needle: bytes) -> bool:
    """Whether the file holds ``needle`` (read in 1 MiB pieces; the program's output size is limited anyway)."""
    try:
        with open(path, "rb") as f:
            tail = b""
            while piece := f.read(1 << 20):
                if needle in tail + piece:
                    return True
                tail = piece[-len(needle):]
    except OSError:
        pass
    return False


class _Batch:
    """The launchers of one :func:`run_programs` call, so that an interruption stops the programs under way instead
    of waiting for their timeouts (each launcher, sent SIGTERM, kills its namespace)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen] = set()
        self.stopping = False

    def add(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.procs.add(proc)
            if self.stopping:  # started while the batch was being stopped
                proc.send_signal(signal.SIGTERM)

    def discard(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.procs.discard(proc)

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)


def _stop_launcher(proc: subprocess.Popen) -> int:
    """SIGTERM the launcher (it kills and reaps the program's namespace), then reap it; its exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # The launcher is not yet reaped, so its process-group id cannot have been reused.
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _run(source: str, limits: SandboxLimits, python: str, check_end: bool = False,
         batch: _Batch | None = None) -> ExecResult:
    sentinel = None
    if check_end:  # a random line the program writes as its very last statement (unguessable by the program)
        sentinel = f"minicpm4-sandbox-end-{secrets.token_hex(16)}"
        source = source + f"\n\nimport os as _minicpm4_os\n_minicpm4_os.write(1, b\"\\n{sentinel}\\n\")\n"
    root = Path(tempfile.mkdtemp(prefix="minicpm4-sandbox-"))
    try:
        os.chmod(root, 0o711)
        work = root / "work"
        work.mkdir()
        prog = work / "program.py"
        prog.write_text(source, encoding="utf-8")
        out_p, err_p = root / "stdout", root / "stderr"
        cpu = int(limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s + 0.999) + 1)
        cfg = {
            "uid_base": UID_BASE, "gid": _nogroup_gid(), "workdir": str(work), "python": python,
            "root": str(root), "prefix": os.path.realpath(sys.base_prefix), "harness_pid": os.getpid(),
            "program": str(prog),
            "limits": {"cpu": max(1, cpu), "as": limits.memory_mb << 20, "fsize": limits.file_size_mb << 20,
                       "nproc": limits.nproc, "nofile": limits.nofile, "disk": limits.disk_mb},
        }
        t0 = time.monotonic()
        status_r, status_w = os.pipe()
        cfg["status_fd"] = status_w
        try:
            with open(out_p, "wb") as out_f, open(err_p, "wb") as err_f:
                proc = subprocess.Popen(
                    [python, "-I", "-S", "-c", _BOOT, json.dumps(cfg)],
                    stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, start_new_session=True,
                    close_fds=True, pass_fds=(status_w,), cwd=str(root),
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                )
        finally:
            os.close(status_w)
        uid = UID_BASE + proc.pid
        timed_out = False
        if batch is not None:
            batch.add(proc)
        try:
            rc = proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = _stop_launcher(proc)
        except BaseException:
            # Ctrl-C / SIGTERM while waiting (run_program, or the probe of run_programs): the program ran on with
            # no timeout until this process exited (an infinite loop kept a core busy after the interruption)
            _stop_launcher(proc)
            raise
        finally:
            if batch is not None:
                batch.discard(proc)
        wall = time.monotonic() - t0
        stray = _sweep_uid(uid, python)
        # Setup errors were written before the launcher exited; read without blocking (a stray
        # forked copy of the write end elsewhere must not hang the harness).
        os.set_blocking(status_r, False)
        try:
            setup_error = os.read(status_r, 4096).decode("utf-8", "replace").strip()
        except BlockingIOError:
            setup_error = ""
        finally:
            os.close(status_r)
        stdout = _read_head(out_p, limits.max_output_chars)
        stderr = _read_head(err_p, limits.max_output_chars)
        if setup_error:
            raise SandboxUnavailable(f"cannot isolate code execution: {' '.join(setup_error.split())}")
        status = "timeout" if timed_out else ("passed" if rc == 0 else "failed")
        extra = {"stray_processes_killed": stray} if stray else {}
        if sentinel is not None:
            ended = _contains(out_p, sentinel.encode())  # (text the program buffered may follow it)
            stdout = stdout.replace(f"\n{sentinel}\n", "").replace(sentinel, "")
            if status == "passed" and not ended:  # exit status 0 before the program's end (sys.exit(0), os._exit)
                status = "failed"
                extra["reason"] = "exited before the end of the program"
        return ExecResult(status, None if timed_out else rc, stdout, stderr, round(wall, 3), uid, extra)
    finally:
        shutil.rmtree(root, ignore_errors=True)


_PROBE = r"""
import os, socket, sys
res = {"uid": os.getuid(), "groups": os.getgroups()}
try:
    s = socket.create_connection(("127.0.0.1", 9), timeout=1); s.close(); res["net"] = "connected"
except OSError as e:
    res["net"] = type(e).__name__
try:
    open("/.probe", "w"); res["rootfs"] = "writable"
except OSError:
    res["rootfs"] = "read-only"
print(repr(res))
"""


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> str | None:
    """``None`` when isolation works, else the one-line reason."""
    if not sys.platform.startswith("linux"):
        return f"code execution is sandboxed only on Linux (this is {sys.platform})"
    if not hasattr(os, "unshare"):
        return "os.unshare is missing (Python >= 3.12 on Linux is needed)"
    if os.geteuid() != 0:
        return ("the sandbox needs root to enter namespaces and drop to a private uid "
                "(without it RLIMIT_NPROC/network isolation cannot be enforced); run the harness as root "
                "in a container or VM")
    try:
        r = _run(_PROBE, SandboxLimits(timeout_s=20.0), python)
    except SandboxUnavailable as e:
        return str(e)
    if r.status != "passed":
        return f"cannot isolate code execution: the probe program failed ({r.status}: {r.stderr.strip()[-200:]!r})"
    import ast

    try:
        got = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    except (ValueError, SyntaxError, IndexError):
        return f"cannot isolate code execution: unreadable probe output {r.stdout[-200:]!r}"
    if got["uid"] < UID_BASE or got["groups"]:
        return "cannot isolate code execution: the program did not run as the private uid"
    if got["net"] == "connected":
        return "cannot isolate code execution: the program could reach the network"
    if got["rootfs"] != "read-only":
        return "cannot isolate code execution: the root filesystem stayed writable"
    return None


def check_isolation(python: str | None = None) -> None:
    """Raise :class:`SandboxUnavailable` (one line) unless programs can be isolated here."""
    reason = _probe(python or _python())
    if reason is not None:
        raise SandboxUnavailable(reason)


def run_program(source: str, limits: SandboxLimits | None = None, *, python: str | None = None,
                check_end: bool = False) -> ExecResult:
    """Run one Python program in the sandbox and report how it ended.

    Exit status 0 within the limits is ``"passed"``; any exception, signal, limit or non-zero
    exit is ``"failed"``; the wall-clock limit gives ``"timeout"``. ``check_end``: ``"passed"`` also needs the
    program to have run to its last line (a random line appended to it must reach stdout), so a program that
    stops early with exit status 0 (``sys.exit(0)``, ``os._exit(0)``) fails, as in the upstream HumanEval
    harness; the line is removed from the reported stdout. An interruption while it waits (Ctrl-C, a SIGTERM
    handler's exception) kills the program before it propagates.
    """
    python = python or _python()
    check_isolation(python)
    return _run(source, limits or SandboxLimits(), python, check_end)


def run_programs(
    sources: Sequence[str], limits: SandboxLimits | None = None, *, workers: int = 4, python: str | None = None,
    progress: bool = False, check_end: bool = False,
) -> list[ExecResult]:
    """:func:`run_program` over many programs, ``workers`` at a time; results in input order."""
    python = python or _python()
    check_isolation(python)
    limits = limits or SandboxLimits()
    if not sources:
        return []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), desc="execute", unit="prog", leave=False)

    batch = _Batch()

    def one(src: str) -> ExecResult:
        r = _run(src, limits, python, check_end, batch)
        if bar is not None:
            bar.update(1)
        return r

    ex = ThreadPoolExecutor(max_workers=max(1, min(workers, len(sources))))
    try:
        return list(ex.map(one, sources))
    except BaseException:  # Ctrl-C / SIGTERM: queued programs never start, running ones are killed now
        ex.shutdown(wait=False, cancel_futures=True)
        batch.stop()
        raise
    finally:
        ex.shutdown(wait=True)  # the workers clean their temporary folders up before the error goes on
        if bar is not None:
            bar.close()
