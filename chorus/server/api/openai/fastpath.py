"""The completion routes without FastAPI's per-request machinery (measured: about a fifth of a proxied request).

`FastPath` is a pure ASGI middleware in front of FastAPI's router: ``POST /v1/chat/completions`` and
``POST /v1/completions`` are read, validated by pydantic-core straight from the bytes
(``model_validate_json``), and handed to the same route functions as FastAPI would call; errors
become the same OpenAI envelopes (server/gateway/errors.py). Everything else (and the OpenAPI schema, which
still documents these two routes) goes through FastAPI unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from chorus.server.api.openai.routes import chat_completions, completions
from chorus.server.gateway.context import ROUTE_KEY, context
from chorus.server.gateway.errors import error_response
from chorus.server.reply import json_response
from chorus.server.wire import request as wire


class FastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.routes: dict[str, tuple[type[wire.CompletionFields], Callable[..., Awaitable[Any]]]] = {
            "/v1/chat/completions": (wire.ChatCompletionRequest, chat_completions),
            "/v1/completions": (wire.CompletionRequest, completions),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        model, handler = route
        scope[ROUTE_KEY] = scope["path"]  # the metrics' route label (no FastAPI route is matched here)
        response: Response
        try:
            req = model.model_validate_json(await _read_body(receive))
            out = await handler(req, context(Request(scope, receive)))
            response = out if isinstance(out, Response) else json_response(out)
        except Exception as exc:  # validation, GatewayError, the body-size limit on a chunked body, bugs
            response = error_response(exc)
        await response(scope, receive, send)


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)
