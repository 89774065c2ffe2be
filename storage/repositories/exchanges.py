"""Exchange records: one per chat completion, tenant-scoped, and the spend reports over them."""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

from sqlalchemy import (
    ColumnElement,
    Connection,
    Insert,
    String,
    and_,
    bindparam,
    case,
    cast,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from storage.errors import ConflictError
from storage.models import EXCHANGES
from storage.records import ExchangeRecord, NewExchange, UsageTotals
from storage.repositories.rows import columns, delete_chosen, utc_row
from storage.repositories.traces import TRACED, Traces, trace_row, upsert_after

E = EXCHANGES
# Not a column: the exchange's trace, written beside its record (storage/repositories/traces.py).
TRACE = "trace"
# What `add_cost` did with a part.
Added = Literal["added", "held", "missing"]
_COLUMNS = columns(E, ExchangeRecord)
FINISH_FIELDS = frozenset(
    {
        "status",
        "http_status",
        "finished_at",
        "latency_ms",
        "ttft_ms",
        "upstream_ms",
        "attached",
        "usage",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "reasoning_tokens",
        "usage_estimated",
        "cost_upstream_usd",
        "overhead_ms",
        "error",
        TRACE,
    }
)
GroupBy = Literal["model", "user", "day", "intent"]


# Built once; values travel as parameters (see repositories/conversations.py).
_INSERT = insert(E)
_FINISH = update(E).where(
    E.c.tenant_id == bindparam("w_tenant"), E.c.request_id == bindparam("w_request")
)


@lru_cache(maxsize=16)
def _finish_traced(fields: tuple[str, ...]) -> Insert:
    """PostgreSQL: `_FINISH` of these `fields` (parameters `s_` before them) and the upsert
    of the exchange's trace (`upsert_after`), one statement: one round trip rather than
    two."""
    done = (
        _FINISH.values({field: bindparam(f"s_{field}") for field in fields})
        .returning(E.c.request_id, E.c.tenant_id)
        .cte("done")
    )
    return upsert_after(done)


_BY_KEY = select(*_COLUMNS).where(
    E.c.tenant_id == bindparam("w_tenant"),
    E.c.user_id == bindparam("w_user"),
    E.c.idempotency_key == bindparam("w_key"),
)


class Exchanges:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def start(self, exchange: NewExchange) -> None:
        """Open the exchange; ConflictError if its request id, or its user's idempotency key,
        is taken."""
        try:
            self.conn.execute(_INSERT, {**exchange.row(), "status": "in_progress"})
        except IntegrityError as exc:
            raise ConflictError(
                f"exchange {exchange.request_id!r} or its idempotency key exists"
            ) from exc

    def insert_finished(self, rows: list[dict[str, Any]]) -> None:
        """Record exchanges that are already over, whole, in one statement (none: nothing),
        with their traces (a row's `trace`, when it has one)."""
        if not rows:
            return
        self.conn.execute(_INSERT, [{k: v for k, v in r.items() if k != TRACE} for r in rows])
        Traces(self.conn).put(
            [trace_row(r["tenant_id"], r["request_id"], r[TRACE]) for r in rows if r.get(TRACE)]
        )

    def finish(self, tenant_id: str, request_id: str, **fields: Any) -> None:
        """Close the exchange's record; its trace (`trace`, when given) is stored beside it."""
        unknown = set(fields) - FINISH_FIELDS
        if unknown:
            raise ValueError(f"not exchange fields: {sorted(unknown)}")
        trace = fields.pop(TRACE, None)
        where = {"w_tenant": tenant_id, "w_request": request_id}
        if trace and self.conn.dialect.name == "postgresql":
            row = trace_row(tenant_id, request_id, trace)
            parameters = {f"s_{field}": value for field, value in fields.items()}
            parameters |= {f"t_{column}": row[column] for column in TRACED}
            self.conn.execute(_finish_traced(tuple(sorted(fields))), parameters | where)
            return
        done = self.conn.execute(_FINISH, fields | where)
        if trace and done.rowcount:  # (none when the record is gone: erased meanwhile)
            Traces(self.conn).put([trace_row(tenant_id, request_id, trace)])

    def get(self, tenant_id: str, request_id: str) -> ExchangeRecord | None:
        query = select(*_COLUMNS).where(E.c.tenant_id == tenant_id, E.c.request_id == request_id)
        row = (self.conn.execute(query)).first()
        return ExchangeRecord(**utc_row(row)) if row else None

    def add_cost(
        self, tenant_id: str, request_id: str, part: dict[str, Any], usd: float | None
    ) -> Added:
        """Add the cost of one of the proxy's own model calls (intent, extraction, summary)
        to an exchange, after the fact: `part` joins `cost_parts`, `usd` the memory cost.
        A part the record holds already (equal in every field, its time included) is not
        added again (`held`), so a replay may repeat it; `missing` if there is no such
        exchange (erased meanwhile, or not written yet)."""
        query = select(E.c.cost_parts).where(
            E.c.tenant_id == tenant_id, E.c.request_id == request_id
        )
        row = self.conn.execute(query.with_for_update()).first()
        if row is None:
            return "missing"
        if part in (row.cost_parts or []):
            return "held"
        values: dict[str, Any] = {"cost_parts": [*(row.cost_parts or []), part]}
        if usd:
            values["cost_memory_usd"] = E.c.cost_memory_usd + usd
        self.conn.execute(
            update(E).where(E.c.tenant_id == tenant_id, E.c.request_id == request_id).values(values)
        )
        return "added"

    def set_intent(
        self, tenant_id: str, request_id: str, label: str, detail: dict[str, Any]
    ) -> bool:
        """Replace the exchange's intent (the LLM's result, arrived after the record)."""
        result = self.conn.execute(
            update(E)
            .where(E.c.tenant_id == tenant_id, E.c.request_id == request_id)
            .values(intent=label, intent_detail=detail)
        )
        return bool(result.rowcount)

    def usage(
        self,
        tenant_id: str,
        start: datetime,
        end: datetime,
        group_by: GroupBy | None = None,
        user_id: str | None = None,
    ) -> list[UsageTotals]:
        """Totals of the tenant's exchanges started in [start, end), per group when asked,
        largest spend first."""
        key = self._group_key(group_by)
        # Usage known, price not: a model with no price (not a call still running).
        finished_unpriced = and_(E.c.prompt_tokens.is_not(None), E.c.cost_upstream_usd.is_(None))
        upstream = func.coalesce(func.sum(E.c.cost_upstream_usd), 0.0)
        memory = func.coalesce(func.sum(E.c.cost_memory_usd), 0.0)
        query = select(
            key.label("key"),
            func.count().label("requests"),
            func.coalesce(func.sum(E.c.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(E.c.completion_tokens), 0).label("completion_tokens"),
            upstream.label("cost_upstream_usd"),
            memory.label("cost_memory_usd"),
            func.coalesce(func.sum(case((finished_unpriced, 1), else_=0)), 0).label(
                "unpriced_requests"
            ),
        ).where(E.c.tenant_id == tenant_id, E.c.started_at >= start, E.c.started_at < end)
        if user_id is not None:
            query = query.where(E.c.user_id == user_id)
        if group_by is not None:
            query = query.group_by(key).order_by((upstream + memory).desc(), key)
        return [UsageTotals(**row._mapping) for row in self.conn.execute(query)]

    def _group_key(self, group_by: GroupBy | None) -> ColumnElement[Any]:
        if group_by == "model":
            return E.c.model
        if group_by == "user":
            return E.c.user_id
        if group_by == "intent":
            return E.c.intent
        if group_by == "day":  # the UTC day; both backends store UTC
            if self.conn.dialect.name == "postgresql":
                return func.to_char(func.timezone("UTC", E.c.started_at), "YYYY-MM-DD")
            return func.substr(cast(E.c.started_at, String), 1, 10)
        return cast(None, String)

    def for_user(
        self, tenant_id: str, user_id: str, *, limit: int, after: ExchangeRecord | None = None
    ) -> list[ExchangeRecord]:
        """A user's exchange records in the order they started, `limit` at a time (export)."""
        query = select(*_COLUMNS).where(E.c.tenant_id == tenant_id, E.c.user_id == user_id)
        if after is not None:
            query = query.where(
                or_(
                    E.c.started_at > after.started_at,
                    and_(E.c.started_at == after.started_at, E.c.request_id > after.request_id),
                )
            )
        rows = self.conn.execute(query.order_by(E.c.started_at, E.c.request_id).limit(limit))
        return [ExchangeRecord(**utc_row(r)) for r in rows]

    def delete_before(self, tenant_id: str, cutoff: datetime, *, limit: int) -> int:
        """Delete up to `limit` of the tenant's finished exchange records started before
        `cutoff` (retention, in batches); how many."""
        oldest = (
            select(E.c.request_id)
            .where(E.c.tenant_id == tenant_id, E.c.started_at < cutoff, E.c.status != "in_progress")
            .order_by(E.c.started_at)
            .limit(limit)
        )
        return delete_chosen(self.conn, E, tenant_id, oldest)

    def by_idempotency_key(self, tenant_id: str, user_id: str, key: str) -> ExchangeRecord | None:
        """The user's exchange that `key` was first sent with: keys are each user's own."""
        params = {"w_tenant": tenant_id, "w_user": user_id, "w_key": key}
        row = self.conn.execute(_BY_KEY, params).first()
        return ExchangeRecord(**utc_row(row)) if row else None
