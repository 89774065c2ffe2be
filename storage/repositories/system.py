"""System tasks that span tenants on purpose: readiness, the crash sweeper, counter pruning.

This is the one repository whose queries do not take a tenant; nothing here returns tenant
content."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, delete, update

from storage.models import EXCHANGES, USAGE_COUNTERS

E = EXCHANGES
C = USAGE_COUNTERS
MINUTE_WINDOWS = "minute:"  # every minute window's key starts so, and sorts after it


class SystemRepository:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def sweep_in_progress(self, started_before: datetime, now: datetime) -> int:
        """Mark exchanges a crashed process left `in_progress` as `incomplete`."""
        result = self.conn.execute(
            update(E)
            .where(E.c.status == "in_progress", E.c.started_at < started_before)
            .values(
                status="incomplete",
                finished_at=now,
                error="abandoned: the proxy stopped mid-exchange",
            )
        )
        return result.rowcount

    def prune_minute_counters(self, before_window: str) -> int:
        """Delete every tenant's minute usage counters older than `before_window` (a key like
        `minute:2026-11-22T02:08`; keys sort in time order). Day and month counters stay."""
        if not before_window.startswith(MINUTE_WINDOWS):
            raise ValueError(f"not a minute window: {before_window!r}")
        result = self.conn.execute(
            delete(C).where(C.c.window > MINUTE_WINDOWS, C.c.window < before_window)
        )
        return result.rowcount
