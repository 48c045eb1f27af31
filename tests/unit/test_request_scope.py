"""What a request carries to the engines (`RequestScope`), seen from the engines: a keyed gateway over fake engines,
through the openai SDK; each fake engine records the scope of the last session it opened."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.engines.fake.engine import FakeEngine
from chorus.server.gateway.auth import hash_key
from tests.helpers import LiveServer, gateway

CONFIG = {
    "models": [{"name": "a", "engine": "fake"}, {"name": "b", "engine": "fake"}],
    "ensembles": [{"name": "pair", "strategy": "logit_average", "members": ["a", "b"]}],
    "auth": {"keys": [{"name": "alpha", "sha256": hash_key("sk-alpha")}, {"name": "bravo", "sha256": hash_key("sk-bravo")}]},
}


@pytest.fixture(scope="module")
def engines() -> dict[str, FakeEngine]:
    return {"a": FakeEngine("a"), "b": FakeEngine("b")}


@pytest.fixture(scope="module")
def server(engines: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG), dict(engines)) as srv:
        yield srv


def ask(server: LiveServer, key: str, model: str, **extra: object) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                              extra_body=extra or None)


def test_the_engine_gets_the_keys_tenant_the_bodys_salt_and_user(server: LiveServer,
                                                                 engines: dict[str, FakeEngine]) -> None:
    ask(server, "sk-alpha", "a", cache_salt="s1", user="conv-7")
    alpha = engines["a"].scope
    assert alpha.tenant is not None and alpha.salt == "s1" and alpha.affinity == "conv-7"
    assert alpha.prefix_salt == f"{alpha.tenant}:s1" and not alpha.background and alpha.request_id
    assert alpha.deadline is not None and alpha.group is not None
    ask(server, "sk-bravo", "a", cache_salt="s1")
    bravo = engines["a"].scope
    assert bravo.tenant not in (None, alpha.tenant) and bravo.prefix_salt != alpha.prefix_salt  # the salt cannot join
    assert bravo.affinity is None and bravo.request_id != alpha.request_id and bravo.group is not alpha.group


def test_every_member_of_an_ensemble_gets_the_requests_scope(server: LiveServer,
                                                              engines: dict[str, FakeEngine]) -> None:
    ask(server, "sk-alpha", "pair", cache_salt="s2")
    a, b = engines["a"].scope, engines["b"].scope
    assert a == b and a.salt == "s2" and a.group is b.group  # one request: its sessions are grouped


def test_a_call_without_a_scope_is_unscoped() -> None:
    assert UNSCOPED == RequestScope() and UNSCOPED.prefix_salt is None and not UNSCOPED.background
    assert RequestScope(salt="s").prefix_salt == "s" and RequestScope(tenant="t").prefix_salt == "t"
