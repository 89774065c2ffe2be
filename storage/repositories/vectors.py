"""Stored messages' embeddings (recall's vector half), tenant- and user-scoped.

A vector belongs to a message (its row goes when the message goes) and to the embedding model
that made it: vectors of different models never meet, so a tenant that changes its model
simply has nothing embedded by the new one yet. Only complete user and assistant messages
(those full-text search indexes, `search_text`) are embedded.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import Connection, Table, and_, delete, exists, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from storage.models import CONVERSATIONS, JOBS, MESSAGE_VECTORS, MESSAGES
from storage.repositories.rows import utc

V = MESSAGE_VECTORS
M = MESSAGES


@dataclass(frozen=True, slots=True)
class Unembedded:
    """A stored message still without a vector of the model asked about."""

    pk: int
    conversation_pk: int
    seq: int
    text: str
    exchange_id: str | None = None  # the turn that stored it (None: imported)


@dataclass(frozen=True, slots=True)
class Backlog:
    """A conversation's searchable messages still without a vector of the model asked about:
    how many, and the first one's seq."""

    user_id: str
    conversation_pk: int
    first_seq: int
    count: int
    conversation_id: str
    conversation_began: datetime


@dataclass(frozen=True, slots=True)
class NewVector:
    """A vector to store for a message, memory or passage (`item_pk`)."""

    item_pk: int
    vector: bytes  # policies.vectors.encode
    dims: int
    # The text embedded: where given, the vector is stored only while its item still says
    # that (a memory edited meanwhile is embedded again, by the job its edit queued).
    text: str | None = None


@dataclass(frozen=True, slots=True)
class StoredVector:
    """A vector with where its item is: a message's conversation and seq (to read it and its
    neighbours), a passage's attachment and seq; a memory has neither (0)."""

    pk: int  # the vector's own: they are read in this order, incrementally
    item_pk: int
    group_pk: int
    seq: int
    vector: bytes


def insert_vectors(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> int:
    """Insert vector rows, skipping those whose item has its vector of that model already;
    how many were stored. One statement (an executemany's row count is not reliable on every
    driver)."""
    if not rows:
        return 0
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stored = conn.execute(
        insert(table).values(list(rows)).on_conflict_do_nothing().returning(table.c.pk)
    ).all()
    return len(stored)


class UserVectors:
    """What every table of vectors answers alike: each row is one user's vector, of one model,
    of one item (a message, a memory, a passage)."""

    table: ClassVar[Table]

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def stats(self, tenant_id: str, user_id: str, model: str) -> tuple[int, int]:
        """(how many vectors of `model` the user has, the newest one's pk or 0): enough to
        tell whether a copy loaded earlier is still whole (one index range count)."""
        v = self.table
        row = self.conn.execute(
            select(func.count(), func.coalesce(func.max(v.c.pk), 0)).where(
                v.c.tenant_id == tenant_id, v.c.user_id == user_id, v.c.model == model
            )
        ).one()
        return int(row[0]), int(row[1])

    def newest(self, tenant_id: str, user_id: str, model: str) -> int:
        """The pk of the user's newest vector of `model`, or 0: one index seek, where `stats`
        counts the whole range."""
        v = self.table
        return int(
            self.conn.execute(
                select(func.coalesce(func.max(v.c.pk), 0)).where(
                    v.c.tenant_id == tenant_id, v.c.user_id == user_id, v.c.model == model
                )
            ).scalar_one()
        )

    def count(self, tenant_id: str, user_id: str | None = None) -> int:
        v = self.table
        query = select(func.count()).where(v.c.tenant_id == tenant_id)
        if user_id is not None:
            query = query.where(v.c.user_id == user_id)
        return int(self.conn.execute(query).scalar_one())

    def delete_user(self, tenant_id: str, user_id: str) -> int:
        v = self.table
        result = self.conn.execute(
            delete(v).where(v.c.tenant_id == tenant_id, v.c.user_id == user_id)
        )
        return int(result.rowcount)


class MessageVectors(UserVectors):
    table = V

    def unembedded(
        self,
        tenant_id: str,
        user_id: str,
        model: str,
        *,
        exchange_id: str | None = None,
        conversation_pk: int | None = None,
        first_seq: int = 0,
        last_seq: int | None = None,
        limit: int = 256,
    ) -> list[Unembedded]:
        """The user's searchable messages without a `model` vector, in order: those an
        exchange stored, or those of a conversation from `first_seq` to `last_seq`."""
        if (exchange_id is None) == (conversation_pk is None):
            raise ValueError("give an exchange or a conversation")
        query = select(M.c.pk, M.c.conversation_pk, M.c.seq, M.c.search_text).where(
            M.c.tenant_id == tenant_id,
            M.c.user_id == user_id,
            M.c.status == "complete",
            M.c.search_text.is_not(None),
            ~exists().where(V.c.message_pk == M.c.pk, V.c.model == model),
        )
        if exchange_id is not None:
            query = query.where(M.c.exchange_id == exchange_id)
        else:
            query = query.where(M.c.conversation_pk == conversation_pk, M.c.seq >= first_seq)
            if last_seq is not None:
                query = query.where(M.c.seq <= last_seq)
        rows = self.conn.execute(query.order_by(M.c.conversation_pk, M.c.seq).limit(limit))
        return [Unembedded(r.pk, r.conversation_pk, r.seq, r.search_text) for r in rows]

    def unembedded_of_queued_turns(
        self,
        tenant_id: str,
        user_id: str,
        model: str,
        *,
        job_kind: str,
        after_pk: int,
        limit: int,
    ) -> list[Unembedded]:
        """The user's searchable messages without a `model` vector stored after the message
        `after_pk` by turns whose job of `job_kind` is queued (the turn ended, and its job is
        not running), oldest first."""
        J = JOBS
        query = (
            select(M.c.pk, M.c.conversation_pk, M.c.seq, M.c.search_text, M.c.exchange_id)
            .where(
                M.c.tenant_id == tenant_id,
                M.c.user_id == user_id,
                M.c.pk > after_pk,
                M.c.status == "complete",
                M.c.search_text.is_not(None),
                exists().where(
                    J.c.tenant_id == tenant_id,
                    J.c.user_id == user_id,
                    J.c.kind == job_kind,
                    J.c.ref == M.c.exchange_id,
                    J.c.status == "queued",
                ),
                ~exists().where(V.c.message_pk == M.c.pk, V.c.model == model),
            )
            .order_by(M.c.pk)
            .limit(limit)
        )
        rows = self.conn.execute(query)
        return [
            Unembedded(r.pk, r.conversation_pk, r.seq, r.search_text, r.exchange_id) for r in rows
        ]

    def embedded_turns(
        self, tenant_id: str, user_id: str, model: str, exchange_ids: Collection[str]
    ) -> set[str]:
        """Those of the user's turns (`exchange_ids`) with no searchable message left without
        a `model` vector (a turn's messages need not be next to each other: two turns of the
        user's answered at once interleave theirs)."""
        if not exchange_ids:
            return set()
        left = self.conn.execute(
            select(M.c.exchange_id)
            .where(
                M.c.tenant_id == tenant_id,
                M.c.user_id == user_id,
                M.c.exchange_id.in_(list(exchange_ids)),
                M.c.status == "complete",
                M.c.search_text.is_not(None),
                ~exists().where(V.c.message_pk == M.c.pk, V.c.model == model),
            )
            .distinct()
        )
        return set(exchange_ids) - {r.exchange_id for r in left}

    def backlog(self, tenant_id: str, model: str, *, except_user: str) -> list[Backlog]:
        """The tenant's conversations with searchable messages not embedded by `model` (of
        every user but `except_user`), oldest conversation first."""
        C = CONVERSATIONS
        rows = self.conn.execute(
            select(
                M.c.user_id,
                M.c.conversation_pk,
                func.min(M.c.seq),
                func.count(),
                C.c.id,
                C.c.created_at,
            )
            .join(C, C.c.pk == M.c.conversation_pk)
            .where(
                M.c.tenant_id == tenant_id,
                M.c.user_id != except_user,
                M.c.status == "complete",
                M.c.search_text.is_not(None),
                ~exists().where(V.c.message_pk == M.c.pk, V.c.model == model),
            )
            .group_by(M.c.user_id, M.c.conversation_pk, C.c.id, C.c.created_at)
            .order_by(M.c.conversation_pk)
        )
        return [Backlog(r[0], int(r[1]), int(r[2]), int(r[3]), str(r[4]), utc(r[5])) for r in rows]

    def store(
        self,
        tenant_id: str,
        user_id: str,
        model: str,
        vectors: Sequence[NewVector],
        *,
        now: datetime,
    ) -> int:
        """Store vectors of the user's messages; a message that is gone (deleted since it was
        read) or another user's, or one that has its vector already, is skipped. How many
        were stored."""
        if not vectors:
            return 0
        mine = {
            r.pk
            for r in self.conn.execute(
                select(M.c.pk).where(
                    M.c.tenant_id == tenant_id,
                    M.c.user_id == user_id,
                    M.c.pk.in_([v.item_pk for v in vectors]),
                )
            )
        }
        rows = [
            {
                "message_pk": v.item_pk,
                "tenant_id": tenant_id,
                "user_id": user_id,
                "model": model,
                "dims": v.dims,
                "vector": v.vector,
                "created_at": now,
            }
            for v in vectors
            if v.item_pk in mine
        ]
        return insert_vectors(self.conn, V, rows)

    def load(
        self, tenant_id: str, user_id: str, model: str, *, after_pk: int = 0
    ) -> list[StoredVector]:
        """The user's `model` vectors stored after `after_pk`, in the order they were stored,
        with their messages' places; only of messages that are still there and complete."""
        rows = self.conn.execute(
            select(V.c.pk, V.c.message_pk, M.c.conversation_pk, M.c.seq, V.c.vector)
            .join(
                M,
                and_(
                    M.c.pk == V.c.message_pk,
                    M.c.tenant_id == tenant_id,
                    M.c.user_id == user_id,
                    M.c.status == "complete",
                ),
            )
            .where(
                V.c.tenant_id == tenant_id,
                V.c.user_id == user_id,
                V.c.model == model,
                V.c.pk > after_pk,
            )
            .order_by(V.c.pk)
        )
        return [StoredVector(r.pk, r.message_pk, r.conversation_pk, r.seq, r.vector) for r in rows]

    def delete_conversation(self, tenant_id: str, conversation_pk: int) -> int:
        messages = select(M.c.pk).where(
            M.c.tenant_id == tenant_id, M.c.conversation_pk == conversation_pk
        )
        result = self.conn.execute(
            delete(V).where(V.c.tenant_id == tenant_id, V.c.message_pk.in_(messages))
        )
        return int(result.rowcount)
