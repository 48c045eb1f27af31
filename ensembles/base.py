"""Strategies and their registry.

A strategy combines member engines for one request. Registries are plain dicts of lazily imported
``"module:Class"`` strings: importing `ensembles` imports no strategy code, registering a name twice is
an error, and an unknown name's error lists the valid ones.
"""

from __future__ import annotations

import importlib
from typing import Any

from engines.errors import InvalidRequest

STRATEGIES: dict[str, str] = {
    "logit_average": "ensembles.logit_average:LogitAverage",
}


def register(name: str, target: str) -> None:
    """Register a strategy class by ``"module:Class"`` (e.g. from the config)."""
    if name in STRATEGIES:
        raise ValueError(f"strategy {name!r} is already registered ({STRATEGIES[name]})")
    if ":" not in target:
        raise ValueError(f"strategy target must be 'module:Class', got {target!r}")
    STRATEGIES[name] = target


def strategy_class(name: str) -> Any:
    try:
        target = STRATEGIES[name]
    except KeyError:
        raise InvalidRequest(f"Unknown ensemble strategy {name!r}. Valid strategies: {', '.join(sorted(STRATEGIES))}.",
                             param="ensemble.strategy") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
