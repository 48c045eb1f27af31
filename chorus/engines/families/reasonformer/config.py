"""ReasonFormer's settings: layer ranges, skills, module kind, LoRA ranks, routing and the stop gate."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from chorus.engines.families.spans import TARGETS, check_spans, check_targets, split_options
from chorus.errors import BuildError

WEIGHTS = "reasonformer.safetensors"
MODEL_TYPE = "chorus_reasonformer"
SKILLS = ("math", "science", "commonsense", "general")


@dataclass
class ReasonFormerConfig:
    representation: tuple[int, int]  # base layer ranges, half-open
    block: tuple[int, int]  # the reasoning block: run once per reasoning step, once per chosen skill
    coda: tuple[int, int]
    skills: tuple[str, ...] = SKILLS
    #: shared: one LoRA per skill over all steps plus a step adapter (a LoRA of ``adapter_rank``) per
    #: (skill, step); private: one LoRA per (skill, step), no adapter
    kind: Literal["shared", "private"] = "shared"
    rank: int = 8
    adapter_rank: int = 4
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    top_k: int | None = 2  # skills run per step (None: all)
    max_steps: int = 3
    stop_threshold: float = 0.5  # a step whose gate is below it ends the cascade (inference)
    router_dim: int = 64  # the router's small transformer layer
    router_heads: int = 4
    base: str = ""  # the base checkpoint directory

    @classmethod
    def retrofit(cls, n_layers: int, **kw: Any) -> ReasonFormerConfig:
        """Default ranges: the first two fifths representation, the next fifth the reasoning block, the rest coda."""
        a = max(1, 2 * n_layers // 5)
        b = max(a + 1, 3 * n_layers // 5)
        return cls(representation=(0, a), block=(a, b), coda=(b, n_layers), **kw)

    @classmethod
    def from_options(cls, n_layers: int, options: dict[str, Any]) -> ReasonFormerConfig:
        """Settings as a config's ``derive.options`` or the CLI give them: the three ranges together, or none."""
        ranges, opts = split_options(options, ("representation", "block", "coda"), "ReasonFormer",
                                     cls.__dataclass_fields__)
        for k in ("skills", "targets"):
            if k in opts:
                opts[k] = tuple(opts[k])
        return cls(**ranges, **opts) if ranges else cls.retrofit(n_layers, **opts)  # type: ignore[arg-type]

    @property
    def n_skills(self) -> int:
        return len(self.skills)

    @property
    def k(self) -> int:
        """Skills run per step."""
        return self.n_skills if self.top_k is None else self.top_k

    def check(self, n_layers: int) -> None:
        check_spans({"representation": self.representation, "block": self.block, "coda": self.coda}, n_layers)
        if not self.skills or len(set(self.skills)) != len(self.skills) or not all(
                isinstance(s, str) and s for s in self.skills):
            raise BuildError(f"skills must be distinct non-empty names (got {list(self.skills)})")
        if self.kind not in ("shared", "private"):
            raise BuildError(f"kind must be shared or private (got {self.kind!r})")
        if self.rank < 1 or (self.kind == "shared" and self.adapter_rank < 1):
            raise BuildError(f"LoRA ranks must be >= 1 (got rank {self.rank}, adapter_rank {self.adapter_rank})")
        check_targets(self.targets)
        if self.top_k is not None and not 1 <= self.top_k <= self.n_skills:
            raise BuildError(
                f"top_k must be between 1 and the {self.n_skills} skills (or null for all; got {self.top_k})"
            )
        if self.max_steps < 1:
            raise BuildError(f"max_steps must be >= 1 (got {self.max_steps})")
        if not 0.0 <= self.stop_threshold <= 1.0:
            raise BuildError(f"stop_threshold must be in [0, 1] (got {self.stop_threshold})")
        if self.router_dim < 1 or self.router_heads < 1 or self.router_dim % self.router_heads:
            raise BuildError(f"router_dim ({self.router_dim}) must be a positive multiple of router_heads "
                             f"({self.router_heads})")

    @property
    def contiguous(self) -> bool:
        return self.representation[0] == 0 and self.representation[1] == self.block[0] and self.block[1] == self.coda[0]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("representation", "block", "coda", "skills", "targets"):
            d[k] = list(getattr(self, k))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReasonFormerConfig:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("representation", "block", "coda", "skills", "targets"):
            if k in kw:
                kw[k] = tuple(kw[k])
        return cls(**kw)
