"""`GET /v1/memory/users/{user_id}/export`: everything memproxy stores for one user of the
tenant, read in one consistent snapshot: conversations with their messages and attachments
(with their text), memories, exchange records, Responses API responses memproxy stored (with
their input items), summaries and background jobs. Vectors are
derived from the messages and are counted, not dumped.

The answer is one JSON document. It is written page by page as the pages are read (each page
one unit of work in a snapshot held while the document is written, so the event loop is free
between pages) into a temporary file, which is then streamed: memory is bounded by a page, not
by the user's history, and the snapshot (a database connection, on PostgreSQL a transaction) is
held for as long as the database takes to read, never for as long as a slow client takes to
download. Everything is read before the response starts, so a database that cannot be read is
the usual error with its status, never a document cut short. At most `EXPORTS_AT_ONCE` exports
of a process read at once (`AppState.exports`); others wait their turn without a connection.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from functools import partial
from typing import Any, BinaryIO, TypeVar

import msgspec
from litestar import MediaType, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Stream
from sqlalchemy import Connection

from policies.public_ids import PublicIds
from proxy.core.auth import Principal
from proxy.core.user_paths import user_in_path
from proxy.pipeline.turn import now
from proxy.protocols.responses.stored import stored_response_object
from proxy.routes.api_types import UserExportDocument
from proxy.routes.attachments import attachment_object
from proxy.routes.conversations import conversation_object
from proxy.routes.jobs import job_object
from proxy.routes.memories import memory_object
from proxy.routes.messages import message_object
from proxy.routes.params import user_param
from proxy.routes.reference import api
from proxy.routes.traces import stored_trace_object
from proxy.routes.usage import exchange_object
from proxy.state import AppState
from storage.database import Snapshot
from storage.records import (
    AttachmentRecord,
    ConversationRecord,
    ExchangeRecord,
    JobRecord,
    MemoryRecord,
    MessageRecord,
    ResponseRecord,
    SummaryRecord,
)
from storage.repositories.attachments import Attachments
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.responses import Responses
from storage.repositories.summaries import Summaries
from storage.repositories.traces import TraceRecord, Traces
from storage.repositories.vectors import MessageVectors

R = TypeVar("R")
# An attachment's text may be far larger than a message: fewer of them to a page.
ATTACHMENTS_PER_PAGE = 10
# The document is written (to its spool, then to the client) in pieces of about this size.
FLUSH_BYTES = 64 * 1024

encode = msgspec.json.encode


async def pages(
    snapshot: Snapshot, fetch: Callable[[R | None, Connection], list[R]], limit: int
) -> AsyncIterator[list[R]]:
    """Every row `fetch` finds, `limit` at a time: `fetch(last, conn)` reads the page after
    `last` (None: the first), each page in a unit of work of its own. A short page is the last."""
    last: R | None = None
    while batch := await snapshot.read(partial(fetch, last)):
        yield batch
        if len(batch) < limit:
            return
        last = batch[-1]


async def array(
    batches: AsyncIterator[Sequence[R]], shown: Callable[[R], Any]
) -> AsyncIterator[bytes]:
    """A JSON array of what `shown` makes of each row, a page at a time."""
    opening = b"["
    async for batch in batches:
        yield opening + b",".join(encode(shown(row)) for row in batch)
        opening = b","
    yield b"[]" if opening == b"[" else b"]"


class UserExport:
    """The pages of one user's export, in the document's order."""

    def __init__(
        self, snapshot: Snapshot, tenant: str, user: str, page: int, ids: PublicIds
    ) -> None:
        self.snapshot, self.tenant, self.user, self.page = snapshot, tenant, user, page
        self.ids = ids

    async def document(self, at: datetime) -> AsyncIterator[bytes]:
        head = {
            "object": "memory.user.export",
            "user": self.user,
            "exported_at": int(at.timestamp()),
        }
        yield encode(head)[:-1] + b',"conversations":'  # (the object goes on: no closing brace)
        yield b"["
        separator = b""
        async for batch in self._pages(self._conversations):
            for conversation in batch:
                yield separator
                async for piece in self._conversation(conversation):
                    yield piece
                separator = b","
        yield b"]"
        sections: list[tuple[str, Callable[[Any, Connection], list[Any]], Callable[[Any], Any]]]
        sections = [
            ("memories", self._memories, memory_object),
            ("exchanges", self._exchanges, exchange_object),
            ("traces", self._traces, partial(stored_trace_object, self.ids)),
            ("responses", self._responses, stored_response_object),
            ("summaries", self._summaries, summary_object),
            ("jobs", self._jobs, partial(job_object, self.ids)),
        ]
        for name, fetch, shown in sections:
            yield b"," + encode(name) + b":"
            async for piece in array(self._pages(fetch), shown):
                yield piece
        vectors = await self.snapshot.read(  # (of messages, memories and passages)
            lambda c: sum(
                table(c).count(self.tenant, self.user)
                for table in (MessageVectors, MemoryVectors, ChunkVectors)
            )
        )
        yield b',"vectors":' + encode(vectors) + b"}"

    async def _conversation(self, conversation: ConversationRecord) -> AsyncIterator[bytes]:
        yield encode(conversation_object(conversation))[:-1] + b',"messages":'
        messages = self._pages(partial(self._messages, conversation.pk))
        async for piece in array(messages, partial(message_object, self.ids, conversation.id)):
            yield piece
        yield b',"attachments":'
        attached = pages(
            self.snapshot,
            partial(self._attachments, conversation.pk),
            min(self.page, ATTACHMENTS_PER_PAGE),
        )
        with_text = partial(_attachment_object, conversation.id)
        async for piece in array(attached, with_text):
            yield piece
        yield b"}"

    def _pages(self, fetch: Callable[[R | None, Connection], list[R]]) -> AsyncIterator[list[R]]:
        return pages(self.snapshot, fetch, self.page)

    def _conversations(
        self, last: ConversationRecord | None, conn: Connection
    ) -> list[ConversationRecord]:
        return Conversations(conn).list(self.tenant, self.user, after=last, limit=self.page)

    def _messages(
        self, conversation_pk: int, last: MessageRecord | None, conn: Connection
    ) -> list[MessageRecord]:
        after = last.seq if last else 0
        return Conversations(conn).messages(
            self.tenant, conversation_pk, after_seq=after, limit=self.page
        )

    def _attachments(
        self, conversation_pk: int, last: tuple[AttachmentRecord, int] | None, conn: Connection
    ) -> list[tuple[AttachmentRecord, int]]:
        """The attachments with their text and their chunk counts."""
        documents = Attachments(conn)
        found = documents.for_conversation(
            self.tenant,
            conversation_pk,
            limit=min(self.page, ATTACHMENTS_PER_PAGE),
            after_pk=last[0].pk if last else None,
        )
        chunks = documents.chunk_counts(self.tenant, [a.pk for a in found])
        return [(a, chunks.get(a.pk, 0)) for a in found]

    def _memories(self, last: MemoryRecord | None, conn: Connection) -> list[MemoryRecord]:
        return Memories(conn).find(self.tenant, self.user, limit=self.page, after=last)

    def _exchanges(self, last: ExchangeRecord | None, conn: Connection) -> list[ExchangeRecord]:
        return Exchanges(conn).for_user(self.tenant, self.user, limit=self.page, after=last)

    def _traces(self, last: TraceRecord | None, conn: Connection) -> list[TraceRecord]:
        return Traces(conn).for_user(self.tenant, self.user, limit=self.page, after=last)

    def _responses(self, last: ResponseRecord | None, conn: Connection) -> list[ResponseRecord]:
        return Responses(conn).for_user(self.tenant, self.user, limit=self.page, after=last)

    def _summaries(self, last: SummaryRecord | None, conn: Connection) -> list[SummaryRecord]:
        after = last.pk if last else None
        return Summaries(conn).for_user(self.tenant, self.user, limit=self.page, after_pk=after)

    def _jobs(self, last: JobRecord | None, conn: Connection) -> list[JobRecord]:
        after = last.pk if last else None
        return Jobs(conn).find(self.tenant, limit=self.page, user_id=self.user, after_pk=after)


def _attachment_object(conversation_id: str, found: tuple[AttachmentRecord, int]) -> dict[str, Any]:
    attachment, chunks = found
    return attachment_object(conversation_id, attachment, chunks, content=True)


def summary_object(s: SummaryRecord) -> dict[str, Any]:
    return {
        "kind": s.kind,
        "subject": s.subject,
        "model": s.model,
        "text": s.text,
        "tokens": s.tokens,
        "created_at": int(s.created_at.timestamp()),
    }


async def coalesced(pieces: AsyncIterator[bytes], size: int) -> AsyncIterator[bytes]:
    """The same bytes in writes of at least `size` (but the last)."""
    buffer = bytearray()
    async for piece in pieces:
        buffer += piece
        if len(buffer) >= size:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)


@get(
    "/v1/memory/users/{user_id:str}/export",
    summary="Export everything stored for a user",
    **api("manage", ok=UserExportDocument),
)
async def export_user(
    user_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    user_id = user_param(user_in_path(user_id), "user_id", stored_before=True)
    principal.only(user_id, "user_id")  # (403: a key or token bound to another user)
    await services.deferred.settle()  # (mode-off records written in batches)
    page = services.config.server.export_page_rows
    spool = await _spooled(services, principal.tenant_id, user_id, page)
    return Stream(_sent(spool), media_type=MediaType.JSON)


async def _spooled(services: AppState, tenant: str, user: str, page: int) -> BinaryIO:
    """The user's export written to an anonymous temporary file (gone once closed), rewound."""
    spool = await asyncio.to_thread(tempfile.TemporaryFile)
    try:
        async with services.exports, services.db.snapshot() as snapshot:
            document = UserExport(snapshot, tenant, user, page, services.ids).document(now())
            async for chunk in coalesced(document, FLUSH_BYTES):
                await asyncio.to_thread(spool.write, chunk)
        await asyncio.to_thread(spool.seek, 0)
    except BaseException:
        spool.close()
        raise
    return spool


async def _sent(spool: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(spool.read, FLUSH_BYTES):
            yield chunk
    finally:
        spool.close()


ROUTES = [export_user]
