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
    prefix_cache_mib: int = Field(default=256, ge=0, description="memory for finished prompts' keys and values "
                                  "kept for reuse (MiB); 0 turns the prefix cache off")
    prefix_cache_min_tokens: int = Field(default=32, ge=1, description="the shortest prefix worth keeping or "
                                         "reusing")
