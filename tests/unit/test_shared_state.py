"""Per-key limits, budgets and spend shared by gateway replicas through a real ``redis-server`` (Debian's
package; CI installs it): two ``chorus serve`` processes over fake engines and one Redis. Exactly ``rpm`` requests
are admitted across both; tokens and budgets likewise; the spend equals the usages the clients received;
Redis killed under load behaves as each policy says (fail_open: every request served and the outage counted;
fail_closed: 503 with Retry-After and no other 5xx), and once it is back no charge is lost or counted twice; a
restarted gateway keeps the window."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import prepared_model_dir, require, wait_until

ADMIN = "sk-admin"
INSTALL = "apt-get install redis-server"


def sha(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    """A redis-server on a free port, persisting every write (appendfsync always) in its own directory, so a
    kill and restart keeps what it had acknowledged, as a deployment's Redis with AOF does."""

    def __init__(self, where: Path) -> None:
        self.port, self.dir = free_port(), where
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                      str(self.dir), "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(self.ping, timeout=10)

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.5).ping())
        except redis.exceptions.ConnectionError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    require(shutil.which("redis-server") is not None, f"needs redis-server ({INSTALL})")
    r = Redis(tmp_path_factory.mktemp("redis"))
    r.start()
    yield r
    r.kill()


def config(redis_url: str, policy: str = "fail_open", **key: Any) -> dict[str, Any]:
    return {"server": {"state": {"store": redis_url, "on_failure": policy, "admin_sha256": sha(ADMIN),
                                 "timeout_s": 0.3}},
            "models": [{"name": "fake", "engine": "fake", "fake": {"script": "Hello there."}},
                       {"name": "other", "engine": "fake", "fake": {"script": "Hi."}}],
            "ensembles": [{"name": "avg", "strategy": "logit_average", "members": ["fake", "other"]}],
            "prices": {"fake": {"prompt": 1000.0, "completion": 2000.0}, "other": {"prompt": 500.0, "completion": 0.0}},
            "auth": {"keys": [{"name": "k", "sha256": sha("sk-k"), **key}]}}


@contextmanager
def serve(cfg: dict[str, Any], tmp: Path, n: int = 2) -> Iterator[list[str]]:
    """``n`` chorus serve processes with this config; yields their base URLs."""
    path = tmp / f"config-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs, urls, logs = [], [], []
    for i in range(n):
        port = free_port()
        logs.append(tmp / f"serve-{path.stem}-{i}.log")  # its stderr: what a process that will not stop said
        with logs[-1].open("wb") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(path), "--port",
                                           str(port), "--log-level", "warning"], env={**os.environ},
                                          stdout=subprocess.DEVNULL, stderr=err))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for u, p in zip(urls, procs):
            assert wait_until(lambda u=u, p=p: up(u) or p.poll() is not None, timeout=120) and p.poll() is None
        yield urls
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        stuck = []
        for p, log in zip(procs, logs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()  # never left running; the failure says what it printed
                p.wait()
                stuck.append(f"pid {p.pid}: {log.read_text(errors='replace')[-2000:]}")
        assert not stuck, "chorus serve did not stop within 60 s of SIGTERM:\n" + "\n".join(stuck)


def up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def ask(url: str, model: str = "fake", max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-k"}, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})


def report(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/keys/k", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens_spent(url: str) -> int:
    return int(sum(m["tokens"] for m in report(url)["spend"]["lifetime"].values()))


def test_two_replicas_admit_exactly_rpm_requests(redis_server: Redis, tmp_path: Path) -> None:
    redis_server.flush()
    with serve(config(redis_server.url, rpm=10), tmp_path) as (a, b), cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: ask(a if i % 2 else b), range(16)))
        assert sorted(r.status_code for r in codes) == [200] * 10 + [429] * 6
        refused = next(r for r in codes if r.status_code == 429)
        assert 1 <= int(refused.headers["retry-after"]) <= 60 and "10 requests per minute" in refused.text
        assert report(a)["window"]["requests"] == report(b)["window"]["requests"] == 10
    # a restarted gateway keeps the window: the state is in Redis, not in the process
    with serve(config(redis_server.url, rpm=10), tmp_path, n=1) as (c,):
        assert ask(c).status_code == 429


def test_tokens_and_budgets_are_shared_and_spend_is_what_clients_received(redis_server: Redis, tmp_path: Path) -> None:
    redis_server.flush()
    with serve(config(redis_server.url, max_budget=300, budget_unit="tokens", budget_period_s=3600), tmp_path) \
            as (a, b):
        received, refused = 0, None
        for i in range(40):
            r = ask(a if i % 2 else b, model="avg" if i % 3 == 0 else "fake")
            if r.status_code == 429:
                refused = r
                break
            assert r.status_code == 200, r.text
            received += r.json()["usage"]["total_tokens"]
        assert refused is not None and refused.json()["error"]["code"] == "budget_exceeded"
        assert "300" in refused.json()["error"]["message"] and "retry-after" in refused.headers
        assert wait_until(lambda: tokens_spent(a) == received, timeout=10), (tokens_spent(a), received)
        rep = report(b)
        # each request's worst case is reserved before it runs (server/reserve.py): the budget is never passed
        assert rep["budget"]["spent"] == received and 150 < received <= 300
        assert rep["budget"]["remaining"] == 300 - received
        assert set(rep["spend"]["lifetime"]) == {"fake", "other"}  # the ensemble charged each member's model
        assert rep["spend"]["period"]["fake"]["cost"] > 0
    redis_server.flush()
    with serve(config(redis_server.url, tpm=60), tmp_path) as (a, b):
        used = 0
        while (r := ask(a)).status_code == 200:
            used += r.json()["usage"]["total_tokens"]
            assert wait_until(lambda: report(b)["window"]["tokens"] == used, timeout=10)  # noqa: B023
        assert r.status_code == 429 and "tokens per minute (tpm) of 60" in r.text and 30 < used <= 60
        r = ask(b)
        assert r.status_code == 429 and "tpm" in r.text


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_redis_killed_under_load(redis_server: Redis, tmp_path: Path, policy: str) -> None:
    redis_server.flush()
    with serve(config(redis_server.url, policy), tmp_path) as (a, b):
        ok_tokens, codes = 0, []

        def load(n: int) -> None:
            nonlocal ok_tokens
            with cf.ThreadPoolExecutor(4) as pool:
                for r in pool.map(lambda i: ask(a if i % 2 else b), range(n)):
                    codes.append((r.status_code, r.headers.get("retry-after")))
                    if r.status_code == 200:
                        ok_tokens += r.json()["usage"]["total_tokens"]

        load(8)
        redis_server.kill()
        load(12)
        redis_server.start()
        assert wait_until(lambda: up(a) and "chorus_state_store_up 1.0" in httpx.get(a + "/metrics").text
                          and "chorus_state_store_up 1.0" in httpx.get(b + "/metrics").text, timeout=30)
        load(4)
        statuses = {c for c, _ in codes}
        if policy == "fail_open":
            assert statuses == {200}
            metrics = httpx.get(a + "/metrics").text + httpx.get(b + "/metrics").text
            assert "chorus_state_local_admissions_total" in metrics and "chorus_state_store_errors_total{op=" in metrics
        else:
            assert statuses <= {200, 503} and 503 in statuses
            assert all(after is not None for c, after in codes if c == 503)
        # no charge lost (the outage's were buffered and written) and none counted twice (ids)
        assert wait_until(lambda: tokens_spent(a) == ok_tokens, timeout=20), (tokens_spent(a), ok_tokens)


def test_a_redis_that_takes_no_writes_is_an_outage(redis_server: Redis, tmp_path: Path) -> None:
    """A Redis that answers but refuses writes (here out of memory; a full disk's MISCONF and a replica's READONLY
    are the same case) is an outage under the policy, never a 500: fail_open admits locally and writes the
    buffered charges once Redis takes writes again."""
    import redis

    redis_server.flush()
    admin = redis.Redis(port=redis_server.port)
    with serve(config(redis_server.url), tmp_path, n=1) as (a,):
        answers = [ask(a)]
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        try:
            answers += [ask(a) for _ in range(3)]
            assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
            assert "chorus_state_store_up 0.0" in httpx.get(a + "/metrics").text
        finally:
            admin.config_set("maxmemory", 0)
        assert wait_until(lambda: "chorus_state_store_up 1.0" in httpx.get(a + "/metrics").text, timeout=30)
        spent = sum(r.json()["usage"]["total_tokens"] for r in answers)
        assert wait_until(lambda: tokens_spent(a) == spent, timeout=20), (tokens_spent(a), spent)


def test_feedback_records_wait_for_redis_and_none_is_lost(redis_server: Redis, tmp_path: Path) -> None:
    """Requests answered while Redis is down keep their feedback records in the gateway's buffer (counted in
    /metrics) and are written when it is back: as many records as answered requests, and feedback on one answered
    during the outage is accepted afterwards."""
    import redis

    redis_server.flush()
    cfg = {**config(redis_server.url), "server": {**config(redis_server.url)["server"],
                                                  "feedback": {"metrics": [{"name": "good"}]}}}
    with serve(cfg, tmp_path) as (a, b):
        answered: list[str] = []

        def load(n: int) -> None:
            with cf.ThreadPoolExecutor(4) as pool:
                for r in pool.map(lambda i: ask(a if i % 2 else b), range(n)):
                    assert r.status_code == 200, r.text
                    answered.append(r.headers["x-request-id"])

        def buffered(url: str) -> float:
            line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                        if x.startswith("chorus_feedback_records_buffered "))
            return float(line.split()[-1])

        load(8)
        redis_server.kill()
        load(12)
        during = answered[-1]
        assert wait_until(lambda: buffered(a) + buffered(b) > 0, timeout=10)
        redis_server.start()
        assert wait_until(lambda: buffered(a) + buffered(b) == 0, timeout=30)
        load(4)
        kept = redis.Redis(port=redis_server.port, decode_responses=True)
        assert wait_until(lambda: len(kept.keys("chorus:fb:req:*")) == len(answered), timeout=20), \
            (len(kept.keys("chorus:fb:req:*")), len(answered))
        # (kept under the key and the id: server/gateway/feedback_store.py's book_entry)
        assert {k.removeprefix("chorus:fb:req:k/") for k in kept.keys("chorus:fb:req:*")} == set(answered)
        lost = [x for url in (a, b) for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith("chorus_feedback_records_lost_total ")]
        assert lost and all(float(x.split()[-1]) == 0 for x in lost)
        r = httpx.post(a + "/v1/feedback", headers={"Authorization": "Bearer sk-k"}, timeout=10,
                       json={"request_id": during, "metric": "good", "value": True})
        assert r.status_code == 200, r.text


async def test_a_feedback_batch_cut_off_at_shutdown_is_written_again(redis_server: Redis) -> None:
    """The drain task is cancelled at shutdown while its batch is on the wire: the batch goes back to the buffer
    and is written by the close (SET NX: written once even if the cut-off write had landed)."""
    import asyncio

    import redis

    from chorus.config import FeedbackSection, StateSection
    from chorus.server.gateway.feedback_store import RedisBook

    redis_server.flush()
    book = RedisBook(FeedbackSection(), StateSection(store=redis_server.url))
    on_the_wire = asyncio.Event()
    real_pipeline = book.redis.pipeline

    class Stuck:  # the first pipeline hangs in execute(), as a write cut off by shutdown does
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __aenter__(self) -> Stuck:
            await self.inner.__aenter__()
            return self

        async def __aexit__(self, *exc: Any) -> None:
            await self.inner.__aexit__(*exc)

        def set(self, *a: Any, **kw: Any) -> None:
            self.inner.set(*a, **kw)

        async def execute(self) -> None:
            on_the_wire.set()
            await asyncio.Event().wait()

    calls = {"n": 0}

    def pipeline(**kw: Any) -> Any:
        calls["n"] += 1
        return Stuck(real_pipeline(**kw)) if calls["n"] == 1 else real_pipeline(**kw)

    book.redis.pipeline = pipeline  # type: ignore[method-assign]
    await book.start()
    book.remember("cut-1", {"key": "k", "model": "fake"})
    book.remember("cut-2", {"key": "k", "model": "fake"})
    await asyncio.wait_for(on_the_wire.wait(), 5)
    assert book.writing.keys() == {"cut-1", "cut-2"} and not book.pending
    book.remember("late", {"key": "k", "model": "fake"})  # answered while the batch hung
    await book.aclose()
    kept = redis.Redis(port=redis_server.port, decode_responses=True)
    assert sorted(kept.keys("chorus:fb:req:*")) == ["chorus:fb:req:cut-1", "chorus:fb:req:cut-2", "chorus:fb:req:late"]
    assert calls["n"] == 2  # the cut-off batch and the late record, written together at close


def test_the_admin_endpoint_needs_the_admin_key(redis_server: Redis, tmp_path: Path) -> None:
    with serve(config(redis_server.url), tmp_path, n=1) as (a,):
        assert httpx.get(a + "/admin/keys/k").status_code == 401
        assert httpx.get(a + "/admin/keys/k", headers={"Authorization": "Bearer sk-k"}).status_code == 401
        r = httpx.get(a + "/admin/keys/nobody", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "name"


def test_a_budget_in_currency_with_the_memory_store(tmp_path: Path) -> None:
    """The embedded default store: a currency budget from the price table, refused before any engine work, and
    the admin report (one process's counts)."""
    from chorus.engines.fake.engine import FakeEngine
    from tests.helpers import gateway

    cfg = config("memory", max_budget=0.05, budget_unit="currency")
    cfg["server"]["state"] = {"store": "memory", "admin_sha256": sha(ADMIN)}
    engines = {"fake": FakeEngine("fake", script="Hello there."), "other": FakeEngine("other", script="Hi.")}
    with gateway(cfg, engines) as srv:
        spent = 0.0
        while True:
            r = ask(srv.url)
            if r.status_code != 200:
                break
            u = r.json()["usage"]
            spent += (u["prompt_tokens"] * 1000 + u["completion_tokens"] * 2000) / 1e6
        # refused before it could pass the budget (its worst case reserved: server/reserve.py)
        assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded" and 0.02 < spent <= 0.05
        rep = report(srv.url)
        assert rep["store"] == "memory" and abs(rep["budget"]["spent"] - spent) < 1e-9
        assert rep["budget"]["unit"] == "currency" and rep["budget"]["resets_in_s"] is None
    with pytest.raises(ValueError, match="no price for: other"):
        from chorus.config import ChorusConfig

        bad = config("memory", max_budget=1.0, budget_unit="currency")
        del bad["prices"]["other"]
        ChorusConfig.model_validate(bad)


def test_the_admin_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CHORUS_ADMIN_KEY (a Kubernetes Secret) turns the admin API on without a hash in the config, and wins."""
    from chorus.engines.fake.engine import FakeEngine
    from tests.helpers import gateway

    monkeypatch.setenv("CHORUS_ADMIN_KEY", "sk-from-env")
    cfg = config("memory")
    cfg["server"]["state"] = {"store": "memory", "admin_sha256": sha(ADMIN)}
    engines = {"fake": FakeEngine("fake", script="Hello there."), "other": FakeEngine("other", script="Hi.")}
    with gateway(cfg, engines) as srv:
        assert ask(srv.url).status_code == 200
        assert httpx.get(srv.url + "/admin/keys/k", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 401
        r = httpx.get(srv.url + "/admin/keys/k", headers={"Authorization": "Bearer sk-from-env"}, timeout=10)
        assert r.status_code == 200 and r.json()["spend"]["lifetime"]["fake"]["tokens"] > 0


@contextmanager
def mock_upstream() -> Iterator[str]:
    """bench gateway's mock OpenAI server (a fixed answer, no model) in a process of its own; yields its /v1 URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", f"from chorus.clients.bench_gateway import mock_upstream; "
                             f"mock_upstream({port})"])
    try:
        assert wait_until(lambda: up_models(f"http://127.0.0.1:{port}"), timeout=30)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.kill()
        proc.wait()


def up_models(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def remote_config(redis_url: str, upstream: str, **key: Any) -> dict[str, Any]:
    """One remote model (what --workers serves); its tokenizer is the prepared SmolLM2's."""
    tokenizer = prepared_model_dir("smollm2-135m-instruct")
    return {"server": {"state": {"store": redis_url, "admin_sha256": sha(ADMIN), "timeout_s": 0.3}},
            "models": [{"name": "fake", "engine": "remote", "max_model_len": 512,
                        "remote": {"replicas": [upstream], "model": "mock", "tokenizer": str(tokenizer)}}],
            "auth": {"keys": [{"name": "k", "sha256": sha("sk-k"), **key}]}}


def test_one_gateway_in_two_processes_counts_one_window(redis_server: Redis, tmp_path: Path) -> None:
    """``chorus serve --workers 2``: two processes on one port (the kernel spreads the connections), one rpm
    window in Redis: exactly rpm requests pass, and SIGTERM stops both."""
    redis_server.flush()
    with mock_upstream() as upstream:
        path = tmp_path / "workers.yaml"
        path.write_text(yaml.safe_dump(remote_config(redis_server.url, upstream, rpm=10)))
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(path), "--port", str(port),
                                 "--workers", "2", "--log-level", "warning"], stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_until(lambda: up(url) or proc.poll() is not None, timeout=120) and proc.poll() is None
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            assert len(children) == 2
            with cf.ThreadPoolExecutor(8) as pool:
                codes = sorted(r.status_code for r in pool.map(lambda _: ask(url), range(16)))
            assert codes == [200] * 10 + [429] * 6
            assert report(url)["window"]["requests"] == 10
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize(("models", "state", "keys", "refusal"), [
    ([{"name": "fake", "engine": "fake"}], "memory", [], "fake run(s) in this process"),
    ("remote", "memory", [{"name": "k", "sha256": "0" * 64, "rpm": 5}], "set server.state.store to a Redis URL"),
])
def test_several_processes_are_refused_where_they_would_be_wrong(tmp_path: Path, models: Any, state: str,
                                                                 keys: list[dict[str, Any]], refusal: str) -> None:
    if models == "remote":
        models = [{"name": "r", "engine": "remote", "remote": {"replicas": ["http://127.0.0.1:9/v1"],
                                                               "tokenizer": "unused"}}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"server": {"state": {"store": state}}, "models": models, "auth": {"keys": keys}}))
    res = subprocess.run([sys.executable, "-m", "chorus", "serve", "--config", str(path), "--workers", "2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and refusal in res.stderr, res.stderr
