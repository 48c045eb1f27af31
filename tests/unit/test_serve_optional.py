"""`chorus serve` serves what is prepared: an optional model that is not prepared is left out with one stderr
line naming the command that adds it, and so is a named ensemble with such a member; `/v1/models` lists
exactly what is served. A real `chorus serve` process over fake engines, asked with the openai SDK."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from chorus.clients.local import free_port, wait_ready
from chorus.config import ChorusConfig

CONFIG = """
models:
  - {name: always, engine: fake}
  - name: opt-in-gguf
    path: /nonexistent/opt-in.gguf
    optional: true
    add_with: make models-opt-in
  - name: opt-in-plain
    path: /nonexistent/plain.gguf
    optional: true
ensembles:
  - {name: pair-ok, strategy: crowd_vote, members: [always, always]}
  - {name: pair-missing, strategy: crowd_vote, members: [always, opt-in-gguf]}
"""


def test_serve_skips_unprepared_optional_models_and_their_ensembles(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG)
    port = free_port()
    env = {"CHORUS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port),
                             "--no-prepare"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=60, interval=0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["always", "pair-ok"]
        for model in ("always", "pair-ok"):
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3)
            assert out.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="pair-missing", messages=[{"role": "user", "content": "hi"}])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if "not served" in ln]
    assert lines == [
        "chorus: opt-in-gguf: optional and not prepared, not served (add it with: make models-opt-in)",
        "chorus: opt-in-plain: optional and not prepared, not served (add it with: chorus models prepare "
        "opt-in-plain)",
        "chorus: pair-missing: not served, its member opt-in-gguf is not served",
    ], err


def test_a_required_model_that_cannot_be_prepared_still_stops_start_up(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("models:\n  - {name: needed, path: /nonexistent/needed.gguf}\n")
    out = subprocess.run([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120, env={"CHORUS_HOME": str(tmp_path / "h"),
                                                                            "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "cannot prepare needed" in out.stderr, out.stderr


def test_served_config_keeps_everything_prepared() -> None:
    config = ChorusConfig.model_validate({
        "models": [{"name": "a", "engine": "fake"}, {"name": "b", "path": "/x/b.gguf", "optional": True}],
        "ensembles": [{"name": "e", "strategy": "crowd_vote", "members": ["a", "b"]}]})
    served, skipped = config.served(lambda spec: None)
    assert [m.name for m in served.models] == ["a", "b"] and [e.name for e in served.ensembles] == ["e"]
    assert skipped == []


def test_the_app_itself_leaves_out_what_is_not_prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """create_app (a worker, an embedding program) serves the same set as `chorus serve`: one mechanism."""
    import yaml

    from tests.helpers import gateway

    monkeypatch.setenv("CHORUS_HOME", str(tmp_path / "home"))
    with gateway(ChorusConfig.model_validate(yaml.safe_load(CONFIG))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["always", "pair-ok"]


def test_an_optional_llama_cpp_model_is_served_where_llama_cpp_python_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default config's `-llama` models: ready once the extra is installed; left out, saying so, where not."""
    import importlib.util

    from chorus.config import load_config
    from chorus.engines.core.registry import is_ready, not_ready

    config = load_config(None)
    llama = [m for m in config.models if m.engine == "llama_cpp"]
    assert [m.name for m in llama] == ["smollm2-135m-instruct-llama", "gemma-3-270m-llama"]
    assert all(m.optional and m.add_with == "make llama-cpp" for m in llama)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp"
                        else real_find_spec(name, *a))
    assert not any(is_ready(m) for m in llama)
    _, skipped = config.served(not_ready)
    assert "smollm2-135m-instruct-llama: optional and llama-cpp-python is not installed, not served (add it with: " \
           "make llama-cpp)" in skipped
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp"
                        else real_find_spec(name, *a))
    assert all(is_ready(m) for m in llama)
