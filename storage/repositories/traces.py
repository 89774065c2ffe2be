"""Exchange traces (what the model saw and why, per exchange): written with the exchange's
record, read by the management API. Each row goes with its exchange (the foreign key
cascades), so erasure and retention need nothing of their own here. Every call takes the
tenant."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite

from storage.models import EXCHANGE_TRACES, EXCHANGES

T = EXCHANGE_TRACES
E = EXCHANGES


@dataclass(frozen=True, slots=True)
class TraceRecord:
    request_id: str
    tenant_id: str
    user_id: str  # the exchange's
    level: str
    size: int
    truncated: bool
    trace: dict[str, Any]


def trace_row(tenant_id: str, request_id: str, trace: dict[str, Any]) -> dict[str, Any]:
    """The row of a trace as the pipeline hands it over (policies/trace.py's `bounded`)."""
    return {
        "request_id": request_id,
        "tenant_id": tenant_id,
        "level": str(trace.get("level", "summary")),
        "size": int(trace.get("bytes", 0)),
        "truncated": bool(trace.get("truncated")),
        "trace": trace,
    }


class Traces:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, rows: Sequence[dict[str, Any]]) -> None:
        """Store traces (`trace_row`s) of exchanges whose records are in this transaction; one
        written again (a replay that repeats) replaces the one there."""
        if not rows:
            return
        insert = postgresql.insert if self.conn.dialect.name == "postgresql" else sqlite.insert
        statement = insert(T).values(list(rows))
        self.conn.execute(
            statement.on_conflict_do_update(
                index_elements=[T.c.request_id],
                set_={
                    "level": statement.excluded.level,
                    "size": statement.excluded.size,
                    "truncated": statement.excluded.truncated,
                    "trace": statement.excluded.trace,
                },
                where=T.c.tenant_id == statement.excluded.tenant_id,
            )
        )

    def get(self, tenant_id: str, request_id: str) -> TraceRecord | None:
        """The trace of the tenant's exchange `request_id`, with the exchange's user."""
        query = (
            select(
                T.c.request_id,
                T.c.tenant_id,
                E.c.user_id,
                T.c.level,
                T.c.size,
                T.c.truncated,
                T.c.trace,
            )
            .join(E, E.c.request_id == T.c.request_id)
            .where(
                T.c.tenant_id == tenant_id,
                T.c.request_id == request_id,
                E.c.tenant_id == tenant_id,
            )
        )
        row = self.conn.execute(query).first()
        return TraceRecord(**row._mapping) if row else None

    def count(self, tenant_id: str, user_id: str | None = None) -> int:
        """How many traces the tenant (or one of its users) has."""
        query = (
            select(T.c.request_id)
            .join(E, E.c.request_id == T.c.request_id)
            .where(T.c.tenant_id == tenant_id)
        )
        if user_id is not None:
            query = query.where(E.c.user_id == user_id)
        return len(self.conn.execute(query).all())
