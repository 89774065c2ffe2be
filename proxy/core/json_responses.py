"""JSON responses the proxy builds itself (not relayed from an upstream)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Response


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response[Any]:
    return Response(
        content=msgspec.json.encode(payload),
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )
