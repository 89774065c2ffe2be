"""Attachments of conversations and their chunks, with full-text search over the chunks.

Search works like the messages' (storage/repositories/search.py): SQLite, FTS5 with BM25 over
`attachment_chunks_fts`, each chunk carrying a token that names its attachment so a query reads
only the postings of the attachments asked about; PostgreSQL, the English tsvector of the
chunk's text (stored, `search_vector`, and GIN-indexed: migration 0017), ranked with
`ts_rank_cd`. Triggers (migration 0008) keep the FTS5 index in step with every insert and
delete. Every call takes the tenant.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, func, insert, literal, or_, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from storage.errors import ConflictError
from storage.models import ATTACHMENT_CHUNKS, ATTACHMENTS
from storage.records import AttachmentRecord, ChunkRecord
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.digests import tenant_digest
from storage.repositories.rows import columns, utc_row
from storage.repositories.summaries import Summaries

A = ATTACHMENTS
K = ATTACHMENT_CHUNKS
_COLUMNS = columns(A, AttachmentRecord)
_CHUNK_COLUMNS = columns(K, ChunkRecord)
_WITHOUT_CONTENT = [literal("").label("content") if c.name == "content" else c for c in _COLUMNS]
_TERM = re.compile(r"^\w+$")
ORIGINS = ("upload", "inline")


def new_attachment_id() -> str:
    return "att_" + secrets.token_hex(12)


def attachment_scope_token(tenant_id: str, attachment_pk: int) -> str:
    """The token that names an attachment in the SQLite index (64 bits of a hash: results are
    checked against the real tenant and attachment too, so a collision could only hide hits)."""
    return "a" + tenant_digest(tenant_id, str(attachment_pk), size=8)


@dataclass(frozen=True, slots=True)
class ChunkHit:
    pk: int
    attachment_pk: int
    seq: int
    score: float  # higher is better; comparable within one search only


_SQLITE = text(
    "SELECT k.pk, k.attachment_pk, k.seq, f.score FROM ("
    "SELECT rowid AS pk, -bm25(attachment_chunks_fts, 1.0, 0.0) AS score "
    "FROM attachment_chunks_fts WHERE attachment_chunks_fts MATCH :query "
    "ORDER BY bm25(attachment_chunks_fts, 1.0, 0.0) LIMIT :limit"
    ") f JOIN attachment_chunks k ON k.pk = f.pk "
    "WHERE k.tenant_id = :tenant AND k.attachment_pk IN :attachments "
    "ORDER BY f.score DESC, k.attachment_pk, k.seq"
).bindparams(bindparam("attachments", expanding=True))
_POSTGRESQL = text(
    "SELECT k.pk, k.attachment_pk, k.seq, "
    "ts_rank_cd(k.search_vector, q) AS score "
    "FROM attachment_chunks k, to_tsquery('english', :query) q "
    "WHERE k.tenant_id = :tenant AND k.attachment_pk IN :attachments "
    "AND k.search_vector @@ q "
    "ORDER BY score DESC, k.attachment_pk, k.seq LIMIT :limit"
).bindparams(bindparam("attachments", expanding=True))


def _record(row: Any) -> AttachmentRecord:
    return AttachmentRecord(**utc_row(row))


class Attachments:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def create(
        self,
        tenant_id: str,
        user_id: str,
        conversation_pk: int,
        attachment_id: str,
        *,
        content: str,
        chunks: Sequence[tuple[str, int]],
        now: datetime,
        media_type: str = "text/plain",
        origin: str = "upload",
        title: str | None = None,
        source: str | None = None,
        size_bytes: int | None = None,
        tokens: int | None = None,
        exchange_id: str | None = None,
    ) -> AttachmentRecord:
        """A new attachment and its chunks ((text, tokens) in order); ConflictError if the id
        is taken in the tenant. `tokens` defaults to the chunks' sum, `size_bytes` to the
        content's UTF-8 length."""
        if origin not in ORIGINS:
            raise ValueError(f"origin must be one of {ORIGINS}, not {origin!r}")
        values = {
            "id": attachment_id,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "conversation_pk": conversation_pk,
            "title": title,
            "source": source,
            "media_type": media_type,
            "origin": origin,
            "content": content,
            "content_hash": hashlib.sha256(content.encode()).hexdigest(),
            "tokens": sum(t for _, t in chunks) if tokens is None else tokens,
            "size_bytes": len(content.encode()) if size_bytes is None else size_bytes,
            "exchange_id": exchange_id,
            "created_at": now,
        }
        try:
            pk = self.conn.execute(insert(A).values(values).returning(A.c.pk)).scalar_one()
        except IntegrityError as exc:
            raise ConflictError(f"attachment {attachment_id!r} exists") from exc
        if chunks:
            scope = attachment_scope_token(tenant_id, pk)
            self.conn.execute(
                insert(K),
                [
                    {
                        "attachment_pk": pk,
                        "tenant_id": tenant_id,
                        "seq": seq,
                        "text": chunk,
                        "tokens": chunk_tokens,
                        "search_scope": scope,
                    }
                    for seq, (chunk, chunk_tokens) in enumerate(chunks, start=1)
                ],
            )
        found = self.get(tenant_id, attachment_id)
        assert found is not None
        return found

    def get(self, tenant_id: str, attachment_id: str) -> AttachmentRecord | None:
        row = self.conn.execute(
            select(*_COLUMNS).where(A.c.tenant_id == tenant_id, A.c.id == attachment_id)
        ).first()
        return _record(row) if row else None

    def for_conversation(
        self,
        tenant_id: str,
        conversation_pk: int,
        *,
        limit: int,
        after_pk: int | None = None,
        with_content: bool = True,
        newest: bool = False,
    ) -> list[AttachmentRecord]:
        """A conversation's attachments, oldest first; `after_pk`: those after that one;
        `newest`: the newest `limit` of them (still oldest first). Without `with_content`,
        each record's `content` is "" (a listing need not read it)."""
        fields = _COLUMNS if with_content else _WITHOUT_CONTENT
        query = select(*fields).where(
            A.c.tenant_id == tenant_id, A.c.conversation_pk == conversation_pk
        )
        if after_pk is not None:
            query = query.where(A.c.pk > after_pk)
        order = A.c.pk.desc() if newest else A.c.pk
        records = [_record(r) for r in self.conn.execute(query.order_by(order).limit(limit))]
        return records[::-1] if newest else records

    def content_hashes(self, tenant_id: str, conversation_pk: int) -> set[str]:
        """The content hashes of a conversation's attachments (to store a document once)."""
        rows = self.conn.execute(
            select(A.c.content_hash).where(
                A.c.tenant_id == tenant_id, A.c.conversation_pk == conversation_pk
            )
        )
        return {r.content_hash for r in rows}

    def chunk_counts(self, tenant_id: str, attachment_pks: Sequence[int]) -> dict[int, int]:
        """How many chunks each attachment has (those with none are left out)."""
        if not attachment_pks:
            return {}
        rows = self.conn.execute(
            select(K.c.attachment_pk, func.count())
            .where(K.c.tenant_id == tenant_id, K.c.attachment_pk.in_(list(attachment_pks)))
            .group_by(K.c.attachment_pk)
        )
        return {int(pk): int(count) for pk, count in rows}

    def chunks(self, tenant_id: str, attachment_pks: Sequence[int]) -> list[ChunkRecord]:
        """The attachments' chunks, by attachment (pk order) and then in document order."""
        if not attachment_pks:
            return []
        rows = self.conn.execute(
            select(*_CHUNK_COLUMNS)
            .where(K.c.tenant_id == tenant_id, K.c.attachment_pk.in_(list(attachment_pks)))
            .order_by(K.c.attachment_pk, K.c.seq)
        )
        return [ChunkRecord(**utc_row(r)) for r in rows]

    def some_chunks(
        self,
        tenant_id: str,
        *,
        whole: Sequence[int],
        openings: Sequence[int],
        opening: int,
        chunk_pks: Sequence[int],
    ) -> list[ChunkRecord]:
        """Every chunk of the `whole` attachments, the first `opening` chunks of the `openings`
        ones, and the chunks `chunk_pks` (search hits): by attachment, then in order."""
        wanted: list[ColumnElement[bool]] = []
        if whole:
            wanted.append(K.c.attachment_pk.in_(list(whole)))
        if openings:
            wanted.append(and_(K.c.attachment_pk.in_(list(openings)), K.c.seq <= opening))
        if chunk_pks:
            wanted.append(K.c.pk.in_(list(chunk_pks)))
        if not wanted:
            return []
        rows = self.conn.execute(
            select(*_CHUNK_COLUMNS)
            .where(K.c.tenant_id == tenant_id, or_(*wanted))
            .order_by(K.c.attachment_pk, K.c.seq)
        )
        return [ChunkRecord(**utc_row(r)) for r in rows]

    def search(
        self, tenant_id: str, attachment_pks: Sequence[int], terms: Sequence[str], *, limit: int
    ) -> list[ChunkHit]:
        """The chunks of those attachments that match any of `terms`, best first."""
        words = [t for t in terms if _TERM.match(t)]
        pks = sorted(set(attachment_pks))
        if not words or not pks or limit < 1:
            return []
        if self.conn.dialect.name == "postgresql":
            statement, query = _POSTGRESQL, " | ".join(words)
        else:
            statement = _SQLITE
            scopes = " OR ".join(f'"{attachment_scope_token(tenant_id, pk)}"' for pk in pks)
            terms_query = " OR ".join(f'"{w}"' for w in words)
            query = f"search_scope : ({scopes}) AND text : ({terms_query})"
        rows = self.conn.execute(
            statement, {"query": query, "tenant": tenant_id, "attachments": pks, "limit": limit}
        )
        return [ChunkHit(r.pk, r.attachment_pk, r.seq, float(r.score)) for r in rows]

    def delete(self, tenant_id: str, attachment_id: str) -> bool:
        """Delete an attachment with its chunks (and so their index entries and vectors) and
        the summaries made of it."""
        found = self.get(tenant_id, attachment_id)
        if found is None:
            return False
        Summaries(self.conn).delete_subjects(tenant_id, found.user_id, [attachment_id])
        ChunkVectors(self.conn).delete_attachments(tenant_id, [found.pk])  # (the cascade's too)
        self.conn.execute(
            delete(K).where(K.c.tenant_id == tenant_id, K.c.attachment_pk == found.pk)
        )
        self.conn.execute(delete(A).where(A.c.tenant_id == tenant_id, A.c.pk == found.pk))
        return True

    def delete_conversation(self, tenant_id: str, conversation_pk: int) -> int:
        """Delete a conversation's attachments, their chunks (and vectors) and the summaries
        made of them; how many attachments."""
        owned = select(A.c.pk).where(
            A.c.tenant_id == tenant_id, A.c.conversation_pk == conversation_pk
        )
        ids = select(A.c.user_id, A.c.id).where(
            A.c.tenant_id == tenant_id, A.c.conversation_pk == conversation_pk
        )
        by_user: dict[str, list[str]] = {}
        for user_id, attachment_id in self.conn.execute(ids):
            by_user.setdefault(user_id, []).append(attachment_id)
        for user_id, subjects in by_user.items():  # (the conversation's user's, in practice)
            Summaries(self.conn).delete_subjects(tenant_id, user_id, subjects)
        ChunkVectors(self.conn).delete_attachments(
            tenant_id, list(self.conn.execute(owned).scalars())
        )
        self.conn.execute(delete(K).where(K.c.tenant_id == tenant_id, K.c.attachment_pk.in_(owned)))
        result = self.conn.execute(
            delete(A).where(A.c.tenant_id == tenant_id, A.c.conversation_pk == conversation_pk)
        )
        return int(result.rowcount)

    def delete_user(self, tenant_id: str, user_id: str) -> int:
        """Erase a user's attachments, their chunks and their vectors; how many attachments."""
        ChunkVectors(self.conn).delete_user(tenant_id, user_id)
        owned = select(A.c.pk).where(A.c.tenant_id == tenant_id, A.c.user_id == user_id)
        self.conn.execute(delete(K).where(K.c.tenant_id == tenant_id, K.c.attachment_pk.in_(owned)))
        result = self.conn.execute(
            delete(A).where(A.c.tenant_id == tenant_id, A.c.user_id == user_id)
        )
        return int(result.rowcount)
