"""``logit_average``'s parameters: how members are aligned (one vocabulary, or the union of their top-k token
strings) and mixed (space, weights, mode and its options), each checked against the others."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chorus.ensembles.logit_average.registry import ALIGNS, MODES, align_class, option_modes


class LogitAverageParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: list[float] | None = Field(default=None, description="one per member; normalised; default equal")
    space: Literal["probability", "logit"] = "probability"
    align: str = Field(default="vocab", description="vocab: members share one vocabulary; topk_union: UniTE "
                       "over token strings (registry.py: ALIGNS)")
    top_k: int = Field(default=10, ge=1, le=100, description="topk_union: tokens each member proposes per step")
    mode: str = Field(
        default="full", description="full: every member every token; selective: the lead decodes, the others "
        "are consulted where it is unsure; speculative: the lead drafts k tokens, the others verify them "
        "(registry.py: MODES)")
    lead: int | str | None = Field(default=None, description="selective / speculative: the member that decodes "
                                   "(its label or index); default the first")
    gate_by: Literal["top1", "entropy"] | None = Field(
        default=None, description="selective: consult when the lead's top-1 probability is below the gate "
        "(top1, the default) or its entropy in nats above it (entropy)")
    gate: float | None = Field(default=None, gt=0.0, description="selective: the threshold (default 0.5 for "
                               "top1, 1.0 for entropy)")
    k: int | None = Field(default=None, ge=1, le=16, description="speculative: tokens drafted per round (default 4)")
    mixture_temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="divides the combined "
                                       "log-probabilities where members are combined (< 1 sharpens)")

    @model_validator(mode="after")
    def _parts(self) -> LogitAverageParams:
        for name, table in (("align", ALIGNS), ("mode", MODES)):
            if getattr(self, name) not in table:
                raise ValueError(f"'{name}' must be one of {', '.join(table)}, not {getattr(self, name)!r}")
        for name, modes in option_modes().items():
            if getattr(self, name) is not None and self.mode not in modes:
                raise ValueError(f"'{name}' applies to mode {' or '.join(modes)}, not {self.mode!r}")
        if self.gate_by != "entropy" and self.gate is not None and self.gate > 1:
            raise ValueError("a top1 gate is a probability: at most 1")
        align_class(self.align).check_params(self)
        return self
