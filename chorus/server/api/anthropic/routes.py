"""``/v1/messages``: Anthropic's Messages API, served through the chat route (wire.py reads the request as a chat
request, render.py gives the chat reply back as Anthropic's), on single models and every ensemble; ``/v1/messages/count_tokens`` counts a request's prompt with the
model's own chat template. Errors come in Anthropic's envelope (gateway/errors.py), keys as ``x-api-key`` or
``Authorization: Bearer`` (gateway/admission.py); ``anthropic-version`` is accepted and not checked."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from chorus.errors import InvalidRequest
from chorus.server import plan
from chorus.server.api.anthropic.render import MessageEvents, MessagesState
from chorus.server.api.anthropic.wire import MessagesRequest
from chorus.server.api.openai import routes
from chorus.server.gateway.context import Ctx
from chorus.server.reply import json_response
from chorus.server.resolve import resolve

router = APIRouter()


class MessagesShape:
    """How the chat route's reply is given back for one Messages request (server/reply.py reads it)."""

    named_events = True  #: SSE events carry ``event: <type>`` and no ``[DONE]``, as Anthropic's

    def __init__(self, state: MessagesState) -> None:
        self.state = state

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        return self.state.from_chat(chat)

    def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
        return MessageEvents(self.state).run(chunks)


@router.post("/v1/messages", response_model=None)
async def create_message(req: MessagesRequest, ctx: Ctx) -> Response:
    return await routes.chat(ctx, req.to_chat(), MessagesShape(MessagesState(req)))


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(req: MessagesRequest, ctx: Ctx) -> Response:
    """The prompt's tokens as the model would read it (its chat template, and the tools as it is offered them); an
    ensemble's are its first member's."""
    if req.ensemble is not None:  # counted for a model or a named ensemble; never silently ignored
        raise InvalidRequest("count_tokens counts the prompt of a model or a named ensemble; an inline 'ensemble' "
                             "is not used here: name one of its members as the model.", param="ensemble")
    chat = req.to_chat(need_max_tokens=False)
    engine = plan.counting_engine(resolve(ctx, chat, use="count"))
    return json_response({"input_tokens": len(chat.to_generation_request(engine).prompt_ids)})
