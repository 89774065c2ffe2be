"""Per-tenant rate limits and budgets (`limits` in config.yaml), shared by replicas.

A request is admitted or refused from counters held in this process, never by asking the
database: what a tenant used in a window is the shared total last read from the database plus
what this replica counted since then. Every `server.limits_sync_seconds` (T) a background task
writes this replica's new counts (one transaction, atomic increments) and reads back the shared
totals of the current windows, which include every replica's counts written so far.

So a request admitted by one replica is seen by the others within 2T (T until it is written, T
until they read it), and the most a window can be overshot is what the other replicas admitted
in those 2T; tokens and cost are only known when a call finishes, so calls in flight when a
limit is reached add theirs too. docs/concepts/costs-and-limits.md states the bound in full.

If the database cannot be reached, counts stay local (nothing is lost; they are written once it
answers again) and decisions go on from the last shared totals. Tenants without limits are not
counted at all: when a tenant gets a budget (at start-up, or a reload), its spend so far in that
day or month is taken from its exchange records (the shared counter is raised to it if less),
so a budget set mid-month knows what the month has cost already.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

import structlog
from sqlalchemy import Connection

from policies.limits import (
    CHECK_ORDER,
    NO_USAGE,
    WINDOW_OF,
    Denial,
    LimitName,
    WindowKind,
    Windows,
    WindowUsage,
    decide,
    used_of,
    windows_at,
    windows_needed,
)
from proxy.core.auth import Principal
from proxy.core.config import Config, Limits
from proxy.core.errors import RateLimited
from storage.database import Database
from storage.repositories.counters import Counters, WindowCount
from storage.repositories.exchanges import Exchanges
from storage.repositories.system import SystemRepository

log = structlog.get_logger("memproxy.limits")

ONE_REQUEST = WindowUsage(requests=1)
# Minute counters are only read in their own minute; older ones are deleted now and then.
PRUNE_EVERY_SECONDS = 600.0
KEEP_MINUTES_SECONDS = 3600.0


class _Tally:
    """One tenant's counts per window key: the last shared totals, the counts being written
    right now, and those counted since (not written yet)."""

    __slots__ = ("flushing", "pending", "shared")

    def __init__(self) -> None:
        self.shared: dict[str, WindowUsage] = {}
        self.flushing: dict[str, WindowUsage] = {}
        self.pending: dict[str, WindowUsage] = {}

    def seen(self, window: str) -> WindowUsage:
        return (
            self.shared.get(window, NO_USAGE)
            + self.flushing.get(window, NO_USAGE)
            + self.pending.get(window, NO_USAGE)
        )

    def count(self, window: str, usage: WindowUsage) -> None:
        self.pending[window] = self.pending.get(window, NO_USAGE) + usage

    def keep_unwritten(self) -> None:
        """A write failed: what was being written is still to be written."""
        for window, usage in self.flushing.items():
            self.count(window, usage)
        self.flushing = {}


@dataclass(frozen=True, slots=True)
class LimitUsage:
    """One configured limit as this replica sees it now."""

    limit: LimitName
    value: float
    used: float
    window: str
    resets_at: float

    @property
    def remaining(self) -> float:
        return max(0.0, self.value - self.used)


@dataclass(frozen=True, slots=True)
class TenantView:
    limits: Limits
    usage: list[LimitUsage]
    synced_at: float | None  # when this replica last read the shared totals
    interval: float


class LimitKeeper:
    """Local counters per tenant, reconciled through the database every `interval` seconds."""

    def __init__(
        self,
        db: Database,
        config: Config,
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.config = config
        self.interval = interval
        self._clock = clock
        self._rules, self._needed = _rules_of(config)
        self._tallies = {name: _Tally() for name in self._rules}
        # Budget windows (tenant, day or month) not counted from their start: their spend so
        # far is read from the exchange records at the next sync.
        self._unseeded = _budget_windows(self._needed)
        self._syncing = asyncio.Lock()
        self._windows = windows_at(clock())
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_prune = 0.0
        self.synced_at: float | None = None

    async def start(self) -> None:
        """Load the shared counters once (so a restart knows today's spend), then reconcile in
        the background. Nothing runs when no tenant has limits."""
        if not self._rules or self._task is not None:
            return
        if not await self.sync():
            log.warning("limits_start_without_shared_counts")
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="memproxy-limits-sync")

    async def reconfigure(self, config: Config) -> None:
        """The limits of a reloaded config: what was counted is kept; a tenant with limits for
        the first time is counted from now on, over the shared totals of its windows, and a
        budget new to it starts from what its exchanges have cost in its day or month."""
        self.config = config
        counted = _budget_windows(self._needed)
        self._rules, self._needed = _rules_of(config)
        self._unseeded |= _budget_windows(self._needed) - counted
        for name in self._rules:
            self._tallies.setdefault(name, _Tally())
        if self._task is None:
            await self.start()
        else:
            await self.sync()

    async def stop(self) -> None:
        """Stop reconciling and write what is still only counted locally."""
        if self._task is None:
            return
        self._stopping.set()
        await self._task  # lets a write in progress finish: cancelling it could count twice
        self._task = None
        if not await self.sync():
            log.error("limits_counts_lost_at_shutdown")

    def admit(self, principal: Principal) -> None:
        """Count one request, or raise RateLimited (429, `retry-after`) if a limit is reached.
        No database round trip."""
        rules = self._rules.get(principal.tenant_id)
        if rules is None:
            return
        windows, now = self._now()
        tally = self._tallies[principal.tenant_id]
        kinds = self._needed[principal.tenant_id]
        denial = decide(rules, {k: tally.seen(windows.key(k)) for k in kinds}, windows, now)
        if denial is not None:
            raise _rate_limited(denial)
        for kind in kinds:
            tally.count(windows.key(kind), ONE_REQUEST)

    def spend(self, tenant_id: str, tokens: int, cost_usd: Decimal | None) -> None:
        """Add what a finished call used (tokens, and its cost when priced)."""
        kinds = self._needed.get(tenant_id)
        if kinds is None:
            return
        usage = WindowUsage(tokens=max(0, tokens), cost_usd=float(cost_usd or 0))
        if usage.empty:
            return
        windows, _ = self._now()
        tally = self._tallies[tenant_id]
        for kind in kinds:
            tally.count(windows.key(kind), usage)

    def view(self, tenant_id: str) -> TenantView:
        """The tenant's limits and this replica's view of the current windows."""
        tenant = self.config.tenants[tenant_id]
        rules = self._rules.get(tenant_id)
        usage: list[LimitUsage] = []
        if rules is not None:
            windows, _ = self._now()
            tally = self._tallies[tenant_id]
            for name in CHECK_ORDER:
                value = getattr(rules, name)
                if value is None:
                    continue
                kind = WINDOW_OF[name]
                used = used_of(name, tally.seen(windows.key(kind)))
                usage.append(LimitUsage(name, value, used, windows.key(kind), windows.ends(kind)))
        return TenantView(tenant.limits, usage, self.synced_at, self.interval)

    async def sync(self) -> bool:
        """Write this replica's new counts and read back the shared totals; False (logged, the
        counts kept for the next try) if the database failed. Never raises. One at a time
        (a reload's and the periodic one)."""
        async with self._syncing:
            return await self._sync()

    async def _sync(self) -> bool:
        if not self._tallies:  # (a tenant whose limits a reload removed: its last counts)
            return True
        windows, now = self._now()
        batch: dict[str, dict[str, WindowCount]] = {}
        for tenant_id, tally in self._tallies.items():
            if tally.pending:
                tally.flushing, tally.pending = tally.pending, {}
                batch[tenant_id] = {
                    window: WindowCount(u.requests, u.tokens, u.cost_usd)
                    for window, u in tally.flushing.items()
                }
        tenants = list(self._rules)
        current = [windows.minute, windows.day, windows.month]
        stamp = datetime.fromtimestamp(now, UTC)
        seeding = sorted((t, kind) for t, kind in self._unseeded if t in self._rules)

        def recorded(conn: Connection) -> list[float]:
            """What the seeded windows' exchanges cost (a read: no write waits for it)."""
            spent = [Exchanges(conn).usage(t, windows.began(k), stamp)[0] for t, k in seeding]
            return [s.cost_upstream_usd + s.cost_memory_usd for s in spent]

        def exchange(conn: Connection) -> dict[str, dict[str, WindowCount]]:
            counters = Counters(conn)
            counters.add_many(batch, stamp)
            # After the batch: what this replica counted is in the records too, so the
            # window holds the larger of the two, never their sum.
            for (tenant_id, kind), cost in zip(seeding, costs, strict=True):
                counters.spend_at_least(tenant_id, windows.key(kind), cost, stamp)
            return counters.get_many(tenants, current)

        def read(conn: Connection) -> dict[str, dict[str, WindowCount]]:
            return Counters(conn).get_many(tenants, current)

        try:
            costs = await self.db.read(recorded) if seeding else []
            write = batch or seeding
            totals = await (self.db.write(exchange) if write else self.db.read(read))
        except Exception as exc:
            for tally in self._tallies.values():
                tally.keep_unwritten()
            log.warning("limits_sync_failed", error=str(exc) or type(exc).__name__)
            return False
        self._unseeded -= set(seeding)
        for tenant_id, tally in self._tallies.items():
            tally.flushing = {}
            tally.shared = {
                window: WindowUsage(c.requests, c.tokens, c.cost_usd)
                for window, c in totals.get(tenant_id, {}).items()
            }
        self.synced_at = now
        return True

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self.interval)
                return
            except TimeoutError:
                pass
            try:
                await self.sync()
                await self._prune_if_due()
            except Exception:  # a bug here must not stop the counting of the next interval
                log.exception("limits_sync_error")

    async def _prune_if_due(self) -> None:
        now = self._clock()
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_SECONDS
        before = windows_at(now - KEEP_MINUTES_SECONDS).minute
        try:
            pruned = await self.db.write(
                lambda conn: SystemRepository(conn).prune_minute_counters(before)
            )
        except Exception as exc:
            log.warning("limits_prune_failed", error=str(exc) or type(exc).__name__)
            return
        if pruned:
            log.info("limits_pruned_minute_counters", count=pruned)

    def _now(self) -> tuple[Windows, float]:
        """The current windows (recomputed once a minute, or if the clock went back)."""
        now = self._clock()
        windows = self._windows
        if not windows.minute_ends - 60.0 <= now < windows.minute_ends:
            windows = self._windows = windows_at(now)
        return windows, now


def _rules_of(config: Config) -> tuple[dict[str, Limits], dict[str, tuple[WindowKind, ...]]]:
    """The tenants with limits: their limits, and the windows those are counted in."""
    rules: dict[str, Limits] = {}
    needed: dict[str, tuple[WindowKind, ...]] = {}
    for name, tenant in config.tenants.items():
        kinds = windows_needed(tenant.limits)
        if kinds:
            rules[name] = tenant.limits
            needed[name] = tuple(sorted(kinds))
    return rules, needed


def _budget_windows(needed: dict[str, tuple[WindowKind, ...]]) -> set[tuple[str, WindowKind]]:
    return {(t, kind) for t, kinds in needed.items() for kind in kinds if kind != "minute"}


def _rate_limited(denial: Denial) -> RateLimited:
    error = RateLimited(
        denial.message, code=denial.code, headers={"retry-after": str(denial.retry_after)}
    )
    error.type = denial.type
    return error
