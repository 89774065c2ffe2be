"""The management API under /v1/memory/: conversations, their messages, erasing a user.

Scope `manage`; every read and write is scoped by the caller's tenant, and an id that belongs
to another tenant looks exactly like one that does not exist (404).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import structlog
from litestar import Request, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from proxy.background.embedding_jobs import queue_range
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, Conflict, NotFound
from proxy.core.json_responses import json_response
from proxy.core.requests import check_messages, parse_json_object
from proxy.core.user_paths import user_in_path
from proxy.pipeline.identify import CONVERSATION_ID
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.turn import ANONYMOUS, TokenCounter, new_conversation_id, now
from proxy.routes.api_types import (
    AppendMessagesRequest,
    Conversation,
    ConversationList,
    CreateConversationRequest,
    Deleted,
    MessageList,
    UpdateConversationRequest,
    UserDeleted,
)
from proxy.routes.reference import api
from proxy.state import AppState
from storage.errors import ConflictError
from storage.records import ConversationRecord, MessageRecord
from storage.repositories.attachments import Attachments
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.responses import Responses
from storage.repositories.summaries import Summaries
from storage.repositories.system import SystemRepository
from storage.repositories.vectors import MessageVectors

log = structlog.get_logger("memproxy.memory")

MAX_PAGE = 100


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


def message_object(conversation_id: str, m: MessageRecord) -> dict[str, Any]:
    return {
        "id": f"msg_{m.pk}",
        "object": "memory.message",
        "conversation_id": conversation_id,
        "seq": m.seq,
        **m.to_openai(),
        "status": m.status,
        "tokens": m.tokens,
        "exchange_id": m.exchange_id,
        "created_at": int(m.created_at.timestamp()),
        "metadata": m.meta,
    }


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


def user_param(value: Any, param: str = "user") -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 256:
        raise BadRequest(
            f"'{param}' must be a non-empty string of at most 256 characters.", param=param
        )
    return value


def _not_found(conversation_id: str) -> NotFound:
    return NotFound(
        f"No conversation found with id '{conversation_id}'.", code="conversation_not_found"
    )


def _conversation(
    conn: Connection, tenant_id: str, conversation_id: str, *, for_update: bool = False
) -> ConversationRecord:
    found = Conversations(conn).get(tenant_id, conversation_id, for_update=for_update)
    if found is None:
        raise _not_found(conversation_id)
    return found


def _queue_embedding(
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
    limit = limit_param(request)
    after = request.query_params.get("after")

    def work(conn: Connection) -> list[ConversationRecord]:
        repo = Conversations(conn)
        cursor = repo.get(principal.tenant_id, after) if after else None
        if after and cursor is None:
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
    user = user_param(body.get("user"))
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
        check_messages(messages, imported=True)
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
            created = ConversationMemory.import_messages(conn, created, messages, count)
            _queue_embedding(conn, services, created, 1)
        return created

    try:
        created = await services.db.write(work)
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
        lambda conn: _conversation(conn, principal.tenant_id, conversation_id)
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
        _conversation(conn, principal.tenant_id, conversation_id, for_update=True)
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
        return Conversations(conn).delete(principal.tenant_id, conversation_id)

    if not await services.db.write(work):
        raise _not_found(conversation_id)
    return json_response(
        {"id": conversation_id, "object": "memory.conversation.deleted", "deleted": True}
    )


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
        found = _conversation(conn, principal.tenant_id, conversation_id)
        repo = Conversations(conn)
        after_seq = 0
        if after:
            pk = after.removeprefix("msg_")
            valid = re.fullmatch(r"[0-9]{1,18}", pk)
            seq = repo.message_seq(principal.tenant_id, found.pk, int(pk)) if valid else None
            if seq is None:
                raise BadRequest(
                    f"after: no message '{after}' in this conversation.", param="after"
                )
            after_seq = seq
        return repo.messages(principal.tenant_id, found.pk, after_seq=after_seq, limit=limit + 1)

    rows = await services.db.read(work)
    return json_response(page([message_object(conversation_id, m) for m in rows], limit))


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
    check_messages(messages, imported=True)
    count = await TokenCounter("").prepare(messages)

    def work(conn: Connection) -> list[MessageRecord]:
        # As a turn: the user's share of the erasure lock before the conversation's row, so
        # an erasure of the user (which locks their rows, then deletes) never interleaves.
        owner = _conversation(conn, principal.tenant_id, conversation_id).user_id
        Erasures(conn).share(principal.tenant_id, owner)
        found = _conversation(conn, principal.tenant_id, conversation_id, for_update=True)
        if found.user_id != owner:  # (deleted and its id given to another user's meanwhile)
            raise _not_found(conversation_id)
        updated = ConversationMemory.import_messages(conn, found, messages, count)
        _queue_embedding(conn, services, updated, found.next_seq)
        return Conversations(conn).messages(
            principal.tenant_id, updated.pk, after_seq=found.next_seq - 1, limit=len(messages)
        )

    rows = await services.db.write(work)
    services.jobs.wake()
    return json_response(
        page([message_object(conversation_id, m) for m in rows], len(rows) or 1), 201
    )


@delete(
    "/v1/memory/users/{user_id:str}",
    status_code=200,
    summary="Erase everything stored for a user",
    **api("manage", ok=UserDeleted),
)
async def delete_user(
    user_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    user_id = user_param(user_in_path(user_id), "user_id")
    await services.deferred.settle()  # mode-off records still in the batch go too

    counts = await services.db.write(
        partial(erase_user, tenant_id=principal.tenant_id, user_id=user_id)
    )
    if not await services.db.checkpoint():  # (nor an earlier copy in SQLite's log)
        log.info("erasure_log_kept", reason="a reader or the file busy; emptied as writes go on")
    counts["spilled"] = await services.spill.forget(principal.tenant_id, user_id)
    if services.vectors is not None:
        services.vectors.forget(principal.tenant_id, user_id)
    return json_response({"object": "memory.user.deleted", "user": user_id, "deleted": counts})


def erase_user(conn: Connection, tenant_id: str, user_id: str) -> dict[str, int]:
    """Everything stored for the user deleted, in the caller's transaction; how much of each.

    Locks in the order the writers take them, so that none waits for another in a cycle:
    the user's erasure lock (turns share it), their jobs (a job being applied holds its row,
    then its conversation's), their conversations' rows (a message import holds one, then the
    user's word counts; retention holds one, then its vectors and attachments), then the rest.
    """
    # Turns of this user waiting in a replica's spill are not written back after this.
    erasures = Erasures(conn)
    erasures.lock(tenant_id, user_id)
    erasures.record(tenant_id, user_id, now())
    # Jobs first: one being applied holds its row, so this waits for it to commit and the
    # deletes below take what it wrote (a later one finds its job gone).
    jobs = Jobs(conn).delete_user(tenant_id, user_id)
    conversations = Conversations(conn)
    conversations.lock(tenant_id, user_id=user_id)
    vectors = MessageVectors(conn).delete_user(tenant_id, user_id)
    attachments = Attachments(conn).delete_user(tenant_id, user_id)
    counts = conversations.delete_user(tenant_id, user_id)
    SystemRepository(conn).drop_deleted_from_search()  # (nor their words in the indexes)
    return {
        **counts,
        "attachments": attachments,
        "memories": Memories(conn).delete_user(tenant_id, user_id),
        "responses": Responses(conn).delete_user(tenant_id, user_id),
        "jobs": jobs,
        "summaries": Summaries(conn).delete_user(tenant_id, user_id),
        "vectors": vectors,
    }


ROUTES = [
    list_conversations,
    create_conversation,
    get_conversation,
    update_conversation,
    delete_conversation,
    list_messages,
    append_messages,
    delete_user,
]
