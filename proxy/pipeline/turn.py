"""A turn's plain data: what `begin()` learned and `finish()` needs (`Turn`), how the exchange
ended (`Outcome`), and the token counter both use."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import structlog

from policies.context import StoredTurn
from policies.intent import Intent
from policies.tokens import count_message, message_text
from proxy.accounting.costs import NO_BILL_FIELDS, TOKENIZE_INLINE_CHARS, Bill, ready_to_count
from proxy.core.auth import ANONYMOUS as ANONYMOUS  # (where identity is decided)
from storage.records import ConversationRecord, NewExchange, ResponseRecord

log = structlog.get_logger("memproxy.memory")
Mode = Literal["full", "read", "off"]
# The intent of a request's newest user turn, given the messages up to it.
IntentOf = Callable[[list[dict[str, Any]]], Intent | None]
# A turn of this many messages or more is heavy: counting and storing it takes the process
# about a second per 10,000 (docs/performance), time every other request shares. One is
# stored at a time (tenants taking turns: storage/fair_slots.py), its write gives way to the
# ordinary turns on their way (FairSlots.expecting), and it has storage time in proportion
# (storage_time_scale): so one tenant's flood of large requests waits on itself, and other
# tenants' ordinary turns stay `ok` (bench/tenant_fairness.py).
HEAVY_TURN_MESSAGES = 1000
HEAVY_TURNS_AT_ONCE = 1


def is_heavy(messages: int) -> bool:
    """Whether a turn of `messages` messages is heavy (see HEAVY_TURN_MESSAGES)."""
    return messages >= HEAVY_TURN_MESSAGES


def storage_time_scale(messages: int) -> float:
    """The storage timeout's multiple for storing a turn of `messages` messages: 1 for an
    ordinary turn, in proportion for a heavy one (10 for 10,000 messages). A large import
    takes its time, and the flooding tenant's client waits for it, rather than being answered
    degraded at once and sending the next while the spill's replay writes the last."""
    return max(1.0, messages / HEAVY_TURN_MESSAGES)


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
    # Whether the conversation has attachments or recent tool results, as `begin()` found it
    # (None: not looked at). Without either, the turn reads none (one storage round trip).
    holds_artifacts: bool | None = None

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if self.conversation else None


class TraceSource(Protocol):
    """What builds an exchange's trace (proxy/pipeline/trace.py), once, when it is written."""

    def build(self, outcome: Outcome) -> dict[str, Any] | None: ...


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
    # The protocol's own object for the reply, kept with it (a Responses API response, served
    # by id and continued with `previous_response_id`): not a column of the exchange record.
    keep: ResponseRecord | None = None
    # The turn's trace, stored beside the record (`trace`, not a column: see Exchanges).
    trace: TraceSource | None = None

    def fields(self) -> dict[str, Any]:
        """The exchange record's columns for this outcome, and its trace when it has one."""
        trace = self.trace.build(self) if self.trace is not None else None
        return {
            **({"trace": trace} if trace else {}),
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
        await ready_to_count(self.model)
        if sum(len(message_text(m)) for m in messages) > TOKENIZE_INLINE_CHARS:
            counts = await asyncio.to_thread(
                lambda: [count_message(m, self.model) for m in messages]
            )
            self._known.update((id(m), n) for m, n in zip(messages, counts, strict=True))
        return self

    def __call__(self, message: dict[str, Any]) -> int:
        known = self._known.get(id(message))
        return known if known is not None else count_message(message, self.model)


def classify_into(
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
