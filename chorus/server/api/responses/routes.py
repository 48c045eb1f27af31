"""``/v1/responses``: OpenAI's Responses API, served through the chat route (server/responses_shapes.py converts
both ways), on single models and every ensemble.

Stored responses (``store``, true by default as on OpenAI) are kept in memory in this process, the most recent
``server.responses.max_stored`` of them (older ones are dropped first), for ``GET`` / ``DELETE
/v1/responses/{id}`` and ``previous_response_id``; with API keys, a key sees only its own. They do not survive
a restart and are not shared between replicas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from chorus.errors import ResponseNotFound
from chorus.server import routes
from chorus.server.replies import json_response
from chorus.server.resolve import owner_of
from chorus.server.responses_shapes import ResponseEvents, ResponsesRequest, ResponseState

router = APIRouter()


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


class ResponseShape:
    """How the chat route's reply is given back for one Responses request (replies.py reads it)."""

    named_events = True  #: SSE events carry ``event: <type>`` and no ``[DONE]``, as OpenAI's

    def __init__(self, state: ResponseState, store: ResponseStore, owner: str | None,
                 messages: list[dict[str, Any]]) -> None:
        self.state, self.store, self.owner, self.messages = state, store, owner, messages

    def keep(self) -> None:
        if self.state.req.store and self.state.error is None:
            self.store.put(self.state.id, Stored(self.owner, self.state.body(),
                                                 self.state.conversation(self.messages)))

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        out = self.state.from_chat(chat)
        self.keep()
        return out

    async def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
        async for e in ResponseEvents(self.state).run(chunks):
            if e["type"] in ("response.completed", "response.incomplete"):
                self.keep()
            yield e


@router.post("/v1/responses", response_model=None)
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    store: ResponseStore = request.app.state.responses
    owner = owner_of(request)
    history = store.get(req.previous_response_id, owner, "previous_response_id").conversation \
        if req.previous_response_id else []
    chat = req.to_chat(history)
    return await routes.chat(request, chat, ResponseShape(ResponseState(req), store, owner, chat.message_dicts()))


@router.get("/v1/responses/{rid}", response_model=None)
async def get_response(rid: str, request: Request) -> Response:
    return json_response(request.app.state.responses.get(rid, owner_of(request)).body)


@router.delete("/v1/responses/{rid}", response_model=None)
async def delete_response(rid: str, request: Request) -> Response:
    request.app.state.responses.delete(rid, owner_of(request))
    return json_response({"id": rid, "object": "response", "deleted": True})
