"""Conversation memory on the request path: identify, load, store the turn, store the reply.

`begin()` runs before the upstream is called, in one transaction: it finds or creates the
conversation, stores the request's new messages and opens the exchange record (`in_progress`),
so the user's turn is durable before anything else happens. `finish()` stores the reply (whole,
partial or none) and closes the exchange.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

from proxy.core.config import ContextSettings
from proxy.durability.storage_circuit import StorageCircuit, StorageCircuitOpen
from proxy.pipeline.reply import finish_in
from proxy.pipeline.turn import (
    IntentOf,
    Mode,
    Outcome,
    TokenCounter,
    Turn,
    classify_into,
    is_heavy,
    now,
    storage_time_scale,
)
from proxy.pipeline.turn_store import begin_in, opening, peek_in
from storage.database import Database
from storage.errors import ConflictError, StorageTimeout
from storage.records import NewExchange

T = TypeVar("T")
# Where late metadata writes are tracked: no user id can be this (they cannot hold NUL).
METADATA_WRITES = "\x00metadata"


class ConversationMemory:
    """Conversation memory on the request path.

    With `reply_after_response` (the default on SQLite, where one process owns the file), a
    reply is written just after the client has it rather than before: the next request of the
    same user, and every management call of the tenant, first waits for such writes (`settle`),
    so nothing reads a conversation without its last reply. Several replicas on PostgreSQL
    cannot see each other's pending writes, so there the reply is written before the response
    ends."""

    def __init__(
        self,
        db: Database,
        *,
        reply_after_response: bool | None = None,
        timeout: float | None = None,
        circuit: StorageCircuit | None = None,
    ) -> None:
        self.db = db
        # Storing a turn or a reply (waiting for the database) may take this long, at most.
        self.timeout = timeout
        # Storage that keeps failing or timing out is not tried for a while (default: always).
        self.circuit = circuit or StorageCircuit(0, 0)
        self.reply_after_response = (
            db.is_sqlite if reply_after_response is None else reply_after_response
        )
        self._unsettled: dict[tuple[str, str], set[asyncio.Task[Any]]] = {}

    def track(self, turn: Turn, task: asyncio.Task[Any], *, metadata: bool = False) -> None:
        """A reply write still running for `turn`'s user; `settle` waits for it. A write of
        `metadata` only (a late intent) holds up management calls, not the user's next turn."""
        key = (turn.tenant_id, METADATA_WRITES if metadata else turn.user_id)
        tasks = self._unsettled.setdefault(key, set())
        tasks.add(task)

        def done(_: asyncio.Task[Any]) -> None:
            tasks.discard(task)
            if not tasks and self._unsettled.get(key) is tasks:
                del self._unsettled[key]

        task.add_done_callback(done)

    async def settle(self, tenant_id: str, user_id: str | None = None) -> None:
        """Wait for reply writes of a user (or of a whole tenant) still in flight."""
        waiting = [
            task
            for (tenant, user), tasks in self._unsettled.items()
            if tenant == tenant_id and (user_id is None or user == user_id)
            for task in tasks
        ]
        if waiting:
            await asyncio.wait(waiting)

    async def begin(
        self,
        *,
        request_id: str,
        tenant_id: str,
        user_id: str,
        conversation_id: str | None,
        mode: Mode,
        idempotency_key: str | None,
        messages: list[dict[str, Any]],
        model: str,
        upstream: str,
        stream: bool,
        context: ContextSettings,
        intent_of: IntentOf | None = None,
    ) -> Turn:
        """`intent_of` classifies the newest user turn given the messages before it (stored
        history, then the request's): microseconds, so it runs inside the transaction, where
        the history is known, and its result is stored with the turn."""
        turn, exchange = opening(
            request_id=request_id,
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_id=conversation_id,
            mode=mode,
            idempotency_key=idempotency_key,
            model=model,
            upstream=upstream,
            stream=stream,
            started_at=now(),
        )
        if mode == "off" and idempotency_key is None:
            # Nothing to store before the upstream call: the exchange is recorded whole when
            # it ends, off the response path; nor to classify (see `classify`).
            turn.pending = exchange
            turn.unclassified = partial(classify_into, turn, exchange, intent_of, messages)
            return turn
        count = await TokenCounter(model).prepare(messages)
        return await self.in_time(
            self._store_turn(turn, exchange, conversation_id, messages, context, count, intent_of),
            scale=storage_time_scale(len(messages)),
        )

    async def peek(
        self,
        *,
        tenant_id: str,
        user_id: str,
        conversation_id: str | None,
        mode: Mode,
        messages: list[dict[str, Any]],
        model: str,
        upstream: str,
        context: ContextSettings,
        intent_of: IntentOf | None = None,
    ) -> Turn:
        """The turn as `begin()` would find it (its conversation, history and keyword intent),
        read in one read transaction and stored nowhere: for count_tokens. A conversation
        the request would open is not there yet (`conversation` None)."""
        turn, exchange = opening(
            request_id="",
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_id=conversation_id,
            mode=mode,
            idempotency_key=None,
            model=model,
            upstream=upstream,
            stream=False,
            started_at=now(),
        )
        if mode == "off":  # (nothing attached: see `begin`)
            turn.pending = exchange
            return turn
        count = await TokenCounter(model).prepare(messages)
        await self.settle(tenant_id, user_id)  # (the user's last reply may be on its way)
        work = partial(peek_in, turn, conversation_id, messages, context, count, intent_of)
        return await self.in_time(self.db.read(work))

    async def _store_turn(
        self,
        turn: Turn,
        exchange: NewExchange,
        conversation_id: str | None,
        messages: list[dict[str, Any]],
        context: ContextSettings,
        count: TokenCounter,
        intent_of: IntentOf | None,
    ) -> Turn:
        tenant_id, user_id, idempotency_key = turn.tenant_id, turn.user_id, exchange.idempotency_key
        await self.settle(tenant_id, user_id)
        for attempt in (1, 2):
            exchange.idempotency_key = idempotency_key  # an attempt may have cleared it
            try:
                await self.db.write(
                    partial(
                        begin_in,
                        turn,
                        exchange,
                        conversation_id,
                        messages,
                        context,
                        count,
                        intent_of,
                    ),
                    tenant=tenant_id,
                    large=is_heavy(len(messages)),
                )
                return turn
            except ConflictError:
                # A concurrent request created the same conversation or used the same
                # idempotency key first; the second attempt finds its row.
                if attempt == 2:
                    raise
                turn = Turn(turn.request_id, tenant_id, user_id, turn.mode, turn.model)
        raise AssertionError("unreachable")

    async def in_time(self, work: Coroutine[Any, Any, T], *, scale: float = 1.0) -> T:
        """`work` (waiting for the database), or StorageTimeout after `timeout` (times
        `scale`: a heavy turn's, storage_time_scale); while the storage circuit is open,
        StorageCircuitOpen at once, `work` not started. A write that has not begun by the
        timeout is abandoned (Database.write); one already running may still land: the
        spill's replay finds it recorded and does not store it twice."""
        try:
            trial = self.circuit.admit()
        except StorageCircuitOpen:
            work.close()  # (never started)
            raise
        seconds = None if self.timeout is None else self.timeout * scale
        with self.circuit.outcome(trial=trial):
            try:
                return await asyncio.wait_for(work, seconds)
            except TimeoutError as exc:
                raise StorageTimeout(f"storage took longer than {seconds:g} s") from exc

    async def finish(self, turn: Turn, outcome: Outcome) -> None:
        """Store the reply (whole, partial or none) and close the exchange record."""
        count = await TokenCounter(turn.model).prepare([outcome.reply] if outcome.reply else [])
        await self.in_time(
            self.db.write(
                partial(
                    finish_in,
                    turn,
                    outcome.status,
                    outcome.reply,
                    outcome.fields(),
                    count,
                    keep=outcome.keep,
                ),
                tenant=turn.tenant_id,
            )
        )
