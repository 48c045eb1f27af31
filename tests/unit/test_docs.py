"""The README is a landing page: at most 250 lines, and every link into the documentation names a page that
exists and, where it has one, an anchor that a heading of that page makes (slugged as mkdocs and GitHub do).
The site itself is checked by `mkdocs build --strict` (`make docs`, in CI)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)")


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "").lower()).strip()
    return re.sub(r"[\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_is_a_landing_page_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = LINK.findall(readme)
    assert len(links) >= 10
    for page, anchor in links:
        path = ROOT / page
        assert path.is_file(), page
        if anchor:
            assert anchor in anchors(path), f"{page}#{anchor}: no such heading"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(re.findall(r":\s+(\S+\.md)", nav))


def test_the_readmes_measured_table_is_made_from_the_data_files() -> None:
    """scripts/measured-table --check: the README's table equals the one made from docs/data, and every number a
    text row quotes appears in its sources (a headline cannot drift from the data or pick a number it lacks)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "scripts/measured-table", "--check"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
