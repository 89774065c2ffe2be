"""Heavy turns (HEAVY_TURN_MESSAGES or more: a large import) are stored one at a time, tenants
taking turns, and each waits for a moment when no ordinary turn is on its way to the database.

SQLite has one writer, and a heavy turn's write holds it for about a second per 10,000
messages. The write lanes (storage/fair_slots.py) make another tenant's write wait for at most
the write already running, but an ordinary turn writes twice within moments (the previous
reply, then its own messages): if a heavy write slips in between, the turn waits for two of
them, and on a busy machine that passes the storage timeout (issue 34, bench/tenant_fairness.py).
So a heavy turn starts only while no ordinary turn is between its arrival and its stored
messages, waiting at most `yield_seconds` for such a moment, so that a steady stream of
ordinary turns cannot hold large imports back for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from storage.fair_slots import FairSlots

# How long a heavy turn gives way to ordinary turns before it goes anyway.
YIELD_SECONDS = 1.0


class HeavyTurns:
    def __init__(self, at_once: int, yield_seconds: float = YIELD_SECONDS) -> None:
        self.slots = FairSlots(at_once)
        self.yield_seconds = yield_seconds
        self._ordinary = 0
        self._clear = asyncio.Event()
        self._clear.set()

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str | None) -> AsyncIterator[None]:
        """Held while a heavy turn (live or replayed) is counted and stored."""
        async with self.slots.slot(tenant):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.yield_seconds):
                    await self._clear.wait()
            yield

    @contextlib.contextmanager
    def ordinary(self) -> Iterator[None]:
        """Held by an ordinary turn from its arrival until its messages are stored (or it
        gives up on the database)."""
        self._ordinary += 1
        self._clear.clear()
        try:
            yield
        finally:
            self._ordinary -= 1
            if not self._ordinary:
                self._clear.set()

    def ordinary_on_their_way(self) -> int:
        return self._ordinary
