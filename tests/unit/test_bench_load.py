"""`chorus bench load` end to end (short): a real server process, mixed clients, nothing left open."""

from __future__ import annotations

import subprocess
import sys


def test_load_bench_runs_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "chorus", "bench", "load", "--seconds", "4", "--clients", "6"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "| ok |" in out and "| ok (stream) |" in out and "disconnected mid-stream" in out
    assert "invalid: 400 invalid_json" in out or "invalid: 400 invalid_value" in out
    assert "transport error" not in out and "failed stream" not in out and "error: 5" not in out
    assert out.rstrip().endswith("sessions open after the run: 0")
