"""Typed errors raised anywhere below the HTTP layer.

The server turns each into the OpenAI error envelope in one place (server/errors.py)::

    GatewayError                      500 server_error
     ├── InvalidRequest               400 invalid_request_error   (param names the field)
     │    ├── ContextLengthExceeded   400 code=context_length_exceeded
     │    └── CapabilityMismatch      400 code=capability_mismatch
     ├── AuthenticationFailed         401 authentication_error
     ├── PermissionDenied             403 permission_error        (the key may not use that model)
     ├── ModelNotFound                404 code=model_not_found
     ├── RequestTooLarge              413 code=request_too_large
     ├── RateLimited                  429 rate_limit_exceeded     (retry_after: seconds)
     ├── EngineFailed                 500 server_error
     │    └── MemberFailed            502 code=member_failed      (an ensemble member failed)
     ├── DeadlineExceeded             504 code=deadline_exceeded
     └── EngineUnavailable            503 code=engine_unavailable
          └── Overloaded              503 code=server_overloaded  (admission limit; retry_after)
"""

from __future__ import annotations


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, object]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class CapabilityMismatch(InvalidRequest):
    code = "capability_mismatch"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: str | None) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.retry_after = retry_after


class DeadlineExceeded(GatewayError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"


class EngineFailed(GatewayError):
    status = 500
    type = "server_error"
    code = "engine_failed"


class MemberFailed(EngineFailed):
    """An ensemble member failed and the ensemble cannot go on without it (``on_member_error: fail``)."""

    status = 502
    code = "member_failed"


class EngineUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "engine_unavailable"


class Overloaded(EngineUnavailable):
    """The server-wide admission limit is reached: refused before any work starts."""

    code = "server_overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
