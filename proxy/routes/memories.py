"""`/v1/memory/memories`: the facts and preferences kept about a user, which they can list,
search, create, correct, pin and delete. Scope `manage`, tenant-scoped; another tenant's id is
404 like an unknown one, and so is another user's when `?user=` names the user acting.
Pinned memories are attached to every turn of their user. A memory created, or its text
edited, is embedded by a background job when the tenant has embeddings on."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.recall import query_terms
from proxy.background.embedding_items import queue_memories
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, NotFound
from proxy.core.json_responses import json_response
from proxy.core.requests import parse_json_object
from proxy.pipeline.turn import ANONYMOUS, now
from proxy.routes.api_types import (
    CreateMemoryRequest,
    Deleted,
    Memory,
    MemoryList,
    UpdateMemoryRequest,
)
from proxy.routes.params import limit_param, page, user_param
from proxy.routes.reference import api
from proxy.state import AppState
from storage.records import MemoryRecord
from storage.repositories.erasures import Erasures
from storage.repositories.memories import Memories, new_memory_id

MAX_TEXT = 4_000
KINDS_PATTERN = "fact, preference, or any name of at most 32 characters"


def memory_object(m: MemoryRecord) -> dict[str, Any]:
    return {
        "id": m.id,
        "object": "memory.memory",
        "user": m.user_id,
        "kind": m.kind,
        "text": m.text,
        "pinned": m.pinned,
        "confidence": m.confidence,
        "source_exchange_id": m.source_exchange_id,
        "access_count": m.access_count,
        "created_at": int(m.created_at.timestamp()),
        "updated_at": int(m.updated_at.timestamp()),
        "last_used_at": int(m.last_used_at.timestamp()) if m.last_used_at else None,
    }


def _not_found(memory_id: str) -> NotFound:
    return NotFound(f"No memory found with id '{memory_id}'.", code="memory_not_found")


# What a memory's body may hold (and, to create one, its "user").
FIELDS = ("text", "kind", "pinned", "confidence")


def memory_fields(body: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    """The writable fields of a body (`FIELDS`), checked."""
    fields: dict[str, Any] = {}
    if "text" in body or creating:
        text = body.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT:
            raise BadRequest(
                f"'text' must be a non-empty string of at most {MAX_TEXT} characters.",
                param="text",
            )
        fields["text"] = text.strip()
    if "kind" in body:
        kind = body["kind"]
        if not isinstance(kind, str) or not kind.strip() or len(kind) > 32:
            raise BadRequest(f"'kind' must be {KINDS_PATTERN}.", param="kind")
        fields["kind"] = kind.strip()
    if "pinned" in body:
        if not isinstance(body["pinned"], bool):
            raise BadRequest("'pinned' must be a boolean.", param="pinned")
        fields["pinned"] = body["pinned"]
    if "confidence" in body:
        value = body["confidence"]
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1
        ):
            raise BadRequest(
                "'confidence' must be a number from 0 to 1, or null.", param="confidence"
            )
        fields["confidence"] = value
    return fields


@get(
    "/v1/memory/memories",
    summary="List or search a user's memories",
    **api("manage", query=("user", "limit", "pinned", "q", "after"), ok=MemoryList),
)
async def list_memories(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    params = request.query_params
    user = params.get("user")
    if user is not None:
        user_param(user)
    user = principal.only(user)
    limit = limit_param(request)
    pinned_param = params.get("pinned")
    if pinned_param not in (None, "true", "false"):
        raise BadRequest("'pinned' must be true or false.", param="pinned")
    pinned = None if pinned_param is None else pinned_param == "true"
    query = params.get("q")
    if query is not None and not query.strip():
        raise BadRequest("'q' is empty: leave it out to list every memory.", param="q")
    terms = query_terms(query) if query else []
    if query is not None and not terms:
        # Only words too common to search by ("what", "the"): nothing matches them.
        return json_response(page([], limit))
    after_id = params.get("after")

    def work(conn: Connection) -> list[MemoryRecord]:
        repo = Memories(conn)
        after = repo.get(principal.tenant_id, after_id, principal.user) if after_id else None
        if after_id and after is None:
            raise BadRequest(f"after: no memory '{after_id}'.", param="after")
        return repo.find(
            principal.tenant_id, user, limit=limit + 1, after=after, pinned=pinned, terms=terms
        )

    found = await services.db.read(work)
    return json_response(page([memory_object(m) for m in found], limit))


@post(
    "/v1/memory/memories",
    summary="Create a memory",
    status_code=201,
    **api("manage", body=CreateMemoryRequest, ok=Memory, status=201),
)
async def create_memory(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body(), (*FIELDS, "user"))
    user = user_param(principal.only(body.get("user")))
    fields = memory_fields(body, creating=True)
    created = await create(services, principal.tenant_id, user, fields)
    return json_response(memory_object(created), status=201)


async def create(
    services: AppState, tenant_id: str, user: str, fields: dict[str, Any]
) -> MemoryRecord:
    """A new memory of `user` from checked `fields` (`memory_fields`), queued for embedding."""
    memory_id, values = new_memory_id(), dict(fields)

    def work(conn: Connection) -> MemoryRecord:
        Erasures(conn).share(tenant_id, user)  # (wholly before an erasure, or after)
        created = Memories(conn).create(
            tenant_id, user, memory_id, values.pop("text"), now=now(), **values
        )
        queue_embedding(conn, services, created)
        return created

    created = await services.db.write(work)
    services.jobs.wake()
    return created


async def update(
    services: AppState, tenant_id: str, memory_id: str, user: str | None, fields: dict[str, Any]
) -> MemoryRecord:
    """The memory with checked `fields` (`memory_fields`) changed (of `user` only, when
    given), queued for embedding again when its text changed; 404 if there is none."""

    def work(conn: Connection) -> MemoryRecord | None:
        # (A new text takes the old one's vectors with it: Memories.update.)
        updated = Memories(conn).update(tenant_id, memory_id, now=now(), user_id=user, **fields)
        if updated is not None and "text" in fields:
            queue_embedding(conn, services, updated)
        return updated

    updated = await services.db.write(work)
    if updated is None:
        raise _not_found(memory_id)
    services.jobs.wake()
    return updated


def queue_embedding(conn: Connection, services: AppState, memory: MemoryRecord) -> None:
    """A memory created, or its text edited, is embedded (again) by a background job, when
    the tenant has embeddings on and the user is named; until then it is found by words."""
    if services.embeddings.wanted(memory.tenant_id, memory.user_id, "full", ANONYMOUS):
        version = int(memory.updated_at.timestamp() * 1_000_000)
        queue_memories(conn, memory.tenant_id, memory.user_id, f"{memory.id}@{version}", now=now())


def _owner(request: Request[Any, Any, Any], principal: Principal) -> str | None:
    """`?user=`, or the user the credentials are bound to: another user's memory is not
    found (403 for bound credentials that name another)."""
    user = request.query_params.get("user")
    return principal.only(None if user is None else user_param(user))


@get(
    "/v1/memory/memories/{memory_id:str}",
    summary="Get a memory",
    **api("manage", query=("user",), ok=Memory),
)
async def get_memory(
    memory_id: FromPath[str],
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    user = _owner(request, principal)
    found = await services.db.read(
        lambda conn: Memories(conn).get(principal.tenant_id, memory_id, user)
    )
    if found is None:
        raise _not_found(memory_id)
    return json_response(memory_object(found))


@patch(
    "/v1/memory/memories/{memory_id:str}",
    summary="Correct, pin or unpin a memory",
    **api("manage", query=("user",), body=UpdateMemoryRequest, ok=Memory),
)
async def update_memory(
    memory_id: FromPath[str],
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    user = _owner(request, principal)
    fields = memory_fields(parse_json_object(await request.body(), FIELDS), creating=False)
    if not fields:
        raise BadRequest("Nothing to update: send text, kind, pinned or confidence.")
    updated = await update(services, principal.tenant_id, memory_id, user, fields)
    return json_response(memory_object(updated))


@delete(
    "/v1/memory/memories/{memory_id:str}",
    summary="Delete a memory",
    **api("manage", query=("user",), ok=Deleted),
    status_code=200,
)
async def delete_memory(
    memory_id: FromPath[str],
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    await remove(services, principal.tenant_id, memory_id, _owner(request, principal))
    return json_response({"id": memory_id, "object": "memory.memory.deleted", "deleted": True})


async def remove(services: AppState, tenant_id: str, memory_id: str, user: str | None) -> None:
    """The memory deleted (of `user` only, when given); 404 if there is none."""
    deleted = await services.db.write(
        lambda conn: Memories(conn).delete(tenant_id, memory_id, user)
    )
    if not deleted:
        raise _not_found(memory_id)


ROUTES = [list_memories, create_memory, get_memory, update_memory, delete_memory]
