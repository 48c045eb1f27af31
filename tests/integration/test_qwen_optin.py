"""The opt-in Qwen2.5-Coder pair (one vocabulary): skipped, with the command to prepare them, when absent.

Their logit_average over ``/v1/choices`` is the per-token mixture of the two models' own scores, and the
probability average is the average of their distributions over the choices."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from chorus.config import ChorusConfig, load_config
from chorus.engines.core.registry import is_ready
from chorus.engines.core.scoring import mixture_logprob
from tests.helpers import LiveServer, gateway

pytestmark = pytest.mark.integration
Q05, Q15 = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def qwen_server() -> Iterator[LiveServer]:
    config = load_config(None)
    missing = [n for n in (Q05, Q15) if not is_ready(config.model(n))]
    if missing:
        pytest.skip(f"opt-in models not prepared ({', '.join(missing)}): run `make models-qwen`")
    qwen = ChorusConfig.model_validate({"models": [config.model(Q05).model_dump(exclude_none=True),
                                                   config.model(Q15).model_dump(exclude_none=True)]})
    with gateway(qwen, timeout=600) as srv:
        yield srv


def test_the_qwen_pair_mixes_per_token_and_per_choice(qwen_server: LiveServer) -> None:
    body = {"prompt": "Question: Which keyword defines a function in Python?\nAnswer: ",
            "choices": ["def", "function", "lambda x"], "logprobs": True}
    alone = [httpx.post(qwen_server.url + "/v1/choices", json={"model": m, **body}, timeout=600).json()
             for m in (Q05, Q15)]
    assert [a["chosen"]["sum"] for a in alone] == [0, 0]  # both know it
    ens = {"strategy": "logit_average", "members": [Q05, Q15], "weights": [1, 3]}
    tokens = httpx.post(qwen_server.url + "/v1/choices", json={"model": "q", **body, "ensemble": ens},
                        timeout=600).json()
    for i, c in enumerate(tokens["choices"]):
        want = mixture_logprob([a["choices"][i]["token_logprobs"] for a in alone], [0.25, 0.75])
        assert c["token_logprobs"] == pytest.approx(want, abs=1e-4)
    probs = httpx.post(qwen_server.url + "/v1/choices", timeout=600, json={
        "model": "q", **body, "logprobs": False, "ensemble": ens, "combine": "probabilities"}).json()
    for i, c in enumerate(probs["choices"]):
        want = (
            0.25 * alone[0]["choices"][i]["probabilities"]["char"]
            + 0.75 * alone[1]["choices"][i]["probabilities"]["char"]
        )
        assert c["probabilities"]["char"] == pytest.approx(want, abs=1e-6)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_qwen_calls_tools_through_its_own_template(qwen_server: LiveServer) -> None:
    """Qwen2.5's template takes tools (tool_format native): with ``auto`` the model writes its own
    ``<tool_call>`` block unforced; the tool result goes back through the template and it answers in text."""
    card = httpx.get(qwen_server.url + f"/v1/models/{Q05}").json()
    assert card["tool_format"] == "native"
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "What is the weather in Oslo right now?"}]
    out = client.chat.completions.create(model=Q05, messages=ask, tools=[WEATHER], temperature=0, max_tokens=64)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    call = c.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    history = [*ask, c.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": -3, "sky": "snow"}'}]
    reply = client.chat.completions.create(model=Q05, messages=history, tools=[WEATHER], temperature=0,
                                           max_tokens=64)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content
    forced = client.chat.completions.create(model=Q05, messages=[{"role": "user", "content": "And in Rome?"}],
                                            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=128)
    assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0].message
    assert all(c.function.name == "get_weather" for c in forced.choices[0].message.tool_calls or [])  # type: ignore[union-attr]
