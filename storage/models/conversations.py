"""Conversations, their messages, the exchanges that stored them (with their traces), stored
Responses API responses and history summaries."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from storage.models.base import PK, Base


class Conversation(Base):
    __tablename__ = "conversations"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    id: Mapped[str] = mapped_column(String(128))  # the client-visible id, unique per tenant
    user_id: Mapped[str] = mapped_column(String(256))
    title: Mapped[str | None] = mapped_column(String(512))
    fingerprint: Mapped[str | None] = mapped_column(String(64))
    archived: Mapped[bool] = mapped_column(Boolean, default=False)
    # The chain: messages that count as the conversation (complete ones), and its hash.
    chain_count: Mapped[int] = mapped_column(Integer, default=0)
    chain_hash: Mapped[str] = mapped_column(String(64), default="")
    next_seq: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)

    __table_args__ = (
        UniqueConstraint("tenant_id", "id", name="uq_conversations_tenant_id"),
        # Continuing a conversation by its chain: one index probe per request message.
        Index("ix_conversations_chain", "tenant_id", "user_id", "chain_hash"),
        Index("ix_conversations_user_recent", "tenant_id", "user_id", "updated_at"),
        Index("ix_conversations_tenant_idle", "tenant_id", "updated_at"),  # (retention)
    )


class Message(Base):
    __tablename__ = "messages"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    conversation_pk: Mapped[int] = mapped_column(
        PK, ForeignKey("conversations.pk", ondelete="CASCADE")
    )
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    seq: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[Any] = mapped_column(JSON, nullable=True)  # a string or a list of parts
    name: Mapped[str | None] = mapped_column(String(256))
    tool_calls: Mapped[Any] = mapped_column(JSON, nullable=True)
    tool_call_id: Mapped[str | None] = mapped_column(String(256))
    tokens: Mapped[int] = mapped_column(Integer, default=0)
    # complete: part of the chain. incomplete / error: a partial reply kept for the record.
    status: Mapped[str] = mapped_column(String(16), default="complete")
    chain_hash: Mapped[str | None] = mapped_column(String(64))
    exchange_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    # The text full-text search indexes (user and assistant messages only; NULL otherwise).
    # SQLite: the FTS5 table `messages_fts`, kept in sync by triggers; PostgreSQL: its tsvector
    # stored in `search_vector` with a GIN index (migration 0017) and each user's word counts
    # in `message_words`, kept by triggers (0018); neither is modelled here.
    search_text: Mapped[str | None] = mapped_column(Text)
    # One token naming the (tenant, user) the message belongs to, indexed beside the text on
    # SQLite, so a search reads only that user's postings (storage/repositories/search.py).
    search_scope: Mapped[str | None] = mapped_column(String(24))

    __table_args__ = (
        UniqueConstraint("conversation_pk", "seq", name="uq_messages_conversation_seq"),
        Index("ix_messages_tenant_user", "tenant_id", "user_id"),
        # The messages an exchange stored (e.g. to put its late intent on its user turn).
        Index("ix_messages_tenant_exchange", "tenant_id", "exchange_id"),
    )


class Exchange(Base):
    """One chat completion through the proxy: what was sent, attached, answered and spent."""

    __tablename__ = "exchanges"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    conversation_pk: Mapped[int | None] = mapped_column(
        PK, ForeignKey("conversations.pk", ondelete="SET NULL")
    )
    conversation_id: Mapped[str | None] = mapped_column(String(128))
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    # With a key: the chained hash of the request's messages (a retry sends the same ones).
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # The seq of the message its reply answers (the turn's last; a retry's, its original's).
    reply_to: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(256))
    upstream: Mapped[str] = mapped_column(String(128))
    mode: Mapped[str] = mapped_column(String(8))
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    # in_progress -> complete | incomplete | error
    status: Mapped[str] = mapped_column(String(16), default="in_progress")
    http_status: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    latency_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    upstream_ms: Mapped[float | None] = mapped_column(Float)
    attached: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    reasoning_tokens: Mapped[int | None] = mapped_column(Integer)
    # Counted with tiktoken because the upstream reported no usage.
    usage_estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    # USD. Upstream: NULL while unknown, and for a model with no price (never a made-up 0).
    cost_upstream_usd: Mapped[float | None] = mapped_column(Float)
    # The proxy's own model calls for this exchange (intent, extraction, summaries), each also
    # listed in cost_parts as it is added.
    cost_memory_usd: Mapped[float] = mapped_column(Float, default=0.0)
    cost_parts: Mapped[list[Any]] = mapped_column(JSON, default=list)
    intent: Mapped[str | None] = mapped_column(String(64))
    # The whole intent result (DESIGN.md's object); the LLM's replaces the keyword one.
    intent_detail: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    overhead_ms: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        # Each user's keys are their own (migration 0021): one user's key never blocks, nor
        # answers as a retry, another user's request.
        UniqueConstraint(
            "tenant_id", "user_id", "idempotency_key", name="uq_exchanges_user_idempotency"
        ),
        # Only the exchanges still in progress: what the crash sweeper looks for, and a tiny
        # index that a finished exchange leaves.
        Index(
            "ix_exchanges_in_progress",
            "started_at",
            sqlite_where=text("status = 'in_progress'"),
            postgresql_where=text("status = 'in_progress'"),
        ),
        Index("ix_exchanges_tenant_started", "tenant_id", "started_at"),
        Index("ix_exchanges_tenant_user", "tenant_id", "user_id"),
    )


class ExchangeTrace(Base):
    """What the model saw and why, for one exchange (docs/reference/trace.md): recorded by the
    turn pipeline's stages and written with the exchange's record, in the same transaction.
    Goes with its exchange (erasure, retention) by the foreign key's cascade. Made by
    migration 0023."""

    __tablename__ = "exchange_traces"

    request_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("exchanges.request_id", ondelete="CASCADE"), primary_key=True
    )
    tenant_id: Mapped[str] = mapped_column(String(128))
    level: Mapped[str] = mapped_column(String(8))  # full | summary
    size: Mapped[int] = mapped_column(Integer)  # bytes of `trace`
    # What was cut to keep it within its size, in order (policies/trace.py); empty: nothing.
    truncated: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # The trace as JSON text, serialized once by the pipeline (its size measured on it).
    trace: Mapped[str] = mapped_column(Text)


# Core handles on the tables, for the repositories' SQL expressions.


class StoredResponse(Base):
    """A Responses API response as its client got it, kept by memproxy for upstreams that keep
    no state (translated ones): what `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`
    and `/input_items` are served from. `input_items` are the request's own input items, each
    with the id it was given. A response created with `store: false` is kept for the record but
    is never found by id. Goes with its user (erasure), its conversation (deleted with it) and
    its age (retention, as its exchange)."""

    __tablename__ = "responses"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    id: Mapped[str] = mapped_column(String(64))  # the public id (resp_...), unique per tenant
    user_id: Mapped[str] = mapped_column(String(256))
    conversation_id: Mapped[str | None] = mapped_column(String(128))
    request_id: Mapped[str] = mapped_column(String(64))  # the exchange's
    model: Mapped[str] = mapped_column(String(256))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    store: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(16))
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    created_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("tenant_id", "id", name="uq_responses_tenant_id"),
        Index("ix_responses_tenant_user", "tenant_id", "user_id"),
        Index("ix_responses_tenant_conversation", "tenant_id", "conversation_id"),
        Index("ix_responses_tenant_created", "tenant_id", "created_at"),  # (retention)
    )


class Summary(Base):
    """A summary the proxy made, cached: of an attachment focused on a question, or of a
    conversation's oldest turns (extended as more turns age out). `key` is a hash of what was
    summarised, the focus and the model, so the same content is never summarised twice for
    the same focus. `user_id` and `subject` (an attachment or conversation id) let erasure and
    deletes find them."""

    __tablename__ = "summaries"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    key: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))  # attachment | history
    user_id: Mapped[str] = mapped_column(String(256))
    subject: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(128))
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(Integer)
    # What it covers, e.g. {"through_seq": 41} for history.
    covers: Mapped[dict[str, Any]] = mapped_column(default=dict)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime]
    used_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("tenant_id", "key", name="uq_summaries_key"),
        Index("ix_summaries_subject", "tenant_id", "kind", "subject"),
        Index("ix_summaries_user", "tenant_id", "user_id"),
    )
