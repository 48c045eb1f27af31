"""Stored responses (the Responses API's ``store``): the most recent ``server.responses.max_stored`` in this
process's memory, each readable only by the key that made it."""

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
    def __init__(self, max_stored: int) -> None:
        self.max_stored = max_stored
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, stored: Stored) -> None:
        self._items[rid] = stored
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, rid: str, owner: str | None, param: str | None = None) -> Stored:
        found = self._items.get(rid)
        if found is None or found.owner != owner:
            raise ResponseNotFound(f"No stored response with id '{rid}' (responses are kept in this server's "
                                   f"memory, the latest {self.max_stored}, and only for the key that made them).",
                                   param=param)
        return found

    def delete(self, rid: str, owner: str | None) -> None:
        self.get(rid, owner)
        del self._items[rid]
