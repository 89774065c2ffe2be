"""The tenant's users: GET /v1/memory/users (searchable, with counts and last activity) and
DELETE /v1/memory/users/{user_id}, everything stored for them.

Scope `manage`, within the caller's tenant; a key or token bound to a user sees only that user.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import structlog
from litestar import Request, Response, delete, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from proxy.core.auth import Principal
from proxy.core.errors import BadRequest
from proxy.core.json_responses import json_response
from proxy.core.user_paths import user_in_path
from proxy.pipeline.turn import now
from proxy.routes.api_types import UserDeleted, UserList
from proxy.routes.params import limit_param, page, user_param
from proxy.routes.reference import api
from proxy.state import AppState
from storage.repositories.attachments import Attachments
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.responses import Responses
from storage.repositories.summaries import Summaries
from storage.repositories.system import SystemRepository
from storage.repositories.users import Users, UserSummary
from storage.repositories.vectors import MessageVectors

log = structlog.get_logger("memproxy.memory")
MAX_QUERY = 256


def user_object(u: UserSummary) -> dict[str, Any]:
    return {
        "id": u.user_id,
        "object": "memory.user",
        "conversations": u.conversations,
        "messages": u.messages,
        "memories": u.memories,
        "last_active_at": int(u.last_active_at.timestamp()),
    }


async def find_users(
    services: AppState, principal: Principal, *, q: str | None, after: str | None, limit: int
) -> list[UserSummary]:
    """Up to `limit` of the users the caller sees, in order of their ids, after `after`,
    whose id holds `q` (any case)."""
    if q is not None and len(q) > MAX_QUERY:
        raise BadRequest(f"'q' must be at most {MAX_QUERY} characters.", param="q")
    if after is not None:
        user_param(after, "after")
    return await services.db.read(
        lambda conn: Users(conn).find(
            principal.tenant_id, limit=limit, contains=q, after=after, only=principal.user
        )
    )


@get(
    "/v1/memory/users",
    summary="List the tenant's users, with counts and last activity",
    **api("manage", query=("q", "after", "limit"), ok=UserList),
)
async def list_users(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    limit = limit_param(request)
    params = request.query_params
    found = await find_users(
        services, principal, q=params.get("q") or None, after=params.get("after"), limit=limit + 1
    )
    return json_response(page([user_object(u) for u in found], limit))


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
    user_id = user_param(user_in_path(user_id), "user_id", stored_before=True)
    principal.only(user_id, "user_id")  # (403: a key or token bound to another user)
    await services.deferred.settle()  # mode-off records still in the batch go too

    counts = await services.db.write(
        partial(erase_user, tenant_id=principal.tenant_id, user_id=user_id)
    )
    if not await services.db.checkpoint():  # (nor an earlier copy in SQLite's log)
        log.info("erasure_log_kept", reason="a reader or the file busy; emptied as writes go on")
    counts["spilled"] = await services.spill.forget(principal.tenant_id, user_id)
    if services.vectors is not None:
        services.vectors.forget(principal.tenant_id, user_id)
    services.shown.forget(principal.tenant_id, user_id)  # (context.keep_shown's sections)
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
    vectors = sum(  # of their messages, memories and attachments' passages
        table(conn).delete_user(tenant_id, user_id)
        for table in (MessageVectors, MemoryVectors, ChunkVectors)
    )
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


ROUTES = [list_users, delete_user]
