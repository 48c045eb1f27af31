"""Anthropic's Messages API on the real default models and ensembles, through Anthropic's own SDK."""

from __future__ import annotations

import anthropic
import pytest

from tests.helpers import SMOL, LiveServer

pytestmark = pytest.mark.integration
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
T0 = {"temperature": 0}


@pytest.fixture
def claude(real_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0, timeout=300)


def test_smollm2_and_an_ensemble_answer_through_the_sdk(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model=SMOL, max_tokens=24, messages=ASK, extra_body=T0)
    assert "Paris" in msg.content[0].text and msg.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model="sc-default", max_tokens=24, messages=ASK, extra_body=T0) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text and final.usage.output_tokens > 0
    assert claude.messages.count_tokens(model=SMOL, messages=ASK).input_tokens == msg.usage.input_tokens + \
        msg.usage.cache_read_input_tokens


def test_a_forced_tool_call_on_smollm2(claude: anthropic.Anthropic) -> None:
    weather = {"name": "get_weather", "description": "Current weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                "required": ["city"], "additionalProperties": False}}
    # one call: SmolLM2 under the JSON grammar would otherwise list the same call until max_tokens
    msg = claude.messages.create(model=SMOL, max_tokens=64, tools=[weather],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body=T0)
    use = next(b for b in msg.content if b.type == "tool_use")
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input.get("city"), str)
