"""Equivalences on the real smollm2: the strongest tests of the engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.transformers.batching import BatchRunner
from chorus.engines.transformers.engine import TransformersEngine
from tests.helpers import drained

pytestmark = pytest.mark.integration

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
             "Explain gravity in one sentence, please, to a child who is five years old."]


def chat_ids(engine: TransformersEngine, q: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": q}])


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


async def test_greedy_matches_model_generate(smol_engine: TransformersEngine) -> None:
    ids = chat_ids(smol_engine, QUESTIONS[0])
    g = await smol_engine.generate(GenerationRequest(ids, greedy(32)))
    with torch.inference_mode():
        ref = smol_engine.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    ref_ids = ref[0, len(ids):].tolist()
    assert g.choices[0].token_ids == ref_ids[: len(g.choices[0].token_ids)]
    assert "Paris" in g.choices[0].text


async def assert_session_matches_full_forward(engine: TransformersEngine, ids: list[int], steps: int,
                                              atol: float) -> None:
    """Greedy-step a session; at every step its logits equal a full forward pass over the sequence."""
    session = engine.open_session()
    try:
        logits = await session.prefill(ids)
        seq = list(ids)
        for _ in range(steps):
            with torch.inference_mode():
                full = engine.model(torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(logits, full, atol=atol), float((logits - full).abs().max())
            token = int(torch.argmax(logits))
            seq.append(token)
            logits = await session.step(token)
    finally:
        session.close()


async def test_kv_cached_decode_equals_full_forward(smol_engine: TransformersEngine) -> None:
    await assert_session_matches_full_forward(smol_engine, chat_ids(smol_engine, QUESTIONS[1]), 6, atol=1e-4)


async def test_concurrent_requests_batch_and_match_sequential(smol_engine: TransformersEngine) -> None:
    reqs = [GenerationRequest(chat_ids(smol_engine, q), greedy(20)) for q in QUESTIONS]
    sequential = [(await smol_engine.generate(r)).choices[0].token_ids for r in reqs]
    steps0 = smol_engine.runner.steps

    async def late(r: GenerationRequest, delay: float):  # join while others are decoding
        await asyncio.sleep(delay)
        return await smol_engine.generate(r)

    results = await asyncio.gather(*(late(r, 0.15 * i) for i, r in enumerate(reqs)))
    assert [g.choices[0].token_ids for g in results] == sequential
    # shared steps: far fewer forward passes than the sum of all tokens
    assert smol_engine.runner.steps - steps0 < sum(len(s) for s in sequential)
    assert await drained(smol_engine)


async def test_simultaneous_prompts_prefill_together_and_match_sequential(smol_engine: TransformersEngine) -> None:
    reqs = [GenerationRequest(chat_ids(smol_engine, q), greedy(12)) for q in QUESTIONS]
    sequential = [(await smol_engine.generate(r)).choices[0].token_ids for r in reqs]
    await smol_engine.drop_prefix_cache()  # cold prompts group; a prefix cache hit is prefilled alone (its rest)
    steps0 = smol_engine.runner.steps
    results = await asyncio.gather(*(smol_engine.generate(r) for r in reqs))
    assert [g.choices[0].token_ids for g in results] == sequential
    assert smol_engine.runner.steps - steps0 <= 14  # one grouped prefill step, then shared decode steps


async def test_chunked_prefill_matches_one_shot(smol_engine: TransformersEngine) -> None:
    ids = chat_ids(smol_engine, QUESTIONS[3] * 3)
    one = BatchRunner(smol_engine.model, max_model_len=2048, prefill_chunk=4096)
    chunked = BatchRunner(smol_engine.model, max_model_len=2048, prefill_chunk=7)
    out = []
    for runner in (one, chunked):
        s = runner.open_many(1)
        out.append(await runner.submit_prefill(s, ids))
        out.append(await s[0].step(42))
        s[0].close()
        await runner.stop()
    assert torch.allclose(out[0], out[2], atol=1e-4)
    assert torch.allclose(out[1], out[3], atol=1e-4)


async def test_n_choices_share_one_prefill(smol_engine: TransformersEngine) -> None:
    ids = chat_ids(smol_engine, QUESTIONS[2])
    one = await smol_engine.generate(GenerationRequest(ids, greedy(12)))
    three = await smol_engine.generate(GenerationRequest(ids, greedy(12, n=3)))
    assert [c.token_ids for c in three.choices] == [one.choices[0].token_ids] * 3
    sampled = await smol_engine.generate(
        GenerationRequest(ids, SamplingParams(temperature=1.2, max_tokens=12, n=3, seed=1))
    )
    again = await smol_engine.generate(
        GenerationRequest(ids, SamplingParams(temperature=1.2, max_tokens=12, n=3, seed=1))
    )
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert len({c.text for c in sampled.choices}) > 1


async def test_logit_average_of_a_model_with_itself_is_the_model(smol_engine: TransformersEngine) -> None:
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage

    ids = chat_ids(smol_engine, QUESTIONS[0])
    single = await smol_engine.generate(GenerationRequest(ids, greedy(16)))
    steps0 = smol_engine.runner.steps
    ens = await LogitAverage([smol_engine, smol_engine]).generate(GenerationRequest(ids, greedy(16)))
    assert ens.choices[0].token_ids == single.choices[0].token_ids
    # both members' sessions decode in the same forward pass of the shared runner
    assert smol_engine.runner.steps - steps0 <= len(single.choices[0].token_ids) + 1
    assert smol_engine.active_sessions == 0


async def test_concurrent_ensemble_requests_share_forward_passes(smol_engine: TransformersEngine) -> None:
    """Three logit_average requests at once: 6 member sessions, all stepped by the same forwards."""
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage

    ens = LogitAverage([smol_engine, smol_engine])
    reqs = [GenerationRequest(chat_ids(smol_engine, q), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            for q in QUESTIONS[:3]]
    alone = [await ens.generate(r) for r in reqs]
    steps0 = smol_engine.runner.steps
    together = await asyncio.gather(*(ens.generate(r) for r in reqs))
    assert [g.choices[0].token_ids for g in together] == [g.choices[0].token_ids for g in alone]
    assert smol_engine.runner.steps - steps0 <= 12 + 3  # not 3 x 12: one forward per step for all six sessions
    assert smol_engine.active_sessions == 0


async def test_gemma_sliding_window_with_chunked_prefill_equals_full_forward(default_config) -> None:  # type: ignore[no-untyped-def]
    """A 562-token prompt: longer than Gemma 3's 512-token sliding window and than one prefill chunk."""
    from tests.helpers import GEMMA

    engine = TransformersEngine.load(default_config.model(GEMMA))
    await engine.start()
    try:
        ids = engine.tokenizer.encode("Once upon a time " * 140)
        assert len(ids) > max(engine.runner.sliding_window or 0, engine.runner.prefill_chunk)
        await assert_session_matches_full_forward(engine, ids, 3, atol=1e-3)
    finally:
        await engine.aclose()


async def test_prompt_scoring_in_one_forward_equals_stepping_a_session(smol_engine: TransformersEngine) -> None:
    """``echo`` + ``logprobs`` scoring: the whole-prompt forward on the runner's thread gives the same
    logprobs (1e-4) and top tokens as the KV-cached session stepped token by token."""
    from chorus.engines.core.generation import SessionEngine

    ids = smol_engine.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
    fast = await smol_engine.prompt_logprobs(ids, 3)
    slow = await SessionEngine.prompt_logprobs(smol_engine, ids, 3)
    assert fast[0] is None and slow[0] is None and len(fast) == len(slow) == len(ids)
    for a, b in zip(fast[1:], slow[1:]):
        assert a is not None and b is not None
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t.token for t in a.top][:1] == [t.token for t in b.top][:1]
    assert smol_engine.active_sessions == 0
