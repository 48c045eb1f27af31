"""What feedback is joined to: every answered request's record, kept by its request id for ``feedback.keep_s``,
and the online routers' outcome logs (ensembles/routers/outcomes.py).

A record: the key that made the request, the model (or ensemble) that answered, its tokens and cost (the config's
prices), when, and the decision an online router made for it (arm, features, propensity). It is written once
the request's usage is known (``settle``), and marked per metric when feedback comes, so a second feedback on the
same metric is refused rather than learned twice.

Two stores, chosen by ``server.state.store`` as the key state is. `MemoryBook`: this process (bounded by
``feedback.max_requests`` and by age). `RedisBook`: Redis, shared by every replica: ``PREFIX:fb:req:ID`` (the record,
expiring after ``keep_s``; written only if absent, so a reused request id cannot take over another request's
record), ``PREFIX:fb:got:ID`` (metrics with feedback, a hash), and ``PREFIX:online:ENSEMBLE`` (a stream: the outcome log,
trimmed to about ``max_events``). Records are written from a buffer by a background task, so a request never
waits on Redis. While Redis is down the records stay in that buffer (``chorus_feedback_records_buffered``) and
are written when it answers again (retried every ``RETRY_S``, doubling to ``RETRY_MAX_S``), as the limits'
charges are; the buffer holds at most ``feedback.max_buffered`` records, and one pushed out of it (the oldest
first) is counted (``chorus_feedback_records_lost_total``) and logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

from chorus.config import FeedbackSection, StateSection
from chorus.ensembles.routers.outcomes import MemoryOutcomes, Outcomes

log = logging.getLogger("chorus.feedback")
KEPT = Counter("chorus_feedback_records_total", "answered requests kept for feedback")
LOST = Counter("chorus_feedback_records_lost_total", "answered requests that could not be kept for feedback")
BUFFERED = Gauge("chorus_feedback_records_buffered", "answered requests waiting to be written to the state store")
RETRY_S, RETRY_MAX_S = 0.5, 5.0  # a failed write is retried after this, doubling up to the max


class RequestBook(Protocol):
    outcomes: Outcomes

    def remember(self, request_id: str, record: dict[str, Any]) -> None: ...

    async def recall(self, request_id: str) -> dict[str, Any] | None: ...

    async def mark(self, request_id: str, metric: str, value: float) -> bool:
        """Note feedback on ``metric``; False if the request already had some."""
        ...

    async def unmark(self, request_id: str, metric: str) -> None:
        """Forget that mark (its feedback could not be learned); best effort."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


def book_entry(owner: str | None, request_id: str) -> str:
    """Where a request is kept for feedback: under its key and its id, so two keys' requests under the same
    (client-chosen) X-Request-ID never meet, and one key cannot squat another's future id."""
    return request_id if owner is None else f"{owner}/{request_id}"


class MemoryBook:
    def __init__(self, section: FeedbackSection) -> None:
        self.section = section
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.outcomes: Outcomes = MemoryOutcomes(section.max_events)

    def _evict(self, now: float) -> None:
        while self.records and (len(self.records) > self.section.max_requests
                                or next(iter(self.records.values()))["t"] < now - self.section.keep_s):
            self.records.popitem(last=False)

    def remember(self, request_id: str, record: dict[str, Any]) -> None:
        if request_id not in self.records:  # the first request under an id keeps it
            self.records[request_id] = {**record, "feedback": {}}
            KEPT.inc()
        self._evict(record["t"])

    async def recall(self, request_id: str) -> dict[str, Any] | None:
        self._evict(time.time())
        return self.records.get(request_id)

    async def mark(self, request_id: str, metric: str, value: float) -> bool:
        record = self.records.get(request_id)
        got = record["feedback"] if record is not None else {}
        if metric in got:
            return False
        got[metric] = value
        return True

    async def unmark(self, request_id: str, metric: str) -> None:
        record = self.records.get(request_id)
        if record is not None:
            record["feedback"].pop(metric, None)

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class RedisOutcomes:
    def __init__(self, redis: Any, prefix: str, max_events: int) -> None:
        self.redis, self.prefix, self.max_events = redis, prefix, max_events

    def key(self, ensemble: str) -> str:
        return f"{self.prefix}:online:{ensemble}"

    async def append(self, ensemble: str, event: dict[str, Any]) -> None:
        await self.redis.xadd(self.key(ensemble), {"e": json.dumps(event)}, maxlen=self.max_events,
                              approximate=True)

    async def read(self, ensemble: str, after: str | None) -> tuple[list[dict[str, Any]], str | None]:
        out: list[dict[str, Any]] = []
        cursor = after
        while True:
            rows = await self.redis.xrange(self.key(ensemble), min=f"({cursor}" if cursor else "-", max="+",
                                           count=5000)
            if not rows:
                return out, cursor
            out.extend(json.loads(fields["e"]) for _, fields in rows)
            cursor = rows[-1][0]


class RedisBook:
    def __init__(self, section: FeedbackSection, state: StateSection) -> None:
        import redis.asyncio as aioredis

        self.section, self.prefix = section, state.key_prefix
        self.redis = aioredis.Redis.from_url(state.store, socket_timeout=max(state.timeout_s, 2.0),
                                             socket_connect_timeout=state.timeout_s, decode_responses=True)
        self.outcomes: Outcomes = RedisOutcomes(self.redis, self.prefix, section.max_events)
        self.pending: dict[str, dict[str, Any]] = {}  # written by the drain task
        self.writing: dict[str, dict[str, Any]] = {}  # the batch being written now
        self._wake = asyncio.Event()
        self._drain: asyncio.Task[None] | None = None

    def k(self, what: str, request_id: str) -> str:
        return f"{self.prefix}:fb:{what}:{request_id}"

    def remember(self, request_id: str, record: dict[str, Any]) -> None:
        self.pending.setdefault(request_id, record)
        self._bound()
        self._wake.set()

    def _bound(self) -> None:
        """At most ``max_buffered`` records wait; the oldest go first (counted as lost)."""
        over = len(self.pending) + len(self.writing) - self.section.max_buffered
        if over > 0:
            for rid in list(self.pending)[:over]:
                del self.pending[rid]
            LOST.inc(over)
            log.error("feedback: the buffer is full (%d records while the state store is down); %d oldest dropped",
                      self.section.max_buffered, over)
        BUFFERED.set(len(self.pending) + len(self.writing))

    async def _write(self) -> bool:
        """The pending records, in one pipeline (the drain task's, and at shutdown). On failure they go back to
        the buffer, before the ones that came meanwhile; returns whether they were written."""
        batch, self.pending = self.pending, {}
        if not batch:
            return True
        self.writing = batch  # recall still finds them while they are on their way
        ttl = max(1, int(self.section.keep_s))
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid, record in batch.items():  # SET NX: a batch written twice (cut off, retried) counts once
                    pipe.set(self.k("req", rid), json.dumps(record), ex=ttl, nx=True)
                await pipe.execute()
            KEPT.inc(len(batch))
            return True
        except Exception as exc:
            log.warning("feedback: %d request records wait for the state store (Redis: %s)", len(batch), exc)
            self.pending = {**batch, **self.pending}
            return False
        finally:
            self.writing = {}
            self._bound()

    async def _run(self) -> None:
        delay = RETRY_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                if await self._write():
                    delay = RETRY_S
                else:  # Redis is down: keep the records, try again later
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)

    async def recall(self, request_id: str) -> dict[str, Any] | None:
        local = self.pending.get(request_id) or self.writing.get(request_id)
        if local is not None:  # this replica answered it a moment ago and has not written it yet
            return local
        raw = await self.redis.get(self.k("req", request_id))
        return None if raw is None else json.loads(raw)

    async def mark(self, request_id: str, metric: str, value: float) -> bool:
        key = self.k("got", request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, metric, value)
            pipe.expire(key, max(1, int(self.section.keep_s)))
            fresh, _ = await pipe.execute()
        return bool(fresh)

    async def unmark(self, request_id: str, metric: str) -> None:
        try:
            await self.redis.hdel(self.k("got", request_id), metric)
        except Exception as exc:
            log.warning("feedback: could not unmark %s on %s: %s", metric, request_id, exc)

    async def start(self) -> None:
        self._drain = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._drain is not None:
            in_flight = self.writing  # a batch the drain task was writing when cancelled: written again (SET NX)
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
            self.pending = {**in_flight, **self.pending}
        if self.pending and not await self._write():
            LOST.inc(len(self.pending))
            log.error("feedback: %d request records not kept at shutdown (the state store is down)", len(self.pending))
        await self.redis.aclose()


def request_book(section: FeedbackSection, state: StateSection) -> RequestBook:
    """The store the config names (``server.state.store``): this process, or Redis."""
    if state.store == "memory":
        return MemoryBook(section)
    return RedisBook(section, state)
