"""Structured outputs and function calling on the real default models (SmolLM2's 49k vocabulary, Gemma's 262k),
with the openai SDK: hypothesis-drawn JSON schemas (unbounded numbers and strings too) always validate,
the SDK's ``parse`` helper works on a model and on a named ensemble, a forced call is valid on a model
without tool support, and the native ``<tool_call>`` grammar decodes on a real vocabulary."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from chorus.engines.core import tool_calls
from chorus.engines.core.base import SamplingParams, Tools
from chorus.engines.core.generation import collect, decode_loop
from chorus.engines.core.sampling import make_generator
from chorus.engines.transformers.engine import TransformersEngine
from tests.helpers import GEMMA, SMOL

PROMPT = [{"role": "user", "content": "Invent a small record about a city and answer in JSON."}]
# unbounded numbers (chorus holds them to I-JSON's range); strings bounded: an unbounded one can loop until
# max_tokens on a 135M model at temperature 0.7 (README "Structured outputs": measured)
LEAF = st.sampled_from([
    {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string", "maxLength": 40},
    {"type": "string", "enum": ["north", "south"]}, {"type": "integer", "minimum": 1, "maximum": 9},
])
NAMES = st.sampled_from(["name", "city", "population", "river", "founded", "capital", "tags", "mayor"])
SCHEMAS = st.recursive(
    st.builds(lambda props: {"type": "object", "properties": props, "required": list(props),
                             "additionalProperties": False}, st.dictionaries(NAMES, LEAF, min_size=1, max_size=3)),
    lambda kids: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props, "required": list(props),
                                 "additionalProperties": False}, st.dictionaries(NAMES, kids, min_size=1, max_size=3)),
        st.builds(lambda s: {"type": "array", "items": s, "maxItems": 3}, kids)),
    max_leaves=5)


@pytest.mark.parametrize("model", [SMOL, GEMMA])
@settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.generate],  # no shrinking on a real model
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 0.7]))
def test_drawn_schemas_always_validate_on_real_models(sdk: openai.OpenAI, model: str, schema: dict[str, Any],
                                                      temperature: float) -> None:
    out = sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=256, temperature=temperature, seed=7,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "record", "schema": schema}})
    c = out.choices[0]
    assert c.finish_reason == "stop", (schema, c.message.content)
    jsonschema.validate(json.loads(c.message.content or ""), schema)


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.mark.parametrize("model", [SMOL, "average-default"])
def test_the_sdk_parse_helper_on_a_model_and_an_ensemble(sdk: openai.OpenAI, model: str) -> None:
    out = sdk.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe Paris."}],
                                     response_format=City, temperature=0, max_tokens=128)
    assert isinstance(out.choices[0].message.parsed, City)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


# Gemma (a base model) allowed parallel calls repeats the same call until max_tokens at temperature 0: one call
@pytest.mark.parametrize("model,parallel", [(SMOL, True), (GEMMA, False)])
def test_a_forced_call_is_valid_on_models_without_tool_templates(sdk: openai.OpenAI, model: str,
                                                                 parallel: bool) -> None:
    out = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                      tools=[WEATHER], tool_choice="required", parallel_tool_calls=parallel,
                                      temperature=0, max_tokens=128)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[union-attr,index]


async def test_the_native_tool_call_grammar_decodes_on_a_real_vocabulary(smol_engine: TransformersEngine) -> None:
    """The Hermes ``<tool_call>`` blocks (Qwen2.5's format) forced on SmolLM2's vocabulary: two parallel calls
    allowed, the answer parses into valid calls."""
    tools = Tools(json.dumps([WEATHER["function"]]), "required", parallel=True)
    constraint = tool_calls.constraint(tools, native=True)
    assert constraint is not None and constraint.kind == "grammar"
    params = SamplingParams(temperature=0.0, max_tokens=120, constraint=constraint)
    tok = smol_engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Weather in Oslo and in Rome? Use <tool_call> blocks."}])
    session = smol_engine.open_session()
    try:
        logits = await session.prefill(prompt)
        choices = await collect(decode_loop(session, logits, tok, params, 120, 0, make_generator(0)), False)
    finally:
        session.close()
    text = choices[0].text
    assert choices[0].finish_reason == "stop" and text.startswith("<tool_call>\n"), text
    content, calls = tool_calls.parse(text, tools)
    assert content is None and calls and all(c.name == "get_weather" for c in calls), text
    assert torch.is_tensor(logits)
