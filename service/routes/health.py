"""Liveness, readiness (database at head, broker reachable) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api_schemas.health import Health

from ..db import ensure_migrated
from ..deps import RuntimeDep
from ..errors import ServiceUnavailable, responses

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health(status="ok", checks={"process": "ok"})


@router.get("/readyz", response_model=Health, summary="Database and job broker are usable",
            responses={503: responses(503)[503]})
def readyz(runtime: RuntimeDep) -> Health:
    checks: dict[str, str] = {}
    try:
        with runtime.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        ensure_migrated(runtime.engine)
        checks["database"] = "ok"
    except Exception as exc:
        raise ServiceUnavailable(f"database not ready: {exc}") from None
    try:
        checks["broker"] = runtime.queue.ping()
    except Exception as exc:
        raise ServiceUnavailable(f"job broker not ready: {exc}") from None
    return Health(status="ok", checks=checks)


@router.get(
    "/metrics", response_class=PlainTextResponse, summary="Prometheus metrics",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}, "example":
               "# HELP lsa_jobs Jobs by status\n# TYPE lsa_jobs gauge\n"
               "lsa_jobs{status=\"queued\"} 0.0\n"}}, "description": "Prometheus text format"}},
)
def metrics(request: Request) -> PlainTextResponse:
    registry = request.app.state.metrics.registry
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
