"""What the management API's list routes share: the `limit` and `user` parameters, and
OpenAI's list shape."""

from __future__ import annotations

import re
from typing import Any

from litestar import Request

from proxy.core.errors import BadRequest
from proxy.core.requests import check_user_id

MAX_PAGE = 100


def page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list shape; callers fetch `limit + 1` rows to learn `has_more`."""
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "has_more": len(data) > limit,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
    }


def limit_param(request: Request[Any, Any, Any], default: int = 20) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not re.fullmatch(r"[0-9]{1,4}", raw) or not 1 <= int(raw) <= MAX_PAGE:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_PAGE}.", param="limit")
    return int(raw)


def user_param(value: Any, param: str = "user", *, stored_before: bool = False) -> str:
    """A user id the route is given (`check_user_id`: 400 naming `param` for a bad one)."""
    return check_user_id(value, param, stored_before=stored_before)
