"""Every response body and stream chunk against OpenAI's published response schemas: chat (one model, ``n``,
logprobs, tool calls, structured outputs, ensembles), chat chunks, completions and their chunks, the model
list and error bodies.

Two references: OpenAI's OpenAPI description as JSON Schema (``schemas.json``, found through
``$CHORUS_OPENAI_SCHEMAS``, or beside the repository at ``../shared/data/openai-spec/``; the tests that need it
skip without it), and the official SDK's own response types (generated from that description), which every
body must also load into.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai.types as T
import openai.types.chat as TC
import pytest
from pydantic import BaseModel

from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, require, serve_fakes

SCHEMAS = Path(os.environ.get("CHORUS_OPENAI_SCHEMAS") or
               Path(__file__).resolve().parents[3] / "shared" / "data" / "openai-spec" / "schemas.json")
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"fake": FakeEngine("fake", max_model_len=512),
               "scripted": FakeEngine("scripted", script="Hi there.", max_model_len=2048)}
    ensembles = [{"name": "avg", "strategy": "logit_average", "members": ["fake", "scripted"]},
                 {"name": "vote", "strategy": "crowd_vote", "members": ["fake", "scripted"], "metric": "char_rouge_l"}]
    with serve_fakes(engines, ensembles) as srv:
        yield srv


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    require(SCHEMAS.is_file(), f"OpenAI's response schemas are not at {SCHEMAS} (set CHORUS_OPENAI_SCHEMAS)")
    return dict(json.loads(SCHEMAS.read_text())["$defs"])


def check(defs: dict[str, Any] | None, name: str, body: Any) -> None:
    if defs is not None:
        jsonschema.validate(body, {"$ref": f"#/$defs/{name}", "$defs": defs})


SDK: dict[str, type[BaseModel]] = {
    "CreateChatCompletionResponse": TC.ChatCompletion, "CreateChatCompletionStreamResponse": TC.ChatCompletionChunk,
    "CreateCompletionResponse": T.Completion, "ListModelsResponse": T.Model,
}


def sdk_check(name: str, body: Any) -> None:
    if name == "ListModelsResponse":
        for m in body["data"]:
            T.Model.model_validate(m)
    elif name in SDK:
        if name == "CreateCompletionResponse" and any(c["finish_reason"] is None for c in body["choices"]):
            # the SDK types a completion chunk as a whole Completion; streams send null until the end
            body = {**body, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in body["choices"]]}
        SDK[name].model_validate(body)


CHAT_CASES: list[dict[str, Any]] = [
    {"model": "fake", "max_tokens": 5},
    {"model": "fake", "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 1},
    {"model": "scripted", "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    {"model": "scripted", "max_tokens": 50, "tools": [WEATHER], "tool_choice": "required"},
    {"model": "scripted", "max_tokens": 50, "tools": [WEATHER]},
    {"model": "fake", "max_tokens": 50, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "n", "schema": SCHEMA}}},
    {"model": "fake", "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}},
    {"model": "avg", "max_tokens": 5, "logprobs": True, "top_logprobs": 1},
    {"model": "avg", "max_tokens": 50, "tools": [WEATHER], "tool_choice": "required"},
    {"model": "vote", "max_tokens": 5, "ensemble": {"trace": True}},
]


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def chunks(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    assert out
    return out


@pytest.fixture(params=["openapi", "sdk"])
def reference(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def validate(reference: str, request: pytest.FixtureRequest, name: str, body: Any) -> None:
    if reference == "openapi":
        check(request.getfixturevalue("openapi"), name, body)
    else:
        sdk_check(name, body)


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: "-".join(k for k in c if k != "model") + "@" + c["model"])
def test_chat_responses_and_chunks_conform(server: LiveServer, reference: str, request: pytest.FixtureRequest,
                                           case: dict[str, Any]) -> None:
    body = {"messages": USER, **case}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    validate(reference, request, "CreateChatCompletionResponse", r.json())
    stream_body = {**body, "stream_options": {"include_usage": True}}
    for chunk in chunks(server, "/v1/chat/completions", stream_body):
        validate(reference, request, "CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("case", [
    {"model": "fake", "prompt": "ab", "max_tokens": 4},
    {"model": "fake", "prompt": ["ab", "cd"], "max_tokens": 4, "n": 2, "logprobs": 2},
    {"model": "scripted", "prompt": "x", "max_tokens": 3, "echo": True},
    {"model": "fake", "prompt": "x", "max_tokens": 20, "structured_outputs": {"regex": "[0-9]{3}"}},
    {"model": "avg", "prompt": "x", "max_tokens": 4},
], ids=lambda c: "-".join(k for k in c if k not in ("model", "prompt")) + "@" + c["model"])
def test_completions_and_chunks_conform(server: LiveServer, reference: str, request: pytest.FixtureRequest,
                                        case: dict[str, Any]) -> None:
    r = post(server, "/v1/completions", case)
    assert r.status_code == 200, r.text
    validate(reference, request, "CreateCompletionResponse", r.json())
    for chunk in chunks(server, "/v1/completions", {**case, "stream_options": {"include_usage": True}}):
        validate(reference, request, "CreateCompletionResponse", chunk)


def test_the_model_list_conforms(server: LiveServer, reference: str, request: pytest.FixtureRequest) -> None:
    r = httpx.get(server.url + "/v1/models")
    validate(reference, request, "ListModelsResponse", r.json())
    for m in r.json()["data"]:
        validate(reference, request, "Model", m)


@pytest.mark.parametrize("path,body,status", [
    ("/v1/chat/completions", {"model": "nope", "messages": USER}, 404),
    ("/v1/chat/completions", {"model": "fake", "messages": USER, "temperature": 9}, 400),
    ("/v1/chat/completions", {"model": "fake", "messages": USER, "structured_outputs": {"regex": "(["}}, 400),
    ("/v1/chat/completions", {"model": "fake", "messages": USER, "tools": [{"type": "custom"}]}, 400),
    ("/v1/completions", {"model": "fake"}, 400),
])
def test_error_bodies_conform(server: LiveServer, openapi: dict[str, Any], path: str, body: dict[str, Any],
                              status: int) -> None:
    r = post(server, path, body)
    assert r.status_code == status
    check(openapi, "ErrorResponse", r.json())
