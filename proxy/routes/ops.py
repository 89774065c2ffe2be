"""Operations endpoints: liveness, readiness and Prometheus metrics. No tenant key: they hold
no content, only counts; /metrics can ask for a key of its own (`server.metrics_key`)."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency

from proxy.errors import AuthenticationFailed
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


@get("/metrics", summary="Prometheus metrics")
async def metrics(
    request: Request[Any, Any, Any], services: NamedDependency[AppState]
) -> Response[bytes]:
    key = services.config.server.metrics_key
    if key is not None:
        given = request.headers.get("authorization", "")
        expected = f"Bearer {key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise AuthenticationFailed(
                "GET /metrics needs 'Authorization: Bearer <server.metrics_key>'."
            )
    return Response(services.metrics.exposition(), media_type=CONTENT_TYPE)
