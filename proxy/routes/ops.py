"""Operations endpoints: liveness and readiness."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency

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
