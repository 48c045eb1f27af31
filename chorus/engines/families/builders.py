"""The families a derived model may name (``derive: {family: ...}`` in the config): how each builds its checkpoint
from a base, as lazily imported ``"module:function"`` strings (nothing here imports torch). A builder is called as
``build(base_dir, out, options, force=True, log=log)``; an unknown option is a TypeError or a BuildError.
Adding a family: its builder and one line in `BUILDERS`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from chorus.lazy import load

BUILDERS: dict[str, str] = {
    "moe": "chorus.engines.families.moe:build_upcycle",  # sparse upcycling
    "graft": "chorus.engines.families.graft:build_graft",  # SOLAR depth up-scaling
    "modr": "chorus.engines.families.modr.checkpoint:build_retrofit",  # recurrent depth with routed LoRA branches
    "reasonformer": "chorus.engines.families.reasonformer.checkpoint:build_retrofit",  # skill-routed steps
}


def build(family: str, base_dir: Path, out: Path, options: dict[str, Any], log: Callable[[str], None]) -> None:
    load(BUILDERS[family])(base_dir, out, options, force=True, log=log)
