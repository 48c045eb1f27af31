"""``engine: fake``: the scripted engine, built in; its options are the FakeEngine's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chorus.engines.core.kind import EngineKind
from chorus.engines.fake.options import FakeOptions

if TYPE_CHECKING:
    from pathlib import Path

    from chorus.engines.core.spec import ModelSpec


class FakeKind(EngineKind):
    name = "fake"
    engine = "chorus.engines.fake.engine:FakeEngine"
    options = FakeOptions
    light = True

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        return "built-in", "-"


KIND = FakeKind()
