"""Recall on the request path: search the user's stored turns (one read), rank and pack them
(policies/recall.py) into the recall share of the budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection

from policies.context import Recalled
from policies.fusion import hybrid_scores
from policies.recall import Excerpt, Turn, fit, pack, query_terms, rank
from policies.tokens import count_text
from proxy.vector_index import SemanticQuery
from storage.database import Database
from storage.records import MemoryRecord
from storage.repositories.memories import Memories
from storage.repositories.search import Found, Hit, MessageSearch


@dataclass(frozen=True, slots=True)
class Recall:
    excerpts: list[Excerpt]
    section: Recalled | None
    memories: list[str] = field(default_factory=list)  # ids of the pinned memories attached

    @property
    def messages(self) -> int:
        """Recalled turns and memories (what `x-memory-memories` counts)."""
        return sum(len(e.turns) for e in self.excerpts) + len(self.memories)

    def record(self) -> list[dict[str, object]]:
        """What the exchange record says was recalled."""
        turns: list[dict[str, object]] = [
            {"message": f"msg_{t.pk}", "conversation_id": t.conversation, "hit": t.pk in e.hits}
            for e in self.excerpts
            for t in e.turns
        ]
        return turns + [{"memory": memory_id, "pinned": True} for memory_id in self.memories]


NOTHING = Recall([], None)


async def recall(
    db: Database,
    *,
    tenant_id: str,
    user_id: str,
    text: str,
    exclude: Sequence[str],
    budget_tokens: int,
    candidates: int,
    now: datetime,
    conversation_pk: int | None = None,
    hidden: tuple[int, int] | None = None,
    semantic: SemanticQuery | None = None,
) -> Recall:
    """Excerpts of the user's stored turns relevant to `text`, within `budget_tokens`.
    `conversation_pk` keeps the search to one conversation (an anonymous user's); `hidden`
    (conversation pk, seq) leaves out that conversation's messages from that seq on.
    `semantic` (embeddings on) adds the nearest stored messages by vector, fused with the
    full-text hits by rank."""
    terms = query_terms(text)
    if budget_tokens <= 0:
        return NOTHING
    with_memories = conversation_pk is None  # not for the anonymous user
    near: list[Hit] = []  # vector hits, read in the same snapshot as everything else

    def work(conn: Connection) -> tuple[list[Hit], list[Found], list[MemoryRecord]]:
        pinned = Memories(conn).pinned(tenant_id, user_id) if with_memories else []
        if not terms and semantic is None:
            return [], [], pinned
        search = MessageSearch(conn)
        hits = search.search(
            tenant_id, user_id, terms, limit=candidates, conversation_pk=conversation_pk
        )
        if semantic is not None:
            near[:] = semantic.nearest(
                conn, tenant_id, user_id, limit=candidates, conversation_pk=conversation_pk
            )
        found = search.around(tenant_id, user_id, [*hits, *near], max_tokens=budget_tokens)
        return hits, found, pinned

    hits, found, pinned = await db.read(work)
    if hidden is not None:
        pk, seq = hidden
        hits = [h for h in hits if not (h.conversation_pk == pk and h.seq >= seq)]
        found = [f for f in found if not (f.conversation_pk == pk and f.seq >= seq)]
    turns = [
        Turn(f.pk, f.conversation_id, f.seq, f.role, f.text, f.tokens, f.created_at) for f in found
    ]
    ranked = rank(_scores(hits, near, found, semantic), turns, now=now, exclude=exclude)
    facts = [m.text for m in pinned]
    room = budget_tokens - (count_text("\n".join(facts)) + 10 * len(facts) if facts else 0)
    excerpts, kept, text, tokens = fit(pack(ranked, room), budget_tokens, facts)
    if not excerpts and not kept:
        return NOTHING
    return Recall(excerpts, Recalled(text, tokens), [m.id for m in pinned[: len(kept)]])


def _scores(
    hits: Sequence[Hit], near: Sequence[Hit], found: Sequence[Found], semantic: SemanticQuery | None
) -> dict[int, float]:
    """The scores `rank` takes: the full-text ones, fused with the vector hits' (those whose
    messages were read back, so still there and visible) when embeddings are on."""
    lexical = {h.pk: h.score for h in hits}
    if semantic is None:
        return lexical
    there = {f.pk for f in found}
    vector = {h.pk: h.score for h in near if h.pk in there}
    return hybrid_scores(lexical, vector, semantic_weight=semantic.weight)
