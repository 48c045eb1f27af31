"""Mixture-of-agents with what the fusion products have, through the openai SDK over fake engines: a quorum
with a grace period (who was waited for, who was late and cancelled), the judge skipped when the proposals
agree, the judge chosen per request, anonymised (and shuffled) proposals, the judge's rationale, and
OpenRouter's ``plugins: [{"id": "fusion", ...}]`` request shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, serve_fakes, wait_until

Q = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS: list[str] = []  # what the judges read


def judge_reply(prompt: str) -> str:
    PROMPTS.append(prompt)
    if "Do not answer the message yourself" in prompt:
        return "Two say Paris, one says Lyon; Paris is right."
    return "Paris, by assessment." if "Paris is right" in prompt else "Paris."


@pytest.fixture(scope="module")
def engines() -> dict[str, FakeEngine]:
    return {
        "fast-a": FakeEngine("fast-a", max_model_len=4096, script="The answer is: Paris"),
        "fast-b": FakeEngine("fast-b", max_model_len=4096, script="Paris."),
        "fast-c": FakeEngine("fast-c", max_model_len=4096, script="The answer is: Lyon"),
        "slow": FakeEngine("slow", max_model_len=4096, delay=0.05, script="I think it is Paris, France." * 4),
        "judge": FakeEngine("judge", max_model_len=4096, reply=judge_reply),
        "judge-2": FakeEngine("judge-2", max_model_len=4096, script="Judge two says Paris."),
    }


@pytest.fixture(scope="module")
def server(engines: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    ensembles = [
        {"name": "panel", "strategy": "mixture_of_agents", "members": ["fast-a", "fast-b", "slow"],
         "aggregator": "judge", "quorum": 2},
        {"name": "agreeing", "strategy": "mixture_of_agents", "members": ["fast-a", "fast-b"], "aggregator": "judge",
         "skip_judge": True},
        {"name": "split", "strategy": "mixture_of_agents", "members": ["fast-a", "fast-c"], "aggregator": "judge",
         "skip_judge": True},
    ]
    with serve_fakes(engines, ensembles) as srv:
        yield srv


@pytest.fixture(scope="module")
def sdk(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def ask(sdk: OpenAI, model: str, ensemble: dict[str, Any] | None = None, **extra: Any) -> Any:
    return sdk.chat.completions.create(model=model, messages=Q, max_tokens=120, temperature=0,
                                       extra_body={"ensemble": {"trace": True, **(ensemble or {})}, **extra})


def test_quorum_answers_without_waiting_for_the_slow_proposer(sdk: OpenAI, engines: dict[str, FakeEngine]) -> None:
    r = ask(sdk, "panel")
    t = r.model_extra["ensemble"]
    layer = t["quorum"]["layers"][0]
    assert layer["replied"] == ["fast-a", "fast-b"] and layer["late"] == ["slow"] and layer["failed"] == []
    assert [p["member"] for p in t["layers"][0]] == ["fast-a", "fast-b"]  # the judge read the two that came
    # the reply did not wait for the slow proposer: it is reported late, and its call was cancelled (KV freed)
    # before it finished its answer, so none of its tokens are charged (speed itself: benchmarks, not tests)
    assert wait_until(lambda: engines["slow"].active_sessions == 0)
    assert t["usage_by_member"].keys() == {"fast-a", "fast-b", "aggregator:judge"}


def test_grace_period_waits_for_the_rest(sdk: OpenAI) -> None:
    t = ask(sdk, "panel", {"grace_s": 30}).model_extra["ensemble"]
    layer = t["quorum"]["layers"][0]
    assert layer["replied"] == ["fast-a", "fast-b", "slow"] and layer["late"] == []
    assert layer["seconds"]["slow"] > layer["seconds"]["fast-a"]
    assert len(t["layers"][0]) == 3


def test_a_quorum_larger_than_the_panel_is_a_400(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="'quorum' is 4 but the ensemble has 3 proposers"):
        ask(sdk, "panel", {"quorum": 4})


def test_judge_skipped_when_the_proposals_agree(sdk: OpenAI) -> None:
    before = len(PROMPTS)
    r = ask(sdk, "agreeing")
    t = r.model_extra["ensemble"]
    assert t["judge"]["skipped"] is True and t["judge"]["answer_type"] == "text"
    assert t["judge"]["answers"] == {"fast-a": "Paris", "fast-b": "Paris"}
    assert r.choices[0].message.content == "The answer is: Paris"  # the first proposal, in its own words
    assert t["winner"] == {"member": "fast-a"} and t["reason"].startswith("judge skipped")
    assert len(PROMPTS) == before and t["usage"]["calls"] == 2  # no judge call


def test_judge_called_when_the_proposals_differ(sdk: OpenAI) -> None:
    r = ask(sdk, "split")
    t = r.model_extra["ensemble"]
    assert "skipped" not in t["judge"] and t["judge"]["why_not"] == "the proposals' answers differ"
    assert t["judge"]["answers"] == {"fast-a": "Paris", "fast-c": "Lyon"}
    assert r.choices[0].message.content == "Paris." and t["usage"]["calls"] == 3


def test_no_skip_when_a_response_format_applies(sdk: OpenAI) -> None:
    r = sdk.chat.completions.create(model="agreeing", messages=Q, max_tokens=40, temperature=0,
                                    response_format={"type": "json_object"}, extra_body={"ensemble": {"trace": True}})
    t = r.model_extra["ensemble"]
    assert t["judge"]["agree"] is True and "skipped" not in t["judge"] and "response format" in t["judge"]["why_not"]
    assert t["usage"]["calls"] == 3


def test_the_judge_is_chosen_per_request(sdk: OpenAI) -> None:
    r = ask(sdk, "split", {"aggregator": "judge-2"})
    t = r.model_extra["ensemble"]
    assert t["judge"]["model"] == "judge-2" and r.choices[0].message.content == "Judge two says Paris."
    assert "aggregator:judge-2" in t["usage_by_member"]


def test_proposals_are_anonymous_and_shuffled_by_seed(sdk: OpenAI) -> None:
    PROMPTS.clear()
    t = ask(sdk, "split", {"shuffle": True}, seed=3).model_extra["ensemble"]
    prompt = PROMPTS[-1]
    assert "fast-a" not in prompt and "fast-c" not in prompt  # no proposer's name reaches the judge
    first, second = ({"fast-a": "The answer is: Paris", "fast-c": "The answer is: Lyon"}[m] for m in t["judge"]["order"])
    assert prompt.index(f"1. {first}") < prompt.index(f"2. {second}")
    orders = {tuple(ask(sdk, "split", {"shuffle": True}, seed=s).model_extra["ensemble"]["judge"]["order"])
              for s in range(8)}
    assert orders == {("fast-a", "fast-c"), ("fast-c", "fast-a")}  # the seed decides; both orders occur
    assert ask(sdk, "split", {"shuffle": True}, seed=3).model_extra["ensemble"]["judge"]["order"] == t["judge"]["order"]


def test_the_judges_rationale_is_in_the_trace_and_in_its_prompt(sdk: OpenAI) -> None:
    r = ask(sdk, "split", {"rationale": True})
    t = r.model_extra["ensemble"]
    assert t["judge"]["rationale"] == "Two say Paris, one says Lyon; Paris is right."
    assert r.choices[0].message.content == "Paris, by assessment."  # the final call read the assessment
    assert t["usage"]["calls"] == 4


def test_openrouter_fusion_plugin(sdk: OpenAI) -> None:
    plugin = {"id": "fusion", "analysis_models": ["fast-a", "fast-c"], "model": "judge-2"}
    r = sdk.chat.completions.create(model="fast-a", messages=Q, max_tokens=60, temperature=0,
                                    extra_body={"plugins": [plugin], "ensemble": {"trace": True}})
    t = r.model_extra["ensemble"]
    assert [p["member"] for p in t["layers"][0]] == ["fast-a", "fast-c"] and t["judge"]["model"] == "judge-2"
    assert r.choices[0].message.content == "Judge two says Paris."
    off = sdk.chat.completions.create(model="fast-b", messages=Q, max_tokens=60, temperature=0,
                                      extra_body={"plugins": [{**plugin, "enabled": False}]})
    assert off.choices[0].message.content == "Paris." and "ensemble" not in (off.model_extra or {})
    judged = sdk.chat.completions.create(model="split", messages=Q, max_tokens=60, temperature=0,
                                         extra_body={"plugins": [{"id": "fusion", "model": "judge-2"}]})
    assert judged.choices[0].message.content == "Judge two says Paris."  # the named ensemble's panel, this judge


@pytest.mark.parametrize(("plugins", "ensemble", "match"), [
    ([{"id": "web"}], None, "the plugin 'web' is not served here"),
    ([{"id": "fusion", "analysis_models": ["fast-a"], "tools": [{"type": "openrouter:web_search"}]}], None,
     "no server tools"),
    ([{"id": "fusion", "preset": "general-high"}], None, "no fusion presets"),
    ([{"id": "fusion", "max_tool_calls": 3}], None, "no server tools"),
    ([{"id": "fusion", "analysis_models": []}], None, "1 to 8 model names"),
    ([{"id": "fusion", "panel": ["fast-a"]}], None, "unknown fusion field"),
    ([{"id": "fusion", "analysis_models": ["fast-a"]}], {"members": ["fast-b"]}, "both say what the ensemble is"),
    ("fusion", None, "must be a list of objects"),
])
def test_fusion_fields_that_do_not_map_are_400s(sdk: OpenAI, plugins: Any, ensemble: Any, match: str) -> None:
    body: dict[str, Any] = {"plugins": plugins}
    if ensemble is not None:
        body["ensemble"] = ensemble
    with pytest.raises(openai.BadRequestError, match=match):
        sdk.chat.completions.create(model="fast-a", messages=Q, max_tokens=8, extra_body=body)
