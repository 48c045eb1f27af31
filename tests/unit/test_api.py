"""The HTTP API over fake engines, through a real server and the official openai SDK."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest

from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, wait_until


def test_models_and_health(client: openai.OpenAI, server: LiveServer) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["fake", "scripted", "slow", "broken"]
    assert client.models.retrieve("fake").id == "fake"
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and "fake" in h["models"]


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "scripted" and r.system_fingerprint and r.created > 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "Hello there. STOP here."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len("Hello there. STOP here.") + 1
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stop_max_tokens_n_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, stop=["STOP"], n=2, logprobs=True, top_logprobs=3)
    assert [c.message.content for c in r.choices] == ["Hello there. ", "Hello there. "]
    assert r.choices[1].index == 1 and r.choices[0].finish_reason == "stop"
    lp = r.choices[0].logprobs.content
    assert lp[0].token == "H" and lp[0].logprob <= 0 and len(lp[0].top_logprobs) == 3
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, max_tokens=5)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello", "length")


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there. STOP here."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_ends_with_done(server: LiveServer) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[1][5:])["object"] == "chat.completion.chunk"


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt="a", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == "bcde"
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == 1
    r = client.completions.create(model="fake", prompt=["a", "k"], max_tokens=2, temperature=0, echo=True, n=2)
    assert [c.text for c in r.choices] == ["abc", "abc", "klm", "klm"]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    r = client.completions.create(model="fake", prompt=[65, 66], max_tokens=1, temperature=0, logprobs=2)
    assert r.choices[0].logprobs.tokens == [
        "c"
    ]  # ids 65, 66 are "ab" and len(r.choices[0].logprobs.top_logprobs[0]) == 2
    stream = client.completions.create(model="fake", prompt="a", max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "bcde"
    texts: dict[int, str] = {}
    for c in client.completions.create(model="fake", prompt=["a", "k"], max_tokens=3, temperature=0, stream=True):
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {0: "bcd", 1: "lmn"}


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        return client.completions.create(model="fake", prompt="a", max_tokens=20, temperature=2.0,
                                         seed=seed).choices[0].text

    assert run(11) == run(11)


def test_model_sampling_defaults_apply_when_the_request_leaves_them_out(start_gateway: Any) -> None:
    srv = start_gateway({"models": [{"name": "greedy-by-default", "engine": "fake", "fake": {"sharpness": 1.0},
                                     "sampling_defaults": {"temperature": 0}}]})
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    texts = {c.completions.create(model="greedy-by-default", prompt="a", max_tokens=8).choices[0].text
             for _ in range(3)}
    assert texts == {"bcdefghi"}  # the model's default (greedy), not OpenAI's temperature 1
    hot = {c.completions.create(model="greedy-by-default", prompt="a", max_tokens=8, temperature=2.0,
                                seed=s).choices[0].text for s in range(4)}
    assert hot != {"bcdefghi"}  # an explicit temperature wins


def test_unknown_fields_are_ignored(server: LiveServer) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
            "some_future_field": {"x": 1}, "ensemble_hint": 3}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200


def test_continue_final_message_continues_the_assistants_partial_turn(client: openai.OpenAI,
                                                                       fakes: dict[str, FakeEngine]) -> None:
    """vLLM's extension: the last message is the assistant's partial answer and the model goes on from its last
    token (the fake writes the characters that follow the prompt's last one), not from a new turn."""
    partial = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "abc"}]
    r = client.chat.completions.create(model="fake", messages=partial, max_tokens=3, temperature=0,
                                       extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == "def"
    tok = fakes["fake"].tokenizer
    assert r.usage.prompt_tokens == len(tok.encode_chat(partial[:1]) + tok.encode_text("abc"))
    plain = client.chat.completions.create(model="fake", messages=partial, max_tokens=3, temperature=0)
    assert plain.choices[0].message.content != "def"  # without it the assistant's turn is a finished one


@pytest.mark.parametrize("messages,extra", [
    ([{"role": "user", "content": "a"}], {}),  # no partial answer to continue
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], {}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     {"ensemble": {"strategy": "answer_vote", "members": ["fake"], "samples": 2}}),
])
def test_continue_final_message_refuses_what_it_cannot_continue(server: LiveServer, messages: list[Any],
                                                                 extra: dict[str, Any]) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "fake", "messages": messages, "max_tokens": 2,
                                                              "continue_final_message": True, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


# ---- errors ----

def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "fake" in e.value.body["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": "fake", "messages": [{"role": "user", "content": "a"}], "temperature": 3}, "temperature"),
    ({"model": "fake", "messages": [{"role": "user", "content": "a"}], "n": 0}, "n"),
    ({"model": "fake", "messages": [{"role": "user", "content": "a"}], "n": 9}, "n"),
    ({"model": "fake", "messages": []}, "messages"),
    ({"model": "fake", "messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a"}]}, "model"),
    ({"model": "fake", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "fake", "messages": [{"role": "user", "content": "a"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "fake", "prompt": "a", "suffix": "b"}, "suffix"),
    ({"model": "fake", "prompt": [1, 99999]}, "prompt"),
])
def test_invalid_parameters_are_400_with_param(server: LiveServer, body: dict, param: str) -> None:
    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_invalid_json_is_400(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a" * 40}],
                                       max_tokens=30)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "64" in e.value.body["message"]


def test_body_too_large_is_413(client: openai.OpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a" * 100_000}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while reading
        for _ in range(100):
            yield b" " * 1024

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_engine_failure_is_500_and_server_stays_up(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "a"}], max_tokens=10)
    assert e.value.body["code"] == "engine_failed"
    assert client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "a"}], max_tokens=2)


def test_unknown_route_and_method(server: LiveServer) -> None:
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ---- disconnects ----

def test_stream_disconnect_frees_sessions(server: LiveServer, fakes: dict[str, FakeEngine]) -> None:
    slow = fakes["slow"]
    body = {"model": "slow", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5000, "stream": True, "n": 2}
    steps0 = slow.steps
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
        # (a mid-stream `active_sessions == 2` check here failed now and then when this module runs
        # alone; see the closing note of issue 2 - the real-model disconnect test checks it reliably)
    assert wait_until(lambda: slow.active_sessions == 0), slow.active_sessions
    assert slow.steps - steps0 < 100  # the 5000-token generation was cancelled, not run to the end


def test_non_stream_disconnect_frees_sessions(server: LiveServer, fakes: dict[str, FakeEngine]) -> None:
    slow = fakes["slow"]
    body = {"model": "slow", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5000}

    def call() -> None:
        try:
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=call)
    t.start()
    assert wait_until(lambda: slow.active_sessions == 1, timeout=5)
    t.join()
    assert wait_until(lambda: slow.active_sessions == 0), slow.active_sessions
