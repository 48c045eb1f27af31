"""Feedback and the online router: the policy in synthetic environments (the best arm depends on a cluster of
prompts; rewards that change), and the served path over fake engines with the openai SDK: a decision kept with
the request id, feedback joined to it and learned, an arm that is a named ensemble answering as that ensemble,
bad feedback each a 4xx naming its field, the config's checks; two replicas over one real Redis learning from each
other's feedback, and the state surviving a restart."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from chorus.bench.online import LARGE, SMALL, gsm8k_table
from chorus.config import ChorusConfig
from chorus.engines.core.base import Engine
from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.routers.bandit import OnlinePolicy, PolicyParams, features, projection
from tests.helpers import LiveServer, gateway, require
from tests.unit.test_shared_state import Redis, redis_server, serve, sha  # noqa: F401 (a fixture)


def clustered(rng: np.random.Generator, centres: np.ndarray, which: int) -> np.ndarray:
    """A unit vector near centre ``which`` (a prompt of that cluster)."""
    v = centres[which] + 0.35 * rng.standard_normal(centres.shape[1]) / np.sqrt(centres.shape[1])
    return v / np.linalg.norm(v)


def run_policy(policy: OnlinePolicy, steps: int, best_of: Any, seed: int = 0) -> list[int]:
    """``steps`` requests from three clusters; reward 1 when the arm is the cluster's best (``best_of(t, c)``),
    else 0.2; returns 1 for each step that chose the best arm."""
    rng, pick = np.random.default_rng(seed), random.Random(seed)
    centres = rng.standard_normal((3, 384))
    proj = projection(32)
    hits = []
    for t in range(steps):
        c = int(rng.integers(3))
        x = features(clustered(rng, centres, c), proj)
        d = policy.choose(x, pick)
        best = best_of(t, c)
        policy.learn(d.arm, x, 1.0 if d.arm == best else 0.2)
        hits.append(int(d.arm == best))
    return hits


def test_the_policy_finds_the_best_arm_of_each_cluster_after_its_safe_start() -> None:
    policy = OnlinePolicy(3, 33, PolicyParams(warmup=30, explore=0.2, explore_floor=0.02), default=0)
    hits = run_policy(policy, 1200, lambda t, c: c)  # cluster c's best arm is arm c
    assert np.mean(hits[:30]) < 0.5  # the safe start plays the default arm (right on a third of the prompts)
    assert np.mean(hits[-300:]) > 0.9
    assert policy.epsilon() == pytest.approx(max(0.02, 0.2 * 200 / (200 + 1170)))


def test_with_a_discount_it_recovers_when_the_rewards_change() -> None:
    policy = OnlinePolicy(3, 33, PolicyParams(warmup=30, discount=0.98, explore_floor=0.05), default=0)
    hits = run_policy(policy, 2400, lambda t, c: c if t < 1200 else (c + 1) % 3)
    assert np.mean(hits[900:1200]) > 0.85  # learned the first world
    assert np.mean(hits[1200:1300]) < 0.6  # the world changed
    assert np.mean(hits[-300:]) > 0.85  # and it followed


def test_the_safe_start_plays_the_default_arm_but_for_the_floor_and_records_propensities() -> None:
    policy = OnlinePolicy(4, 5, PolicyParams(warmup=1000, explore_floor=0.1), default=2)
    rng = random.Random(0)
    decisions = [policy.choose(np.ones(5), rng) for _ in range(2000)]
    share = np.mean([d.arm == 2 for d in decisions])
    assert 0.9 < share < 0.96  # 1 - 0.1 + 0.1 / 4 = 0.925
    assert {round(d.propensity, 4) for d in decisions} == {0.925, 0.025}
    assert all(d.scores is None and d.phase == "safe start" for d in decisions)


# ---- served --------------------------------------------------------------------------------------------------

METRICS = [{"name": "correct", "type": "boolean"},
           {"name": "rating", "type": "number", "min": 1, "max": 5}]


def online(**params: Any) -> dict[str, Any]:
    return {"name": "online", "strategy": "route", "members": ["a42", "c7"],
            "router": "online", "ensembles": ["vote"], "metric": "correct", **params}


def served_config(**params: Any) -> dict[str, Any]:
    return {"server": {"feedback": {"metrics": METRICS}},
            "models": [{"name": n, "engine": "fake"} for n in ("a42", "c7")],
            "ensembles": [{"name": "vote", "strategy": "answer_vote", "members": ["a42", "c7"], "samples": 2},
                          online(**params)],
            "auth": {"keys": [{"name": "alice", "sha256": sha("sk-alice")}, {"name": "bob", "sha256": sha("sk-bob")}]}}


def engines() -> dict[str, Engine]:
    return {"a42": FakeEngine("a42", script="The answer is 42.", max_model_len=2048),
            "c7": FakeEngine("c7", script="The answer is 7.", max_model_len=2048)}


@pytest.fixture(scope="module")
def server() -> Any:
    with gateway(ChorusConfig.model_validate(served_config(warmup=0, explore=0.0, explore_floor=0.0)),
                 engines()) as srv:
        yield srv


def sdk(srv: LiveServer, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def ask(srv: LiveServer, key: str = "sk-alice", text: str = "What is 6*7?") -> Any:
    return sdk(srv, key).chat.completions.with_raw_response.create(
        model="online", messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0)


def give(srv: LiveServer, body: dict[str, Any], key: str = "sk-alice") -> httpx.Response:
    return httpx.post(srv.url + "/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def traced(srv: LiveServer, text: str) -> tuple[str, dict[str, Any]]:
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alice"}, timeout=30,
                   json={"model": "online", "messages": [{"role": "user", "content": text}], "max_tokens": 16,
                         "temperature": 0, "ensemble": {"trace": True}})
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()["ensemble"]


def test_feedback_is_joined_to_the_decision_and_learned(server: LiveServer) -> None:
    raw = ask(server)
    rid = raw.request_id  # the id the SDK reads from X-Request-ID
    assert raw.parse().choices[0].message.content
    r = give(server, {"request_id": rid, "metric": "correct", "value": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["learned_by"] == "online" and body["arm"] in {"a42", "c7", "vote"} and body["model"] == "online"
    # a metric the router does not learn from is accepted and kept, not learned
    r = give(server, {"request_id": rid, "metric": "rating", "value": 4})
    assert r.status_code == 200 and r.json()["learned_by"] is None
    _, trace = traced(server, "What is 6*7?")
    assert trace["learned"] >= 1 and trace["phase"] == "learned" and set(trace["scores"]) == {"a42", "c7", "vote"}
    assert trace["explored"] is False and trace["propensity"] == 1.0
    # streamed: the decision is kept when the stream ends, and the SDK reads the id from the same header
    with sdk(server).chat.completions.with_streaming_response.create(
            model="online", messages=[{"role": "user", "content": "What is 6*7?"}], max_tokens=16, temperature=0,
            stream=True) as streamed:
        text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
        sid = streamed.request_id
    assert text and give(server, {"request_id": sid, "metric": "correct", "value": False}).json()["learned_by"]
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r'chorus_online_decisions_total\{arm="[^"]+",ensemble="online",explored="false",phase="learned"\}',
                     metrics)
    assert 'chorus_online_feedback_total{' in metrics and "chorus_online_reward_count{" in metrics
    # feedback on a single model's request is kept too (not learned by anything)
    plain = sdk(server).chat.completions.with_raw_response.create(
        model="a42", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    r = give(server, {"request_id": plain.request_id, "metric": "correct", "value": False})
    assert r.status_code == 200 and r.json()["learned_by"] is None and r.json()["model"] == "a42"


@pytest.mark.parametrize(("body", "key", "status", "param", "words"), [
    ({"metric": "correct", "value": True}, "sk-alice", 400, "request_id", "request_id"),
    ({"request_id": "RID", "metric": "stars", "value": True}, "sk-alice", 400, "metric", "correct, rating"),
    ({"request_id": "RID", "metric": "correct", "value": 1}, "sk-alice", 400, "value", "true or false"),
    ({"request_id": "RID", "metric": "rating", "value": True}, "sk-alice", 400, "value", "must be a number"),
    ({"request_id": "RID", "metric": "rating", "value": 9}, "sk-alice", 400, "value", "outside"),
    ({"request_id": "RID", "metric": "rating", "value": "5"}, "sk-alice", 400, "value", "value"),
    ({"request_id": "RID", "metric": "correct", "value": True, "note": "x"}, "sk-alice", 400, "note", "note"),
    ({"request_id": "nope", "metric": "correct", "value": True}, "sk-alice", 404, "request_id", "unknown"),
    ({"request_id": "RID", "metric": "correct", "value": True}, "sk-bob", 404, "request_id", "another key"),
])
def test_bad_feedback_is_a_4xx_naming_the_field(server: LiveServer, body: dict[str, Any], key: str, status: int,
                                                param: str, words: str) -> None:
    rid = ask(server).request_id
    body = {k: (rid if v == "RID" else v) for k, v in body.items()}
    r = give(server, body, key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") and words in err["message"], err


def test_a_second_feedback_on_one_metric_is_a_409(server: LiveServer) -> None:
    rid = ask(server).request_id
    assert give(server, {"request_id": rid, "metric": "correct", "value": True}).status_code == 200
    r = give(server, {"request_id": rid, "metric": "correct", "value": False})
    assert r.status_code == 409 and r.json()["error"]["code"] == "feedback_exists"


def test_a_request_older_than_keep_s_cannot_get_feedback() -> None:
    cfg = served_config()
    cfg["server"]["feedback"]["keep_s"] = 0.5
    with gateway(ChorusConfig.model_validate(cfg), engines()) as srv:
        rid = sdk(srv).chat.completions.with_raw_response.create(
            model="a42", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0).request_id
        import time

        time.sleep(1.0)
        r = give(srv, {"request_id": rid, "metric": "correct", "value": True})
    assert r.status_code == 404 and "older than 0.5 s" in r.json()["error"]["message"], r.text


def test_an_arm_that_is_an_ensemble_answers_as_that_ensemble() -> None:
    cfg = served_config(default="vote", warmup=10_000, explore_floor=0.0)
    with gateway(ChorusConfig.model_validate(cfg), engines()) as srv:
        _, trace = traced(srv, "What is 6*7?")
    assert trace["winner"] == {"ensemble": "vote"} and trace["phase"] == "safe start"
    arm = trace["arm_trace"]
    assert arm["strategy"] == "answer_vote" and arm["histogram"]
    assert {"vote/a42", "vote/c7"} <= set(trace["usage_by_member"])  # each member call counted, to its model
    assert trace["usage"]["calls"] == arm["usage"]["calls"] >= 2


def test_an_online_router_is_served_from_the_config_only(server: LiveServer) -> None:
    inline = {"strategy": "route", "members": ["a42", "c7"], "router": "online", "metric": "correct"}
    for body in ({"model": "x", "ensemble": inline}, {"model": "online", "ensemble": {"warmup": 3}}):
        r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alice"},
                       json={**body, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 400 and "named ensemble in the config" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("change", "words"), [
    ({"metric": "thumbs"}, "does not declare"),
    ({"ensembles": ["missing"]}, "other named ensembles"),
    ({"ensembles": ["online"]}, "other named ensembles"),
    ({"metric": None}, "needs 'metric'"),
])
def test_the_config_checks_what_an_online_router_names(change: dict[str, Any], words: str) -> None:
    cfg = served_config(**change)
    cfg["ensembles"][1] = {k: v for k, v in cfg["ensembles"][1].items() if v is not None}
    with pytest.raises(ValueError, match=words):
        ChorusConfig.model_validate(cfg)


def test_building_an_online_router_checks_its_arms() -> None:
    from chorus.ensembles.base import Ensemble
    from chorus.ensembles.spec import EnsembleSpec
    from chorus.errors import InvalidRequest

    for change, words in (({"default": "zzz"}, "not an arm"), ({"ensembles": ["a42"]}, "must differ")):
        spec = EnsembleSpec.model_validate({k: v for k, v in online(**change).items() if k != "name"})
        with pytest.raises(InvalidRequest, match=words):
            Ensemble.build(spec, dict(engines()), name="x")


# ---- two replicas on one Redis --------------------------------------------------------------------------------

def redis_config(url: str) -> dict[str, Any]:
    cfg = served_config(warmup=0, explore=0.0, explore_floor=0.0)
    cfg["server"]["state"] = {"store": url}
    cfg["models"] = [{"name": "a42", "engine": "fake", "fake": {"script": "The answer is 42."}},
                     {"name": "c7", "engine": "fake", "fake": {"script": "The answer is 7."}}]
    return cfg


def chat(url: str, text: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alice"}, timeout=60,
                      json={"model": "online", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                            "temperature": 0, "ensemble": {"trace": True}})


def test_replicas_join_feedback_across_each_other_and_the_state_survives_a_restart(
        redis_server: Redis, tmp_path: Path) -> None:  # noqa: F811
    redis_server.flush()
    with serve(redis_config(redis_server.url), tmp_path) as (a, b):
        for i in range(6):  # asked on one replica, feedback on the other
            r = chat(a if i % 2 else b, f"question {i}")
            assert r.status_code == 200, r.text
            fb = httpx.post((b if i % 2 else a) + "/v1/feedback", headers={"Authorization": "Bearer sk-alice"},
                            json={"request_id": r.headers["x-request-id"], "metric": "correct", "value": i % 3 == 0})
            assert fb.status_code == 200 and fb.json()["learned_by"] == "online", fb.text
        # each replica has learned all six, whichever got them
        assert chat(a, "q").json()["ensemble"]["learned"] == chat(b, "q").json()["ensemble"]["learned"] == 6
    with serve(redis_config(redis_server.url), tmp_path, n=1) as (c,):  # a restart reads the log back
        assert chat(c, "q").json()["ensemble"]["learned"] == 6


def test_feedback_without_its_store_is_a_503_to_retry() -> None:
    """Redis out of reach (fail_open: requests are still served, an online router's too): feedback cannot be
    joined, 503 + Retry-After."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again: nothing listens there
    cfg = served_config()
    cfg["server"]["state"] = {"store": f"redis://127.0.0.1:{dead}/0", "timeout_s": 0.2}
    with gateway(ChorusConfig.model_validate(cfg), engines()) as srv:
        rid = sdk(srv).chat.completions.with_raw_response.create(
            model="a42", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0).request_id
        r = give(srv, {"request_id": rid, "metric": "correct", "value": True})
        # the online router cannot read its log: it routes with what it has learned (nothing: the safe start)
        _, trace = traced(srv, "What is 6*7?")
    assert trace["phase"] == "safe start" and trace["learned"] == 0
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["code"] == "state_store_unavailable" and "retry" in r.json()["error"]["message"]


def test_the_replay_pins_its_gsm8k_items_while_the_answer_cache_grows() -> None:
    """`chorus bench online --gsm8k-test-items N` replays test items 0 .. N-1 only: the documented table keeps its
    items when later sessions add answers to the committed cache."""
    data = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
    require((data / "test.jsonl").is_file(), f"needs the evaluation data at {data}")
    cache, prices = Path(__file__).resolve().parents[2] / "docs" / "data" / "gsm8k", {SMALL: 0.494, LARGE: 1.54}
    every, pinned = (gsm8k_table(cache, data, "test", prices, 0.5, below) for below in (None, 62))
    assert len(pinned.prompts) == 62 < len(every.prompts) and pinned.prompts == every.prompts[:62]
    assert pinned.right.shape == (62, 5) and (pinned.right == every.right[:62]).all()
