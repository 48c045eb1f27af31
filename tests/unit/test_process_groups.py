"""Servers the tools and tests start are stopped whole: `spawn` gives each a process group, `signal_group` and
`stop_all` reach every process left in it (vLLM's API server runs its engine in child processes, which a signal
to the server alone leaves running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from chorus.clients.local import signal_group, spawn, stop_all

#: a "server" whose child ignores SIGTERM (as an engine process busy in a forward may) and writes its pid
SERVER = """
import subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", deaf])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}/status").exists() else ""
    return "State:\tZ" not in status  # an exited child not yet reaped by its (gone) parent's init counts as gone


def child_of(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    pidfile = tmp / "child.pid"
    proc = spawn([sys.executable, "-c", SERVER, str(pidfile)])
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            return proc, int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("the server never started its child")


def gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_killed_server_takes_its_children_with_it(tmp_path: Path) -> None:
    proc, child = child_of(tmp_path)
    signal_group(proc, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    assert gone(child), "the server's child outlived it"


def test_stop_all_stops_what_a_server_left_running(tmp_path: Path) -> None:
    proc, child = child_of(tmp_path)
    stop_all([proc], grace=5)
    assert proc.poll() is not None and gone(child), "a child that ignores SIGTERM outlived stop_all"


def test_a_process_not_spawned_in_a_group_is_stopped_alone(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stop_all([proc], grace=5)
    assert proc.returncode == -signal.SIGTERM
