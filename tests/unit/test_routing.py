"""Routing strategies (route: random / semantic / cost; cascade) over fake members, via the openai SDK.

The semantic and cost routers use the real all-MiniLM-L6-v2 embedder (the thing they route with)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, gateway

MATH = ["What is 17 times 23?", "Solve for x: 2x + 3 = 11.", "How much is 15% of 80?",
        "A train travels 60 km in 1.5 hours. What is its speed?"]
CHAT = ["Hi there, how are you today?", "What's your favourite colour?", "Tell me something fun about cats.",
        "Good morning! Any plans for the weekend?"]

CONFIG = {
    "models": [{"name": n, "engine": "fake"} for n in ("small", "big", "unsure", "flaky")],
    "ensembles": [
        {"name": "ab", "strategy": "route", "router": "random", "members": ["small", "big"], "weights": [3, 1]},
        {"name": "topic", "strategy": "route", "router": "semantic", "members": ["small", "big"],
         "examples": {"small": CHAT, "big": MATH}, "k": 3},
        {"name": "cost", "strategy": "route", "router": "cost", "members": ["small", "big"],
         "hard_examples": MATH, "easy_examples": CHAT, "thresholds": [0.0], "k": 2},
        {"name": "cascade", "strategy": "cascade", "members": ["unsure", "big"], "threshold": -1.0},
    ],
}


@pytest.fixture(scope="module")
def fakes() -> dict[str, FakeEngine]:
    return {
        "small": FakeEngine("small", script="small says hi", max_model_len=4000),
        "big": FakeEngine("big", script="The answer is 42.", max_model_len=4000),
        "unsure": FakeEngine("unsure", script="maybe 41", sharpness=1.0, max_model_len=4000),
        "flaky": FakeEngine("flaky", script="never", fail_after=0, max_model_len=4000),
    }


@pytest.fixture(scope="module")
def server(fakes: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG), engines=dict(fakes), timeout=120) as srv:
        yield srv
    assert all(e.active_sessions == 0 for e in fakes.values())


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, model: str, text: str, ensemble: dict[str, Any] | None = None, **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          extra_body={"ensemble": {"trace": True, **(ensemble or {})}}, **kw)


def winner(resp: Any) -> str:
    return resp.model_extra["ensemble"]["winner"]["member"]


def test_random_router_weights_and_seed(client: openai.OpenAI) -> None:
    picks = [winner(ask(client, "ab", "q", seed=s, temperature=0)) for s in range(40)]
    assert 20 <= picks.count("small") <= 38  # weights 3:1
    assert picks == [winner(ask(client, "ab", "q", seed=s, temperature=0)) for s in range(40)]  # seeded
    only = ask(client, "ab", "q", {"weights": [0, 1]}, temperature=0)
    assert winner(only) == "big" and only.choices[0].message.content == "The answer is 42."


def test_route_streams_the_members_tokens_and_counts_decisions(client: openai.OpenAI, server: LiveServer) -> None:
    before = httpx.get(server.url + "/metrics").text
    chunks = list(client.chat.completions.create(
        model="ab", messages=[{"role": "user", "content": "q"}], stream=True, temperature=0,
        extra_body={"ensemble": {"weights": [1, 0]}}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == len("small says hi")
    after = httpx.get(server.url + "/metrics").text
    line = 'chorus_route_decisions_total{ensemble="ab",member="small",router="random"}'
    count = lambda text: float(next((x.split()[-1] for x in text.splitlines() if x.startswith(line)), "0"))  # noqa: E731
    assert count(after) == count(before) + 1


def test_route_supports_n_and_logprobs(client: openai.OpenAI) -> None:
    resp = ask(client, "ab", "q", {"weights": [0, 1]}, n=2, logprobs=True, max_tokens=3, temperature=0)
    assert len(resp.choices) == 2 and len(resp.choices[0].logprobs.content) == 3


@pytest.mark.parametrize(("text", "member"), [
    ("What is 12 times 31?", "big"), ("Solve 5x - 2 = 13 for x.", "big"),
    ("Hello! How is your day going?", "small"), ("Do you like dogs or cats more?", "small")])
def test_semantic_router(client: openai.OpenAI, text: str, member: str) -> None:
    resp = ask(client, "topic", text, temperature=0)
    assert winner(resp) == member
    assert len(resp.model_extra["ensemble"]["nearest"]) == 3


def test_semantic_threshold_sends_outliers_to_the_default(client: openai.OpenAI) -> None:
    resp = ask(client, "topic", "Quantum chromodynamics lattice gauge", {"threshold": 0.9, "default": "small"})
    assert winner(resp) == "small" and "default member" in resp.model_extra["ensemble"]["reason"]


@pytest.mark.parametrize(("text", "member"), [("Compute 48 divided by 6.", "big"), ("Hey, nice to meet you!", "small")])
def test_cost_router(client: openai.OpenAI, text: str, member: str) -> None:
    resp = ask(client, "cost", text, temperature=0)
    assert winner(resp) == member
    assert "score" in resp.model_extra["ensemble"]


def test_cascade_escalates_when_unsure(client: openai.OpenAI) -> None:
    resp = ask(client, "cascade", "q", temperature=0)
    t = resp.model_extra["ensemble"]
    assert [s["member"] for s in t["steps"]] == ["unsure", "big"]
    assert t["steps"][0]["decision"].startswith("escalated") and t["steps"][0]["confidence"] < -1.0
    assert resp.choices[0].message.content == "The answer is 42."
    assert t["usage"]["calls"] == 2 and resp.usage.completion_tokens == t["usage"]["completion_tokens"]
    low = ask(client, "cascade", "q", {"threshold": -8.0}, temperature=0)
    assert winner(low) == "unsure" and len(low.model_extra["ensemble"]["steps"]) == 1


def test_cascade_min_logprob_and_agreement(client: openai.OpenAI) -> None:
    resp = ask(client, "cascade", "q", {"confidence": "min_logprob", "threshold": -0.5}, temperature=0)
    assert winner(resp) == "big"
    agree = ask(client, "cascade", "q", {"confidence": "agreement", "threshold": 0.9, "samples": 4,
                                         "temperature": 0.3, "members": ["big", "unsure"]}, seed=3)
    assert winner(agree) == "big" and agree.model_extra["ensemble"]["steps"][0]["confidence"] == 1.0
    unsure = ask(client, "cascade", "q", {"confidence": "agreement", "threshold": 0.9, "samples": 4,
                                          "temperature": 1.5}, seed=3)
    assert unsure.model_extra["ensemble"]["steps"][0]["decision"].startswith("escalated")


def test_cascade_streams_the_accepted_answer(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="cascade", messages=[{"role": "user", "content": "q"}],
                                                 stream=True, temperature=0))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer is 42."


def test_cascade_survives_a_failing_member(client: openai.OpenAI) -> None:
    resp = ask(client, "cascade", "q", {"members": ["unsure", "flaky"]}, temperature=0)
    t = resp.model_extra["ensemble"]
    assert winner(resp) == "unsure" and "failed" in t["reason"] and t["errors"][0]["member"] == "flaky"


@pytest.mark.parametrize(
    ("ensemble", "match"),
    [
        ({"strategy": "route", "router": "psychic", "members": ["small", "big"]}, "router"),
        (
            {"strategy": "route", "router": "semantic", "members": ["small", "big"], "examples": {"small": CHAT}},
            "needs example prompts for every member but the default; none for: big",
        ),
        (
            {"strategy": "route", "router": "semantic", "members": ["small", "big"], "examples": {"huge": MATH}},
            "unknown members: huge",
        ),
        (
            {
                "strategy": "route",
                "router": "semantic",
                "members": ["small", "big"],
                "examples": {"big": MATH},
                "threshold": 3,
            },
            "threshold",
        ),
        ({"strategy": "route", "router": "cost", "members": ["small", "big"], "hard_examples": MATH}, "thresholds"),
        (
            {
                "strategy": "route",
                "router": "cost",
                "members": ["small", "big", "big"],
                "hard_examples": MATH,
                "thresholds": [0.5, 0.1],
            },
            "ascending",
        ),
        ({"strategy": "route", "router": "random", "members": ["small", "big"], "weights": [1]}, "2 non-negative"),
        ({"strategy": "route", "router": "random", "members": ["small", "big"], "k": 3},
         r"'k' applies to router: semantic / cost only \(this ensemble's router is random\)"),
        ({"strategy": "route", "router": "semantic", "members": ["small", "big"], "examples": {"big": MATH},
          "margin": 0.1}, "'margin' applies to router: learned only"),
        ({"strategy": "cascade", "members": ["small"], "threshold": -1}, "at least 2 members"),
        ({"strategy": "cascade", "members": ["small", "big"], "threshold": 0.5}, "must be <= 0"),
        (
            {"strategy": "cascade", "members": ["small", "big"], "threshold": -1.0, "confidence": "agreement"},
            "thresholds are shares",
        ),
        ({"strategy": "cascade", "members": ["small", "big", "big"], "threshold": [-1, -1, -1]}, "one number or 2"),
    ],
)
def test_bad_routing_is_400(client: openai.OpenAI, ensemble: dict[str, Any], match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.chat.completions.create(model="small", messages=[{"role": "user", "content": "q"}],
                                       extra_body={"ensemble": ensemble})
    assert err.value.body["param"].startswith("ensemble")


def test_route_calibrate_hits_the_target_share(tmp_path: Any) -> None:
    import argparse
    import json

    from chorus.bench.route_calibrate import calibrate

    prompts = tmp_path / "sample.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in [*MATH, *CHAT, "What is 3 + 4?", "Hi!"]))
    ens = json.dumps({"strategy": "route", "router": "cost", "members": ["small", "big"],
                      "hard_examples": MATH[:2], "easy_examples": CHAT[:2], "k": 1})
    out = calibrate(argparse.Namespace(config=None, ensemble=ens, prompts=str(prompts), share=[0.25], limit=None))
    assert "| big | 0.25 |" in out and out.splitlines()[-1].startswith("thresholds: [")
    row = next(line for line in out.splitlines() if line.startswith("| big"))
    assert row.endswith("| 0.30 |")  # 3 of 10: the quantile lands on a tie-free sample as near as it can


def test_examples_file_is_read_by_name_from_the_selectors_folder(client: openai.OpenAI, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The semantic router's examples file: read from $CHORUS_HOME/selectors by name; a path elsewhere (which a
    request could otherwise use to probe the server's files) and a missing one are 400s naming the field."""
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path))
    (tmp_path / "selectors").mkdir()
    (tmp_path / "selectors" / "topics.jsonl").write_text(
        "\n".join(json.dumps({"member": m, "prompt": p}) for m, ps in (("small", CHAT), ("big", MATH)) for p in ps))
    spec = {"strategy": "route", "router": "semantic", "members": ["small", "big"], "k": 3}
    resp = ask(client, "small", "What is 12 times 31?", {**spec, "examples_file": "topics.jsonl"}, temperature=0)
    assert winner(resp) == "big"
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"member": "secret", "prompt": "x"}))
    for name, words in ((str(outside), "must name an artifact inside"), ("../outside.jsonl", "must name an artifact"),
                        ("nowhere.jsonl", "No examples_file 'nowhere.jsonl'")):
        with pytest.raises(openai.BadRequestError, match=words) as err:
            ask(client, "small", "q", {**spec, "examples_file": name})
        assert err.value.body["param"] == "ensemble.examples_file" and "secret" not in err.value.body["message"]
