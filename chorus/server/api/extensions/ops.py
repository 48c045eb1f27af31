"""The gateway's own operations endpoints: ``/health`` (liveness, load, draining) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from chorus.server.gateway.context import Ctx

router = APIRouter()


@router.get("/health", response_model=None)
async def health(ctx: Ctx) -> dict[str, Any] | JSONResponse:
    services = ctx.services
    body = {"status": "ok", "models": {n: e.stats() for n, e in services.engines.items()},
            "ensembles": sorted(services.ensembles), "inflight": services.admission.inflight}
    if services.admission.draining:  # load balancers stop sending; in-flight requests finish
        return JSONResponse({**body, "status": "draining"}, status_code=503)
    return body


@router.get("/metrics")
async def metrics() -> Response:
    """Prometheus exposition: requests, tokens, engines, ensembles, router decisions, cascade steps."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
