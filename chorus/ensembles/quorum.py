"""Member calls that need only k of n replies: answer once a quorum has replied, give the rest a grace period.

`first_k` starts every call at once. When ``k`` calls have succeeded, the others get ``grace_s`` more
seconds; whatever has not replied by then is cancelled (its engine frees the sequence, as on a client
disconnect) and reported ``late``. A failed call does not count towards the quorum. Without a quorum
(``k`` None) every call is waited for, as `call.gather` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Outcome:
    """What became of one call: ``replied`` (with its result), ``failed`` (None came back) or ``late``."""

    status: str
    seconds: float


async def first_k(aws: Sequence[Awaitable[T | None]], k: int | None, grace_s: float = 0.0
                  ) -> tuple[list[T | None], list[Outcome]]:
    """The results in the calls' order (None for a failed or late call) and each call's outcome."""
    start = time.monotonic()
    tasks: list[asyncio.Future[T | None]] = [asyncio.ensure_future(a) for a in aws]
    index = {t: i for i, t in enumerate(tasks)}
    results: list[T | None] = [None] * len(tasks)
    outcomes = [Outcome("late", 0.0) for _ in tasks]
    need = len(tasks) if k is None else min(k, len(tasks))
    pending: set[asyncio.Future[T | None]] = set(tasks)
    deadline: float | None = None
    try:
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break  # the grace period is over
            for t in done:
                i = index[t]
                results[i] = t.result()  # a request error (InvalidRequest, MemberFailed) ends the request
                outcomes[i] = Outcome("replied" if results[i] is not None else "failed", time.monotonic() - start)
            replied = sum(o.status == "replied" for o in outcomes)
            if deadline is None and replied >= need:
                deadline = time.monotonic() + grace_s
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    waited = time.monotonic() - start
    for t in pending:
        outcomes[index[t]] = Outcome("late", waited)
    return results, outcomes
