"""Vectors of messages, memories and attachment chunks (recall by meaning)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from storage.models.base import PK, Base


class MessageVector(Base):
    """A stored message's embedding (recall's vector half): unit length, float32
    little-endian (policies/vectors.py), one per message and embedding model. Goes with its
    message (the foreign key cascades; erasure and conversation deletes also remove them
    explicitly)."""

    __tablename__ = "message_vectors"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    message_pk: Mapped[int] = mapped_column(PK, ForeignKey("messages.pk", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(128))
    dims: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("message_pk", "model", name="uq_message_vectors_message_model"),
        # A user's vectors of one model in the order they were stored: the request path reads
        # only those stored since it last looked.
        Index("ix_message_vectors_user", "tenant_id", "user_id", "model", "pk"),
    )


class MemoryVector(Base):
    """A memory's embedding, as a message's is stored (the relevant-memory choice's vector
    half). Goes with its memory (the foreign key cascades; deletes, erasure and retention also
    remove it explicitly), and when its text is edited (storage/repositories/memories.py)."""

    __tablename__ = "memory_vectors"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    memory_pk: Mapped[int] = mapped_column(PK, ForeignKey("memories.pk", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(128))
    dims: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("memory_pk", "model", name="uq_memory_vectors_memory_model"),
        Index("ix_memory_vectors_user", "tenant_id", "user_id", "model", "pk"),
    )


class ChunkVector(Base):
    """A passage's embedding (the relevant-passage choice's vector half), of the user whose
    attachment it is. Goes with its chunk, so with its attachment (the foreign key cascades;
    deletes, erasure and retention also remove it explicitly)."""

    __tablename__ = "chunk_vectors"

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    chunk_pk: Mapped[int] = mapped_column(
        PK, ForeignKey("attachment_chunks.pk", ondelete="CASCADE")
    )
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(128))
    dims: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime]

    __table_args__ = (
        UniqueConstraint("chunk_pk", "model", name="uq_chunk_vectors_chunk_model"),
        Index("ix_chunk_vectors_user", "tenant_id", "user_id", "model", "pk"),
    )
