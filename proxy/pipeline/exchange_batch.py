"""Exchange records written in batches: turns that stored nothing before the upstream call
(mode off) are recorded shortly after their responses, many to a transaction."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from functools import partial
from typing import Any

import structlog
from sqlalchemy import Connection

from proxy.durability.spill import SpillFile
from proxy.pipeline.reply import pending_row
from proxy.pipeline.spill_entries import spilled_record
from proxy.pipeline.turn import Outcome, Turn
from storage.database import Database
from storage.errors import StorageError, StorageUnavailable
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges

log = structlog.get_logger("memproxy.exchanges")


class DeferredExchanges:
    """Exchange records of turns that stored nothing beforehand (mode off), written in batches
    shortly after their responses: one transaction for many, on no request's path. A crash
    loses at most the last batch's records, never conversation content; a batch the database
    cannot take goes to the spill."""

    def __init__(self, db: Database, spill: SpillFile, delay: float = 0.05) -> None:
        self.db, self.spill = db, spill
        self.delay = delay
        self._rows: list[dict[str, Any]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False
        self._sleeping = False
        # One batch written at a time, so `settle` can wait for the one being written.
        self._writing = asyncio.Lock()

    def add(self, turn: Turn, outcome: Outcome) -> None:
        if self._closed:
            log.error("exchange_not_recorded", request_id=turn.request_id, error="after shutdown")
            return
        self._rows.append(pending_row(turn, outcome))
        if self._flusher is None:
            # Sleeping from now: a close() before the task first runs cancels it too, rather
            # than waiting out its delay.
            self._sleeping = True
            self._flusher = asyncio.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        try:
            await asyncio.sleep(self.delay)
        finally:
            self._sleeping = False
        try:
            await self.flush()
        finally:
            self._flusher = None
            if self._rows and not self._closed:  # added while this batch was written
                self._sleeping = True
                self._flusher = asyncio.create_task(self._flush_soon())

    async def settle(self) -> None:
        """Write the records still waiting, after any batch being written now: a management
        call then reads every exchange that has ended."""
        if self._rows or self._writing.locked():
            await self.flush()

    async def flush(self) -> None:
        async with self._writing:
            rows, self._rows = self._rows, []
            if rows:
                await self._write(rows)

    async def _write(self, rows: list[dict[str, Any]]) -> None:
        try:
            await self.db.write(partial(_insert_finished, rows))
        except StorageUnavailable as exc:
            await self._spill(rows, exc)
        except StorageError:
            # One bad row must not cost the others their records.
            for n, row in enumerate(rows):
                try:
                    await self.db.write(partial(_insert_finished, [row]))
                except StorageUnavailable as exc:  # (gone meanwhile: the rest waits too)
                    await self._spill(rows[n:], exc)
                    return
                except StorageError as exc:
                    log.error("exchange_not_recorded", request_id=row["request_id"], error=str(exc))

    async def _spill(self, rows: list[dict[str, Any]], error: StorageError) -> None:
        """They wait in the spill for the database."""
        log.warning("exchanges_spilled", count=len(rows), error=str(error))
        for row in rows:
            try:
                await self.spill.add(spilled_record(row), bounded=False)
            except OSError as lost:
                log.error("exchange_not_recorded", request_id=row["request_id"], error=str(lost))

    async def close(self) -> None:
        """Write everything waiting, including a batch being written right now."""
        self._closed = True
        flusher = self._flusher
        if flusher is not None:
            if self._sleeping:
                flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
        await self.flush()


def _insert_finished(rows: list[dict[str, Any]], conn: Connection) -> None:
    """The records, but for those of users erased since their request began (the erasure
    settles the batch first, but a request still waiting for its upstream adds to it later),
    as the spill's replay leaves them out."""
    erasures = Erasures(conn)
    erased: dict[tuple[str, str], datetime | None] = {}
    for user in sorted({(r["tenant_id"], r["user_id"]) for r in rows}):
        erasures.share(*user)  # (before reading: an erasure under way is waited for)
        erased[user] = erasures.erased_at(*user)
    kept = []
    for row in rows:
        when = erased[(row["tenant_id"], row["user_id"])]
        if when is None or when < row["started_at"]:
            kept.append(row)
    Exchanges(conn).insert_finished(kept)
