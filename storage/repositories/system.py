"""System tasks that span tenants on purpose: readiness, the crash sweeper.

This is the one repository whose queries do not take a tenant; nothing here returns tenant
content."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, update

from storage.models import EXCHANGES

E = EXCHANGES


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
