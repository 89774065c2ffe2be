"""Each replica's upkeep, every `server.maintenance_seconds` (and once at start-up):

- **The sweeper**: exchanges left `in_progress` by a process that died become `incomplete`. At
  start-up on SQLite (one process owns the file) every one of them; on PostgreSQL, where other
  replicas may be serving theirs, those older than `server.stale_exchange_minutes`, at start-up
  and then periodically, so a replica that crashed for good is swept by the others.
- **Retention** (`retention_days` per tenant, from the first interval on, not at start-up):
  conversations idle that long are deleted with everything made of them (each row locked and
  its idleness checked again, so a turn stored meanwhile keeps its conversation), and so are
  exchange records as old with the Responses API responses stored for them (by their own
  age: a response is saved as its exchange ends, so it goes on the same pass or the next)
  and memories neither pinned, changed nor used since. In small transactions, so one pass
  never holds the database for long.

Every replica runs it: each step is idempotent, and two replicas doing it at once delete the
same rows once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import structlog
from sqlalchemy import Connection

from proxy.core.config import Config
from proxy.pipeline.turn import now
from storage.database import Database
from storage.errors import StorageError
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.responses import Responses
from storage.repositories.system import SystemRepository

log = structlog.get_logger("memproxy.maintenance")
BATCH = 200  # idle conversations looked up at a time
PER_TRANSACTION = 10  # conversations deleted per transaction
ROWS = 1000  # exchange records or memories deleted per transaction


@dataclass(slots=True)
class Pass:
    """What one pass did."""

    swept: int = 0
    deleted: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> kind -> n


class Maintenance:
    def __init__(self, db: Database, config: Config) -> None:
        self.db, self.config = db, config
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One pass now (the start-up sweep included), then one every interval."""
        await self.run_once(starting=True)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.server.maintenance_seconds)
            try:
                await self.run_once()
            except StorageError as exc:  # the database is away: next time
                log.warning("maintenance_failed", error=str(exc))
            except Exception:
                log.exception("maintenance_error")

    async def run_once(self, *, starting: bool = False) -> Pass:
        done = Pass()
        at = now()
        if starting and self.db.is_sqlite:
            cutoff = at  # only this process writes: whatever is in progress was abandoned
        elif self.db.is_sqlite:
            cutoff = None  # (and nothing else could have left one)
        else:
            cutoff = at - timedelta(minutes=self.config.server.stale_exchange_minutes)
        if cutoff is not None:
            done.swept = await self.db.write(
                lambda conn: SystemRepository(conn).sweep_in_progress(cutoff, at)
            )
            if done.swept:
                log.warning("swept_abandoned_exchanges", count=done.swept)
        if starting:
            return done  # retention waits for the first interval: start-up stays quick
        for name, tenant in self.config.tenants.items():
            if tenant.retention_days is not None:
                deleted = await self.retain(name, at - timedelta(days=tenant.retention_days))
                if any(deleted.values()):
                    done.deleted[name] = deleted
                    log.info("retention_deleted", tenant=name, **deleted)
        return done

    async def retain(self, tenant_id: str, cutoff: datetime) -> dict[str, int]:
        """Delete what the tenant keeps no longer than `cutoff`."""
        deleted = {"conversations": 0, "exchanges": 0, "responses": 0, "memories": 0, "jobs": 0}
        # A conversation at a time (its row locked, idleness checked again), a few per
        # transaction; records and memories a batch at a time: between transactions the
        # requests' own writes go ahead.
        while True:
            idle = await self.db.read(
                lambda conn: Conversations(conn).idle_since(tenant_id, cutoff, limit=BATCH)
            )
            for start in range(0, len(idle), PER_TRANSACTION):
                ids = idle[start : start + PER_TRANSACTION]

                def forget(conn: Connection, ids: Sequence[str] = ids) -> int:
                    conversations = Conversations(conn)
                    conversations.lock(tenant_id, ids=ids)
                    return sum(conversations.delete_if_idle(tenant_id, c, cutoff) for c in ids)

                deleted["conversations"] += await self.db.write(forget)
            if len(idle) < BATCH:
                break

        def old_records(conn: Connection) -> int:
            return Exchanges(conn).delete_before(tenant_id, cutoff, limit=ROWS)

        def old_responses(conn: Connection) -> int:
            return Responses(conn).delete_before(tenant_id, cutoff, limit=ROWS)

        def unused_memories(conn: Connection) -> int:
            return Memories(conn).delete_unused_since(tenant_id, cutoff, limit=ROWS)

        def ended_jobs(conn: Connection) -> int:
            return Jobs(conn).delete_finished_before(tenant_id, cutoff, limit=ROWS)

        steps = (
            ("exchanges", old_records),
            ("responses", old_responses),
            ("memories", unused_memories),
            ("jobs", ended_jobs),
        )
        for kind, step in steps:
            while (count := await self.db.write(step)) > 0:
                deleted[kind] += count
                if count < ROWS:
                    break
        return deleted
