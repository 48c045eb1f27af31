"""Per-key state: request and token windows, requests in flight, budgets and spend (``server.state``).

One interface, two stores. `MemoryState` keeps it in this process (the embedded default; with k replicas a key
gets k times its limits). `RedisState` (server/gateway/redis_state.py) keeps it in Redis, shared by every replica,
each admission and each charge one atomic Lua script. The gateway middleware calls ``admit`` before any engine
work (a key over a window, its concurrency or its budget gets a 429 naming it, with ``Retry-After``),
``release`` when the request ends, and ``charge`` with every model's usage once a response is known (an
ensemble: one charge per member model). A charge has an id (the request id and the model), so a charge
replayed after an outage is counted once.

Budgets: ``max_budget`` per key, in tokens or in currency (the config's ``prices``: per million prompt and
completion tokens per model); with ``budget_period_s`` the period starts at its first charge and the spend
resets when it ends. Spend is recorded per key and model for the current period and for the key's lifetime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from chorus.config import ApiKey, Price
from chorus.errors import RateLimited
from chorus.server.gateway.auth import WINDOW_S, Principal


@dataclass(frozen=True)
class Charge:
    id: str  #: unique per request and model: a replayed charge is counted once
    key: str
    model: str
    tokens: int
    cost: float


@dataclass(frozen=True)
class Reservation:
    """A request's worst case, held against its key's budget and token window from admission until it is
    settled (server/reserve.py)."""

    id: str
    tokens: int
    cost: float

    def amount(self, key: ApiKey | None) -> float:
        """What it holds of the key's budget: its tokens, or its cost."""
        if key is None or key.max_budget is None:
            return 0.0
        return float(self.tokens) if key.budget_unit == "tokens" else self.cost


def too_costly(key: ApiKey, principal: Principal, r: Reservation, what: str, spent: float, held: float,
               limit: float, retry_after: float | None) -> RateLimited:
    """The refusal of a reservation: what the request may cost, what is spent and held by requests in flight."""
    unit = "tokens" if what == "tpm" or key.budget_unit == "tokens" else "in currency"
    cost = r.tokens if unit == "tokens" else r.cost
    name = "its tokens per minute (tpm)" if what == "tpm" else "its budget (max_budget)"
    return RateLimited(f"Key {principal.name!r}: this request may cost up to {cost:g} ({unit}: its prompt + "
                       f"max_tokens x n, x the calls of an ensemble), and {name} of {limit:g} has {spent:g} spent "
                       f"and {held:g} held by requests in flight; lower max_tokens or n, or retry later.",
                       retry_after=retry_after if retry_after is not None else 1.0,
                       code="rate_limit_exceeded" if what == "tpm" else "budget_exceeded")


def cost_of(prices: dict[str, Price], model: str, prompt: int, completion: int) -> float:
    p = prices.get(model)
    return 0.0 if p is None else (prompt * p.prompt + completion * p.completion) / 1e6


def budget_amount(key: ApiKey | None, charge: Charge) -> float:
    """What a charge takes from the key's budget: its tokens, or its cost."""
    if key is None or key.max_budget is None:
        return 0.0
    return float(charge.tokens) if key.budget_unit == "tokens" else charge.cost


def over_budget(key: ApiKey, spent: float, resets_in: float | None) -> RateLimited:
    unit = "tokens" if key.budget_unit == "tokens" else "in currency"
    when = f"; it resets in {resets_in:.0f} s" if resets_in is not None else " (it does not reset)"
    return RateLimited(f"Key {key.name!r} has spent its budget: {spent:g} of max_budget {key.max_budget:g} "
                       f"({unit}){when}.", retry_after=resets_in if resets_in is not None else 3600.0,
                       code="budget_exceeded")


class KeyState(Protocol):
    async def admit(self, principal: Principal, request_id: str) -> str:
        """Count one request in (or raise `RateLimited`); returns where it was counted, for ``release``."""
        ...

    async def release(self, principal: Principal, where: str) -> None: ...

    async def reserve(self, principal: Principal, r: Reservation) -> None:
        """Hold ``r`` against the key's budget and tpm (or raise `RateLimited`: it would not fit)."""
        ...

    def unreserve(self, principal: Principal, r: Reservation) -> None:
        """Drop the hold (after the request's charges, which take its place); never blocks."""
        ...

    def charge(self, charges: list[Charge]) -> None:
        """Record these charges (windows, budget, spend); never blocks the response."""
        ...

    async def report(self, principal: Principal) -> dict[str, Any]:
        """The key's window, in-flight count, budget and spend (the admin endpoint)."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass
class Spend:
    total: float = 0.0
    started: float | None = None  #: the period's first charge (monotonic)
    by_model: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, c: Charge, amount: float) -> None:
        self.total += amount
        m = self.by_model.setdefault(c.model, {"tokens": 0, "cost": 0.0})
        m["tokens"] += c.tokens
        m["cost"] += c.cost


class MemoryState:
    """This process's counts (the windows live on each `Principal`)."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self.keys = keys
        self.period: dict[str, Spend] = {}
        self.lifetime: dict[str, Spend] = {}
        self.principals: dict[str, Principal] = {}
        self.held: dict[str, dict[str, Reservation]] = {}  #: key -> reservation id -> the reservation

    def _period(self, name: str, now: float) -> Spend:
        key, spend = self.keys.get(name), self.period.get(name)
        if spend is None or (key is not None and key.budget_period_s is not None and spend.started is not None
                             and now - spend.started >= key.budget_period_s):
            spend = self.period[name] = Spend()
        return spend

    def resets_in(self, name: str, now: float) -> float | None:
        key, spend = self.keys.get(name), self.period.get(name)
        if key is None or key.budget_period_s is None or spend is None or spend.started is None:
            return None
        return max(0.0, key.budget_period_s - (now - spend.started))

    def check_budget(self, principal: Principal) -> None:
        key = self.keys.get(principal.name)
        if key is not None and key.max_budget is not None:
            now = time.monotonic()
            spent = self._period(principal.name, now).total
            if spent >= key.max_budget:
                raise over_budget(key, spent, self.resets_in(principal.name, now))

    async def admit(self, principal: Principal, request_id: str) -> str:
        self.principals[principal.name] = principal
        self.check_budget(principal)
        principal.admit()
        return "memory"

    async def release(self, principal: Principal, where: str) -> None:
        principal.release()

    async def reserve(self, principal: Principal, r: Reservation) -> None:
        held = self.held.setdefault(principal.name, {})
        key, now = self.keys.get(principal.name), time.monotonic()
        if principal.tpm is not None:
            principal._expire(now)
            tokens = sum(x.tokens for x in held.values())
            if principal.tokens_in_window + tokens + r.tokens > principal.tpm and key is not None:
                oldest = principal.tokens[0][0] if principal.tokens else now
                raise too_costly(key, principal, r, "tpm", principal.tokens_in_window, tokens, principal.tpm,
                                 WINDOW_S - (now - oldest))
        if key is not None and key.max_budget is not None:
            spent, holding = self._period(principal.name, now).total, sum(x.amount(key) for x in held.values())
            if spent + holding + r.amount(key) > key.max_budget:
                raise too_costly(key, principal, r, "budget", spent, holding, key.max_budget,
                                 self.resets_in(principal.name, now))
        held[r.id] = r

    def unreserve(self, principal: Principal, r: Reservation) -> None:
        self.held.get(principal.name, {}).pop(r.id, None)

    def record(self, c: Charge, principal: Principal | None) -> None:
        """Count a charge in the windows and the spend (a process sees each charge once: no ids kept)."""
        if principal is not None:
            principal.charge(c.tokens)
        now = time.monotonic()
        spend = self._period(c.key, now)
        if spend.started is None:
            spend.started = now
        spend.add(c, budget_amount(self.keys.get(c.key), c))
        self.lifetime.setdefault(c.key, Spend()).add(c, 0.0)

    def charge(self, charges: list[Charge]) -> None:
        for c in charges:
            self.record(c, self.principals.get(c.key))

    async def report(self, principal: Principal) -> dict[str, Any]:
        now = time.monotonic()
        principal._expire(now)
        spend = self._period(principal.name, now)
        return build_report(self.keys.get(principal.name), principal.name, "memory",
                            len(principal.requests), principal.tokens_in_window, principal.inflight, spend.total,
                            self.resets_in(principal.name, now), spend.by_model,
                            self.lifetime.get(principal.name, Spend()).by_model)

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def build_report(key: ApiKey | None, name: str, store: str, requests: int, tokens: int, inflight: int,
                 spent: float, resets_in: float | None, period: dict[str, Any],
                 lifetime: dict[str, Any]) -> dict[str, Any]:
    budget = None
    if key is not None and key.max_budget is not None:
        budget = {"max_budget": key.max_budget, "unit": key.budget_unit, "period_s": key.budget_period_s,
                  "spent": spent, "remaining": max(0.0, key.max_budget - spent), "resets_in_s": resets_in}
    limits = {"rpm": key.rpm, "tpm": key.tpm, "max_concurrent": key.max_concurrent} if key is not None else {}
    return {"key": name, "store": store, "limits": limits,
            "window_s": WINDOW_S, "window": {"requests": requests, "tokens": tokens}, "inflight": inflight,
            "budget": budget, "spend": {"period": period, "lifetime": lifetime}}
