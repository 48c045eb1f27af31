"""What an engine kind says about itself: the one place that knows a kind's options, origins, readiness and
preparation. Each kind's sub-package defines a subclass in ``kind.py`` (light: pydantic and the standard library
at import time; the engine itself is imported only by `load`), and the registry (core/registry.py) names it.
Nothing outside a kind's package branches on its name: the config, ``chorus models``, ``chorus serve`` and the
server ask the kind.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from chorus.lazy import load

if TYPE_CHECKING:
    from chorus.engines.core.base import Engine
    from chorus.engines.core.spec import ModelSpec


class NoOptions(BaseModel):
    """A kind without per-model options: any key under its block is an error."""

    model_config = ConfigDict(extra="forbid")


class EngineKind:
    """One engine kind. Subclasses set `name`, `engine` (``"module:Class"``) and usually `options`; the defaults
    suit a kind that loads what the entry names as it is."""

    #: the value of a model entry's ``engine:``, and the key of its options block (``llama_cpp: {threads: 2}``)
    name: ClassVar[str]
    #: the engine class, imported only when a model of this kind is loaded
    engine: ClassVar[str]
    #: the options block's model (validated where the config is read; unknown keys are errors)
    options: ClassVar[type[BaseModel]] = NoOptions
    #: runs no torch forward in this process (``chorus serve`` gives torch one thread when all models are light)
    light: ClassVar[bool] = False
    #: its model runs in this process (weights, KV caches): a gateway in several processes would hold one copy
    #: each, so ``chorus serve --workers`` refuses it (a remote model's process only forwards)
    in_process: ClassVar[bool] = True

    def check(self, spec: ModelSpec) -> None:
        """Raise ValueError when the entry cannot be of this kind (its origin: ``source``, ``path``, ``derive``)."""

    def needs_prepare(self, spec: ModelSpec) -> bool:
        """True when ``chorus models prepare`` must build something into the cache before the model loads."""
        return False

    def not_ready(self, spec: ModelSpec, home: Path) -> str | None:
        """Why the model cannot be loaded now without preparing (``None``: it can)."""
        return None

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        """What ``chorus models list`` shows: the state word and where the model is."""
        return ("ready" if self.not_ready(spec, home) is None else "optional" if spec.optional else "missing",
                str(spec.source or spec.path or "-"))

    def prefix_cache(self, spec: ModelSpec) -> str:
        """The prefix cache's budget, for ``chorus models list`` ("-": the kind keeps none)."""
        return "-"

    def prepare(self, spec: ModelSpec, home: Path, *, force: bool, log: Callable[[str], None],
                models: dict[str, ModelSpec]) -> Path:
        """Build what the model needs into ``home`` (idempotent); the default has nothing to build."""
        log(f"{spec.name}: nothing to prepare ({self.name}: loaded as it is)")
        return Path(str(spec.path or spec.source or "-"))

    def pull(self, spec: ModelSpec, home: Path, *, log: Callable[[str], None],
             models: dict[str, ModelSpec]) -> Path:
        """Fetch what the model is made from (``chorus models pull``: the hub's files into its cache, a packaged
        GGUF joined) without building or serving it; the default has nothing to fetch."""
        log(f"{spec.name}: nothing to fetch ({self.name})")
        return Path(str(spec.path or spec.source or "-"))

    def engine_class(self) -> Any:
        return load(self.engine)

    def load(self, spec: ModelSpec, models: dict[str, ModelSpec]) -> Engine:
        """The engine of this entry, loaded (weights read, tokenizer built; not started)."""
        engine: Engine = self.engine_class().load(spec, models)
        return engine
