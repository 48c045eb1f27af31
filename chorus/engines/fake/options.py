"""The options of ``engine: fake``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FakeOptions(BaseModel):
    """``fake: {script: ..., delay: ...}`` (engines/fake/engine.py)."""

    model_config = ConfigDict(extra="forbid")

    script: str | None = Field(default=None, description="the text it writes; default: letters in turn")
    delay: float = Field(default=0.0, ge=0, description="seconds per step")
    max_model_len: int = Field(default=256, ge=1)
    sharpness: float = Field(default=10.0, gt=0, description="how peaked its logits are on the scripted token")
    fail_after: int | None = Field(default=None, ge=0, description="steps before every session fails (tests)")
