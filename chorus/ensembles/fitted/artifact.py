"""What every fitted artifact is: a JSON file in ``$CHORUS_HOME/selectors`` (nothing is unpickled when a server
loads one), of a ``kind`` and ``format``, written atomically, read once per file version, and checked against the
ensemble that serves it (same members, same order). `Logistic` is the learner the selector and the verifier share:
a logistic regression over standardised features."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import numpy as np

from chorus.engines.core.spec import chorus_home
from chorus.errors import ConfigError, InvalidRequest

A = TypeVar("A", bound="Artifact")


class Artifact:
    """A fitted artifact (a dataclass with ``members``, ``kind`` and ``format`` fields): its file name, kind and
    format, how it is saved and loaded. `check` is each kind's own validation of what it read."""

    FILE: ClassVar[str]
    KIND: ClassVar[str]
    FORMAT: ClassVar[int] = 1
    members: list[str]

    def check(self, path: Path) -> None:
        """Raise ConfigError when what was read is not servable (features of another chorus, shapes)."""

    def save(self, out: Path) -> Path:
        """Written as ``out / FILE``."""
        return write_artifact(out / self.FILE, asdict(self))  # type: ignore[call-overload]

    @classmethod
    def load(cls, where: str | Path) -> Self:
        """Read from ``where`` (its folder or the file): a field it lacks or does not know, a wrong kind or format,
        or a failed `check`: a ConfigError naming the file."""
        path, raw = read_artifact(where, cls.FILE, cls.KIND, cls.FORMAT)
        try:
            found = cls(**raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        found.check(path)
        return found


@dataclass
class Logistic:
    """A logistic regression over standardised features: the members it was fitted on, its feature names, the
    coefficients, the scaler and its regularisation ``C``."""

    members: list[str]
    features: list[str]
    coef: list[float]
    intercept: float
    mean: list[float]
    scale: list[float]
    C: float

    def decision(self, x: np.ndarray) -> np.ndarray:
        """The decision value (log-odds) of each row of ``x`` (rows, features)."""
        z = (x - np.array(self.mean)) / np.array(self.scale)
        return z @ np.array(self.coef) + self.intercept

    def shaped(self) -> bool:
        return len(self.coef) == len(self.mean) == len(self.scale) == len(self.features)


def selectors_dir() -> Path:
    """Where fitted selectors, verifiers and routers live: ``$CHORUS_HOME/selectors``."""
    return chorus_home() / "selectors"


def artifact_path(name: str, param: str = "ensemble.artifact") -> Path:
    """A fitted artifact by name (or a path inside `selectors_dir`): a request cannot make the server read files
    elsewhere."""
    root = selectors_dir().resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise InvalidRequest(f"'{param.rsplit('.', 1)[-1]}' must name an artifact inside {root} (got {name!r}).",
                             param=param)
    return path


def artifact_out(given: str) -> Path:
    """Where a `chorus train ...` command writes its artifact: ``given`` as a name in `selectors_dir` (what a
    request then names), or a folder path (one with a ``/``)."""
    return Path(given) if "/" in given else selectors_dir() / given


def write_artifact(path: Path, body: dict[str, Any]) -> Path:
    """An artifact as JSON, written atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    return path


def read_artifact(where: str | Path, file: str, kind: str, fmt: int) -> tuple[Path, dict[str, Any]]:
    """An artifact's JSON (``where``: its folder or the file), checked to be of this kind and format."""
    path = Path(where)
    path = path / file if path.is_dir() else path
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the artifact {path}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != fmt or raw.get("kind") != kind:
        raise ConfigError(f"{path} is not a chorus {kind} artifact (format {fmt}, kind {kind!r})")
    return path, raw


@functools.lru_cache(maxsize=32)
def _read(loader: Callable[[Path], Any], file: Path, mtime: float) -> Any:
    return loader(file)


def load_trained(cls: type[A], name: str, members: list[str], what: str,
                 param: str = "ensemble.artifact", command: str = "chorus train selector") -> A:
    """A fitted artifact of type ``cls`` by name for an ensemble with these ``members`` (model names, in order):
    read once per file version, every problem a 400 naming the field."""
    path = artifact_path(name, param)
    file = path / cls.FILE if path.is_dir() else path
    if not file.is_file():
        raise InvalidRequest(f"No {what} artifact {name!r} in {selectors_dir()} (train one with `{command}`).",
                             param=param)
    try:
        trained: A = _read(cls.load, file, file.stat().st_mtime)
    except ConfigError as exc:
        raise InvalidRequest(str(exc), param=param) from None
    if members != trained.members:
        raise InvalidRequest(f"The {what} {name!r} was trained on members {trained.members}; this ensemble has "
                             f"{members} (same models, same order).", param="ensemble.members")
    return trained
