"""OpenTelemetry traces (server/tracing.py, ensembles/spans.py) with the SDK's in-memory exporter: the request's
span with GenAI attributes under the client's traceparent, and an ensemble's fan-out below it (Exchange-of-Thought
rounds, cascade steps, vote batches, one span per member call); the OTEL_* configuration's errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.errors import ConfigError
from chorus.server.gateway import tracing
from tests.helpers import LiveServer, gateway

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def open_spans() -> Any:
    """A span processor that knows which spans started and have not ended."""
    from opentelemetry.sdk.trace import SpanProcessor

    class OpenSpans(SpanProcessor):
        def __init__(self) -> None:
            self.open: dict[int, Any] = {}

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            self.open[span.context.span_id] = span

        def on_end(self, span: Any) -> None:
            self.open.pop(span.context.span_id, None)

        def of_trace(self, trace_id: str) -> list[str]:
            return [s.name for s in list(self.open.values()) if format(s.context.trace_id, "032x") == trace_id]

    return OpenSpans()


OPEN = open_spans()


@pytest.fixture(scope="module")
def spans() -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the process's one global provider
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(OPEN)
    return exporter


@pytest.fixture(scope="module")
def server(spans: Any) -> Iterator[LiveServer]:
    engines = {"a42": FakeEngine("a42", script="Six times seven. The answer is 42.", max_model_len=2048),
               "c7": FakeEngine("c7", script="The answer is 7.", max_model_len=2048),
               "slow": FakeEngine("slow", script="x" * 200, delay=0.02, max_model_len=2048)}
    config = {"server": {"opentelemetry": True},
              "models": [{"name": n, "engine": "fake"} for n in engines],
              "ensembles": [{"name": "eot", "strategy": "exchange_of_thought", "members": ["a42", "c7"],
                             "max_rounds": 1},
                            {"name": "cascade", "strategy": "cascade", "members": ["c7", "a42"], "threshold": 0.0},
                            {"name": "vote", "strategy": "answer_vote", "members": ["a42", "c7"], "samples": 2,
                             "batch": 1},
                            {"name": "avg", "strategy": "logit_average", "members": ["a42", "a42"]},
                            {"name": "slow-vote", "strategy": "answer_vote", "members": ["slow", "slow"],
                             "samples": 2, "batch": 1},
                            {"name": "moa", "strategy": "mixture_of_agents", "members": ["a42", "c7"],
                             "aggregator": "a42", "rationale": True}]}
    with gateway(ChorusConfig.model_validate(config), engines) as srv:
        yield srv


def traced(server: LiveServer, spans: Any, model: str) -> tuple[Any, list[Any], str]:
    spans.clear()
    r = httpx.post(server.url + "/v1/chat/completions", headers={"traceparent": PARENT},
                   json={"model": model, "messages": [{"role": "user", "content": "What is 6*7?"}], "max_tokens": 40,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    found = [s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == TRACE_ID]
    root = next(s for s in found if s.attributes.get("gen_ai.request.model") == model and s.parent is not None
                and s.parent.span_id == int("00f067aa0ba902b7", 16))
    return root, found, r.headers["x-request-id"]


def children(found: list[Any], parent: Any) -> list[Any]:
    return [s for s in found if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_a_request_span_under_the_clients_traceparent_with_genai_attributes(server: LiveServer, spans: Any) -> None:
    root, found, rid = traced(server, spans, "a42")
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.max_tokens"] == 40
    assert a["gen_ai.usage.output_tokens"] > 0 and a["gen_ai.usage.input_tokens"] > 0
    assert a["chorus.request_id"] == rid
    prefill, decode = (next(s for s in found if s.name == name) for name in ("engine.prefill", "engine.decode"))
    assert prefill.parent.span_id == decode.parent.span_id == root.context.span_id
    assert prefill.attributes["chorus.engine"] == "a42" and decode.attributes["gen_ai.usage.output_tokens"] > 0
    assert prefill.end_time <= decode.start_time


def test_an_exchange_of_thought_is_a_tree_of_rounds_and_member_calls(server: LiveServer, spans: Any) -> None:
    root, found, rid = traced(server, spans, "eot")
    rounds = [s for s in children(found, root) if s.name == "eot.round"]
    assert [r.attributes["chorus.round"] for r in rounds] == [0, 1]
    for r in rounds:
        calls = children(found, r)
        assert sorted(c.attributes["chorus.member"] for c in calls) == ["a42", "c7"]
        assert all(c.name.startswith("chat ") and c.attributes["gen_ai.usage.output_tokens"] > 0 for c in calls)
        assert all(c.attributes["chorus.request_id"] == rid and c.attributes["chorus.ensemble"] == "eot"
                   for c in calls)
        assert all({s.name for s in children(found, c)} == {"engine.prefill", "engine.decode"} for c in calls)


def test_cascade_steps_and_vote_batches(server: LiveServer, spans: Any) -> None:
    root, found, _ = traced(server, spans, "cascade")
    steps = [s for s in children(found, root) if s.name == "cascade.step"]
    assert steps and steps[0].attributes["chorus.member"] == "c7"
    assert [c.attributes["gen_ai.request.model"] for c in children(found, steps[0])] == ["c7"]
    root, found, _ = traced(server, spans, "vote")
    batches = [s for s in children(found, root) if s.name == "vote.batch"]
    assert len(batches) == 2 and all(len(children(found, b)) == 2 for b in batches)


def test_logit_average_has_a_span_per_member_over_the_whole_answer(server: LiveServer, spans: Any) -> None:
    root, found, _ = traced(server, spans, "avg")
    members = [s for s in children(found, root) if s.name == "chat a42"]
    assert sorted(s.attributes["chorus.member"] for s in members) == ["a42", "a42#2"]
    assert all(s.attributes["gen_ai.usage.output_tokens"] > 0 for s in members)
    assert any(s.name == "engine.decode" for s in children(found, root))  # the averaged engine's own phases


def test_mixture_of_agents_has_its_proposals_under_a_layer_and_its_judge_calls_under_a_judge(
        server: LiveServer, spans: Any) -> None:
    root, found, _ = traced(server, spans, "moa")
    (layer,) = [s for s in children(found, root) if s.name == "moa.layer"]
    assert sorted(c.attributes["chorus.member"] for c in children(found, layer)) == ["a42", "c7"]
    (judge,) = [s for s in children(found, root) if s.name == "moa.judge"]
    assert judge.attributes["chorus.proposals"] == 2
    rationale, answer = sorted(children(found, judge), key=lambda s: s.start_time)
    assert rationale.name == answer.name == "chat a42"
    # the streamed answer's engine phases are its children too (each step of the stream runs in its context)
    assert {s.name for s in children(found, answer)} == {"engine.prefill", "engine.decode"}
    assert judge.start_time <= rationale.start_time and answer.end_time <= judge.end_time


async def test_a_batched_prefill_reports_its_wait_as_an_engine_queue_span(spans: Any) -> None:
    """The transformers engine's scheduler stamps when it first takes a prompt; the wait before that is a child
    span of engine.prefill (llama.cpp's runner stamps its sessions the same way)."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from chorus.engines.core.generation import TRACER, queue_span
    from chorus.engines.runtime.observer import DenseObserver
    from chorus.engines.transformers.batching import BatchRunner

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2), attn_implementation="sdpa").eval()
    runner = BatchRunner(model, max_model_len=64, observer=DenseObserver())
    spans.clear()
    try:
        with TRACER.start_as_current_span("engine.prefill") as prefill:
            sessions = [runner.open_many(1)[0] for _ in range(3)]
            await asyncio.gather(*(runner.submit_prefill([s], [5, 6, 7, 8 + i]) for i, s in enumerate(sessions)))
            queue_span(prefill, [(s, None) for s in sessions])
            for s in sessions:
                s.close()
    finally:
        await runner.stop()
    assert all(s.scheduled_ns and s.scheduled_ns >= prefill.start_time for s in sessions)
    (queue,) = [s for s in spans.get_finished_spans() if s.name == "engine.queue"]
    assert queue.parent.span_id == prefill.context.span_id
    assert queue.start_time == prefill.start_time and queue.end_time == min(s.scheduled_ns for s in sessions)


def test_the_environment_names_the_exporters() -> None:
    assert tracing.exporters({}) == [] and tracing.exporters({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "console, otlp"}) == ["console", "otlp"]
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == []
    with pytest.raises(ConfigError, match="zipkin"):
        tracing.exporters({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_trace_crosses_the_gateway_and_its_remote_worker(spans: Any) -> None:
    """The gateway's replica attempt sends its traceparent: the worker's request span is its child, in the same
    trace as the client's."""
    from chorus.engines.core.spec import ModelSpec
    from chorus.engines.fake.engine import CharTokenizer
    from chorus.engines.remote.engine import RemoteEngine

    worker_cfg = {"server": {"opentelemetry": True}, "models": [{"name": "up", "engine": "fake"}]}
    with gateway(ChorusConfig.model_validate(worker_cfg), {"up": FakeEngine("up", script="from the worker")}) as up:
        spec = ModelSpec.model_validate({"name": "r", "engine": "remote", "max_model_len": 256, "remote": {
            "replicas": [up.url + "/v1"], "model": "up", "tokenizer": "unused"}})
        front_cfg = {"server": {"opentelemetry": True}, "models": [spec.model_dump(exclude_unset=True)]}
        with gateway(ChorusConfig.model_validate(front_cfg), {"r": RemoteEngine(spec, CharTokenizer())}) as front:
            for stream in (False, True):
                spans.clear()
                r = httpx.post(front.url + "/v1/chat/completions", headers={"traceparent": PARENT}, json={
                    "model": "r", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0,
                    "stream": stream})
                assert r.status_code == 200
                text = r.json()["choices"][0]["message"]["content"] if not stream else "".join(
                    (json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                    for line in r.text.splitlines() if line.startswith("data: {"))
                assert text == "from the worker"
                found = [s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == TRACE_ID]
                attempt = next(s for s in found if s.name == "remote.attempt")
                assert attempt.attributes["server.address"] == up.url + "/v1"
                served = [s for s in found if s.parent is not None and s.parent.span_id == attempt.context.span_id]
                assert served and served[0].attributes.get("gen_ai.request.model") == "up"  # the worker's span


def test_chorus_serve_exports_otlp_to_a_receiver_process(tmp_path: Any) -> None:
    """`chorus serve` with OTEL_TRACES_EXPORTER=otlp: an ensemble request's spans reach a separate OTLP/HTTP receiver
    (OpenTelemetry's protobuf), batched and flushed at shutdown, under OTEL_SERVICE_NAME."""
    import os
    import signal
    import subprocess
    import sys

    from chorus.clients.local import free_port, wait_ready

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"models": [{"name": "a", "engine": "fake", "fake": {"script": "The answer is 4.", "max_model_len": 4000}},
                                          {"name": "b", "engine": "fake", "fake": {"script": "The answer is 5.", "max_model_len": 4000}}],
                               "ensembles": [{"name": "eot", "strategy": "exchange_of_thought", "members": ["a", "b"],
                                              "max_rounds": 1}]}))
    got, rport, port = tmp_path / "spans.jsonl", free_port(), free_port()
    receiver = subprocess.Popen([sys.executable, "-m", "tests.otlp_receiver", str(rport), str(got)])
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rport}",
           "OTEL_SERVICE_NAME": "chorus-test", "CHORUS_HOME": str(tmp_path / "home")}
    server = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port),
                               "--no-prepare"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server, timeout=60, interval=0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"traceparent": PARENT}, json={
            "model": "eot", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 20})
        assert r.status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
        receiver.terminate()
        receiver.wait(10)
    spans = [json.loads(line) for line in got.read_text().splitlines()] if got.exists() else []
    mine = [s for s in spans if s["trace_id"] == TRACE_ID]
    assert mine and {s["service"] for s in mine} == {"chorus-test"}, err[-2000:]
    names = [s["name"] for s in mine]
    assert names.count("eot.round") == 2 and names.count("chat a") == 2 and names.count("chat b") == 2
    root = next(s for s in mine if s["attributes"].get("gen_ai.request.model") == "eot")
    assert root["parent"] == "00f067aa0ba902b7" and root["attributes"]["gen_ai.usage.output_tokens"] > 0


@pytest.mark.parametrize("model", ["slow", "slow-vote"])
def test_no_span_is_left_open_when_the_client_goes_away(server: LiveServer, spans: Any, model: str) -> None:
    import time

    trace_id = format(int(time.time_ns()) & ((1 << 128) - 1), "032x")
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                      json={"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 150,
                            "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response at once
        next(lines)
        time.sleep(0.3)  # mid-answer (about 150 tokens x 0.02 s each were asked for)
        assert OPEN.of_trace(trace_id)  # spans are open while it runs
    deadline = time.monotonic() + 10
    while OPEN.of_trace(trace_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert OPEN.of_trace(trace_id) == []
