"""How a model family plugs into the batching engine: one small interface, no attribute probing.

The batching runner calls ``before`` / ``after`` around every forward (on the forward thread) and
``match_caches`` when two sequences' caches must be joined (``joined`` after); the engine asks
``check_options`` about a request's family options, ``trace`` for a response's ``trace`` object and
``metrics`` for Prometheus. `DenseObserver` is the plain model's: no options, nothing to observe. The engine picks
a model's observer (``chorus.engines.transformers.engine.observer_for``).
"""

from __future__ import annotations

from typing import Any

from chorus.engines.runtime.family_options import refuse_foreign
from chorus.engines.runtime.metric import Metric


class FamilyObserver:
    """The interface; every method has the dense model's behaviour."""

    #: the family decides once per sequence, on its prompt (ReasonFormer): a whole-text forward scores a
    #: prompt, and a multiple-choice prefix is prefilled once with its continuations fed after it
    decides_on_prompt = False
    #: a prompt may start from another prompt's cached keys and values (the engine's prefix cache): false where
    #: the cache is not one key / value pair per layer and token, or where what the family decides on the whole
    #: prompt would be skipped
    reuses_prefixes = True

    def check_options(self, options: dict[str, Any], model: str) -> None:
        """A request's model-family options (MoDr's ``recurrence``, ``exit``; ReasonFormer's ``max_steps``,
        ``stop_threshold``) for the model named ``model``: 400 naming the first one it does not take."""
        refuse_foreign(options, (), model)

    def before(self, rows: list[Any]) -> None:
        """Before a forward: ``rows[b]`` is the session batch row b serves (None: padding)."""

    def after(self, rows: list[Any], lens: list[int], width: int) -> None:
        """After a forward: row b's real tokens were its first ``lens[b]`` of ``width`` positions."""

    def joined(self, sessions: list[Any]) -> None:
        """A prefill's sessions (the n choices of one prompt) joined the batch; the first stood for all
        in the prefill forwards (``before`` / ``after``)."""

    def match_caches(self, a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
        """Two caches' layers made joinable (same number of layers); dense caches already are."""
        return a, b

    def trace(self, sessions: list[Any]) -> dict[str, Any]:
        return {}

    def metrics(self) -> list[Metric]:
        return []


class DenseObserver(FamilyObserver):
    """A plain model."""
