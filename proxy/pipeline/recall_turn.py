"""Recall for one turn: the question's embedding (started early, to overlap the turn's other
work) and the search of the user's memories and stored turns (pipeline/recall.py) within
recall's share of the budget, leaving out what the prompt already holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from policies.context import StoredTurn
from policies.tokens import message_text
from proxy.background.embeddings import EMBED_CHARS, Vector
from proxy.background.semantic_query import SemanticQuery
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.recall import NOTHING, Recall, recall
from proxy.pipeline.turn import ANONYMOUS, Turn, now
from storage.errors import StorageError
from storage.repositories.search import searchable_text

log = structlog.get_logger("memproxy.pipeline")
# Recall ranks one search hit per this many tokens of its budget, unless configured.
TOKENS_PER_CANDIDATE = 40
MAX_CANDIDATES = 500


@dataclass(frozen=True, slots=True)
class TurnRecall:
    found: Recall
    failed: bool = False  # the read failed or was too slow
    ms: float | None = None


def embed_question(req: TurnRequest) -> asyncio.Task[Vector | None] | None:
    """Start embedding the newest user message when the turn's searches will want it (the
    tenant has embeddings on, the user is named, memory is not off): it runs while the turn is
    stored and classified, and recall (stored turns, memories) and the attachments' passages
    all use this one vector."""
    tenant, messages = req.principal.tenant, req.turn.messages
    if (
        tenant.memory.embeddings == "off"
        or req.identity.mode == "off"
        or req.user_id == ANONYMOUS
        or not messages
        or messages[-1].get("role") != "user"
    ):
        return None
    text = message_text(messages[-1])[:EMBED_CHARS]
    return asyncio.ensure_future(
        req.services.embeddings.query(req.tenant_id, text, request_id=req.request_id)
    )


async def semantic_query(
    req: TurnRequest, question: asyncio.Task[Vector | None] | None
) -> SemanticQuery | None:
    """The searches' vector half, when the question's embedding arrived in time (awaited by
    whichever search asks first; the others find it done)."""
    index = req.services.vectors
    if question is None or index is None:
        return None
    vector = await question  # bounded by the tenant's embedding_timeout_ms; never raises
    if vector is None:
        return None
    memory = req.principal.tenant.memory
    return SemanticQuery(
        index,
        vector.model,
        vector.values,
        weight=memory.embedding_weight,
        min_similarity=memory.embedding_min_similarity,
    )


async def recall_for(
    req: TurnRequest,
    turn: Turn | None,
    history: list[StoredTurn],
    budget: int,
    question: asyncio.Task[Vector | None] | None,
    *,
    shown: Sequence[str] = (),
) -> TurnRecall:
    """The user's memories and the stored turns of their conversations that match this one,
    within `budget` tokens, leaving out what the prompt holds (the client's messages,
    `history`). Memories go with every call, a tool loop's too (those relevant to the user's
    turn it answers); stored turns are searched for a user's turn, when `context.recall` is
    on. `shown`: texts of stored turns the prompt holds in kept sections (left out too)."""
    ctx, messages = req.principal.tenant.context, req.turn.messages
    if turn is None or turn.mode == "off" or budget <= 0:
        return TurnRecall(NOTHING)
    anonymous = turn.user_id == ANONYMOUS
    search = ctx.recall and messages[-1].get("role") == "user"
    if anonymous and (turn.conversation is None or turn.opened or not search):
        # No memories and no cross-conversation recall for the anonymous user (and a
        # conversation this turn opened holds only what the prompt does).
        return TurnRecall(NOTHING)
    in_prompt = [
        searchable_text(str(m.get("role")), m.get("content")) or ""
        for m in [*messages, *(h.message for h in history)]
    ] + list(shown)
    started = time.perf_counter()
    semantic = await semantic_query(req, question)  # (memories use it without `search` too)
    if semantic is None and question is not None and req.services.vectors is not None:
        req.trace.degrade("embeddings", "the question was not embedded in time: words only")
    failed = False
    try:
        found = await req.services.memory.in_time(
            recall(
                req.services.db,
                tenant_id=turn.tenant_id,
                user_id=turn.user_id,
                text=last_user_text(messages),
                exclude=in_prompt,
                budget_tokens=budget,
                candidates=ctx.recall_candidates
                or min(MAX_CANDIDATES, max(10, budget // TOKENS_PER_CANDIDATE)),
                now=now(),
                conversation_pk=turn.conversation.pk if anonymous and turn.conversation else None,
                hidden=_hidden(req, turn),
                memory_share=ctx.memory_share,
                semantic=semantic,
                excerpts=search,
            )
        )
    except StorageError as exc:  # recall is an addition: without it the request goes on
        log.warning("recall_failed", request_id=req.request_id, error=str(exc))
        found, failed = NOTHING, True
    return TurnRecall(found, failed, round((time.perf_counter() - started) * 1000, 3))


def _hidden(req: TurnRequest, turn: Turn) -> tuple[int, int] | None:
    """What of the turn's own conversation recall leaves out, from which seq on: all of it
    when the prompt holds the conversation already (a Responses chain the upstream keeps, or
    memproxy sends again), else what this turn may not see (a replay's later messages)."""
    if turn.conversation is None:
        return None
    if not req.turn.attach_history:
        return (turn.conversation.pk, 0)
    if turn.visible_before is not None:
        return (turn.conversation.pk, turn.visible_before)
    return None


def last_user_text(messages: list[dict[str, object]]) -> str:
    """The newest user turn's text (a tool loop's calls answer it too)."""
    return next((message_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
