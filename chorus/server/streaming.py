"""SSE plumbing: OpenAI chunks as ``data:`` events, a final error event after the first byte, cancellation."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from chorus.errors import ClientClosedRequest, DeadlineExceeded, EngineFailed, GatewayError

log = logging.getLogger("chorus.stream")
T = TypeVar("T")


def deadline_of(request: Request | None) -> float | None:
    return getattr(request.state, "deadline", None) if request is not None else None


def deadline_error(request: Request | None) -> DeadlineExceeded:
    timeout = getattr(request.state, "timeout", None) if request is not None else None
    return DeadlineExceeded(f"The request ran past its deadline of {timeout:g} s and was stopped; its work is "
                            "cancelled. Raise X-Chorus-Timeout (up to the server's request_timeout_s) or ask "
                            "for fewer tokens." if timeout else "The request ran past its deadline.")


def sse_response(events: AsyncGenerator[dict[str, Any], None], request: Request | None = None,
                 named: bool = False) -> EventSourceResponse:
    """Stream dicts as ``data: {json}`` events, then ``data: [DONE]``; ``named``: each event also carries
    ``event: <its type>`` and no ``[DONE]`` follows (the Responses API's stream).

    An error raised after the first byte becomes one final ``data: {"error": ...}`` event (the
    stream is never cut silently). sse-starlette cancels the producer when the client disconnects;
    the producer's ``finally`` blocks free the engine sessions.
    """

    deadline = deadline_of(request)

    async def body() -> AsyncGenerator[str | dict[str, str], None]:
        try:
            while True:
                try:
                    # past the deadline the producer is cancelled (its finally frees the sessions); in this
                    # task, not a wait_for task: a cancelled body must be able to close the producer
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise deadline_error(request) from None
                data = json.dumps(event, separators=(",", ":"))
                yield {"event": event["type"], "data": data} if named else data
        except GatewayError as exc:
            yield json.dumps({"error": exc.to_dict()})
        except Exception as exc:
            log.exception("stream failed")
            yield json.dumps({"error": EngineFailed(f"stream failed: {exc}").to_dict()})
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
        if not named:
            yield "[DONE]"

    return EventSourceResponse(body(), ping=15, sep="\n", headers={"Cache-Control": "no-cache"})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, or the request's deadline passes, cancel it (its
    sessions close in its finally)."""
    task = asyncio.ensure_future(work)
    deadline = deadline_of(request)

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
        raise deadline_error(request)
    return task.result()
