"""docs/architecture.md matches the tree: every file and folder its layout table names exists in the row's folder,
and every path it names from the repository's root exists (history it quotes is marked as such and left out)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PLACEHOLDERS = {"KIND/", "chorus/engines/KIND/"}


def named(cell: str) -> set[str]:
    return {t.split(":")[0].rstrip(",.") for t in re.findall(r"`([^`\s]+)`", cell)
            if t.endswith((".py", "/")) and not t.startswith(("/", "http")) and t not in PLACEHOLDERS}


def exists_under(folder: Path, name: str) -> bool:
    if "*" in name:
        return any(folder.rglob(name))
    return (folder / name).exists() or any(p.name == name.rstrip("/") for p in folder.rglob(name.rstrip("/")))


def test_the_layout_table_names_only_what_is_there() -> None:
    missing = []
    for line in DOC.read_text().splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `chorus/") or len(cells) < 2:
            continue
        folders = [ROOT / f for f in named(cells[0])]
        for name in named(" | ".join(cells[1:])):
            if not any(exists_under(f, name) for f in folders) and not (ROOT / name).exists() \
                    and not (ROOT / "chorus" / name).exists():
                missing.append(f"{cells[0].strip('| ')}: {name}")
    assert not missing, f"docs/architecture.md's layout table names what the tree lacks: {missing}"


def test_paths_from_the_root_exist() -> None:
    text = DOC.read_text()
    paths = {p for p in named(text) if p.startswith(("chorus/", "scripts/", "tests/", "docs/", "deploy/"))}
    assert paths and not sorted(p for p in paths if not (ROOT / p).exists())
