"""Request-size limit as a pure ASGI middleware: 413 before the body is read into memory. A path may have a limit of
its own (``paths``: the Batch API's uploads, ``server.batches.max_file_bytes``, far above a request's)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope.get("path", ""), self.max_bytes)
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > limit:
                await self._reject(send, limit)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # chunked bodies without a Content-Length
                    raise HTTPException(413, self._message(limit))
            return message

        await self.app(scope, limited, send)

    @staticmethod
    def _message(limit: int) -> str:
        return f"Request body too large: the limit is {limit} bytes."

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps({"error": {"message": self._message(limit), "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
