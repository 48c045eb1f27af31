"""The remote engine and its replica pool against a real chorus upstream serving a fake engine (same
character tokenizer on both sides), over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from chorus.config import ChorusConfig
from chorus.engines.core.base import Constraint, GenerationRequest, SamplingParams
from chorus.engines.core.spec import ModelSpec
from chorus.engines.fake.engine import CharTokenizer, FakeEngine
from chorus.engines.remote.engine import RemoteEngine
from chorus.engines.remote.replicas import ReplicaPool, Retryable, error_from
from chorus.errors import EngineFailed, EngineUnavailable, InvalidRequest, RateLimited
from tests.helpers import LiveServer, gateway


@pytest.fixture(scope="module")
def upstream() -> Iterator[LiveServer]:
    cfg = ChorusConfig.model_validate(
        {"models": [{"name": "up", "engine": "fake"}, {"name": "flaky", "engine": "fake"}]}
    )
    with gateway(
        cfg,
        engines={
            "up": FakeEngine("up", script="hello from upstream"),
            "flaky": FakeEngine("flaky", script="abcdefghij", fail_after=4),
        },
    ) as srv:
        yield srv


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # nothing listens there once closed


async def engine(replicas: list[str], model: str = "up", **remote: object) -> AsyncIterator[RemoteEngine]:
    spec = ModelSpec.model_validate({"name": "r", "engine": "remote", "max_model_len": 256, "remote": {
        "replicas": replicas, "model": model, "tokenizer": "unused", "cooldown_s": 60, **remote}})
    e = RemoteEngine(spec, CharTokenizer())
    await e.start()
    try:
        yield e
    finally:
        await e.aclose()


def req(e: RemoteEngine, **kw: object) -> GenerationRequest:
    params = {"temperature": 0.0, "max_tokens": 40, **kw}
    return GenerationRequest(e.tokenizer.encode("q"), SamplingParams(**params))  # type: ignore[arg-type]


async def test_generate_and_stream_through_a_dead_replica(upstream: LiveServer) -> None:
    async for e in engine([dead_url(), upstream.url + "/v1"]):
        for _ in range(2):
            g = await e.generate(req(e))
            assert g.choices[0].text == "hello from upstream" and g.completion_tokens == 20
        text = "".join([d.text async for d in e.stream(req(e))])
        assert text == "hello from upstream"
        stats = e.stats()
        assert stats["replicas_healthy"] == 1 and stats["outstanding"] == 0
        assert e.pool.replicas[1].served == 3


async def test_errors_map_into_chorus_errors(upstream: LiveServer) -> None:
    async for e in engine([upstream.url + "/v1"]):
        with pytest.raises(InvalidRequest, match="upstream refused"):
            await e.generate(req(e, max_tokens=10_000))  # beyond the upstream's context
    async for e in engine([upstream.url + "/v1"], model="nope"):
        with pytest.raises(EngineFailed, match="404"):
            await e.generate(req(e))
    async for e in engine([dead_url()]):
        with pytest.raises(EngineUnavailable, match="No healthy replica"):
            await e.generate(req(e))


async def test_a_failure_mid_stream_is_an_error_not_a_cut(upstream: LiveServer) -> None:
    async for e in engine([upstream.url + "/v1"], model="flaky"):
        got = []
        with pytest.raises(EngineFailed, match="upstream error"):
            async for d in e.stream(req(e)):
                got.append(d.text)
        assert "".join(got).startswith("abc")


def test_pool_prefers_the_least_outstanding_and_cools_failures_down() -> None:
    pool = ReplicaPool(["http://a/v1", "http://b/v1"], cooldown_s=0.2)
    a, b = pool.replicas
    a.outstanding = 3
    assert pool.pick(set()) is b
    pool.failed(b, "boom")
    assert pool.pick(set()) is a
    with pytest.raises(EngineUnavailable, match="boom"):
        pool.pick({"http://a/v1"})
    time.sleep(0.25)
    assert pool.pick({"http://a/v1"}) is b  # back after the cool-down


@pytest.mark.parametrize(("status", "kind"), [(400, InvalidRequest), (422, InvalidRequest), (429, RateLimited),
                                              (500, Retryable), (503, Retryable), (401, EngineFailed)])
def test_error_mapping(status: int, kind: type) -> None:
    assert isinstance(error_from(status, '{"error": {"message": "m"}}', "http://x"), kind)


async def test_remote_models_score_prompts_and_choices_by_echo(upstream: LiveServer) -> None:
    local = FakeEngine("up", script="hello from upstream")
    ids = local.tokenizer.encode("hello there")
    want = await local.prompt_logprobs(ids, 2)
    async for e in engine([dead_url(), upstream.url + "/v1"]):
        got = await e.prompt_logprobs(ids, 2)
        assert got[0] is None and len(got) == len(ids)
        for g, w in zip(got[1:], want[1:]):
            assert g is not None and w is not None
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5) and g.token == w.token and len(g.top) == 2
        prefix, conts = ids[:5], [ids[5:], ids[6:8]]
        scored = await e.score_continuations(prefix, conts)
        assert scored == [pytest.approx(x, abs=1e-5) for x in await local.score_continuations(prefix, conts)]


def test_a_gateway_scores_choices_on_a_remote_model(upstream: LiveServer) -> None:
    import httpx

    cfg = ChorusConfig.model_validate({"models": [{"name": "r", "engine": "remote", "max_model_len": 256, "remote": {
        "replicas": [upstream.url + "/v1"], "model": "up", "tokenizer": "unused"}}]})
    remote = RemoteEngine(cfg.models[0], CharTokenizer())
    with gateway(cfg, engines={"r": remote}) as gw:
        body = {"prompt": "hello ", "choices": ["from", "upstream", "there"]}
        via = httpx.post(gw.url + "/v1/choices", json={"model": "r", **body}, timeout=30).json()
        direct = httpx.post(upstream.url + "/v1/choices", json={"model": "up", **body}, timeout=30).json()
        assert [c["logprob"] for c in via["choices"]] == pytest.approx([c["logprob"] for c in direct["choices"]],
                                                                       abs=1e-5)
        assert via["chosen"] == direct["chosen"]


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("constraint,check", [
    (Constraint("choice", '["yes", "no"]'), lambda t: t in ("yes", "no")),
    (Constraint("regex", "[0-9]{4}"), lambda t: len(t) == 4 and t.isdigit()),
    (Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["n"], "additionalProperties": False}),
     lambda t: set(json.loads(t)) == {"n"}),
])
async def test_a_constraint_travels_to_the_upstream_server(upstream: LiveServer, api: str, constraint: Constraint,
                                                           check: object) -> None:
    """The upstream (a chorus server) constrains the decoding: the remote engine sent the format on."""
    async for e in engine([upstream.url + "/v1"], api=api):
        r = req(e, constraint=constraint)
        if api == "chat":
            r.messages = [{"role": "user", "content": "q"}]
        g = await e.generate(r)
        assert check(g.choices[0].text), g.choices[0].text  # type: ignore[operator]
        streamed = "".join([d.text async for d in e.stream(r)])
        assert check(streamed), streamed  # type: ignore[operator]


@pytest.mark.parametrize("batch_priority", [1, None])
def test_batch_lines_reach_the_workers_as_batch_work(tmp_path: Path, batch_priority: int | None) -> None:
    """A Batch API line on a gateway's remote model goes to the worker with ``priority`` (remote.batch_priority),
    and the worker queues it as batch work; live requests go without it."""
    import io

    import openai

    marked = FakeEngine("w", reply=lambda prompt: "batch" if marked.scope.background else "live")
    with gateway(ChorusConfig.model_validate({"models": [{"name": "w", "engine": "fake"}]}), {"w": marked}) as w:
        cfg = ChorusConfig.model_validate({
            "server": {"batches": {"dir": str(tmp_path), "poll_s": 0.05}},
            "models": [{"name": "r", "engine": "remote", "max_model_len": 256, "remote": {
                "replicas": [w.url + "/v1"], "model": "w", "tokenizer": "unused", "batch_priority": batch_priority}}]})
        with gateway(cfg, engines={"r": RemoteEngine(cfg.models[0], CharTokenizer())}) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            ask = {"model": "r", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
            assert c.chat.completions.create(**ask).choices[0].message.content == "live"  # type: ignore[call-overload]
            line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": ask})
            fid = c.files.create(file=("in.jsonl", io.BytesIO(line.encode())), purpose="batch").id
            batch = c.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="1h")
            deadline = time.monotonic() + 30
            while batch.status != "completed" and time.monotonic() < deadline:
                time.sleep(0.05)
                batch = c.batches.retrieve(batch.id)
            out = json.loads(c.files.content(batch.output_file_id).text)  # type: ignore[arg-type]
            assert out["response"]["body"]["choices"][0]["message"]["content"] == \
                ("batch" if batch_priority else "live")
        direct = openai.OpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="priority"):
            direct.chat.completions.create(**{**ask, "model": "w"}, extra_body={"priority": -1})  # type: ignore[call-overload]


async def test_logprobs_are_relayed_with_their_token_ids(upstream: LiveServer) -> None:
    """A remote generation's token logprobs and top alternatives come back as the upstream sent them (each token's
    id read from its text by the gateway's tokenizer), streamed or not."""
    async for e in engine([upstream.url + "/v1"]):
        g = await e.generate(req(e, logprobs=True, top_logprobs=2, max_tokens=5))
        choice = g.choices[0]
        assert choice.text == "hello" and choice.logprobs is not None and len(choice.logprobs) == 5
        assert "".join(lp.token for lp in choice.logprobs) == "hello"
        assert choice.token_ids == e.tokenizer.encode("hello") == [lp.token_id for lp in choice.logprobs]
        assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in choice.logprobs)
        deltas = [d async for d in e.stream(req(e, logprobs=True, top_logprobs=1, max_tokens=5))]
        streamed = [lp for d in deltas for lp in d.logprobs]
        assert [lp.token for lp in streamed] == list("hello") and all(len(lp.top) == 1 for lp in streamed)
        assert [round(lp.logprob, 4) for lp in streamed] == [round(lp.logprob, 4) for lp in choice.logprobs]


async def test_family_fields_travel_only_to_servers_that_take_them(upstream: LiveServer) -> None:
    """A vLLM worker would ignore MoDr's ``recurrence``: refused before sending unless the servers take chorus's
    family fields (``remote.family_options``: chorus workers), which then check them themselves."""
    async for e in engine([upstream.url + "/v1"]):
        r = req(e)
        r.options = {"recurrence": 2}
        with pytest.raises(InvalidRequest, match="vLLM would ignore them") as got:
            await e.generate(r)
        assert got.value.param == "recurrence" and e.pool.replicas[0].served == 0
        with pytest.raises(InvalidRequest, match="vLLM would ignore them"):
            _ = [d async for d in e.stream(r)]
        assert e.placement() == {"runs": "remote", "upstream_model": "up", "replicas": [upstream.url + "/v1"]}
    async for e in engine([upstream.url + "/v1"], family_options=True):
        r = req(e)
        r.options = {"recurrence": 2}
        with pytest.raises(InvalidRequest, match="applies to MoDr models only") as got:  # the upstream's own check
            await e.generate(r)
        assert got.value.param == "recurrence"
