"""OpenAI's Batch API (/v1/files, /v1/batches; server/batch/) through the official openai SDK, on fake engines: the
whole cycle, an ensemble batch, cancel and expiry mid-run, a restart mid-batch, keys kept apart, budgets, and
malformed input failing the batch with the line named."""

from __future__ import annotations

import io
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from chorus.clients.local import free_port, wait_ready
from chorus.config import ChorusConfig
from chorus.engines.core.request_scope import queue_in
from chorus.engines.fake.engine import FakeEngine
from chorus.server.gateway.auth import hash_key
from tests.helpers import LiveServer, gateway, require, wait_until
from tests.unit.test_shared_state import Redis

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


def config(tmp: Path, **batches: Any) -> ChorusConfig:
    return ChorusConfig.model_validate({
        "server": {"batches": {"dir": str(tmp / "batches"), "poll_s": 0.05, **batches}},
        "models": [{"name": n, "engine": "fake"} for n in ("fake", "slow", "other")],
        "ensembles": [{"name": "pair", "strategy": "answer_vote", "members": ["fake", "other"], "samples": 2}],
        "auth": {"keys": [{"name": "alpha", "sha256": hash_key("sk-alpha")},
                          {"name": "bravo", "sha256": hash_key("sk-bravo")},
                          {"name": "narrow", "sha256": hash_key("sk-narrow"), "models": ["fake"]},
                          {"name": "broke", "sha256": hash_key("sk-broke"), "max_budget": 200}]},
    })


def engines() -> dict[str, FakeEngine]:
    echo = lambda prompt: "re:" + (re.findall(r"item \d+", prompt) or ["?"])[-1]  # noqa: E731
    return {"fake": FakeEngine("fake", reply=echo), "slow": FakeEngine("slow", delay=0.02, reply=echo),
            "other": FakeEngine("other", reply=echo)}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with gateway(config(tmp_path), engines()) as srv:
        yield srv


def client(srv: LiveServer, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def line(i: int, model: str = "fake", url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": 16,
                     "temperature": 0, **body}}


def upload(c: openai.OpenAI, lines: list[Any]) -> str:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return c.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def finished(c: openai.OpenAI, batch_id: str, timeout: float = 30.0) -> Any:
    assert wait_until(lambda: c.batches.retrieve(batch_id).status in FINAL, timeout=timeout)
    return c.batches.retrieve(batch_id)


def rows(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def test_the_whole_cycle(server: LiveServer) -> None:
    c = client(server)
    fid = upload(c, [line(i) for i in range(12)])
    assert c.files.retrieve(fid).purpose == "batch" and fid in [f.id for f in c.files.list()]
    batch = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = finished(c, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.output_file_id
    out = rows(c, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(12))
    for r in out:
        body = r["response"]["body"]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == \
            "re:" + r["custom_id"].replace("req-", "item ")
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert [b.id for b in c.batches.list()] == [batch.id]
    assert c.files.delete(fid).deleted and fid not in [f.id for f in c.files.list()]


def test_completions_an_ensemble_and_a_failing_line(server: LiveServer) -> None:
    c = client(server)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": f"item {i}", "max_tokens": 4}} for i in range(3)]
    done = finished(c, c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/completions",
                                        completion_window="24h").id)
    assert done.status == "completed" and len(rows(c, done.output_file_id)) == 3
    chats = [line(0, "pair"), line(1, "fake", ensemble={"strategy": "answer_vote", "members": ["fake", "other"],
                                                              "samples": 2}),
             line(2, "fake", max_tokens=100_000)]  # runs, and is refused as a live request would be
    done = finished(c, c.batches.create(input_file_id=upload(c, chats), endpoint=CHAT, completion_window="24h").id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = {r["custom_id"]: r["response"]["body"] for r in rows(c, done.output_file_id)}
    assert out["req-0"]["model"] == "pair" and out["req-1"]["choices"][0]["message"]["content"] == "re:item 1"
    (err,) = rows(c, done.error_file_id)
    assert err["custom_id"] == "req-2" and err["response"]["status_code"] == 400
    assert "maximum context length" in err["response"]["body"]["error"]["message"]


def test_cancel_mid_run(tmp_path: Path) -> None:
    with gateway(config(tmp_path, concurrency=1), engines()) as srv:
        c = client(srv)
        batch = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(40)]), endpoint=CHAT,
                                 completion_window="24h")
        assert wait_until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 2)
        assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = finished(c, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        ran, unrun = rows(c, done.output_file_id), rows(c, done.error_file_id)
        assert len(ran) + len(unrun) == 40 and len(ran) < 40
        assert {r["error"]["code"] for r in unrun} == {"batch_cancelled"}
        completed = finished(c, c.batches.create(input_file_id=upload(c, [line(0)]), endpoint=CHAT,
                                                 completion_window="24h").id)
        with pytest.raises(openai.BadRequestError, match="only a validating or in-progress batch"):
            c.batches.cancel(completed.id)


def test_expiry(tmp_path: Path) -> None:
    with gateway(config(tmp_path, concurrency=1), engines()) as srv:
        c = client(srv)
        batch = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(60)]), endpoint=CHAT,
                                 completion_window="2s")
        done = finished(c, batch.id)
        assert done.status == "expired" and done.expired_at
        ran, unrun = rows(c, done.output_file_id), rows(c, done.error_file_id)
        assert ran and unrun and len(ran) + len(unrun) == 60
        assert unrun[0]["error"]["code"] == "batch_expired"


def test_a_restart_resumes_and_answers_each_line_once(tmp_path: Path) -> None:
    cfg = config(tmp_path, concurrency=2)
    with gateway(cfg, engines()) as first:
        c = client(first)
        batch = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(30)]), endpoint=CHAT,
                                 completion_window="24h")
        assert wait_until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 3)
    with gateway(cfg, engines()) as second:  # the store is found at start-up: the batch goes on
        c = client(second)
        done = finished(c, batch.id)
        ids = [r["custom_id"] for r in rows(c, done.output_file_id)]
        assert done.status == "completed" and sorted(ids) == sorted(f"req-{i}" for i in range(30))


def test_keys_see_only_their_own(server: LiveServer) -> None:
    a, b = client(server), client(server, "sk-bravo")
    fid = upload(a, [line(0)])
    batch = a.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    for call in (lambda: b.files.retrieve(fid), lambda: b.files.content(fid), lambda: b.files.delete(fid),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.batches.list().data == [] and b.files.list().data == []
    done = finished(a, batch.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)


def test_a_batch_runs_as_its_key(server: LiveServer) -> None:
    narrow = client(server, "sk-narrow")
    done = finished(narrow, narrow.batches.create(input_file_id=upload(narrow, [line(0, "other")]), endpoint=CHAT,
                                                  completion_window="24h").id)
    assert done.status == "failed" and done.errors.data[0].code == "model_not_found"
    assert "other" not in (done.errors.data[0].message or "").split("Available models:")[1]
    broke = client(server, "sk-broke")  # 200 tokens: a few lines, then the budget stops the batch cleanly
    done = finished(broke, broke.batches.create(input_file_id=upload(broke, [line(i) for i in range(40)]),
                                                endpoint=CHAT, completion_window="24h").id)
    assert done.status == "failed" and done.errors.data[0].code == "budget_exceeded"
    ran, unrun = rows(broke, done.output_file_id), rows(broke, done.error_file_id)
    assert ran and len(ran) + len(unrun) == 40 and {r["error"]["code"] for r in unrun} == {"budget_exceeded"}


GOOD = json.dumps(line(0))
MALFORMED = [  # (file lines, the line named, the error code)
    ([GOOD, "{not json"], 2, "invalid_json_line"),
    ([GOOD, "[1, 2]"], 2, "invalid_request"),
    ([{**line(1), "custom_id": None}], 1, "missing_custom_id"),
    ([GOOD, json.dumps(line(0))], 2, "duplicate_custom_id"),
    ([{**line(1), "method": "GET"}], 1, "invalid_method"),
    ([GOOD, GOOD.replace("req-0", "req-1").replace(CHAT, "/v1/embeddings")], 2, "mismatched_url"),
    ([{**line(1), "body": "hello"}], 1, "invalid_request"),
    ([GOOD, line(1, "nosuch")], 2, "model_not_found"),
    ([line(1, stream=True)], 1, "invalid_request"),
    ([{**line(1), "body": {"model": "fake"}}], 1, "invalid_request"),  # no messages
    ([GOOD, {**line(1), "extra": 1}], 2, "invalid_request"),
    ([line(1, temperature="hot")], 1, "invalid_request"),
]


@pytest.mark.parametrize("lines, bad, code", MALFORMED)
def test_malformed_input_fails_the_batch_naming_the_line(server: LiveServer, lines: list[Any], bad: int,
                                                         code: str) -> None:
    c = client(server)
    done = finished(c, c.batches.create(input_file_id=upload(c, lines), endpoint=CHAT, completion_window="24h").id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    (error,) = done.errors.data
    assert (error.line, error.code) == (bad, code) and f"Line {bad}" in (error.message or "")


def test_requests_the_api_refuses(server: LiveServer, tmp_path: Path) -> None:
    c = client(server)
    fid = upload(c, [line(0)])
    for kwargs, status in (({"endpoint": "/v1/moderations"}, openai.BadRequestError),
                           ({"completion_window": "forever"}, openai.BadRequestError),
                           ({"completion_window": "30d"}, openai.BadRequestError),
                           ({"input_file_id": "file-nosuch"}, openai.NotFoundError)):
        with pytest.raises(status):
            c.batches.create(**{"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h", **kwargs})
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    empty = finished(c, c.batches.create(input_file_id=upload(c, []), endpoint=CHAT, completion_window="24h").id)
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"
    out = finished(c, c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h").id).output_file_id
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.batches.create(input_file_id=out, endpoint=CHAT, completion_window="24h")
    with gateway(config(tmp_path / "small", max_file_bytes=1024), engines()) as small:
        with pytest.raises(openai.APIStatusError) as big:
            client(small).files.create(file=("big.jsonl", io.BytesIO(b"x" * 4096)), purpose="batch")
        assert big.value.status_code == 413
    roomy = config(tmp_path / "roomy")
    roomy.server.limits.max_body_bytes = 64 * 1024  # a request's limit: uploads have their own (max_file_bytes)
    with gateway(roomy, engines()) as srv:
        c = client(srv)
        big = [json.dumps(line(i, "fake", user="x" * 2000)) for i in range(100)]  # ~220 KB
        assert c.files.retrieve(upload(c, big)).bytes > 200_000
        with pytest.raises(openai.APIStatusError) as too_big:  # and a chat request is still held to its own
            c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 70_000}])
        assert too_big.value.status_code == 413
    with gateway(config(tmp_path / "lines", max_lines=3), engines()) as few:
        c = client(few)
        done = finished(c, c.batches.create(input_file_id=upload(c, [line(i) for i in range(4)]), endpoint=CHAT,
                                            completion_window="24h").id)
        assert done.status == "failed" and done.errors.data[0].code == "too_many_requests"


def test_the_batch_api_can_be_off(tmp_path: Path) -> None:
    cfg = config(tmp_path, enabled=False)
    with gateway(cfg, engines()) as srv:
        with pytest.raises(openai.NotFoundError, match="off"):
            client(srv).batches.list()
    assert not (tmp_path / "batches").exists()


# ---- as processes: kill -9 mid-batch, and two processes on one store ----

@contextmanager
def serving(tmp: Path, n: int = 1, redis: str | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` chorus serve processes on one batch store (slow fakes: 0.01 s a token); their URLs in ``.url``.
    With ``redis``, the store is Redis and each process has a batch folder of its own (nothing shared on disk)."""
    procs = []
    for i in range(n):
        cfg = tmp / f"serve-{i}.yaml"
        state = {"state": {"store": redis}} if redis else {}
        folder = tmp / (f"store-{i}" if redis else "store")
        cfg.write_text(yaml.safe_dump({"server": {"batches": {"dir": str(folder), "poll_s": 0.05, "concurrency": 2},
                                                  **state},
                                       "models": [{"name": "slow", "engine": "fake", "fake": {"delay": 0.01}}]}))
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port),
                                 "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        procs.append(proc)
    try:
        for p in procs:
            wait_ready(p.url + "/health", p, timeout=120, interval=0.1)  # type: ignore[attr-defined]
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)


def sdk(proc: subprocess.Popen[bytes]) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)  # type: ignore[attr-defined]


def lines_done(proc: subprocess.Popen[bytes]) -> float:
    text = httpx.get(proc.url + "/metrics").text  # type: ignore[attr-defined]
    return sum(float(x.split()[-1]) for x in text.splitlines()
               if x.startswith('chorus_batch_lines_total{outcome="completed"'))


def test_kill_9_mid_batch_then_restart_answers_every_line_exactly_once(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc,):
        c = sdk(proc)
        batch = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(40)]), endpoint=CHAT,
                                 completion_window="24h")
        assert wait_until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 5, timeout=60)
        proc.kill()  # SIGKILL: no shutdown, its two lines in flight still claimed
        proc.wait(10)
    with serving(tmp_path) as (again,):
        c = sdk(again)
        done = finished(c, batch.id, timeout=120)
        ids = [r["custom_id"] for r in rows(c, done.output_file_id)]
        assert done.status == "completed" and done.request_counts.completed == 40
        assert sorted(ids) == sorted(f"req-{i}" for i in range(40))  # each once: none lost, none twice


def test_two_processes_share_a_batch_each_line_once(tmp_path: Path) -> None:
    with serving(tmp_path, 2) as (one, two):
        c = sdk(one)
        batch = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(40)]), endpoint=CHAT,
                                 completion_window="24h")
        done = finished(sdk(two), batch.id, timeout=120)  # the same store: either process answers for it
        ids = [r["custom_id"] for r in rows(c, done.output_file_id)]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(40))
        assert lines_done(one) > 0 and lines_done(two) > 0 and lines_done(one) + lines_done(two) == 40


def test_the_batch_command_submits_follows_and_downloads(server: LiveServer, tmp_path: Path) -> None:
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(json.dumps(line(i)) + "\n" for i in range(5)))
    run = subprocess.run([sys.executable, "-m", "chorus", "batch", "--url", server.url, "--api-key", "sk-alpha", "run",
                          str(src), "--metadata", "job=cli"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    batch_id = run.stdout.strip()
    out = [json.loads(x) for x in (tmp_path / "requests.out.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in out) == [f"req-{i}" for i in range(5)]
    status = subprocess.run([sys.executable, "-m", "chorus", "batch", "--url", server.url, "--api-key", "sk-bravo",
                             "status", batch_id], capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and "404" in status.stderr  # another key's batch


@pytest.mark.parametrize("queued, new, background, expected", [
    ("LLbb", "N", False, "LLNbb"),  # live: ahead of the first batch prompt waiting
    ("LLbb", "n", True, "LLbbn"),  # batch: at the end
    ("bLb", "N", False, "NbLb"),
    ("", "N", False, "N"),
])
def test_engines_queue_live_prompts_ahead_of_batch_work(queued: str, new: str, background: bool,
                                                        expected: str) -> None:
    q = deque(queued)
    queue_in(q, new, background, str.islower)
    assert "".join(q) == expected


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(shutil.which("redis-server") is not None, "needs redis-server (apt-get install redis-server)")
    r = Redis(tmp_path_factory.mktemp("redis"))
    r.start()
    yield r.url
    r.kill()


def test_the_whole_cycle_on_redis(tmp_path: Path, redis_url: str) -> None:
    cfg = config(tmp_path)
    cfg.server.state.store = redis_url
    cfg.server.state.key_prefix = f"t{time.monotonic_ns()}"
    with gateway(cfg, engines()) as srv:
        c, other = client(srv), client(srv, "sk-bravo")
        fid = upload(c, [line(i) for i in range(8)] + [line(8, "fake", max_tokens=100_000)])
        batch = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h", metadata={"on": "redis"})
        done = finished(c, batch.id)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (8, 1)
        assert sorted(r["custom_id"] for r in rows(c, done.output_file_id)) == sorted(f"req-{i}" for i in range(8))
        assert [r["custom_id"] for r in rows(c, done.error_file_id)] == ["req-8"]
        assert c.files.content(fid).text.count("\n") == 9 and [b.id for b in c.batches.list()] == [batch.id]
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        assert other.files.list().data == []
        bad = finished(c, c.batches.create(input_file_id=upload(c, [GOOD, "{"]), endpoint=CHAT,
                                           completion_window="24h").id)
        assert bad.status == "failed" and bad.errors.data[0].line == 2
        slow = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(40)]), endpoint=CHAT,
                                completion_window="24h")
        assert wait_until(lambda: c.batches.retrieve(slow.id).request_counts.completed >= 1)
        c.batches.cancel(slow.id)
        cancelled = finished(c, slow.id)
        assert cancelled.status == "cancelled"
        assert len(rows(c, cancelled.output_file_id)) + len(rows(c, cancelled.error_file_id)) == 40
        assert c.files.delete(fid).deleted and fid not in [f.id for f in c.files.list()]


def test_two_replicas_on_one_redis_share_a_batch_and_survive_a_kill_9(tmp_path: Path, redis_url: str) -> None:
    with serving(tmp_path, 2, redis=redis_url) as (one, two):
        c = sdk(one)
        batch = c.batches.create(input_file_id=upload(c, [line(i, "slow") for i in range(60)]), endpoint=CHAT,
                                 completion_window="24h")
        assert wait_until(lambda: lines_done(one) >= 3 and lines_done(two) >= 3, timeout=60)  # both at work
        one.kill()  # SIGKILL: its lines in flight stay claimed until it is back (or their lease ends)
        one.wait(10)
        before = lines_done(two)
        with serving(tmp_path, 1, redis=redis_url) as (again,):
            done = finished(sdk(two), batch.id, timeout=120)
            ids = [r["custom_id"] for r in rows(sdk(again), done.output_file_id)]
            assert done.status == "completed" and sorted(ids) == sorted(f"req-{i}" for i in range(60))
            assert lines_done(two) > before


def test_responses_lines_and_a_key_at_its_concurrency_limit(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg.auth.keys[0].max_concurrent = 1  # alpha: one request at a time; the batch runs 4 lines at once
    with gateway(cfg, engines()) as srv:
        c = client(srv)
        retried = lambda: sum(float(x.split()[-1]) for x in httpx.get(srv.url + "/metrics").text.splitlines()  # noqa: E731
                              if x.startswith('chorus_batch_lines_total{outcome="retried"}'))
        before = retried()
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "fake", "input": f"item {i}", "max_output_tokens": 16, "temperature": 0}}
                 for i in range(6)]
        done = finished(c, c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/responses",
                                            completion_window="24h").id, timeout=60)
        assert done.status == "completed" and done.request_counts.completed == 6  # refused lines waited, then ran
        out = {r["custom_id"]: r["response"]["body"] for r in rows(c, done.output_file_id)}
        assert out["r3"]["object"] == "response" and out["r3"]["output"][0]["content"][0]["text"] == "re:item 3"
        assert retried() > before  # 429s for the key's concurrency, each tried again after its Retry-After
