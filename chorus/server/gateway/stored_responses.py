"""Stored responses (the Responses API's ``store``): the most recent ``server.limits.max_stored_responses`` of each
key in this process's memory, each readable only by the key that made it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from chorus.errors import ResponseNotFound


@dataclass
class Stored:
    owner: str | None
    body: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Each key's own pool of ``max_stored`` (oldest dropped first): one key's responses never evict another's."""

    def __init__(self, max_stored: int) -> None:
        self.max_stored = max_stored
        self._pools: dict[str | None, OrderedDict[str, Stored]] = {}

    def put(self, rid: str, stored: Stored) -> None:
        pool = self._pools.setdefault(stored.owner, OrderedDict())
        pool[rid] = stored
        while len(pool) > self.max_stored:
            pool.popitem(last=False)

    def get(self, rid: str, owner: str | None, param: str | None = None) -> Stored:
        pool = self._pools.get(owner)
        found = pool.get(rid) if pool is not None else None
        if found is None:
            raise ResponseNotFound(f"No stored response with id '{rid}' (responses are kept in this server's "
                                   f"memory, the latest {self.max_stored} of each key, and only for the key that "
                                   "made them).", param=param)
        return found

    def delete(self, rid: str, owner: str | None) -> None:
        self.get(rid, owner)
        del self._pools[owner][rid]
