"""`make serve`'s gateway with both default models, driven by the official openai SDK."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest
import torch

from chorus.server.gateway.services import services_of
from tests.helpers import GEMMA, QWEN, SMOL, LiveServer, wait_until

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(sdk: openai.OpenAI) -> None:
    listed = list(sdk.models.list())
    assert listed[0].id == QWEN  # the default chat model: the first id a new user sees
    models = {m.id: m for m in listed}
    assert {n for n, m in models.items() if not m.model_extra.get("ensemble")} == {
        QWEN,
        SMOL,
        "smollm2-moe",
        "smollm2-modr",
        "smollm2-reasonformer",
        GEMMA,
        "all-minilm-l6-v2",
    }
    assert {"average-default", "unite-default", "vote-default", "sc-default", "cascade-default"} <= set(models)
    assert not {"eot-default", "moa-default"} & set(models)  # deploy/configs/discussion.yaml: not a default


@pytest.mark.parametrize("model", [QWEN, SMOL, GEMMA])
def test_chat_with_each_default_model(sdk: openai.OpenAI, model: str) -> None:
    r = sdk.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert "User:" not in text  # gemma's fallback template stops at the next turn
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 24


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_chat_streaming(sdk: openai.OpenAI, model: str) -> None:
    plain = sdk.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=16)
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=16,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_is_raw_continuation(sdk: openai.OpenAI, real_server: LiveServer) -> None:
    prompt = "The capital of France is"
    r = sdk.completions.create(model=GEMMA, prompt=prompt, max_tokens=12, temperature=0)
    engine = services_of(real_server.app).engines[GEMMA]
    ids = engine.tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = engine.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert r.choices[0].text == engine.tokenizer.decode(ref[0, len(ids):])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_sampling_parameters(sdk: openai.OpenAI) -> None:
    def run(**kw):
        return sdk.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Tell me a story."}],
                                           max_tokens=20, **kw)

    a, b = run(temperature=0.9, top_p=0.9, seed=3, n=2), run(temperature=0.9, top_p=0.9, seed=3, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2 and a.usage.completion_tokens <= 40
    r = run(temperature=0, stop=[" "], logprobs=True, top_logprobs=2)
    assert " " not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    first = r.choices[0].logprobs.content[0]
    assert first.logprob <= 0 and first.top_logprobs[0].logprob >= first.top_logprobs[1].logprob


def test_context_length_exceeded(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "hello " * 5000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=GEMMA, prompt="hi", max_tokens=10_000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"


def test_unknown_model(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4o", messages=ASK)


def test_concurrent_requests_share_batches(sdk: openai.OpenAI, real_server: LiveServer) -> None:
    prompts = ["Name a fruit.", "Name a planet.", "Name a river.", "Name a poet."]

    def one(p: str) -> str:
        return sdk.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": p}],
                                           temperature=0, max_tokens=16).choices[0].message.content

    sequential = [one(p) for p in prompts]
    with cf.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, prompts)) == sequential


def test_disconnect_mid_stream_frees_the_kv_cache(real_server: LiveServer) -> None:
    engine = services_of(real_server.app).engines[SMOL]
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Write a long essay about rivers."}],
            "max_tokens": 2000, "stream": True, "temperature": 0.7, "ignore_eos": True}
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a collected line iterator closes the connection (a disconnect)
        for i, _ in enumerate(lines):
            if i >= 8:
                break
        assert engine.active_sessions == 1
    assert wait_until(lambda: engine.active_sessions == 0 and not engine.runner.rows, timeout=20)
