"""What the embedding jobs share (`embed_messages`, `embed_memories`, `embed_passages`): read
up to `CHUNK` items still without a vector of the tenant's model, embed them in one batch,
charge the call, and store the vectors with the job's end, queueing a job for the rest when a
whole chunk was done. Each kind says where its items are (embedding_jobs.py,
embedding_items.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.pricing import Usage
from policies.vectors import BadVector, encode
from proxy.accounting.charges import EMBEDDING, MemoryCharges
from proxy.accounting.metrics import Metrics
from proxy.background.embeddings import Embedded, EmbeddingError, Embeddings
from proxy.background.jobs import Apply, JobFailed
from storage.database import Database
from storage.errors import StorageError
from storage.records import JobRecord
from storage.repositories.vectors import NewVector

log = structlog.get_logger("memproxy.embedding_jobs")
# Items embedded per attempt: an attempt stays well inside its lease with the local model
# on two cores (about 30 a second), and a large import is embedded in steps that each count.
CHUNK = 256


@dataclass(frozen=True, slots=True)
class Pending:
    """An item to embed: its pk, where it is (a message's or passage's seq), its text, its
    public id (a memory's: what names the job that goes on after it), its group (a
    message's conversation pk) and its source (a message's: the turn that stored it)."""

    pk: int
    seq: int
    text: str
    id: str = ""
    group: int = 0
    source: str = ""


class ItemEmbedder(ABC):
    """A job handler for one kind of item, for every tenant: read what is pending, embed it in
    one batch, charge it, and store the vectors with the job's end."""

    chunk = CHUNK  # items per attempt

    def __init__(
        self, embeddings: Embeddings, db: Database, metrics: Metrics, charges: MemoryCharges
    ) -> None:
        self.embeddings, self.db, self.metrics, self.charges = embeddings, db, metrics, charges

    @abstractmethod
    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        """Up to `chunk` of the job's items still without a `model` vector, in order."""

    @abstractmethod
    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        """Store the vectors of those items still there; how many."""

    @abstractmethod
    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> dict[str, Any]:
        """A whole chunk was embedded: a job for what may be left; what the job's result
        says of it (nothing: none was needed)."""

    def settle_others(
        self, conn: Connection, job: JobRecord, model: str, pending: Sequence[Pending]
    ) -> dict[str, Any]:
        """With the job's end: the other jobs whose items it embedded, ended; what its result
        says of them (nothing: none)."""
        return {}

    def known(self, job: JobRecord, model: str, pending: Sequence[Pending]) -> list[Any]:
        """Vectors made already for some of the items (None for the others)."""
        return [None] * len(pending)

    def charged_to(self, job: JobRecord) -> str | None:
        """The exchange the embedding call is charged to, if any."""
        exchange = (job.payload or {}).get("exchange_id")
        return str(exchange) if exchange else None

    async def _charge(self, job: JobRecord, model: str, usage: Usage | None) -> None:
        """Charge what the embedding used (None: nothing paid for), whatever becomes of the
        vectors."""
        if usage is None:
            return
        exchange = self.charged_to(job)
        if not exchange:
            # Nothing to charge it to (an API write, a catch-up): in the budgets and metrics.
            _, usd = self.charges.priced(EMBEDDING, model, usage)
            self.charges.count(job.tenant_id, model, usage, usd, EMBEDDING)
            return
        try:
            await self.charges.charge(
                job.tenant_id, exchange, kind=EMBEDDING, model=model, usage=usage
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
        known = self.known(job, model, pending)
        missing = [p.text for p, vector in zip(pending, known, strict=True) if vector is None]
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
                NewVector(p.pk, encode(v), len(v), p.text)
                for p, v in zip(pending, vectors, strict=True)
            ]
        except (BadVector, ValueError, StopIteration) as exc:
            raise JobFailed(str(exc)) from exc

        def apply(conn: Connection) -> dict[str, Any]:
            stored = self.store(conn, job, model, rows)
            result: dict[str, Any] = {"model": model, "embedded": stored}
            result.update(self.settle_others(conn, job, model, pending))
            if len(pending) == self.chunk:
                result.update(self.queue_rest(conn, job, pending[-1]))
            return result

        return apply
