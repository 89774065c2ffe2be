"""Per-tenant rate limits and budgets (`limits` in config.yaml), shared by replicas.

INTERFACE SKELETON: the helper working on limits replaces this with the real implementation.
"""

from __future__ import annotations

from decimal import Decimal

from proxy.auth import Principal
from proxy.config import Config
from storage.database import Database


class LimitKeeper:
    """Local counters per tenant, reconciled through the database every `interval` seconds."""

    def __init__(self, db: Database, config: Config, *, interval: float = 1.0) -> None:
        self.db = db
        self.config = config
        self.interval = interval

    async def start(self) -> None:
        """Load the shared counters once, then reconcile in the background."""

    async def stop(self) -> None:
        """Stop reconciling and write what is still only counted locally."""

    def admit(self, principal: Principal) -> None:
        """Count one request, or raise RateLimited (429, `retry-after`) if a limit is reached.
        No database round trip."""

    def spend(self, tenant_id: str, tokens: int, cost_usd: Decimal | None) -> None:
        """Add what a finished call used (tokens, and its cost when priced)."""
