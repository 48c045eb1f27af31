"""How a model family plugs into the batching engine: one small interface, no attribute probing.

The batching runner calls ``before`` / ``after`` around every forward (on the forward thread) and
``match_caches`` when two sequences' caches must be joined; the engine asks ``check_options`` about
a request's family options, ``trace`` for a response's ``trace`` object and ``metrics`` for
Prometheus. `DenseObserver` is the plain model's: no options, nothing to observe. The engine picks
a model's observer (``chorus.engines.transformers_engine.observer_for``).
"""

from __future__ import annotations

from typing import Any

from chorus.engines.families.metric import Metric
from chorus.errors import InvalidRequest


class FamilyObserver:
    """The interface; every method has the dense model's behaviour."""

    def check_options(self, options: dict[str, Any], model: str) -> None:
        """A request's model-family options (``recurrence``, ``exit``) for the model named ``model``: 400
        naming the first one it does not take."""
        if options:
            name = sorted(options)[0]
            raise InvalidRequest(f"'{name}' applies to MoDr models only; {model!r} is not one.", param=name)

    def before(self, rows: list[Any]) -> None:
        """Before a forward: ``rows[b]`` is the session batch row b serves (None: padding)."""

    def after(self, rows: list[Any], lens: list[int], width: int) -> None:
        """After a forward: row b's real tokens were its first ``lens[b]`` of ``width`` positions."""

    def match_caches(self, a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
        """Two caches' layers made joinable (same number of layers); dense caches already are."""
        return a, b

    def trace(self, sessions: list[Any]) -> dict[str, Any]:
        return {}

    def metrics(self) -> list[Metric]:
        return []


class DenseObserver(FamilyObserver):
    """A plain model."""
