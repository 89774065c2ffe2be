"""`GET /v1/memory/users/{user_id}/export`: everything memproxy stores for one user of the
tenant, read in one consistent snapshot: conversations with their messages and attachments
(with their text), memories, exchange records, summaries and background jobs. Vectors are
derived from the messages and are counted, not dumped.

The reads go page by page through index ranges; the answer is one JSON document, so a user
with a very large history makes a large response."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from proxy.auth import Principal
from proxy.memory import now
from proxy.responses import json_response
from proxy.routes.attachments import attachment_object
from proxy.routes.jobs import job_object
from proxy.routes.memories import memory_object
from proxy.routes.memory import MANAGE, conversation_object, message_object, user_param
from proxy.routes.usage import exchange_object
from proxy.state import AppState
from storage.records import ConversationRecord, ExchangeRecord, MemoryRecord
from storage.repositories.attachments import Attachments
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.summaries import Summaries
from storage.repositories.vectors import MessageVectors

PAGE = 500


def _conversations(conn: Connection, tenant: str, user: str) -> list[dict[str, Any]]:
    repo, documents = Conversations(conn), Attachments(conn)
    found: list[dict[str, Any]] = []
    after: ConversationRecord | None = None
    while batch := repo.list(tenant, user, after=after, limit=PAGE):
        for conversation in batch:
            messages, seq = [], 0
            while page := repo.messages(tenant, conversation.pk, after_seq=seq, limit=PAGE):
                messages += [message_object(conversation.id, m) for m in page]
                seq = page[-1].seq
            attached = documents.for_conversation(tenant, conversation.pk, limit=1_000_000)
            chunks = documents.chunk_counts(tenant, [a.pk for a in attached])
            found.append(
                {
                    **conversation_object(conversation),
                    "messages": messages,
                    "attachments": [
                        attachment_object(conversation.id, a, chunks.get(a.pk, 0), content=True)
                        for a in attached
                    ],
                }
            )
        after = batch[-1]
    return found


def _memories(conn: Connection, tenant: str, user: str) -> list[dict[str, Any]]:
    repo, found = Memories(conn), []
    after: MemoryRecord | None = None
    while batch := repo.find(tenant, user, limit=PAGE, after=after):
        found += [memory_object(m) for m in batch]
        after = batch[-1]
    return found


def _exchanges(conn: Connection, tenant: str, user: str) -> list[dict[str, Any]]:
    repo, found = Exchanges(conn), []
    after: ExchangeRecord | None = None
    while batch := repo.for_user(tenant, user, limit=PAGE, after=after):
        found += [exchange_object(x) for x in batch]
        after = batch[-1]
    return found


@get(
    "/v1/memory/users/{user_id:str}/export",
    opt=MANAGE,
    summary="Export everything stored for a user",
)
async def export_user(
    user_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    user_param(user_id, "user_id")
    tenant = principal.tenant_id
    await services.deferred.settle()  # (mode-off records written in batches)

    def work(conn: Connection) -> dict[str, Any]:
        jobs, after = [], None
        while batch := Jobs(conn).find(tenant, limit=PAGE, user_id=user_id, after_pk=after):
            jobs += [job_object(j) for j in batch]
            after = batch[-1].pk
        return {
            "object": "memory.user.export",
            "user": user_id,
            "exported_at": int(now().timestamp()),
            "conversations": _conversations(conn, tenant, user_id),
            "memories": _memories(conn, tenant, user_id),
            "exchanges": _exchanges(conn, tenant, user_id),
            "summaries": [
                {
                    "kind": s.kind,
                    "subject": s.subject,
                    "model": s.model,
                    "text": s.text,
                    "tokens": s.tokens,
                    "created_at": int(s.created_at.timestamp()),
                }
                for s in Summaries(conn).for_user(tenant, user_id)
            ],
            "jobs": jobs,
            "vectors": MessageVectors(conn).count(tenant, user_id),
        }

    return json_response(await services.db.read(work))


ROUTES = [export_user]
