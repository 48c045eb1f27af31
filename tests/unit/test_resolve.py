"""Every route that names a model resolves it through the one step (server/resolve.py): walked from the app's own
route table, so a new endpoint that takes a model cannot skip the key's allow-list."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from chorus.config import ChorusConfig
from chorus.server.app import create_app
from chorus.server.gateway.auth import hash_key
from chorus.server.gateway.context import Context
from chorus.server.gateway.services import services_of
from tests.helpers import LiveServer, gateway

CONFIG = {
    "models": [{"name": "fake", "engine": "fake"}, {"name": "other", "engine": "fake"}],
    "auth": {"keys": [{"name": "limited", "sha256": hash_key("sk-limited"), "models": ["fake"]},
                      {"name": "admin", "sha256": hash_key("sk-admin")}]},
}
LIMITED = {"Authorization": "Bearer sk-limited"}
ADMIN = {"Authorization": "Bearer sk-admin"}

#: a request body per route whose body names a model (``{model}`` is filled in)
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ("post", "/v1/completions"): {"prompt": "hi", "max_tokens": 2},
    ("post", "/v1/responses"): {"input": "hi", "max_output_tokens": 16},
    ("post", "/v1/messages"): {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ("post", "/v1/messages/count_tokens"): {"messages": [{"role": "user", "content": "hi"}]},
    ("post", "/v1/choices"): {"prompt": "Pick one:", "choices": ["a", "b"]},
    ("post", "/v1/embeddings"): {"input": "hi"},
    ("post", "/chorus/v1/sessions"): {"prompt": [1, 2]},
    ("post", "/chorus/v2/sessions"): {"prompt": [1, 2]},
}
#: routes on a held token session: only the key that opened it finds it (another key's session is a 404, as an
#: unknown one), and they admit the session's model again
ON_A_SESSION: dict[tuple[str, str], dict[str, Any] | None] = {
    ("post", "/chorus/v1/sessions/{sid}/step"): {"token": 1},
    ("post", "/chorus/v2/sessions/{sid}/step"): {"tokens": [1]},
    ("delete", "/chorus/v1/sessions/{sid}"): None,
    ("delete", "/chorus/v2/sessions/{sid}"): None,
}
#: routes that serve no model, and why
NO_MODEL = {
    ("get", "/health"): "liveness and load",
    ("get", "/metrics"): "Prometheus",
    ("get", "/v1/models"): "the list of what is served",
    ("get", "/v1/models/{name}"): "one model's card (what it is, not a use of it)",
    ("get", "/chorus/v1/sessions"): "the session store's stats",
    ("get", "/chorus/v2/sessions"): "the session store's stats",
    ("get", "/v1/responses/{rid}"): "a stored response, by its owner",
    ("delete", "/v1/responses/{rid}"): "a stored response, by its owner",
    ("post", "/v1/feedback"): "feedback on a request, by the key that made it",
    ("get", "/admin/keys/{name}"): "an admin route",
    ("delete", "/admin/models/{name}/prefix-cache"): "an admin route (drops a model's prefix cache)",
    **{(m, p): "the Batch API's bookkeeping, by the owner (each line is resolved when it runs, as a live request)"
       for m, p in (("post", "/v1/files"), ("get", "/v1/files"), ("get", "/v1/files/{file_id}"),
                    ("get", "/v1/files/{file_id}/content"), ("delete", "/v1/files/{file_id}"),
                    ("post", "/v1/batches"), ("get", "/v1/batches"), ("get", "/v1/batches/{batch_id}"),
                    ("post", "/v1/batches/{batch_id}/cancel"))},
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with gateway(ChorusConfig.model_validate(CONFIG)) as srv:
        yield srv


def routes(srv: LiveServer) -> dict[tuple[str, str], bool]:
    """Every (method, path) the app serves, with whether its JSON body has a ``model`` field."""
    spec = httpx.get(srv.url + "/openapi.json").json()
    out = {}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            schema = spec["components"]["schemas"].get(ref.get("$ref", "").rpartition("/")[2], {})
            out[(method, path)] = "model" in schema.get("properties", {})
    return out


def test_every_route_is_classified(server: LiveServer) -> None:
    found = routes(server)
    assert {r for r, named in found.items() if named} == set(BODIES)
    assert set(found) == set(BODIES) | set(ON_A_SESSION) | set(NO_MODEL)


@pytest.mark.parametrize("route", sorted(BODIES))
def test_each_model_route_refuses_a_model_the_key_may_not_use(server: LiveServer, route: tuple[str, str]) -> None:
    method, path = route
    denied = httpx.request(method, server.url + path, json={**BODIES[route], "model": "other"}, headers=LIMITED)
    assert denied.status_code == 403, denied.text
    assert "Key 'limited' may not use other" in denied.json()["error"]["message"]
    allowed = httpx.request(method, server.url + path, json={**BODIES[route], "model": "fake"}, headers=LIMITED)
    assert allowed.status_code != 403, allowed.text  # (an embedding route answers 400: fake is no embedder)


@pytest.mark.parametrize("route", sorted(ON_A_SESSION))
def test_a_held_session_belongs_to_the_key_that_opened_it(server: LiveServer, route: tuple[str, str]) -> None:
    method, path = route
    base = path.split("/{sid}")[0]
    sid = httpx.post(server.url + base, json={"model": "other", "prompt": [1, 2]}, headers=ADMIN).json()["id"]
    try:
        denied = httpx.request(method, server.url + path.format(sid=sid), json=ON_A_SESSION[route], headers=LIMITED)
        assert denied.status_code == 404 and denied.json()["error"]["code"] == "session_not_found", denied.text
        assert "other" not in denied.text  # nothing about the session is told
    finally:
        httpx.delete(server.url + f"{base}/{sid}", headers=ADMIN)


def test_a_reply_without_the_step_is_refused() -> None:
    request = Request({"type": "http", "path": "/v1/new", "headers": [], "state": {}, "app": None})
    ctx = Context(services_of(create_app(ChorusConfig.model_validate(CONFIG))), "id", 0.0, http=request)
    with pytest.raises(RuntimeError, match="replied without resolving its model"):
        ctx.resolved()
