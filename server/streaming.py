"""SSE plumbing: OpenAI chunks as ``data:`` events, a final error event after the first byte, cancellation."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from engines.errors import EngineFailed, GatewayError

log = logging.getLogger("chorus.stream")
T = TypeVar("T")


class ClientClosedRequest(GatewayError):
    """The client went away before the response (nginx's 499); nobody reads this response."""

    status = 499
    type = "client_closed_request"


def sse_response(events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    """Stream dicts as ``data: {json}`` events, then ``data: [DONE]``.

    An error raised after the first byte becomes one final ``data: {"error": ...}`` event (the
    stream is never cut silently). sse-starlette cancels the producer when the client disconnects;
    the producer's ``finally`` blocks free the engine sessions.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield json.dumps(event, separators=(",", ":"))
        except GatewayError as exc:
            yield json.dumps({"error": exc.to_dict()})
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged here
            log.exception("stream failed")
            yield json.dumps({"error": EngineFailed(f"stream failed: {exc}").to_dict()})
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
        yield "[DONE]"

    return EventSourceResponse(body(), ping=15, sep="\n", headers={"Cache-Control": "no-cache"})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (its sessions close in its finally)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientClosedRequest("client disconnected; generation cancelled")
    return task.result()
