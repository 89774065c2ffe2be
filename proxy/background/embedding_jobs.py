"""Embedding stored messages, the background job (`embed_messages`), off the request path.

Queued with each stored exchange of a named user when the tenant has embeddings on (in the
transaction that stores the reply: proxy/pipeline/memory.py), and for messages imported or appended
through the management API (`queue_range`), so imported histories are recalled by meaning too.
A job embeds the messages still without a vector of the tenant's model, up to `CHUNK` per
attempt, and queues a job for the rest; the vectors are written in the transaction that ends
the job, and only for messages that are still there. An upstream's embedding call is charged
as it is made (`embedding` in the cost parts of the job's exchange, the tenant's budgets, the
metrics).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.pricing import Usage
from policies.vectors import EMBED_JOB_KIND, BadVector, encode
from proxy.accounting.charges import EMBEDDING, MemoryCharges
from proxy.accounting.metrics import Metrics
from proxy.background.embeddings import Embedded, EmbeddingError, Embeddings
from proxy.background.jobs import Apply, JobFailed
from storage.database import Database
from storage.errors import StorageError
from storage.records import JobRecord
from storage.repositories.jobs import Jobs
from storage.repositories.vectors import MessageVectors, NewVector, Unembedded

log = structlog.get_logger("memproxy.embedding_jobs")
# Messages embedded per attempt: an attempt stays well inside its lease with the local model
# on two cores (about 30 a second), and a large import is embedded in steps that each count.
CHUNK = 256


def _now() -> datetime:
    return datetime.now(UTC)


def queue_range(
    conn: Connection,
    tenant_id: str,
    user_id: str,
    conversation_pk: int,
    first_seq: int,
    last_seq: int | None,
    *,
    subject: str,
    now: datetime,
    name: str = "range",
) -> bool:
    """Queue embedding of a conversation's messages from `first_seq` to `last_seq` (None: to
    its end), in the caller's transaction. The job is named by the conversation (`subject`:
    `conversation_subject`) and its whole range: a range queued again (a retried import) is
    queued once, and one that starts where another ended (an append after an import's last
    chunk) is a job of its own. (`name`: the catch-up's ranges are named apart, so one is
    never taken for a range done earlier.)"""
    end = "" if last_seq is None else last_seq
    return Jobs(conn).enqueue(
        tenant_id,
        user_id,
        EMBED_JOB_KIND,
        f"{name}:{subject}:{first_seq}-{end}",
        now=now,
        payload={
            "conversation_pk": conversation_pk,
            "subject": subject,
            "first_seq": first_seq,
            "last_seq": last_seq,
        },
    )


class MessageEmbedder:
    """The handler of `embed_messages` jobs, for every tenant."""

    def __init__(
        self, embeddings: Embeddings, db: Database, metrics: Metrics, charges: MemoryCharges
    ) -> None:
        self.embeddings, self.db, self.metrics, self.charges = embeddings, db, metrics, charges

    def _pending(self, conn: Connection, job: JobRecord, model: str) -> list[Unembedded]:
        vectors = MessageVectors(conn)
        payload = job.payload or {}
        if "conversation_pk" in payload:
            return vectors.unembedded(
                job.tenant_id,
                job.user_id,
                model,
                conversation_pk=int(payload["conversation_pk"]),
                first_seq=int(payload.get("first_seq") or 0),
                last_seq=payload.get("last_seq"),
                limit=CHUNK,
            )
        return vectors.unembedded(
            job.tenant_id, job.user_id, model, exchange_id=job.ref, limit=CHUNK
        )

    async def _charge(self, job: JobRecord, model: str, usage: Usage | None) -> None:
        """Charge what the embedding used (None: nothing paid for), whatever becomes of the
        vectors."""
        if usage is None:
            return
        try:
            await self.charges.charge(
                job.tenant_id, job.ref, kind=EMBEDDING, model=model, usage=usage
            )
        except StorageError as exc:
            log.error("embedding_cost_not_recorded", job=job.pk, error=str(exc))

    async def __call__(self, job: JobRecord) -> Apply:
        embedder = self.embeddings.embedder(job.tenant_id)
        if embedder is None:
            return lambda conn: {"skipped": "embeddings are off for this tenant now"}
        model = embedder.model
        pending = await self.db.read(lambda conn: self._pending(conn, job, model))
        if not pending:
            # Embedded already, or erased / deleted since.
            return lambda conn: {"model": model, "embedded": 0}
        # A turn's question was embedded on the request path: its stored message is not again.
        known = [self.embeddings.recent(job.tenant_id, model, m.text) for m in pending]
        missing = [m.text for m, vector in zip(pending, known, strict=True) if vector is None]
        try:
            embedded = await embedder.embed(missing) if missing else Embedded([])
        except EmbeddingError as exc:
            await self._charge(job, model, exc.paid)
            raise JobFailed(str(exc)) from exc
        await self._charge(job, model, embedded.usage)
        made = iter(embedded.vectors)
        try:
            vectors = [vector if vector is not None else next(made) for vector in known]
            rows = [
                NewVector(m.pk, encode(v), len(v)) for m, v in zip(pending, vectors, strict=True)
            ]
        except (BadVector, ValueError, StopIteration) as exc:
            raise JobFailed(str(exc)) from exc

        def apply(conn: Connection) -> dict[str, Any]:
            stored = MessageVectors(conn).store(job.tenant_id, job.user_id, model, rows, now=_now())
            self.metrics.embedded_messages.labels(job.tenant_id).inc(stored)
            result: dict[str, Any] = {"model": model, "embedded": stored}
            last, payload = pending[-1], job.payload or {}
            through = payload.get("last_seq")
            # A whole chunk: there may be more, a job for the rest (if the range has one).
            if len(pending) == CHUNK and (through is None or last.seq < int(through)):
                queue_range(
                    conn,
                    job.tenant_id,
                    job.user_id,
                    last.conversation_pk,
                    last.seq + 1,
                    through,
                    # (a job queued before subjects named conversations: its pk, as it did)
                    subject=str(payload.get("subject") or last.conversation_pk),
                    now=_now(),
                )
                result["continued_from"] = last.seq + 1
            return result

        return apply
