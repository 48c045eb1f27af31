"""``/v1/responses`` through the official SDK over fake engines: plain and streamed answers on a model and on
ensembles (token-level and text-level), ``text.format`` with a JSON schema, a function-tool round trip (the
call as an output item, its output fed back as an input item), the in-memory store (``previous_response_id``,
GET, DELETE), every body and event loaded into the SDK's own types, and a 400 naming each field it does not
serve."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, serve_fakes

CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}
EVENTS = TypeAdapter(ResponseStreamEvent)


def weather_reply(prompt: str) -> str:
    """Calls the function until its result is in the conversation, then answers with it."""
    return "It is 18 C in Paris." if "18 C" in prompt else CALL


# sharp scripts: the tests compare exact text sampled at the default temperature 1 (sharpness 10 let one token in
# about 150 be the runner-up, and a 12-character reply came back wrong one run in 13)
@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"talker": FakeEngine("talker", script="Hello there.", max_model_len=2048, sharpness=30.0),
               "greeter": FakeEngine("greeter", script="Hi there.", max_model_len=2048, sharpness=30.0),
               "abc": FakeEngine("abc", max_model_len=2048),
               "caller": FakeEngine("caller", reply=weather_reply, max_model_len=2048)}
    ensembles = [{"name": "avg", "strategy": "logit_average", "members": ["talker", "greeter"]},
                 {"name": "vote", "strategy": "crowd_vote", "members": ["talker", "greeter"], "metric": "char_rouge_l"}]
    with serve_fakes(engines, ensembles) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def raw(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=60)


def events(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    out, names = [], []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                assert line != "data: [DONE]"  # OpenAI's Responses stream ends with response.completed
                out.append(json.loads(line[6:]))
    assert names == [e["type"] for e in out]  # every event is named by its type
    return out


@pytest.mark.parametrize("model", ["talker", "avg", "vote"])
def test_a_plain_response_on_a_model_and_on_ensembles(client: openai.OpenAI, server: LiveServer, model: str) -> None:
    r = client.responses.create(model=model, input="Say hello", instructions="Be brief.", max_output_tokens=40,
                                metadata={"run": "t1"}, user="u1", temperature=0)
    assert r.status == "completed" and r.output_text and r.model == model
    assert r.metadata == {"run": "t1"} and r.instructions == "Be brief." and r.id.startswith("resp_")
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if model == "talker":
        assert r.output_text == "Hello there."
    body = raw(server, {"model": model, "input": "Say hello", "max_output_tokens": 40})
    Response.model_validate(body.json())


def test_an_ensemble_trace_rides_on_the_response(server: LiveServer) -> None:
    body = raw(server, {"model": "vote", "input": "Say hello", "max_output_tokens": 20, "ensemble": {"trace": True}})
    assert body.status_code == 200, body.text
    trace = body.json()["ensemble"]
    assert trace["strategy"] == "crowd_vote" and "similarity" in json.dumps(trace)


@pytest.mark.parametrize("model", ["talker", "avg", "vote"])
def test_the_event_stream_has_openais_events_in_order(server: LiveServer, model: str) -> None:
    evs = events(server, {"model": model, "input": "Say hello", "max_output_tokens": 40})
    for e in evs:
        EVENTS.validate_python(e)
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text
    assert evs[0]["response"]["status"] == "in_progress" and final["usage"]["output_tokens"] > 0


def test_the_sdk_stream_helper_accumulates_the_answer(client: openai.OpenAI) -> None:
    with client.responses.stream(model="talker", input="Say hello", max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there."


def test_the_token_limit_makes_an_incomplete_response(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.responses.create(model="talker", input="Say hello", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
    evs = events(server, {"model": "talker", "input": "Say hello", "max_output_tokens": 3})
    assert evs[-1]["type"] == "response.incomplete"


def test_text_format_json_schema_constrains_the_answer(client: openai.OpenAI, server: LiveServer) -> None:
    fmt = {"format": {"type": "json_schema", "name": "digit", "schema": SCHEMA, "strict": True}}
    for model in ("abc", "avg"):
        r = client.responses.create(model=model, input="A digit", text=fmt, max_output_tokens=40)  # type: ignore[arg-type]
        value = json.loads(r.output_text)
        assert set(value) == {"n"} and 0 <= value["n"] <= 9
        assert r.text is not None and r.text.format.type == "json_schema"
    evs = events(server, {"model": "abc", "input": "A digit", "text": fmt, "max_output_tokens": 40})
    assert set(json.loads(evs[-1]["response"]["output"][0]["content"][0]["text"])) == {"n"}


def test_a_function_tool_round_trip(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.responses.create(model="caller", input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                max_output_tokens=200, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    again = client.responses.create(model="caller", tools=[WEATHER], max_output_tokens=200, temperature=0, input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, clear"}])
    assert again.output_text == "It is 18 C in Paris."
    chained = client.responses.create(model="caller", tools=[WEATHER], previous_response_id=r.id,  # type: ignore[list-item]
                                      max_output_tokens=200, temperature=0, input=[
                                          {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert chained.output_text == "It is 18 C in Paris."
    evs = events(server, {"model": "caller", "input": "Weather in Paris?", "tools": [WEATHER],
                          "max_output_tokens": 200, "temperature": 0})
    for e in evs:
        EVENTS.validate_python(e)
    done = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0]["arguments"]) == {"city": "Paris"}
    assert evs[-1]["response"]["output"][0]["type"] == "function_call"


def test_stored_responses_chain_and_can_be_read_and_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(model="talker", input="Say hello", max_output_tokens=40)
    got = client.responses.retrieve(first.id)
    assert got.output_text == first.output_text and got.id == first.id
    second = client.responses.create(model="talker", input="And again", previous_response_id=first.id,
                                     max_output_tokens=40)
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="talker", input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(model="talker", input="Say hello", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("extra,param", [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"model": "nope"}, "model"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server: LiveServer, extra: dict[str, Any], param: str) -> None:
    r = raw(server, {"model": "talker", "input": "hi", **extra})
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
