"""Operations endpoints: liveness, readiness and Prometheus metrics (no key needed: they hold
no tenant content, only counts)."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency

from proxy.metrics import CONTENT_TYPE
from proxy.state import AppState
from storage.errors import StorageError


@get("/healthz", summary="Liveness")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: the database answers")
async def readyz(services: NamedDependency[AppState]) -> Response[dict[str, Any]]:
    try:
        await services.db.ping()
    except StorageError as exc:
        return Response({"status": "unavailable", "database": str(exc)[:200]}, status_code=503)
    return Response({"status": "ok", "database": "ok"})


@get("/metrics", summary="Prometheus metrics", include_in_schema=True)
async def metrics(services: NamedDependency[AppState]) -> Response[bytes]:
    return Response(services.metrics.exposition(), media_type=CONTENT_TYPE)
