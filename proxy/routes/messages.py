"""The management API's messages of a conversation: listing them in order, appending them.

Scope `manage`; scoped by the caller's tenant as the conversations are
(proxy/routes/conversations.py).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.public_ids import MESSAGE, PublicIds
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest
from proxy.core.json_responses import json_response
from proxy.core.requests import check_messages, parse_json_object
from proxy.pipeline.turn import TokenCounter
from proxy.pipeline.turn_store import import_messages
from proxy.routes.api_types import AppendMessagesRequest, MessageList
from proxy.routes.conversations import conversation_or_404, not_found, queue_embedding
from proxy.routes.params import limit_param, page
from proxy.routes.reference import api
from proxy.state import AppState
from storage.records import MessageRecord
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures


def message_object(ids: PublicIds, conversation_id: str, m: MessageRecord) -> dict[str, Any]:
    return {
        "id": ids.format(MESSAGE, m.pk),
        "object": "memory.message",
        "conversation_id": conversation_id,
        "seq": m.seq,
        **m.to_openai(),
        "status": m.status,
        "tokens": m.tokens,
        "exchange_id": m.exchange_id,
        "request_id": m.exchange_id,  # (its trace: /v1/memory/exchanges/{id}/trace)
        "created_at": int(m.created_at.timestamp()),
        "metadata": m.meta,
    }


@get(
    "/v1/memory/conversations/{conversation_id:str}/messages",
    summary="List messages in order",
    **api("manage", query=("limit", "after"), ok=MessageList),
)
async def list_messages(
    request: Request[Any, Any, Any],
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    limit = limit_param(request, default=100)
    after = request.query_params.get("after")

    def work(conn: Connection) -> list[MessageRecord]:
        found = conversation_or_404(conn, principal.tenant_id, conversation_id, user=principal.user)
        repo = Conversations(conn)
        after_seq = 0
        if after:
            pk = services.ids.parse(MESSAGE, after)
            seq = None if pk is None else repo.message_seq(principal.tenant_id, found.pk, pk)
            if seq is None:
                raise BadRequest(
                    f"after: no message '{after}' in this conversation.", param="after"
                )
            after_seq = seq
        return repo.messages(principal.tenant_id, found.pk, after_seq=after_seq, limit=limit + 1)

    rows = await services.db.read(work)
    return json_response(
        page([message_object(services.ids, conversation_id, m) for m in rows], limit)
    )


@post(
    "/v1/memory/conversations/{conversation_id:str}/messages",
    summary="Append messages",
    **api("manage", body=AppendMessagesRequest, ok=MessageList, status=201),
)
async def append_messages(
    request: Request[Any, Any, Any],
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body(), ("messages",))
    messages: list[dict[str, Any]] = body.get("messages")  # type: ignore[assignment]
    check_messages(
        messages, imported=True, max_messages=services.config.server.max_request_messages
    )
    count = await TokenCounter("").prepare(messages)

    def work(conn: Connection) -> list[MessageRecord]:
        # As a turn: the user's share of the erasure lock before the conversation's row, so
        # an erasure of the user (which locks their rows, then deletes) never interleaves.
        tenant, user = principal.tenant_id, principal.user
        owner = conversation_or_404(conn, tenant, conversation_id, user=user).user_id
        Erasures(conn).share(principal.tenant_id, owner)
        found = conversation_or_404(conn, principal.tenant_id, conversation_id, for_update=True)
        if found.user_id != owner:  # (deleted and its id given to another user's meanwhile)
            raise not_found(conversation_id)
        updated = import_messages(conn, found, messages, count)
        queue_embedding(conn, services, updated, found.next_seq)
        return Conversations(conn).messages(
            principal.tenant_id, updated.pk, after_seq=found.next_seq - 1, limit=len(messages)
        )

    rows = await services.db.write(work, tenant=principal.tenant_id)
    services.jobs.wake()
    return json_response(
        page([message_object(services.ids, conversation_id, m) for m in rows], len(rows) or 1), 201
    )


ROUTES = [list_messages, append_messages]
