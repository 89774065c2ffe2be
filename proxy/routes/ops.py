"""Operations endpoints: liveness and readiness."""

from __future__ import annotations

from typing import Any

from litestar import get


@get("/healthz", summary="Liveness")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness")
async def readyz() -> dict[str, Any]:
    return {"status": "ok"}
