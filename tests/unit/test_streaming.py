"""The SSE body of a stream: events as ``data:`` lines, and the request's deadline over the whole stream (one
timer): past it, a producer being awaited is cancelled, and one not being awaited is not asked again; either
way the stream ends with a deadline error, then ``[DONE]``, and the producer is closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from chorus.server.gateway.streaming import sse_response


def request_due_in(seconds: float) -> Any:
    return SimpleNamespace(deadline=asyncio.get_running_loop().time() + seconds, timeout=seconds)  # a Context's


async def producer(delays: list[float], closed: list[str]) -> AsyncGenerator[dict[str, Any], None]:
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield {"type": "chunk", "i": i}
    finally:
        closed.append("closed")


async def read(body: Any, pause: float = 0.0) -> list[bytes]:
    out = []
    async for chunk in body:
        out.append(chunk)
        await asyncio.sleep(pause)
    return out


async def test_events_then_done_within_the_deadline() -> None:
    closed: list[str] = []
    resp = sse_response(producer([0, 0], closed), request_due_in(5))
    out = await read(resp.body_iterator)
    assert [json.loads(c[len(b"data: "):]) for c in out[:2]] == [{"type": "chunk", "i": 0}, {"type": "chunk", "i": 1}]
    assert out[2] == b"data: [DONE]\n\n" and closed == ["closed"]


async def test_a_producer_awaited_past_the_deadline_is_cancelled() -> None:
    closed: list[str] = []
    resp = sse_response(producer([0, 30], closed), request_due_in(0.2))
    out = await asyncio.wait_for(read(resp.body_iterator), 5)
    assert b'"i":0' in out[0] and b"deadline_exceeded" in out[1] and out[2] == b"data: [DONE]\n\n"
    assert closed == ["closed"]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the deadline's cancel was taken back


async def test_a_deadline_passed_between_events_stops_the_next_wait() -> None:
    closed: list[str] = []
    resp = sse_response(producer([0, 0, 0], closed), request_due_in(0.1))
    out = await read(resp.body_iterator, pause=0.3)  # the consumer (a slow client) outlives the deadline
    assert b'"i":0' in out[0] and b"deadline_exceeded" in out[1] and out[2] == b"data: [DONE]\n\n"
    assert closed == ["closed"]


async def test_named_events_carry_their_type() -> None:
    resp = sse_response(producer([0], []), None, named=True)
    out = await read(resp.body_iterator)
    assert out == [b'event: chunk\ndata: {"type":"chunk","i":0}\n\n']
