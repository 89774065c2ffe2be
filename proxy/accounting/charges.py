"""The proxy's own model calls (intent, memory extraction, summaries), charged to the exchange
that caused them when they happen, also long after its response: the exchange record (a part
in `cost_parts`, added to `cost_memory_usd`), the tenant's budgets and the metrics.

This is the only way a memory cost reaches the record. A cost incurred before a response's
headers went out is also in that response's `x-cost-memory-usd` (`Bill.memory_usd`), which is
not written again.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection

from policies.pricing import Usage
from proxy.accounting.costs import Pricer
from proxy.accounting.limits import LimitKeeper
from proxy.accounting.metrics import Metrics
from storage.database import Database
from storage.repositories.exchanges import Added, Exchanges

EMBEDDING = "embedding"  # the kind of an embeddings call's part


class MemoryCharges:
    def __init__(self, db: Database, pricer: Pricer, limits: LimitKeeper, metrics: Metrics) -> None:
        self.db, self.pricer, self.limits, self.metrics = db, pricer, limits, metrics

    async def charge(
        self, tenant_id: str, request_id: str, *, kind: str, model: str, usage: Usage
    ) -> Decimal | None:
        """Charge one call of `model` (`kind`: intent, extraction, summary...) to the exchange;
        its cost, or None when the model has no price (then it is listed, not added up). The
        call was made: it counts against the budgets and in the metrics first, whether or not
        its part of the record can be written (a StorageError is raised after)."""
        part, usd = self.priced(kind, model, usage)
        self.count(tenant_id, model, usage, usd, kind)
        await self.record(tenant_id, request_id, part)
        return usd

    def priced(self, kind: str, model: str, usage: Usage) -> tuple[dict[str, Any], Decimal | None]:
        """The exchange record's part for one call, and its cost."""
        usd = self.pricer.prices.cost(model, usage)
        part = {
            "kind": kind,
            "model": model,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "estimated": usage.estimated,
            "cost_usd": None if usd is None else float(usd),
            "at": datetime.now(UTC).isoformat(),
        }
        return part, usd

    async def record(self, tenant_id: str, request_id: str, part: dict[str, Any]) -> Added:
        """Add `part` (`priced`) to the exchange record."""
        return await self.db.write(lambda conn: add_part(conn, tenant_id, request_id, part))

    def count(
        self, tenant_id: str, model: str, usage: Usage, usd: Decimal | None, kind: str = ""
    ) -> None:
        """The call against the tenant's budgets (and `tpm`, but for embeddings: providers
        limit those apart from chat, and an import's would crowd out the chat), and in the
        metrics."""
        tokens = 0 if kind == EMBEDDING else usage.total_tokens
        self.limits.spend(tenant_id, tokens, usd)
        label = self.metrics.model(model)
        self.metrics.tokens.labels(tenant_id, label, "prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels(tenant_id, label, "completion").inc(usage.completion_tokens)
        if usd is None:
            self.metrics.unpriced.labels(tenant_id, label).inc()
        else:
            self.metrics.cost.labels(tenant_id, label, "memory").inc(float(usd))


def add_part(conn: Connection, tenant_id: str, request_id: str, part: dict[str, Any]) -> Added:
    """`part` into the exchange's `cost_parts`, its cost into `cost_memory_usd` (also the
    spill's replay)."""
    return Exchanges(conn).add_cost(tenant_id, request_id, part, part["cost_usd"])
