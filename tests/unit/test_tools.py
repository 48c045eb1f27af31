"""Function calling (engines/core/tool_calls.py, server/tools.py) over fake engines, with the openai SDK: the
fallback format's prompt, forced calls on any model (``required``, a named function, one call when
``parallel_tool_calls`` is false), ``auto``, streamed ``delta.tool_calls``, tool-result turns, ensembles,
the SDK's ``parse`` helper with a pydantic tool, and a 400 for every malformed field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from chorus.engines.core import tool_calls
from chorus.engines.core.base import Tools
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, serve_fakes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"caller": FakeEngine("caller", script=CALL, max_model_len=2048),
               "talker": FakeEngine("talker", script="It is sunny.", max_model_len=2048),
               "abc": FakeEngine("abc", max_model_len=2048)}
    ensembles = [{"name": "avg", "strategy": "logit_average", "members": ["caller", "abc"]},
                 {"name": "vote", "strategy": "crowd_vote", "members": ["caller", "caller", "talker"]}]
    with serve_fakes(engines, ensembles) as srv:
        yield srv


def check_calls(calls: Any, names: set[str] | None = None) -> None:
    assert calls, "no tool calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_auto_reads_the_call_the_model_writes(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="caller", messages=USER, tools=TOOLS, temperature=0, max_tokens=200)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    check_calls(c.message.tool_calls, {"get_weather"})
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}  # type: ignore[index]


def test_auto_leaves_text_as_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="talker", messages=USER, tools=TOOLS, temperature=0, max_tokens=50)
    c = out.choices[0]
    assert c.finish_reason == "stop" and c.message.content == "It is sunny." and not c.message.tool_calls


@pytest.mark.parametrize("model", ["talker", "abc", "avg"])
@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_required_or_named_forces_a_valid_call_on_any_model(client: openai.OpenAI, model: str, choice: Any,
                                                            names: set[str]) -> None:
    out = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice=choice,
                                         temperature=0.7, seed=4, max_tokens=300)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    check_calls(c.message.tool_calls, names)


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    for seed in range(4):
        out = client.chat.completions.create(model="abc", messages=USER, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=300)
        assert len(out.choices[0].message.tool_calls or []) == 1


def test_streamed_calls_arrive_as_delta_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="caller", messages=USER, tools=TOOLS, temperature=0,
                                            max_tokens=200, stream=True, n=2)
    calls: dict[int, list[Any]] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            calls.setdefault(ch.index, []).extend(ch.delta.tool_calls or [])
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for got in calls.values():
        assert [c.function.name for c in got] == ["get_weather"] and got[0].index == 0  # type: ignore[union-attr]
        assert json.loads(got[0].function.arguments) == {"city": "Paris", "unit": "c"}  # type: ignore[union-attr]


def test_a_tool_result_turn_is_rendered_and_answered(client: openai.OpenAI, server: LiveServer) -> None:
    first = client.chat.completions.create(model="caller", messages=USER, tools=TOOLS, temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    out = client.chat.completions.create(model="talker", messages=history, tools=TOOLS, temperature=0, max_tokens=50)
    assert out.choices[0].message.content == "It is sunny."
    prompt = tool_calls.prepare(history, Tools(json.dumps([t["function"] for t in TOOLS])), native=False)
    assert "get_weather" in prompt[0]["content"] and prompt[0]["role"] == "system"
    assert json.loads(prompt[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]
    assert prompt[3] == {"role": "user", "content": f"Result of the function call {call.id}: 18 C, sunny"}


def test_crowd_vote_votes_on_calls_as_objects(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="vote", messages=USER, tools=TOOLS, temperature=0, max_tokens=200,
                                         extra_body={"ensemble": {"trace": True}})
    c = out.choices[0]
    assert c.finish_reason == "tool_calls"
    check_calls(c.message.tool_calls, {"get_weather"})


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: str


def test_the_sdk_parse_helper_reads_pydantic_tool_arguments(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    out = client.chat.completions.parse(model="caller", messages=USER, tools=[tool], temperature=0, max_tokens=200)
    call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.parsed_arguments == GetWeather(city="Paris", unit="c")


def test_parse_reads_both_formats_and_rejects_what_does_not_fit() -> None:
    tools = Tools(json.dumps([t["function"] for t in TOOLS]))
    native = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    content, calls = tool_calls.parse(native, tools)
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [("get_time", {"zone": "utc"})]
    fenced = '```json\n{\n  "name": "get_time",\n  "arguments": {"zone": "cet"}\n}\n```'
    assert [(c.name, c.arguments) for c in tool_calls.parse(fenced, tools)[1]] == [("get_time", {"zone": "cet"})]
    for text in ['[{"name": "nope", "arguments": {}}]', '[{"name": "get_time", "arguments": {"zone": "mars"}}]',
                 '{"answer": 42}', "[]", "plain text"]:
        assert tool_calls.parse(text, tools) == (text, []), text


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "not in 'tools'"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'required'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot both"),
])
def test_malformed_tool_fields_are_a_400(client: openai.OpenAI, body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="caller", messages=USER, **body)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param and words in err["message"], err


def test_tool_choice_none_offers_nothing(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="caller", messages=USER, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=200)
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
    with_format = client.chat.completions.create(model="caller", messages=USER, tools=TOOLS, tool_choice="none",
                                                 response_format={"type": "json_object"}, temperature=0, max_tokens=5)
    assert with_format.choices[0].finish_reason == "length"  # the format applies; no calls are read


def test_model_cards_say_how_functions_reach_a_model(server: LiveServer) -> None:
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert "tools" in cards["caller"]["capabilities"] and cards["caller"]["tool_format"] == "json"
    assert "structured_outputs" in cards["caller"]["capabilities"]


LOOP = '[{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "get_time", "arguments": {"zone": "utc"}}, {"na'


@pytest.mark.parametrize(("text", "choice", "cut", "content", "zones"), [
    (LOOP, "required", True, None, ["utc"]),  # a list cut short: its completed calls, a repeat counted once
    (LOOP, "auto", True, None, ["utc"]),
    ('[{"name": "get_time", "arguments": {"zo', "required", True, None, []),  # none completed: no grammar text
    ('[{"name": "get_time", "arguments": {"zo', "auto", True, '[{"name": "get_time", "arguments": {"zo', []),
    ('Let me see. <tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>\n<tool_call>\n{"na',
     "required", True, "Let me see.", ["cet"]),  # native: the unclosed block is dropped
    ('<tool_call>\n{"name": "get_ti', "required", True, None, []),
    (LOOP.rsplit(", {", 1)[0] + "]", "required", False, None, ["utc"]),  # finished with two identical calls: one
    (LOOP, "required", False, LOOP, []),  # not cut: an unfinished list is text, as before
])
def test_a_cut_answer_keeps_the_calls_it_completed(text: str, choice: str, cut: bool, content: str | None,
                                                   zones: list[str]) -> None:
    tools = Tools(json.dumps([t["function"] for t in TOOLS]), choice=choice)
    got_content, calls = tool_calls.parse(text, tools, cut=cut)
    assert got_content == content and [c.arguments["zone"] for c in calls] == zones


def test_a_cut_call_list_through_an_ensemble_replies_with_the_call() -> None:
    """Served: a fake that loops on one call until max_tokens cuts it, alone and as a crowd vote's members."""
    looping = FakeEngine("looping", script=LOOP + 'me": "get_time", "arguments": {"zone": "utc"}}]',
                         max_model_len=2048)
    with serve_fakes({"looping": looping}, [{"name": "loop-vote", "strategy": "crowd_vote",
                                             "members": ["looping", "looping"]}]) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for model in ("looping", "loop-vote"):
            out = c.chat.completions.create(model=model, messages=USER, tools=[TIME], tool_choice="auto",
                                            temperature=0, max_tokens=len(LOOP))
            choice = out.choices[0]
            assert choice.finish_reason == "length" and choice.message.content is None, model
            assert [json.loads(t.function.arguments) for t in choice.message.tool_calls or []] == [{"zone": "utc"}]

