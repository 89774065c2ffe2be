"""Plain records that repositories return and accept: no ORM objects leave storage/."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    pk: int
    tenant_id: str
    id: str
    user_id: str
    title: str | None
    fingerprint: str | None
    archived: bool
    chain_count: int
    chain_hash: str
    next_seq: int
    created_at: datetime
    updated_at: datetime
    meta: dict[str, Any]


# Items of another wire protocol with no chat equivalent (a Responses API `reasoning` item,
# say) that came with a message, just before it: kept whole in its metadata, never sent to a
# model as chat, searched or recalled. A message dict carries them under this key.
KEPT_ITEMS = "memproxy_items"


@dataclass(frozen=True, slots=True)
class MessageRecord:
    pk: int
    seq: int
    role: str
    content: Any
    name: str | None
    tool_calls: Any
    tool_call_id: str | None
    tokens: int
    status: str
    exchange_id: str | None
    created_at: datetime
    meta: dict[str, Any]
    chain_hash: str | None = None  # the conversation's chain up to it (None: outside the chain)

    def to_openai(self) -> dict[str, Any]:
        """The message as a chat completion request carries it."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(slots=True)
class NewMessage:
    role: str
    content: Any
    tokens: int
    chain_hash: str | None  # None for a partial reply that is not part of the chain
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None
    status: str = "complete"
    exchange_id: str | None = None
    created_at: datetime | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class NewExchange:
    request_id: str
    tenant_id: str
    user_id: str
    model: str
    upstream: str
    mode: str
    stream: bool
    started_at: datetime
    conversation_pk: int | None = None
    conversation_id: str | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    reply_to: int | None = None
    attached: dict[str, Any] = field(default_factory=dict)
    intent: str | None = None
    intent_detail: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """Its fields as a row's values: a shallow copy (`dataclasses.asdict` copies every
        nested value, several times slower on every turn)."""
        return {name: getattr(self, name) for name in _NEW_EXCHANGE_FIELDS}


_NEW_EXCHANGE_FIELDS = tuple(f.name for f in fields(NewExchange))


@dataclass(frozen=True, slots=True)
class ExchangeRecord:
    request_id: str
    tenant_id: str
    user_id: str
    conversation_pk: int | None
    conversation_id: str | None
    idempotency_key: str | None
    request_hash: str | None
    reply_to: int | None
    model: str
    upstream: str
    mode: str
    stream: bool
    status: str
    http_status: int | None
    started_at: datetime
    finished_at: datetime | None
    latency_ms: float | None
    ttft_ms: float | None
    upstream_ms: float | None
    attached: dict[str, Any]
    usage: dict[str, Any] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    reasoning_tokens: int | None
    usage_estimated: bool
    cost_upstream_usd: float | None
    cost_memory_usd: float
    cost_parts: list[dict[str, Any]]
    intent: str | None
    intent_detail: dict[str, Any] | None
    overhead_ms: float | None
    error: str | None


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """Requests, tokens and spend of a group of exchanges (a model, user, day or intent)."""

    key: str | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_upstream_usd: float
    cost_memory_usd: float
    # Exchanges with usage but no price: their upstream cost is not in the sum.
    unpriced_requests: int


@dataclass(frozen=True, slots=True)
class MemoryRecord:
    pk: int
    id: str
    tenant_id: str
    user_id: str
    kind: str
    text: str
    source_exchange_id: str | None
    confidence: float | None
    pinned: bool
    access_count: int
    created_at: datetime
    updated_at: datetime
    last_used_at: datetime | None


@dataclass(frozen=True, slots=True)
class JobRecord:
    pk: int
    tenant_id: str
    user_id: str
    kind: str
    ref: str
    payload: dict[str, Any]
    status: str
    attempts: int
    run_after: datetime
    worker: str | None
    lease_until: datetime | None
    last_error: str | None
    result: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class AttachmentRecord:
    pk: int
    id: str
    tenant_id: str
    user_id: str
    conversation_pk: int
    title: str | None
    source: str | None
    media_type: str
    origin: str
    content: str
    content_hash: str
    tokens: int
    size_bytes: int
    exchange_id: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    pk: int
    attachment_pk: int
    seq: int
    text: str
    tokens: int


@dataclass(frozen=True, slots=True)
class SummaryRecord:
    pk: int
    tenant_id: str
    key: str
    kind: str
    user_id: str
    subject: str
    model: str
    text: str
    tokens: int
    covers: dict[str, Any]
    hits: int
    created_at: datetime
    used_at: datetime


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """A stored Responses API response (storage/models/'s StoredResponse): what is saved
    and what is read back."""

    tenant_id: str
    id: str
    user_id: str
    conversation_id: str | None
    request_id: str
    model: str
    previous_response_id: str | None
    store: bool
    status: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ItemPage:
    """A page of a stored response's input items, in the order asked for."""

    items: list[dict[str, Any]]
    has_more: bool
