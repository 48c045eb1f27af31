"""The one place where exceptions become OpenAI error envelopes."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from chorus.errors import GatewayError

log = logging.getLogger("chorus.errors")

_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded"}


def envelope(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def retry_headers(exc: GatewayError) -> dict[str, str] | None:
    after = getattr(exc, "retry_after", None)
    return {"Retry-After": str(max(1, math.ceil(after)))} if after is not None else None


def validation_param(loc: tuple[object, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not str(p).startswith(("function-", "literal[", "str", "list[", "int", "union[")):
            out += ("." if out else "") + str(p)
    return out or None


def validation_envelope(errors: Sequence[Any]) -> JSONResponse:
    """pydantic's errors for a request body -> 400 naming the first bad field (``messages[0].role``)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return envelope(400, "We could not parse the JSON body of your request: it is not valid JSON.",
                        "invalid_request_error", None, "invalid_json")
    param = validation_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    text = f"Invalid value for '{param}': {msg}{more}" if param else f"Invalid request: {msg}{more}"
    return envelope(400, text, "invalid_request_error", param, "invalid_value")


def error_response(exc: BaseException) -> JSONResponse:
    """The one exception -> HTTP map, used by the FastAPI handlers, the fast path and the gateway middleware.

    `GatewayError` -> its status and type (``Retry-After`` when it has one); pydantic's validation
    errors -> 400 naming the first bad field; Starlette's HTTP errors (404, 405, 413) -> their status;
    anything else -> 500, logged with its traceback, with nothing of it in the body.
    """
    if isinstance(exc, GatewayError):
        if exc.status >= 500:
            log.error("request failed: %s", exc.message)
        return envelope(exc.status, exc.message, exc.type, exc.param, exc.code, headers=retry_headers(exc))
    if isinstance(exc, RequestValidationError | ValidationError):
        return validation_envelope(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return envelope(exc.status_code, str(exc.detail), _HTTP_TYPES.get(exc.status_code, "server_error"),
                        None, code, headers=getattr(exc, "headers", None))
    log.error("unhandled error", exc_info=exc)
    return envelope(500, "The server had an error while processing your request.", "server_error")


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def for_path(path: str, response: JSONResponse) -> JSONResponse:
    """Anthropic's envelope on the Messages API (``{"type": "error", "error": {"type", "message"}}``, the field
    named in the message), OpenAI's everywhere else."""
    if not path.startswith("/v1/messages"):
        return response
    err = json.loads(bytes(response.body))["error"]
    message = err["message"] if not err.get("param") or err["param"] in err["message"] else \
        f"{err['param']}: {err['message']}"
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse({"type": "error", "error": {"type": error_type(response.status_code), "message": message}},
                        status_code=response.status_code, headers=headers or None)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return for_path(request.url.path, error_response(exc))


def install(app: FastAPI) -> None:
    for kind in (GatewayError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _handle)
