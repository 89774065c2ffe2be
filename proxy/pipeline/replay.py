"""Replaying the spill (proxy/durability/spill.py) into the database once it answers: the
rounds, their order and their failures.

What a spill entry holds and how entries are grouped by request is in
proxy/pipeline/spill_entries.py; what one request writes, in one transaction, is in
proxy/pipeline/replay_writes.py. Each request is replayed through the same code as a live
request, and one whose exchange is recorded already is skipped (but for its amendments), so a
replay is safe to repeat: after a crash half-way, after a `begin()` that timed out but landed,
or with the spill shared by replicas on one host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import structlog

from proxy.accounting.metrics import Metrics
from proxy.core.config import Config
from proxy.core.requests import Inline
from proxy.durability.spill import Spilled, SpillFile
from proxy.pipeline.artifacts import chunked
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.replay_writes import ReplayWrites, Wanted
from proxy.pipeline.spill_entries import SpilledRequest, grouped
from proxy.pipeline.turn import HEAVY_TURNS_AT_ONCE, IntentOf, TokenCounter, is_heavy
from storage.errors import ConflictError, StorageError, StorageUnavailable
from storage.fair_slots import FairSlots

log = structlog.get_logger("memproxy.spill")

# A request the database keeps failing (not unreachable) is set aside after this many rounds.
MAX_TRIES = 5
# What became of a request when its replay wrote to the database.
WROTE = frozenset({"replayed", "begun", "refused", "amended"})


class SpillReplayer:
    """Every `interval` seconds, when the spill holds anything, writes it to the database; a
    round that meets an unreachable database stops and leaves the rest for the next."""

    def __init__(
        self,
        spill: SpillFile,
        memory: ConversationMemory,
        config: Config,
        metrics: Metrics,
        *,
        intent_of: Callable[[str], IntentOf],
        wanted: Callable[[str, str, str], Wanted],
        wake_jobs: Callable[[], None],
        interval: float,
        heavy: FairSlots | None = None,
    ) -> None:
        """`intent_of(tenant)` classifies a replayed turn as a live one would be;
        `wanted(tenant, user, mode)` says what to queue after its reply."""
        self.spill, self.memory, self.db = spill, memory, memory.db
        self.config, self.metrics = config, metrics
        self.writes = ReplayWrites(intent_of=intent_of, wanted=wanted)
        self.wake_jobs = wake_jobs
        self.interval = interval
        # Large turns are counted and stored one at a time, live or replayed (proxy/state.py).
        self.heavy = heavy or FairSlots(HEAVY_TURNS_AT_ONCE)
        self._task: asyncio.Task[None] | None = None
        self._round = asyncio.Lock()
        self._failures: dict[tuple[str, str], int] = {}
        # Catch-ups waiting for the round lock: a full round stops at its next request for
        # them, so a user's turn waits for its own spilled turns, not for everyone's.
        self._catching_up = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:  # (the first round at once: what a previous run left)
            try:
                await self.replay()
            except Exception:
                log.exception("spill_replay_failed")
            await asyncio.sleep(self.interval)

    async def replay(self, *, user: tuple[str, str] | None = None) -> dict[str, int]:
        """One round (one at a time): what became of each request (replayed: stored whole;
        begun: its turn stored, its outcome still to come; amended: only costs or an intent
        added to a record already there; duplicate, erased, refused, gone, failed). `user`
        (tenant, user): that user's requests only, the rest left for the next round."""
        if user is None:
            async with self._round:
                return await self._replay_round(None)
        self._catching_up += 1
        try:
            async with self._round:
                return await self._replay_round(user)
        finally:
            self._catching_up -= 1

    async def catch_up(self, tenant_id: str, user_id: str) -> bool:
        """Before a live turn of a user whose earlier turns wait in the spill: replay them
        first, so they go in before it, in order, and its conversation is found. False if
        some still wait (the live turn must then wait in the spill too). A caller that stops
        waiting does not stop the round. The spill's own files failing (a full or broken
        disk) is logged, and the turn waits too (which that failing, is refused with 503)."""
        if self.spill.holds(tenant_id, user_id):
            try:
                # This user's turns only: another tenant's large spill is not this turn's
                # wait (issue 34: turns degraded for about 65 s behind one tenant's replay).
                await asyncio.shield(self.replay(user=(tenant_id, user_id)))
            except OSError as exc:
                log.error("spill_replay_failed", error=str(exc))
        return not self.spill.holds(tenant_id, user_id)

    async def _replay_round(self, user: tuple[str, str] | None) -> dict[str, int]:
        counts: dict[str, int] = {}
        self.metrics.spill_bytes.set(self.spill.size())
        if self.spill.empty():
            return counts
        try:
            await self.db.ping()  # (rather than read the whole file while it is away)
        except StorageError:
            return counts
        batch = await self.spill.take()
        if batch is None:
            return counts
        requests = grouped(batch.entries)
        done: set[int] = set()  # (ids of the requests this round finished with)

        def rest() -> list[Spilled]:
            return [e for r in requests if id(r) not in done for e in r.entries()]

        left: list[Spilled] = []
        try:
            for request in requests:
                if user is not None and (request.first.tenant_id, request.first.user_id) != user:
                    continue
                if user is None and self._catching_up and done:
                    # A user's turn waits for its own spilled turns: this round stops here
                    # (between requests, having made progress) and the rest goes in the next.
                    break
                try:
                    result = await self._replay(request)
                except StorageError as exc:
                    # The database went again, or failed this request for now: the rest
                    # waits for the next round (a request failing again and again goes aside).
                    tries = self._failures[request.key] = self._failures.get(request.key, 0) + 1
                    if isinstance(exc, StorageUnavailable) or tries < MAX_TRIES:
                        log.warning("spill_replay_paused", error=str(exc), tries=tries)
                        break
                    await self.spill.dead_letter(request.entries(), repr(exc))
                    result = "failed"
                except Exception as exc:
                    await self.spill.dead_letter(request.entries(), repr(exc))
                    result = "failed"
                else:
                    if result in WROTE:
                        # The database took a write: requests need not wait out the storage
                        # circuit (a read alone does not say so: a held lock lets reads
                        # through, and a request found recorded already was only read).
                        self.memory.circuit.close(by="spill_replay")
                self._failures.pop(request.key, None)
                done.add(id(request))
                counts[result] = counts.get(result, 0) + 1
                self.metrics.spill_replayed.labels(result).inc()
            left = rest()
        except BaseException:
            left = batch.entries  # (cancelled: all of it again, replaying is idempotent)
            raise
        finally:
            await batch.close(left=left)
            self.metrics.spill_bytes.set(self.spill.size())
            if counts:
                log.info("spill_replayed", **counts)
                self.wake_jobs()
        return counts

    async def _replay(self, request: SpilledRequest) -> str:
        turn = request.turn
        if turn is not None and is_heavy(len(turn.data.get("messages", ()))):
            async with self.heavy.slot(request.first.tenant_id):
                return await self._replay_one(request, large=True)
        return await self._replay_one(request, large=False)

    async def _replay_one(self, request: SpilledRequest, *, large: bool) -> str:
        head = request.first
        tenant = self.config.tenants.get(head.tenant_id)
        if tenant is None:
            raise ValueError(f"tenant {head.tenant_id!r} is no longer configured")
        model = str((request.turn or head).data.get("model", ""))
        texts, documents = [], []
        if request.turn is not None:
            for message in request.turn.data["messages"]:  # dated when sent, not today
                message.setdefault("created_at", request.turn.at.isoformat())
            texts = list(request.turn.data["messages"])
            for fields in request.turn.data.get("documents", []):
                doc = Inline(**fields)
                documents.append((doc, await chunked(doc.content or "")))
        if request.outcome and request.outcome.data.get("reply"):
            texts.append(request.outcome.data["reply"])
        count = await TokenCounter(model).prepare(texts)
        work = partial(self.writes.apply, request, tenant, count, documents)
        # In the tenant's own lane (storage/fair_slots.py): a tenant's large spill does not
        # hold up the others' live turns. (A user's catch-up, inside their ordinary turn,
        # waits for the turn itself here: at most FairSlots' second, once, for a large turn
        # of theirs in the spill.)
        try:
            return await self.db.write(work, tenant=head.tenant_id, large=large)
        except ConflictError:  # a live request created the same conversation just now
            return await self.db.write(work, tenant=head.tenant_id, large=large)
