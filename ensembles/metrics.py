"""Prometheus counters that strategies update; the server exposes them at ``/metrics``.

Registered in prometheus-client's default registry (one set per process).
"""

from __future__ import annotations

from prometheus_client import Counter

ROUTE_DECISIONS = Counter(
    "chorus_route_decisions_total", "Requests a routing strategy sent to each member",
    ["ensemble", "router", "member"])
CASCADE_STEPS = Counter(
    "chorus_cascade_steps_total", "Cascade steps per member and outcome (accepted / escalated / failed)",
    ["ensemble", "member", "outcome"])
ENSEMBLE_REQUESTS = Counter(
    "chorus_ensemble_requests_total", "Requests answered by an ensemble strategy", ["ensemble", "strategy"])
MEMBER_CALLS = Counter(
    "chorus_member_calls_total", "Ensemble member calls by outcome (ok / failed)", ["ensemble", "member", "outcome"])
