"""Per-key state in Redis (``server.state.store: redis://...``), shared by every gateway replica.

Keys, under ``server.state.key_prefix`` (default ``chorus``) and the key's name: ``req`` (a sorted set of the
window's request ids, scored by time), ``tok`` (the window's tokens in one-second buckets: a hash of at most
61 fields, so a check costs the same at any request rate), ``inflight`` (a
counter, expiring an hour after its last change so a replica that died cannot hold a slot for ever),
``resv`` (the worst cases of requests in flight, server/reserve.py: a sorted set of ``ID|TOKENS|AMOUNT`` scored
by when each expires, ``server.state.reservation_ttl_s``, so a replica that died holds nothing for long),
``spend`` (this budget period: ``total`` and ``tokens:MODEL`` / ``cost:MODEL``; it expires when the period
ends) and ``lifetime`` (the same, never reset); ``charge:ID`` marks a charge as counted (a day).

Each admission is one Lua script (windows trimmed, every limit and the budget checked, the request counted),
and so is each charge (counted once by its id): Redis runs a script alone, so two replicas cannot both admit
the last request of a window. Time is Redis's own (``TIME``), so replicas need no shared clock.

When Redis cannot be reached (``server.state.on_failure``): ``fail_open`` admits against this process's own
counts (`MemoryState`) and logs and counts the outage (``chorus_state_store_errors_total``,
``chorus_state_store_up``); ``fail_closed`` refuses with 503 and ``Retry-After``. Either way the charges of
answered requests are kept in a buffer and written, with their ids, once Redis answers again (a background
task reconnects with backoff), so no charge is lost and none is counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge

from chorus.config import ApiKey, StateSection
from chorus.errors import RateLimited, StoreUnavailable
from chorus.server.gateway.auth import WINDOW_S, Principal
from chorus.server.gateway.key_state import (
    Charge,
    MemoryState,
    Reservation,
    budget_amount,
    build_report,
    over_budget,
    too_costly,
)
from chorus.server.gateway.redis_scripts import ADMIT, CHARGE, RELEASE, RESERVE

log = logging.getLogger("chorus.state")
STORE_UP = Gauge("chorus_state_store_up", "1 while the shared state store (Redis) answers")
STORE_ERRORS = Counter("chorus_state_store_errors_total", "calls to the shared state store that failed", ["op"])
LOCAL = Counter("chorus_state_local_admissions_total", "admissions counted locally while the store was down")

def by_model(raw: dict[str, str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for field, value in raw.items():
        kind, _, model = field.partition(":")
        if kind in ("tokens", "cost") and model:
            out.setdefault(model, {"tokens": 0, "cost": 0.0})[kind] = int(value) if kind == "tokens" else float(value)
    return out


class RedisState:
    def __init__(self, section: StateSection, keys: dict[str, ApiKey]) -> None:
        import redis.asyncio as aioredis

        self.section, self.keys = section, keys
        self.redis = aioredis.Redis.from_url(section.store, socket_timeout=section.timeout_s,
                                             socket_connect_timeout=section.timeout_s, decode_responses=True)
        self.local = MemoryState(keys)  #: while Redis is down (fail_open)
        self.buffer: list[Charge] = []  #: charges not yet written (Redis down, or in flight)
        self.releases: list[str] = []  #: keys whose Redis in-flight count is still to be decremented
        self.up = True
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reconnect: asyncio.Task[None] | None = None
        self._admit = self.redis.register_script(ADMIT)
        self._charge = self.redis.register_script(CHARGE)
        self._release = self.redis.register_script(RELEASE)
        self._reserve = self.redis.register_script(RESERVE)
        self.unreserves: list[tuple[str, str]] = []  #: holds to drop once the charges before them are written
        self.hold_ms = 1000 * int(section.reservation_ttl_s)
        self._flushing = asyncio.Lock()

    def k(self, name: str, what: str) -> str:
        return f"{self.section.key_prefix}:{{{name}}}:{what}"

    # -- outages ----------------------------------------------------------------------------------------------
    def failed(self, op: str, exc: BaseException) -> None:
        STORE_ERRORS.labels(op).inc()
        if self.up:
            log.error("state store %s unreachable (%s: %s); policy %s", self.section.store, type(exc).__name__, exc,
                      self.section.on_failure)
        self.up = False
        STORE_UP.set(0)
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.get_running_loop().create_task(self._come_back())

    async def _come_back(self) -> None:
        delay = 0.1
        while True:
            await asyncio.sleep(delay)
            try:
                await self.redis.ping()
                await self.flush()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                STORE_ERRORS.labels("reconnect").inc()
                log.debug("state store still down: %s", exc)
                delay = min(delay * 2, 5.0)
                continue
            self.up = True
            STORE_UP.set(1)
            log.info("state store %s is back; buffered charges written", self.section.store)
            return

    async def flush(self) -> None:
        """Write the buffered charges and releases (each charge counted once, by its id), one flush at a time."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        while self.releases:
            await self._release(keys=[self.k(self.releases[0], "inflight")])
            self.releases.pop(0)
        while self.buffer:
            await self.write(self.buffer[0])
            self.buffer.pop(0)
        while self.unreserves:  # after the charges that take their place: never a moment with neither counted
            name, member = self.unreserves[0]
            await self.redis.zrem(self.k(name, "resv"), member)
            self.unreserves.pop(0)

    # -- the interface ---------------------------------------------------------------------------------------
    async def admit(self, principal: Principal, request_id: str) -> str:
        self.local.principals[principal.name] = principal
        key = self.keys.get(principal.name)
        if self.up:
            budget = key.max_budget if key is not None and key.max_budget is not None else 0
            try:
                out = await self._admit(
                    keys=[self.k(principal.name, "req"), self.k(principal.name, "tok"),
                          self.k(principal.name, "inflight"), self.k(principal.name, "spend")],
                    args=[principal.rpm or 0, principal.tpm or 0, principal.max_concurrent or 0, budget, request_id,
                          int(WINDOW_S * 1000)])
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.failed("admit", exc)
            else:
                if int(out[0]) == 1:
                    return "redis"
                raise refusal(principal, key, out)
        if self.section.on_failure == "fail_closed":
            raise StoreUnavailable("The shared rate-limit store cannot be reached and this deployment fails closed; "
                                   "retry shortly.", retry_after=1.0)
        LOCAL.inc()
        return await self.local.admit(principal, request_id)

    async def release(self, principal: Principal, where: str) -> None:
        if where != "redis":
            await self.local.release(principal, where)
            return
        if self.up:
            try:
                await self._release(keys=[self.k(principal.name, "inflight")])
                return
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.failed("release", exc)
        self.releases.append(principal.name)

    async def reserve(self, principal: Principal, r: Reservation) -> None:
        key = self.keys.get(principal.name)
        if self.up:
            budget = key.max_budget if key is not None and key.max_budget is not None else 0
            try:
                out = await self._reserve(
                    keys=[self.k(principal.name, "tok"), self.k(principal.name, "spend"), self.k(principal.name, "resv")],
                    args=[principal.tpm or 0, budget, member_of(r, key), r.tokens, repr(r.amount(key)),
                          int(WINDOW_S * 1000), self.hold_ms])
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.failed("reserve", exc)
            else:
                if int(out[0]) == 1:
                    return
                assert key is not None
                what, spent, held, retry = str(out[1]), float(out[2]), float(out[3]), float(out[4])
                limit = float(principal.tpm or 0) if what == "tpm" else float(key.max_budget or 0)
                raise too_costly(key, principal, r, what, spent, held, limit, retry / 1000 if retry > 0 else None)
        if self.section.on_failure == "fail_closed":
            raise StoreUnavailable("The shared rate-limit store cannot be reached and this deployment fails closed; "
                                   "retry shortly.", retry_after=1.0)
        await self.local.reserve(principal, r)

    def unreserve(self, principal: Principal, r: Reservation) -> None:
        self.local.unreserve(principal, r)
        self.unreserves.append((principal.name, member_of(r, self.keys.get(principal.name))))
        if self.up:
            task = asyncio.get_running_loop().create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def write(self, c: Charge) -> None:
        key, principal = self.keys.get(c.key), self.local.principals.get(c.key)
        period = key.budget_period_s if key is not None and key.budget_period_s is not None else 0
        windowed = "1" if principal is None or principal.tpm is not None else "0"  # a window only for a tpm limit
        await self._charge(keys=[self.k(c.key, "tok"), self.k(c.key, "spend"), self.k(c.key, "lifetime"),
                                 f"{self.section.key_prefix}:charge:{c.id}"],
                           args=[c.id, c.tokens, repr(c.cost), c.model, period, int(WINDOW_S * 1000),
                                 repr(budget_amount(key, c)), windowed])

    def charge(self, charges: list[Charge]) -> None:
        self.local.charge(charges)  # the local counts, used while Redis is down
        self.buffer.extend(charges)
        if self.up:
            task = asyncio.get_running_loop().create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            await self.flush()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self.failed("charge", exc)

    async def report(self, principal: Principal) -> dict[str, Any]:
        name, key = principal.name, self.keys.get(principal.name)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                now_ms = time.time() * 1000
                pipe.zcount(self.k(name, "req"), now_ms - WINDOW_S * 1000, "+inf")
                pipe.hgetall(self.k(name, "tok"))
                pipe.get(self.k(name, "inflight"))
                pipe.hgetall(self.k(name, "spend"))
                pipe.ttl(self.k(name, "spend"))
                pipe.hgetall(self.k(name, "lifetime"))
                requests, toks, inflight, spend, ttl, lifetime = await pipe.execute()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self.failed("report", exc)
            raise StoreUnavailable("The shared state store cannot be reached; its counts cannot be read now.",
                                   retry_after=1.0) from None
        tokens = sum(int(v) for sec, v in toks.items() if int(sec) > now_ms / 1000 - WINDOW_S)
        resets = float(ttl) if ttl is not None and ttl >= 0 else None
        out = build_report(key, name, "redis", int(requests), tokens, int(inflight or 0),
                           float(spend.get("total", 0)), resets, by_model(spend), by_model(lifetime))
        out["store_up"] = self.up
        out["buffered_charges"] = len(self.buffer)
        return out

    async def start(self) -> None:
        STORE_UP.set(1)
        try:
            await self.redis.ping()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self.failed("start", exc)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.up and self.buffer:
            try:
                await self.flush()
            except Exception as exc:
                log.error("state store: %d charges not written at shutdown: %s", len(self.buffer), exc)
        if self._reconnect is not None:
            self._reconnect.cancel()
        await self.redis.aclose()


def member_of(r: Reservation, key: ApiKey | None) -> str:
    """A hold's member of the key's ``resv`` sorted set: ``ID|TOKENS|AMOUNT`` (scored by when it expires)."""
    return f"{r.id}|{r.tokens}|{r.amount(key)!r}"


def is_outage(exc: BaseException) -> bool:
    """A lost or timed-out connection, or a Redis that answers but takes no writes now (out of memory, a read-only
    replica, a master or cluster that is down, its disk full: MISCONF); for the gateway each is an outage."""
    import redis.exceptions as rx

    refusing = (rx.OutOfMemoryError, rx.ReadOnlyError, rx.MasterDownError, rx.ClusterDownError, rx.TryAgainError)
    if isinstance(exc, (rx.ConnectionError, rx.TimeoutError, OSError, ConnectionError, TimeoutError, *refusing)):
        return True
    return isinstance(exc, rx.ResponseError) and "MISCONF" in str(exc)  # (no class of its own in redis-py)


def refusal(principal: Principal, key: ApiKey | None, out: list[Any]) -> RateLimited:
    reason, retry = str(out[1]), max(float(out[2]), 0.0) / 1000
    if reason == "concurrent":
        return RateLimited(f"Key {principal.name!r} has {out[3]} requests in flight; its limit is "
                           f"{principal.max_concurrent}.", retry_after=1.0)
    if reason == "rpm":
        return RateLimited(f"Key {principal.name!r} is limited to {principal.rpm} requests per minute.",
                           retry_after=retry)
    if reason == "tpm":
        return RateLimited(f"Key {principal.name!r} is limited to {principal.tpm} tokens per minute ({out[3]} used).",
                           retry_after=retry)
    assert key is not None
    return over_budget(key, float(out[3]), retry if float(out[2]) > 0 else None)
