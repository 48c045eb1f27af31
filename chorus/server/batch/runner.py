"""The batch runner: one background task per gateway process that moves batches through OpenAI's statuses and
runs their lines.

``validating`` (the input file read and checked, validate.py; bad lines fail the batch) -> ``in_progress`` (lines
claimed a few at a time, store.py, and each sent through this very app as if a client had sent it: the same
front door, so the batch's key is authenticated, its allow-list, limits and budget apply and its spend is
charged; the same routes, so a line is answered exactly as a live request) -> ``finalizing`` (the answers written
to the output file, the failures to the error file, in OpenAI's line format) -> ``completed``. A cancelled batch
stops claiming, cancels its lines in flight and ends ``cancelled``; one past its completion window ends
``expired``; one whose key runs out of budget stops cleanly and ends ``failed`` (``errors`` says why). In every
case the lines that never ran are in the error file (``batch_cancelled``, ``batch_expired``, ``budget_exceeded``).

Politeness: at most ``server.batches.concurrency`` lines of this process are in flight at once, they go to the
engines marked as batch work (`BATCH_PRIORITY`: an engine's scheduler admits live requests first), and a line
refused for load (429 for the key's rate or concurrency, 503 when the server is full) is given back and tried
again after the ``Retry-After`` it was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from prometheus_client import Counter, Gauge
from pydantic import BaseModel
from starlette.types import ASGIApp, Message

from chorus.config import BatchesSection
from chorus.engines.core.base import cancelled
from chorus.errors import NotFound
from chorus.server.batch.store import DB, Line, Store, new_id, this_process

if TYPE_CHECKING:
    from chorus.server.batch.redis_store import RedisStore
from chorus.server.batch.validate import read_lines
from chorus.server.gateway.context import BATCH_OWNER, Context
from chorus.server.gateway.services import Services

log = logging.getLogger("chorus.batch")
AnyStore: TypeAlias = "Store | RedisStore"
LINES = Counter("chorus_batch_lines_total", "Batch lines answered, by outcome", ["outcome"])
IN_FLIGHT = Gauge("chorus_batch_lines_in_flight", "Batch lines being answered by this process")
BATCHES = Gauge("chorus_batches", "Batches by status, as this process last saw them", ["status"])


class Batches:
    """The Batch API of one app: its store, opened when first used or, at start-up, when one is already there
    (a restarted server resumes its unfinished batches), and the runner working through it."""

    def __init__(self, root: Path, options: BatchesSection, services: Services,
                 endpoints: Mapping[str, type[BaseModel]]) -> None:
        self.root = root
        self.options = options
        self.services = services
        #: what a batch may run and the request model each line's body must pass (given by the API layer,
        #: server/api/openai/batches.py's ENDPOINTS: the batch layer names no API module)
        self.endpoints = dict(endpoints)
        self.app: ASGIApp | None = None
        self._store: AnyStore | None = None
        state = services.config.server.state.store
        #: with a Redis state store the batches are shared by every replica (redis_store.py); else SQLite on this node
        self.redis_url = state if state != "memory" else None
        self.runner: Runner | None = None

    async def start(self, app: ASGIApp) -> None:
        self.app = app
        if self.redis_url is not None or (self.root / DB).exists():
            await self.open()

    async def open(self) -> AnyStore:
        if self._store is None:
            if self.redis_url is not None:
                from chorus.server.batch.redis_store import RedisStore

                self._store = RedisStore(self.redis_url, self.services.config.server.state.key_prefix)
            else:
                self._store = Store(self.root)
            if self.app is not None:
                self.runner = Runner(self.app, self.services, self._store, self.options, self.endpoints)
                await self.runner.start()
        return self._store

    def poke(self) -> None:
        """Work was added: look now rather than at the next poll."""
        if self.runner is not None:
            self.runner.wake.set()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self._store is not None:
            await self._store.close()


def batches_of(ctx: Context) -> Batches:
    found = ctx.services.batches
    if found is None:
        raise NotFound("The Batch API is off on this server (server.batches.enabled: false).")
    assert isinstance(found, Batches)
    return found


class Runner:
    def __init__(self, app: ASGIApp, services: Services, store: AnyStore, options: BatchesSection,
                 endpoints: Mapping[str, type[BaseModel]]) -> None:
        self.app = app
        self.endpoints = endpoints
        self.services = services
        self.store = store
        self.options = options
        self.me = this_process()
        self.tasks: dict[asyncio.Task[None], tuple[str, int]] = {}  #: lines in flight -> (batch, line index)
        self.not_before: dict[str, float] = {}  #: batch -> when to claim again (told to wait)
        self.wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._loop = asyncio.create_task(self.loop())

    async def give_back_dead(self) -> None:
        """Lines held by processes of this host that are gone go back to the queue (at the loop's first pass, so
        a store out of reach at start-up, Redis down, delays this rather than the server's start)."""
        released = await self.store.release_dead(self.me)
        if released:
            log.info("batch lines of a stopped process given back: %d", released)

    async def stop(self) -> None:
        """Stop claiming; lines in flight are given back (another process, or this one restarted, runs them)."""
        await cancelled(self._loop)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def loop(self) -> None:
        dead_given_back, failures = False, 0
        while True:
            try:
                if not dead_given_back:
                    await self.give_back_dead()
                    dead_given_back = True
                await self.tick()
                if failures:
                    log.info("batch runner working again after %d failed passes", failures)
                failures = 0
            except Exception as exc:  # the store out of reach (Redis down), or a bug: logged, tried again later
                failures += 1
                if failures == 1:
                    log.exception("batch runner step failed; trying again with backoff")
                elif failures % 20 == 0:
                    log.warning("batch runner still failing (%d passes): %s", failures, exc)
            wait = self.options.poll_s * min(2 ** failures, 60)  # failing: backing off to a minute or so
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait)
            self.wake.clear()

    # ---- one pass over the open batches ----

    async def tick(self) -> None:
        opened = await self.store.open_batches()
        seen: dict[str, int] = {}
        for b in opened:
            seen[b["status"]] = seen.get(b["status"], 0) + 1
        for status in ("validating", "in_progress", "finalizing", "cancelling"):
            BATCHES.labels(status).set(seen.get(status, 0))
        now = time.time()
        for b in opened:
            status, bid = b["status"], b["id"]
            if status == "validating":
                if await self.store.claim_batch(bid, "validating", self.me, self.options.lease_s):
                    await self.validate(b)
            elif status == "in_progress":
                counts = await self.store.counts(bid)
                if counts["running"] == 0 and (counts["pending"] == 0 or now >= b["expires_at"]):
                    await self.store.move(bid, ("in_progress",), "finalizing")
                    self.wake.set()
            elif status == "cancelling":
                self.cancel_mine(bid)
                if (await self.store.counts(bid))["running"] == 0 and \
                        await self.store.claim_batch(bid, "cancelling", self.me, self.options.lease_s):
                    await self.finalize(b)
            elif status == "finalizing" and await self.store.claim_batch(bid, "finalizing", self.me,
                                                                          self.options.lease_s):
                await self.finalize(b)
        await self.claim([b for b in opened if b["status"] == "in_progress" and now < b["expires_at"]
                    and self.not_before.get(b["id"], 0.0) <= time.monotonic()])

    async def validate(self, b: dict[str, Any]) -> None:
        owner = b["owner"]
        if await self.store.file(b["input_file_id"], owner) is None:
            await self.fail(b, [{"code": "invalid_file", "message": f"The input file {b['input_file_id']} was deleted "
                           "before the batch started.", "param": "input_file_id", "line": None}])
            return
        data = await self.store.read(b["input_file_id"])  # checked off the event loop: a large file blocks no one
        endpoint = b["endpoint"]
        lines, errors = await asyncio.to_thread(read_lines, data, endpoint, self.endpoints[endpoint],
                                                self.usable(owner), self.options.max_lines)
        if errors:
            await self.fail(b, [e.as_dict() for e in errors])
            return
        await self.store.add_lines(b["id"], lines)
        await self.store.move(b["id"], ("validating",), "in_progress")
        log.info("batch %s: %d lines in progress", b["id"], len(lines))

    async def fail(self, b: dict[str, Any], errors: list[dict[str, Any]]) -> None:
        await self.store.move(b["id"], ("validating",), "failed", errors={"object": "list", "data": errors})
        log.info("batch %s failed validation: %s", b["id"], errors[0]["message"])

    def usable(self, owner: str) -> list[str]:
        """The models and named ensembles the batch's key may use."""
        names = [*self.services.engines, *self.services.ensembles]
        principal = next((p for p in self.services.keys.principals if p.name == owner), None)
        if principal is None or principal.models is None:
            return names
        return [n for n in names if n in principal.models]

    # ---- lines ----

    async def claim(self, batches: list[dict[str, Any]]) -> None:
        """Fill this process's free slots with lines, a fair share from each batch in turn."""
        while batches and len(self.tasks) < self.options.concurrency:
            free = self.options.concurrency - len(self.tasks)
            share = max(1, free // len(batches))
            still = []
            for b in batches:
                got = await self.store.claim(b["id"], self.me, min(share, self.options.concurrency - len(self.tasks)),
                                       self.options.lease_s)
                for line in got:
                    task = asyncio.create_task(self.run_line(b, line))
                    self.tasks[task] = (b["id"], line.idx)
                    task.add_done_callback(self.done)
                if len(got) == share:
                    still.append(b)
                if len(self.tasks) >= self.options.concurrency:
                    return
            batches = still

    def done(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        IN_FLIGHT.set(len(self.tasks))
        self.wake.set()

    def cancel_mine(self, batch_id: str) -> None:
        for task, (bid, _) in list(self.tasks.items()):
            if bid == batch_id:
                task.cancel()

    async def run_line(self, b: dict[str, Any], line: Line) -> None:
        IN_FLIGHT.set(len(self.tasks))
        rid = new_id("batch_req_")
        try:
            status, body = await call(self.app, b["endpoint"], line.body, rid, b["owner"])
        except asyncio.CancelledError:
            await asyncio.shield(self.store.unclaim(b["id"], line.idx, self.me))  # cancelled or stopping: run again
            raise
        except Exception as exc:  # a bug: the line is failed, never retried forever
            log.exception("batch %s line %d", b["id"], line.idx)
            status, body = 500, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                                           "param": None, "code": None}}
        error = body.get("error") if isinstance(body, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if status in (429, 503) and code != "budget_exceeded":  # load: try again when told
            await self.store.unclaim(b["id"], line.idx, self.me)
            self.not_before[b["id"]] = time.monotonic() + retry_after(body, status)
            LINES.labels("retried").inc()
            return
        if code == "budget_exceeded" and isinstance(error, dict):  # the key's budget stops the batch; not run
            await self.store.unclaim(b["id"], line.idx, self.me)
            errors = {"object": "list", "data": [{"code": "budget_exceeded", "message": error["message"],
                                                  "param": None, "line": None}]}
            if await self.store.move(b["id"], ("in_progress",), "cancelling", errors=errors):
                log.info("batch %s stopped: %s", b["id"], error["message"])
            LINES.labels("budget_exceeded").inc()
            return
        kept = await self.store.answer(b["id"], line.idx, self.me, status,
                                 {"id": rid, "status_code": status, "request_id": rid, "body": body})
        LINES.labels(("completed" if 200 <= status < 300 else "failed") if kept else "dropped").inc()

    # ---- the end ----

    async def finalize(self, b: dict[str, Any]) -> None:
        """Write the output and error files, then the batch's last status."""
        bid = b["id"]
        fresh = await self.store.batch(bid)
        assert fresh is not None
        errors = json.loads(fresh["errors"]) if fresh["errors"] else None
        if fresh["status"] == "cancelling":
            final = "failed" if errors else "cancelled"
        else:
            final = "completed"
        unrun_code = (errors["data"][0]["code"] if errors else "batch_cancelled") if final != "completed" else ""
        out: list[dict[str, Any]] = []
        err: list[dict[str, Any]] = []
        async for custom_id, status, result in self.store.results(bid):
            if result is None:
                if not unrun_code:
                    final, unrun_code = "expired", "batch_expired"
                message = {"batch_cancelled": "The batch was cancelled before this request ran.",
                           "batch_expired": "This request could not be executed before the completion window "
                                            "expired.",
                           }.get(unrun_code, "The batch stopped before this request ran: its key's budget is spent.")
                err.append({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                            "error": {"code": unrun_code, "message": message}})
                continue
            rid = result.pop("id")
            row = {"id": rid, "custom_id": custom_id, "response": result, "error": None}
            (out if status is not None and 200 <= status < 300 else err).append(row)
        files: dict[str, Any] = {}
        for kind, rows in (("output", out), ("error", err)):
            if rows:
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                files[f"{kind}_file_id"] = (await self.store.add_file(b["owner"], "batch_output",
                                                                     f"{bid}_{kind}.jsonl", data))["id"]
        ran_badly = sum(1 for r in err if r["response"] is not None)
        if await self.store.move(bid, (fresh["status"],), final, completed=len(out), failed=ran_badly, **files):
            await self.store.drop_lines(bid)
            self.not_before.pop(bid, None)
            log.info("batch %s %s: %d answered, %d errors", bid, final, len(out), len(err))


def retry_after(body: Any, status: int) -> float:
    """How long a line refused for load waits (the refusal's own advice is in its headers, read by `call`)."""
    told = body.get("_retry_after") if isinstance(body, dict) else None
    return max(0.1, min(float(told), 60.0)) if told is not None else (1.0 if status == 503 else 2.0)


async def call(app: ASGIApp, path: str, body: dict[str, Any], request_id: str, owner: str) -> tuple[int, Any]:
    """POST ``body`` to ``path`` through the whole app, in this process, as the key ``owner``: (status, JSON)."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                         (b"x-request-id", request_id.encode())],
             "client": ("batch", 0), "server": ("batch", 0), BATCH_OWNER: owner}
    sent = False
    status, headers, chunks = 500, {}, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves: it waits until the reply is done
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    raw = b"".join(chunks)
    try:
        parsed: Any = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        parsed = {"error": {"message": raw[:300].decode(errors="replace"), "type": "server_error", "param": None,
                            "code": None}}
    if status in (429, 503) and "retry-after" in headers and isinstance(parsed, dict):
        with contextlib.suppress(ValueError):
            parsed["_retry_after"] = float(headers["retry-after"])
    return status, parsed
