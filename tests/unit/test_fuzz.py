"""Property-based tests: the HTTP API fuzzed from its OpenAPI schema (schemathesis), and the protocol models
and sampling (hypothesis). No input may cause a 500, and every error is in the OpenAI envelope."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

from chorus.config import ChorusConfig
from chorus.engines.core.base import SamplingParams
from chorus.engines.core.sampling import make_generator, sample
from chorus.engines.fake.engine import FakeEngine
from chorus.errors import InvalidRequest
from chorus.server.wire.request import ChatCompletionRequest, CompletionRequest
from tests.helpers import LiveServer, gateway

CONFIG = {
    "server": {"limits": {"max_tokens": 32, "max_n": 4}},
    "models": [{"name": "fake", "engine": "fake"}],
    "ensembles": [{"name": "vote", "strategy": "crowd_vote", "members": ["fake", "fake"], "metric": "char_rouge_l"}],
}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG), engines={"fake": FakeEngine("fake")}) as srv:
        yield srv


def test_no_input_causes_a_server_error(live: LiveServer) -> None:
    """Every operation of /openapi.json, with generated (valid and invalid) inputs: 40 examples each.

    (schemathesis's pytest plugin does not load under this pytest, so its strategies drive hypothesis here.)"""
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: Any) -> None:
            response = case.call(timeout=30)
            path = op.path  # noqa: B023 (check runs inside this iteration)
            assert response.status_code < 500, (path, response.status_code, response.text[:500])
            if response.status_code >= 400:
                body = response.json()  # always JSON, always the API's own envelope
                if path.startswith("/v1/messages"):  # Anthropic's
                    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
                    assert body["error"]["message"]
                else:
                    err = body["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"]

        check()


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "bot", 3]),
                                           "content": st.one_of(st.text(max_size=20), st.none(), st.integers())}),
                    max_size=3)
bodies = st.fixed_dictionaries(
    {"model": st.text(max_size=5), "messages": messages},
    optional={
        "temperature": st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.text(max_size=3)),
        "top_p": st.floats(allow_nan=True),
        "top_k": st.integers(-5, 5),
        "n": st.integers(-2, 200),
        "max_tokens": st.integers(-5, 10**6),
        "stop": st.one_of(st.text(), st.lists(st.text(), max_size=6)),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-2, 30),
        "seed": st.integers(),
        "presence_penalty": st.floats(-5, 5),
        "stream": st.booleans(),
        "ensemble": st.dictionaries(st.text(), st.integers()),
    },
)


@given(bodies)
@settings(max_examples=300, deadline=None)
def test_chat_request_model_accepts_or_rejects_cleanly(body: dict[str, Any]) -> None:
    try:
        req = ChatCompletionRequest.model_validate(body)
    except (ValidationError, InvalidRequest):
        return
    p = req.sampling_params()
    assert 0 <= p.temperature <= 2 and 0 < p.top_p <= 1 and p.n >= 1 and p.top_k >= 0
    assert len(p.stop) <= 4 and (p.max_tokens is None or p.max_tokens >= 1)


@given(
    st.one_of(st.text(), st.lists(st.integers(-3, 10**6), max_size=5), st.lists(st.text(), max_size=3), st.integers())
)
@settings(max_examples=200, deadline=None)
def test_completion_prompt_shapes(prompt: Any) -> None:
    try:
        req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    except (ValidationError, InvalidRequest):
        return
    assert req.prompts() and all(isinstance(p, (str, list)) for p in req.prompts())


@given(logits=st.lists(st.floats(-1e4, 1e4), min_size=2, max_size=50), temperature=st.floats(0, 2),
       top_p=st.floats(0.01, 1), top_k=st.integers(0, 60), seed=st.integers(0, 2**31))
@settings(max_examples=300, deadline=None)
def test_sampling_always_returns_a_token_in_range(logits: list[float], temperature: float, top_p: float,
                                                 top_k: int, seed: int) -> None:
    z = torch.tensor(logits)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    token = sample(z, params, make_generator(seed), {})
    assert 0 <= token < len(logits)
    if temperature == 0 or top_k == 1:
        assert z[token] == z.max()
    again = sample(z, params, make_generator(seed), {})
    assert again == token  # a seed fixes the choice
