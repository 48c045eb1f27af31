"""A learned selector over a multiple-choice ensemble's members (the ``select`` strategy): the features it reads
from the members' answers and the artifact it is served from. Fitting is chorus/training/selector.py.

Features, per choice of an item (`feature_names`): for each member and normalisation (``sum``, ``mean``,
``char``), the choice's probability, its log, whether it is the member's top choice and its rank; for each
member the item's margin (top-1 minus top-2) and normalised entropy; the share of members whose top choice it
is; the prompt's length. The learner is a logistic regression over (item, choice) rows; an item's choice
probabilities are the softmax of its rows' decision values. The artifact is JSON only (members, feature names,
coefficients and scaler, the training data's hash, the cross-validated figures, library versions): nothing is
unpickled when a server loads it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from chorus.engines.core.spec import chorus_home
from chorus.errors import ConfigError, InvalidRequest

NORMS = ("sum", "mean", "char")
PER_MEMBER_CHOICE = ("p", "logp", "top", "rank")
PER_MEMBER_ITEM = ("margin", "entropy")
T = TypeVar("T")
ARTIFACT = "selector.json"
FORMAT = 1


def feature_names(members: list[str]) -> list[str]:
    names = []
    for m in members:
        names += [f"{m}:{nm}:{f}" for nm in NORMS for f in PER_MEMBER_CHOICE]
        names += [f"{m}:{nm}:{f}" for nm in NORMS for f in PER_MEMBER_ITEM]
    return [*names, *(f"agreement:{nm}" for nm in NORMS), "prompt_log_chars"]


def choice_features(answers: list[dict[str, list[float]]], prompt_chars: int) -> np.ndarray:
    """(choices, features) for one item: ``answers[m][norm]`` is member m's distribution over the choices."""
    n = len(answers[0][NORMS[0]])
    cols: list[np.ndarray] = []
    tops = {nm: [int(np.argmax(a[nm])) for a in answers] for nm in NORMS}
    for a in answers:
        for nm in NORMS:
            p = np.clip(np.asarray(a[nm], dtype=float), 1e-12, 1.0)
            order = np.argsort(-p, kind="stable")
            rank = np.empty(n)
            rank[order] = np.arange(n) / max(n - 1, 1)
            cols += [p, np.log(p), (np.arange(n) == order[0]).astype(float), rank]
        for nm in NORMS:
            p = np.sort(np.clip(np.asarray(a[nm], dtype=float), 1e-12, 1.0))[::-1]
            margin = p[0] - (p[1] if n > 1 else 0.0)
            entropy = float(-(p * np.log(p)).sum() / math.log(n)) if n > 1 else 0.0
            cols += [np.full(n, margin), np.full(n, entropy)]
    for nm in NORMS:
        cols.append(np.array([sum(t == c for t in tops[nm]) / len(answers) for c in range(n)], dtype=float))
    cols.append(np.full(n, math.log1p(prompt_chars)))
    return np.stack(cols, axis=1)


@dataclass
class Selector:
    """The artifact: what to compute from the members' answers, and how to choose from it."""

    members: list[str]
    features: list[str]
    coef: list[float]
    intercept: float
    mean: list[float]
    scale: list[float]
    C: float
    fallback: str | None = None  #: the member served instead of the learner (its CV gain did not exclude 0)
    training: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    kind: str = "select"
    learner: str = "logistic_regression"
    format: int = FORMAT

    def probabilities(self, answers: list[dict[str, list[float]]], prompt_chars: int) -> dict[str, list[float]]:
        """Per normalisation, the served distribution over the choices: the learner's (the same under every
        normalisation), or the fallback member's own."""
        if self.fallback is not None:
            return dict(answers[self.members.index(self.fallback)])
        z = (choice_features(answers, prompt_chars) - np.array(self.mean)) / np.array(self.scale)
        logits = z @ np.array(self.coef) + self.intercept
        p = np.exp(logits - logits.max())
        probs = (p / p.sum()).tolist()
        return {nm: probs for nm in NORMS}

    def save(self, out: Path) -> Path:
        return write_artifact(out / ARTIFACT, asdict(self))

    @classmethod
    def load(cls, where: str | Path) -> Selector:
        path, sel = load_artifact(cls, where, ARTIFACT, "select", FORMAT)
        expected = feature_names(sel.members)
        if sel.features != expected:
            unknown = sorted(set(sel.features) - set(expected))
            raise ConfigError(f"{path}: unknown or missing features ({', '.join(unknown[:5]) or 'order differs'}); "
                              "retrain it with this chorus")
        if sel.fallback is not None and sel.fallback not in sel.members:
            raise ConfigError(f"{path}: the fallback {sel.fallback!r} is not one of its members")
        return sel


def selectors_dir() -> Path:
    """Where trained selectors and routers live: ``$CHORUS_HOME/selectors``."""
    return chorus_home() / "selectors"


def artifact_path(name: str, param: str = "ensemble.artifact") -> Path:
    """A trained artifact by name (or a path inside `selectors_dir`): a request cannot make the server read
    files elsewhere."""
    root = selectors_dir().resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise InvalidRequest(f"'{param.rsplit('.', 1)[-1]}' must name an artifact inside {root} (got {name!r}).",
                             param=param)
    return path


def write_artifact(path: Path, body: dict[str, Any]) -> Path:
    """A trained artifact as JSON, written atomically (a reader never sees half a file)."""
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


def load_artifact(cls: type[T], where: str | Path, file: str, kind: str, fmt: int) -> tuple[Path, T]:
    """An artifact read (`read_artifact`) into its dataclass ``cls``; a field it lacks or does not know: an error."""
    path, raw = read_artifact(where, file, kind, fmt)
    try:
        return path, cls(**raw)
    except TypeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


@functools.lru_cache(maxsize=32)
def _read(loader: Callable[[Path], Any], file: Path, mtime: float) -> Any:
    return loader(file)


def load_trained(name: str, file_name: str, loader: Callable[[Path], Any], members: list[str], what: str,
                 param: str = "ensemble.artifact", command: str = "chorus train selector") -> Any:
    """A trained artifact (``selector.json``, ``router.json``, ``verifier.json``) for an ensemble with these
    ``members`` (model names, in order): read once per file version, every problem a 400 naming the field."""
    path = artifact_path(name, param)
    file = path / file_name if path.is_dir() else path
    if not file.is_file():
        raise InvalidRequest(f"No {what} artifact {name!r} in {selectors_dir()} (train one with `{command}`).",
                             param=param)
    try:
        trained = _read(loader, file, file.stat().st_mtime)
    except ConfigError as exc:
        raise InvalidRequest(str(exc), param=param) from None
    if members != trained.members:
        raise InvalidRequest(f"The {what} {name!r} was trained on members {trained.members}; this ensemble has "
                             f"{members} (same models, same order).", param="ensemble.members")
    return trained
