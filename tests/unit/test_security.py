"""Keys, per-key limits, admission, deadlines, request limits, metrics, request ids, draining, logs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.server.gateway.auth import KeyStore, hash_key
from chorus.server.gateway.services import services_of
from tests.helpers import LiveServer, gateway, wait_until

CONFIG = {
    "server": {"limits": {"max_concurrent_requests": 3, "max_messages": 4, "max_members": 3, "max_rounds": 2,
                          "max_candidates": 4, "request_timeout_s": 30}},
    "models": [{"name": "fake", "engine": "fake"}, {"name": "slow", "engine": "fake"}],
    "ensembles": [{"name": "pair", "strategy": "logit_average", "members": ["fake", "fake"]}],
    "auth": {"keys": [
        {"name": "limited", "sha256": hash_key("sk-limited"), "models": ["fake", "pair"], "rpm": 1000},
        {"name": "rpm", "sha256": hash_key("sk-rpm"), "rpm": 2},
        {"name": "tpm", "sha256": hash_key("sk-tpm"), "tpm": 80},
        {"name": "tpm2", "sha256": hash_key("sk-tpm2"), "tpm": 40},
        {"name": "one-at-a-time", "sha256": hash_key("sk-one"), "max_concurrent": 1},
        {"name": "admin", "sha256": hash_key("sk-admin")},
        {"name": "spare", "sha256": hash_key("sk-spare")},
    ]},
}


@pytest.fixture(scope="module")
def fakes() -> dict[str, FakeEngine]:
    return {
        "fake": FakeEngine("fake", max_model_len=4000),
        "slow": FakeEngine("slow", delay=0.02, max_model_len=100_000),
    }


@pytest.fixture(scope="module")
def server(fakes: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG), engines=dict(fakes), api_keys="ops:sk-env") as srv:
        yield srv


def client(server: LiveServer, key: str = "sk-admin") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def ask(c: openai.OpenAI, model: str = "fake", **kw: Any) -> Any:
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw)


def test_missing_or_wrong_key_is_401(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        ask(client(server, "sk-nope"))
    assert ask(client(server)).choices[0].message.content
    assert ask(client(server, "sk-env")).choices[0].message.content  # from CHORUS_API_KEYS
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics need no key
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_key_model_allow_list_is_403(server: LiveServer) -> None:
    c = client(server, "sk-limited")
    assert ask(c).choices[0].message.content
    assert ask(c, "pair").choices[0].message.content  # a named ensemble it may use
    with pytest.raises(openai.PermissionDeniedError, match="may not use slow"):
        ask(c, "slow")
    with pytest.raises(openai.PermissionDeniedError, match="slow"):  # an inline ensemble uses slow
        ask(c, extra_body={"ensemble": {"strategy": "logit_average", "members": ["fake", "slow"]}})


def test_requests_per_minute_is_429_with_retry_after(server: LiveServer) -> None:
    c = client(server, "sk-rpm")
    ask(c)
    ask(c)
    with pytest.raises(openai.RateLimitError, match="2 requests per minute") as err:
        ask(c)
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 60


def test_tokens_per_minute(server: LiveServer) -> None:
    c = client(server, "sk-tpm")
    resp = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 40}], max_tokens=4)
    assert resp.usage.total_tokens >= 40
    with pytest.raises(openai.RateLimitError, match="tokens per minute"):
        ask(c)
    # a request that could pass the window is refused before it runs (its worst case reserved, server/reserve.py)
    other = client(server, "sk-tpm2")
    with pytest.raises(openai.RateLimitError, match="may cost up to .* tokens per minute \\(tpm\\) of 40"):
        other.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 40}], max_tokens=4)


def test_streamed_tokens_are_charged(server: LiveServer) -> None:
    store = KeyStore(ChorusConfig.model_validate(CONFIG).auth.keys)
    assert store.authenticate("Bearer sk-tpm").name == "tpm"
    with pytest.raises(Exception, match="Missing API key"):
        store.authenticate(None)


async def test_per_key_concurrency_and_server_admission(server: LiveServer, fakes: dict[str, FakeEngine]) -> None:
    body = {"model": "slow", "messages": [{"role": "user", "content": "q"}], "max_tokens": 60, "stream": True}

    async def hold(http: httpx.AsyncClient, key: str, started: asyncio.Event) -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            started.set()
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        started = asyncio.Event()
        one = asyncio.create_task(hold(http, "sk-one", started))
        await started.wait()
        r = await http.post("/v1/chat/completions", json={**body, "stream": False},
                            headers={"Authorization": "Bearer sk-one"})
        assert r.status_code == 429 and "1" in r.headers["retry-after"]
        events = [asyncio.Event(), asyncio.Event()]
        more = [asyncio.create_task(hold(http, key, e)) for key, e in zip(("sk-admin", "sk-spare"), events)]
        for e in events:
            await e.wait()
        # (one key alone is held to its fair share of the limit: tests/unit/test_tenant_fairness.py)
        r = await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"]
        await asyncio.gather(one, *more)
    async with httpx.AsyncClient() as after:
        r = await after.post(server.url + "/v1/chat/completions", json={**body, "stream": False},
                             headers={"Authorization": "Bearer sk-one"})
    assert r.status_code == 200  # released when the stream ended


def test_deadline(server: LiveServer, fakes: dict[str, FakeEngine]) -> None:
    slow = {"model": "slow", "messages": [{"role": "user", "content": "q"}], "max_tokens": 5000, "ignore_eos": True}
    auth = {"Authorization": "Bearer sk-admin"}
    r = httpx.post(server.url + "/v1/chat/completions", json=slow, headers={**auth, "X-Chorus-Timeout": "0.3"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert wait_until(lambda: fakes["slow"].active_sessions == 0, 5)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**slow, "stream": True},
                      headers={**auth, "X-Chorus-Timeout": "0.3"}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data:")]
    assert "deadline_exceeded" in lines[-2] and lines[-1] == "data: [DONE]"
    assert wait_until(lambda: fakes["slow"].active_sessions == 0, 5)
    r = httpx.post(server.url + "/v1/chat/completions", json=slow, headers={**auth, "X-Chorus-Timeout": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Chorus-Timeout"


@pytest.mark.parametrize(("extra", "match"), [
    ({"messages": [{"role": "user", "content": "q"}] * 5}, "At most 4 messages"),
    ({"ensemble": {"strategy": "crowd_vote", "members": ["fake"] * 4}}, "At most 3 ensemble members"),
    ({"ensemble": {"strategy": "exchange_of_thought", "members": ["fake"] * 2, "max_rounds": 3}}, "max_rounds"),
    ({"ensemble": {"strategy": "crowd_vote", "candidates": ["a"] * 5}}, "At most 4 candidates (given or sampled)"),
    ({"ensemble": {"strategy": "crowd_vote", "members": ["fake"] * 3, "samples_per_member": 2}}, "candidates"),
])
def test_request_limits(server: LiveServer, extra: dict[str, Any], match: str) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "q"}], **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-admin"})
    assert r.status_code == 400 and match in r.json()["error"]["message"]


def test_request_id_and_metrics(server: LiveServer) -> None:
    auth = {"Authorization": "Bearer sk-admin"}
    body = {"model": "fake", "messages": [{"role": "user", "content": "q"}], "max_tokens": 3}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={**auth, "X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={**auth, "X-Request-ID": "bad id/"})
    assert len(r.headers["x-request-id"]) == 32  # not sane: replaced
    text = httpx.get(server.url + "/metrics").text
    for name in ('chorus_requests_total{model="fake",route="/v1/chat/completions",status="200",strategy=""}',
                 'chorus_tokens_total{kind="completion",model="fake"}', "chorus_inflight_requests",
                 'chorus_engine_active_sessions{model="slow"}', "chorus_request_seconds_bucket",
                 'chorus_refused_total{reason="invalid_api_key"}'):
        assert name in text, name


def test_access_log_has_the_request_id_and_no_prompt(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="chorus.access"):
        httpx.post(
            server.url + "/v1/chat/completions",
            headers={"Authorization": "Bearer sk-admin", "X-Request-ID": "r-1"},
            json={"model": "fake", "messages": [{"role": "user", "content": "secret words"}], "max_tokens": 2},
        )
        assert wait_until(lambda: any(getattr(r, "request_id", None) == "r-1" for r in caplog.records), 5)
    rec = next(r for r in caplog.records if getattr(r, "request_id", None) == "r-1")
    assert rec.status == 200 and rec.key == "admin" and rec.model == "fake" and rec.usage["completion_tokens"] == 2
    assert "secret" not in str(rec.__dict__)


def test_draining(server: LiveServer) -> None:
    admission = services_of(server.app).admission
    admission.draining = True
    try:
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        r = httpx.post(server.url + "/v1/chat/completions", json={}, headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    finally:
        admission.draining = False


def test_env_keys() -> None:
    store = KeyStore([], "team:abc, xyz")
    assert store.authenticate("Bearer abc").name == "team"
    assert store.authenticate("Bearer xyz").name == "env-2"
    assert not KeyStore([], None).enabled


def test_token_window_slides() -> None:
    import time

    from chorus.errors import RateLimited
    from chorus.server.gateway.auth import Principal

    p = Principal("k", "h", tpm=100, rpm=3)
    p.admit(now=0.0)
    p.charge(60)
    p.charge(50)
    p.release()
    with pytest.raises(RateLimited, match=r"100 tokens per minute \(110 used\)"):
        p.admit(now=time.monotonic())
    p.tokens = type(p.tokens)((t - 100.0, n) for t, n in p.tokens)  # as if charged 100 s ago
    p.admit(now=time.monotonic())
    assert p.tokens_in_window == 0 and not p.tokens
