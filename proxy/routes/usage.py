"""Exchange records and spend reports: `/v1/memory/exchanges/{id}` and `/v1/memory/usage`.

Scope `manage`, tenant-scoped like the rest of the management API. An exchange is `final` once
it is no longer `in_progress`: a stream's record is final as soon as the stream ends, with the
usage of its last chunk. Costs the proxy's own model calls add later (intent, extraction,
summaries) appear in `cost.memory_usd` and `cost.parts` when they happen.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, cast, get_args

from litestar import Request, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.pricing import USD_DIGITS
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, NotFound
from proxy.core.json_responses import json_response
from proxy.core.requests import parse_timestamp
from proxy.pipeline.turn import now
from proxy.routes.params import user_param
from proxy.routes.reference import api
from proxy.routes.report_types import Exchange, UsageReport
from proxy.state import AppState
from storage.records import ExchangeRecord, UsageTotals
from storage.repositories.exchanges import Exchanges, GroupBy

DEFAULT_PERIOD = timedelta(days=30)
# Unix seconds (ASCII digits: "²".isdigit() is true); eight digits are an ISO 8601 basic date
# (20261101), as fromisoformat reads them, not a day in 1970-1973.
_SECONDS = re.compile(r"(?![0-9]{8}$)[0-9]{1,12}")
REQUEST_ID_MAX = 64


def _usd(value: float | None) -> float | None:
    return None if value is None else round(value, USD_DIGITS)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def exchange_object(x: ExchangeRecord) -> dict[str, Any]:
    upstream = x.cost_upstream_usd
    return {
        "id": x.request_id,
        "object": "memory.exchange",
        "status": x.status,
        "final": x.status != "in_progress",
        "http_status": x.http_status,
        "user": x.user_id,
        "conversation_id": x.conversation_id,
        "model": x.model,
        "upstream": x.upstream,
        "mode": x.mode,
        "stream": x.stream,
        "intent": x.intent,
        "created_at": int(x.started_at.timestamp()),
        "finished_at": int(x.finished_at.timestamp()) if x.finished_at else None,
        "attached": x.attached,
        "usage": None
        if x.prompt_tokens is None
        else {
            "prompt_tokens": x.prompt_tokens,
            "completion_tokens": x.completion_tokens,
            "total_tokens": x.prompt_tokens + (x.completion_tokens or 0),
            "cached_tokens": x.cached_tokens,
            "reasoning_tokens": x.reasoning_tokens,
            "estimated": x.usage_estimated,
            "reported": None if x.usage_estimated else x.usage,
        },
        "cost": {
            # None while nothing is known yet (in progress, or ended before any usage).
            "priced": None if x.prompt_tokens is None else upstream is not None,
            "usd": None if upstream is None else _usd(upstream + x.cost_memory_usd),
            "upstream_usd": _usd(upstream),
            "memory_usd": _usd(x.cost_memory_usd),
            "parts": x.cost_parts,
        },
        "timings": {
            "latency_ms": _ms(x.latency_ms),
            "ttft_ms": _ms(x.ttft_ms),
            "upstream_ms": _ms(x.upstream_ms),
            "overhead_ms": _ms(x.overhead_ms),
        },
        "error": x.error,
    }


@get(
    "/v1/memory/exchanges/{request_id:str}",
    summary="One exchange: what was attached, usage, cost and timings",
    **api("manage", ok=Exchange),
)
async def get_exchange(
    request_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    await services.deferred.settle()  # mode-off records are written in batches
    found = None
    if len(request_id) <= REQUEST_ID_MAX:
        found = await services.db.read(
            lambda conn: Exchanges(conn).get(principal.tenant_id, request_id)
        )
    if found is None or not principal.sees(found.user_id):
        raise NotFound(f"No exchange found with id '{request_id}'.", code="exchange_not_found")
    return json_response(exchange_object(found))


def _totals(rows: list[UsageTotals]) -> dict[str, Any]:
    upstream = sum(r.cost_upstream_usd for r in rows)
    memory = sum(r.cost_memory_usd for r in rows)
    prompt = sum(r.prompt_tokens for r in rows)
    completion = sum(r.completion_tokens for r in rows)
    return {
        "requests": sum(r.requests for r in rows),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cost_usd": _usd(upstream + memory),
        "cost_upstream_usd": _usd(upstream),
        "cost_memory_usd": _usd(memory),
        "unpriced_requests": sum(r.unpriced_requests for r in rows),
    }


def _period(request: Request[Any, Any, Any]) -> tuple[datetime, datetime]:
    """[from, to) from the query (ISO 8601 or unix seconds); the last 30 days by default."""
    values: dict[str, datetime] = {}
    for name in ("from", "to"):
        raw = request.query_params.get(name)
        if raw is not None:
            value: Any = int(raw) if _SECONDS.fullmatch(raw) else raw
            values[name] = parse_timestamp(value, name)
    end = values.get("to") or now()
    try:
        start = values.get("from") or end - DEFAULT_PERIOD
    except OverflowError:  # (a 'to' in the first days of year 1)
        raise BadRequest("'to' is too early for the 30 days before it.", param="to") from None
    if start >= end:
        raise BadRequest("'from' must be earlier than 'to'.", param="from")
    return start, end


@get(
    "/v1/memory/usage",
    summary="Spend and tokens by model, user, day or intent",
    **api("manage", query=("from", "to", "group_by", "user"), ok=UsageReport),
)
async def get_usage(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    start, end = _period(request)
    group_by = request.query_params.get("group_by")
    if group_by is not None and group_by not in get_args(GroupBy):
        raise BadRequest("group_by must be one of model, user, day, intent.", param="group_by")
    user = request.query_params.get("user")
    if user is not None:
        user_param(user)
    user = principal.only(user)
    await services.deferred.settle()
    key = cast(GroupBy | None, group_by)

    def work(conn: Connection) -> list[UsageTotals]:
        return Exchanges(conn).usage(principal.tenant_id, start, end, key, user)

    rows = await services.db.read(work)
    if group_by == "day":
        rows.sort(key=lambda r: r.key or "")
    data = [{group_by: r.key, **_totals([r])} for r in rows] if group_by else []
    return json_response(
        {
            "object": "memory.usage",
            "from": start.isoformat(),
            "to": end.isoformat(),
            "group_by": group_by,
            "user": user,
            "data": data,
            "total": _totals(rows),
        }
    )


ROUTES = [get_exchange, get_usage]
