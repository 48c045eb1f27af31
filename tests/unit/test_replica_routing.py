"""Replica routing policies (engines/remote/routing.py) as case tables over the pool's own `Replica`s."""

from __future__ import annotations

import random

import pytest

from chorus.engines.core.base import ServerLoad
from chorus.engines.remote.options import AffinityOptions
from chorus.engines.remote.replicas import Replica, ReplicaPool, reported_load
from chorus.engines.remote.routing import REPLICA_POLICIES, Ask

URLS = [f"http://w{i}:8000/v1" for i in range(4)]


def pool(routing: str, **affinity: object) -> ReplicaPool:
    return ReplicaPool(URLS, cooldown_s=10.0, routing=routing, affinity=AffinityOptions(**affinity))


def prompt(head: int, length: int, tail: int = 0) -> list[int]:
    """A prompt: a shared head (a tenant's system prompt, ``head`` picks which), then a conversation ``tail``."""
    rng = random.Random(head)
    ids = [rng.randrange(1000, 30000) for _ in range(length)]
    return ids + [random.Random(tail).randrange(1000, 30000) for _ in range(tail and 40)]


def send(p: ReplicaPool, ask: Ask) -> Replica:
    r = p.pick(set(), ask)
    p.answered(r)
    return r


def test_the_registry_names_every_policy() -> None:
    assert set(REPLICA_POLICIES) == {"least_outstanding", "prefix", "session"}
    with pytest.raises(KeyError):
        pool("nosuch")


def test_least_outstanding_takes_the_idlest() -> None:
    p = pool("least_outstanding")
    for r, n in zip(p.replicas, [3, 1, 2, 1]):
        r.outstanding = n
    p.replicas[1].served = 5
    assert p.pick(set(), Ask(prompt(1, 200))).url == URLS[3]  # fewest in flight, then fewest served


def test_prefix_keeps_a_conversation_on_one_replica_as_it_grows() -> None:
    p = pool("prefix")
    first = send(p, Ask(prompt(7, 300), scope="tenant-a"))
    for turn in range(1, 6):  # the history grows; its leading blocks stay
        grown = Ask(prompt(7, 300) + prompt(100 + turn, 50 * turn), scope="tenant-a")
        assert send(p, grown).url == first.url
    assert p.policy.stats()["routed_by_prefix"] == 5


def test_prefix_is_scoped_by_tenant() -> None:
    """The same prompt under two scopes hashes apart: a tenant is never sent where another's prefix is."""
    p = pool("prefix")
    a = send(p, Ask(prompt(7, 300), scope="tenant-a"))
    chain_a, chain_b = p.policy.blocks(Ask(prompt(7, 300), scope="tenant-a")), \
        p.policy.blocks(Ask(prompt(7, 300), scope="tenant-b"))
    assert not set(chain_a) & set(chain_b)
    assert p.policy.run(a.url, chain_b) == 0


def test_a_hot_prefix_spills_to_a_second_replica_under_load() -> None:
    p = pool("prefix", load_factor=1.25)
    home = send(p, Ask(prompt(3, 400), scope="t"))
    home.outstanding = 4  # the replica holding it is busy; the others idle
    spill = p.pick(set(), Ask(prompt(3, 400), scope="t"))
    assert spill.url != home.url  # (and from now on it holds the prefix too)
    home.outstanding, spill.outstanding = 1, 2  # within the bound again: the less busy of the two that hold it
    assert p.pick(set(), Ask(prompt(3, 400), scope="t")).url == home.url
    others = [r for r in p.replicas if r.url not in (home.url, spill.url)]
    assert all(p.policy.run(r.url, p.policy.blocks(Ask(prompt(3, 400), scope="t"))) == 0 for r in others)


@pytest.mark.parametrize("cold", ["least_outstanding", "ring"])
def test_unique_prompts_spread(cold: str) -> None:
    p = pool("prefix", cold=cold)
    counts = {u: 0 for u in URLS}
    for i in range(400):
        counts[send(p, Ask(prompt(10_000 + i, 120), scope="t")).url] += 1
    assert min(counts.values()) > 400 / 4 * 0.5, counts  # no replica starved (the ring's points spread them)


def test_a_short_shared_opening_is_no_reason_to_follow() -> None:
    """A chat template's fixed opening (under min_match_tokens) matches everywhere: it does not pull prompts."""
    p = pool("prefix", block_tokens=32, min_match_tokens=64)
    template = prompt(1, 32)
    send(p, Ask(template + prompt(50, 100), scope="t"))
    placed = p.policy.stats()["routed_by_ring"]
    send(p, Ask(template + prompt(51, 100), scope="t"))
    assert p.policy.stats()["routed_by_ring"] == placed + 1


def test_a_failed_replica_is_passed_over_in_the_policys_order() -> None:
    p = pool("prefix")
    ask = Ask(prompt(9, 300), scope="t")
    home = send(p, ask)
    p.failed(home, "refused")
    second = p.pick(set(), ask)
    assert second.url != home.url
    last = p.pick({u for u in URLS if u not in (home.url, URLS[-1] if home.url != URLS[-1] else URLS[0])}, ask)
    assert last.url not in (home.url,) and last.healthy


def test_session_routing_is_sticky_per_key_and_spreads_keys() -> None:
    p = pool("session")
    seen = {send(p, Ask(prompt(i, 10), session="user-1")).url for i in range(20)}
    assert len(seen) == 1
    spread = {send(p, Ask(prompt(1, 10), session=f"user-{i}")).url for i in range(40)}
    assert len(spread) >= 3


# ---- what replicas report of their load (the model-server protocol's gauges) ----

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 3.0
vllm:num_requests_waiting{engine="0",model_name="other"} 50.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 8.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.42
"""


@pytest.mark.parametrize("text, model, expected", [
    (VLLM, "qwen", ServerLoad(3, 8, 0.42)),  # another model's samples are not counted
    (VLLM.replace("kv_cache_usage_perc", "gpu_cache_usage_perc"), "qwen", ServerLoad(3, 8, 0.42)),  # vLLM < 0.10
    ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n", "any", ServerLoad(0, 2, 0.0)),
    ("# TYPE http_requests_total counter\nhttp_requests_total 7\n", "qwen", None),  # no request gauges
])
def test_a_replicas_gauges_are_read_for_its_model(text: str, model: str, expected: ServerLoad | None) -> None:
    assert reported_load(text, model) == expected


def test_a_replica_busy_with_others_requests_is_passed_over_until_its_report_goes_stale() -> None:
    p = pool("least_outstanding")
    busy = p.replicas[0]
    for r in p.replicas:
        r.report(ServerLoad(0, 0, 0.0), 60)
    busy.report(ServerLoad(waiting=2, running=4, kv_usage=0.9), 60)
    busy.served = -1  # it would win every tie
    picked = [send(p, Ask()).url for _ in range(12)]
    assert busy.url not in picked
    p.replicas[1].outstanding = 9  # what this gateway has in flight counts when it is more than reported
    assert p.pick(set()).url not in (busy.url, p.replicas[1].url)
    busy.report(ServerLoad(2, 4, 0.9), fresh_s=-1)  # stale: read blind again
    assert busy.load == 0 and p.pick(set()).url == busy.url
