"""The options of ``engine: transformers`` (``transformers: {modr: {...}}`` in a model's entry)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ModrServing(BaseModel):
    """Serving settings of a MoDr checkpoint that override its own (engines/families/modr)."""

    model_config = ConfigDict(extra="forbid")

    recurrence: int | None = Field(default=None, ge=1, description="core-block passes per token")
    max_recurrence: int | None = Field(default=None, ge=1)
    kv_share: int | None = Field(default=None, ge=1, description="KV slots kept per layer (step t -> slot t mod N)")


class TransformersOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modr: ModrServing = Field(default_factory=ModrServing)
