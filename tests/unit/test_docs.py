"""The README is a landing page: at most 250 lines, and every link into the documentation names a page that
exists and, where it has one, an anchor that a heading of that page makes (slugged as mkdocs and GitHub do).
The site itself is checked by `mkdocs build --strict` (`make docs`, in CI)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def test_measured_table_reads_tables_apart_and_refuses_a_word_for_a_figure(tmp_path: Path) -> None:
    """A data file with two tables: the first is read alone (the second's header is not one of its rows), and a
    cell quoted as a figure must be one (the tenants row once quoted the header 'bravo / cold')."""
    import importlib.util
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("measured_table", str(ROOT / "scripts" / "measured-table"))
    spec = importlib.util.spec_from_loader("measured_table", loader)
    assert spec is not None
    script = importlib.util.module_from_spec(spec)
    loader.exec_module(script)
    data = tmp_path / "t.txt"
    data.write_text("| engine | ratio |\n|---|---|\n| a | 1.01x [0.97, 1.04] |\n\n$ second run\n"
                    "| engine | ratio |\n|---|---|\n| b | 0.02x [0.02, 0.03] |\n")
    first, second = script.tables(data)
    assert [r["engine"] for r in script.table(data)] == ["a"]
    assert second == [{"engine": "b", "ratio": "0.02x [0.02, 0.03]"}]
    assert script.figure(first[0]["ratio"], "t") == "1.01x [0.97, 1.04]"
    with pytest.raises(SystemExit, match="is not a figure"):
        script.figure("bravo / cold", "t")
