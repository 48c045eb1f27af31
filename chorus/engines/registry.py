"""The engine kinds a model's ``engine:`` may name, as lazily imported ``"module:Class"`` strings.

Importing this module imports no engine (so a fake-only config never loads transformers, and nothing
here touches vllm or CUDA). Each class builds itself from its config entry: ``Class.load(spec, models)``
(``models``: every model of the config by name, for engines that borrow another's tokenizer).
The server and the in-process benches both build engines through `build_engine`.
"""

from __future__ import annotations

import importlib
from typing import Any

from chorus.engines.base import Engine
from chorus.engines.spec import ModelSpec
from chorus.errors import ConfigError

ENGINES: dict[str, str] = {
    "transformers": "chorus.engines.transformers_engine:TransformersEngine",
    "remote": "chorus.engines.remote:RemoteEngine",
    "fake": "chorus.engines.fake:FakeEngine",
    "embedding": "chorus.engines.embedding:EmbeddingEngine",
    "llama_cpp": "chorus.engines.llama_cpp_engine:LlamaCppEngine",
}


def register_engine(kind: str, target: str) -> None:
    """Add an engine kind (``"module:Class"``); a kind registered twice is an error."""
    if kind in ENGINES:
        raise ConfigError(f"engine kind {kind!r} is already registered ({ENGINES[kind]})")
    ENGINES[kind] = target


def engine_class(kind: str) -> Any:
    target = ENGINES.get(kind)
    if target is None:
        raise ConfigError(f"unknown engine {kind!r}; known: {', '.join(sorted(ENGINES))}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_engine(spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> Engine:
    """The engine a config entry names, loaded (weights read, tokenizer built; not started)."""
    engine: Engine = engine_class(spec.engine).load(spec, models or {})
    return engine
