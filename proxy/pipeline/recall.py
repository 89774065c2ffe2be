"""Recall on the request path: search the user's stored turns and memories (one read), rank
and pack them (policies/recall.py, policies/memories.py) into the recall share of the budget.

Memories come first: every pinned one, then the others most relevant to the turn (by words,
and by meaning when the question was embedded and the memories were), up to `memory_share` of
the recall budget together; excerpts of stored turns get the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection

from policies.context import Recalled
from policies.dates import asked_period, favour_period
from policies.fusion import hybrid_scores
from policies.memories import rank_by_words_and_meaning, stem
from policies.public_ids import MESSAGE, PublicIds
from policies.recall import (
    WIDE_RADIUS,
    Excerpt,
    Turn,
    fit,
    pack,
    query_terms,
    rank,
    wide_hits,
)
from policies.tokens import count_text
from policies.trace import MAX_CANDIDATES
from proxy.background.semantic_query import SemanticQuery
from proxy.background.vector_index import Nearest
from storage.database import Database
from storage.records import MemoryRecord
from storage.repositories.memories import Memories
from storage.repositories.search import Found, Hit, MessageSearch


@dataclass(frozen=True, slots=True)
class RecallTrace:
    """How recall chose, for the exchange's trace: the search terms, how many hits each search
    found, the best ranked turns (`candidates`: pk, conversation, seq, role, value, the
    search's score, whether the search found it, tokens) and the memories weighed."""

    terms: list[str]
    lexical_hits: int = 0
    vector_hits: int = 0
    semantic: bool = False
    candidates: list[tuple[int, str, int, str, float, float | None, bool, int]] = field(
        default_factory=list
    )
    ranked: int = 0  # turns ranked in all
    memories_considered: int = 0
    memory_tokens: int = 0  # of the memories attached (their lines, as budgeted)


@dataclass(frozen=True, slots=True)
class Recall:
    excerpts: list[Excerpt]
    section: Recalled | None
    memories: list[str] = field(default_factory=list)  # ids of the pinned memories attached
    known: list[str] = field(default_factory=list)  # ids of the other memories attached
    memory_pks: list[int] = field(default_factory=list)  # of all attached (access counts)
    trace: RecallTrace | None = None

    @property
    def messages(self) -> int:
        """Recalled turns and memories (what `x-memory-memories` counts)."""
        return sum(len(e.turns) for e in self.excerpts) + len(self.memories) + len(self.known)

    def record(self, ids: PublicIds) -> list[dict[str, object]]:
        """What the exchange record says was recalled (messages by their public ids)."""
        turns: list[dict[str, object]] = [
            {
                "message": ids.format(MESSAGE, t.pk),
                "conversation_id": t.conversation,
                "hit": t.pk in e.hits,
            }
            for e in self.excerpts
            for t in e.turns
        ]
        return (
            turns
            + [{"memory": memory_id, "pinned": True} for memory_id in self.memories]
            + [{"memory": memory_id, "pinned": False} for memory_id in self.known]
        )


NOTHING = Recall([], None)
# Memories that share a word with the turn, read to be ranked.
MEMORY_CANDIDATES = 200
# Pinned memories read on every turn, oldest first (what fits the budget of them goes).
MAX_PINNED = 100
# A memory's framing in the section ("> - " and the line), beyond its text's tokens.
MEMORY_LINE_TOKENS = 4


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
    memory_share: float = 0.25,
    semantic: SemanticQuery | None = None,
    excerpts: bool = True,
) -> Recall:
    """Excerpts of the user's stored turns relevant to `text`, within `budget_tokens`.
    `conversation_pk` keeps the search to one conversation (an anonymous user's); `hidden`
    (conversation pk, seq) leaves out that conversation's messages from that seq on.
    `semantic` (embeddings on) adds the nearest stored messages and memories by vector,
    fused with the full-text hits by score (policies/fusion.py); then the strongest hits of
    either search reach wide windows, every turn ranked is weighed by its own similarity to the
    question too, and the hits said in a time the question names count more
    (policies/dates.py). Without `excerpts`, only memories are attached."""
    terms = query_terms(text)
    if budget_tokens <= 0:
        return NOTHING
    with_memories = conversation_pk is None  # not for the anonymous user
    vectors: list[Nearest] = []  # the vector search, made in the same snapshot as the reads
    wide: set[int] = set()  # the hits read with a wide window around them
    near_memories: dict[int, float] = {}  # memory pk -> similarity, of those read back

    def work(
        conn: Connection,
    ) -> tuple[list[Hit], list[Found], list[MemoryRecord], list[MemoryRecord]]:
        pinned: list[MemoryRecord] = []
        others: list[MemoryRecord] = []
        if with_memories:
            # (both read in one statement)
            stems = sorted({stem(t) for t in terms}) if memory_share > 0 else []
            pinned, others = Memories(conn).pinned_and_relevant(
                tenant_id, user_id, stems, pinned=MAX_PINNED, limit=MEMORY_CANDIDATES
            )
            if semantic is not None and memory_share > 0:
                others = _with_near_memories(
                    conn, semantic, tenant_id, user_id, others, near_memories
                )
        if not excerpts or (not terms and semantic is None):
            return [], [], pinned, others
        search = MessageSearch(conn)
        hits = search.search(
            tenant_id, user_id, terms, limit=candidates, conversation_pk=conversation_pk
        )
        near: list[Hit] = []
        if semantic is not None:
            vectors.append(
                semantic.search(
                    conn, tenant_id, user_id, limit=candidates, conversation_pk=conversation_pk
                )
            )
            near = vectors[0].message_hits()
        wide.update(wide_hits(_scores(hits, near, semantic), budget_tokens))
        found = search.around(
            tenant_id,
            user_id,
            [*hits, *near],
            radius=1,
            further_after=1,
            max_tokens=budget_tokens,
            wide=[h for h in [*hits, *near] if h.pk in wide],
            wide_radius=WIDE_RADIUS,
        )
        return hits, found, pinned, others

    hits, found, pinned, others = await db.read(work)
    if hidden is not None:
        pk, seq = hidden
        hits = [h for h in hits if not (h.conversation_pk == pk and h.seq >= seq)]
        found = [f for f in found if not (f.conversation_pk == pk and f.seq >= seq)]
    turns = [
        Turn(f.pk, f.conversation_id, f.seq, f.role, f.text, f.tokens, f.created_at) for f in found
    ]
    said = {f.pk: f.created_at for f in found}
    near = [h for h in vectors[0].message_hits() if h.pk in said] if vectors else []  # still there
    scores = _scores(hits, near, semantic)
    meaning: dict[int, float] | None = None
    if near:  # Without embeddings, or before anything is embedded, recall ranks as it did.
        scores = favour_period(scores, said, asked_period(text, now))
        meaning = vectors[0].of(said.keys())
    ranked = rank(scores, turns, now=now, terms=terms, exclude=exclude, wide=wide, meaning=meaning)
    costs: dict[int, int] = {}  # memory pk -> its line's tokens, as budgeted
    # The user's pinned instructions go in a section of their own (policies/recall.py).
    standing = [m for m in pinned if m.kind == "instruction"]
    pinned = [m for m in pinned if m.kind != "instruction"]
    facts = [m.text for m in pinned]
    for m in [*standing, *pinned]:
        costs[m.pk] = count_text(m.text) + MEMORY_LINE_TOKENS
    used = sum(costs.values())
    known: list[MemoryRecord] = []
    memory_room = int(budget_tokens * memory_share) - used
    by_pk = {m.pk: m for m in others}
    weight = semantic.weight if semantic is not None else 0.0
    ranked_memories = rank_by_words_and_meaning(
        terms, [(m.pk, m.text) for m in others], near_memories, weight=weight
    )
    for memory in (by_pk[pk] for pk in ranked_memories):
        cost = count_text(memory.text) + MEMORY_LINE_TOKENS
        if cost > memory_room:
            break
        known.append(memory)
        costs[memory.pk] = cost
        memory_room -= cost
        used += cost
    headings = (10 if facts else 0) + (10 if known else 0) + (30 if standing else 0)
    room = budget_tokens - used - headings
    fitted = fit(
        pack(ranked, room),
        budget_tokens,
        facts,
        [m.text for m in known],
        [m.text for m in standing],
    )
    shown = standing[: len(fitted.standing)] + pinned[: len(fitted.memories)]
    attached = shown + known[: len(fitted.known)]
    trace = RecallTrace(
        terms,
        len(hits),
        len(near),
        semantic is not None,
        [
            (t.pk, t.conversation, t.seq, t.role, e.value, scores.get(t.pk), bool(e.hits), t.tokens)
            for e in ranked[:MAX_CANDIDATES]
            for t in e.turns
        ],
        len(ranked),
        len(standing) + len(pinned) + len(others),
        sum(costs[m.pk] for m in attached),
    )
    if not (fitted.excerpts or fitted.memories or fitted.known or fitted.standing):
        return Recall([], None, trace=trace)
    return Recall(
        fitted.excerpts,
        Recalled(fitted.text, fitted.tokens),
        [m.id for m in shown],
        [m.id for m in known[: len(fitted.known)]],
        [m.pk for m in attached],
        trace,
    )


def _with_near_memories(
    conn: Connection,
    semantic: SemanticQuery,
    tenant_id: str,
    user_id: str,
    others: list[MemoryRecord],
    similarity: dict[int, float],
) -> list[MemoryRecord]:
    """`others` (the memories that share a word with the turn) with the user's unpinned
    memories nearest the question, read back in the same snapshot (what is gone or pinned
    since it was embedded does not count), newest first; `similarity` gets each one's."""
    near = semantic.memories(conn, tenant_id, user_id, limit=MEMORY_CANDIDATES)
    if not near:
        return others
    have = {m.pk for m in others}
    more = Memories(conn).unpinned_of(tenant_id, user_id, [pk for pk in near if pk not in have])
    both = sorted([*others, *more], key=lambda m: -m.pk)
    similarity.update({m.pk: near[m.pk] for m in both if m.pk in near})
    return both


def _scores(
    hits: Sequence[Hit], near: Sequence[Hit], semantic: SemanticQuery | None
) -> dict[int, float]:
    """The full-text hits' scores, fused with the vector hits' when embeddings are on."""
    lexical = {h.pk: h.score for h in hits}
    if semantic is None:
        return lexical
    vector = {h.pk: h.score for h in near}
    return hybrid_scores(lexical, vector, semantic_weight=semantic.weight)
