"""Sandbox for model-written code: each attack is contained, scored as a failure, and leaves
nothing behind (no stray processes, no files outside the private directory, no connection)."""

import contextlib
import os
import signal
import socket
import time
import uuid

import pytest

from minicpm4_jax.eval import sandbox as sb


def _isolated_or_skip():
    try:
        sb.check_isolation()
    except sb.SandboxUnavailable as e:
        pytest.skip(f"no isolation on this machine: {e}")


def _children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


SMALL = sb.SandboxLimits(timeout_s=3.0, memory_mb=512, file_size_mb=4, nproc=8)


def test_refuses_with_one_line_error_when_it_cannot_isolate(monkeypatch):
    sb._probe.cache_clear()
    monkeypatch.setattr(sb.os, "geteuid", lambda: 1000)
    try:
        with pytest.raises(sb.SandboxUnavailable) as ei:
            sb.run_program("print(1)")
        msg = str(ei.value)
        assert "\n" not in msg and "root" in msg
        with pytest.raises(sb.SandboxUnavailable):
            sb.run_programs(["print(1)"])
    finally:
        monkeypatch.undo()
        sb._probe.cache_clear()


@pytest.mark.parametrize("field", ["timeout_s", "cpu_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1.0])
def test_limits_refuse_a_timeout_that_is_not_finite_and_positive(field, value):
    # nan / inf raised ValueError / OverflowError inside _run (int(timeout)), after a benchmark's generation
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}={value} must be a finite number"):
        sb.SandboxLimits(**{field: value})


def test_pass_fail_and_identity():
    _isolated_or_skip()
    ok = sb.run_program("import os\nprint(os.getuid(), os.getgroups(), os.getcwd())\n", SMALL)
    assert ok.passed and ok.returncode == 0
    uid, _, rest = ok.stdout.partition(" ")
    assert int(uid) >= sb.UID_BASE and "[]" in rest and "minicpm4-sandbox-" in rest
    bad = sb.run_program("assert 1 == 2\n", SMALL)
    assert bad.status == "failed" and "AssertionError" in bad.stderr
    # results come back in order, several at a time
    rs = sb.run_programs([f"import sys\nsys.exit({i % 2})\n" for i in range(6)], SMALL, workers=3)
    assert [r.passed for r in rs] == [True, False] * 3


def test_a_program_that_exits_early_with_status_0_fails_when_the_end_is_checked():
    """Break test: a HumanEval completion calling sys.exit(0) / os._exit(0) before check() ran scored as passed."""
    _isolated_or_skip()
    early = ["import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\nassert False\n",
             "print('\u00e9')\nraise SystemExit(0)\n"]
    closed = "import os\nos.close(1)\n"  # its end cannot be reported: a failure, not a pass
    rs = sb.run_programs(early + [closed, "import sys\nsys.stdout.close()\nx = 1\n", "print('done')\n"], SMALL,
                         workers=2, check_end=True)
    assert [r.status for r in rs] == ["failed"] * 4 + ["passed"] * 2
    assert all(r.extra.get("reason") == "exited before the end of the program" for r in rs[:3])
    assert rs[-1].stdout.strip() == "done"  # the end marker is not part of the reported output
    # without check_end, exit status 0 is a pass (the runner's generic contract)
    assert all(r.passed for r in sb.run_programs(early[:3], SMALL, workers=2))


def test_infinite_loop_times_out():
    _isolated_or_skip()
    t0 = time.monotonic()
    r = sb.run_program("while True:\n    pass\n", sb.SandboxLimits(timeout_s=1.5))
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - t0 < 10
    assert sb._pids_of_uid(r.uid) == []


def test_fork_bomb_is_contained_and_leaves_no_process():
    _isolated_or_skip()
    before = set(_children_of(os.getpid()))
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = sb.run_program(bomb, sb.SandboxLimits(timeout_s=2.0, nproc=8))
    assert not r.passed
    assert sb._pids_of_uid(r.uid) == []  # nothing left under the private uid
    assert set(_children_of(os.getpid())) <= before  # no stray child of the harness
    # a child that leaves the process group and outlives its parent is killed too
    esc = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n"
    r = sb.run_program(esc, SMALL)
    assert r.passed and sb._pids_of_uid(r.uid) == []
    # the harness still works
    assert sb.run_program("print('alive')\n", SMALL).stdout.strip() == "alive"


def test_large_allocation_fails():
    _isolated_or_skip()
    r = sb.run_program("x = bytearray(8 * 1024 ** 3)\n", SMALL)
    assert r.status == "failed" and "MemoryError" in r.stderr


def test_writes_outside_the_private_directory_fail(tmp_path):
    _isolated_or_skip()
    targets = [tmp_path / "escape.txt", f"/tmp/minicpm4-escape-{uuid.uuid4().hex}", "/var/tmp/minicpm4-escape",
               "/dev/shm/minicpm4-escape", os.path.join(os.getcwd(), "minicpm4-escape")]
    for t in targets:
        r = sb.run_program(f"open({str(t)!r}, 'w').write('x')\n", SMALL)
        assert r.status == "failed", (t, r)
        assert not os.path.exists(t), t
    # inside its own directory it may write; a file-size limit caps it
    assert sb.run_program("open('ok.txt', 'w').write('x')\n", SMALL).passed
    big = sb.run_program("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)\n", SMALL)
    assert big.status == "failed"


def test_the_private_directory_holds_at_most_disk_mb(tmp_path):
    """Many files, each under the file-size limit, went to the machine's disk without bound (3 GB in the default
    10 s here: four workers could fill a disk); the private directory is now a tmpfs of ``disk_mb``."""
    _isolated_or_skip()
    prog = (
        "import errno\nn = 0\ntry:\n"
        "    for i in range(40):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(4):\n"
        "                f.write(b'x' * (1 << 20)); n += 1\n"
        "except OSError as e:\n"
        "    print('full', e.errno == errno.ENOSPC, n)\n"
        "else:\n"
        "    print('wrote', n)\n"
    )
    r = sb.run_program(prog, sb.SandboxLimits(timeout_s=10.0, memory_mb=512, file_size_mb=4, nproc=8, disk_mb=16))
    assert r.passed, r
    words = r.stdout.split()
    assert words[:2] == ["full", "True"] and int(words[2]) <= 16, r.stdout
    # the program itself still runs from there, and small writes work
    assert sb.run_program("open('ok.txt', 'w').write('x' * 1000)\nprint(open(__file__).read()[:4])\n",
                          sb.SandboxLimits(disk_mb=1)).stdout.strip() == "open"
    with pytest.raises(ValueError, match="disk_mb=0"):
        sb.SandboxLimits(disk_mb=0)


def test_no_network_even_to_localhost():
    _isolated_or_skip()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    try:
        prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')\n"
        r = sb.run_program(prog, SMALL)
        assert r.status == "failed"
        with pytest.raises(socket.timeout):
            srv.accept()  # nothing ever connected
    finally:
        srv.close()


def test_a_program_cannot_fake_a_setup_failure():
    _isolated_or_skip()
    r = sb.run_program("import sys\nsys.stderr.write('sandbox-setup: fake\\n')\nsys.exit(121)\n", SMALL)
    assert r.status == "failed" and r.returncode == 121
    # no descriptor beyond stdout/stderr is writable (the setup-status pipe is closed before the program starts)
    prog = ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'x')\n        print(fd)\n"
            "    except OSError:\n        pass\n")
    r = sb.run_program(prog, SMALL)
    assert r.passed and r.stdout == ""


@contextlib.contextmanager
def _ctrl_c_after(seconds: float):
    """``KeyboardInterrupt`` in the main thread ``seconds`` into the block, as a Ctrl-C there would be."""
    def interrupt(signum, frame):
        # An exception raised while a gc callback runs (JAX registers one) is printed and dropped, as a Ctrl-C
        # there would be: let the timer fire again instead, and stop it once the interruption is raised.
        if frame is not None and "gc_callback" in frame.f_code.co_name:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.2)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_an_interrupted_program_is_stopped_not_left_running():
    """Ctrl-C while ``run_program`` (or ``run_programs``' isolation probe) waited left the launcher and the program
    running, with no timeout any more, until the harness exited (an infinite loop kept a core busy). Now it is
    killed before the interruption goes on."""
    _isolated_or_skip()
    children = set(_children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), _ctrl_c_after(1.0):
        sb.run_program("while True:\n    pass\n", sb.SandboxLimits(timeout_s=60.0))
    assert time.monotonic() - t0 < 20, "waited for the program's 60 s timeout"
    assert set(_children_of(os.getpid())) <= children  # no launcher or program left


def test_an_interruption_stops_the_running_programs(monkeypatch):
    """Helper 67: Ctrl-C during code execution waited, silently, for every running program's timeout (the
    executor's exit joined them), and repeated Ctrl-C left temporary folders behind. Now the running programs
    are killed at once, queued ones never start, and their folders are removed before the interruption goes on."""
    import shutil
    import tempfile
    from pathlib import Path

    _isolated_or_skip()
    own = Path(tempfile.mkdtemp(prefix="minicpm4-sandbox-test-"))  # this call's folders only (other tests run too)
    own.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    children = set(_children_of(os.getpid()))  # e.g. the MATH checker's worker of an earlier test
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), _ctrl_c_after(3.0):
        sb.run_programs(["while True:\n    pass\n"] * 6, sb.SandboxLimits(timeout_s=60.0), workers=2)
    assert time.monotonic() - t0 < 20, "waited for the programs' 60 s timeout"
    left = list(own.iterdir())
    shutil.rmtree(own, ignore_errors=True)
    assert not left, left  # every program's folder removed
    assert set(_children_of(os.getpid())) <= children  # no launcher or program left
