"""Conversation memory on the request path: identify, load, store the turn, store the reply.

`begin()` runs before the upstream is called, in one transaction: it finds or creates the
conversation, stores the request's new messages and opens the exchange record (`in_progress`),
so the user's turn is durable before anything else happens. `finish()` stores the reply (whole,
partial or none) and closes the exchange.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, Literal, TypeVar

import structlog
from sqlalchemy import Connection

from policies.context import StoredTurn
from policies.extraction import JOB_KIND as EXTRACTION
from policies.identity import (
    chain_hashes,
    chain_next,
    continues,
    fingerprint,
    rewind,
    split_request,
)
from policies.intent import Intent
from policies.summaries import JOB_KIND as SUMMARIZE
from policies.summaries import KIND as HISTORY_SUMMARY
from policies.tokens import count_message, message_text
from policies.vectors import EMBED_JOB_KIND as EMBED
from proxy.accounting.costs import NO_BILL_FIELDS, TOKENIZE_INLINE_CHARS, Bill
from proxy.core.config import ContextSettings
from proxy.core.errors import Conflict, NotFound, Unprocessable
from proxy.core.requests import parse_timestamp, reply_problem
from proxy.durability.storage_circuit import StorageCircuit, StorageCircuitOpen
from storage.database import Database
from storage.errors import ConflictError, StaleConversation, StorageTimeout
from storage.records import ConversationRecord, MessageRecord, NewExchange, NewMessage
from storage.repositories.conversations import SUPERSEDED, Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.summaries import Summaries

log = structlog.get_logger("memproxy.memory")
T = TypeVar("T")
Mode = Literal["full", "read", "off"]
# The intent of a request's newest user turn, given the messages up to it.
IntentOf = Callable[[list[dict[str, Any]]], Intent | None]
ANONYMOUS = "anonymous"
# Where late metadata writes are tracked: no user id can be this (they cannot hold NUL).
METADATA_WRITES = "\x00metadata"
# Stored messages read beyond the history window, so a tool call's replies are not cut off.
TAIL_SLACK = 8
# A reply's status when the upstream's message is not one a client could send back.
MALFORMED = "malformed"


def now() -> datetime:
    return datetime.now(UTC)


def new_conversation_id() -> str:
    return "conv_" + secrets.token_hex(12)


@dataclass(slots=True)
class Turn:
    """What `begin()` learned and `finish()` needs."""

    request_id: str
    tenant_id: str
    user_id: str
    mode: Mode
    model: str
    conversation: ConversationRecord | None = None
    # The conversation was opened by this turn: nothing was stored in it before.
    opened: bool = False
    history: list[StoredTurn] = field(default_factory=list)
    store_reply: bool = False
    # Queue memory extraction once the reply is stored (the tenant extracts; a named user).
    extract: bool = False
    # Queue embedding of the stored messages with the reply (the tenant has embeddings on).
    embed: bool = False
    # Queue a history summary covering the conversation through this seq, with the reply.
    summarize_through: int | None = None
    # An exchange not yet written (mode off): `finish()` records it whole.
    pending: NewExchange | None = None
    # The keyword intent of the newest user turn, once the history it may refer to is known.
    intent: Intent | None = None
    # Mode off: what finds `intent` (nothing before the upstream call depends on it), for the
    # caller to run when it suits it (`classify`).
    unclassified: Callable[[], Intent | None] | None = None
    # Messages of this conversation from this seq on are newer than what this turn may see (a
    # replay sees the conversation as its original did): recall leaves them out.
    visible_before: int | None = None
    # The seq of the message the reply answers (its `reply_to`, kept on the exchange too):
    # the turn's last message; a retry's, its original's. Unset (an exchange recorded before
    # it was kept), the last one stored when the turn began.
    reply_to: int | None = None

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if self.conversation else None


@dataclass(slots=True)
class Outcome:
    status: Literal["complete", "incomplete", "error"]
    http_status: int | None = None
    reply: dict[str, Any] | None = None
    bill: Bill | None = None
    error: str | None = None
    latency_ms: float | None = None
    ttft_ms: float | None = None
    upstream_ms: float | None = None
    # The proxy's own time: before forwarding, and (non-stream) after the upstream answered.
    overhead_ms: float | None = None
    attached: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The exchange record's columns for this outcome."""
        return {
            "status": self.status,
            "http_status": self.http_status,
            "finished_at": now(),
            "latency_ms": self.latency_ms,
            "ttft_ms": self.ttft_ms,
            "upstream_ms": self.upstream_ms,
            "overhead_ms": self.overhead_ms,
            "attached": self.attached,
            **(self.bill.fields() if self.bill else NO_BILL_FIELDS),
            "error": self.error,
        }


class TokenCounter:
    """Counts messages' tokens inside a transaction. Texts too long to tokenize without
    holding up the event loop are counted beforehand, in a worker thread (`prepare`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._known: dict[int, int] = {}

    async def prepare(self, messages: list[dict[str, Any]]) -> TokenCounter:
        if sum(len(message_text(m)) for m in messages) > TOKENIZE_INLINE_CHARS:
            counts = await asyncio.to_thread(
                lambda: [count_message(m, self.model) for m in messages]
            )
            self._known.update((id(m), n) for m, n in zip(messages, counts, strict=True))
        return self

    def __call__(self, message: dict[str, Any]) -> int:
        known = self._known.get(id(message))
        return known if known is not None else count_message(message, self.model)


def answered_since(
    conversations: Conversations, as_begun: ConversationRecord, reply_to: int
) -> bool:
    """Whether an attempt at this turn (the message at seq `reply_to`) stored a complete reply
    to it after `as_begun` (the conversation as an attempt began). A reply to an overlapping
    turn stored meanwhile is not one; nor is a partial reply, nor an imported message. An
    assistant message without `reply_to` (one a client sent back in its history, or a reply
    stored before replies named their turn) counts when it comes right after the turn."""
    replies = conversations.replies_after(as_begun.tenant_id, as_begun.pk, as_begun.next_seq - 1)
    for seq, status, meta in replies:
        if "reply_to" not in meta:
            if seq == as_begun.next_seq:
                return True
        elif meta["reply_to"] == reply_to and status == "complete":
            return True
    return False


def _fork_points(tail: Sequence[MessageRecord]) -> list[str | None]:
    """The chain hashes of the stored messages a client may have gone another way from: from
    the first reply stored in the tail on. What came before the first reply is what the
    conversation's opening request carried, which a thin client may send again and again (a
    greeting, instructions as a first user message, few-shot examples): going back there is
    no fork, and taking it for one would set the whole conversation aside."""
    first = next(
        (i for i, m in enumerate(tail) if m.role == "assistant" and "reply_to" in m.meta),
        len(tail),
    )
    return [m.chain_hash for m in tail[first:]]


def _new_messages(
    messages: list[dict[str, Any]],
    hashes: list[str],
    count: TokenCounter,
    exchange_id: str | None = None,
    intent: Intent | None = None,
) -> list[NewMessage]:
    """Rows for complete messages; `created_at` (imports) is honoured when present; the
    intent goes into the metadata of the last user message."""
    rows = [
        NewMessage(
            role=str(m["role"]),
            content=m.get("content"),
            name=m.get("name"),
            tool_calls=m.get("tool_calls"),
            tool_call_id=m.get("tool_call_id"),
            tokens=count(m),
            chain_hash=h,
            exchange_id=exchange_id,
            created_at=parse_timestamp(m["created_at"], "created_at")
            if "created_at" in m
            else None,
        )
        for m, h in zip(messages, hashes, strict=True)
    ]
    if intent is not None:
        last_user = next((r for r in reversed(rows) if r.role == "user"), None)
        if last_user is not None:
            last_user.meta = {**last_user.meta, "intent": intent.as_dict()}
    return rows


def _classify(
    turn: Turn,
    exchange: NewExchange,
    intent_of: IntentOf | None,
    messages: list[dict[str, Any]],
) -> Intent | None:
    """The turn's intent, also on its exchange record."""
    if intent_of is not None:
        try:
            turn.intent = intent_of(messages)
        except Exception:  # intent is metadata: it never fails the turn it describes
            log.exception("intent_failed", request_id=turn.request_id)
            turn.intent = None
        if turn.intent is not None:
            exchange.intent = turn.intent.label
            exchange.intent_detail = turn.intent.as_dict()
    return turn.intent


def classify(turn: Turn) -> Intent | None:
    """The turn's keyword intent, found now if `begin()` left it for later (mode off)."""
    if turn.unclassified is not None:
        unclassified, turn.unclassified = turn.unclassified, None
        unclassified()
    return turn.intent


def opening(
    *,
    request_id: str,
    tenant_id: str,
    user_id: str,
    conversation_id: str | None,
    mode: Mode,
    idempotency_key: str | None,
    model: str,
    upstream: str,
    stream: bool,
    started_at: datetime,
) -> tuple[Turn, NewExchange]:
    """A turn about to begin, and its exchange record as it opens."""
    turn = Turn(request_id, tenant_id, user_id, mode, model)
    exchange = NewExchange(
        request_id=request_id,
        tenant_id=tenant_id,
        user_id=user_id,
        model=model,
        upstream=upstream,
        mode=mode,
        stream=stream,
        started_at=started_at,
        conversation_id=conversation_id,
        idempotency_key=idempotency_key,
    )
    return turn, exchange


def _stored(record: MessageRecord) -> StoredTurn:
    return StoredTurn(record.to_openai(), record.tokens, record.seq)


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
            turn.unclassified = partial(_classify, turn, exchange, intent_of, messages)
            return turn
        count = await TokenCounter(model).prepare(messages)
        return await self.in_time(
            self._store_turn(turn, exchange, conversation_id, messages, context, count, intent_of)
        )

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
                        self.begin_in,
                        turn,
                        exchange,
                        conversation_id,
                        messages,
                        context,
                        count,
                        intent_of,
                    )
                )
                return turn
            except ConflictError:
                # A concurrent request created the same conversation or used the same
                # idempotency key first; the second attempt finds its row.
                if attempt == 2:
                    raise
                turn = Turn(turn.request_id, tenant_id, user_id, turn.mode, turn.model)
        raise AssertionError("unreachable")

    async def in_time(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` (waiting for the database), or StorageTimeout after `timeout`; while the
        storage circuit is open, StorageCircuitOpen at once, `work` not started. On SQLite
        a write already handed to the writer thread may still land later: the spill's replay
        finds it recorded and does not store it twice."""
        try:
            trial = self.circuit.admit()
        except StorageCircuitOpen:
            work.close()  # (never started)
            raise
        with self.circuit.outcome(trial=trial):
            try:
                return await asyncio.wait_for(work, self.timeout)
            except TimeoutError as exc:
                raise StorageTimeout(f"storage took longer than {self.timeout:g} s") from exc

    def begin_in(
        self,
        turn: Turn,
        exchange: NewExchange,
        conversation_id: str | None,
        messages: list[dict[str, Any]],
        context: ContextSettings,
        count: TokenCounter,
        intent_of: IntentOf | None,
        conn: Connection,
        *,
        forks: bool = True,
    ) -> None:
        """`begin()`'s work inside the caller's transaction (also the spill's replay). A user
        erased since the request began (its turn waited for the erasure) is not stored again
        from it: Conflict, nothing written. Without `forks` (a replay: the conversation may
        have gone on since), a request that went another way from a stored message does not
        move the conversation's chain back to it."""
        erasures = Erasures(conn)
        erasures.share(turn.tenant_id, turn.user_id)  # never half before an erasure
        if erasures.erased_since(turn.tenant_id, turn.user_id, exchange.started_at):
            raise Conflict(
                "The user was erased while this request was on its way; nothing of it was "
                "stored. Send it again to start afresh.",
                code="user_erased",
            )
        hashes = chain_hashes(messages)  # (the last one identifies the request's messages)
        key = self._resolve(
            conn,
            turn,
            conversation_id,
            exchange.idempotency_key,
            messages,
            hashes,
            context,
            count,
            lambda history: _classify(turn, exchange, intent_of, history + messages),
            forks=forks,
        )
        exchange.idempotency_key = key
        exchange.request_hash = hashes[-1] if key and hashes else None  # (kept with the key)
        exchange.reply_to = turn.reply_to
        exchange.conversation_pk = turn.conversation.pk if turn.conversation else None
        exchange.conversation_id = turn.conversation_id or conversation_id
        Exchanges(conn).start(exchange)

    def _resolve(
        self,
        conn: Connection,
        turn: Turn,
        conversation_id: str | None,
        idempotency_key: str | None,
        messages: list[dict[str, Any]],
        hashes: list[str],
        context: ContextSettings,
        count: TokenCounter,
        classify: Callable[[list[dict[str, Any]]], Intent | None],
        *,
        forks: bool,
    ) -> str | None:
        """Fill `turn` in; return the idempotency key to record on the new exchange. `hashes`:
        the messages' chained hashes; `classify(history)` gives the turn's intent once its
        history is known."""
        prior = None
        if idempotency_key:
            prior = Exchanges(conn).by_idempotency_key(turn.tenant_id, idempotency_key)
            if prior is not None and prior.user_id != turn.user_id:
                # Not a retry: answering it as one would hand over the other user's context.
                raise Unprocessable(
                    "This Idempotency-Key was already used for another user's request.",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                )
            asked = hashes[-1] if hashes else None
            if prior is not None and prior.request_hash not in (None, asked):
                # Nor is a request with other messages under the key: taken for a retry, it
                # was answered and its turn never stored. (Exchanges recorded before hashes
                # were kept have none.)
                raise Unprocessable(
                    "This Idempotency-Key was already used for a request with other messages.",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                )
        # A replay's exchange is recorded without the key, which its original holds.
        key = idempotency_key if prior is None else None
        if turn.mode == "off":
            classify([])
            return key
        conversations = Conversations(conn)
        writing = turn.mode == "full"
        conv = None
        if prior is not None and prior.conversation_id:
            # The original's conversation, unless it was deleted since (whatever has its id
            # now is another one): then the retry is stored as a new request would be.
            conv = conversations.still(
                turn.tenant_id,
                prior.conversation_id,
                prior.conversation_pk,
                turn.user_id,
                for_update=writing,
            )
        retry = prior if conv is not None else None
        if conv is None and conversation_id:
            conv = conversations.get(turn.tenant_id, conversation_id, for_update=writing)
            if conv is not None and conv.user_id != turn.user_id:
                raise NotFound(
                    f"No conversation {conversation_id!r} for user {turn.user_id!r}.",
                    param="X-Memory-Conversation-Id",
                    code="conversation_not_found",
                )
        elif conv is None:
            conv = conversations.find_by_chain(
                turn.tenant_id, turn.user_id, hashes, for_update=writing
            )
        if conv is None:
            intent = classify([])
            if writing:
                # A new conversation: everything the request carries is new, stored as the
                # conversation opens.
                turn.conversation = conversations.create(
                    turn.tenant_id,
                    turn.user_id,
                    conversation_id or new_conversation_id(),
                    now=now(),
                    fingerprint=fingerprint(messages),
                    messages=_new_messages(messages, hashes, count, turn.request_id, intent),
                )
                turn.opened = turn.store_reply = True
                turn.reply_to = turn.conversation.next_seq - 1
            return key
        turn.conversation = conv
        window = max(context.max_history_messages, context.min_recent_messages) + TAIL_SLACK
        tail: list[MessageRecord] = []
        chain_count, chain_hash = conv.chain_count, conv.chain_hash
        if retry is not None:
            # A replay is answered against the conversation as its original found it: without
            # the original's own messages and reply, and without anything stored after them.
            tail = conversations.tail(turn.tenant_id, conv.pk, window)
            cut = next(
                (i for i, m in enumerate(tail) if m.exchange_id == retry.request_id), len(tail)
            )
            dropped = [m.to_openai() for m in tail[cut:]]
            chain_count, chain_hash = rewind(chain_count, chain_hash, hashes, dropped)
            # What the original stored, and everything after it, is hidden from recall too,
            # however far back it now is.
            turn.visible_before = conversations.first_seq_of_exchange(
                turn.tenant_id, conv.pk, retry.request_id
            )
            tail = tail[:cut]
        elif chain_count and not continues(chain_count, chain_hash, hashes):
            tail = conversations.tail(turn.tenant_id, conv.pk, window)
        split = split_request(
            messages,
            hashes,
            chain_count,
            chain_hash,
            [m.to_openai() for m in tail],
            _fork_points(tail) if retry is None and forks else (),
        )
        if split.fork:
            # The client went another way from a stored message (a regenerated answer, an
            # edited turn): the conversation's chain goes back there, so what the request
            # adds (or the reply, if nothing) is stored once and its next request, resending
            # this branch, continues it; the branch left is kept, `superseded` (in mode read,
            # only hidden from this request's recall).
            base = hashes[split.fork - 1]
            at = next(m.seq for m in tail if m.chain_hash == base)
            if writing:
                conv = conversations.fork(conv, at, split.fork, base, now=now())
                # (A history summary may cover the branch left: made again as needed.)
                Summaries(conn).delete_subjects(
                    turn.tenant_id, turn.user_id, [conv.id], kind=HISTORY_SUMMARY
                )
            else:
                conv = replace(conv, chain_count=split.fork, chain_hash=base)
            turn.conversation = conv
            turn.visible_before = at + 1
            if not split.new:
                turn.reply_to = at
        if split.attach_history:
            kept = tail[: len(tail) - split.overlap]
            turn.history = [_stored(m) for m in kept if m.role not in ("system", "developer")]
        new = [] if retry is not None else split.new
        if retry is not None:
            # A retry answers its original's turn: where the original's reply belongs (as it
            # recorded it; else, from before it did, after the messages it stored).
            if retry.reply_to is not None:
                turn.reply_to = retry.reply_to
            elif turn.visible_before is not None and split.new:
                turn.reply_to = turn.visible_before + len(split.new) - 1
        intent = classify([t.message for t in turn.history])
        turn.store_reply = writing and (retry is None or retry.status != "complete")
        if turn.visible_before is None:
            turn.visible_before = conv.next_seq  # this turn's own messages come next
        if writing and new:
            hashes = chain_hashes(new, conv.chain_hash)  # (a fork's: the request's own)
            rows = _new_messages(new, hashes, count, turn.request_id, intent)
            turn.conversation = conversations.append(conv, turn.user_id, rows, now=now())
        if turn.reply_to is None:
            turn.reply_to = turn.conversation.next_seq - 1  # (the turn's last message)
        return key

    @staticmethod
    def import_messages(
        conn: Connection,
        conversation: ConversationRecord,
        messages: list[dict[str, Any]],
        count: TokenCounter,
    ) -> ConversationRecord:
        """Append messages to a conversation without calling a model (management API).
        `conversation` must have been read `for_update` in this transaction."""
        hashes = chain_hashes(messages, conversation.chain_hash)  # created_at is not hashed
        rows = _new_messages(messages, hashes, count)
        return Conversations(conn).append(conversation, conversation.user_id, rows, now=now())

    async def finish(self, turn: Turn, outcome: Outcome) -> None:
        """Store the reply (whole, partial or none) and close the exchange record."""
        count = await TokenCounter(turn.model).prepare([outcome.reply] if outcome.reply else [])
        await self.in_time(
            self.db.write(
                partial(finish_in, turn, outcome.status, outcome.reply, outcome.fields(), count)
            )
        )


def finish_in(
    turn: Turn,
    status: str,
    reply: dict[str, Any] | None,
    fields: dict[str, Any],
    count: TokenCounter,
    conn: Connection,
    *,
    replied_at: datetime | None = None,
) -> None:
    """`finish()`'s work inside the caller's transaction (also the spill's replay): `status`
    and `reply` are the outcome's, `fields` the exchange record's columns for it;
    `replied_at` dates the reply (default: now). A complete reply that is not a well-formed
    message (`reply_problem`: the upstream broke the format) is kept as `malformed`, outside
    the chain, never attached or searched, and the record's error says what is wrong."""
    Erasures(conn).share(turn.tenant_id, turn.user_id)
    if status == "complete" and reply is not None and (problem := reply_problem(reply)):
        status = MALFORMED
        fields = {**fields, "error": f"the upstream's reply is malformed: {problem}"}
    conv = turn.conversation
    stored = None
    if turn.store_reply and conv is not None and reply is not None:
        conversations = Conversations(conn)
        tokens = count(reply)
        reply_to = turn.reply_to if turn.reply_to is not None else conv.next_seq - 1

        def store(at: ConversationRecord, as_status: str) -> None:
            in_chain = as_status == "complete"
            message = NewMessage(
                role="assistant",
                content=reply.get("content"),
                tool_calls=reply.get("tool_calls"),
                tokens=tokens,
                chain_hash=chain_next(at.chain_hash, reply) if in_chain else None,
                status=as_status,
                exchange_id=turn.request_id,
                created_at=replied_at,
                meta={"reply_to": reply_to},
            )
            conversations.append(at, turn.user_id, [message], now=now())
            nonlocal stored
            stored = as_status

        try:
            # Usually nothing was stored since begin(): no need to read the row again.
            store(conv, status)
        except StaleConversation:
            fresh = conversations.still(
                turn.tenant_id, conv.id, conv.pk, conv.user_id, for_update=True
            )
            if fresh is None:  # deleted meanwhile: the reply goes nowhere, nor any job
                conv = None
            elif answered_since(conversations, conv, reply_to) or conversations.set_aside(
                turn.tenant_id, conv.pk, reply_to
            ):
                # Another attempt at the same turn (a retry that overtook this one)
                # answered it first, or the client went another way from before the turn
                # meanwhile (a fork): keep this reply for the record, outside the chain.
                # (A turn stored meanwhile is answered after it: the reply follows it.)
                store(fresh, SUPERSEDED if status == "complete" else status)
            else:
                store(fresh, status)
    elif conv is not None and (turn.embed or turn.summarize_through is not None):
        # Nothing stored now: work is queued for the conversation only if it is still there
        # (not deleted, or its user erased, while the upstream answered).
        conv = Conversations(conn).still(turn.tenant_id, conv.id, conv.pk, conv.user_id)
    if turn.pending is not None:  # nothing was written for it yet
        Exchanges(conn).insert_finished([turn.pending.row() | fields])
    else:
        Exchanges(conn).finish(turn.tenant_id, turn.request_id, **fields)
    if turn.extract and stored == "complete":  # with the reply, or not at all
        Jobs(conn).enqueue(turn.tenant_id, turn.user_id, EXTRACTION, turn.request_id, now=now())
    if turn.embed and conv is not None and turn.mode == "full":
        # The turn's messages (stored at begin) and a complete reply: whatever is there.
        Jobs(conn).enqueue(turn.tenant_id, turn.user_id, EMBED, turn.request_id, now=now())
    if turn.summarize_through is not None and conv is not None:
        # Once per conversation and seq: the next requests that find the same need are
        # not queued again. Charged to this exchange.
        payload = {
            "conversation_id": conv.id,
            "conversation_pk": conv.pk,
            "through_seq": turn.summarize_through,
            "exchange_id": turn.request_id,
        }
        ref = f"{conv.pk}:{turn.summarize_through}"
        Jobs(conn).enqueue(turn.tenant_id, turn.user_id, SUMMARIZE, ref, now=now(), payload=payload)


def pending_row(turn: Turn, outcome: Outcome) -> dict[str, Any]:
    """The whole record of an exchange that nothing was written for before it ended."""
    assert turn.pending is not None
    return turn.pending.row() | outcome.fields()
