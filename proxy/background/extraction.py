"""Memory extraction, the background job: after an exchange of a named user is stored (mode
`full`, `memory.extract: llm`), a job asks the tenant's memory model which memories it holds,
given the similar ones the user has, and applies its decisions (policies/extraction.py).

The model call runs outside any transaction and is charged to the exchange (`extraction` in
its cost parts) whatever it answered; the decisions are written in the transaction that ends
the job, each one checked again against the memory as it is then (the user may have pinned,
edited or deleted it meanwhile). A reply that cannot be used fails the attempt with the reply
kept on the job, so the queue retries it and finally dead-letters it with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.extraction import (
    BadExtraction,
    Decision,
    Known,
    Rejected,
    extraction_request,
    parse_decisions,
    spellings,
    turn_of,
)
from policies.memories import rank_memories, stem
from policies.recall import query_terms
from policies.tokens import message_text
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.metrics import Metrics
from proxy.background.embedding_items import queue_memories
from proxy.background.embeddings import Embeddings
from proxy.background.jobs import Apply, JobFailed, ask_model
from proxy.core.config import Config
from proxy.pipeline.turn import ANONYMOUS
from proxy.upstream.base import Upstream
from storage.database import Database
from storage.errors import StorageError
from storage.records import JobRecord, MemoryRecord, MessageRecord
from storage.repositories.conversations import Conversations
from storage.repositories.memories import Memories, new_memory_id

log = structlog.get_logger("memproxy.extraction")
# The message before the exchange's turn, which it may answer ("yes, I am").
CONTEXT_MESSAGES = 1
CANDIDATES = 200


class MemoryExtractor:
    """The handler of `extract_memories` jobs, for every tenant."""

    def __init__(
        self,
        config: Config,
        upstreams: Mapping[str, Upstream],
        db: Database,
        charges: MemoryCharges,
        metrics: Metrics,
        embeddings: Embeddings | None = None,
    ) -> None:
        self.config, self.db, self.charges, self.metrics = config, db, charges, metrics
        self.embeddings = embeddings
        self._upstreams = {
            name: upstreams[tenant.memory.upstream or tenant.upstream]
            for name, tenant in config.tenants.items()
            if tenant.memory.extract == "llm"
        }

    def wanted(self, tenant_id: str, user_id: str, mode: str) -> bool:
        """Whether an exchange of this user, stored in this mode, is to be extracted from."""
        return tenant_id in self._upstreams and mode == "full" and user_id != ANONYMOUS

    async def __call__(self, job: JobRecord) -> Apply:
        tenant = self.config.tenants.get(job.tenant_id)
        upstream = self._upstreams.get(job.tenant_id)
        if tenant is None or upstream is None:
            raise JobFailed("extraction is off for this tenant now")
        settings = tenant.memory
        messages, known, versions = await self.db.read(
            lambda conn: self._read(conn, job, settings.similar_memories)
        )
        if not messages:
            # Erased, or its conversation deleted, since: there is nothing to learn from.
            return lambda conn: {"skipped": "the exchange's messages are gone"}
        body = extraction_request(settings.model, [m.to_openai() for m in messages], known)
        answer = await ask_model(
            upstream, body, seconds=settings.timeout_seconds, what="the memory model"
        )
        try:
            await self.charges.charge(
                job.tenant_id, job.ref, kind="extraction", model=settings.model, usage=answer.usage
            )
        except StorageError as exc:
            log.error("extraction_cost_not_recorded", job=job.pk, error=str(exc))
        try:
            decisions, rejected = parse_decisions(answer.content, known)
        except BadExtraction as exc:
            raise JobFailed(str(exc), output=answer.output) from exc
        return lambda conn: self._apply(conn, job, settings.model, decisions, rejected, versions)

    def _read(
        self, conn: Connection, job: JobRecord, similar: int
    ) -> tuple[Sequence[MessageRecord], list[Known], dict[str, datetime]]:
        """The exchange's turn (with the message before it) and reply, the user's memories
        most like them, and when each of those was last changed."""
        stored = Conversations(conn).exchange_messages(
            job.tenant_id, job.ref, before=CONTEXT_MESSAGES
        )
        start, turn = turn_of([m.role for m in stored], CONTEXT_MESSAGES)
        messages = stored[start:]
        if not messages or similar == 0:
            return messages, [], {}
        # The turn's words first: a long reply's must not crowd them out of the search.
        first = [stored[turn], *(m for m in messages if m is not stored[turn])]
        text = " ".join(message_text(m.to_openai()) for m in first)
        terms = query_terms(text)
        memories = Memories(conn)
        found = memories.find(
            job.tenant_id,
            job.user_id,
            limit=CANDIDATES,
            terms=sorted({stem(t) for t in terms}),
        )
        chosen = rank_memories(terms, [(m, m.text) for m in found])[:similar]
        if len(chosen) < similar:  # a user with few memories: show the newest too
            ids = {m.id for m in chosen}
            for m in memories.find(job.tenant_id, job.user_id, limit=similar):
                if len(chosen) >= similar:
                    break
                if m.id not in ids:
                    chosen.append(m)
        known = [Known(m.id, m.kind, m.text, m.pinned) for m in chosen]
        return messages, known, {m.id: m.updated_at for m in chosen}

    def _apply(
        self,
        conn: Connection,
        job: JobRecord,
        model: str,
        decisions: list[Decision],
        rejected: list[Rejected],
        shown: Mapping[str, datetime],
    ) -> dict[str, Any]:
        """Write the decisions; `shown`: when each memory the model was shown last changed."""
        memories, now = Memories(conn), datetime.now(UTC)
        memories.lock_user(job.tenant_id, job.user_id)  # (before `_one` checks for repeats)
        applied: list[dict[str, Any]] = []
        refused = [r.as_dict() for r in rejected]
        for decision in decisions:
            memory_id, refusal = self._one(memories, job, decision, shown, now)
            if refusal is None:
                applied.append({**decision.as_dict(), "id": memory_id})
            else:
                refused.append({"decision": decision.as_dict(), "reason": refusal})
            self.metrics.memory_decisions.labels(
                job.tenant_id, decision.action, "yes" if refusal is None else "no"
            ).inc()
        for r in rejected:
            action = r.decision.get("action") if isinstance(r.decision, dict) else None
            label = action if action in ("add", "update", "delete") else "invalid"
            self.metrics.memory_decisions.labels(job.tenant_id, label, "no").inc()
        written = any(a["action"] in ("add", "update") for a in applied)
        if (
            written
            and self.embeddings
            and self.embeddings.wanted(job.tenant_id, job.user_id, "full", ANONYMOUS)
        ):  # (their text embedded too, charged to the same exchange)
            queue_memories(conn, job.tenant_id, job.user_id, job.ref, now=now, exchange_id=job.ref)
        return {"model": model, "applied": applied, "rejected": refused}

    @staticmethod
    def _one(
        memories: Memories,
        job: JobRecord,
        d: Decision,
        shown: Mapping[str, datetime],
        now: datetime,
    ) -> tuple[str | None, str | None]:
        """Apply one decision: (the memory's id, None), or (None, why not). An update or delete
        is for the memory as the model saw it: not once it is gone, pinned or edited since. An
        add, or an update's new text, that the user's memories hold already (another job of
        theirs stored it meanwhile, say) is not written again."""
        if d.text is not None:
            same = memories.with_text(job.tenant_id, job.user_id, spellings(d.text))
            if set(same) - {d.memory_id}:
                return None, "already remembered"
        if d.action == "add":
            assert d.text is not None
            memory = memories.create(
                job.tenant_id,
                job.user_id,
                new_memory_id(),
                d.text,
                now=now,
                kind=d.kind,
                confidence=d.confidence,
                source_exchange_id=job.ref,
            )
            return memory.id, None
        assert d.memory_id is not None
        current: MemoryRecord | None = memories.get(job.tenant_id, d.memory_id, job.user_id)
        if current is None:
            return None, "the memory is gone"
        if current.pinned:
            return None, "the memory was pinned meanwhile"
        if current.updated_at != shown.get(d.memory_id):
            return None, "the memory was edited meanwhile"
        if d.action == "delete":
            memories.delete(job.tenant_id, d.memory_id)
            return d.memory_id, None
        fields: dict[str, Any] = {"text": d.text, "kind": d.kind}
        if d.confidence is not None:
            fields["confidence"] = d.confidence
        memories.update(job.tenant_id, d.memory_id, now=now, **fields)
        return d.memory_id, None
