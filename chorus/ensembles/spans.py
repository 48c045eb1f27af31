"""OpenTelemetry spans of an ensemble's fan-out: one per member call (GenAI semantic conventions) and one per step
of a strategy (an Exchange-of-Thought round, a mixture-of-agents layer and judge, a vote's sample batch, a cascade
step). Through OpenTelemetry's API only: without a configured SDK (server/gateway/tracing.py) every span is a no-op."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry import trace

from chorus.engines.core.request_scope import RequestScope

TRACER = trace.get_tracer("chorus.ensembles")
T = TypeVar("T")


def attributes(scope: RequestScope, **fields: Any) -> dict[str, Any]:
    """The span attributes given (None left out), with the request's id (X-Request-ID) from its scope."""
    out = {k.replace("__", "."): v for k, v in fields.items() if v is not None}
    if scope.request_id:
        out["chorus.request_id"] = scope.request_id
    return out


def member_call(scope: RequestScope, ensemble: str, label: str, model: str, max_tokens: int | None,
                temperature: float | None) -> Any:
    """A span for one member call (started, not current: the caller ends it)."""
    return TRACER.start_span(f"chat {model}", kind=trace.SpanKind.CLIENT, attributes=attributes(
        scope, gen_ai__operation__name="chat", gen_ai__request__model=model, gen_ai__request__max_tokens=max_tokens,
        gen_ai__request__temperature=temperature, chorus__ensemble=ensemble or None, chorus__member=label))


def usage(span: Any, prompt_tokens: int, completion_tokens: int) -> None:
    span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)


@contextmanager
def step(name: str, scope: RequestScope, **fields: Any) -> Iterator[Any]:
    """A strategy's step as the current span (its member calls are its children). Never around a ``yield`` of an
    async generator: a span must end in the context it started in."""
    with TRACER.start_as_current_span(name, attributes=attributes(scope, **fields)) as span:
        yield span


def started(name: str, scope: RequestScope, **fields: Any) -> Any:
    """A step's span, started but not current (for a step that streams: see `under`); the caller ends it."""
    return TRACER.start_span(name, attributes=attributes(scope, **fields))


def within(span: Any) -> Any:
    """``span`` as the current span for a block (the caller records errors and ends it)."""
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


async def under(span: Any, items: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """``items`` with each step run inside ``span`` (the spans it starts are its children), the context never held
    across a ``yield``; closing this closes ``items``."""
    try:
        while True:
            with within(span):
                try:
                    item = await anext(items)
                except StopAsyncIteration:
                    return
            yield item
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
