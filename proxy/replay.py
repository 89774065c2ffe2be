"""What goes into the spill (proxy/spill.py), and writing it to the database once it answers.

Entries are grouped by request: a turn (what `begin()` was given), its outcome (what `finish()`
was given), or a whole mode-off record. Each request is replayed in one transaction, through
the same code as a live request (`begin_in`, `finish_in`), so its conversation is found or
created as it would have been then. A request whose exchange is recorded already is skipped,
which makes a replay safe to repeat: after a crash half-way, after a `begin()` that timed out
but landed, or with the spill shared by replicas on one host. A user erased after the request
began is not written back (`erasures`).

A turn whose request was refused by rules that need the database (its conversation belongs to
another user, an idempotency key reused by another user) is recorded as an exchange with the
reason and no messages, as the live request would have been refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, cast

import structlog
from sqlalchemy import Connection

from proxy.config import Config, TenantConfig
from proxy.errors import ProxyError
from proxy.memory import (
    ConversationMemory,
    IntentOf,
    Mode,
    Outcome,
    TokenCounter,
    Turn,
    finish_in,
    opening,
    pending_fields,
)
from proxy.metrics import Metrics
from proxy.spill import Spilled, SpillFile
from storage.errors import ConflictError, StorageUnavailable
from storage.records import ExchangeRecord
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.system import SWEPT

log = structlog.get_logger("memproxy.spill")

DATE_KEYS = ("started_at", "finished_at")


def _dates_out(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.isoformat() if k in DATE_KEYS and isinstance(v, datetime) else v
        for k, v in values.items()
    }


def _dates_in(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: datetime.fromisoformat(v) if k in DATE_KEYS and isinstance(v, str) else v
        for k, v in values.items()
    }


def spilled_turn(
    *,
    request_id: str,
    tenant_id: str,
    user_id: str,
    started_at: datetime,
    mode: Mode,
    model: str,
    conversation_id: str | None,
    idempotency_key: str | None,
    messages: list[dict[str, Any]],
    upstream: str,
    stream: bool,
) -> Spilled:
    """A turn `begin()` could not store: what it was given."""
    data = {
        "mode": mode,
        "model": model,
        "conversation_id": conversation_id,
        "idempotency_key": idempotency_key,
        "messages": messages,
        "upstream": upstream,
        "stream": stream,
    }
    return Spilled("turn", tenant_id, user_id, request_id, started_at, data)


def spilled_outcome(
    tenant_id: str,
    user_id: str,
    request_id: str,
    at: datetime,
    outcome: Outcome,
    *,
    turn: Turn | None,
) -> Spilled:
    """An outcome `finish()` could not store. `turn`, when it is in the database (its
    `finish()` failed): what `finish()` would have done with it goes along."""
    data: dict[str, Any] = {
        "status": outcome.status,
        "reply": outcome.reply,
        "fields": _dates_out(outcome.fields()),
    }
    if turn is not None:
        data["turn"] = {
            "store_reply": turn.store_reply,
            "extract": turn.extract,
            "embed": turn.embed,
            "summarize_through": turn.summarize_through,
        }
    return Spilled("outcome", tenant_id, user_id, request_id, at, data)


def spilled_record(row: dict[str, Any]) -> Spilled:
    """A whole mode-off exchange record whose batch could not be written."""
    tenant_id, user_id, request_id = row["tenant_id"], row["user_id"], row["request_id"]
    return Spilled("record", tenant_id, user_id, request_id, row["started_at"], _dates_out(row))


@dataclass(frozen=True, slots=True)
class Wanted:
    """What to queue after a replayed reply: memory extraction, embedding."""

    extract: bool
    embed: bool


@dataclass(slots=True)
class _Request:
    """One request's entries."""

    first: Spilled
    turn: Spilled | None = None
    outcome: Spilled | None = None
    record: Spilled | None = None


def grouped(entries: list[Spilled]) -> list[_Request]:
    """Entries by request, in the order the requests first appear (so a conversation's turns
    are replayed in their order)."""
    requests: dict[tuple[str, str], _Request] = {}
    for entry in entries:
        request = requests.setdefault((entry.tenant_id, entry.request_id), _Request(entry))
        setattr(request, entry.kind, entry)
    return list(requests.values())


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
    ) -> None:
        """`intent_of(tenant)` classifies a replayed turn as a live one would be;
        `wanted(tenant, user, mode)` says what to queue after its reply."""
        self.spill, self.memory, self.db = spill, memory, memory.db
        self.config, self.metrics = config, metrics
        self.intent_of, self.wanted, self.wake_jobs = intent_of, wanted, wake_jobs
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.replay()
            except Exception:
                log.exception("spill_replay_failed")

    async def replay(self) -> dict[str, int]:
        """One round: what became of each request (replayed, duplicate, erased, ...)."""
        counts: dict[str, int] = {}
        self.metrics.spill_bytes.set(self.spill.size())
        batch = await self.spill.take()
        if batch is None:
            return counts
        done = False
        try:
            for request in grouped(batch.entries):
                try:
                    result = await self._replay(request)
                except StorageUnavailable as exc:
                    log.warning("spill_replay_paused", error=str(exc))
                    return counts
                except Exception as exc:
                    entries = [e for e in (request.turn, request.outcome, request.record) if e]
                    await self.spill.dead_letter(entries, repr(exc))
                    result = "failed"
                counts[result] = counts.get(result, 0) + 1
                self.metrics.spill_replayed.labels(result).inc()
            done = True
        finally:
            await batch.close(done=done)
            self.metrics.spill_bytes.set(self.spill.size())
            if counts:
                log.info("spill_replayed", **counts)
                self.wake_jobs()
        return counts

    async def _replay(self, request: _Request) -> str:
        head = request.first
        tenant = self.config.tenants.get(head.tenant_id)
        if tenant is None:
            raise ValueError(f"tenant {head.tenant_id!r} is no longer configured")
        model = str((request.turn or head).data.get("model", ""))
        texts = list(request.turn.data["messages"]) if request.turn else []
        if request.outcome and request.outcome.data.get("reply"):
            texts.append(request.outcome.data["reply"])
        count = await TokenCounter(model).prepare(texts)
        work = partial(self._apply, request, tenant, count)
        try:
            return await self.db.write(work)
        except ConflictError:  # a live request created the same conversation just now
            return await self.db.write(work)

    def _apply(
        self, request: _Request, tenant: TenantConfig, count: TokenCounter, conn: Connection
    ) -> str:
        head = request.first
        tenant_id, user_id, request_id = head.tenant_id, head.user_id, head.request_id
        erasures = Erasures(conn)
        erasures.lock(tenant_id, user_id)
        if erasures.erased_since(tenant_id, user_id, head.at):
            return "erased"
        exchanges = Exchanges(conn)
        found = exchanges.get(tenant_id, request_id)
        if request.record is not None:
            if found is not None:
                return "duplicate"
            exchanges.insert_finished([_dates_in(request.record.data)])
            return "replayed"
        if found is None:
            if request.turn is None:
                return "gone"  # begun in the database, deleted since (conversation, retention)
            turn = self._begin(conn, request.turn, tenant, count)
            if turn is None:
                return "refused"
        elif found.status == "in_progress" or found.error == SWEPT:
            turn = self._resumed(conn, found, request.outcome)
        else:
            return "duplicate"
        if request.outcome is not None:
            data = request.outcome.data
            fields = _dates_in(data["fields"])
            finish_in(turn, data["status"], data.get("reply"), fields, count, conn)
        return "replayed"

    def _begin(
        self, conn: Connection, entry: Spilled, tenant: TenantConfig, count: TokenCounter
    ) -> Turn | None:
        data = entry.data
        turn, exchange = opening(
            request_id=entry.request_id,
            tenant_id=entry.tenant_id,
            user_id=entry.user_id,
            conversation_id=data.get("conversation_id"),
            mode=data["mode"],
            idempotency_key=data.get("idempotency_key"),
            model=data["model"],
            upstream=data["upstream"],
            stream=bool(data.get("stream")),
            started_at=entry.at,
        )
        messages = data["messages"]
        try:
            self.memory.begin_in(
                turn,
                exchange,
                data.get("conversation_id"),
                messages,
                tenant.context,
                count,
                self.intent_of(entry.tenant_id),
                conn,
            )
        except ProxyError as exc:  # (raised before anything is written)
            log.warning("spill_turn_refused", request_id=entry.request_id, error=exc.message)
            exchange.idempotency_key = None  # (its owner holds it)
            refused = Outcome(
                "error", exc.status, error=f"answered while storage was down, not stored: {exc}"
            )
            Exchanges(conn).insert_finished([pending_fields(exchange) | refused.fields()])
            return None
        self._flag(turn, {})
        return turn

    def _flag(self, turn: Turn, flags: dict[str, Any]) -> None:
        """What `finish_in` queues after the reply: as the live request decided, when it
        got as far, else as a live request would now."""
        wanted = self.wanted(turn.tenant_id, turn.user_id, turn.mode)
        turn.extract = bool(flags.get("extract", wanted.extract))
        turn.embed = bool(flags.get("embed", wanted.embed))
        turn.summarize_through = flags.get("summarize_through")

    def _resumed(self, conn: Connection, found: ExchangeRecord, outcome: Spilled | None) -> Turn:
        """The turn of an exchange begun in the database (its `begin()` landed, or its
        `finish()` failed), as `finish_in` needs it."""
        conv = None
        if found.conversation_id is not None:
            conv = Conversations(conn).get(found.tenant_id, found.conversation_id, for_update=True)
        mode = cast(Mode, found.mode)
        turn = Turn(found.request_id, found.tenant_id, found.user_id, mode, found.model, conv)
        flags = (outcome.data.get("turn") if outcome else None) or {}
        turn.store_reply = conv is not None and bool(flags.get("store_reply", mode == "full"))
        self._flag(turn, flags)
        return turn
