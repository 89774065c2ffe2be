"""Operations endpoints: liveness, readiness and Prometheus metrics. No tenant key: they hold
no content, only counts; /metrics can ask for a key of its own (`server.metrics_key`)."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from litestar import Request, Response, get, head
from litestar.di import NamedDependency
from litestar.openapi import ResponseSpec

from proxy.accounting.metrics import CONTENT_TYPE
from proxy.core.errors import AuthenticationFailed
from proxy.routes.report_types import Health
from proxy.state import AppState
from storage.errors import StorageError


@get("/healthz", summary="Liveness")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@head("/healthz", summary="Liveness, without a body (uptime monitors ask with HEAD)")
async def healthz_head() -> None:
    return None


@get(
    "/readyz",
    summary="Readiness: the database answers",
    responses={
        200: ResponseSpec(Health, description="Ready.", generate_examples=False),
        503: ResponseSpec(
            Health, description="The database does not answer.", generate_examples=False
        ),
    },
)
async def readyz(services: NamedDependency[AppState]) -> Response[dict[str, Any]]:
    """503 while the database does not answer. The storage circuit is reported, not judged:
    open, this replica answers degraded at once, as it should; and the replicas of one
    database open theirs together, so a 503 for it would have a load balancer pull them all."""
    status, body = await _readiness(services)
    return Response(body, status_code=status)


@head("/readyz", summary="Readiness, without a body")
async def readyz_head(services: NamedDependency[AppState]) -> Response[None]:
    status, _ = await _readiness(services)
    return Response(None, status_code=status)


async def _spill(services: AppState) -> str:
    """The spill, reported, not judged (like the circuit): `unwritable: <why>` while its disk
    takes no write (full, read-only). Fail-open tenants are still answered then, their turns
    not kept (`x-memory-stored: false`) when the database fails too; a 503 here would take
    away the answers fail-open promises (docs/operations/database-away.md)."""
    try:
        async with asyncio.timeout(services.memory.timeout):  # (a hung disk: bounded too)
            problem = await services.spill.probe()
    except TimeoutError:
        problem = services.spill.unwritable = "its disk did not answer in time"
    services.metrics.spill_writable.set(0 if problem else 1)
    return f"unwritable: {problem}" if problem else "ok"


async def _readiness(services: AppState) -> tuple[int, dict[str, Any]]:
    circuit = services.memory.circuit.state()
    spill = await _spill(services)
    try:
        # Bounded like the request path's storage: a probe must answer, slow database or not.
        async with asyncio.timeout(services.memory.timeout):
            await services.db.ping()
    except TimeoutError:
        database = "timeout"
    except StorageError as exc:
        database = str(exc)[:200]
    else:
        database = "ok"
    body = {"status": "ok", "database": database, "storage_circuit": circuit, "spill": spill}
    if database != "ok":
        return 503, {**body, "status": "unavailable"}
    embeddings = services.embeddings.status()
    if embeddings is not None:  # reported, not judged: without it recall goes on by keywords
        body["embeddings"] = embeddings
    return 200, body


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
    services.metrics.spill_writable.set(0 if services.spill.unwritable else 1)
    return Response(services.metrics.exposition(), media_type=CONTENT_TYPE)
