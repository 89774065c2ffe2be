"""The management API's conversations: /v1/memory/conversations and one by id.

Scope `manage`; every read and write is scoped by the caller's tenant, and an id that belongs
to another tenant looks exactly like one that does not exist (404); so does another user's, for
a key or token bound to one user (docs/concepts/trust-model.md), which lists only its own.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.jobs import conversation_subject
from proxy.background.embedding_jobs import queue_range
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, Conflict, NotFound
from proxy.core.json_responses import json_response
from proxy.core.requests import check_messages, parse_json_object
from proxy.pipeline.identify import CONVERSATION_ID
from proxy.pipeline.turn import ANONYMOUS, TokenCounter, new_conversation_id, now
from proxy.pipeline.turn_store import import_messages
from proxy.routes.api_types import (
    Conversation,
    ConversationList,
    CreateConversationRequest,
    Deleted,
    UpdateConversationRequest,
)
from proxy.routes.params import limit_param, page, user_param
from proxy.routes.reference import api
from proxy.state import AppState
from storage.errors import ConflictError
from storage.records import ConversationRecord
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures


def conversation_object(c: ConversationRecord) -> dict[str, Any]:
    return {
        "id": c.id,
        "object": "memory.conversation",
        "user": c.user_id,
        "title": c.title,
        "archived": c.archived,
        "message_count": c.chain_count,
        "created_at": int(c.created_at.timestamp()),
        "updated_at": int(c.updated_at.timestamp()),
        "metadata": c.meta,
    }


def not_found(conversation_id: str) -> NotFound:
    return NotFound(
        f"No conversation found with id '{conversation_id}'.", code="conversation_not_found"
    )


def conversation_or_404(
    conn: Connection,
    tenant_id: str,
    conversation_id: str,
    *,
    for_update: bool = False,
    user: str | None = None,
) -> ConversationRecord:
    """The tenant's conversation (of `user` only, when given), else a 404."""
    found = Conversations(conn).get(tenant_id, conversation_id, for_update=for_update)
    if found is None or (user is not None and found.user_id != user):
        raise not_found(conversation_id)
    return found


def queue_embedding(
    conn: Connection, services: AppState, conversation: ConversationRecord, first_seq: int
) -> None:
    """Imported messages are embedded too (a background job), when the tenant has
    embeddings on and the user is named."""
    if services.embeddings.wanted(conversation.tenant_id, conversation.user_id, "full", ANONYMOUS):
        queue_range(
            conn,
            conversation.tenant_id,
            conversation.user_id,
            conversation.pk,
            first_seq,
            conversation.next_seq - 1,
            subject=conversation_subject(conversation.id, conversation.created_at),
            now=now(),
        )


@get(
    "/v1/memory/conversations",
    summary="List a user's conversations, newest first",
    **api("manage", query=("user", "limit", "after"), ok=ConversationList),
)
async def list_conversations(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    user = request.query_params.get("user")
    if user is not None:
        user_param(user)
    user = principal.only(user)
    limit = limit_param(request)
    after = request.query_params.get("after")

    def work(conn: Connection) -> list[ConversationRecord]:
        repo = Conversations(conn)
        cursor = repo.get(principal.tenant_id, after) if after else None
        if after and (cursor is None or not principal.sees(cursor.user_id)):
            raise BadRequest(f"after: no conversation '{after}'.", param="after")
        return repo.list(principal.tenant_id, user, after=cursor, limit=limit + 1)

    rows = await services.db.read(work)
    return json_response(page([conversation_object(c) for c in rows], limit))


@post(
    "/v1/memory/conversations",
    summary="Create a conversation, optionally importing messages",
    **api(
        "manage",
        body=CreateConversationRequest,
        ok=Conversation,
        status=201,
        errors=(400, 401, 403, 409, 429, 503),
    ),
)
async def create_conversation(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body(), ("id", "user", "title", "messages"))
    user = user_param(principal.only(body.get("user")))
    conversation_id = body.get("id")
    if conversation_id is not None and (
        not isinstance(conversation_id, str) or not CONVERSATION_ID.fullmatch(conversation_id)
    ):
        raise BadRequest("id must be 1-128 characters of A-Z a-z 0-9 . _ : -", param="id")
    title = body.get("title")
    if title is not None and (not isinstance(title, str) or len(title) > 512):
        raise BadRequest("title must be a string of at most 512 characters.", param="title")
    messages = body.get("messages")
    if messages is not None:
        check_messages(
            messages, imported=True, max_messages=services.config.server.max_request_messages
        )
    count = await TokenCounter("").prepare(messages or [])

    def work(conn: Connection) -> ConversationRecord:
        Erasures(conn).share(principal.tenant_id, user)  # (wholly before an erasure, or after)
        created = Conversations(conn).create(
            principal.tenant_id,
            user,
            conversation_id or new_conversation_id(),
            now=now(),
            title=title,
        )
        if messages:
            created = import_messages(conn, created, messages, count)
            queue_embedding(conn, services, created, 1)
        return created

    try:
        created = await services.db.write(work, tenant=principal.tenant_id)
    except ConflictError:
        raise Conflict(
            f"A conversation with id '{conversation_id}' already exists.",
            param="id",
            code="conversation_exists",
        ) from None
    if messages:
        services.jobs.wake()  # (an embedding job, when the tenant has embeddings on)
    return json_response(conversation_object(created), 201)


@get(
    "/v1/memory/conversations/{conversation_id:str}",
    summary="Get a conversation",
    **api("manage", ok=Conversation),
)
async def get_conversation(
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    found = await services.db.read(
        lambda conn: conversation_or_404(
            conn, principal.tenant_id, conversation_id, user=principal.user
        )
    )
    return json_response(conversation_object(found))


@patch(
    "/v1/memory/conversations/{conversation_id:str}",
    summary="Rename or archive a conversation",
    **api("manage", body=UpdateConversationRequest, ok=Conversation),
)
async def update_conversation(
    request: Request[Any, Any, Any],
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body(), ("title", "archived", "metadata"))
    changes: dict[str, Any] = {}
    if "title" in body:
        if body["title"] is not None and (
            not isinstance(body["title"], str) or len(body["title"]) > 512
        ):
            raise BadRequest("title must be a string of at most 512 characters.", param="title")
        changes["title"] = body["title"]
    if "archived" in body:
        if not isinstance(body["archived"], bool):
            raise BadRequest("archived must be a boolean.", param="archived")
        changes["archived"] = body["archived"]
    if "metadata" in body:
        if not isinstance(body["metadata"], dict):
            raise BadRequest("metadata must be an object.", param="metadata")
        changes["meta"] = body["metadata"]

    def work(conn: Connection) -> ConversationRecord | None:
        conversation_or_404(
            conn, principal.tenant_id, conversation_id, for_update=True, user=principal.user
        )
        return Conversations(conn).update(
            principal.tenant_id, conversation_id, now=now(), **changes
        )

    updated = await services.db.write(work)
    assert updated is not None
    return json_response(conversation_object(updated))


@delete(
    "/v1/memory/conversations/{conversation_id:str}",
    status_code=200,
    summary="Delete a conversation",
    **api("manage", ok=Deleted),
)
async def delete_conversation(
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    def work(conn: Connection) -> bool:
        if principal.user is not None:
            conversation_or_404(
                conn, principal.tenant_id, conversation_id, for_update=True, user=principal.user
            )
        return Conversations(conn).delete(principal.tenant_id, conversation_id)

    if not await services.db.write(work):
        raise not_found(conversation_id)
    return json_response(
        {"id": conversation_id, "object": "memory.conversation.deleted", "deleted": True}
    )


ROUTES = [
    list_conversations,
    create_conversation,
    get_conversation,
    update_conversation,
    delete_conversation,
]
