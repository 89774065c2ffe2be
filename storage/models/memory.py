"""Memories, attachments and their chunks, background jobs, usage counters, erasures and the
server's own secrets."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from storage.models.base import PK, Base


class Memory(Base):
    """A fact or preference about a user, curated: created through the API (and, later, by
    extraction from conversations), pinned to be attached to every turn, corrected, deleted."""

    __tablename__ = "memories"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64))  # the client-visible id, unique per tenant
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(32), default="fact")
    text: Mapped[str] = mapped_column(Text)
    # `text` lowercased by Python (every letter, not only ASCII, on either database, whatever
    # its locale): what the memories' word search matches.
    folded: Mapped[str] = mapped_column(Text, server_default="")
    source_exchange_id: Mapped[str | None] = mapped_column(String(64))
    confidence: Mapped[float | None] = mapped_column(Float)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    access_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    last_used_at: Mapped[datetime | None]

    __table_args__ = (
        UniqueConstraint("tenant_id", "id", name="uq_memories_tenant_id"),
        Index("ix_memories_user", "tenant_id", "user_id", "pinned"),
    )


class Job(Base):
    """A unit of background work in the durable queue (e.g. extracting memories from an
    exchange): claimed with a lease, retried with backoff, dead-lettered with the reason.
    At most one job of a kind per subject (`ref`, e.g. the exchange's request id)."""

    __tablename__ = "jobs"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(32))
    ref: Mapped[str] = mapped_column(String(128))
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # queued -> running -> done, or back to queued (a retry), or dead (out of attempts).
    status: Mapped[str] = mapped_column(String(16), default="queued")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    run_after: Mapped[datetime]
    # While running: who claimed it, and until when (then anyone may claim it again).
    worker: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    # What it did (done), or what the failed attempts got (each error and the raw output).
    result: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("tenant_id", "kind", "ref", name="uq_jobs_subject"),
        Index("ix_jobs_due", "status", "run_after"),
        Index("ix_jobs_tenant_user", "tenant_id", "user_id"),
        Index("ix_jobs_tenant_ended", "tenant_id", "status", "updated_at"),  # (retention)
    )


class Attachment(Base):
    """A document attached to a conversation: uploaded through the management API, or sent
    inline in a request body (stored in mode `full`). `content` is its text (extracted from
    PDF or HTML); its chunks are what search and the processing plan work with."""

    __tablename__ = "attachments"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64))  # the client-visible id, unique per tenant
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    conversation_pk: Mapped[int] = mapped_column(
        PK, ForeignKey("conversations.pk", ondelete="CASCADE")
    )
    title: Mapped[str | None] = mapped_column(String(512))
    source: Mapped[str | None] = mapped_column(String(2048))
    media_type: Mapped[str] = mapped_column(String(128))
    origin: Mapped[str] = mapped_column(String(16))  # upload | inline
    content: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(64))  # sha256 of `content`
    tokens: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(Integer)  # as received
    exchange_id: Mapped[str | None] = mapped_column(String(64))  # inline: the request's
    created_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("tenant_id", "id", name="uq_attachments_tenant_id"),
        Index("ix_attachments_conversation", "tenant_id", "conversation_pk", "pk"),
        Index("ix_attachments_user", "tenant_id", "user_id"),
    )


class AttachmentChunk(Base):
    """A passage of an attachment, in order (`seq`), indexed for full-text search like the
    messages (migration 0008: SQLite FTS5 `attachment_chunks_fts`, a GIN index on
    PostgreSQL). Goes with its attachment."""

    __tablename__ = "attachment_chunks"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    attachment_pk: Mapped[int] = mapped_column(PK, ForeignKey("attachments.pk", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(128))
    seq: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(Integer)
    # The token naming the attachment in the SQLite index (search.scope_token's kind).
    search_scope: Mapped[str] = mapped_column(String(24))

    __table_args__ = (Index("ix_attachment_chunks_attachment", "attachment_pk", "seq"),)


class UsageCounter(Base):
    """Requests, tokens and spend of a tenant in one window (a minute, a UTC day or month):
    the shared totals that replicas reconcile their local limit counters against."""

    __tablename__ = "usage_counters"

    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    window: Mapped[str] = mapped_column(String(32), primary_key=True)  # e.g. "day:2026-11-22"
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    updated_at: Mapped[datetime]


class Erasure(Base):
    """When a user was last erased. Turns spilled to a replica's local file while the database
    was away (proxy/durability/spill.py) are replayed only if they began after it, so an erasure
    cannot be undone by a replay. The user is named by a hash of the tenant and user id
    (storage/repositories/erasures.py), not by the id, which would outlive the erasure."""

    __tablename__ = "erasures"

    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    user_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    erased_at: Mapped[datetime]


class ServerSecret(Base):
    """The deployment's own secrets, the same for every replica: `public_ids`, the key of the
    permutation that gives numbered rows their public ids (policies/public_ids.py). Made by
    migration 0022; not tenant data."""

    __tablename__ = "server_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
