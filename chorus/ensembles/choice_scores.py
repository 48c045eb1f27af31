"""What a multiple-choice question is, and how answers combine (``/v1/choices``, engines/core/scoring.py).

A single model's answer is its `ChoiceScores` made into probabilities, one softmax over the choices per
normalisation. An ensemble's members may tokenize differently, so in general their answers combine
where they agree on the unit: the choices. ``probabilities`` averages the members' distributions over
the choices with normalised weights, per normalisation. Members that share one vocabulary can also
combine per token (``tokens``: the logit_average strategy's mixture scores each choice token).
A scorer model (DUMA) answers with one distribution over the choices; ``choice_average`` ensembles
average it with language models' distributions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chorus.engines.core.base import ChoiceScorer, Engine
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.scoring import NORMALISATIONS, ChoiceScores, argmax, score_choices, softmax
from chorus.errors import InvalidRequest

COMBINES = ("probabilities", "tokens")


@dataclass
class ChoiceQuestion:
    """A prompt (text, or chat messages) and the choices to score after it."""

    choices: list[str]
    normalisations: list[str] = field(default_factory=lambda: list(NORMALISATIONS))
    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        unknown = [n for n in self.normalisations if n not in NORMALISATIONS]
        if unknown or not self.normalisations:
            raise InvalidRequest(f"Unknown normalisation(s) {unknown or '(none given)'}; valid: "
                                 f"{', '.join(NORMALISATIONS)}.", param="normalisations")

    async def score(self, engine: Engine, messages: list[dict[str, Any]] | None = None,
                    scope: RequestScope | None = None) -> ChoiceScores:
        """The choices scored by one engine (``messages``: this member's own version of the chat prompt)."""
        msgs = messages if messages is not None else self.messages
        return await score_choices(engine, self.choices, text=self.text, messages=msgs,
                                   unconditional="unconditional" in self.normalisations, scope=scope)

    async def answer(self, engine: Engine, messages: list[dict[str, Any]] | None = None,
                     scope: RequestScope | None = None) -> tuple[ChoiceAnswer, int]:
        """One engine's answer and the tokens it read: a language model's scores made into probabilities per
        normalisation, or a scorer's (engines/transformers/scorer.py) one distribution, reported under every normalisation
        asked for (it has no token logprobs to normalise)."""
        if not isinstance(engine, ChoiceScorer):
            scores = await self.score(engine, messages, scope)
            return ChoiceAnswer.of(scores, self.normalisations), scores.tokens_scored
        if self.text is None:
            raise InvalidRequest(f"The scorer '{engine.name}' reads a text 'prompt' (passage and question), not chat "
                                 "'messages'.", param="messages")
        logits, tokens = await engine.score_options(self.text, self.choices)
        probs = softmax(logits)
        top = max(logits)
        log_z = top + math.log(sum(math.exp(x - top) for x in logits))
        return ChoiceAnswer({n: probs for n in self.normalisations}, [x - log_z for x in logits]), tokens


@dataclass
class ChoiceAnswer:
    """Per normalisation, a probability per choice; with the summed logprobs and token counts where one
    tokenization underlies them (a single model, a token-level ensemble)."""

    probabilities: dict[str, list[float]]
    logprobs: list[float] | None = None
    tokens: list[int] | None = None
    per_token: list[list[float]] | None = None
    unconditional: list[float] | None = None
    trace: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, scores: ChoiceScores, normalisations: Sequence[str]) -> ChoiceAnswer:
        return cls(scores.probabilities(normalisations), scores.logprobs, scores.tokens, scores.per_token,
                   scores.unconditional)

    @property
    def chosen(self) -> dict[str, int]:
        return {n: argmax(p) for n, p in self.probabilities.items()}


def average(answers: Sequence[ChoiceAnswer], weights: Sequence[float]) -> dict[str, list[float]]:
    """The weighted average of the members' distributions over the choices, per normalisation."""
    total = sum(weights)
    out: dict[str, list[float]] = {}
    for n in answers[0].probabilities:
        per_member = [a.probabilities[n] for a in answers]
        out[n] = [sum(w * p[i] for w, p in zip(weights, per_member)) / total for i in range(len(per_member[0]))]
    return out
