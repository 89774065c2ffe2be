"""Memories' embeddings (the relevant-memory choice's vector half), tenant- and user-scoped.

Shaped like the messages' (storage/repositories/vectors.py): one vector per memory and model,
gone with its memory. A memory's text edited takes its vectors away in the same statement's
transaction (`Memories.update`), and a vector is stored only while its memory still says what
was embedded, with the memory's row locked: an edit racing the job that embeds the old text
either waits for it and deletes what it stored, or is waited for and leaves nothing to store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, exists, func, select

from storage.models import MEMORIES, MEMORY_VECTORS
from storage.repositories.vectors import NewVector, StoredVector, UserVectors, insert_vectors

V = MEMORY_VECTORS
R = MEMORIES


@dataclass(frozen=True, slots=True)
class UnembeddedMemory:
    pk: int
    id: str  # (the memory's public id)
    text: str


@dataclass(frozen=True, slots=True)
class MemoryBacklog:
    """A user's memories without a vector of the model asked about: the first one's id, and
    how many."""

    user_id: str
    first_id: str
    count: int


class MemoryVectors(UserVectors):
    table = V

    def unembedded(
        self, tenant_id: str, user_id: str, model: str, *, limit: int
    ) -> list[UnembeddedMemory]:
        """The user's memories without a `model` vector, oldest first."""
        rows = self.conn.execute(
            select(R.c.pk, R.c.id, R.c.text)
            .where(
                R.c.tenant_id == tenant_id,
                R.c.user_id == user_id,
                ~exists().where(V.c.memory_pk == R.c.pk, V.c.model == model),
            )
            .order_by(R.c.pk)
            .limit(limit)
        )
        return [UnembeddedMemory(r.pk, r.id, r.text) for r in rows]

    def backlog(self, tenant_id: str, model: str, *, except_user: str) -> list[MemoryBacklog]:
        """The tenant's users (but `except_user`) with memories that have no `model` vector."""
        rows = self.conn.execute(
            select(R.c.user_id, func.min(R.c.pk), func.count())
            .where(
                R.c.tenant_id == tenant_id,
                R.c.user_id != except_user,
                ~exists().where(V.c.memory_pk == R.c.pk, V.c.model == model),
            )
            .group_by(R.c.user_id)
            .order_by(R.c.user_id)
        )
        counted = [(str(r[0]), int(r[1]), int(r[2])) for r in rows]
        ids = dict(
            self.conn.execute(
                select(R.c.pk, R.c.id).where(
                    R.c.tenant_id == tenant_id, R.c.pk.in_([pk for _, pk, _ in counted])
                )
            ).all()
        )
        return [MemoryBacklog(user, ids[pk], count) for user, pk, count in counted]

    def store(
        self,
        tenant_id: str,
        user_id: str,
        model: str,
        vectors: Sequence[NewVector],
        *,
        now: datetime,
    ) -> int:
        """Store vectors of the user's memories that are still there and still say the text
        embedded (`NewVector.text`), their rows locked until the transaction ends (see the
        module's note); how many were stored."""
        if not vectors:
            return 0
        query = select(R.c.pk, R.c.text).where(
            R.c.tenant_id == tenant_id,
            R.c.user_id == user_id,
            R.c.pk.in_([v.item_pk for v in vectors]),
        )
        if self.conn.dialect.name == "postgresql":  # (in pk order: two jobs never deadlock)
            query = query.order_by(R.c.pk).with_for_update()
        current = {r.pk: r.text for r in self.conn.execute(query)}
        rows = [
            {
                "memory_pk": v.item_pk,
                "tenant_id": tenant_id,
                "user_id": user_id,
                "model": model,
                "dims": v.dims,
                "vector": v.vector,
                "created_at": now,
            }
            for v in vectors
            if v.item_pk in current and (v.text is None or current[v.item_pk] == v.text)
        ]
        return insert_vectors(self.conn, V, rows)

    def load(
        self, tenant_id: str, user_id: str, model: str, *, after_pk: int = 0
    ) -> list[StoredVector]:
        """The user's memories' `model` vectors stored after `after_pk`, in that order."""
        rows = self.conn.execute(
            select(V.c.pk, V.c.memory_pk, V.c.vector)
            .join(R, and_(R.c.pk == V.c.memory_pk, R.c.tenant_id == tenant_id))
            .where(
                V.c.tenant_id == tenant_id,
                V.c.user_id == user_id,
                V.c.model == model,
                V.c.pk > after_pk,
            )
            .order_by(V.c.pk)
        )
        return [StoredVector(r.pk, r.memory_pk, 0, 0, r.vector) for r in rows]

    def delete_memories(self, tenant_id: str, memory_pks: Sequence[int]) -> int:
        if not memory_pks:
            return 0
        result = self.conn.execute(
            delete(V).where(V.c.tenant_id == tenant_id, V.c.memory_pk.in_(list(memory_pks)))
        )
        return int(result.rowcount)
