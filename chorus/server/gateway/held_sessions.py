"""Held token sessions (the token-session API's, api/extensions/sessions.py): open engine sessions by id, each owned by the
key that opened it; a reaper frees the ones idle past ``server.sessions.idle_timeout_s``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from chorus.engines.core.base import Session, cancelled
from chorus.errors import SessionNotFound

log = logging.getLogger("chorus.sessions")


@dataclass
class Held:
    id: str
    model: str
    session: Session
    vocab_size: int
    length: int
    owner: str | None = None  #: the key that opened it: only that key may step, read or close it
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionStore:
    """Open sessions by id; a reaper closes the ones idle past the timeout."""

    def __init__(self, idle_timeout_s: float, max_open: int, max_per_key: int | None = None) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_open = max_open
        self.max_per_key = max_per_key
        self.held: dict[str, Held] = {}
        self.expired = 0
        self.expired_by: dict[str | None, int] = {}  #: per key (each key's listing shows its own)
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="chorus-session-reaper")

    async def stop(self) -> None:
        await cancelled(self._reaper)
        self._reaper = None
        for held in list(self.held.values()):
            self.close(held.id)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout_s / 4))
            self.reap_now()

    def reap_now(self) -> int:
        now = time.monotonic()
        idle = [h.id for h in self.held.values() if not h.lock.locked() and now - h.last_used > self.idle_timeout_s]
        for sid in idle:
            owner = self.held[sid].owner
            self.close(sid)
            self.expired += 1
            self.expired_by[owner] = self.expired_by.get(owner, 0) + 1
        if idle:
            log.info("freed %d idle session(s)", len(idle))
        return len(idle)

    def get(self, sid: str, owner: str | None = None) -> Held:
        held = self.held.get(sid)
        if held is None or held.owner != owner:  # another key's session is not there for this one
            raise SessionNotFound(f"No open session {sid!r}: it was closed, or freed after "
                                  f"{self.idle_timeout_s:g} s idle.", param="id")
        return held

    def close(self, sid: str) -> bool:
        held = self.held.pop(sid, None)
        if held is not None:
            held.session.close()
        return held is not None
