"""The agreement cascade's fitted thresholds (`chorus train cascade`, chorus/training/cascade.py): one share per
step (members minus one), fitted on a train split for a target accuracy, with the members they were fitted for
and the rule for samples cut at ``max_tokens``. Served by `cascade` (``artifact: NAME``) through
`artifact.load_trained`, so a request names an artifact inside ``$CHORUS_HOME/selectors`` and never a path
elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chorus.ensembles.fitted.artifact import Artifact
from chorus.errors import ConfigError


@dataclass
class CascadeThresholds(Artifact):
    """Agreement thresholds for a cascade over ``members`` (cheap to expensive)."""

    FILE = "cascade.json"
    KIND = "chorus-agreement-cascade"

    members: list[str]
    thresholds: list[float]
    answer: str = "number"
    samples: int = 4
    unfinished: str = "abstain"
    target: float | None = None
    train: dict[str, Any] = field(default_factory=dict)
    kind: str = KIND
    format: int = 1

    def check(self, path: Path) -> None:
        if len(self.thresholds) != len(self.members) - 1 or any(
                not isinstance(x, int | float) or not 0 <= x <= 1 for x in self.thresholds):
            raise ConfigError(f"{path}: a cascade over {len(self.members)} members holds {len(self.members) - 1} "
                              "thresholds in [0, 1]")
        if self.unfinished not in ("abstain", "vote"):
            raise ConfigError(f"{path}: unfinished must be abstain or vote, not {self.unfinished!r}")
