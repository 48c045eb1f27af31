"""``/v1/responses``: OpenAI's Responses API, served through the chat route (wire.py reads the request as a chat
request, render.py gives the chat reply back as a response), on single models and every ensemble.

Stored responses (``store``, true by default as on OpenAI) are kept in memory in this process, the most recent
``server.responses.max_stored`` of them (older ones are dropped first), for ``GET`` / ``DELETE
/v1/responses/{id}`` and ``previous_response_id``; with API keys, a key sees only its own. They do not survive
a restart and are not shared between replicas.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from chorus.server.api.openai import routes
from chorus.server.api.openai.responses.render import ResponseEvents, ResponseState
from chorus.server.api.openai.responses.wire import ResponsesRequest
from chorus.server.gateway.context import Ctx
from chorus.server.gateway.stored_responses import ResponseStore, Stored
from chorus.server.reply import json_response

router = APIRouter()


class ResponseShape:
    """How the chat route's reply is given back for one Responses request (server/reply.py reads it)."""

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
async def create_response(req: ResponsesRequest, ctx: Ctx) -> Response:
    store, owner = ctx.services.responses, ctx.owner
    history = store.get(req.previous_response_id, owner, "previous_response_id").conversation \
        if req.previous_response_id else []
    chat = req.to_chat(history)
    return await routes.chat(ctx, chat, ResponseShape(ResponseState(req), store, owner, chat.message_dicts()))


@router.get("/v1/responses/{rid}", response_model=None)
async def get_response(rid: str, ctx: Ctx) -> Response:
    return json_response(ctx.services.responses.get(rid, ctx.owner).body)


@router.delete("/v1/responses/{rid}", response_model=None)
async def delete_response(rid: str, ctx: Ctx) -> Response:
    ctx.services.responses.delete(rid, ctx.owner)
    return json_response({"id": rid, "object": "response", "deleted": True})
