"""No key can starve the others (issue: tenant boundaries, finding 2), over real sockets: a body counts in flight
only once it has arrived (``server.limits.body_timeout_s``: a 408 after), so a key holding sockets open with
unsent bodies takes no request slot; under contention each key gets a fair share of the in-flight limit (a 429
``fair_share_exceeded`` past it), so one busy key leaves room for the others."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.server.gateway.auth import hash_key
from tests.helpers import LiveServer, gateway

LIMIT = 8
CONFIG = {
    "server": {"limits": {"max_concurrent_requests": LIMIT, "body_timeout_s": 2.0}},
    "models": [{"name": "fake", "engine": "fake"}, {"name": "slow", "engine": "fake"}],
    "auth": {"keys": [{"name": "hostile", "sha256": hash_key("sk-hostile")},
                      {"name": "other", "sha256": hash_key("sk-other")}]},
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"fake": FakeEngine("fake", reply=lambda _: "hello"),
               "slow": FakeEngine("slow", reply=lambda _: "slow answer", delay=0.3)}
    with gateway(ChorusConfig.model_validate(CONFIG), engines) as srv:
        yield srv


def stalled(url: str, key: str) -> socket.socket:
    """A socket that sends a chat completion's headers, promises 1000 bytes and sends one."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {key}\r\n"
              "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
    return s


def ask(server: LiveServer, key: str, model: str = "fake") -> openai.types.chat.ChatCompletion:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=10)
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0)


def test_sockets_with_unsent_bodies_hold_no_slot_and_are_answered_408(server: LiveServer) -> None:
    socks = [stalled(server.url, "sk-hostile") for _ in range(4 * LIMIT)]  # four times the server's limit
    try:
        time.sleep(0.3)
        for key in ("sk-other", "sk-hostile"):  # every key, the hostile one too, is still served
            assert ask(server, key).choices[0].message.content == "hello"
        metrics = httpx.get(server.url + "/metrics").text
        inflight = next(line for line in metrics.splitlines() if line.startswith("chorus_inflight_requests "))
        assert float(inflight.split()[1]) <= 1
        socks[0].settimeout(10)
        reply = socks[0].recv(4096).decode()  # past body_timeout_s: the request ends with a 408 in the envelope
        head, _, body = reply.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 408")
        error = json.loads(body[body.index("{"):body.rindex("}") + 1])["error"]
        assert error["code"] == "request_timeout" and "body_timeout_s" in error["message"]
    finally:
        for s in socks:
            s.close()


def test_one_busy_key_gets_its_fair_share_and_leaves_room_for_another(server: LiveServer) -> None:
    results: list[int] = []

    async def flood() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30,
                                     headers={"Authorization": "Bearer sk-hostile"}) as c:
            body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(3 * LIMIT)))
            results.extend(r.status_code for r in rs)
            refused = [r.json()["error"] for r in rs if r.status_code == 429]
            assert refused and all(e["code"] == "fair_share_exceeded" for e in refused)

    t = threading.Thread(target=asyncio.run, args=(flood(),))
    t.start()
    time.sleep(0.1)
    try:  # while the hostile key floods the server, the other key is served, not told the server is full
        for _ in range(3):
            assert ask(server, "sk-other").choices[0].message.content == "hello"
    finally:
        t.join()
    assert results.count(200) >= LIMIT // 2 and 429 in results and 503 not in results
