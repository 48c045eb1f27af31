"""MoDr's settings: layer ranges, branches, LoRA rank, recurrence and KV sharing (one dataclass)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from chorus.engines.families.spans import TARGETS, check_spans, check_targets, split_options
from chorus.errors import BuildError

WEIGHTS = "modr.safetensors"


@dataclass
class MoDrConfig:
    prelude: tuple[int, int]  # base layer ranges, half-open
    core: tuple[int, int]
    coda: tuple[int, int]
    branches: int = 4
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    recurrence: int = 4  # served when a request does not say
    max_recurrence: int = 64
    state_init: Literal["embed", "random"] = "embed"
    state_sigma: float = 1.0
    kv_share: int | None = None
    router_eta: float = 0.001
    base: str = ""  # the base checkpoint directory

    @classmethod
    def tiny(cls, n_layers: int = 4) -> MoDrConfig:
        return cls(prelude=(0, 1), core=(1, n_layers - 1), coda=(n_layers - 1, n_layers), branches=4, rank=4,
                   alpha=4.0, recurrence=2, max_recurrence=8)

    @classmethod
    def retrofit(cls, n_layers: int, **kw: Any) -> MoDrConfig:
        """Default ranges: a fifth of the layers prelude, a fifth coda, the middle the core."""
        p = max(1, n_layers // 5)
        return cls(prelude=(0, p), core=(p, n_layers - p), coda=(n_layers - p, n_layers), **kw)

    @classmethod
    def from_options(cls, n_layers: int, options: dict[str, Any]) -> MoDrConfig:
        """Settings as a config's ``derive.options`` or the CLI give them: the three layer ranges together,
        or none (then the default split of `retrofit`)."""
        ranges, opts = split_options(options, ("prelude", "core", "coda"), "MoDr", cls.__dataclass_fields__)
        return cls(**ranges, **opts) if ranges else cls.retrofit(n_layers, **opts)  # type: ignore[arg-type]

    def check(self, n_layers: int) -> None:
        check_spans({"prelude": self.prelude, "core": self.core, "coda": self.coda}, n_layers)
        if self.branches < 1:
            raise BuildError(f"branches must be >= 1 (got {self.branches})")
        if self.rank < 1:
            raise BuildError(f"LoRA rank must be >= 1 (got {self.rank})")
        check_targets(self.targets)
        if not 1 <= self.recurrence <= self.max_recurrence:
            raise BuildError(
                f"recurrence must be between 1 and max_recurrence={self.max_recurrence} (got {self.recurrence})"
            )
        if self.kv_share is not None and self.kv_share < 1:
            raise BuildError(f"kv_share must be >= 1 (got {self.kv_share})")

    @property
    def contiguous(self) -> bool:
        return self.prelude[0] == 0 and self.prelude[1] == self.core[0] and self.core[1] == self.coda[0]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(prelude=list(self.prelude), core=list(self.core), coda=list(self.coda), targets=list(self.targets))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MoDrConfig:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        for k in ("prelude", "core", "coda", "targets"):
            if k in kw:
                kw[k] = tuple(kw[k])
        return cls(**kw)
