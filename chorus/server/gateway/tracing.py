"""OpenTelemetry traces, configured by OpenTelemetry's own environment variables and off unless they ask for them.

``OTEL_TRACES_EXPORTER`` names the exporters (``console``, ``otlp``; comma-separated; ``none`` or unset: tracing
off, and every span in chorus is OpenTelemetry's no-op). ``otlp`` sends OTLP over HTTP/protobuf to
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporter reads them itself), batched;
``console`` prints each span as JSON as it ends. ``OTEL_SERVICE_NAME`` names the service (default ``chorus``),
``OTEL_RESOURCE_ATTRIBUTES`` adds to it, ``OTEL_SDK_DISABLED=true`` turns it all off. With tracing on, FastAPI's
native telemetry makes a server span per request (a client's W3C ``traceparent`` is its parent), chorus adds the
GenAI attributes to it and the ensembles' spans under it (ensembles/spans.py). The SDK and the exporter are the
``otel`` extra: `pip install 'chorus[otel]'`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace

from chorus.errors import ConfigError

EXPORTERS = ("console", "otlp")
_provider: Any = None  # the one SDK provider of this process (OpenTelemetry allows one global provider)


def exporters(env: Mapping[str, str]) -> list[str]:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return []
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not served (chorus has: "
                          f"{', '.join(EXPORTERS)}, none)")
    return names


def configure(env: Mapping[str, str] | None = None) -> bool:
    """Install the SDK's tracer provider when the environment asks for traces; whether tracing is on."""
    global _provider
    names = exporters(os.environ if env is None else env)
    if not names:
        return _provider is not None
    if _provider is not None:
        return True
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError as exc:
        raise ConfigError("OTEL_TRACES_EXPORTER is set but the OpenTelemetry SDK is not installed: "
                          "pip install 'chorus[otel]'") from exc
    attrs = {} if (env or os.environ).get("OTEL_SERVICE_NAME") else {"service.name": "chorus"}
    provider = TracerProvider(resource=Resource.create(attrs))
    for name in names:
        if name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def flush() -> None:
    """Export what is still batched (at shutdown)."""
    if _provider is not None:
        _provider.force_flush()


def request_attributes(request_id: str, model: str, max_tokens: int | None, temperature: float | None,
                       operation: str = "chat") -> None:
    """The GenAI attributes of the request's own span (FastAPI's server span), when tracing is on."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({k: v for k, v in {
            "gen_ai.operation.name": operation, "gen_ai.request.model": model, "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature, "chorus.request_id": request_id or None}.items()
            if v is not None})


def usage_attributes(usage: Mapping[str, Any]) -> None:
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"gen_ai.usage.input_tokens": int(usage.get("prompt_tokens", 0)),
                             "gen_ai.usage.output_tokens": int(usage.get("completion_tokens", 0))})
