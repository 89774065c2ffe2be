"""What goes into the spill (proxy/durability/spill.py), and writing it to the database once
it answers.

Entries are grouped by request: a turn (what `begin()` was given), its outcome (what `finish()`
was given), or a whole mode-off record, and what amends its record after it: the costs of the
proxy's own calls (charges, each added once) and the LLM's intent. Each request is replayed in
one transaction, through the same code as a live request (`begin_in`, `finish_in`), so its
conversation is found or created as it would have been then. A request whose exchange is
recorded already is skipped (but for its amendments), which makes a replay safe to repeat:
after a crash half-way, after a `begin()` that timed out but landed, or with the spill shared
by replicas on one host. A user erased after the request began is not written back
(`erasures`).

A turn whose request was refused by rules that need the database (its conversation belongs to
another user, an idempotency key reused by another user) is recorded as an exchange with the
reason and no messages, as the live request would have been refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, cast

import structlog
from sqlalchemy import Connection

from proxy.accounting.charges import add_part
from proxy.accounting.metrics import Metrics
from proxy.core.config import Config, TenantConfig
from proxy.core.errors import ProxyError
from proxy.core.requests import Inline
from proxy.durability.spill import Spilled, SpillFile
from proxy.pipeline.artifacts import Chunked, chunked, store_documents
from proxy.pipeline.intent import record_intent
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.reply import answered_since, finish_in
from proxy.pipeline.turn import IntentOf, Mode, Outcome, TokenCounter, Turn
from proxy.pipeline.turn_store import begin_in, opening
from storage.errors import ConflictError, StorageError, StorageUnavailable
from storage.records import ConversationRecord, ExchangeRecord
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.system import SWEPT

log = structlog.get_logger("memproxy.spill")

DATE_KEYS = ("started_at", "finished_at")
# A request the database keeps failing (not unreachable) is set aside after this many rounds.
MAX_TRIES = 5
# What became of a request when its replay wrote to the database.
WROTE = frozenset({"replayed", "begun", "refused", "amended"})


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


def _conversation_of(
    conversations: Conversations, found: ExchangeRecord
) -> ConversationRecord | None:
    """The conversation an exchange begun in the database was stored in, locked, if it is
    still that one (not another given its id since); else None."""
    if found.conversation_id is None:
        return None
    return conversations.still(
        found.tenant_id,
        found.conversation_id,
        found.conversation_pk,
        found.user_id,
        for_update=True,
    )


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
    documents: Sequence[Inline] = (),
) -> Spilled:
    """A turn `begin()` could not store: what it was given, and the request's inline
    documents (`attachments` with content), stored with its conversation in mode `full`."""
    data: dict[str, Any] = {
        "mode": mode,
        "model": model,
        "conversation_id": conversation_id,
        "idempotency_key": idempotency_key,
        "messages": messages,
        "upstream": upstream,
        "stream": stream,
    }
    if documents and mode == "full":
        data["documents"] = [
            {"content": d.content, "title": d.title, "source": d.source} for d in documents
        ]
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


def spilled_charge(
    tenant_id: str, user_id: str, request_id: str, at: datetime, part: dict[str, Any]
) -> Spilled:
    """A cost part of the proxy's own model call (`MemoryCharges.priced`) that its exchange
    record could not take yet."""
    return Spilled("charge", tenant_id, user_id, request_id, at, {"part": part})


def spilled_intent(
    tenant_id: str, user_id: str, request_id: str, at: datetime, detail: dict[str, Any]
) -> Spilled:
    """The LLM's intent for a request (`Intent.as_dict()`) that its exchange record could not
    take yet."""
    return Spilled("intent", tenant_id, user_id, request_id, at, {"intent": detail})


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
    intent: Spilled | None = None
    charges: list[Spilled] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.first.tenant_id, self.first.request_id)

    def entries(self) -> list[Spilled]:
        entries = (self.turn, self.outcome, self.record, self.intent)
        return [e for e in entries if e is not None] + self.charges


def grouped(entries: list[Spilled]) -> list[_Request]:
    """Entries by request, in the order the requests first appear (so a conversation's turns
    are replayed in their order)."""
    requests: dict[tuple[str, str], _Request] = {}
    for entry in entries:
        request = requests.setdefault((entry.tenant_id, entry.request_id), _Request(entry))
        if entry.kind == "charge":
            request.charges.append(entry)
        else:
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
        self._round = asyncio.Lock()
        self._failures: dict[tuple[str, str], int] = {}

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

    async def replay(self) -> dict[str, int]:
        """One round (one at a time): what became of each request (replayed: stored whole;
        begun: its turn stored, its outcome still to come; amended: only costs or an intent
        added to a record already there; duplicate, erased, refused, gone, failed)."""
        async with self._round:
            return await self._replay_round()

    async def catch_up(self, tenant_id: str, user_id: str) -> bool:
        """Before a live turn of a user whose earlier turns wait in the spill: replay them
        first, so they go in before it, in order, and its conversation is found. False if
        some still wait (the live turn must then wait in the spill too). A caller that stops
        waiting does not stop the round. The spill's own files failing (a full or broken
        disk) is logged, and the turn waits too (which that failing, is refused with 503)."""
        if self.spill.holds(tenant_id, user_id):
            try:
                await asyncio.shield(self.replay())
            except OSError as exc:
                log.error("spill_replay_failed", error=str(exc))
        return not self.spill.holds(tenant_id, user_id)

    async def _replay_round(self) -> dict[str, int]:
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
        left: list[Spilled] = []
        try:
            for n, request in enumerate(requests):
                try:
                    result = await self._replay(request)
                except StorageError as exc:
                    # The database went again, or failed this request for now: the rest
                    # waits for the next round (a request failing again and again goes aside).
                    tries = self._failures[request.key] = self._failures.get(request.key, 0) + 1
                    if isinstance(exc, StorageUnavailable) or tries < MAX_TRIES:
                        log.warning("spill_replay_paused", error=str(exc), tries=tries)
                        left = [e for r in requests[n:] for e in r.entries()]
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
                counts[result] = counts.get(result, 0) + 1
                self.metrics.spill_replayed.labels(result).inc()
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

    async def _replay(self, request: _Request) -> str:
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
        work = partial(self._apply, request, tenant, count, documents)
        try:
            return await self.db.write(work)
        except ConflictError:  # a live request created the same conversation just now
            return await self.db.write(work)

    def _apply(
        self,
        request: _Request,
        tenant: TenantConfig,
        count: TokenCounter,
        documents: Chunked,
        conn: Connection,
    ) -> str:
        result = self._apply_exchange(request, tenant, count, documents, conn)
        if result == "erased":
            return result
        # Then what amends its record: the intent replaces the keyword one, as live; each
        # charge is added once, however often the replay repeats.
        wrote = False
        if request.intent is not None:
            head = request.intent
            wrote = record_intent(
                conn,
                tenant_id=head.tenant_id,
                request_id=head.request_id,
                detail=head.data["intent"],
            )
        for charge in request.charges:
            part = charge.data["part"]
            wrote = add_part(conn, charge.tenant_id, charge.request_id, part) == "added" or wrote
        return "amended" if wrote and result == "duplicate" else result

    def _apply_exchange(
        self,
        request: _Request,
        tenant: TenantConfig,
        count: TokenCounter,
        documents: Chunked,
        conn: Connection,
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
        elif request.outcome is not None and (
            found.status == "in_progress" or found.error == SWEPT
        ):
            turn = self._resumed(conn, found, request.outcome)
        else:
            # The turn's own write landed late (its documents were not stored with it), and
            # its outcome, if any, comes in a later round: the documents go in now, or never.
            if documents and found.mode == "full":
                conv = _conversation_of(Conversations(conn), found)
                if conv is not None:
                    self._store(conn, head, conv.pk, documents)
                    return "amended"
            return "duplicate"
        if documents and turn.mode == "full" and turn.conversation is not None:
            # (Also when the turn's own write landed late: the documents were not stored.)
            self._store(conn, head, turn.conversation.pk, documents)
        if request.outcome is None:
            return "begun"
        data = request.outcome.data
        fields = _dates_in(data["fields"])
        reply, at = data.get("reply"), fields.get("finished_at")
        finish_in(turn, data["status"], reply, fields, count, conn, replied_at=at)
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
            begin_in(
                turn,
                exchange,
                data.get("conversation_id"),
                messages,
                tenant.context,
                count,
                self.intent_of(entry.tenant_id),
                conn,
                forks=False,
            )
        except ProxyError as exc:  # (raised before anything is written)
            log.warning("spill_turn_refused", request_id=entry.request_id, error=exc.message)
            exchange.idempotency_key = None  # (its owner holds it)
            refused = Outcome(
                "error", exc.status, error=f"answered while storage was down, not stored: {exc}"
            )
            Exchanges(conn).insert_finished([exchange.row() | refused.fields()])
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

    @staticmethod
    def _store(conn: Connection, head: Spilled, conversation_pk: int, documents: Chunked) -> None:
        """A spilled turn's inline documents, with its conversation (those already there, by
        their content, are not stored twice)."""
        store_documents(
            conn,
            request_id=head.request_id,
            tenant_id=head.tenant_id,
            user_id=head.user_id,
            conversation_pk=conversation_pk,
            documents=documents,
            now=head.at,
        )

    def _resumed(self, conn: Connection, found: ExchangeRecord, outcome: Spilled | None) -> Turn:
        """The turn of an exchange begun in the database (its `begin()` landed, or its
        `finish()` failed), as `finish_in` needs it."""
        conversations = Conversations(conn)
        conv, last = _conversation_of(conversations, found), None
        if conv is not None:
            last = conversations.first_seq_of_exchange(
                found.tenant_id, conv.pk, found.request_id, last=True
            )
            if last is not None and last + 1 != conv.next_seq:
                # Turns were stored after this one meanwhile: the conversation as this turn
                # left it, so the reply is placed as a late live reply is (`finish_in`: kept
                # beside an answer already there, else after them).
                conv = dataclasses.replace(conv, next_seq=last + 1)
        mode = cast(Mode, found.mode)
        turn = Turn(found.request_id, found.tenant_id, found.user_id, mode, found.model, conv)
        turn.reply_to = found.reply_to
        flags = (outcome.data.get("turn") if outcome else None) or {}
        store = flags.get("store_reply")
        if store is None and conv is not None:
            # Without the live turn's word, as a live turn decides: a reply is stored unless
            # the turn was answered already (a retry of an answered turn stores none; a
            # retry, which stores no messages of its own, of an unanswered one does).
            answered = found.reply_to is None or answered_since(
                conversations,
                dataclasses.replace(conv, next_seq=found.reply_to + 1),
                found.reply_to,
            )
            store = mode == "full" and (last is not None or not answered)
        turn.store_reply = conv is not None and bool(store)
        self._flag(turn, flags)
        return turn
