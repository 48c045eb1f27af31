"""Every error chorus raises on purpose: the one exception tree (the bottom layer; anything may import it).

A `GatewayError` carries its HTTP status and OpenAI error type; the server turns it into the OpenAI
error envelope in one place (``chorus.server.gateway.errors.error_response``). `ConfigError` and
`BuildError` stop a command before it serves (``chorus serve`` exits with the message; a model that
cannot be prepared while serving becomes `EngineUnavailable`)::

    ChorusError
     ├── GatewayError                   500 server_error
     │    ├── InvalidRequest            400 invalid_request_error   (param names the field)
     │    │    ├── ContextLengthExceeded  400 code=context_length_exceeded
     │    │    └── CapabilityMismatch     400 code=capability_mismatch
     │    ├── AuthenticationFailed      401 authentication_error
     │    ├── PermissionDenied          403 permission_error        (the key may not use that model)
     │    ├── ModelNotFound             404 code=model_not_found
     │    ├── SessionNotFound           404 code=session_not_found  (session API: unknown or reaped id)
     │    ├── ResponseNotFound          404 code=response_not_found (/v1/responses: not stored, or dropped)
     │    ├── RequestNotFound           404 code=request_not_found  (/v1/feedback: unknown or expired id)
     │    ├── SessionBusy               409 code=session_busy       (session API: a step is in flight)
     │    ├── BodyTimeout               408 code=request_timeout    (the body did not arrive in body_timeout_s)
     │    ├── FeedbackExists            409 code=feedback_exists    (/v1/feedback: that metric already given)
     │    ├── RequestTooLarge           413 code=request_too_large
     │    ├── RateLimited               429 rate_limit_exceeded     (retry_after: seconds; code=budget_exceeded)
     │    ├── ClientClosedRequest       499 client_closed_request   (nobody reads it: the client left)
     │    ├── EngineFailed              500 server_error
     │    │    └── MemberFailed         502 code=member_failed      (an ensemble member failed)
     │    ├── EngineUnavailable         503 code=engine_unavailable
     │    │    ├── Overloaded           503 code=server_overloaded  (admission limit; retry_after)
     │    │    └── StoreUnavailable     503 code=state_store_unavailable (Redis down, fail_closed; retry_after)
     │    └── DeadlineExceeded          504 code=deadline_exceeded
     ├── ConfigError                    the config file is invalid (start-up)
     └── BuildError                     a checkpoint cannot be built from this input
"""

from __future__ import annotations


class ChorusError(Exception):
    """The root of every error chorus raises on purpose."""


class ConfigError(ChorusError):
    """The config file (or an environment override) is invalid; the message names the key."""


class BuildError(ChorusError):
    """A checkpoint cannot be built from this input (the message says why and what to change)."""


class GatewayError(ChorusError):
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


class SessionNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "session_not_found"


class ResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class RequestNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "request_not_found"


class NotFound(GatewayError):
    """A file or batch that does not exist, or belongs to another key (the same answer: ids are not probes)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class FeedbackExists(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "feedback_exists"


class SessionBusy(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "session_busy"


class ClientClosedRequest(GatewayError):
    """The client went away before the response (nginx's 499); nobody reads this response."""

    status = 499
    type = "client_closed_request"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class BodyTimeout(GatewayError):
    """The request's body did not arrive within ``server.limits.body_timeout_s`` (a slow or stalled client)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: str | None) -> None:
        super().__init__(message, **kw)
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


class StoreUnavailable(Overloaded):
    """The shared state store (Redis) cannot be reached and the deployment fails closed."""

    code = "state_store_unavailable"
