"""Embedding memories and attachments' passages, the background jobs (`embed_memories`,
`embed_passages`), off the request path, as stored messages are (embedding_jobs.py).

- `embed_memories`: queued when a memory is created or its text edited (the management API,
  in the transaction that writes it) and when an extraction job applies its decisions. A job
  embeds the user's memories still without a vector of the tenant's model, whichever job
  queued them: a burst of writes is embedded by the first job in one batch, the others find
  nothing left.
- `embed_passages`: queued when an attachment is stored (uploaded, or inline in a request of
  mode `full`); a job embeds its passages in document order.

Each job embeds up to `CHUNK` items in one batch of the tenant's `Embedder` and queues a job for
the rest; the vectors are written in the transaction that ends the job, only for items still
there (a memory: still saying what was embedded). Only named users' items are embedded (the
`anonymous` user gets no recall by meaning), and only for tenants with embeddings on. An
upstream's embedding call is charged as it is made, to the exchange that caused it, if any.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.pricing import Usage
from policies.vectors import EMBED_MEMORIES_KIND, EMBED_PASSAGES_KIND, BadVector, encode
from proxy.accounting.charges import EMBEDDING, MemoryCharges
from proxy.accounting.metrics import Metrics
from proxy.background.embedding_jobs import CHUNK
from proxy.background.embeddings import EmbeddingError, Embeddings
from proxy.background.jobs import Apply, JobFailed
from storage.database import Database
from storage.errors import StorageError
from storage.records import JobRecord
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.jobs import Jobs
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.vectors import NewVector

log = structlog.get_logger("memproxy.embedding_jobs")


def _now() -> datetime:
    return datetime.now(UTC)


def queue_memories(
    conn: Connection,
    tenant_id: str,
    user_id: str,
    ref: str,
    *,
    now: datetime,
    exchange_id: str | None = None,
) -> bool:
    """Queue embedding of the user's memories not embedded yet, in the caller's transaction.
    `ref` names what queued it (a memory's id and version, an exchange), so a retried write
    queues it once; `exchange_id`: the exchange its cost is charged to."""
    payload = {"exchange_id": exchange_id} if exchange_id else {}
    return Jobs(conn).enqueue(
        tenant_id, user_id, EMBED_MEMORIES_KIND, ref, now=now, payload=payload
    )


def queue_passages(
    conn: Connection,
    tenant_id: str,
    user_id: str,
    attachment_id: str,
    *,
    now: datetime,
    first_seq: int = 0,
    exchange_id: str | None = None,
    name: str = "",
) -> bool:
    """Queue embedding of an attachment's passages from `first_seq` on, in the caller's
    transaction (`name`: the catch-up's jobs are named apart)."""
    payload: dict[str, Any] = {"attachment_id": attachment_id, "first_seq": first_seq}
    if exchange_id:
        payload["exchange_id"] = exchange_id
    ref = f"{name}{attachment_id}:{first_seq}"
    return Jobs(conn).enqueue(
        tenant_id, user_id, EMBED_PASSAGES_KIND, ref, now=now, payload=payload
    )


@dataclass(frozen=True, slots=True)
class Pending:
    """An item to embed: its pk, where it is (a passage's seq), its text, and its public id
    (a memory's: what names the job that goes on after it)."""

    pk: int
    seq: int
    text: str
    id: str = ""


class _ItemEmbedder(ABC):
    """What both handlers share: read what is pending, embed it in one batch, charge it, and
    store the vectors with the job's end."""

    def __init__(
        self, embeddings: Embeddings, db: Database, metrics: Metrics, charges: MemoryCharges
    ) -> None:
        self.embeddings, self.db, self.metrics, self.charges = embeddings, db, metrics, charges

    @abstractmethod
    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        """Up to `CHUNK` of the job's items still without a `model` vector, in order."""

    @abstractmethod
    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        """Store the vectors of those items still there; how many."""

    @abstractmethod
    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> None:
        """A whole chunk was embedded: a job for what may be left."""

    async def _charge(self, job: JobRecord, model: str, usage: Usage | None) -> None:
        if usage is None:
            return
        exchange = (job.payload or {}).get("exchange_id")
        if not exchange:
            # Nothing to charge it to (an API write, a catch-up): in the budgets and metrics.
            _, usd = self.charges.priced(EMBEDDING, model, usage)
            self.charges.count(job.tenant_id, model, usage, usd, EMBEDDING)
            return
        try:
            await self.charges.charge(
                job.tenant_id, str(exchange), kind=EMBEDDING, model=model, usage=usage
            )
        except StorageError as exc:
            log.error("embedding_cost_not_recorded", job=job.pk, error=str(exc))

    async def __call__(self, job: JobRecord) -> Apply:
        embedder = self.embeddings.embedder(job.tenant_id)
        if embedder is None:
            return lambda conn: {"skipped": "embeddings are off for this tenant now"}
        model = embedder.model
        pending = await self.db.read(lambda conn: self.pending(conn, job, model))
        if not pending:
            # Embedded already (by another job of the user's), or deleted since.
            return lambda conn: {"model": model, "embedded": 0}
        try:
            embedded = await embedder.embed([p.text for p in pending])
        except EmbeddingError as exc:
            await self._charge(job, model, exc.paid)
            raise JobFailed(str(exc)) from exc
        await self._charge(job, model, embedded.usage)
        try:
            rows = [
                NewVector(p.pk, encode(v), len(v), p.text)
                for p, v in zip(pending, embedded.vectors, strict=True)
            ]
        except (BadVector, ValueError) as exc:
            raise JobFailed(str(exc)) from exc

        def apply(conn: Connection) -> dict[str, Any]:
            stored = self.store(conn, job, model, rows)
            result: dict[str, Any] = {"model": model, "embedded": stored}
            if len(pending) == CHUNK:
                self.queue_rest(conn, job, pending[-1])
                result["continued"] = True
            return result

        return apply


class MemoryEmbedder(_ItemEmbedder):
    """The handler of `embed_memories` jobs, for every tenant."""

    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        found = MemoryVectors(conn).unembedded(job.tenant_id, job.user_id, model, limit=CHUNK)
        return [Pending(m.pk, 0, m.text, m.id) for m in found]

    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        stored = MemoryVectors(conn).store(job.tenant_id, job.user_id, model, rows, now=_now())
        self.metrics.embedded_items.labels(job.tenant_id, "memory").inc(stored)
        return stored

    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> None:
        # (Named by where it goes on: memory ids are random, never reused; a row's pk would
        # tell how many memories all tenants have.)
        queue_memories(conn, job.tenant_id, job.user_id, f"after:{last.id}", now=_now())


class PassageEmbedder(_ItemEmbedder):
    """The handler of `embed_passages` jobs, for every tenant."""

    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        payload = job.payload or {}
        found = ChunkVectors(conn).unembedded(
            job.tenant_id,
            job.user_id,
            str(payload.get("attachment_id")),
            model,
            first_seq=int(payload.get("first_seq") or 0),
            limit=CHUNK,
        )
        return [Pending(c.pk, c.seq, c.text) for c in found]

    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        stored = ChunkVectors(conn).store(job.tenant_id, job.user_id, model, rows, now=_now())
        self.metrics.embedded_items.labels(job.tenant_id, "passage").inc(stored)
        return stored

    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> None:
        payload = job.payload or {}
        queue_passages(
            conn,
            job.tenant_id,
            job.user_id,
            str(payload.get("attachment_id")),
            now=_now(),
            first_seq=last.seq + 1,
            exchange_id=payload.get("exchange_id"),
        )
