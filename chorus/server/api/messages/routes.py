"""``/v1/messages``: Anthropic's Messages API, served through the chat route (server/messages_shapes.py converts
both ways), on single models and every ensemble; ``/v1/messages/count_tokens`` counts a request's prompt with the
model's own chat template. Errors come in Anthropic's envelope (server/errors.py), keys as ``x-api-key`` or
``Authorization: Bearer`` (server/gateway.py); ``anthropic-version`` is accepted and not checked."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from chorus.errors import InvalidRequest
from chorus.server import routes
from chorus.server.messages_shapes import MessageEvents, MessagesRequest, MessagesState
from chorus.server.replies import json_response
from chorus.server.resolve import ensemble_for, ensembles, model_for

router = APIRouter()


class MessagesShape:
    """How the chat route's reply is given back for one Messages request (replies.py reads it)."""

    named_events = True  #: SSE events carry ``event: <type>`` and no ``[DONE]``, as Anthropic's

    def __init__(self, state: MessagesState) -> None:
        self.state = state

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        return self.state.from_chat(chat)

    def events(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
        return MessageEvents(self.state).run(chunks)


@router.post("/v1/messages", response_model=None)
async def create_message(req: MessagesRequest, request: Request) -> Response:
    return await routes.chat(request, req.to_chat(), MessagesShape(MessagesState(req)))


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(req: MessagesRequest, request: Request) -> Response:
    """The prompt's tokens as the model would read it (its chat template, and the tools as it is offered them); an
    ensemble's are its first member's."""
    if req.ensemble is not None:  # counted for a model or a named ensemble; never silently ignored
        raise InvalidRequest("count_tokens counts the prompt of a model or a named ensemble; an inline 'ensemble' "
                             "is not used here: name one of its members as the model.", param="ensemble")
    chat = req.to_chat(need_max_tokens=False)
    name = req.model
    named = ensembles(request).get(name)
    if named is not None:
        ensemble_for(request, name, named, chat)
        engine = named.strategy.members[0].engine
    else:
        engine = model_for(request, name, body=chat, generates=True)
    return json_response({"input_tokens": len(chat.to_generation_request(engine).prompt_ids)})
