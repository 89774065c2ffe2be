"""Attachment passages' embeddings (the relevant-passage choice's vector half).

Shaped like the messages' (storage/repositories/vectors.py): one vector per chunk and model,
of the user whose attachment it is, gone with its chunk (so with its attachment, conversation
or user). Chunks never change, so a stored vector is never stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, exists, func, select

from storage.models import ATTACHMENT_CHUNKS, ATTACHMENTS, CHUNK_VECTORS
from storage.repositories.vectors import NewVector, StoredVector, UserVectors, insert_vectors

V = CHUNK_VECTORS
K = ATTACHMENT_CHUNKS
A = ATTACHMENTS


@dataclass(frozen=True, slots=True)
class UnembeddedChunk:
    pk: int
    seq: int
    text: str


@dataclass(frozen=True, slots=True)
class ChunkBacklog:
    """An attachment with passages not embedded by the model asked about."""

    user_id: str
    attachment_id: str
    first_seq: int
    count: int


class ChunkVectors(UserVectors):
    table = V

    def unembedded(
        self,
        tenant_id: str,
        user_id: str,
        attachment_id: str,
        model: str,
        *,
        first_seq: int = 0,
        limit: int,
    ) -> list[UnembeddedChunk]:
        """The passages of the user's attachment from `first_seq` on without a `model` vector,
        in order."""
        rows = self.conn.execute(
            select(K.c.pk, K.c.seq, K.c.text)
            .join(A, and_(A.c.pk == K.c.attachment_pk, A.c.tenant_id == tenant_id))
            .where(
                A.c.id == attachment_id,
                A.c.user_id == user_id,
                K.c.tenant_id == tenant_id,
                K.c.seq >= first_seq,
                ~exists().where(V.c.chunk_pk == K.c.pk, V.c.model == model),
            )
            .order_by(K.c.seq)
            .limit(limit)
        )
        return [UnembeddedChunk(r.pk, r.seq, r.text) for r in rows]

    def backlog(self, tenant_id: str, model: str, *, except_user: str) -> list[ChunkBacklog]:
        """The tenant's attachments (but `except_user`'s) with passages not embedded by
        `model`, oldest first."""
        rows = self.conn.execute(
            select(A.c.user_id, A.c.id, func.min(K.c.seq), func.count())
            .join(K, and_(K.c.attachment_pk == A.c.pk, K.c.tenant_id == tenant_id))
            .where(
                A.c.tenant_id == tenant_id,
                A.c.user_id != except_user,
                ~exists().where(V.c.chunk_pk == K.c.pk, V.c.model == model),
            )
            .group_by(A.c.pk, A.c.user_id, A.c.id)
            .order_by(A.c.pk)
        )
        return [ChunkBacklog(str(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows]

    def store(
        self,
        tenant_id: str,
        user_id: str,
        model: str,
        vectors: Sequence[NewVector],
        *,
        now: datetime,
    ) -> int:
        """Store vectors of passages of the user's attachments; one whose attachment is gone
        (deleted since it was read) or another user's is skipped. How many were stored."""
        if not vectors:
            return 0
        mine = set(
            self.conn.execute(
                select(K.c.pk)
                .join(A, and_(A.c.pk == K.c.attachment_pk, A.c.tenant_id == tenant_id))
                .where(
                    K.c.tenant_id == tenant_id,
                    A.c.user_id == user_id,
                    K.c.pk.in_([v.item_pk for v in vectors]),
                )
            ).scalars()
        )
        rows = [
            {
                "chunk_pk": v.item_pk,
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
        """The user's passages' `model` vectors stored after `after_pk`, in that order, each
        with its attachment and seq."""
        rows = self.conn.execute(
            select(V.c.pk, V.c.chunk_pk, K.c.attachment_pk, K.c.seq, V.c.vector)
            .join(K, and_(K.c.pk == V.c.chunk_pk, K.c.tenant_id == tenant_id))
            .where(
                V.c.tenant_id == tenant_id,
                V.c.user_id == user_id,
                V.c.model == model,
                V.c.pk > after_pk,
            )
            .order_by(V.c.pk)
        )
        return [StoredVector(r.pk, r.chunk_pk, r.attachment_pk, r.seq, r.vector) for r in rows]

    def delete_attachments(self, tenant_id: str, attachment_pks: Sequence[int]) -> int:
        """The vectors of those attachments' passages."""
        if not attachment_pks:
            return 0
        chunks = select(K.c.pk).where(
            K.c.tenant_id == tenant_id, K.c.attachment_pk.in_(list(attachment_pks))
        )
        result = self.conn.execute(
            delete(V).where(V.c.tenant_id == tenant_id, V.c.chunk_pk.in_(chunks))
        )
        return int(result.rowcount)
