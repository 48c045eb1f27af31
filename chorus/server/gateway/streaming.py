"""SSE plumbing: OpenAI chunks as ``data:`` events, a final error event after the first byte, cancellation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from pydantic_core import to_json
from sse_starlette import EventSourceResponse

from chorus.errors import ClientClosedRequest, DeadlineExceeded, EngineFailed, GatewayError
from chorus.server.gateway.context import Context

log = logging.getLogger("chorus.stream")
T = TypeVar("T")


def deadline_error(ctx: Context | None) -> DeadlineExceeded:
    timeout = ctx.timeout if ctx is not None else None
    return DeadlineExceeded(f"The request ran past its deadline of {timeout:g} s and was stopped; its work is "
                            "cancelled. Raise X-Chorus-Timeout (up to the server's request_timeout_s) or ask "
                            "for fewer tokens." if timeout else "The request ran past its deadline.")


def sse_response(events: AsyncGenerator[dict[str, Any], None], ctx: Context | None = None,
                 named: bool = False) -> EventSourceResponse:
    """Stream dicts as ``data: {json}`` events, then ``data: [DONE]``; ``named``: each event also carries
    ``event: <its type>`` and no ``[DONE]`` follows (the Responses API's stream).

    An error raised after the first byte becomes one final ``data: {"error": ...}`` event (the
    stream is never cut silently). sse-starlette cancels the producer when the client disconnects;
    the producer's ``finally`` blocks free the engine sessions.
    """

    deadline = ctx.deadline if ctx is not None else None

    async def body() -> AsyncGenerator[bytes, None]:
        timer = _Deadline(deadline)
        try:
            while True:
                try:
                    event = await timer.next(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise deadline_error(ctx) from None
                yield _event(to_json(event), event["type"] if named else None)
        except GatewayError as exc:
            yield _event(to_json({"error": exc.to_dict()}))
        except Exception as exc:
            log.exception("stream failed")
            yield _event(to_json({"error": EngineFailed(f"stream failed: {exc}").to_dict()}))
        finally:
            timer.close()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
        if not named:
            yield b"data: [DONE]\n\n"

    return EventSourceResponse(body(), ping=15, sep="\n", headers={"Cache-Control": "no-cache"})


class _Deadline:
    """The request's deadline over a stream: one timer for the whole stream (a timeout around each event cost
    a timer per token). Past the deadline the producer is cancelled while it is awaited, in this task, not a
    wait_for task (a cancelled body must be able to close the producer; its finally frees the sessions), or
    the next wait for it fails at once; either is a `TimeoutError`."""

    def __init__(self, when: float | None) -> None:
        self.task = asyncio.current_task()
        self.waiting = self.expired = False
        self.handle = None if when is None else asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.waiting and self.task is not None:
            self.task.cancel()

    async def next(self, events: AsyncGenerator[T, None]) -> T:
        if self.expired:
            raise TimeoutError
        self.waiting = True
        try:
            return await anext(events)
        except asyncio.CancelledError:
            if self.expired and self.task is not None and self.task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self.waiting = False

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


def _event(data: bytes, name: str | None = None) -> bytes:
    """One SSE event, encoded here (sse-starlette sends bytes as they are): JSON has no raw newline, so one
    ``data:`` line holds it."""
    return (b"event: " + name.encode() + b"\ndata: " if name else b"data: ") + data + b"\n\n"


async def until_disconnect(ctx: Context, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, or the request's deadline passes, cancel it (its
    sessions close in its finally)."""
    task = asyncio.ensure_future(work)
    deadline, request = ctx.deadline, ctx.http
    assert request is not None, "a route's context is bound to its HTTP request (gateway/context.py: context)"

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    disconnected = False
    try:
        timeout = None if deadline is None else max(deadline - asyncio.get_running_loop().time(), 0.0)
        await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        disconnected = watcher.done() and not watcher.cancelled()
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        if disconnected or deadline is None:
            raise ClientClosedRequest("client disconnected; generation cancelled")
        raise deadline_error(ctx)
    return task.result()
