"""Write slots shared fairly between tenants.

SQLite has one writer; PostgreSQL's writes share a bounded pool. Handed out first come, first
served, one tenant that floods the write path (many large turns at once, or the spill's replay
of them) queues every other tenant's writes behind all of its own, and their turns time out
and are answered degraded (issue 34: 3-5.4 s for about 65 s). Here each tenant waits in a lane
of its own and a free slot goes to the lanes in turn, so another tenant's write waits for at
most the writes already running and one of each other busy tenant's, however many one tenant
has queued.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator

# The lane of writes that name no tenant (upkeep, migrations' bookkeeping).
SHARED = ""
# How long a large write gives way to the small writes announced (`expecting`) before it
# goes anyway, so that a steady stream of small writes cannot hold large ones back for ever.
LARGE_YIELDS_SECONDS = 1.0


class FairSlots:
    """`slots` writes at a time; waiting writes get them round-robin by tenant, FIFO within
    a tenant."""

    def __init__(self, slots: int, large_yields_seconds: float = LARGE_YIELDS_SECONDS) -> None:
        self.slots = slots
        self.large_yields_seconds = large_yields_seconds
        self._busy = 0
        # tenant -> its waiting writes, in the order the lanes take turns.
        self._lanes: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._expected = 0
        self._none_expected = asyncio.Event()
        self._none_expected.set()

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str | None, *, large: bool = False) -> AsyncIterator[None]:
        """Hold a slot for the block (a cancelled waiter leaves its lane)."""
        await self.acquire(tenant, large=large)
        try:
            yield
        finally:
            self.release()

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """A small write is on its way for the block (an ordinary turn, from its arrival
        until its messages are stored): a large write waits for it (`acquire(large=True)`).

        A large write (a 10,000-message import) holds SQLite's one writer for a second or
        more. The lanes make another tenant's write wait for at most the write already
        running, but an ordinary turn writes twice within moments (its previous reply, then
        its own messages): a large write slipping in between makes it wait for two, and on
        a busy machine that passes the storage timeout (issue 34, bench/tenant_fairness.py)."""
        self._expected += 1
        self._none_expected.clear()
        try:
            yield
        finally:
            self._expected -= 1
            if not self._expected:
                self._none_expected.set()

    def expected(self) -> int:
        return self._expected

    async def acquire(self, tenant: str | None, *, large: bool = False) -> None:
        if large:  # gives way to the small writes on their way, for a while
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.large_yields_seconds):
                    await self._none_expected.wait()
        if self._busy < self.slots and not self._lanes:
            self._busy += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane = self._lanes.setdefault(tenant or SHARED, deque())
        lane.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted as it was cancelled: pass the slot on
            else:
                self._leave(tenant or SHARED, waiter)
            raise

    def release(self) -> None:
        """A slot is free: the next lane in turn gets it, and goes to the back of the turn."""
        self._busy -= 1
        while self._lanes:
            tenant, lane = next(iter(self._lanes.items()))
            waiter = lane.popleft()
            if lane:
                self._lanes.move_to_end(tenant)
            else:
                del self._lanes[tenant]
            if not waiter.done():
                self._busy += 1
                waiter.set_result(None)
                return

    def waiting(self, tenant: str | None = None) -> int:
        """Writes waiting for a slot (of one tenant, or all)."""
        if tenant is not None:
            return len(self._lanes.get(tenant, ()))
        return sum(len(lane) for lane in self._lanes.values())

    def _leave(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        lane = self._lanes.get(tenant)
        if lane is None:
            return
        with contextlib.suppress(ValueError):
            lane.remove(waiter)
        if not lane:
            del self._lanes[tenant]
