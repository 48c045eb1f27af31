"""``engine: remote``: a model served by OpenAI-compatible workers; nothing to prepare, its options name them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from chorus.engines.core.kind import EngineKind
from chorus.engines.remote.options import RemoteOptions

if TYPE_CHECKING:
    from pathlib import Path

    from chorus.engines.core.spec import ModelSpec


class RemoteKind(EngineKind):
    name = "remote"
    engine = "chorus.engines.remote.engine:RemoteEngine"
    options = RemoteOptions
    light = True
    in_process = False

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        assert isinstance(spec.options, RemoteOptions)
        return "remote", ", ".join(spec.options.replicas)

    def pull(self, spec: ModelSpec, home: Path, *, log: Callable[[str], None],
             models: dict[str, ModelSpec]) -> Path:
        from chorus.engines.core import hub

        assert isinstance(spec.options, RemoteOptions)
        if hub.is_hub(spec.options.tokenizer):
            return hub.fetch_snapshot(hub.parse(spec.options.tokenizer), spec.revision, hub.TOKENIZER_FILES, log)
        return super().pull(spec, home, log=log, models=models)


KIND = RemoteKind()
