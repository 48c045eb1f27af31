"""Ensemble strategies over fake engines, through a live server and the openai SDK."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.core.base import Delta
from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.base import Strategy
from chorus.ensembles.call import Call, gather
from tests.helpers import LiveServer, gateway, wait_until


def converts(prompt: str) -> str:
    """An agent that answers 7 alone and 42 once it has seen other agents' solutions."""
    return "I checked the others. The answer is 42." if "Solutions from other agents" in prompt else "The answer is 7."


def forgets(prompt: str) -> str:
    """An agent that answers 8 alone and loses its answer once it has seen others (a small model's placeholder)."""
    return '"The answer is X"' if "Solutions from other agents" in prompt else "The answer is 8."


def never_agrees(prompt: str) -> str:
    return "The answer is 9." if "Solutions from other agents" in prompt else "The answer is 8."


class Longest(Strategy):
    """A third-party strategy registered from the config: the longest member answer wins."""

    async def stream(self, call: Call) -> AsyncIterator[Delta]:
        gens = await gather(*(call.generate(m) for m in self.members))
        texts = [g.choices[0].text for _, g in call.survivors(gens, self.members)]
        best = max(texts, key=len)
        call.trace["winner"] = {"text": best}
        yield Delta(0, best, finish_reason="stop")


CONFIG = {
    "server": {"limits": {"max_n": 8}},
    "models": [{"name": n, "engine": "fake"}
               for n in ("fake", "a42", "b42", "c7", "stub", "agg", "broken", "odd", "textonly", "forgets")],
    "strategies": {"longest": "tests.unit.test_ensembles:Longest"},
    "ensembles": [
        {"name": "vote-test", "strategy": "crowd_vote", "members": ["a42", "b42", "c7"], "metric": "word_rouge_l"},
        {"name": "avg-test", "strategy": "logit_average", "members": ["fake", "fake"]},
        {"name": "eot-test", "strategy": "exchange_of_thought", "members": ["a42", "b42", "c7"], "topology": "relay"},
        {"name": "moa-test", "strategy": "mixture_of_agents", "members": ["a42", "c7"], "aggregator": "agg"},
        {"name": "longest-test", "strategy": "longest", "members": ["a42", "agg"]},
    ],
}


@pytest.fixture(scope="module")
def fakes() -> dict[str, FakeEngine]:
    odd = FakeEngine("odd", max_model_len=4000)
    odd.tokenizer.vocab = list(odd.tokenizer.vocab)
    odd.tokenizer.vocab[0] = "~~"  # another vocabulary
    textonly = FakeEngine("textonly", script="The answer is 42.", max_model_len=4000)
    textonly.capabilities = frozenset({"text", "stream"})  # like a remote worker without full logits
    return {
        "textonly": textonly,
        "fake": FakeEngine("fake", max_model_len=4000),
        "a42": FakeEngine("a42", script="Six times seven. The answer is 42.", max_model_len=4000),
        "b42": FakeEngine("b42", script="The answer is 42.", max_model_len=4000),
        "c7": FakeEngine("c7", reply=converts, max_model_len=4000),
        "stub": FakeEngine("stub", reply=never_agrees, max_model_len=4000),
        "forgets": FakeEngine("forgets", reply=forgets, max_model_len=4000),
        "agg": FakeEngine("agg", script="Combined: 42.", max_model_len=4000, delay=0.001),
        "broken": FakeEngine("broken", script="abcdefghijklmnop", fail_after=0, max_model_len=4000),
        "odd": odd,
    }


@pytest.fixture(scope="module")
def server(fakes: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG), engines=dict(fakes)) as srv:
        yield srv
    assert {n: e.active_sessions for n, e in fakes.items()} == dict.fromkeys(fakes, 0)


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, ensemble: dict[str, Any] | None = None, model: str = "fake", **kw: Any) -> Any:
    extra = {"ensemble": ensemble} if ensemble is not None else None
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 6*7?"}],
                                          extra_body=extra, **kw)


def trace_of(resp: Any) -> dict[str, Any]:
    return resp.model_extra["ensemble"]


# ---- logit_average ----

def test_logit_average_of_a_model_with_itself_is_the_model(client: openai.OpenAI) -> None:
    single = chat(client, temperature=0, max_tokens=12)
    ens = chat(client, {"strategy": "logit_average", "members": ["fake", "fake"], "trace": True},
               temperature=0, max_tokens=12)
    assert ens.choices[0].message.content == single.choices[0].message.content
    assert ens.usage.completion_tokens == 2 * single.usage.completion_tokens  # usage sums the members
    assert ens.usage.prompt_tokens == 2 * single.usage.prompt_tokens
    t = trace_of(ens)
    assert t["strategy"] == "logit_average" and t["weights"] == [0.5, 0.5]
    assert [m["label"] for m in t["members"]] == ["fake", "fake#2"]


def test_logit_average_weights_pick_a_member_and_stream(client: openai.OpenAI) -> None:
    ens = {"strategy": "logit_average", "members": ["a42", "b42"], "weights": [1, 0]}
    resp = chat(client, ens, temperature=0)
    assert resp.choices[0].message.content == "Six times seven. The answer is 42."
    chunks = list(chat(client, {**ens, "weights": [0, 2]}, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The answer is 42."
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5  # token by token
    assert chunks[-1].usage.completion_tokens == 2 * (len(text) + 1)


def test_logit_average_n_and_logprobs(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "logit_average", "members": ["fake", "fake"]}, n=3, max_tokens=4,
                seed=1, logprobs=True, top_logprobs=2)
    assert len(resp.choices) == 3
    assert all(len(c.logprobs.content) == 4 for c in resp.choices)


def test_named_ensembles_are_models(client: openai.OpenAI) -> None:
    ids = {m.id: m for m in client.models.list()}
    for name in ("vote-test", "avg-test", "eot-test", "moa-test", "longest-test"):
        assert name in ids
    assert ids["vote-test"].model_extra["ensemble"]["strategy"] == "crowd_vote"
    assert client.models.retrieve("eot-test").id == "eot-test"
    plain = chat(client, model="avg-test", temperature=0, max_tokens=5)
    assert "ensemble" not in plain.model_extra
    traced = chat(client, {"trace": True}, model="avg-test", temperature=0, max_tokens=5)
    assert trace_of(traced)["strategy"] == "logit_average"


# ---- crowd_vote ----

def test_crowd_vote_picks_the_candidate_closest_to_the_others(client: openai.OpenAI) -> None:
    cands = ["the cat sat on the mat", "a cat sat on a mat", "the dog ran far away", "the cat sat on a mat"]
    for metric in ("word_rouge_l", "char_rouge_l"):
        resp = chat(client, {"strategy": "crowd_vote", "candidates": cands, "metric": metric, "trace": True})
        assert resp.choices[0].message.content == "the cat sat on a mat"
        t = trace_of(resp)
        assert t["winner"]["index"] == 3 and len(t["scores"]) == 4
        assert resp.usage.total_tokens == 0  # no member was called


def test_crowd_vote_ties_go_to_the_lowest_index(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "crowd_vote", "candidates": ["x y", "x y", "x y"], "metric": "word_rouge_l"})
    assert resp.choices[0].message.content == "x y"
    resp = chat(client, {"strategy": "crowd_vote", "candidates": ["b", "a"], "metric": "char_rouge_l", "trace": True})
    assert trace_of(resp)["winner"]["index"] == 0


def test_crowd_vote_over_members(client: openai.OpenAI) -> None:
    resp = chat(client, {"trace": True}, model="vote-test", temperature=0)
    assert resp.choices[0].message.content == "The answer is 42."
    t = trace_of(resp)
    assert [c["member"] for c in t["candidates"]] == ["a42", "b42", "c7"]
    assert resp.usage.completion_tokens == sum(u["completion_tokens"] for u in t["usage_by_member"].values())
    assert t["usage"]["calls"] == 3
    two = chat(client, {"trace": True, "samples_per_member": 2}, model="vote-test", temperature=0)
    assert len(trace_of(two)["candidates"]) == 6
    metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    assert 'chorus_member_calls_total{ensemble="vote-test",member="c7",outcome="ok"}' in metrics
    assert 'chorus_ensemble_requests_total{ensemble="vote-test",strategy="crowd_vote"}' in metrics


def test_crowd_vote_streams_the_chosen_answer(client: openai.OpenAI) -> None:
    chunks = list(chat(client, {"trace": True}, model="vote-test", temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The answer is 42."
    assert chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].model_extra["ensemble"]["winner"]["member"] == "b42"


def test_weighted_metric_mix(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "crowd_vote", "candidates": ["abc", "abd", "xyz"],
                         "weights": {"word_rouge_l": 1, "char_rouge_l": 3}, "trace": True})
    t = trace_of(resp)
    assert t["metric"] == {"word_rouge_l": 0.25, "char_rouge_l": 0.75}
    assert set(t["scores_by_metric"]) == {"word_rouge_l", "char_rouge_l"}


# ---- exchange_of_thought ----

def test_eot_unanimous_round_zero_stops_early(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "exchange_of_thought", "members": ["a42", "b42"], "trace": True}, temperature=0)
    t = trace_of(resp)
    assert len(t["rounds"]) == 1 and t["answer"] == "42"
    assert t["reason"].startswith("unanimous at round 0")
    assert t["usage"]["calls"] == 2


def test_eot_exchange_converges(client: openai.OpenAI) -> None:
    resp = chat(client, {"trace": True}, model="eot-test", temperature=0)
    t = trace_of(resp)
    assert [a["answer"] for a in t["rounds"][0]["agents"]] == ["42", "42", "7"]
    assert t["visibility"] == [[0, 1, 0], [0, 0, 1], [1, 0, 0]]  # relay: a ring
    assert t["rounds"][1]["agents"][2]["sees"] == ["a42"]
    assert [a["answer"] for a in t["rounds"][1]["agents"]] == ["42", "42", "42"]
    assert t["reason"] == "all agents agreed after round 1" and t["answer"] == "42"
    assert resp.choices[0].message.content == "Six times seven. The answer is 42."  # the first winner's solution
    assert t["usage"]["calls"] == 6


def test_eot_max_rounds_majority_and_confidence(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "exchange_of_thought", "members": ["a42", "stub", "stub"], "max_rounds": 2,
                         "trace": True}, temperature=0)
    t = trace_of(resp)
    assert len(t["rounds"]) == 3 and t["reason"].startswith("max_rounds (2)")
    assert t["answer"] == "9" and t["winner"]["member"] == "stub"  # 9, 9 beat 42 in the last round
    assert "peer_confidence" not in t["rounds"][1]["agents"][0] or not t["rounds"][1]["agents"][0]["peer_confidence"]
    assert t["rounds"][2]["agents"][0]["peer_confidence"] == {"stub": 0.5, "stub#2": 0.5}
    assert t["confidence"] == {"a42": 1.0, "stub": pytest.approx(2 / 3), "stub#2": pytest.approx(2 / 3)}


def test_eot_custom_visibility_and_bad_matrix(client: openai.OpenAI) -> None:
    ok = chat(client, {"strategy": "exchange_of_thought", "members": ["a42", "c7"], "visibility": [[0, 0], [1, 0]],
                       "trace": True}, temperature=0)
    assert trace_of(ok)["topology"] == "custom"
    with pytest.raises(openai.BadRequestError, match="2 x 2 matrix"):
        chat(client, {"strategy": "exchange_of_thought", "members": ["a42", "c7"], "visibility": [[0, 1]]})


def test_an_agent_that_loses_its_answer_keeps_the_one_it_gave(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "exchange_of_thought", "members": ["forgets", "c7"], "max_rounds": 2,
                         "trace": True}, temperature=0)
    t = trace_of(resp)
    assert [a["answer"] for a in t["rounds"][2]["agents"]] == ["", "42"]
    assert t["answer"] == "8" and t["winner"]["member"] == "forgets"  # 8 (round 0) and 42 tie: the earliest agent
    assert resp.choices[0].message.content == "The answer is 8."  # its words from the round it gave the answer


def test_a_spent_token_budget_ends_the_exchange_with_the_last_rounds_majority(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "exchange_of_thought", "members": ["a42", "stub", "stub"], "max_rounds": 5,
                         "max_total_tokens": 1, "trace": True}, temperature=0)
    t = trace_of(resp)
    assert len(t["rounds"]) == 1 and t["reason"] == "token budget of 1 reached before round 1: majority of the last round"
    assert t["budget"]["stopped"] == "token budget of 1 reached before round 1"
    assert t["budget"]["deadline_s"] == 30 and t["budget"]["elapsed_s"] < 30  # the defaults of every ensemble


def test_a_member_calls_length_is_call_max_tokens_unless_the_request_gives_max_tokens(client: openai.OpenAI) -> None:
    body = {"strategy": "exchange_of_thought", "members": ["a42", "b42"], "call_max_tokens": 5, "max_rounds": 0,
            "trace": True}
    used = trace_of(chat(client, body, temperature=0))["usage_by_member"]
    assert used["a42"]["completion_tokens"] == used["b42"]["completion_tokens"] == 5
    used = trace_of(chat(client, body, temperature=0, max_tokens=8))["usage_by_member"]
    assert used["a42"]["completion_tokens"] == 8  # the request's max_tokens: the answer's length
    for bad, param in (({"deadline_s": 0}, "deadline_s"), ({"max_total_tokens": 0}, "max_total_tokens"),
                       ({"call_max_tokens": "x"}, "call_max_tokens")):
        with pytest.raises(openai.BadRequestError, match=param):
            chat(client, {**body, **bad})


# ---- mixture_of_agents ----

def test_moa_streams_the_aggregator(client: openai.OpenAI, fakes: dict[str, FakeEngine]) -> None:
    chunks = list(chat(client, {"trace": True, "layers": 2}, model="moa-test", temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Combined: 42."
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5
    t = chunks[-1].model_extra["ensemble"]
    assert len(t["layers"]) == 2 and t["winner"]["member"] == "aggregator:agg"
    assert set(t["usage_by_member"]) == {"a42", "c7", "aggregator:agg"}


def test_moa_past_its_deadline_answers_with_a_proposal_instead_of_the_judge(client: openai.OpenAI) -> None:
    resp = chat(client, {"trace": True, "deadline_s": 0.001}, model="moa-test", temperature=0)
    t = trace_of(resp)
    assert t["judge"]["skipped"] and t["reason"] == "deadline of 0.001 s reached before the judge: the first proposal"
    assert resp.choices[0].message.content == "Six times seven. The answer is 42."
    assert "aggregator:agg" not in t["usage_by_member"]


def test_moa_aggregator_sees_the_proposals() -> None:
    from chorus.ensembles.strategies.mixture_of_agents import with_references

    msgs = with_references([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], ["x", "y"])
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.")
    assert "1. x" in msgs[0]["content"] and "2. y" in msgs[0]["content"] and msgs[1]["content"] == "q"


# ---- third-party strategies, failures, bad input ----

def test_third_party_strategy_from_the_config(client: openai.OpenAI) -> None:
    resp = chat(client, model="longest-test", temperature=0)
    assert resp.choices[0].message.content == "Six times seven. The answer is 42."


def test_member_failure_skip_and_fail(client: openai.OpenAI) -> None:
    ens = {"strategy": "crowd_vote", "members": ["a42", "broken", "b42"], "metric": "word_rouge_l", "trace": True}
    resp = chat(client, ens, temperature=0)
    assert trace_of(resp)["errors"][0]["member"] == "broken"
    assert resp.choices[0].message.content.endswith("The answer is 42.")
    with pytest.raises(openai.APIStatusError, match="broken") as err:
        chat(client, {**ens, "on_member_error": "fail"}, temperature=0)
    assert err.value.status_code == 502
    with pytest.raises(openai.APIStatusError, match="broken") as err:
        chat(client, {"strategy": "logit_average", "members": ["fake", "broken"]})
    assert err.value.status_code == 502
    skipped = chat(client, {"strategy": "logit_average", "members": ["a42", "broken"], "on_member_error": "skip",
                            "trace": True}, temperature=0)
    assert skipped.choices[0].message.content == "Six times seven. The answer is 42."
    with pytest.raises(openai.APIStatusError, match="every ensemble member failed"):
        chat(client, {"strategy": "crowd_vote", "members": ["broken", "broken"]})


@pytest.mark.parametrize(
    ("ensemble", "match"),
    [
        (
            {"strategy": "nope", "members": ["a42", "b42"]},
            "Valid strategies: answer_vote, cascade, choice_average, consistency_select, crowd_vote, exchange_of_thought",
        ),
        ({"strategy": "crowd_vote", "members": ["a42", "zzz"]}, "Unknown ensemble member.*zzz.*GET /v1/models"),
        ({"strategy": "crowd_vote", "members": ["a42"]}, "at least 2 members"),
        ({"strategy": "crowd_vote", "candidates": []}, "candidates must not be empty"),
        ({"strategy": "crowd_vote", "members": ["a42", "b42"], "metric": "bleu"}, "metric"),
        ({"strategy": "crowd_vote", "members": ["a42", "b42"], "temprature": 1}, "Valid parameters: metric"),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "weights": [1]}, "2 non-negative numbers"),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "weights": [1, -1]}, "non-negative"),
        ({"strategy": "logit_average", "members": ["fake", "odd"]}, "odd differ from fake.*topk_union"),
        ({"strategy": "logit_average", "members": ["fake", {"model": "fake", "seed": 3}]}, "per-member temperature"),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "gate": 0.3}, "'gate' applies to mode selective"),
        (
            {"strategy": "logit_average", "members": ["fake", "fake"], "mode": "selective", "k": 3},
            "'k' applies to mode",
        ),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "mode": "selective", "gate": 2}, "at most 1"),
        (
            {"strategy": "logit_average", "members": ["fake", "fake"], "mode": "speculative", "lead": "zz"},
            "'lead' 'zz'",
        ),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "mode": "speculative", "lead": 5}, "member index"),
        (
            {"strategy": "logit_average", "members": ["fake", "odd"], "align": "topk_union", "mode": "speculative"},
            "shared vocabulary",
        ),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "mode": "fast"}, "mode"),
        (
            {
                "strategy": "logit_average",
                "members": ["fake", "odd"],
                "align": "topk_union",
                "mixture_temperature": 0.5,
            },
            "mixture_temperature applies",
        ),
        (
            {"strategy": "logit_average", "members": ["fake", "odd"], "align": "topk_union", "space": "logit"},
            "space 'logit' needs align 'vocab'",
        ),
        ({"strategy": "logit_average", "members": ["fake", "fake"], "top_k": 5}, "'top_k' applies to align"),
        ({"strategy": "logit_average", "members": ["fake", "textonly"]}, "have neither: textonly"),
        ({"strategy": "exchange_of_thought", "members": ["a42", "b42"], "answer_pattern": "("}, "regular expression"),
        ({"members": ["a42", "b42"]}, "strategy"),
        ({"strategy": "crowd_vote", "members": "a42"}, "members"),
    ],
)
def test_bad_ensembles_are_400(client: openai.OpenAI, ensemble: dict[str, Any], match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match) as err:
        chat(client, ensemble)
    assert err.value.body["param"].startswith("ensemble")


def test_text_strategies_work_without_logits(client: openai.OpenAI) -> None:
    resp = chat(client, {"strategy": "crowd_vote", "members": ["textonly", "b42"], "metric": "char_rouge_l"},
                temperature=0)
    assert resp.choices[0].message.content == "The answer is 42."


def test_n_above_one_needs_a_token_level_strategy(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        chat(client, model="vote-test", n=2)


def test_completions_endpoint_with_an_ensemble(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="avg-test", prompt="abc", max_tokens=3, temperature=0)
    assert resp.choices[0].text == "def"
    assert resp.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="one string"):
        client.completions.create(model="avg-test", prompt=["a", "b"], max_tokens=3)


@pytest.mark.parametrize("strategy", ["logit_average", "crowd_vote", "exchange_of_thought"])
def test_disconnect_cancels_the_members(server: LiveServer, fakes: dict[str, FakeEngine], strategy: str) -> None:
    body = {"model": "x", "messages": [{"role": "user", "content": "q"}], "stream": True, "max_tokens": 3000,
            "ensemble": {"strategy": strategy, "members": ["fake", "fake"]}, "ignore_eos": True}
    fakes["fake"].delay = 0.005
    try:
        with httpx.Client(base_url=server.url) as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:") and wait_until(lambda: fakes["fake"].active_sessions >= 2, 5.0):
                    break  # members are generating: go away
        assert wait_until(lambda: fakes["fake"].active_sessions == 0, 5.0)
    finally:
        fakes["fake"].delay = 0.0


def test_topk_union_over_different_vocabularies(client: openai.OpenAI) -> None:
    ens = {"strategy": "logit_average", "align": "topk_union", "members": ["a42", "odd"], "weights": [1, 0],
           "trace": True}
    resp = chat(client, ens, temperature=0)
    assert resp.choices[0].message.content == "Six times seven. The answer is 42."  # weight 1 on a42
    t = trace_of(resp)
    assert t["align"] == "topk_union" and "approximation" in t["note"]
    same = chat(client, {**ens, "members": ["fake", "fake"], "weights": None}, temperature=0, max_tokens=8)
    alone = chat(client, temperature=0, max_tokens=8)
    assert same.choices[0].message.content == alone.choices[0].message.content
    chunks = list(chat(client, ens, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == resp.choices[0].message.content
