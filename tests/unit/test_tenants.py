"""Tenants apart, on fake engines (the real prefix caches: tests/integration/test_tenants.py): the prefix-cache
scope each key gets (``server.prefix_cache.share``), listings that show a key only what its allow-list permits,
on every route that lists or describes models, and the allow-list's 403 answered before a limit's or a budget's
429."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.core.request_scope import RequestScope
from chorus.server.gateway.auth import KeyStore, hash_key
from chorus.server.gateway.tenancy import cache_scope, scope_secret
from tests.helpers import LiveServer, gateway

KEYS = [
    {"name": "alpha", "sha256": hash_key("sk-alpha"), "team": "red"},
    {"name": "carol", "sha256": hash_key("sk-carol"), "team": "red"},
    {"name": "bravo", "sha256": hash_key("sk-bravo")},
    {"name": "narrow", "sha256": hash_key("sk-narrow"), "models": ["fake", "pair"]},
    {"name": "broke", "sha256": hash_key("sk-broke"), "models": ["fake"], "max_budget": 30, "rpm": 1000},
    {"name": "rpm", "sha256": hash_key("sk-rpm"), "models": ["fake"], "rpm": 1},
]
CONFIG: dict[str, Any] = {
    "models": [{"name": "fake", "engine": "fake"}, {"name": "secret-model", "engine": "fake"}],
    "ensembles": [{"name": "pair", "strategy": "logit_average", "members": ["fake", "fake"]},
                  {"name": "secret-ensemble", "strategy": "logit_average", "members": ["fake", "secret-model"]}],
    "auth": {"keys": KEYS},
}


def scopes(share: str) -> dict[str, str | None]:
    store = KeyStore(ChorusConfig.model_validate(CONFIG).auth.keys)
    secret = scope_secret(p.sha256 for p in store.principals)
    return {p.name: cache_scope(p, share, secret) for p in store.principals}  # type: ignore[arg-type]


def test_each_key_has_its_own_scope_a_team_shares_one_and_all_shares_everything() -> None:
    by_key, by_team, shared = scopes("key"), scopes("team"), scopes("all")
    assert len(set(by_key.values())) == len(KEYS) and None not in by_key.values()
    assert by_team["alpha"] == by_team["carol"] != by_team["bravo"]  # the red team shares; bravo has no team
    assert by_team["bravo"] == by_key["bravo"] and by_team["alpha"] != by_key["alpha"]
    assert set(shared.values()) == {None}
    assert cache_scope(None, "key", b"x") is None  # no keys: the unscoped cache of a one-user server
    # the scope is an HMAC under the keys' hashes: the same on every replica with these keys, unknowable without
    assert scopes("key") == by_key and not any("alpha" in str(s) for s in by_key.values())


def test_the_clients_salt_narrows_within_the_scope_and_cannot_leave_it() -> None:
    def salt(scope: str | None, given: str | None) -> str | None:
        return RequestScope(tenant=scope, salt=given).prefix_salt

    assert salt(None, None) is None and salt(None, "s") == "s"  # unscoped: today's behaviour
    assert salt("A", None) == "A" and salt("A", "s") == "A:s" != salt("B", "s")
    # a client of scope B cannot name A's entries: whatever it sends stays under B
    assert salt("B", "A") != salt("A", None) and salt("B", None) != salt("A", None)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG)) as srv:
        yield srv


def client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_listings_show_a_key_only_what_its_allow_list_permits(server: LiveServer) -> None:
    everything = {m.id for m in client(server, "sk-bravo").models.list()}
    assert everything == {"fake", "secret-model", "pair", "secret-ensemble"}
    narrow = client(server, "sk-narrow")
    assert [m.id for m in narrow.models.list()] == ["fake", "pair"]
    assert narrow.models.retrieve("pair").id == "pair"
    for hidden in ("secret-model", "secret-ensemble", "no-such-model"):  # another key's model: as absent as none
        with pytest.raises(openai.NotFoundError) as err:
            narrow.models.retrieve(hidden)
        message = err.value.response.json()["error"]["message"]
        assert "Available models: fake, pair." in message and "secret" not in message.replace(hidden, "")
    # a "not found" on any route lists only the key's own models
    with pytest.raises(openai.NotFoundError) as err:
        narrow.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "secret" not in err.value.response.text and "fake, pair" in err.value.response.text
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-narrow"},
                   json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "secret" not in r.text and "fake, pair" in r.text
    # an inline ensemble's unknown member does not list the server's models either
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-narrow"},
                   json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                         "ensemble": {"strategy": "logit_average", "members": ["fake", "nope"]}})
    assert r.status_code == 400 and "secret" not in r.text


def test_the_allow_list_answers_before_the_budget_and_the_limits(server: LiveServer) -> None:
    broke = client(server, "sk-broke")  # (its budget of 30 tokens holds one such request, never two)
    broke.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.RateLimitError, match="budget"):  # its budget is spent: a model it may use is 429
        broke.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    for model in ("secret-model", "secret-ensemble"):  # one it may not use is the allow-list's 403, as before
        with pytest.raises(openai.PermissionDeniedError, match=f"may not use {model}"):
            broke.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError, match="secret-model"):  # an inline ensemble's member
        broke.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      extra_body={"ensemble": {"strategy": "logit_average",
                                                               "members": ["fake", {"model": "secret-model"}]}})
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-broke"},
                   json={"model": "secret-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    rpm = client(server, "sk-rpm")
    rpm.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.RateLimitError, match="requests per minute"):
        rpm.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError):
        rpm.completions.create(model="secret-model", prompt="hi", max_tokens=4)
    r = httpx.get(server.url + "/v1/models/secret-model", headers={"Authorization": "Bearer sk-rpm"})
    assert r.status_code == 403  # over its rpm: the allow-list's 403, not the 429
