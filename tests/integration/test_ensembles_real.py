"""Every strategy on the real default models (Qwen2.5-Coder-0.5B, SmolLM2, Gemma-3), through the live server and the
openai SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import yaml

from chorus.ensembles.similarity import Embedder
from tests.helpers import GEMMA, QWEN, SMOL

pytestmark = pytest.mark.integration
Q = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# the discussion ensembles of deploy/configs/discussion.yaml (not served by default), asked for per request
DISCUSSION = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "configs" / "discussion.yaml").read_text())
EOT, MOA = ({k: v for k, v in e.items() if k not in ("name", "description")} for e in DISCUSSION["ensembles"])


def ask(sdk: openai.OpenAI, model: str, ensemble: dict[str, Any] | None = None, **kw: Any) -> Any:
    return sdk.chat.completions.create(model=model, messages=Q, extra_body={"ensemble": ensemble} if ensemble else None,
                                       **kw)


def test_named_default_ensembles_are_listed(sdk: openai.OpenAI) -> None:
    cards = {m.id: m.model_extra.get("ensemble") for m in sdk.models.list()}
    strategies = {c["strategy"] for c in cards.values() if c}
    assert strategies == {"logit_average", "crowd_vote", "answer_vote", "route", "cascade"}
    assert cards["unite-default"]["members"] == [QWEN, SMOL]


def test_logit_average_of_a_model_with_itself_over_http(sdk: openai.OpenAI) -> None:
    single = ask(sdk, QWEN, temperature=0, max_tokens=24)
    for space in ("probability", "logit"):
        ens = ask(sdk, "average-default", {"space": space, "weights": [0.3, 0.7]}, temperature=0, max_tokens=24)
        assert ens.choices[0].message.content == single.choices[0].message.content
        assert ens.usage.completion_tokens == 2 * single.usage.completion_tokens


@pytest.mark.parametrize(("weights", "alone"), [([1, 0], QWEN), ([0, 1], SMOL)])
def test_topk_union_with_one_weight_is_that_member(sdk: openai.OpenAI, weights: list[int], alone: str) -> None:
    single = ask(sdk, alone, temperature=0, max_tokens=16)
    ens = ask(sdk, "unite-default", {"weights": weights, "trace": True}, temperature=0, max_tokens=16)
    assert ens.choices[0].message.content == single.choices[0].message.content
    assert set(ens.model_extra["ensemble"]["usage_by_member"]) == {QWEN, SMOL}


def test_the_gate_answers_with_the_greedy_text_where_it_does_not_sample(sdk: openai.OpenAI) -> None:
    """answer_vote with a gate on Qwen: a greedy answer above the threshold is the reply, its text the model's own
    temperature-0 answer, and nothing is sampled; under an unreachable threshold the samples are drawn."""
    single = ask(sdk, QWEN, temperature=0, max_tokens=24)
    body = {"strategy": "answer_vote", "members": [QWEN], "greedy": True, "samples": 2, "answer": "text",
            "trace": True}
    passed = ask(sdk, "ensemble", {**body, "gate": -5.0}, max_tokens=24)
    trace = passed.model_extra["ensemble"]
    assert trace["gate"]["passed"] and trace["drawn"] == 1, trace["gate"]
    assert passed.choices[0].message.content == single.choices[0].message.content
    sampled = ask(sdk, "ensemble", {**body, "gate": 0.5}, max_tokens=24, seed=3).model_extra["ensemble"]
    assert not sampled["gate"]["passed"] and sampled["drawn"] == 3


def test_the_online_stop_stops_qwens_samples_and_the_greedy_answer_is_the_reply(sdk: openai.OpenAI) -> None:
    """answer_vote with trace_stop on Qwen: under an unreachable threshold every sample is stopped once it has a
    window of tokens (its stream closed; it does not vote), so the greedy answer, Qwen's own temperature-0 text, is
    the reply; under an unreachable-low one no sample is stopped."""
    single = ask(sdk, QWEN, temperature=0, max_tokens=24)
    body = {"strategy": "answer_vote", "members": [QWEN], "greedy": True, "samples": 2, "batch": 2,
            "answer": "text", "window": 4, "trace": True}
    stopped = ask(sdk, "ensemble", {**body, "trace_stop": 1000.0}, max_tokens=24, seed=3)
    trace = stopped.model_extra["ensemble"]
    samples = [s for s in trace["samples"] if not s.get("greedy")]
    assert trace["trace_stop"]["stopped"] == 2 and [(s["finish_reason"], s["tokens"]) for s in samples] == \
        [("confidence", 4)] * 2
    assert stopped.choices[0].message.content == single.choices[0].message.content
    whole = ask(sdk, "ensemble", {**body, "trace_stop": -1.0}, max_tokens=24, seed=3).model_extra["ensemble"]
    assert whole["trace_stop"]["stopped"] == 0 and all(s["finish_reason"] != "confidence" for s in whole["samples"])


def test_topk_union_of_both_models_streams(sdk: openai.OpenAI) -> None:
    chunks = list(ask(sdk, "unite-default", temperature=0, max_tokens=16, stream=True,
                      stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.prompt_tokens > 0


def test_embedding_cosine_matches_sentence_transformers(sdk: openai.OpenAI) -> None:
    cands = ["Paris is the capital of France.", "The capital of France is Paris.", "France's capital city is Paris.",
             "Bananas are yellow and grow in bunches."]
    resp = ask(sdk, "vote-default", {"candidates": cands, "trace": True})
    t = resp.model_extra["ensemble"]
    assert resp.choices[0].message.content in cands[:3]
    assert int(np.argmin(t["scores"])) == 3  # the outlier scores lowest
    emb = Embedder.model().encode(cands, normalize_embeddings=True)
    sim = emb @ emb.T
    assert t["scores"] == pytest.approx((sim.sum(1) - np.diag(sim)).tolist(), abs=1e-5)


def test_crowd_vote_from_members(sdk: openai.OpenAI) -> None:
    resp = ask(sdk, "vote-default", {"trace": True}, max_tokens=24)
    t = resp.model_extra["ensemble"]
    assert len(t["candidates"]) == 3
    assert resp.choices[0].message.content == t["candidates"][t["winner"]["index"]]["text"]
    assert resp.usage.completion_tokens == sum(u["completion_tokens"] for u in t["usage_by_member"].values())


def test_exchange_of_thought(sdk: openai.OpenAI) -> None:
    q = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have now?"}]
    resp = sdk.chat.completions.create(model=SMOL, messages=q, temperature=0, max_tokens=48,
                                       extra_body={"ensemble": {**EOT, "trace": True, "max_rounds": 1}})
    t = resp.model_extra["ensemble"]
    assert 1 <= len(t["rounds"]) <= 2 and t["reason"]
    assert t["usage"]["calls"] == 3 * len(t["rounds"])
    assert resp.choices[0].message.content


def test_eot_answers_a_general_question_in_plain_text(sdk: openai.OpenAI) -> None:
    """answer: auto reads a general question as text; the members' replies agree on Paris (in their words)."""
    q = [{"role": "user", "content": "What is the capital of France?"}]
    resp = sdk.chat.completions.create(model=SMOL, messages=q, temperature=0, max_tokens=48,
                                       extra_body={"ensemble": {**EOT, "trace": True, "max_rounds": 1}})
    t = resp.model_extra["ensemble"]
    assert t["answer_type"] == "text" and "Paris" in t["answer"]
    assert "Paris" in (resp.choices[0].message.content or "") and "The answer is: X" not in resp.choices[0].message.content
    assert all(a["answer"] for a in t["rounds"][0]["agents"][:2])


def test_mixture_of_agents_streams_the_aggregator(sdk: openai.OpenAI) -> None:
    chunks = list(ask(sdk, SMOL, {**MOA, "trace": True}, temperature=0, max_tokens=32, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 2  # token by token
    t = chunks[-1].model_extra["ensemble"]
    assert len(t["layers"][0]) == 2 and t["winner"]["member"] == f"aggregator:{SMOL}"


def test_mixture_of_agents_quorum_and_judge_per_request(sdk: openai.OpenAI) -> None:
    """A quorum of one (the other proposer is cancelled), the judge-skip test (one proposal: no skip), and
    Gemma as the judge for this request only."""
    r = ask(sdk, SMOL, {**MOA, "trace": True, "quorum": 1, "skip_judge": True, "aggregator": GEMMA},
            temperature=0, max_tokens=24)
    t = r.model_extra["ensemble"]
    layer = t["quorum"]["layers"][0]
    assert len(layer["replied"]) == 1 and len(layer["late"]) == 1 and len(t["layers"][0]) == 1
    assert t["judge"]["model"] == GEMMA and t["judge"]["why_not"] == "fewer than two proposals"
    assert (r.choices[0].message.content or "").strip() and f"aggregator:{GEMMA}" in t["usage_by_member"]


def test_logit_average_refuses_different_vocabularies(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="topk_union"):
        ask(sdk, SMOL, {"strategy": "logit_average", "members": [SMOL, GEMMA]})


@pytest.mark.parametrize(("model", "text", "member"), [
    ("route-default", "A baker makes 14 loaves a day for 6 days and sells 70. How many are left?", QWEN),
    ("route-default", "Hi! What's a nice thing to do on a rainy afternoon?", SMOL),
    ("cost-default", "A baker makes 14 loaves a day for 6 days and sells 70. How many are left?", QWEN),
    ("cost-default", "Hi! What's a nice thing to do on a rainy afternoon?", SMOL),
])
def test_default_routers(sdk: openai.OpenAI, model: str, text: str, member: str) -> None:
    resp = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=8,
                                       temperature=0, extra_body={"ensemble": {"trace": True}})
    assert resp.model_extra["ensemble"]["winner"]["member"] == member
    assert resp.usage.completion_tokens > 0


def test_default_cascade(sdk: openai.OpenAI) -> None:
    resp = ask(sdk, "cascade-default", {"trace": True}, temperature=0, max_tokens=16)
    t = resp.model_extra["ensemble"]
    assert t["steps"][0]["member"] == SMOL and t["winner"]["member"] in (SMOL, QWEN)
    assert t["usage"]["calls"] == len(t["steps"])
    forced = ask(sdk, "cascade-default", {"trace": True, "threshold": -0.0001}, temperature=0, max_tokens=16)
    assert [s["member"] for s in forced.model_extra["ensemble"]["steps"]] == [SMOL, QWEN]
