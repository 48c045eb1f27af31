"""How a caller (request body) or the config names an ensemble: strategy, members, options, params.

``{"strategy": "crowd_vote", "members": ["a", {"model": "a", "seed": 7}], "trace": true, "metric": ...}``:
the fields below are common to every strategy; any other field is a strategy parameter, validated by
the strategy's own ``Params`` model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chorus.engines.core.base import SEED_MAX, SEED_MIN
from chorus.errors import InvalidRequest


class MemberSpec(BaseModel):
    """One member: a served model, optionally with its own persona, temperature or seed."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    name: str | None = Field(default=None, description="label in the trace (default: the model, numbered)")
    system: str | None = Field(default=None, description="persona: replaces the request's system message")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)


class EnsembleSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    strategy: str = Field(min_length=1)
    members: list[MemberSpec] = Field(default_factory=list)
    trace: bool = False
    on_member_error: Literal["fail", "skip"] | None = Field(
        default=None, description="default: skip for text-level strategies, fail for token-level ones")
    #: the bounds of one request (docs/ensembles.md, "Bounds"): once past the deadline or the token budget, a
    #: strategy starts no new round, sample batch, cascade step or judge and answers with what it has
    deadline_s: float | None = Field(default=30.0, gt=0, le=3600, description=(
        "seconds after which no new member work starts (null: none)"))
    max_total_tokens: int | None = Field(default=4096, ge=1, description=(
        "completion tokens of all member calls together after which no new member work starts (null: none)"))
    call_max_tokens: int = Field(default=256, ge=1, description=(
        "a member call's max_tokens when the request gives none (a request's max_tokens is the answer's length)"))

    @field_validator("members", mode="before")
    @classmethod
    def _names_to_members(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"model": m} if isinstance(m, str) else m for m in v]
        return v

    @property
    def params(self) -> dict[str, Any]:
        """The strategy's own parameters: every field not common to all strategies."""
        return dict(self.model_extra or {})

    def merged(self, override: dict[str, Any]) -> EnsembleSpec:
        """This spec with fields from a request body on top (e.g. ``trace: true`` on a named ensemble)."""
        base = self.model_dump(exclude_unset=True, exclude={"name", "description"})
        return EnsembleSpec.model_validate({**base, **override})


class NamedEnsemble(EnsembleSpec):
    """A config entry: an ensemble served under its own model name (listed in /v1/models)."""

    name: str = Field(min_length=1)
    description: str | None = None


def member_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """A strategy's ``weights`` checked (one non-negative number per member, positive sum) and normalised;
    equal weights when none are given."""
    w = list(weights) if weights is not None else [1.0] * n
    if len(w) != n or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise InvalidRequest(f"'weights' must be {n} non-negative numbers (one per member) with a positive sum; "
                             f"got {list(w)}.", param="ensemble.weights")
    return [x / sum(w) for x in w]
