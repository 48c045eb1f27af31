"""The GPU check's CPU path (scripts/bench-gpu --tiny --cpu): the script that runs on a lent GPU machine
cannot rot unseen. Tiny random models; only that it runs and prints both tables is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_script_runs_on_cpu_with_tiny_shapes() -> None:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "bench-gpu"), "--tiny", "--cpu", "--tokens", "6", "--prompt",
                          "6", "--streams", "1", "3"], capture_output=True, text=True, timeout=600, check=True,
                         env={**os.environ, "PYTHON": sys.executable}).stdout
    assert "| SmolLM2-135M | 3 " in out and "| Qwen2.5-1.5B | 1 " in out
    assert "logit averaging, two SmolLM2-135M-shaped members" in out
    spec = [line for line in out.splitlines() if "speculative, k=4" in line]
    assert len(spec) == 2 and all(line.split("|")[-2].strip() == "yes" for line in spec)  # = full's output
