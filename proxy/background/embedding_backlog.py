"""What is stored but not embedded yet, and catching up on it.

Messages are embedded by the job queue as they are stored (proxy/background/embedding_jobs.py).
What was stored before (an upgrade that turned embeddings on, a tenant switched to another
model, a start without the local model) has no vectors and is found by keywords alone until it
is embedded. Every `server.maintenance_seconds` (and at start-up), each tenant's backlog is
counted (`memproxy_embedding_backlog`, and a log line while it drains); the first time a set
of embedders is seen (at start-up, after a reload), a catch-up job is queued for each
conversation with messages to embed, oldest first, and so for each user's memories and each
attachment's passages not embedded yet (proxy/background/embedding_items.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial

import structlog
from sqlalchemy import Connection

from policies.jobs import conversation_subject
from proxy.accounting.metrics import Metrics
from proxy.background.embedding_items import queue_memories, queue_passages
from proxy.background.embedding_jobs import queue_range
from proxy.background.embeddings import Embeddings
from storage.database import Database
from storage.errors import StorageError
from storage.repositories.chunk_vectors import ChunkBacklog, ChunkVectors
from storage.repositories.memory_vectors import MemoryBacklog, MemoryVectors
from storage.repositories.vectors import Backlog, MessageVectors

log = structlog.get_logger("memproxy.embedding_jobs")


class EmbeddingBacklog:
    def __init__(
        self,
        db: Database,
        embeddings: Callable[[], Embeddings],
        metrics: Metrics,
        *,
        interval: float,
        anonymous: str,
        wake_jobs: Callable[[], None],
    ) -> None:
        self.db, self.embeddings, self.metrics = db, embeddings, metrics
        self.interval, self.anonymous, self.wake_jobs = interval, anonymous, wake_jobs
        self._caught_up: Embeddings | None = None  # the embedders a catch-up was queued for
        self._remaining: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_once()
            except StorageError as exc:  # the database is away: next time
                log.warning("embedding_backlog_not_read", error=str(exc))
            except Exception:
                log.exception("embedding_backlog_error")
            await asyncio.sleep(self.interval)

    async def run_once(self) -> dict[str, int]:
        """Count each tenant's backlog (and queue its catch-up, the first time these
        embedders are seen): messages to embed, per tenant."""
        embeddings = self.embeddings()
        catch_up = embeddings is not self._caught_up
        counts: dict[str, int] = {}
        for tenant_id in embeddings.settings:
            embedder = embeddings.embedder(tenant_id)
            if embedder is None:  # the local model is unavailable: nothing to catch up with
                continue
            model = embedder.model

            def read(
                conn: Connection, tenant: str = tenant_id, model: str = model
            ) -> list[Backlog]:
                return MessageVectors(conn).backlog(tenant, model, except_user=self.anonymous)

            backlog = await self.db.read(read)
            counts[tenant_id] = total = sum(b.count for b in backlog)
            self.metrics.embedding_backlog.labels(tenant_id).set(total)
            if catch_up:
                await self._catch_up_items(tenant_id, model)
            if catch_up and backlog:
                queued = await self.db.write(
                    partial(self._queue, tenant_id=tenant_id, backlog=backlog)
                )
                log.info(
                    "embedding_catch_up",
                    tenant=tenant_id,
                    model=model,
                    messages=total,
                    conversations=len(backlog),
                    jobs_queued=queued,
                )
            elif total or self._remaining.get(tenant_id):
                event = "embedding_backlog" if total else "embedding_caught_up"
                log.info(event, tenant=tenant_id, model=model, messages=total)
            self._remaining[tenant_id] = total
        if catch_up:
            self._caught_up = embeddings
            self.wake_jobs()
        return counts

    @staticmethod
    def _queue(conn: Connection, *, tenant_id: str, backlog: list[Backlog]) -> int:
        at = datetime.now(UTC)
        return sum(
            queue_range(
                conn,
                tenant_id,
                b.user_id,
                b.conversation_pk,
                b.first_seq,
                None,
                subject=conversation_subject(b.conversation_id, b.conversation_began),
                now=at,
                name="catch-up",
            )
            for b in backlog
        )

    async def _catch_up_items(self, tenant_id: str, model: str) -> None:
        """Queue the embedding of the tenant's memories and passages without a `model` vector
        (stored before embeddings were on, or by another model): a job per user's memories,
        a job per attachment."""

        def read(conn: Connection) -> tuple[list[MemoryBacklog], list[ChunkBacklog]]:
            memories = MemoryVectors(conn).backlog(tenant_id, model, except_user=self.anonymous)
            chunks = ChunkVectors(conn).backlog(tenant_id, model, except_user=self.anonymous)
            return memories, chunks

        memories, chunks = await self.db.read(read)
        if not memories and not chunks:
            return

        def queue(conn: Connection) -> int:
            at = datetime.now(UTC)
            return sum(
                queue_memories(conn, tenant_id, m.user_id, f"catch-up:{m.first_id}", now=at)
                for m in memories
            ) + sum(
                queue_passages(
                    conn,
                    tenant_id,
                    c.user_id,
                    c.attachment_id,
                    now=at,
                    first_seq=c.first_seq,
                    name="catch-up:",
                )
                for c in chunks
            )

        queued = await self.db.write(queue)
        log.info(
            "embedding_catch_up_items",
            tenant=tenant_id,
            model=model,
            memories=sum(m.count for m in memories),
            passages=sum(c.count for c in chunks),
            jobs_queued=queued,
        )
