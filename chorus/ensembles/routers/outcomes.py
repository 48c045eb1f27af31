"""The online routers' shared outcome log: what every replica learned from, in order.

A router does not keep its model in the store: it keeps its *evidence*, one event per feedback (the arm, the
features, the reward), appended to a log per ensemble. Every replica reads the events it has not seen before
each choice and learns from them, so every replica learns from every replica's traffic and a restarted one
rebuilds its model by reading the log from the start. The log is bounded (the oldest events drop out past
``max_events``), so memory is bounded and a rebuilt model reflects the recent past.

`MemoryOutcomes` is this process's log (the embedded default: one replica); the gateway's Redis store
(server/gateway/feedback_store.py) keeps it in a Redis stream per ensemble when ``server.state.store`` is Redis.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class Outcomes(Protocol):
    async def append(self, ensemble: str, event: dict[str, Any]) -> None: ...

    async def read(self, ensemble: str, after: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Events after the cursor ``after`` (None: from the oldest kept), and the cursor past them."""
        ...


class MemoryOutcomes:
    def __init__(self, max_events: int = 100_000) -> None:
        self.max_events = max_events
        self.logs: dict[str, deque[tuple[int, dict[str, Any]]]] = {}
        self.next: dict[str, int] = {}

    async def append(self, ensemble: str, event: dict[str, Any]) -> None:
        log = self.logs.setdefault(ensemble, deque(maxlen=self.max_events))
        n = self.next.get(ensemble, 0)
        log.append((n, event))
        self.next[ensemble] = n + 1

    async def read(self, ensemble: str, after: str | None) -> tuple[list[dict[str, Any]], str | None]:
        start = -1 if after is None else int(after)
        out = [e for i, e in self.logs.get(ensemble, ()) if i > start]
        last = self.next.get(ensemble, 0) - 1
        return out, (str(last) if last >= 0 else after)
