"""What chorus does not serve yet is a 400 naming the field (server/unsupported.py), never silently ignored;
harmless unknown fields stay accepted. Sent with the official openai SDK."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.helpers import LiveServer

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "kwargs,param,words",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
            "'image_url'",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}],
                    }
                ]
            },
            "messages[0].content[0]",
            "text parts only",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "'function' object"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "needs 'tool_call_id'"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream' is true"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "not supported"),
    ],
)
def test_unsupported_chat_fields_are_a_400_naming_them(client: openai.OpenAI, kwargs: dict[str, Any], param: str,
                                                       words: str) -> None:
    body = {"model": "fake", "messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param and words in err["message"], err


def test_what_changes_nothing_stays_accepted(client: openai.OpenAI, server: LiveServer) -> None:
    out = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=2,
        response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=False, modalities=["text"],
        logit_bias={}, user="u", metadata={"k": "v"}, store=False, extra_body={"some_future_field": 1})
    assert out.choices[0].message.content is not None
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 2,
                                                               "logprobs": True, "top_logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert "refusal" in lp and lp["refusal"] is None and len(lp["content"]) == 2  # OpenAI's schema requires it


def test_stream_options_on_a_text_completion_without_stream_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake", prompt="hi", max_tokens=2, stream_options={"include_usage": True})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "stream_options"
