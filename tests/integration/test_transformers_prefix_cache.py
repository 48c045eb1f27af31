"""The transformers engine's prefix cache (engines/transformers/prefix_store.py) on the real SmolLM2: a hit gives a
cold prefill's logits (to float rounding) and the same greedy and seeded outputs; usage reports it through the
openai SDK (chat, streamed, Responses); the MoE family reuses prefixes, MoDr and ReasonFormer do not."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.transformers.engine import TransformersEngine
from chorus.engines.transformers.prefix_store import PrefixStore
from tests.helpers import SMOL, LiveServer

pytestmark = pytest.mark.integration

SYSTEM = " ".join(f"Rule {i}: answer politely and briefly, and cite rule {i} when it applies." for i in range(12))
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "How many legs has a spider?"]


def chat(engine: TransformersEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


@contextmanager
def cache_off(engine: TransformersEngine) -> Iterator[None]:
    store, engine.runner.prefix = engine.runner.prefix, PrefixStore(0)
    try:
        yield
    finally:
        engine.runner.prefix = store


async def prefill(engine: TransformersEngine, ids: list[int],
                  scope: RequestScope | None = None) -> tuple[torch.Tensor, int]:
    s = engine.open_session(scope)
    try:
        return await s.prefill(ids), s.cached
    finally:
        s.close()


async def test_a_hit_gives_a_cold_prefills_logits_and_outputs(smol_engine: TransformersEngine) -> None:
    await smol_engine.drop_prefix_cache()
    store = smol_engine.runner.prefix
    assert store.enabled and store.budget_bytes == 256 << 20  # on by default
    first, second = chat(smol_engine, QUESTIONS[0]), chat(smol_engine, QUESTIONS[1])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 150
    with cache_off(smol_engine):
        cold, cached = await prefill(smol_engine, second)
        assert cached == 0
        greedy_cold = await smol_engine.generate(GenerationRequest(second, SamplingParams(temperature=0, max_tokens=24)))
        seeded_cold = await smol_engine.generate(
            GenerationRequest(second, SamplingParams(temperature=0.8, seed=7, max_tokens=24, n=2)))
    hits = store.hits
    _, cached = await prefill(smol_engine, first)
    assert cached == 0 and store.held_tokens == len(first)
    warm, cached = await prefill(smol_engine, second)
    assert cached == shared and store.hits == hits + 1
    # the rest is computed after the cached columns, as chunked prefill does: equal up to float rounding
    assert float((warm - cold).abs().max()) < 1e-4
    greedy = await smol_engine.generate(GenerationRequest(second, SamplingParams(temperature=0, max_tokens=24)))
    assert greedy.cached_tokens == len(second) - 1  # the second prompt itself is now cached: all but its last token
    assert greedy.choices[0].token_ids == greedy_cold.choices[0].token_ids
    seeded = await smol_engine.generate(
        GenerationRequest(second, SamplingParams(temperature=0.8, seed=7, max_tokens=24, n=2)))
    assert [c.token_ids for c in seeded.choices] == [c.token_ids for c in seeded_cold.choices]
    stats = smol_engine.stats()
    assert stats["prefix_cache_hits"] == store.hits and stats["prefix_cache_tokens"] == store.held_tokens
    names = {m[0] for m in smol_engine.family_metrics()}
    assert {"chorus_prefix_cache_lookups_total", "chorus_prefix_cache_bytes"} <= names
    assert await smol_engine.drop_prefix_cache() > 0 and store.held_bytes == 0


async def test_a_salt_or_a_small_budget_computes_everything(smol_engine: TransformersEngine) -> None:
    await smol_engine.drop_prefix_cache()
    ids = chat(smol_engine, QUESTIONS[2])
    store = smol_engine.runner.prefix
    await prefill(smol_engine, ids)
    assert store.held_tokens == len(ids)  # the first prompt was stored (without a salt)
    tenant_b = RequestScope(salt="tenant-b")
    assert (await prefill(smol_engine, ids, tenant_b))[1] == 0  # stored without a salt: not tenant-b's
    assert (await prefill(smol_engine, ids, tenant_b))[1] == len(ids) - 1  # tenant-b's own, stored just now: a hit
    assert (await prefill(smol_engine, ids))[1] == len(ids) - 1  # the unsalted entry still serves unsalted requests
    smol_engine.runner.prefix = PrefixStore(64 << 10)  # less than this prompt
    try:
        await prefill(smol_engine, ids)
        assert (await prefill(smol_engine, ids))[1] == 0 and smol_engine.runner.prefix.entries == []
    finally:
        smol_engine.runner.prefix = store


def test_usage_reports_cached_tokens_through_the_sdk(sdk: openai.OpenAI, real_server: LiveServer) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    sdk.chat.completions.create(model=SMOL, messages=messages, max_tokens=4, temperature=0)
    messages[1]["content"] = QUESTIONS[1]
    warm = sdk.chat.completions.create(model=SMOL, messages=messages, max_tokens=4, temperature=0)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert 150 < warm.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens
    stream = sdk.chat.completions.create(model=SMOL, messages=messages, max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens > 150
    response = sdk.responses.create(model=SMOL, instructions=SYSTEM, input=QUESTIONS[2], max_output_tokens=8,
                                    temperature=0)
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens > 150
    text = httpx.get(real_server.url + "/metrics").text
    assert f'chorus_prefix_cache_lookups_total{{model="{SMOL}",result="hit"}}' in text


@pytest.mark.parametrize(("model", "reuses"), [("smollm2-moe", True), ("smollm2-modr", False),
                                               ("smollm2-reasonformer", False)])
def test_which_families_reuse_prefixes(sdk: openai.OpenAI, model: str, reuses: bool) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    answers, cached = [], []
    for _ in range(2):
        r = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        answers.append(r.choices[0].message.content)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert answers[0] == answers[1]
    assert (cached[1] > 150) == reuses
