"""``engine: llama_cpp``: a GGUF loaded as it is by llama.cpp in this process (a ``source`` is fetched from the hub,
joined or located at load; nothing is converted). Ready once llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chorus.engines.core import hub
from chorus.engines.core.kind import EngineKind
from chorus.engines.llama_cpp.options import LlamaCppOptions

if TYPE_CHECKING:
    from chorus.engines.core.spec import ModelSpec


class LlamaCppKind(EngineKind):
    name = "llama_cpp"
    engine = "chorus.engines.llama_cpp.engine:LlamaCppEngine"
    options = LlamaCppOptions
    light = True  # llama.cpp's threads own the cores; torch only mixes and samples 1-D rows beside it

    def check(self, spec: ModelSpec) -> None:
        if (spec.derive is not None or (spec.source is None) == (spec.path is None)
                or (spec.path is not None and not spec.path.endswith(".gguf"))):
            raise ValueError(f"model {spec.name!r}: engine: llama_cpp needs exactly one of 'source' (a GGUF on the "
                             "hub: hf:ORG/REPO[:QUANT | /FILE.gguf]; packaged: pypi:..., pypi-parts:...; or a "
                             "list of these, mirrors of one pinned file) or 'path' (a .gguf file)")

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        if hub.is_hub(spec.source):
            word, where = hub.cache_state(hub.parse(str(spec.source)), spec.revision)
            return ("ready" if word == "cached" and self.not_ready(spec, home) is None else word), where
        return super().state(spec, home)

    def pull(self, spec: ModelSpec, home: Path, *, log: Callable[[str], None],
             models: dict[str, ModelSpec]) -> Path:
        from chorus.engines.core.sources import resolve_gguf

        return resolve_gguf(spec, home, log)

    def prefix_cache(self, spec: ModelSpec) -> str:
        assert isinstance(spec.options, LlamaCppOptions)
        slots = spec.options.prefix_cache_slots
        return f"{slots} slots" if slots else "off"

    def not_ready(self, spec: ModelSpec, home: Path) -> str | None:
        return None if importlib.util.find_spec("llama_cpp") is not None else "llama-cpp-python is not installed"


KIND = LlamaCppKind()
