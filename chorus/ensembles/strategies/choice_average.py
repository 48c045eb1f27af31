"""``choice_average``: a scoring-only ensemble; each member's distribution over a question's choices, averaged.

Members may be language models (each scores the choices with its own tokenizer, engines/core/scoring.py) or
scorer models such as a trained DUMA (engines/transformers/scorer.py), which answer with one distribution over the
choices. The average uses ``weights`` (normalised; equal by default), per normalisation: a scorer's one
distribution stands in for every normalisation. The ensemble serves ``POST /v1/choices`` only; chat and
completions with it are a 400 (it has nothing to generate with).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from pydantic import BaseModel, ConfigDict, Field

from chorus.engines.core.base import Delta
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, with_own_sampling
from chorus.ensembles.spec import member_weights
from chorus.errors import InvalidRequest


class ChoiceAverageParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: list[float] | None = Field(default=None, description="one per member; normalised; default equal")


class ChoiceAverage(Strategy):
    requires = frozenset()  # a language model or a scorer: anything that scores choices
    Params = ChoiceAverageParams
    scores_only = True

    def check(self) -> None:
        member_weights(self.params.weights, len(self.members))
        own = with_own_sampling(self.members)
        if own:
            raise InvalidRequest("choice_average samples nothing: per-member temperature / top_p / seed do not apply "
                                 f"(members: {', '.join(own)}).", param="ensemble.members")

    def stream(self, call: Call) -> AsyncGenerator[Delta, None]:  # pragma: no cover - Ensemble.call refuses first
        raise InvalidRequest("choice_average scores choices only (POST /v1/choices).", param="model")
