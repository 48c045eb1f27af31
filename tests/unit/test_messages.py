"""Anthropic's Messages API (server/messages.py) through Anthropic's own Python SDK, on fake engines: plain and
streamed messages on a model and on ensembles, a tool round trip, stop sequences, the max_tokens stop,
count_tokens, keys as x-api-key, and bad inputs in Anthropic's error envelope naming the field."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, gateway

CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is 6*7?"}]
T0 = {"temperature": 0}  # the SDK has no sampling parameters of its own any more: they go in the body
KEY = "sk-messages-test"


def engines() -> dict[str, FakeEngine]:
    return {"a42": FakeEngine("a42", script="Six times seven. The answer is 42.", max_model_len=2048),
            "b42": FakeEngine("b42", script="The answer is 42.", max_model_len=2048),
            "caller": FakeEngine("caller", script=CALL, max_model_len=2048)}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = {"models": [{"name": n, "engine": "fake"} for n in engines()],
              "ensembles": [{"name": "vote", "strategy": "answer_vote", "members": ["a42", "b42"], "samples": 2,
                             "temperature": None,  # the request's (0): the fakes follow their scripts
                             "batch": 2}],
              "auth": {"keys": [{"name": "user", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}}
    with gateway(ChorusConfig.model_validate(config), engines()) as srv:
        yield srv


@pytest.fixture
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # sends x-api-key


def test_a_message_on_a_model(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="a42", max_tokens=64, messages=ASK, extra_body=T0)
    assert isinstance(msg, anthropic.types.Message) and msg.role == "assistant" and msg.type == "message"
    assert msg.content[0].type == "text" and msg.content[0].text == "Six times seven. The answer is 42."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens > 0 and msg.usage.cache_read_input_tokens == 0
    short = client.messages.create(model="a42", max_tokens=5, messages=ASK, system="Be brief.", extra_body=T0)
    assert short.stop_reason == "max_tokens" and short.content[0].text == "Six t"


def test_stop_sequences_and_their_stop_reason(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="a42", max_tokens=64, messages=ASK, stop_sequences=["answer", "zzz"],
                                 extra_body=T0)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "answer"
    assert msg.content[0].text == "Six times seven. The "


def test_a_streamed_message_in_anthropics_events(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="a42", max_tokens=64, messages=ASK, extra_body=T0) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == \
        "Six times seven. The answer is 42."
    assert final.content[0].text == "Six times seven. The answer is 42." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_ensembles_named_and_in_the_body(client: anthropic.Anthropic) -> None:
    voted = client.messages.create(model="vote", max_tokens=64, messages=ASK,
                                   extra_body={**T0, "ensemble": {"trace": True}})
    assert "42" in voted.content[0].text
    trace = (voted.model_extra or {}).get("ensemble")
    assert trace is not None and trace["winner"]["answer"] == "42"
    # the body's ensemble serves, not the model it names: b42's words, never a42's own
    inline = client.messages.create(model="a42", max_tokens=64, messages=ASK, extra_body={
        **T0, "ensemble": {"strategy": "crowd_vote", "members": ["b42", "b42"], "trace": True}})
    assert inline.content[0].text == "The answer is 42."
    assert (inline.model_extra or {}).get("ensemble", {}).get("strategy") == "crowd_vote"
    with client.messages.stream(model="vote", max_tokens=64, messages=ASK, extra_body=T0) as stream:
        assert "42" in "".join(stream.text_stream)


def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model="caller", max_tokens=128, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice={"type": "any"}, extra_body=T0)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    second = client.messages.create(model="a42", max_tokens=64, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}],
        tool_choice={"type": "none"}, extra_body=T0)
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    with client.messages.stream(model="caller", max_tokens=128, tools=[WEATHER], tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}], extra_body=T0) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris"}


def test_a_tool_result_must_answer_a_tool_use_of_the_previous_turn(client: anthropic.Anthropic) -> None:
    """Anthropic's rule: each tool_result answers a tool_use block of the assistant message just before it."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    cases = [  # (messages, the tool_use_id refused)
        ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "18 C"}]}],
         "toolu_2"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}],
         "toolu_1"),  # no assistant turn before it at all
        ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]},
          {"role": "assistant", "content": "Sunny."},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "19 C"}]}],
         "toolu_1"),  # it answered a tool_use two assistant turns back
    ]
    for messages, refused in cases:
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="a42", max_tokens=16, tools=[WEATHER], messages=messages, extra_body=T0)
        body = err.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert refused in body["error"]["message"] and ".tool_use_id" in body["error"]["message"]


def test_count_tokens_counts_the_prompt_the_model_reads(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="a42", messages=ASK)
    made = client.messages.create(model="a42", max_tokens=2, messages=ASK, extra_body=T0)
    assert counted.input_tokens == made.usage.input_tokens > 0
    assert client.messages.count_tokens(model="vote", messages=ASK).input_tokens == counted.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="ensemble"):
        client.messages.count_tokens(model="a42", messages=ASK, extra_body={"ensemble": {"strategy": "crowd_vote"}})


def anthropic_error(server: LiveServer, body: dict[str, Any], headers: dict[str, str] | None = None,
                    path: str = "/v1/messages") -> tuple[int, dict[str, Any]]:
    r = httpx.post(server.url + path, json=body, headers=headers if headers is not None else {"x-api-key": KEY})
    return r.status_code, r.json()


BASE = {"model": "a42", "max_tokens": 16, "messages": ASK}


@pytest.mark.parametrize(("body", "status", "names"), [
    ({k: v for k, v in BASE.items() if k != "max_tokens"}, 400, "max_tokens"),
    ({**BASE, "messages": []}, 400, "messages"),
    ({**BASE, "messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
    ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                         "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
     400, "cache_control"),
    ({**BASE, "output_config": {"format": {"type": "json_schema"}}}, 400, "output_config"),
    ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
    ({**BASE, "tool_choice": {"type": "sometimes"}}, 400, "tool_choice.type"),
    ({**BASE, "temperature": 1.5}, 400, "temperature"),
    ({**BASE, "metadata": {"session": "x"}}, 400, "metadata.session"),
    ({**BASE, "model": "nope"}, 404, "nope"),
    ({**BASE, "max_tokens": 0}, 400, "max_tokens"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400, "tool_use_id"),
])
def test_bad_inputs_get_anthropics_envelope_naming_the_field(server: LiveServer, body: dict[str, Any], status: int,
                                                             names: str) -> None:
    code, err = anthropic_error(server, body)
    assert code == status and err["type"] == "error"
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert names in err["error"]["message"]


def test_keys_as_x_api_key_or_bearer_and_the_sdks_error_types(server: LiveServer) -> None:
    code, err = anthropic_error(server, BASE, headers={})
    assert code == 401 and err["error"]["type"] == "authentication_error" and "x-api-key" in err["error"]["message"]
    code, _ = anthropic_error(server, BASE, headers={"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"})
    assert code == 200
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="a42", max_tokens=4, messages=ASK)
    good = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        good.messages.create(model="a42", max_tokens=4, messages=ASK,
                             thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.NotFoundError):
        good.messages.create(model="nope", max_tokens=4, messages=ASK)
