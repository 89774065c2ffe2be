"""The vector half of one turn's searches: the question's embedding, made once, searched
against the user's stored messages, memories and attachments' passages (vector_index.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from proxy.background.vector_index import Near, Nearest, VectorIndex


@dataclass(frozen=True, slots=True)
class SemanticQuery:
    """The vector half of one turn's searches (stored turns, memories, passages): the
    question's embedding, made once, and how vector hits count."""

    index: VectorIndex
    model: str
    vector: Sequence[float]
    weight: float = 1.0  # against the full-text scores, when the two are fused
    min_similarity: float = -1.0

    def search(
        self,
        conn: Connection,
        tenant_id: str,
        user_id: str,
        *,
        limit: int,
        conversation_pk: int | None = None,
    ) -> Nearest:
        """The stored messages nearest the question, and every one's similarity."""
        return self.index.search(
            "messages",
            conn,
            tenant_id,
            user_id,
            self.model,
            self.vector,
            limit=limit,
            min_similarity=self.min_similarity,
            groups=None if conversation_pk is None else (conversation_pk,),
        )

    def memories(
        self, conn: Connection, tenant_id: str, user_id: str, *, limit: int
    ) -> dict[int, float]:
        """The user's memories nearest the question: memory pk -> similarity."""
        found = self.index.nearest_of(
            "memories",
            conn,
            tenant_id,
            user_id,
            self.model,
            self.vector,
            limit=limit,
            min_similarity=self.min_similarity,
        )
        return {n.item_pk: n.score for n in found}

    def passages(
        self,
        conn: Connection,
        tenant_id: str,
        user_id: str,
        attachment_pks: Collection[int],
        *,
        limit: int,
    ) -> list[Near]:
        """The passages of those attachments (the user's) nearest the question."""
        if not attachment_pks:
            return []
        return self.index.nearest_of(
            "passages",
            conn,
            tenant_id,
            user_id,
            self.model,
            self.vector,
            limit=limit,
            min_similarity=self.min_similarity,
            groups=attachment_pks,
        )
