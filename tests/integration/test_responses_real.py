"""The Responses API and embeddings on the default models, through the official openai SDK: a plain and a
streamed response on SmolLM2 and on a named ensemble, ``text.format`` with a JSON schema, a function tool
round trip, and the packaged embedder."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import openai
import pytest

from tests.helpers import SMOL

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.mark.parametrize("model", [SMOL, "average-default"])
def test_plain_and_streamed_responses(sdk: openai.OpenAI, model: str) -> None:
    r = sdk.responses.create(model=model, input="What is the capital of France?", max_output_tokens=24,
                             temperature=0)
    assert "Paris" in r.output_text and r.usage is not None and r.usage.output_tokens > 0
    with sdk.responses.stream(model=model, input="What is the capital of France?", max_output_tokens=24,
                              temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text


def test_text_format_json_schema(sdk: openai.OpenAI) -> None:
    r = sdk.responses.create(model=SMOL, input="Which city is the capital of France? Answer in JSON.",
                             max_output_tokens=40, temperature=0,
                             text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA,
                                              "strict": True}})  # type: ignore[typeddict-item]
    assert set(json.loads(r.output_text)) == {"city"}


def test_a_function_tool_round_trip(sdk: openai.OpenAI) -> None:
    r = sdk.responses.create(model=SMOL, input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                             tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                             temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    out = sdk.responses.create(model=SMOL, previous_response_id=r.id, tools=[WEATHER],  # type: ignore[list-item]
                               max_output_tokens=30, temperature=0, input=[
                                   {"type": "function_call_output", "call_id": call.call_id,
                                    "output": json.dumps({"temperature_c": 18, "sky": "clear"})}])
    assert out.status in ("completed", "incomplete") and out.output_text


def test_the_default_embedder(sdk: openai.OpenAI) -> None:
    r = sdk.embeddings.create(model="all-minilm-l6-v2",
                              input=["The capital of France is Paris.", "Paris is France's capital.", "I like tea."])
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (3, 384) and v[0] @ v[1] > v[0] @ v[2]


def test_embeddings_and_responses_as_one_batch_each(sdk: openai.OpenAI) -> None:
    """The Batch API on the real default server: an embeddings batch gives the live vectors, a Responses batch the
    live answer (greedy)."""
    texts = ["The capital of France is Paris.", "Paris is France's capital.", "I like tea."]
    for endpoint, bodies in (
            ("/v1/embeddings", [{"model": "all-minilm-l6-v2", "input": t} for t in texts]),
            ("/v1/responses", [{"model": SMOL, "input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}])):
        data = "".join(json.dumps({"custom_id": f"x{i}", "method": "POST", "url": endpoint, "body": b}) + "\n"
                       for i, b in enumerate(bodies))
        fid = sdk.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id
        batch = sdk.batches.create(input_file_id=fid, endpoint=endpoint, completion_window="1h")  # type: ignore[arg-type]
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.2)
            batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id, batch
        out = {r["custom_id"]: r["response"]["body"]
               for r in map(json.loads, sdk.files.content(batch.output_file_id).text.splitlines())}
        if endpoint == "/v1/embeddings":
            live = sdk.embeddings.create(model="all-minilm-l6-v2", input=texts)
            for i, d in enumerate(live.data):
                assert np.allclose(out[f"x{i}"]["data"][0]["embedding"], d.embedding, atol=1e-5)
        else:
            live_text = sdk.responses.create(**bodies[0]).output_text  # type: ignore[arg-type]
            assert out["x0"]["output"][0]["content"][0]["text"] == live_text
