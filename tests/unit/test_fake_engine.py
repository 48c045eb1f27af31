import asyncio

import pytest

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.fake.engine import FakeEngine
from chorus.errors import ContextLengthExceeded, EngineFailed


def req(engine: FakeEngine, prompt: str = "x", **kw) -> GenerationRequest:
    return GenerationRequest(engine.tokenizer.encode(prompt), SamplingParams(**kw))


async def test_script_then_eos_stop() -> None:
    e = FakeEngine(script="Hi!")
    g = await e.generate(req(e, temperature=0))
    assert g.choices[0].text == "Hi!"
    assert g.choices[0].finish_reason == "stop"
    assert g.completion_tokens == 4  # three characters and the EOS token
    assert e.active_sessions == 0


async def test_length_and_stop_strings() -> None:
    e = FakeEngine()
    g = await e.generate(req(e, "a", temperature=0, max_tokens=5))
    assert (g.choices[0].text, g.choices[0].finish_reason) == ("bcdef", "length")
    g = await e.generate(req(e, "a", temperature=0, max_tokens=20, stop=("ef",)))
    assert (g.choices[0].text, g.choices[0].finish_reason) == ("bcd", "stop")


async def test_n_choices_and_seeds() -> None:
    e = FakeEngine(sharpness=1.0)
    a = await e.generate(req(e, "a", temperature=1.5, max_tokens=12, n=3, seed=5))
    b = await e.generate(req(e, "a", temperature=1.5, max_tokens=12, n=3, seed=5))
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice has its own seed


async def test_logprobs() -> None:
    e = FakeEngine(script="ab")
    g = await e.generate(req(e, temperature=0, logprobs=True, top_logprobs=2))
    lps = g.choices[0].logprobs
    assert lps is not None and [lp.token for lp in lps[:2]] == ["a", "b"]
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in lps)


async def test_context_window() -> None:
    e = FakeEngine(max_model_len=8)
    with pytest.raises(ContextLengthExceeded):
        await e.generate(req(e, "abcdef", max_tokens=5))


async def test_engine_failure_is_an_engine_error_and_frees_sessions() -> None:
    e = FakeEngine(script="abcdefgh", fail_after=3)
    with pytest.raises(EngineFailed):
        await e.generate(req(e, temperature=0, n=2))
    assert e.active_sessions == 0


async def test_cancelling_a_stream_closes_its_sessions() -> None:
    e = FakeEngine(delay=0.01, max_model_len=10_000)
    stream = e.stream(req(e, "a", max_tokens=1000, n=2))
    async for _ in stream:
        break
    assert e.active_sessions == 2
    await stream.aclose()
    await asyncio.sleep(0)
    assert e.active_sessions == 0
