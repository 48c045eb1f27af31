"""Replicas of one remote model: pick one by the routing policy (routing.py), take a failing one out for a while.

`ReplicaPool` picks, for each request, the healthy replica its policy ranks first among those not tried yet; a
replica that fails (connection refused or reset, timeout, 5xx) is out for ``cooldown_s``. Upstream
HTTP errors map into chorus's error tree here (`error_from`); a `Retryable` one lets the caller try
the next replica as long as nothing has reached the client.

A replica's load is what this gateway has in flight there, or, when the replica reports more on its ``/metrics``
(the model-server protocol's gauges, `reported_load`: vLLM and chorus workers expose them), what it reports: the
requests other gateway processes, other gateways or other clients sent it count too.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from chorus.engines.core.base import SERVER_LOAD, ServerLoad
from chorus.engines.remote.routing import Ask, Policy, policy
from chorus.errors import EngineFailed, EngineUnavailable, GatewayError, InvalidRequest, RateLimited

log = logging.getLogger("chorus.remote")


class Retryable(Exception):
    """A replica failed before anything reached the client: another replica may answer."""


@dataclass
class Replica:
    url: str
    outstanding: int = 0
    down_until: float = 0.0
    failures: int = 0
    served: int = 0
    last_error: str = ""
    reported: ServerLoad | None = None  #: the replica's own gauges, last read
    reported_until: float = 0.0  #: ... trusted until then (a replica that stops answering /metrics is read blind)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    @property
    def load(self) -> int:
        """Requests on this replica: this gateway's in flight, or the replica's own count (waiting + running) when
        it reported more, recently."""
        if self.reported is None or time.monotonic() > self.reported_until:
            return self.outstanding
        return max(self.outstanding, self.reported.waiting + self.reported.running)

    def report(self, load: ServerLoad | None, fresh_s: float) -> None:
        self.reported = load
        self.reported_until = time.monotonic() + fresh_s


class ReplicaPool:
    def __init__(self, urls: list[str], cooldown_s: float, routing: str = "least_outstanding",
                 affinity: Any = None) -> None:
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.cooldown_s = cooldown_s
        self.policy: Policy = policy(routing, [r.url for r in self.replicas], affinity)

    def pick(self, tried: set[str], ask: Ask | None = None) -> Replica:
        candidates = [r for r in self.replicas if r.url not in tried and r.healthy]
        if not candidates:
            down = [f"{r.url} ({r.last_error or 'cooling down'})" for r in self.replicas]
            raise EngineUnavailable(f"No healthy replica left: {'; '.join(down)}.")
        chosen: Replica = self.policy.order(candidates, ask or Ask())[0]
        if ask is not None:
            self.policy.sent(chosen, ask)  # known at once: a request with the same prefix a moment later follows
        return chosen

    def answered(self, replica: Replica) -> None:
        replica.served += 1

    def failed(self, replica: Replica, why: str) -> None:
        replica.failures += 1
        replica.last_error = why
        replica.down_until = time.monotonic() + self.cooldown_s
        log.warning("replica %s out for %.0fs: %s", replica.url, self.cooldown_s, why)

    def stats(self) -> dict[str, int]:
        return {"replicas": len(self.replicas), "replicas_healthy": sum(r.healthy for r in self.replicas),
                "outstanding": sum(r.outstanding for r in self.replicas),
                "replicas_reporting_load": sum(r.reported is not None for r in self.replicas), **self.policy.stats()}


def reported_load(text: str, model: str) -> ServerLoad | None:
    """A replica's load for ``model`` read from its Prometheus exposition: the model-server protocol's gauges under
    vLLM's names (`SERVER_LOAD`; chorus workers expose them too), the first name of a field that is there (vLLM's
    KV gauge had an older name). None: it exposes no request gauges. Samples labelled with another ``model_name``
    are not this model's; unlabelled ones are the server's."""
    names = {vllm for vllm, _, _, _ in SERVER_LOAD}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("model_name", model) == model:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value

    def first(field: str) -> float | None:
        return next((found[n] for n, _, _, f in SERVER_LOAD if f == field and n in found), None)

    waiting, running = first("waiting"), first("running")
    if waiting is None and running is None:
        return None
    return ServerLoad(int(waiting or 0), int(running or 0), first("kv_usage") or 0.0)


def error_from(status: int, body: str, url: str) -> GatewayError | Retryable:
    """An upstream HTTP error -> chorus's error tree, or `Retryable` (5xx: another replica may answer)."""
    param = None
    try:
        err = json.loads(body).get("error") or {}
        msg = err.get("message") if isinstance(err, dict) else str(err)
        param = err.get("param") if isinstance(err, dict) and isinstance(err.get("param"), str) else None
    except (json.JSONDecodeError, AttributeError):
        msg = body[:300]
    msg = msg or f"HTTP {status}"
    if status >= 500:
        return Retryable(f"{url}: HTTP {status}: {msg}")
    if status == 429:
        return RateLimited(f"upstream rate limit: {msg}", retry_after=1.0)
    if status in (400, 413, 422):
        return InvalidRequest(f"upstream refused the request: {msg}", param=param)  # the field it named, kept
    return EngineFailed(f"{url}: HTTP {status}: {msg}")  # 401/403/404: the gateway's config is wrong
