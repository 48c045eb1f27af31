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
SELECTOR_CHOICES = Counter(
    "chorus_selector_choices_total", "Items a select ensemble answered, by the first member whose top choice it "
    "took ('none': a choice no member put first)", ["ensemble", "member"])
ENSEMBLE_REQUESTS = Counter(
    "chorus_ensemble_requests_total", "Requests answered by an ensemble strategy", ["ensemble", "strategy"])
MEMBER_CALLS = Counter(
    "chorus_member_calls_total", "Ensemble member calls by outcome (ok / failed)", ["ensemble", "member", "outcome"])
TOKEN_POSITIONS = Counter(
    "chorus_token_ensemble_positions_total", "Tokens decoded by token-level ensembles, per mode", ["ensemble", "mode"])
TOKEN_CONSULTED = Counter(
    "chorus_token_ensemble_consulted_total",
    "Of those, positions where the members were combined (selective: where the gate fired)", ["ensemble", "mode"])
TOKEN_CATCH_UP = Counter(
    "chorus_token_ensemble_catch_up_tokens_total",
    "Tokens a selective ensemble's member read in catch-up chunks when consulted", ["ensemble", "member"])
SPECULATIVE_PROPOSED = Counter(
    "chorus_speculative_proposed_total", "Tokens a speculative ensemble's lead drafted", ["ensemble"])
SPECULATIVE_ACCEPTED = Counter(
    "chorus_speculative_accepted_total", "Drafted tokens the ensemble's sampled output matched", ["ensemble"])
