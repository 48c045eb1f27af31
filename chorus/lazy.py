"""The one loader of lazily imported ``"module:name"`` targets, which every registry holds (engine kinds, strategies,
routers, logit-average modes, the CLI's commands): nothing is imported until a name is looked up, so importing a
registry never imports torch, vLLM or CUDA code."""

from __future__ import annotations

import importlib
from typing import Any


def load(target: str) -> Any:
    """``"module:name"`` -> the object (its module is imported now, not before)."""
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{target!r} is no 'module:name' target")
    return getattr(importlib.import_module(module), name)
