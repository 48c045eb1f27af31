"""Structured outputs (engines/core/constraint.py, server/structured.py) over fake engines, with the openai SDK:
every format's output parses and validates, streamed and with ``n``; the SDK's ``parse`` helper works;
hypothesis-generated schemas all validate; every malformed format is a 400 naming its field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from chorus.engines.core.constraint import bounded
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, serve_fakes

USER = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


PAIR = [{"model": "json"}, {"model": "abc"}]
ENSEMBLES = [
    {"name": "avg", "strategy": "logit_average", "members": PAIR},
    {"name": "union", "strategy": "logit_average", "align": "topk_union", "top_k": 3, "members": PAIR},
    {"name": "vote", "strategy": "crowd_vote", "members": PAIR},
    {"name": "eot", "strategy": "exchange_of_thought", "members": ["json", "json"]},
    {"name": "moa", "strategy": "mixture_of_agents", "members": ["abc", "json"], "aggregator": "json"},
    {"name": "route", "strategy": "route", "router": "random", "members": ["json", "abc"]},
    {"name": "cascade", "strategy": "cascade", "members": ["json", "abc"], "threshold": -1.0},
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"json": FakeEngine("json", script='{"name": "Ada", "age": 36}', max_model_len=4096),
               "abc": FakeEngine("abc", max_model_len=4096)}
    with serve_fakes(engines, ENSEMBLES) as srv:
        yield srv


def schema_format(schema: dict[str, Any], name: str = "person") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("model", ["json", "abc", "avg", "union", "vote", "eot", "moa", "route", "cascade"])
def test_a_json_schema_answer_validates(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=USER, max_tokens=200, temperature=0,
                                         response_format=schema_format(PERSON))
    c = out.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content or ""), PERSON)


def test_the_script_comes_through_where_the_schema_allows_it(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="json", messages=USER, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    assert json.loads(out.choices[0].message.content or "") == {"name": "Ada", "age": 36}


def test_streamed_and_n_answers_validate(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="abc", messages=USER, max_tokens=200, n=3, temperature=1.0, seed=3,
                                            stream=True, response_format=schema_format(PERSON))
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


class Person(BaseModel):
    name: str = Field(max_length=12)  # the fake models never end a free string by themselves
    age: int


@pytest.mark.parametrize("model", ["json", "avg"])
def test_the_sdk_parse_helper_gets_a_model_back(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.parse(model=model, messages=USER, max_tokens=200, temperature=0,
                                        response_format=Person)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person)
    if model == "json":
        assert person == Person(name="Ada", age=36)


@pytest.mark.parametrize("so,check", [
    ({"regex": r"\d{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
    ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"grammar": 'start: "light " COLOR\nCOLOR: "red" | "green"'}, lambda t: t in ("light red", "light green")),
    ({"grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch(r"x\d\d", t)),  # GBNF, as llama.cpp writes it
    ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_outputs_on_chat_and_completions(client: openai.OpenAI, so: dict[str, Any], check: Any,
                                                    temperature: float) -> None:
    chat = client.chat.completions.create(model="json", messages=USER, max_tokens=100, temperature=temperature,
                                          seed=1, extra_body={"structured_outputs": so})
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    comp = client.completions.create(model="json", prompt="Answer: ", max_tokens=100, temperature=temperature,
                                     seed=1, extra_body={"structured_outputs": so})
    assert check(comp.choices[0].text), comp.choices[0].text
    assert comp.choices[0].finish_reason == "stop"


def test_a_short_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="json", messages=USER, max_tokens=5, temperature=0,
                                         response_format=schema_format(PERSON))
    assert out.choices[0].finish_reason == "length"  # cut before the object closes, as OpenAI reports it


def test_logprobs_are_of_the_masked_distribution(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="abc", messages=USER, max_tokens=20, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    first = out.choices[0].logprobs.content[0]  # type: ignore[union-attr,index]
    assert {t.token for t in first.top_logprobs if t.logprob > -1e9} <= {"y", "n"}


# ---- hypothesis: many schemas, every answer validates ----

# bounded leaves: a fake model has no reason to end a number or a string; the real-model test
# (tests/integration/test_structured_real.py) draws unbounded ones
LEAF = st.sampled_from([
    {"type": "integer", "minimum": 0, "maximum": 100}, {"type": "integer", "minimum": -5, "maximum": 5},
    {"enum": [1.5, 2, -3.25]},
    {"type": "boolean"}, {"type": "null"}, {"type": "string", "maxLength": 6},
    {"type": "string", "enum": ["red", "green", "blue"]}, {"type": "string", "pattern": "^[a-c]{1,3}$"},
    {"const": "fixed"},
])
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[bool], closed: bool) -> dict[str, Any]:
        req = [k for k, r in zip(props, required) if r]
        return {"type": "object", "properties": props, "required": req, "additionalProperties": not closed and False}
    return st.builds(build, st.dictionaries(NAMES, children, min_size=1, max_size=4),
                     st.lists(st.booleans(), min_size=4, max_size=4), st.booleans())


SCHEMAS = st.recursive(LEAF, lambda kids: st.one_of(
    _objects(kids), st.builds(lambda s, n: {"type": "array", "items": s, "maxItems": n}, kids, st.integers(0, 3)),
    st.builds(lambda a, b: {"anyOf": [a, b]}, kids, kids)), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_hypothesis_schemas_always_validate(client: openai.OpenAI, schema: dict[str, Any], temperature: float,
                                            seed: int) -> None:
    # the scripted fake: past its script it favours EOS, so an answer ends where the grammar lets it
    out = client.chat.completions.create(model="json", messages=USER, max_tokens=400, temperature=temperature,
                                         seed=seed, extra_body={"structured_outputs": {"json": schema}})
    c = out.choices[0]
    assert c.finish_reason == "stop", (schema, c.message.content)
    jsonschema.validate(json.loads(c.message.content or ""), schema)


# ---- errors ----

@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "'name'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"extra_body": {"structured_outputs": {"regex": "(["}}}, "structured_outputs.regex", "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}}, "structured_outputs.grammar", "nowhere"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "non-empty"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json", "not valid JSON"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"extra_body": {"structured_outputs": "json"}}, "structured_outputs", "must be an object"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json", "'structured_outputs': {'json'"),
    ({"extra_body": {"guided_choice": ["a"]}}, "guided_choice", "removed in vLLM 0.12"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs", "not both"),
])
def test_malformed_formats_are_a_400_naming_the_field(client: openai.OpenAI, body: dict[str, Any], param: str,
                                                      words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="json", messages=USER, **body)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param and words in err["message"], err


def test_response_format_on_completions_says_what_to_send(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="json", prompt="x", extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "response_format"
    assert "structured_outputs" in info.value.body["message"]


def test_unbounded_numbers_are_held_to_the_i_json_range() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["number", "null"],
              "maximum": 5}, "c": {"enum": [1]}, "d": {"type": "array", "items": {"type": "number"}}}}
    out = bounded(schema)
    assert out["properties"]["a"] == {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert out["properties"]["b"]["maximum"] == 5 and out["properties"]["b"]["minimum"] == -(2**53 - 1)
    assert out["properties"]["c"] == {"enum": [1]} and out["properties"]["d"]["items"]["maximum"] == 2**53 - 1
    assert schema["properties"]["a"] == {"type": "integer"}  # the client's schema is left as sent
