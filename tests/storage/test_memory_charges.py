"""The proxy's own model calls charged to an exchange after the fact (proxy/accounting/charges.py): the
record, the tenant's budget counters and the metrics, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text as sql
from sqlalchemy.ext.asyncio import create_async_engine

from policies.pricing import Price, PriceBook, Usage
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.costs import Pricer
from proxy.accounting.limits import LimitKeeper
from proxy.accounting.metrics import Metrics
from proxy.core.config import Config, Limits, TenantConfig
from storage.database import Database
from storage.records import NewExchange
from storage.repositories.exchanges import Exchanges
from tests.polling import eventually

# $1 per million input tokens, $2 per million output tokens.
PRICES = {"helper-model": Price.per_million(1.0, 2.0, None)}
CONFIG = Config(tenants={"t1": TenantConfig(api_keys=["k"], limits=Limits(budget_usd_day=1.0))})


@pytest.fixture
async def charges(db: Database) -> MemoryCharges:
    pricer = Pricer(PriceBook(PRICES, lambda model: None))
    exchange = NewExchange(
        request_id="req_1",
        tenant_id="t1",
        user_id="alice",
        model="main-model",
        upstream="echo",
        mode="full",
        stream=False,
        started_at=datetime.now(UTC),
    )
    await db.write(lambda conn: Exchanges(conn).start(exchange))
    return MemoryCharges(db, pricer, LimitKeeper(db, CONFIG), Metrics())


async def test_a_charge_lands_in_the_record_the_budget_and_the_metrics(
    db: Database, charges: MemoryCharges
) -> None:
    usd = await charges.charge(
        "t1", "req_1", kind="intent", model="helper-model", usage=Usage(1000, 500)
    )
    # 1000 x 1/M + 500 x 2/M
    assert usd == Decimal("0.002")
    record = await db.read(lambda conn: Exchanges(conn).get("t1", "req_1"))
    assert record is not None
    assert record.cost_memory_usd == 0.002
    (part,) = record.cost_parts
    assert (part["kind"], part["model"], part["cost_usd"]) == ("intent", "helper-model", 0.002)
    (budget,) = charges.limits.view("t1").usage
    assert (budget.limit, budget.used) == ("budget_usd_day", 0.002)
    text = charges.metrics.exposition().decode()
    costs = {
        s.labels["part"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "memproxy_cost_usd_total"
    }
    assert costs == {"memory": 0.002}


async def test_a_call_counts_against_the_budget_before_its_record_is_written(
    db: Database, charges: MemoryCharges
) -> None:
    """The call was paid for: if writing its part of the record failed, the budget and the
    metrics must have it still. Here the write waits behind another connection's, holding
    the row (on SQLite, the file)."""
    other = create_async_engine(db.url)
    try:
        async with other.begin() as holding:
            await holding.execute(
                sql("UPDATE exchanges SET model = model WHERE request_id = 'req_1'")
            )
            charging = asyncio.create_task(
                charges.charge(
                    "t1", "req_1", kind="extraction", model="helper-model", usage=Usage(1000, 500)
                )
            )
            (budget,) = await eventually(
                lambda: asyncio.sleep(
                    0, result=[u for u in charges.limits.view("t1").usage if u.used]
                ),
                "the charge counted",
                attempts=100,
            )
            assert budget.used == 0.002
            assert not charging.done()
    finally:
        await other.dispose()
    assert await charging == Decimal("0.002")
    record = await db.read(lambda conn: Exchanges(conn).get("t1", "req_1"))
    assert record is not None and record.cost_memory_usd == 0.002


async def test_an_embeddings_call_counts_toward_the_budgets_but_not_tpm(db: Database) -> None:
    """Providers limit embeddings apart from chat: an import's embeddings must not use up the
    chat's tokens per minute."""
    limited = Config(
        tenants={"t1": TenantConfig(api_keys=["k"], limits=Limits(tpm=1000, budget_usd_day=1.0))}
    )
    charges = MemoryCharges(
        db, Pricer(PriceBook(PRICES, lambda model: None)), LimitKeeper(db, limited), Metrics()
    )
    await charges.charge(
        "t1", "req_none", kind="embedding", model="helper-model", usage=Usage(5000, 0)
    )
    await charges.charge(
        "t1", "req_none", kind="summary", model="helper-model", usage=Usage(100, 0)
    )
    used = {u.limit: u.used for u in charges.limits.view("t1").usage}
    assert used == {"budget_usd_day": 0.0051, "tpm": 100}


async def test_an_unpriced_call_is_listed_but_adds_no_cost(
    db: Database, charges: MemoryCharges
) -> None:
    usd = await charges.charge(
        "t1", "req_1", kind="summary", model="mystery-model", usage=Usage(10, 10)
    )
    assert usd is None
    record = await db.read(lambda conn: Exchanges(conn).get("t1", "req_1"))
    assert record is not None
    assert record.cost_memory_usd == 0
    assert record.cost_parts[0]["cost_usd"] is None
    (budget,) = charges.limits.view("t1").usage
    assert budget.used == 0
