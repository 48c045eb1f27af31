"""The tenant-boundary findings 3 to 8, one test each (1 and 2: test_allow_list_walk.py, test_tenant_fairness.py),
through the openai SDK where a client is involved, the Redis store where one is named: held sessions cannot
starve another key and are charged; /metrics stays bounded and names no ids; budgets hold under concurrency, for
``n: 16`` and for a mixture-of-agents judge; files and batches are metered; out-of-range integers, odd file names
and JSONL separators are clear; and the smaller leaks are closed."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import io
import json
import shutil
import time
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import openai
import pytest

from chorus.config import ChorusConfig, ConfigError
from chorus.engines.fake.engine import FakeEngine
from chorus.server.gateway.auth import KeyStore, hash_key
from chorus.server.gateway.services import services_of
from tests.helpers import LiveServer, gateway, require, wait_until
from tests.unit.test_shared_state import Redis

KEYS = [{"name": n, "sha256": hash_key(f"sk-{n}")} for n in ("alpha", "bravo", "carol", "delta")] + [
    {"name": "budget", "sha256": hash_key("sk-budget"), "max_budget": 300},
    {"name": "judge", "sha256": hash_key("sk-judge"), "max_budget": 100_000, "budget_unit": "currency"},
    {"name": "slowrpm", "sha256": hash_key("sk-slowrpm"), "rpm": 2},
    {"name": "narrow", "sha256": hash_key("sk-narrow"), "models": ["fa", "moa"]},
    {"name": "small", "sha256": hash_key("sk-small"), "tpm": 1_000_000},
]
PRICE = {"prompt": 1.0, "completion": 1.0}


def config(tmp: Path, **server: Any) -> dict[str, Any]:
    return {
        "server": {"batches": {"dir": str(tmp / "batches"), "poll_s": 0.05, "max_bytes_per_key": 4096},
                   "limits": {"max_stored_responses": 3}, **server},
        "models": [{"name": "fa", "engine": "fake", "max_batch_size": 4}, {"name": "fsecret", "engine": "fake"},
                   {"name": "fjudge", "engine": "fake"}],
        "ensembles": [{"name": "moa", "strategy": "mixture_of_agents", "members": ["fa", "fsecret"],
                       "aggregator": "fjudge"}],
        "prices": {"fa": PRICE, "fsecret": PRICE, "fjudge": {"prompt": 5.0, "completion": 5.0}},
        "auth": {"keys": KEYS},
        "server_feedback": None,
    }


def build(tmp: Path, **server: Any) -> ChorusConfig:
    cfg = config(tmp, **server)
    cfg.pop("server_feedback")
    cfg["server"]["feedback"] = {"metrics": [{"name": "good"}]}
    return ChorusConfig.model_validate(cfg)


def engines() -> dict[str, FakeEngine]:
    return {"fa": FakeEngine("fa", reply=lambda _: "the answer is 4", max_model_len=4096),
            "fsecret": FakeEngine("fsecret", reply=lambda _: "secret words", max_model_len=4096),
            "fjudge": FakeEngine("fjudge", reply=lambda _: "judged: 4", max_model_len=4096)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with gateway(build(tmp_path_factory.mktemp("findings")), engines()) as srv:
        yield srv


def sdk(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=f"sk-{key}", max_retries=0, timeout=30)


def post(server: LiveServer, key: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer sk-{key}", **headers},
                      timeout=30)


def spend(server: LiveServer, key: str) -> dict[str, Any]:
    services = services_of(server.app)
    principal = next(p for p in services.keys.principals if p.name == key)
    return asyncio.run(services.key_state.report(principal))


CHAT = {"model": "fa", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 8, "temperature": 0}


# ---- 3: held sessions ---------------------------------------------------------------------------------------

def test_held_sessions_leave_a_slot_for_others_and_are_charged(server: LiveServer) -> None:
    def open_(key: str) -> httpx.Response:
        return post(server, key, "/chorus/v2/sessions", {"model": "fa", "prompt": [5, 6, 7, 8, 9]})

    before = spend(server, "small")["window"]["tokens"]
    first = open_("small")
    assert first.status_code == 200
    again = open_("small")  # fa has 4 batch slots: one key may hold (4 - 1) // 2 = 1 session on it
    assert again.status_code == 429 and again.json()["error"]["code"] == "sessions_exhausted"
    assert [open_(k).status_code for k in ("alpha", "bravo")] == [200, 200]
    full = open_("carol")  # three held: the fourth slot stays for requests of any key
    assert full.status_code == 429 and "one is kept for requests" in full.json()["error"]["message"]
    assert post(server, "delta", "/v1/chat/completions", CHAT).status_code == 200
    sid = first.json()["id"]
    step = post(server, "small", f"/chorus/v2/sessions/{sid}/step", {"tokens": [3, 4, 5]})
    assert step.status_code == 200
    assert wait_until(lambda: spend(server, "small")["window"]["tokens"] - before == 5 + 3)  # charged as tokens
    listing = httpx.get(server.url + "/chorus/v1/sessions", headers={"Authorization": "Bearer sk-delta"}).json()
    assert listing["open"] == 0  # another key's sessions are not counted for it
    for key in ("small", "alpha", "bravo"):
        for s in list(services_of(server.app).sessions.held.values()):
            if s.owner == key:
                httpx.delete(server.url + f"/chorus/v1/sessions/{s.id}", headers={"Authorization": f"Bearer sk-{key}"})


# ---- 4: /metrics --------------------------------------------------------------------------------------------

def test_metrics_stay_bounded_and_name_no_ids(server: LiveServer) -> None:
    def size() -> int:
        return len(httpx.get(server.url + "/metrics").text.splitlines())

    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sk-alpha"}) as http:
        for i in range(30):
            http.get(f"/x{i}")
            http.get(f"/v1/files/file-{i:024x}")
            http.get(f"/v1/batches/batch_{i:024x}")
        size()  # (the scrape's own series appear after the first)
        lines = size()
        for i in range(30, 600):
            http.get(f"/x{i}")
            http.get(f"/v1/files/file-{i:024x}")
            http.get(f"/v1/batches/batch_{i:024x}")
    assert size() == lines  # not one series per path
    text = httpx.get(server.url + "/metrics").text
    assert "file-0000" not in text and "batch_0000" not in text and "/x5" not in text
    assert 'route="/v1/files/{file_id}"' in text and 'route="unmatched"' in text


# ---- 5: budgets ---------------------------------------------------------------------------------------------

def test_budgets_hold_before_the_spend(server: LiveServer) -> None:
    body = {**CHAT, "max_tokens": 16}
    with cf.ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(lambda _: post(server, "budget", "/v1/chat/completions", body).status_code, range(20)))
    assert codes.count(200) >= 1 and set(codes) <= {200, 429}
    assert wait_until(lambda: spend(server, "budget")["budget"]["spent"] > 0)
    time.sleep(0.2)
    report = spend(server, "budget")
    assert report["budget"]["spent"] <= 300, (report, codes)  # 20 at once could not pass the budget together
    opened = engines_opened(server)
    r = post(server, "budget", "/v1/chat/completions", {**CHAT, "n": 16, "max_tokens": 100})
    assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded"
    assert "may cost up to" in r.json()["error"]["message"] and engines_opened(server) == opened  # nothing ran


def engines_opened(server: LiveServer) -> int:
    return sum(e.opened for e in services_of(server.app).engines.values() if isinstance(e, FakeEngine))


def test_a_judge_is_charged_to_its_own_model_at_its_price(server: LiveServer) -> None:
    r = sdk(server, "judge").chat.completions.create(model="moa", messages=[{"role": "user", "content": "2+2?"}],
                                                     max_tokens=8)
    assert r.choices[0].message.content
    assert wait_until(lambda: "fjudge" in spend(server, "judge")["spend"]["lifetime"])
    lifetime = spend(server, "judge")["spend"]["lifetime"]
    assert not any(m.startswith("aggregator:") for m in lifetime) and lifetime["fjudge"]["cost"] > 0
    with pytest.raises(Exception, match="no price for: fjudge"):
        bad = config(Path("/tmp"))
        bad.pop("server_feedback")
        del bad["prices"]["fjudge"]
        ChorusConfig.model_validate(bad)


# ---- 6: files and batches metered ---------------------------------------------------------------------------

def test_uploads_count_against_rpm_and_a_storage_quota(server: LiveServer) -> None:
    c = sdk(server, "slowrpm")
    c.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    c.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.RateLimitError, match="requests per minute"):  # past its rpm: no more uploads
        c.files.create(file=("c.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert len(c.files.list().data) == 2  # reading stays open
    b = sdk(server, "bravo")
    b.files.create(file=("big.jsonl", io.BytesIO(b"x" * 3000)), purpose="batch")
    with pytest.raises(openai.APIStatusError, match="max_bytes_per_key") as err:
        b.files.create(file=("more.jsonl", io.BytesIO(b"x" * 2000)), purpose="batch")
    assert err.value.status_code == 413


# ---- 7: inputs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_an_out_of_range_seed_is_a_400_naming_it(server: LiveServer, seed: int) -> None:
    for body in ({**CHAT, "seed": seed},
                 {**CHAT, "ensemble": {"strategy": "answer_vote", "members": [{"model": "fa", "seed": seed}, "fa"]}}):
        r = post(server, "alpha", "/v1/chat/completions", body)
        assert r.status_code == 400 and "seed" in (r.json()["error"]["param"] or ""), r.text
    ok = post(server, "alpha", "/v1/chat/completions", {**CHAT, "seed": 2**63 - 1, "n": 3})
    assert ok.status_code == 200  # the largest seed, and the seeds derived from it (seed + choice)
    r = post(server, "alpha", "/v1/chat/completions", {**CHAT, "max_tokens": 2**40})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def jsonl_with_separators() -> bytes:
    body = {**CHAT, "messages": [{"role": "user", "content": "one\u2028two\u2029three\u0085four"}]}
    line = json.dumps({"custom_id": "sep", "method": "POST", "url": "/v1/chat/completions", "body": body},
                      ensure_ascii=False)
    return (line + "\r\n").encode()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    require(shutil.which("redis-server") is not None, "needs redis-server (apt-get install redis-server)")
    r = Redis(tmp_path_factory.mktemp("redis"))
    r.start()
    yield r
    r.kill()


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_file_names_and_jsonl_separators(tmp_path: Path, store: str, request: pytest.FixtureRequest) -> None:
    cfg = build(tmp_path)
    if store == "redis":
        cfg.server.state.store = request.getfixturevalue("redis_server").url
        cfg.server.state.key_prefix = f"t{time.monotonic_ns()}"
    with gateway(cfg, engines()) as srv:
        c = sdk(srv, "alpha")
        auth = {"Authorization": "Bearer sk-alpha"}
        for name in ("check✓.jsonl", 'a"; evil="x.jsonl'):
            up = upload_raw(srv, name, jsonl_with_separators())
            assert up.status_code == 200, up.text
            fid = up.json()["id"]
            r = httpx.get(srv.url + f"/v1/files/{fid}/content", headers=auth)
            assert r.status_code == 200
            message = Message()
            message["content-disposition"] = r.headers["content-disposition"]
            params = dict(message.get_params(header="content-disposition") or [])
            assert set(params) == {"attachment", "filename"}  # (filename* read into filename): none injected
            exact = r.headers["content-disposition"].split("filename*=UTF-8''", 1)[1]
            assert unquote(exact) == up.json()["filename"]  # the exact name as stored, in filename*
            assert name.startswith(up.json()["filename"])  # (the form parser ends a raw quote's name at it)
        f = c.files.retrieve(fid)
        for bad in ("nul\x00.jsonl", "esc\x1b[31m.jsonl", "line\u2028.jsonl"):
            refused = upload_raw(srv, bad, b"{}\n")
            assert refused.status_code == 400 and "control" in refused.json()["error"]["message"]
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_until(lambda: c.batches.retrieve(batch.id).status in ("completed", "failed"), timeout=30)
        done = c.batches.retrieve(batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1, done.errors


def upload_raw(srv: LiveServer, name: str, data: bytes) -> httpx.Response:
    """An upload with ``name`` raw on the wire, as a client that escapes nothing sends it (curl -F)."""
    boundary = "b0undary"
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return httpx.post(srv.url + "/v1/files", content=form, headers={
        "Authorization": "Bearer sk-alpha", "Content-Type": f"multipart/form-data; boundary={boundary}"})


# ---- 8: the smaller leaks -----------------------------------------------------------------------------------

def test_stored_responses_are_kept_per_key(server: LiveServer) -> None:
    mine = sdk(server, "carol").responses.create(model="fa", input="hello", max_output_tokens=16)
    other = sdk(server, "delta")
    for _ in range(5):  # more than max_stored_responses (3) of another key
        other.responses.create(model="fa", input="hello", max_output_tokens=16)
    assert sdk(server, "carol").responses.retrieve(mine.id).id == mine.id


def test_a_client_request_id_cannot_squat_another_keys(server: LiveServer) -> None:
    assert post(server, "alpha", "/v1/chat/completions", CHAT, **{"X-Request-ID": "job-1"}).status_code == 200
    assert post(server, "bravo", "/v1/chat/completions", CHAT, **{"X-Request-ID": "job-1"}).status_code == 200
    for key in ("bravo", "alpha"):  # each key's feedback reaches its own request
        r = post(server, key, "/v1/feedback", {"request_id": "job-1", "metric": "good", "value": True})
        assert r.status_code == 200, r.text
    r = post(server, "carol", "/v1/feedback", {"request_id": "job-1", "metric": "good", "value": True})
    assert r.status_code == 404


def test_listings_confirm_nothing_of_another_key(server: LiveServer) -> None:
    theirs = sdk(server, "delta").files.create(file=("t.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    c = sdk(server, "carol")
    c.files.create(file=("m.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    after = httpx.get(server.url + "/v1/files", params={"after": theirs.id}, headers={"Authorization": "Bearer sk-carol"})
    unknown = httpx.get(server.url + "/v1/files", params={"after": "file-nope"},
                        headers={"Authorization": "Bearer sk-carol"})
    assert after.json()["data"] == unknown.json()["data"]
    card = sdk(server, "narrow").models.retrieve("moa").model_extra or {}
    assert card["ensemble"]["members"] == ["fa"] and card["ensemble"]["members_not_shown"] == 1


def test_a_key_from_the_environment_cannot_shadow_a_config_key() -> None:
    keys = ChorusConfig.model_validate({"models": [{"name": "f", "engine": "fake"}],
                                        "auth": {"keys": [{"name": "alpha", "sha256": hash_key("a"),
                                                           "models": ["f"]}]}}).auth.keys
    with pytest.raises(ConfigError, match="'alpha'"):
        KeyStore(keys, "alpha:sk-other")
    assert len(KeyStore(keys, "beta:sk-other").principals) == 2
