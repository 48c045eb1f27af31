"""chorus serve's glibc allocator settings: applied where the environment does not set them, an operator's own
``MALLOC_*`` variable left alone (run in a child process: the settings are process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chorus.cli import allocator

pytestmark = pytest.mark.skipif(allocator.glibc() is None, reason="not glibc")

PROBE = "import json; from chorus.cli.allocator import tune; print(json.dumps(tune()))"


def tuned(**env: str) -> dict[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "CHORUS_ALLOCATOR"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_every_setting_applied_by_default() -> None:
    assert tuned() == {"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 262144, "MALLOC_TRIM_THRESHOLD_": 16777216}


def test_an_operators_variable_wins() -> None:
    assert tuned(MALLOC_ARENA_MAX="4") == {"MALLOC_MMAP_THRESHOLD_": 262144, "MALLOC_TRIM_THRESHOLD_": 16777216}


def test_chorus_allocator_default_leaves_glibc_as_it_is() -> None:
    assert tuned(CHORUS_ALLOCATOR="default") == {}
