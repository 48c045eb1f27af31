"""Log-likelihood scoring through /v1/completions: ``echo`` + ``logprobs`` (+ ``max_tokens: 0``), as vLLM
returns it: every prompt token with its logprob given the ones before it, ``null`` for the first."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from chorus.engines.core.generation import SessionEngine
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer


async def test_session_engines_score_prompts_exactly() -> None:
    engine = FakeEngine()
    ids = engine.tokenizer.encode("abcab")
    lps = await engine.prompt_logprobs(ids, 2)
    assert lps[0] is None and len(lps) == len(ids)
    session = engine.open_session()
    logits = await session.prefill(ids[:1])
    for i, token in enumerate(ids[1:], start=1):  # the same numbers as stepping a session by hand
        want = float(logits.float().log_softmax(-1)[token])
        got = lps[i]
        assert got is not None and got.logprob == pytest.approx(want) and len(got.top) == 2
        logits = await session.step(token)
    session.close()
    assert engine.active_sessions == 0
    assert SessionEngine.prompt_logprobs is FakeEngine.prompt_logprobs  # the generic path


def test_echo_with_logprobs_and_no_tokens(server: LiveServer) -> None:
    body = {"model": "fake", "prompt": "abcab", "echo": True, "logprobs": 1, "max_tokens": 0}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "abcab" and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == "abcab" and lp["text_offset"] == list(range(5))
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_logprobs_come_before_the_completions(server: LiveServer) -> None:
    body = {"model": "fake", "prompt": "ab", "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0}
    lp = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 + 3 and lp["token_logprobs"][0] is None
    assert lp["text_offset"] == [0, 1, 2, 3, 4]


def test_streamed_echo_carries_the_prompt_logprobs(server: LiveServer) -> None:
    body = {"model": "fake", "prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    first = json.loads(events[0])["choices"][0]
    assert first["text"] == "abc" and first["logprobs"]["token_logprobs"][0] is None
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": -1}, "max_tokens"),
])
def test_bad_scoring_requests(server: LiveServer, body: dict[str, object], param: str) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "fake", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_the_openai_sdk_scores_a_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt="abca", echo=True, logprobs=2, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "abca" and lp is not None and lp.token_logprobs is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == 4 and lp.top_logprobs is not None
    assert len(lp.top_logprobs[1]) == 2


def test_a_shared_vocabulary_ensemble_scores_with_its_mixture(server: LiveServer) -> None:
    """Two identical members: the mixture is the member, so the scores are the single model's."""
    one = {"model": "fake", "prompt": "abcab", "echo": True, "logprobs": 2, "max_tokens": 0}
    single = httpx.post(server.url + "/v1/completions", json=one).json()["choices"][0]["logprobs"]
    both = {**one, "ensemble": {"strategy": "logit_average", "members": ["fake", "fake"], "trace": True}}
    r = httpx.post(server.url + "/v1/completions", json=both)
    assert r.status_code == 200, r.text
    got = r.json()
    lp = got["choices"][0]["logprobs"]
    assert lp["tokens"] == single["tokens"] and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(single["token_logprobs"][1:], abs=1e-5)
    assert got["usage"]["prompt_tokens"] == 10 and got["usage"]["completion_tokens"] == 0  # both members scored


def test_other_strategies_refuse_prompt_scoring(server: LiveServer) -> None:
    body = {"model": "fake", "prompt": "ab", "echo": True, "max_tokens": 0,
            "ensemble": {"strategy": "crowd_vote", "members": ["fake", "fake"]}}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
