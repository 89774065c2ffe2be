"""What a turn's artifacts are made of: the conversation's newest attachments, the stored ones
the request names and the conversation's earlier tool results, read in one unit of work (of a
document larger than the budget only what can go in); the artifacts made of them, and each
passage's relevance to the question. Also storing a request's inline documents.

A stored passage's relevance is its full-text score, fused (policies/fusion.py) with its
cosine similarity to the question when the turn's question was embedded (the same vector
recall uses) and the passage has a vector of that model: a passage that says what the question
asks in other words is found too. Without vectors it is the full-text score alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from policies.artifact_prompts import SUMMARY_SOURCE_CHARS
from policies.artifacts import Artifact, Passage, Relevance, score_passages
from policies.chunks import counted_chunks
from policies.fusion import hybrid_scores
from policies.model_json import clip, text_of
from proxy.background.embedding_items import queue_passages
from proxy.background.semantic_query import SemanticQuery
from proxy.core.requests import Inline
from storage.records import AttachmentRecord, ChunkRecord, MessageRecord
from storage.repositories.attachments import Attachments, ChunkHit, new_attachment_id
from storage.repositories.conversations import Conversations

MAX_ATTACHMENTS = 50  # of a conversation, considered per turn
SEARCH_HITS = 200
OPENING_PASSAGES = 3  # read of a document larger than the budget, besides its matches
TOOL_WINDOW = 200  # stored messages looked through for earlier tool results


@dataclass(frozen=True, slots=True)
class Sources:
    """What a turn's artifacts are made of, read in one go."""

    stored: list[AttachmentRecord]
    chunks: list[ChunkRecord]  # all of those that may go whole; of the rest, hits and openings
    counts: dict[int, int]  # attachment pk -> its number of chunks, for those read in part
    tools: Sequence[MessageRecord]


NO_SOURCES = Sources([], [], {}, [])


def content_hash(text: str) -> str:
    """What a document's text is known by (as its stored attachment records it)."""
    return hashlib.sha256(text.encode()).hexdigest()


Chunked = Sequence[tuple[Inline, list[tuple[str, int]]]]


def store_documents(
    conn: Connection,
    *,
    request_id: str,
    tenant_id: str,
    user_id: str,
    conversation_pk: int,
    documents: Chunked,
    now: datetime,
    embed: bool = False,
) -> None:
    """Store a request's inline documents (with their passages, `chunked`) with its
    conversation; one the conversation has already (the same text) is not stored again.
    `embed`: queue the embedding of their passages (the tenant has embeddings on)."""
    repo = Attachments(conn)
    have = repo.content_hashes(tenant_id, conversation_pk)
    for doc, chunks in documents:
        content = doc.content or ""
        if content_hash(content) in have:
            continue
        have.add(content_hash(content))
        created = repo.create(
            tenant_id,
            user_id,
            conversation_pk,
            new_attachment_id(),
            content=content,
            chunks=chunks,
            now=now,
            origin="inline",
            title=doc.title,
            source=doc.source,
            exchange_id=request_id,
        )
        if embed:
            queue_passages(conn, tenant_id, user_id, created.id, now=now, exchange_id=request_id)


def read_sources(
    conn: Connection,
    tenant_id: str,
    user_id: str,
    conversation_pk: int | None,
    tools_after: int,
    refs: Sequence[str],
    terms: Sequence[str],
    tool_results: int,
    budget: int,
    semantic: SemanticQuery | None = None,
) -> tuple[Sources, dict[tuple[int, int], float]]:
    """The sources, and the score of each stored passage that matches `terms` or, with
    `semantic`, is near the question ((attachment pk, seq) -> score)."""
    repo = Attachments(conn)
    stored = (  # the newest (this request's own among them), without their text
        repo.for_conversation(
            tenant_id, conversation_pk, limit=MAX_ATTACHMENTS, newest=True, with_content=False
        )
        if conversation_pk is not None
        else []
    )
    have = {a.id for a in stored}
    for attachment_id in refs:
        if attachment_id in have:
            continue
        found = repo.get(tenant_id, attachment_id)
        if found is None or found.user_id != user_id:  # (deleted since it was checked)
            continue
        stored.append(found)
        have.add(found.id)
    pks = [a.pk for a in stored]
    matched = repo.search(tenant_id, pks, terms, limit=SEARCH_HITS)
    if semantic is not None:  # (the index holds the user's own passages only)
        near = semantic.passages(conn, tenant_id, user_id, pks, limit=SEARCH_HITS)
        vector_hits = [ChunkHit(n.item_pk, n.group_pk, n.seq, n.score) for n in near]
        matched = _fused(matched, vector_hits, semantic.weight)
    hits = {(h.attachment_pk, h.seq): h.score for h in matched}
    # Only what can go in is read: a document larger than the budget never goes whole,
    # so of it only its matching passages and its opening (a preview; what goes when
    # nothing matches).
    large = {a.pk for a in stored if a.tokens > budget}
    chunks = repo.some_chunks(
        tenant_id,
        whole=[pk for pk in pks if pk not in large],
        openings=sorted(large),
        opening=OPENING_PASSAGES,
        chunk_pks=[h.pk for h in matched if h.attachment_pk in large],
    )
    counts = repo.chunk_counts(tenant_id, sorted(large))
    tools = (
        Conversations(conn).tool_results(
            tenant_id, conversation_pk, after_seq=tools_after, limit=tool_results
        )
        if conversation_pk is not None and tool_results
        else []
    )
    return Sources(stored, chunks, counts, tools), hits


def _fused(lexical: Sequence[ChunkHit], near: Sequence[ChunkHit], weight: float) -> list[ChunkHit]:
    """Full-text hits and vector hits (scored by similarity) as one list, best first, scored
    by `hybrid_scores` (by chunk pk); the full-text hits as they are without vector hits."""
    if not near:
        return list(lexical)
    where = {h.pk: h for h in [*near, *lexical]}
    scores = hybrid_scores(
        {h.pk: h.score for h in lexical},
        {h.pk: h.score for h in near},
        semantic_weight=weight,
    )
    return [
        ChunkHit(pk, where[pk].attachment_pk, where[pk].seq, score)
        for pk, score in sorted(scores.items(), key=lambda kv: -kv[1])
    ]


def artifacts_of(sources: Sources, in_prompt_calls: set[str]) -> list[Artifact]:
    """The stored attachments and the tool results the prompt does not hold already (by
    their call ids, `in_prompt_calls`) as artifacts. Chunks tool results: CPU work."""
    by_attachment: dict[int, list[ChunkRecord]] = {}
    for chunk in sources.chunks:
        by_attachment.setdefault(chunk.attachment_pk, []).append(chunk)
    artifacts = [
        Artifact(
            a.id,
            "attachment",
            a.title,
            a.tokens,
            tuple(Passage(c.seq, c.text, c.tokens) for c in by_attachment.get(a.pk, [])),
            a.content_hash,
            sources.counts.get(a.pk, 0),
        )
        for a in sources.stored
    ]
    for message in sources.tools:
        # (without a call id, by its place in the conversation: its key would count all rows)
        call = message.tool_call_id or f"message_{message.seq}"
        if call in in_prompt_calls:
            continue  # the prompt holds it already
        content = text_of(message.content)
        if not content.strip():
            continue
        chunks = counted_chunks(clip(content, SUMMARY_SOURCE_CHARS))
        title = message.name or f"tool result {call}"
        artifacts.append(
            Artifact.of_text(f"tool:{call}", "tool_result", title, chunks, content_hash(content))
        )
    return artifacts


def relevance_of(
    artifacts: Sequence[Artifact],
    sources: Sources,
    hits: Mapping[tuple[int, int], float],
    question: str,
) -> Relevance:
    """Stored attachments by the database's search (the same full-text search as recall);
    the rest (inline documents not stored, tool results) by the same BM25 in Python. Each
    source's scores are taken relative to its best, so they compare."""
    relevance = Relevance()
    pk_of = {a.id: a.pk for a in sources.stored}
    best = max(hits.values(), default=0.0) or 1.0
    unindexed = [a for a in artifacts if a.key not in pk_of]
    for artifact in artifacts:
        if artifact.key in pk_of:
            for passage in artifact.passages:
                score = hits.get((pk_of[artifact.key], passage.seq), 0.0)
                if score > 0:
                    relevance.scores[(artifact.key, passage.seq)] = score / best
    scored = score_passages(question, unindexed)
    top = max(scored.scores.values(), default=0.0) or 1.0
    relevance.scores.update({k: v / top for k, v in scored.scores.items()})
    return relevance
