"""Prometheus metrics of the gateway (prometheus-client's default registry, exposed at ``/metrics``).

Strategy counters (router decisions, cascade steps, member calls) live in ensembles/metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from chorus.engines.core.base import SERVER_LOAD

REQUESTS = Counter("chorus_requests_total", "HTTP requests by route, model, strategy and status",
                   ["route", "model", "strategy", "status"])
LATENCY = Histogram("chorus_request_seconds", "Request latency (until the last byte)", ["route"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
TTFT = Histogram("chorus_time_to_first_token_seconds", "Streaming: time to the first token", ["model"],
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
TOKENS = Counter("chorus_tokens_total", "Tokens in and out", ["model", "kind"])
INFLIGHT = Gauge("chorus_inflight_requests", "Requests admitted and not yet finished (the queue depth)")
REFUSED = Counter("chorus_refused_total", "Requests refused before any work, by reason", ["reason"])


class EngineCollector(Collector):
    """Active sessions (KV caches) and other engine stats, read from the engines at scrape time; and each batching
    engine's load as the model-server protocol asks (gauges labelled ``model_name``, as vLLM's)."""

    def __init__(self, engines: Callable[[], dict[str, Any]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        loads: dict[str, Any] = {}  #: the batching engines' `ServerLoad`
        for name, engine in self.engines().items():
            if (load := getattr(engine, "server_load", None)) is not None:
                loads[name] = load()
            for stat, value in engine.stats().items():
                fam = families.setdefault(stat, GaugeMetricFamily(f"chorus_engine_{stat}", f"engine stat {stat}",
                                                                  labels=["model"]))
                fam.add_metric([name], float(value))
            # model-family metrics (MoE expert load, MoDr branch usage, ReasonFormer skill weights), kept by the
            # engine since start-up: a name ending in _total is a counter, any other (a running sum) a gauge
            for metric, doc, labels, samples in engine.family_metrics():
                kind = CounterMetricFamily if metric.endswith("_total") else GaugeMetricFamily
                cfam = families.setdefault(metric, kind(metric, doc, labels=["model", *labels]))
                for values, value in samples:
                    cfam.add_metric([name, *values], value)
        yield from families.values()
        for vllm_name, own, doc, field in SERVER_LOAD:
            for metric in (vllm_name, own):
                if metric is None:
                    continue
                gauge = GaugeMetricFamily(metric, doc, labels=["model_name"])
                for name, state in loads.items():
                    gauge.add_metric([name], float(getattr(state, field)))
                yield gauge


_collector: EngineCollector | None = None
#: the running apps' engines, latest first to report (tests run several apps in one process)
_watched: list[Callable[[], dict[str, Any]]] = []


def watch_engines(engines: Callable[[], dict[str, Any]]) -> Callable[[], None]:
    """Report this app's engines (the most recently started app that is still running is the one reported:
    the registry is per process); returns the function that stops reporting them (call it at shutdown)."""
    global _collector
    if _collector is None:
        _collector = EngineCollector(lambda: _watched[-1]() if _watched else {})
        REGISTRY.register(_collector)
    _watched.append(engines)

    def unwatch() -> None:
        if engines in _watched:
            _watched.remove(engines)

    return unwatch


def count_tokens(model: str, prompt: int, completion: int) -> None:
    TOKENS.labels(model, "prompt").inc(prompt)
    TOKENS.labels(model, "completion").inc(completion)
