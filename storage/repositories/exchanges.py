"""Exchange records: one per chat completion, tenant-scoped."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError

from storage.errors import ConflictError
from storage.models import EXCHANGES
from storage.records import ExchangeRecord, NewExchange
from storage.repositories.rows import columns, utc_row

E = EXCHANGES
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
        "error",
    }
)


# Built once; values travel as parameters (see repositories/conversations.py).
_INSERT = insert(E)
_FINISH = update(E).where(
    E.c.tenant_id == bindparam("w_tenant"), E.c.request_id == bindparam("w_request")
)
_BY_KEY = select(*_COLUMNS).where(
    E.c.tenant_id == bindparam("w_tenant"), E.c.idempotency_key == bindparam("w_key")
)


class Exchanges:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def start(self, exchange: NewExchange) -> None:
        """Open the exchange; ConflictError if its request id or idempotency key is taken."""
        try:
            self.conn.execute(_INSERT, {**dataclasses.asdict(exchange), "status": "in_progress"})
        except IntegrityError as exc:
            raise ConflictError(
                f"exchange {exchange.request_id!r} or its idempotency key exists"
            ) from exc

    def insert_finished(self, rows: list[dict[str, Any]]) -> None:
        """Record exchanges that are already over, whole, in one statement."""
        self.conn.execute(_INSERT, rows)

    def finish(self, tenant_id: str, request_id: str, **fields: Any) -> None:
        unknown = set(fields) - FINISH_FIELDS
        if unknown:
            raise ValueError(f"not exchange fields: {sorted(unknown)}")
        self.conn.execute(_FINISH, {**fields, "w_tenant": tenant_id, "w_request": request_id})

    def get(self, tenant_id: str, request_id: str) -> ExchangeRecord | None:
        query = select(*_COLUMNS).where(E.c.tenant_id == tenant_id, E.c.request_id == request_id)
        row = (self.conn.execute(query)).first()
        return ExchangeRecord(**utc_row(row)) if row else None

    def by_idempotency_key(self, tenant_id: str, key: str) -> ExchangeRecord | None:
        row = self.conn.execute(_BY_KEY, {"w_tenant": tenant_id, "w_key": key}).first()
        return ExchangeRecord(**utc_row(row)) if row else None
