"""GET /v1/memory/limits: the caller's tenant limits and how much of each is used."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency

from proxy.core.auth import Principal
from proxy.core.json_responses import json_response
from proxy.routes.reference import api
from proxy.routes.report_types import Limits
from proxy.state import AppState


@get(
    "/v1/memory/limits",
    summary="The tenant's limits and their current usage",
    **api("manage", ok=Limits, errors=(401, 403, 429, 503)),
)
async def get_limits(
    principal: NamedDependency[Principal], services: NamedDependency[AppState]
) -> Response[Any]:
    """Usage as this replica sees it: the shared totals of its last sync (`synced_at`) plus
    what it counted since; other replicas' newest requests may not be in it yet."""
    principal.whole_tenant()  # (403 for a key or token bound to one user)
    view = services.limits.view(principal.tenant_id)
    return json_response(
        {
            "object": "memory.limits",
            "limits": view.limits.model_dump(),
            "usage": {
                u.limit: {
                    "limit": u.value,
                    "used": u.used,
                    "remaining": u.remaining,
                    "window": u.window,
                    "resets_at": int(u.resets_at),
                }
                for u in view.usage
            },
            "synced_at": view.synced_at,
            "sync_interval_seconds": view.interval,
        }
    )
