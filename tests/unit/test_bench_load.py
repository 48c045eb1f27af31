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


def test_the_llama_bench_compares_round_by_round() -> None:
    """`chorus bench llama` reports a server against its peer as the geometric mean of each round's ratio with a
    t interval: equal ratios give a zero-width interval; one round, no interval."""
    from chorus.bench.llama import paired_ratio

    assert paired_ratio([200.0, 100.0, 50.0], [100.0, 50.0, 25.0]) == "2.00x [2.00, 2.00]"
    mean, low, high = (float(v.strip("x[],")) for v in paired_ratio([100.0, 110.0, 90.0], [105.0, 100.0, 100.0]).split())
    assert low < mean < high and abs(mean - ((100 / 105) * 1.1 * 0.9) ** (1 / 3)) < 0.01
    assert paired_ratio([90.0], [100.0]) == "0.90x"
