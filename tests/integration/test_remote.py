"""Remote engines: a gateway in front of real worker processes on 127.0.0.1 (chorus workers serving
smollm2-135m-instruct, a hanging server), through the official openai SDK."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from chorus.clients.local import free_port, wait_ready
from chorus.config import ChorusConfig, load_config
from tests.helpers import SMOL, gateway, wait_until

pytestmark = pytest.mark.integration
Q = [{"role": "user", "content": "Name a colour."}]


class Worker:
    def __init__(self, cfg: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = subprocess.Popen([sys.executable, "-m", "chorus", "worker", "--config", str(cfg), "--port",
                                      str(self.port), "--no-prepare", "--log-level", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self) -> Worker:
        wait_ready(self.url.removesuffix("/v1") + "/health", self.proc, timeout=180, interval=0.3)
        return self

    def served(self) -> float:
        text = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("chorus_requests_total{") and 'route="/v1/completions"' in line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class Hang:
    """Accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, default_config: ChorusConfig) -> Iterator[list[Worker]]:
    cfg = tmp_path_factory.mktemp("w") / "worker.yaml"
    cfg.write_text(yaml.safe_dump({"models": [default_config.model(SMOL).model_dump(exclude_none=True)]}))
    ws = [Worker(cfg), Worker(cfg)]
    try:
        yield [w.wait() for w in ws]
    finally:
        for w in ws:
            if w.proc.poll() is None:
                w.kill()


def remote_config(replicas: list[str], **remote: object) -> ChorusConfig:
    """One remote model, ``smol-remote``, over these replicas (SmolLM2's tokenizer)."""
    tok = str(load_config(None).model(SMOL).checkpoint_dir())
    return ChorusConfig.model_validate({"models": [{
        "name": "smol-remote", "engine": "remote", "max_model_len": 2048,
        "remote": {"replicas": replicas, "model": SMOL, "tokenizer": tok, "cooldown_s": 30, **remote}}]})


def test_requests_spread_over_both_workers_and_match_local(workers: list[Worker], sdk: openai.OpenAI) -> None:
    with gateway(remote_config([w.url for w in workers])) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        before = [w.served() for w in workers]
        with ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda _: c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=8,
                                                                     temperature=0), range(8)))
        after = [w.served() for w in workers]
        assert all(a - b >= 2 for a, b in zip(after, before)), (before, after)  # both got work
        local = sdk.chat.completions.create(model=SMOL, messages=Q, max_tokens=8, temperature=0)
        assert {o.choices[0].message.content for o in outs} == {local.choices[0].message.content}
        assert outs[0].usage.completion_tokens == local.usage.completion_tokens
        chunks = list(c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=8, temperature=0,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
            local.choices[0].message.content
        health = httpx.get(gw.url + "/health").json()["models"]["smol-remote"]
        assert health["replicas_healthy"] == 2 and health["outstanding"] == 0


def test_a_worker_busy_with_other_clients_is_passed_over_by_its_gauges(workers: list[Worker]) -> None:
    """The gateway reads each worker's model-server gauges (vllm:num_requests_running / _waiting): a worker busy
    with requests sent around the gateway gets none of the gateway's while it reports them."""
    busy = workers[0]
    direct = openai.OpenAI(base_url=busy.url, api_key="x", max_retries=0, timeout=120)
    with gateway(remote_config([w.url for w in workers], load_interval_s=0.2)) as gw, ThreadPoolExecutor(3) as ex:
        hogs = [ex.submit(direct.completions.create, model=SMOL, prompt="Once upon a time", max_tokens=400,
                          temperature=0, extra_body={"ignore_eos": True}) for _ in range(3)]
        assert wait_until(lambda: "vllm:num_requests_running{model_name=\"" + SMOL + "\"} 0.0" not in
                          httpx.get(busy.url.removesuffix("/v1") + "/metrics").text, timeout=30)
        time.sleep(0.6)  # three reads of the gauges
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        before = [w.served() for w in workers]
        for _ in range(4):  # one at a time: blind, the pool would alternate (ties go to the one that served fewer)
            c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=4, temperature=0)
        after = [w.served() for w in workers]
        assert not hogs[0].done(), "the direct requests ended before the gateway's: lengthen them"
        assert after[1] - before[1] == 4 and after[0] == before[0], (before, after)
        assert httpx.get(gw.url + "/health").json()["models"]["smol-remote"]["replicas_reporting_load"] == 2
        for h in hogs:
            h.result()


def test_a_hanging_replica_is_timed_out_and_routed_around(workers: list[Worker]) -> None:
    hang = Hang()
    with gateway(remote_config([hang.url, workers[0].url], read_timeout_s=6)) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for _ in range(3):
            r = c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=4, temperature=0)
            assert r.choices[0].message.content
        health = httpx.get(gw.url + "/health").json()["models"]["smol-remote"]
        assert health["replicas_healthy"] == 1  # the hanging one is cooling down


def test_gateway_in_front_of_transformers_serve(tmp_path: Path, default_config: ChorusConfig) -> None:
    """A third-party OpenAI server (transformers serve, chat API) behind the gateway, via the openai SDK."""
    path = str(default_config.model(SMOL).checkpoint_dir())
    port = free_port()
    exe = str(Path(sys.executable).with_name("transformers"))
    log = (tmp_path / "tserve.log").open("w")
    proc = subprocess.Popen([exe, "serve", path, "--device", "cpu", "--dtype", "float32", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url + "/v1/models", proc, timeout=240, interval=1.0)
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{(tmp_path / 'tserve.log').read_text()[-2000:]}")
        # transformers serve names a model by its path
        with gateway(remote_config([url + "/v1"], api="chat", read_timeout_s=240, model=path)) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=300)
            r = c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=8, temperature=0)
            assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
            chunks = list(c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=8, temperature=0,
                                                    stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()
            with pytest.raises(openai.BadRequestError, match="chat-only"):
                c.completions.create(model="smol-remote", prompt="Hello", max_tokens=4)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_logit_average_of_a_local_and_a_remote_member(workers: list[Worker], smol_engine: object) -> None:
    """Members on different processes: the remote one steps over /v1/completions with top-k logprobs."""
    tok = str(load_config(None).model(SMOL).checkpoint_dir())
    spec = load_config(None).model(SMOL).model_dump(exclude_none=True)
    cfg = ChorusConfig.model_validate({"models": [spec, {
        "name": "smol-remote", "engine": "remote", "max_model_len": 2048,
        "remote": {"replicas": [workers[0].url], "model": SMOL, "tokenizer": tok}}]})
    with gateway(cfg) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        local = c.chat.completions.create(model=SMOL, messages=Q, max_tokens=8, temperature=0)
        ens = c.chat.completions.create(model=SMOL, messages=Q, max_tokens=8, temperature=0, extra_body={
            "ensemble": {"strategy": "logit_average", "members": [SMOL, "smol-remote"], "trace": True}})
        assert ens.choices[0].message.content == local.choices[0].message.content
        assert "approximate" in ens.model_extra["ensemble"]["note"]
        with pytest.raises(openai.BadRequestError, match="space 'logit' needs full logits"):
            c.chat.completions.create(model=SMOL, messages=Q, max_tokens=4, extra_body={
                "ensemble": {"strategy": "logit_average", "members": [SMOL, "smol-remote"], "space": "logit"}})


def test_exact_logit_average_over_a_workers_session_api(workers: list[Worker]) -> None:
    """token_api: chorus: the remote member steps a session on the worker and returns its full logits, so
    averaging is exact (logit space allowed, no approximation note) and the worker frees every session."""
    tok = str(load_config(None).model(SMOL).checkpoint_dir())
    spec = load_config(None).model(SMOL).model_dump(exclude_none=True)
    cfg = ChorusConfig.model_validate({"models": [spec, {
        "name": "smol-exact", "engine": "remote", "max_model_len": 2048,
        "remote": {"replicas": [workers[0].url], "model": SMOL, "tokenizer": tok, "token_api": "chorus"}}]})
    sessions = workers[0].url.removesuffix("/v1") + "/chorus/v1/sessions"
    with gateway(cfg) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        local = c.chat.completions.create(model=SMOL, messages=Q, max_tokens=8, temperature=0, logprobs=True)
        for space in ("probability", "logit"):
            ens = c.chat.completions.create(model=SMOL, messages=Q, max_tokens=8, temperature=0, logprobs=True,
                                            extra_body={"ensemble": {"strategy": "logit_average", "trace": True,
                                                                     "members": [SMOL, "smol-exact"], "space": space}})
            assert ens.choices[0].message.content == local.choices[0].message.content
            assert "note" not in ens.model_extra["ensemble"]
            got = [t.logprob for t in ens.choices[0].logprobs.content]
            want = [t.logprob for t in local.choices[0].logprobs.content]
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3  # the same model twice: the same distribution
        # speculative over the v2 session API: the worker's member verifies the drafts in one multi-token step
        # and rolls back rejected ones (a persona makes the members disagree); the answer is full averaging's
        members = [SMOL, {"model": "smol-exact", "system": "You are a pirate. Answer like one."}]
        answers = {}
        for mode in ("full", "speculative"):
            ens = c.chat.completions.create(model=SMOL, messages=Q, max_tokens=24, temperature=0, extra_body={
                "ensemble": {"strategy": "logit_average", "trace": True, "members": members, "mode": mode}})
            answers[mode] = ens.choices[0].message.content
            if mode == "speculative":
                te = ens.model_extra["ensemble"]["token_ensemble"]
                assert te["rounds"] < te["positions"] and te["rolled_back"]["smol-exact"] > 0
        assert answers["speculative"] == answers["full"]
        assert wait_until(lambda: httpx.get(sessions).json()["open"] == 0, timeout=10)


def test_killing_a_worker_under_load_loses_no_request(workers: list[Worker]) -> None:
    with gateway(remote_config([w.url for w in workers])) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def ask(i: int) -> str:
            return c.chat.completions.create(model="smol-remote", messages=Q, max_tokens=48, temperature=0,
                                             seed=i).choices[0].message.content or ""

        with ThreadPoolExecutor(12) as ex:
            futures = [ex.submit(ask, i) for i in range(12)]
            time.sleep(1.0)
            workers[1].kill()  # mid-load: its non-streamed requests are retried on the other worker
            results = [f.result() for f in futures]
        assert len(results) == 12 and all(results)
        health = httpx.get(gw.url + "/health").json()["models"]["smol-remote"]
        assert health["replicas_healthy"] == 1
