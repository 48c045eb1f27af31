"""Where chorus keeps its files: ``$CHORUS_HOME``, default ``~/.cache/chorus`` (models, downloads)."""

from __future__ import annotations

import os
from pathlib import Path


def chorus_home() -> Path:
    """``$CHORUS_HOME``, default ``~/.cache/chorus``."""
    return Path(os.environ.get("CHORUS_HOME") or Path.home() / ".cache" / "chorus").expanduser()
