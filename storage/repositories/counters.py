"""Usage counters: a tenant's requests, tokens and spend per window, shared by replicas.

Replicas add what they counted with one atomic upsert per (tenant, window)
(`INSERT ... ON CONFLICT DO UPDATE SET requests = requests + excluded.requests, ...`), so
concurrent writers never lose each other's increments, and read the totals back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.dialects import postgresql, sqlite

from storage.models import USAGE_COUNTERS

C = USAGE_COUNTERS


@dataclass(frozen=True, slots=True)
class WindowCount:
    requests: int = 0
    tokens: int = 0
    cost_usd: float = 0.0


def _upsert(statement: postgresql.Insert | sqlite.Insert) -> postgresql.Insert | sqlite.Insert:
    return statement.on_conflict_do_update(
        index_elements=[C.c.tenant_id, C.c.window],
        set_={
            "requests": C.c.requests + statement.excluded.requests,
            "tokens": C.c.tokens + statement.excluded.tokens,
            "cost_usd": C.c.cost_usd + statement.excluded.cost_usd,
            "updated_at": statement.excluded.updated_at,
        },
    )


def _at_least(statement: postgresql.Insert | sqlite.Insert, larger: Any) -> Any:
    return statement.on_conflict_do_update(
        index_elements=[C.c.tenant_id, C.c.window],
        set_={"cost_usd": larger(C.c.cost_usd, statement.excluded.cost_usd)},
    )


# Built once; values travel as parameters (executemany for many rows).
_UPSERT = {"postgresql": _upsert(postgresql.insert(C)), "sqlite": _upsert(sqlite.insert(C))}
_AT_LEAST = {  # (SQLite's max() of two arguments is the larger, PostgreSQL's greatest())
    "postgresql": _at_least(postgresql.insert(C), func.greatest),
    "sqlite": _at_least(sqlite.insert(C), func.max),
}
_READ = select(C.c.tenant_id, C.c.window, C.c.requests, C.c.tokens, C.c.cost_usd).where(
    C.c.tenant_id.in_(bindparam("tenants", expanding=True)),
    C.c.window.in_(bindparam("windows", expanding=True)),
)


class Counters:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def add(self, tenant_id: str, counts: Mapping[str, WindowCount], now: datetime) -> None:
        """Add `counts` (window -> amounts) to the tenant's windows."""
        self.add_many({tenant_id: counts}, now)

    def add_many(self, counts: Mapping[str, Mapping[str, WindowCount]], now: datetime) -> None:
        """Add tenant -> window -> amounts, one statement for all of them. Rows go in key order,
        so replicas writing the same rows at once lock them in the same order (no deadlock)."""
        rows = [
            {
                "tenant_id": tenant_id,
                "window": window,
                "requests": count.requests,
                "tokens": count.tokens,
                "cost_usd": count.cost_usd,
                "updated_at": now,
            }
            for tenant_id, windows in sorted(counts.items())
            for window, count in sorted(windows.items())
        ]
        if rows:
            self.conn.execute(_UPSERT[self.conn.dialect.name], rows)

    def spend_at_least(self, tenant_id: str, window: str, cost_usd: float, now: datetime) -> None:
        """Raise the tenant's spend in `window` to `cost_usd` if it is less (what its exchange
        records add up to, when the window was not counted from its start)."""
        row = {"tenant_id": tenant_id, "window": window, "requests": 0, "tokens": 0}
        self.conn.execute(
            _AT_LEAST[self.conn.dialect.name], {**row, "cost_usd": cost_usd, "updated_at": now}
        )

    def get(self, tenant_id: str, windows: Iterable[str]) -> dict[str, WindowCount]:
        """The tenant's totals in `windows` (window -> amounts; absent windows are left out)."""
        return self.get_many([tenant_id], windows).get(tenant_id, {})

    def get_many(
        self, tenant_ids: Iterable[str], windows: Iterable[str]
    ) -> dict[str, dict[str, WindowCount]]:
        """Totals of each tenant in `windows`: tenant -> window -> amounts."""
        tenants, keys = list(tenant_ids), list(windows)
        out: dict[str, dict[str, WindowCount]] = {}
        if not tenants or not keys:
            return out
        for row in self.conn.execute(_READ, {"tenants": tenants, "windows": keys}):
            out.setdefault(row.tenant_id, {})[row.window] = WindowCount(
                int(row.requests), int(row.tokens), float(row.cost_usd)
            )
        return out
