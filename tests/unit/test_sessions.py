"""The session API (/chorus/v1 and v2 sessions) on fake engines, and a gateway's remote engine stepping it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.engines.remote.session_wire import decode_next, next_token
from tests.helpers import LiveServer, gateway, wait_until


def config(**sessions: object) -> ChorusConfig:
    return ChorusConfig.model_validate({
        "server": {"sessions": {"idle_timeout_s": 60, "max_open": 3, **sessions}},
        "models": [{"name": "fake", "engine": "fake"}, {"name": "slow", "engine": "fake"}]})


@pytest.fixture(scope="module")
def engines() -> dict[str, FakeEngine]:
    return {"fake": FakeEngine("fake", max_model_len=64), "slow": FakeEngine("slow", delay=0.3)}


@pytest.fixture(scope="module")
def worker(engines: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    with gateway(config(), engines=dict(engines)) as srv:
        yield srv


S = "/chorus/v1/sessions"
V2 = "/chorus/v2/sessions"


def api(worker: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=worker.url, timeout=30)


def test_wire_format_round_trip() -> None:
    logits = torch.randn(50)
    assert torch.equal(decode_next(next_token(logits, None), 50), logits)
    top = decode_next(next_token(logits, 3), 50)
    assert torch.isfinite(top).sum() == 3 and int(top.argmax()) == int(logits.argmax())
    with pytest.raises(ValueError, match="vocabulary of 49"):
        decode_next(next_token(logits, None), 49)


async def test_open_step_close_give_the_engines_logits(worker: LiveServer, engines: dict[str, FakeEngine]) -> None:
    fake = engines["fake"]
    ids = fake.tokenizer.encode("abc")
    with api(worker) as c:
        opened = c.post(S, json={"model": "fake", "prompt": ids})
        assert opened.status_code == 200 and opened.headers["x-chorus-session-api"] == "2"
        body = opened.json()
        sid, vocab = body["id"], fake.tokenizer.vocab_size
        assert body["object"] == "chorus.session" and body["length"] == len(ids)
        ref = fake.open_session()
        want = await ref.prefill(ids)
        assert torch.equal(decode_next(body["next"], vocab), want)
        tok = int(want.argmax())
        stepped = c.post(f"{S}/{sid}/step", json={"token": tok, "top_k": 2}).json()
        want = await ref.step(tok)
        ref.close()
        assert stepped["length"] == len(ids) + 1 and stepped["next"]["ids"][0] == int(want.argmax())
        assert c.get(S).json()["open"] == 1
        assert c.delete(f"{S}/{sid}").json()["deleted"] is True
        assert c.get(S).json()["open"] == 0
        gone = c.post(f"{S}/{sid}/step", json={"token": 1})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert wait_until(lambda: fake.active_sessions == 0)


async def test_v2_steps_several_tokens_and_rolls_back(worker: LiveServer, engines: dict[str, FakeEngine]) -> None:
    """/chorus/v2: one step feeds several tokens (a distribution after each) after forgetting the last n."""
    fake = engines["fake"]
    ids, vocab = fake.tokenizer.encode("abc"), fake.tokenizer.vocab_size
    more = fake.tokenizer.encode("xyz")
    with api(worker) as c:
        opened = c.post(V2, json={"model": "fake", "prompt": ids}).json()
        sid = opened["id"]
        body = c.post(f"{V2}/{sid}/step", json={"tokens": more}).json()
        ref = fake.open_session()
        await ref.prefill(ids)
        want = await ref.extend(more)
        assert body["length"] == 6 and len(body["next"]) == 3
        assert all(torch.equal(decode_next(n, vocab), w) for n, w in zip(body["next"], want))
        back = c.post(f"{V2}/{sid}/step", json={"rollback": 2, "tokens": more[:1]}).json()
        ref.rollback(2)
        assert back["length"] == 5 and torch.equal(decode_next(back["next"][0], vocab), (await ref.extend(more[:1]))[0])
        ref.close()
        for bad, param in (({"rollback": 5}, "rollback"), ({}, "tokens"), ({"tokens": [10**6]}, "tokens"),
                           ({"tokens": [1], "token": 1}, "token")):
            r = c.post(f"{V2}/{sid}/step", json=bad)
            assert r.status_code == 400 and param in r.json()["error"]["param"], r.text
        assert c.get(V2).json()["open"] == 1 and c.delete(f"{V2}/{sid}").json()["deleted"] is True
    assert wait_until(lambda: fake.active_sessions == 0)


async def test_a_gateways_worker_session_extends_and_rolls_back(worker: LiveServer) -> None:
    """The gateway side (`WorkerSession`): extend is one request, a rollback rides on the next step."""
    from chorus.engines.core.spec import ModelSpec
    from chorus.engines.remote.engine import RemoteEngine

    spec = ModelSpec.model_validate({"name": "w", "engine": "remote", "remote": {
        "replicas": [worker.url + "/v1"], "model": "fake", "token_api": "chorus", "tokenizer": "unused"}})
    local = FakeEngine("local", max_model_len=64)
    remote = RemoteEngine(spec, local.tokenizer)
    await remote.start()
    try:
        s, ref = remote.open_session(), local.open_session()
        ids, more = local.tokenizer.encode("ab"), local.tokenizer.encode("cde")
        assert torch.equal(await s.prefill(ids), await ref.prefill(ids))
        assert torch.equal(await s.extend(more), await ref.extend(more))
        s.rollback(2)
        ref.rollback(2)
        assert s.length == 3 and torch.equal(await s.step(more[0]), await ref.step(more[0]))
        s.close()
        ref.close()
    finally:
        await remote.aclose()


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": [1]}, 404, "model"),
    ({"model": "fake", "prompt": []}, 400, "prompt"),
    ({"model": "fake", "prompt": [10**6]}, 400, "prompt"),
    ({"model": "fake", "prompt": [1] * 64}, 400, "prompt"),
    ({"model": "fake", "prompt": [1], "top_k": 0}, 400, "top_k"),
    ({"model": "fake", "prompt": [1], "colour": "red"}, 400, "colour"),
])
def test_bad_opens(worker: LiveServer, body: dict, status: int, param: str) -> None:
    with api(worker) as c:
        r = c.post(S, json=body)
    assert r.status_code == status, r.text
    assert param in (r.json()["error"]["param"] or "")


def test_bad_token_busy_session_and_session_cap(worker: LiveServer, engines: dict[str, FakeEngine]) -> None:
    with api(worker) as c:
        sid = c.post(S, json={"model": "slow", "prompt": [1, 2]}).json()["id"]
        assert c.post(f"{S}/{sid}/step", json={"token": 10**6}).json()["error"]["param"] == "token"

        async def two_steps() -> list[int]:
            async with httpx.AsyncClient(base_url=worker.url, timeout=30) as ac:
                first = asyncio.create_task(ac.post(f"{S}/{sid}/step", json={"token": 3}))
                await asyncio.sleep(0.1)
                second = await ac.post(f"{S}/{sid}/step", json={"token": 3})
                return [(await first).status_code, second.status_code]

        assert asyncio.run(two_steps()) == [200, 409]
        more = [c.post(S, json={"model": "fake", "prompt": [1]}) for _ in range(3)]
        assert [r.status_code for r in more] == [200, 200, 429]
        assert more[2].headers["retry-after"]
        for r in [*more[:2]]:
            c.delete(f"{S}/{r.json()['id']}")
        c.delete(f"{S}/{sid}")
    assert wait_until(lambda: engines["slow"].active_sessions == 0 and engines["fake"].active_sessions == 0)


def test_idle_sessions_are_freed() -> None:
    fake = FakeEngine("fake")
    with gateway(config(idle_timeout_s=0.4), engines={"fake": fake, "slow": FakeEngine("slow")}) as srv:
        with api(srv) as c:
            sid = c.post(S, json={"model": "fake", "prompt": [1, 2, 3]}).json()["id"]
            assert fake.active_sessions == 1
            assert wait_until(lambda: fake.active_sessions == 0, timeout=5)
            assert c.get(S).json()["expired"] == 1
            assert c.post(f"{S}/{sid}/step", json={"token": 1}).status_code == 404


def test_session_api_needs_a_key_when_keys_are_set() -> None:
    cfg = config()
    with gateway(
        cfg, engines={"fake": FakeEngine("fake"), "slow": FakeEngine("slow")}, api_keys="gw:secret-key-123"
    ) as srv:
        with api(srv) as c:
            assert c.post(S, json={"model": "fake", "prompt": [1]}).status_code == 401
            ok = c.post(S, json={"model": "fake", "prompt": [1]}, headers={"Authorization": "Bearer secret-key-123"})
            assert ok.status_code == 200


async def test_gather_ready_waits_for_every_served_sequence_within_its_window() -> None:
    """A batching scheduler's pause: it returns as soon as every sequence it served has its next token in, keeps
    waiting while they keep coming (each one restarts the window), and gives up one window after the last."""
    from chorus.engines.core.base import gather_ready

    ready = [False, False, False]
    wake = asyncio.Event()

    async def arrive(i: int, after_s: float) -> None:
        await asyncio.sleep(after_s)
        ready[i] = True
        wake.set()

    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(arrive(i, 0.01 * (i + 1))) for i in range(3)]  # each within 10 ms of the last
    await gather_ready(lambda: sum(ready), 3, 0.05, wake)
    assert all(ready)  # the window restarted with each arrival
    await asyncio.gather(*tasks)
    ready[:] = [True, False, False]  # two never come: back after a window
    t0 = loop.time()
    await gather_ready(lambda: sum(ready), 3, 0.05, wake)
    assert loop.time() - t0 >= 0.045
    await gather_ready(lambda: 0, 0, 10, wake)  # nothing served: no wait at all
