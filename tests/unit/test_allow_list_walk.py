"""The allow-list under every override (issue: tenant boundaries, finding 1): a key may use ``fb`` and named
ensembles of every strategy over ``fb``, never ``fsecret``. Every path a request body has to name a model (an
ensemble's members as names or objects, a mixture-of-agents aggregator, the fusion plugin's panel and judge),
over every strategy, named or inline, on chat, completions, Responses, Messages, /v1/choices and Batch lines, is
a 403 naming ``fsecret``; nothing of fsecret's text comes back. A key may compose an inline ensemble over the
models it may use unless its ``inline_ensembles`` is false."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.server.gateway.auth import hash_key
from tests.helpers import LiveServer, gateway

SECRET_TEXT = "the secret model's words"
#: one named ensemble per strategy over fb (the ones a request can build without a fitted artifact)
NAMED: dict[str, dict[str, Any]] = {
    "vote-fab": {"strategy": "answer_vote", "members": ["fb", "fb"], "samples": 2},
    "avg-fab": {"strategy": "logit_average", "members": ["fb", "fb"]},
    "eot-fab": {"strategy": "exchange_of_thought", "members": ["fb", "fb"], "max_rounds": 1},
    "crowd-fab": {"strategy": "crowd_vote", "members": ["fb", "fb"]},
    "moa-fab": {"strategy": "mixture_of_agents", "members": ["fb", "fb"]},
    "route-fab": {"strategy": "route", "router": "random", "members": ["fb", "fb"]},
    "cascade-fab": {"strategy": "cascade", "members": ["fb", "fb"], "threshold": 0.0},
    "consistency-fab": {"strategy": "consistency_select", "members": ["fb", "fb"]},
}
#: how a body can bring fsecret into an ensemble (merged over a named one, or inline with a strategy)
OVERRIDES: list[dict[str, Any]] = [
    {"members": ["fsecret", "fsecret"]},
    {"members": ["fb", {"model": "fsecret", "name": "innocent"}]},
]
MOA_OVERRIDES: list[dict[str, Any]] = [{"aggregator": "fsecret"}, {"aggregator": {"model": "fsecret"}}]
KEYS = [{"name": "bravo", "sha256": hash_key("sk-bravo"), "models": ["fb", *NAMED, "choices-fab"]},
        {"name": "fixed", "sha256": hash_key("sk-fixed"), "models": ["fb", "vote-fab"], "inline_ensembles": False}]


def config(tmp: Path) -> ChorusConfig:
    return ChorusConfig.model_validate({
        "server": {"batches": {"dir": str(tmp / "batches"), "poll_s": 0.05}},
        "models": [{"name": "fb", "engine": "fake"}, {"name": "fsecret", "engine": "fake"}],
        "ensembles": [*({"name": n, **e} for n, e in NAMED.items()),
                      {"name": "choices-fab", "strategy": "choice_average", "members": ["fb", "fb"]}],
        "auth": {"keys": KEYS},
    })


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engines = {"fb": FakeEngine("fb", reply=lambda _: "fb says 42"),
               "fsecret": FakeEngine("fsecret", reply=lambda _: SECRET_TEXT)}
    with gateway(config(tmp_path_factory.mktemp("walk")), engines) as srv:
        yield srv


def bodies() -> Iterator[tuple[str, dict[str, Any]]]:
    """(what, the body's model and ensemble fields) for every override path of every strategy."""
    for name, spec in NAMED.items():
        extra = MOA_OVERRIDES if spec["strategy"] == "mixture_of_agents" else []
        for override in [*OVERRIDES, *extra]:
            yield f"{name} + {override}", {"model": name, "ensemble": override}
            inline = {"strategy": spec["strategy"], **{k: v for k, v in spec.items() if k != "strategy"}, **override}
            yield f"inline {spec['strategy']} {override}", {"model": "fb", "ensemble": inline}
    for plugin in ({"id": "fusion", "analysis_models": ["fb", "fsecret"]}, {"id": "fusion", "model": "fsecret"},
                   {"id": "fusion", "analysis_models": ["fb", "fb"], "model": "fsecret"}):
        yield f"fusion {plugin}", {"model": "moa-fab", "plugins": [plugin]}
        if "analysis_models" in plugin:  # on a plain model the panel is the plugin's own
            yield f"fusion on a model {plugin}", {"model": "fb", "plugins": [plugin]}


def routes(fields: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    msgs = [{"role": "user", "content": "what is 6 x 7?"}]
    yield "/v1/chat/completions", {**fields, "messages": msgs, "max_tokens": 8}
    if "plugins" not in fields:  # the fusion plugin is a chat request's field
        yield "/v1/completions", {**fields, "prompt": "what is 6 x 7?", "max_tokens": 8}
        yield "/v1/responses", {**fields, "input": "what is 6 x 7?", "max_output_tokens": 16}
        yield "/v1/messages", {**fields, "messages": msgs, "max_tokens": 8}


def denied(r: httpx.Response, what: str) -> None:
    assert r.status_code == 403, f"{what}: {r.status_code} {r.text[:300]}"
    assert "fsecret" in r.json()["error"]["message"] and SECRET_TEXT not in r.text, what


def test_every_override_path_of_every_strategy_refuses_a_model_the_key_may_not_use(server: LiveServer) -> None:
    seen = 0
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sk-bravo"}, timeout=30) as http:
        for what, fields in bodies():
            for path, body in routes(fields):
                denied(http.post(path, json=body), f"{path} {what}")
                seen += 1
        # /v1/choices: a choice_average ensemble's members
        r = http.post("/v1/choices", json={"model": "choices-fab", "prompt": "2 + 2 =", "choices": ["4", "5"],
                                           "ensemble": {"members": ["fb", "fsecret"]}})
        denied(r, "/v1/choices")
    assert seen > 60


def test_the_same_bodies_through_the_openai_sdk_and_a_batch(server: LiveServer) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-bravo", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="fsecret"):
        c.chat.completions.create(model="vote-fab", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  extra_body={"ensemble": {"members": ["fsecret", "fsecret"]}})
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**fields, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
             for i, (_, fields) in enumerate(bodies())]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    f = c.files.create(file=("walk.jsonl", io.BytesIO(data)), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.1)
        batch = c.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.failed == len(lines) and batch.output_file_id is None  # every line refused
    errors = c.files.content(batch.error_file_id).text
    assert SECRET_TEXT not in errors
    statuses = [json.loads(line)["response"]["status_code"] for line in errors.splitlines()]
    assert statuses == [403] * len(lines), statuses


def test_an_inline_ensemble_over_allowed_models_is_served_unless_the_key_may_not_compose(server: LiveServer) -> None:
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
           "ensemble": {"strategy": "answer_vote", "members": ["fb", "fb"], "samples": 2}}
    bravo = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-bravo"},
                       json={"model": "fb", **ask}, timeout=30)
    assert bravo.status_code == 200 and "fb" in bravo.json()["choices"][0]["message"]["content"]
    fixed = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-fixed"},
                       json={"model": "fb", **ask}, timeout=30)
    assert fixed.status_code == 403 and "inline_ensembles" in fixed.json()["error"]["message"]
    # its named ensemble still answers, and a body may tune it without changing which models it calls
    named = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-fixed"},
                       json={"model": "vote-fab", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "ensemble": {"samples": 1, "trace": True}})
    assert named.status_code == 200, named.text
