"""``engine: transformers``: a Hugging Face checkpoint in this process. A GGUF (a packaged or hub ``source``, or a
``.gguf`` ``path``) is dequantized into ``$CHORUS_HOME/models`` first, a hub checkpoint repository (``source:
hf:ORG/REPO``) is fetched into the hub cache and linked there, and a derived family checkpoint (``derive``) is
built there from its base (engines/transformers/prepare.py); a checkpoint directory is loaded as it is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chorus.engines.core.kind import EngineKind
from chorus.engines.transformers.options import TransformersOptions

if TYPE_CHECKING:
    from chorus.engines.core.spec import ModelSpec


#: derived families whose observer does not reuse prefixes (`FamilyObserver.reuses_prefixes`)
NO_PREFIX_REUSE = ("modr", "reasonformer")


class TransformersKind(EngineKind):
    name = "transformers"
    engine = "chorus.engines.transformers.engine:TransformersEngine"
    options = TransformersOptions

    def check(self, spec: ModelSpec) -> None:
        if sum(x is not None for x in (spec.source, spec.path, spec.derive)) != 1:
            raise ValueError(f"model {spec.name!r}: give exactly one of 'source', 'path' or 'derive'")

    def needs_prepare(self, spec: ModelSpec) -> bool:
        return spec.source is not None or spec.derive is not None or str(spec.path).endswith(".gguf")

    def not_ready(self, spec: ModelSpec, home: Path) -> str | None:
        from chorus.engines.transformers.prepare import is_prepared

        return "not prepared" if self.needs_prepare(spec) and not is_prepared(spec.prepared_dir(home)) else None

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        d = spec.checkpoint_dir(home)
        if self.needs_prepare(spec):
            word = "prepared" if self.not_ready(spec, home) is None else "optional" if spec.optional else "not prepared"
        else:
            word = "local" if (d / "config.json").is_file() else "missing"
        return word, str(d)

    def prefix_cache(self, spec: ModelSpec) -> str:
        assert isinstance(spec.options, TransformersOptions)
        if spec.derive is not None and spec.derive.family in NO_PREFIX_REUSE:
            return "-"
        mib = spec.options.prefix_cache_mib
        return f"{mib} MiB" if mib else "off"

    def pull(self, spec: ModelSpec, home: Path, *, log: Callable[[str], None],
             models: dict[str, ModelSpec]) -> Path:
        from chorus.engines.core import hub
        from chorus.engines.core.registry import engine_kind
        from chorus.engines.core.sources import resolve_gguf

        if spec.derive is not None:
            base = models.get(spec.derive.base)
            if base is None:
                log(f"{spec.name}: derived from the directory {spec.derive.base}; nothing to fetch")
                return Path(spec.derive.base)
            return engine_kind(base.engine).pull(base, home, log=log, models=models)
        if (repo := hub.repository(spec.source)) is not None:
            return hub.fetch_snapshot(repo, spec.revision, hub.CHECKPOINT_FILES, log)
        if spec.source is not None or str(spec.path).endswith(".gguf"):
            return resolve_gguf(spec, home, log)
        return super().pull(spec, home, log=log, models=models)

    def prepare(self, spec: ModelSpec, home: Path, *, force: bool, log: Callable[[str], None],
                models: dict[str, ModelSpec]) -> Path:
        from chorus.engines.transformers.prepare import prepare_checkpoint

        return prepare_checkpoint(spec, home, force=force, log=log, models=models)


KIND = TransformersKind()
