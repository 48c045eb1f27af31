"""The shared request path: the engine registry, encode_prompt (the one place a prompt becomes tokens),
the one exception -> HTTP map, and strategies' budgets."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from chorus.engines.core.base import SamplingParams
from chorus.engines.core.generation import encode_prompt
from chorus.engines.core.registry import ENGINES, build_engine, engine_class, register_engine
from chorus.engines.core.spec import ModelSpec
from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.base import Ensemble
from chorus.ensembles.spec import EnsembleSpec
from chorus.errors import (
    ChorusError,
    ConfigError,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    Overloaded,
    SessionBusy,
)
from chorus.server.gateway.errors import error_response
from chorus.server.wire import request as wire


def test_the_registry_builds_engines_by_kind_lazily() -> None:
    engine = build_engine(ModelSpec.model_validate({"name": "f", "engine": "fake", "fake": {"script": "hi"}}))
    assert isinstance(engine, FakeEngine) and engine.name == "f"
    assert set(ENGINES) == {"transformers", "remote", "fake", "embedding", "llama_cpp"}
    assert all(":" in target for target in ENGINES.values())


def test_the_registry_refuses_unknown_and_duplicate_kinds() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine 'vllm-native'; known: embedding, fake, llama_cpp, remote, transformers"):
        engine_class("vllm-native")
    with pytest.raises(ConfigError, match="already registered"):
        register_engine("fake", "somewhere:Else")


def test_encode_prompt_renders_checks_and_refuses() -> None:
    engine = FakeEngine(max_model_len=32)
    params = SamplingParams(max_tokens=4)
    chat = encode_prompt(engine, params, messages=[{"role": "user", "content": "abc"}])
    assert chat.prompt_ids == engine.tokenizer.encode_chat([{"role": "user", "content": "abc"}])
    assert chat.extra_stop == engine.tokenizer.chat_stop and chat.messages is not None
    text = encode_prompt(engine, params, text="abc")
    assert text.prompt_ids == engine.tokenizer.encode("abc") and text.messages is None and text.extra_stop == ()
    with pytest.raises(InvalidRequest, match="prompt 2 holds token ids outside the vocabulary") as err:
        encode_prompt(engine, params, ids=[1, 10**6], label="prompt 2")
    assert err.value.param == "prompt"
    with pytest.raises(ContextLengthExceeded):
        encode_prompt(engine, SamplingParams(max_tokens=40), text="abc")
    with pytest.raises(InvalidRequest, match="empty"):
        encode_prompt(engine, params, ids=[])


def test_request_models_convert_themselves_for_an_engine() -> None:
    engine = FakeEngine(sampling_defaults={"temperature": 0.3})
    chat = wire.ChatCompletionRequest.model_validate({"model": "f", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_completion_tokens": 5, "recurrence": 2, "trace": True})
    req = chat.to_generation_request(engine)
    assert req.params.max_tokens == 5 and req.params.temperature == 0.3
    assert req.options == {"recurrence": 2} and req.trace == {}
    rf = wire.CompletionRequest.model_validate({"model": "f", "prompt": "ab", "max_steps": 2, "stop_threshold": 0})
    assert rf.family_options == {"max_steps": 2, "stop_threshold": 0.0}
    for bad in ({"max_steps": True}, {"max_steps": "2"}, {"stop_threshold": True}, {"stop_threshold": "0.3"}):
        with pytest.raises(ValueError, match=next(iter(bad))):  # strict: never read as a cap of 1 or 2
            wire.CompletionRequest.model_validate({"model": "f", "prompt": "ab", **bad})
    comp = wire.CompletionRequest.model_validate({"model": "f", "prompt": ["ab", "cd"], "max_tokens": 3})
    reqs = comp.to_generation_requests(engine)
    assert [r.prompt_ids for r in reqs] == [engine.tokenizer.encode("ab"), engine.tokenizer.encode("cd")]


def body(response: object) -> dict[str, object]:
    return json.loads(response.body)  # type: ignore[attr-defined]


def test_one_map_from_exceptions_to_http() -> None:
    r = error_response(Overloaded("busy", retry_after=2.5))
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert body(r)["error"] == {"message": "busy", "type": "server_error", "param": None, "code": "server_overloaded"}
    assert error_response(SessionBusy("a step is in flight")).status_code == 409

    class M(BaseModel):
        n: int

    with pytest.raises(ValidationError) as bad:
        M.model_validate({"n": "x"})
    r = error_response(bad.value)
    assert r.status_code == 400 and body(r)["error"]["param"] == "n"  # type: ignore[index]
    r = error_response(RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "bad"}]))
    assert body(r)["error"]["code"] == "invalid_json"  # type: ignore[index]
    assert error_response(HTTPException(404, "Not Found")).status_code == 404
    r = error_response(RuntimeError("secret detail"))
    assert r.status_code == 500 and b"secret" not in r.body


def test_every_deliberate_error_is_a_chorus_error() -> None:
    assert issubclass(GatewayError, ChorusError) and issubclass(ConfigError, ChorusError)


@pytest.mark.parametrize(("spec", "rounds", "candidates"), [
    ({"strategy": "exchange_of_thought", "members": ["a", "a", "a"], "max_rounds": 3}, 3, 0),
    ({"strategy": "crowd_vote", "members": ["a", "a"], "samples_per_member": 4}, 0, 8),
    ({"strategy": "crowd_vote", "members": [], "candidates": ["x", "y", "z"]}, 0, 3),
    ({"strategy": "mixture_of_agents", "members": ["a", "a"]}, 0, 0),
])
def test_strategies_state_their_budget(spec: dict[str, object], rounds: int, candidates: int) -> None:
    ensemble = Ensemble.build(EnsembleSpec.model_validate(spec), {"a": FakeEngine("a")})
    budget = ensemble.strategy.budget()
    assert (budget.rounds, budget.candidates) == (rounds, candidates)
