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

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection

from policies.vectors import EMBED_MEMORIES_KIND, EMBED_PASSAGES_KIND
from proxy.background.item_embedder import ItemEmbedder, Pending
from storage.records import JobRecord
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.jobs import Jobs
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.vectors import NewVector


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


class MemoryEmbedder(ItemEmbedder):
    """The handler of `embed_memories` jobs, for every tenant."""

    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        found = MemoryVectors(conn).unembedded(job.tenant_id, job.user_id, model, limit=self.chunk)
        return [Pending(m.pk, 0, m.text, m.id) for m in found]

    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        stored = MemoryVectors(conn).store(job.tenant_id, job.user_id, model, rows, now=_now())
        self.metrics.embedded_items.labels(job.tenant_id, "memory").inc(stored)
        return stored

    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> dict[str, Any]:
        # (Named by where it goes on: memory ids are random, never reused; a row's pk would
        # tell how many memories all tenants have.)
        queue_memories(conn, job.tenant_id, job.user_id, f"after:{last.id}", now=_now())
        return {"continued": True}


class PassageEmbedder(ItemEmbedder):
    """The handler of `embed_passages` jobs, for every tenant."""

    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        payload = job.payload or {}
        found = ChunkVectors(conn).unembedded(
            job.tenant_id,
            job.user_id,
            str(payload.get("attachment_id")),
            model,
            first_seq=int(payload.get("first_seq") or 0),
            limit=self.chunk,
        )
        return [Pending(c.pk, c.seq, c.text) for c in found]

    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        stored = ChunkVectors(conn).store(job.tenant_id, job.user_id, model, rows, now=_now())
        self.metrics.embedded_items.labels(job.tenant_id, "passage").inc(stored)
        return stored

    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> dict[str, Any]:
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
        return {"continued": True}
