"""The distribution: one import package (`chorus`), a lazy CLI, `python -m chorus`, one version."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

import chorus
from chorus.cli import COMMANDS, load, parser_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, cwd=out)
    (found,) = out.glob("chorus_gateway-*.whl")
    return found


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"chorus", f"chorus_gateway-{chorus.__version__}.dist-info"}
    for layer in ("cli", "bench", "server", "ensembles", "engines", "engines/families", "engines/families/modr",
                  "engines/families/reasonformer", "clients", "training"):
        assert f"chorus/{layer}/__init__.py" in names
    assert "chorus/default_config.yaml" in names and "chorus/clients/data/route-sample.jsonl" in names
    entry = zipfile.ZipFile(wheel).read(f"chorus_gateway-{chorus.__version__}.dist-info/entry_points.txt").decode()
    assert "chorus = chorus.cli:main" in entry


def test_the_tree_is_the_package() -> None:
    """Every importable module lives under chorus/ (an import path is a file path): the repository root holds no
    other Python package than the tests."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == {"chorus", "tests"}, packages
    assert not list(ROOT.glob("*.py"))


def test_one_version_from_the_metadata() -> None:
    assert chorus.__version__ == version("chorus-gateway")


def test_help_imports_no_torch() -> None:
    code = "import sys; from chorus.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False" and "bench engine" in out


def test_python_m_chorus_runs_the_cli() -> None:
    res = subprocess.run([sys.executable, "-m", "chorus", "keys", "hash", "--key", "abc"], capture_output=True,
                         text=True, check=True)
    assert res.stdout.strip() == "sha256: ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_unknown_commands_fail_with_the_list() -> None:
    res = subprocess.run([sys.executable, "-m", "chorus", "models", "frobnicate"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown command 'models frobnicate'" in res.stderr
    assert "models prepare" in res.stderr and "serve" not in res.stderr.split("Commands:")[1]


def test_an_unknown_command_with_help_still_fails() -> None:
    """``--help`` after a word that names no command is no request for help: exit 2, naming the valid words."""
    res = subprocess.run([sys.executable, "-m", "chorus", "bench", "NOSUCH", "--help"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown command 'bench NOSUCH'" in res.stderr
    assert "valid: " in res.stderr and "gateway" in res.stderr.rsplit("valid: ", 1)[1]


@pytest.mark.parametrize("words", list(COMMANDS))
def test_every_table_entry_resolves(words: tuple[str, ...]) -> None:
    parser_for(words)  # the arguments function exists and adds valid arguments
    assert callable(load(COMMANDS[words].run))
