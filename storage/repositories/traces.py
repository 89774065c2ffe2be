"""Exchange traces (what the model saw and why, per exchange): written with the exchange's
record, read by the management API. Each row goes with its exchange (the foreign key
cascades), so erasure and retention need nothing of their own here. Every call takes the
tenant. A conversation deleted takes its exchanges' traces (`delete_conversation`): the
records keep their figures, the traces hold what was said (at `full`, its text as sent).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import CTE, Connection, Insert, bindparam, delete, func, select
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
    truncated: list[str]
    trace: dict[str, Any]


def trace_row(tenant_id: str, request_id: str, stored: dict[str, Any]) -> dict[str, Any]:
    """The row of a trace as the pipeline hands it over (policies/trace.py's `bounded`:
    `level`, `size`, `truncated`, and `text`, its JSON)."""
    return {
        "request_id": request_id,
        "tenant_id": tenant_id,
        "level": stored["level"],
        "size": stored["size"],
        "truncated": list(stored.get("truncated") or []),
        "trace": stored["text"],
    }


def _upsert(insert: Any) -> Insert:
    """One statement per dialect, built once: a trace written again (a replay that repeats)
    replaces the one there, of the same tenant only."""
    statement = insert(T)
    return statement.on_conflict_do_update(  # type: ignore[no-any-return]
        index_elements=[T.c.request_id],
        set_={
            "level": statement.excluded.level,
            "size": statement.excluded.size,
            "truncated": statement.excluded.truncated,
            "trace": statement.excluded.trace,
        },
        where=T.c.tenant_id == statement.excluded.tenant_id,
    )


_UPSERT = {"postgresql": _upsert(postgresql.insert), "sqlite": _upsert(sqlite.insert)}
# A trace's own columns, as `upsert_after` takes them (`t_level`...).
TRACED = ("level", "size", "truncated", "trace")


def upsert_after(written: CTE) -> Insert:
    """PostgreSQL: the upsert of the trace of the exchange `written` returns (a CTE that
    writes an exchange's record and returns its `request_id` and `tenant_id`), in the same
    statement; none when it returns no row (the record is gone). Parameters: `t_level`,
    `t_size`, `t_truncated`, `t_trace`."""
    traced = select(
        written.c.request_id,
        written.c.tenant_id,
        *(bindparam(f"t_{column}", type_=T.c[column].type) for column in TRACED),
    )
    statement = postgresql.insert(T).add_cte(written)
    statement = statement.from_select(["request_id", "tenant_id", *TRACED], traced)
    return statement.on_conflict_do_update(
        index_elements=[T.c.request_id],
        set_={column: statement.excluded[column] for column in TRACED},
        where=T.c.tenant_id == statement.excluded.tenant_id,
    )


_SELECT = select(
    T.c.request_id,
    T.c.tenant_id,
    E.c.user_id,
    T.c.level,
    T.c.size,
    T.c.truncated,
    T.c.trace,
).join(E, (E.c.request_id == T.c.request_id) & (E.c.tenant_id == T.c.tenant_id))
_GET = _SELECT.where(
    T.c.tenant_id == bindparam("w_tenant"), T.c.request_id == bindparam("w_request")
)


def _record(row: Any) -> TraceRecord:
    values = dict(row._mapping)
    values["trace"] = json.loads(values["trace"])
    values["truncated"] = list(values["truncated"] or [])
    return TraceRecord(**values)


class Traces:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, rows: Sequence[dict[str, Any]]) -> None:
        """Store traces (`trace_row`s) of exchanges whose records are in this transaction."""
        if rows:
            self.conn.execute(_UPSERT[self.conn.dialect.name], list(rows))

    def get(self, tenant_id: str, request_id: str) -> TraceRecord | None:
        """The trace of the tenant's exchange `request_id`, with the exchange's user."""
        row = self.conn.execute(_GET, {"w_tenant": tenant_id, "w_request": request_id}).first()
        return _record(row) if row is not None else None

    def for_user(
        self, tenant_id: str, user_id: str, *, limit: int, after: TraceRecord | None = None
    ) -> list[TraceRecord]:
        """A user's traces by request id, `limit` at a time (export)."""
        query = _SELECT.where(T.c.tenant_id == tenant_id, E.c.user_id == user_id)
        if after is not None:
            query = query.where(T.c.request_id > after.request_id)
        rows = self.conn.execute(query.order_by(T.c.request_id).limit(limit))
        return [_record(row) for row in rows]

    def delete_conversation(self, tenant_id: str, conversation_pk: int) -> int:
        """Delete the traces of the exchanges stored in conversation `conversation_pk`."""
        theirs = select(E.c.request_id).where(
            E.c.tenant_id == tenant_id, E.c.conversation_pk == conversation_pk
        )
        done = self.conn.execute(
            delete(T).where(T.c.tenant_id == tenant_id, T.c.request_id.in_(theirs))
        )
        return int(done.rowcount)

    def count(self, tenant_id: str, user_id: str | None = None) -> int:
        """How many traces the tenant (or one of its users) has."""
        query = (
            select(func.count())
            .select_from(T.join(E, E.c.request_id == T.c.request_id))
            .where(T.c.tenant_id == tenant_id)
        )
        if user_id is not None:
            query = query.where(E.c.user_id == user_id)
        return int(self.conn.execute(query).scalar_one())
