"""What the model saw and why: `GET /v1/memory/exchanges/{request_id}/trace`, and the messages
a trace names, `GET /v1/memory/messages/{id}` (docs/reference/trace.md).

Scope `manage`, tenant-scoped like the rest of the management API; a key or token bound to a
user sees that user's only. Another tenant's or user's id is a 404, as an unknown one is.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.public_ids import MESSAGE, PublicIds
from policies.trace import with_public_ids
from proxy.core.auth import Principal
from proxy.core.errors import NotFound
from proxy.core.json_responses import json_response
from proxy.routes.api_types import MemoryTrace, StoredMessage
from proxy.routes.messages import message_object
from proxy.routes.reference import api
from proxy.routes.usage import REQUEST_ID_MAX, exchange_object
from proxy.state import AppState
from storage.records import ExchangeRecord, MessageRecord
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.traces import TraceRecord, Traces

# The trace's own keys shown as they are stored (the rest comes from the exchange's record).
TRACE_KEYS = ("budget", "context", "sections", "recall", "intent", "timings", "degraded")


def trace_object(ids: PublicIds, exchange: ExchangeRecord, found: TraceRecord) -> dict[str, Any]:
    """The trace as the API shows it: what the pipeline recorded (messages by their public
    ids), with the exchange's usage and cost as they are now (the proxy's own calls may have
    added to them since)."""
    trace = with_public_ids(found.trace, partial(ids.format, MESSAGE))
    record = exchange_object(exchange)
    intent = trace.get("intent")
    if intent is not None and exchange.intent_detail not in (None, {}):
        final = exchange.intent_detail
        if final is not None and final.get("label") != intent.get("label"):
            intent = {**intent, "final": final}  # (the LLM's label, arrived later)
    return {
        "id": exchange.request_id,
        "object": "memory.exchange.trace",
        "level": found.level,
        "truncated": found.truncated or False,
        "bytes": found.size,
        "user": exchange.user_id,
        "conversation_id": exchange.conversation_id,
        "model": exchange.model,
        "mode": exchange.mode,
        "status": exchange.status,
        "created_at": record["created_at"],
        **{key: trace.get(key) for key in TRACE_KEYS},
        "intent": intent,
        "timings": {**(trace.get("timings") or {}), **record["timings"]},
        "degraded": trace.get("degraded") or [],
        "usage": record["usage"],
        "cost": record["cost"],
    }


def stored_trace_object(ids: PublicIds, found: TraceRecord) -> dict[str, Any]:
    """A trace as a user's export shows it: as recorded (the exchange is beside it)."""
    return {
        "id": found.request_id,
        "object": "memory.exchange.trace",
        "level": found.level,
        "truncated": found.truncated or False,
        "bytes": found.size,
        **with_public_ids(found.trace, partial(ids.format, MESSAGE)),
    }


@get(
    "/v1/memory/exchanges/{request_id:str}/trace",
    summary="What the model saw and why: one exchange's trace",
    **api("manage", ok=MemoryTrace),
)
async def get_trace(
    request_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    await services.deferred.settle()  # mode-off records are written in batches

    def work(conn: Connection) -> tuple[ExchangeRecord | None, TraceRecord | None]:
        exchange = Exchanges(conn).get(principal.tenant_id, request_id)
        if exchange is None or not principal.sees(exchange.user_id):
            return None, None
        return exchange, Traces(conn).get(principal.tenant_id, request_id)

    exchange = trace = None
    if len(request_id) <= REQUEST_ID_MAX:
        exchange, trace = await services.db.read(work)
    if exchange is None:
        raise NotFound(f"No exchange found with id '{request_id}'.", code="exchange_not_found")
    if trace is None:
        raise NotFound(
            f"No trace was recorded for exchange '{request_id}': its tenant's `trace` setting "
            "was off, or it has not ended yet.",
            code="trace_not_found",
        )
    return json_response(trace_object(services.ids, exchange, trace))


@get(
    "/v1/memory/messages/{message_id:str}",
    summary="One stored message, by its id",
    **api("manage", ok=StoredMessage),
)
async def get_message(
    message_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    message, conversation_id = await find_message(services, principal, message_id)
    return json_response(message_object(services.ids, conversation_id, message))


async def find_message(
    services: AppState, principal: Principal, message_id: str
) -> tuple[MessageRecord, str]:
    """The tenant's message `message_id` and its conversation's id, if the caller sees its
    user; else a 404 (an id that is not one: the same)."""
    pk = services.ids.parse(MESSAGE, message_id)

    def work(conn: Connection) -> tuple[MessageRecord, str, str] | None:
        assert pk is not None
        return Conversations(conn).message(principal.tenant_id, pk)

    found = await services.db.read(work) if pk is not None else None
    if found is None or not principal.sees(found[2]):
        raise NotFound(f"No message found with id '{message_id}'.", code="message_not_found")
    return found[0], found[1]


ROUTES = [get_trace, get_message]
