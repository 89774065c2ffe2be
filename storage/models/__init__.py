"""Tables. Every row of tenant data carries `tenant_id`, and every index on the request path
starts with it (or with a key that is already tenant-scoped)."""

from __future__ import annotations

from typing import cast

from sqlalchemy import Table

from storage.models.base import PK, Base
from storage.models.conversations import (
    Conversation,
    Exchange,
    ExchangeTrace,
    Message,
    StoredResponse,
    Summary,
)
from storage.models.memory import (
    Attachment,
    AttachmentChunk,
    Erasure,
    Job,
    Memory,
    ServerSecret,
    UsageCounter,
)
from storage.models.vectors import ChunkVector, MemoryVector, MessageVector

CONVERSATIONS = cast(Table, Conversation.__table__)
MESSAGES = cast(Table, Message.__table__)
EXCHANGES = cast(Table, Exchange.__table__)
USAGE_COUNTERS = cast(Table, UsageCounter.__table__)
MEMORIES = cast(Table, Memory.__table__)
JOBS = cast(Table, Job.__table__)
ATTACHMENTS = cast(Table, Attachment.__table__)
ATTACHMENT_CHUNKS = cast(Table, AttachmentChunk.__table__)
SUMMARIES = cast(Table, Summary.__table__)
MESSAGE_VECTORS = cast(Table, MessageVector.__table__)
MEMORY_VECTORS = cast(Table, MemoryVector.__table__)
CHUNK_VECTORS = cast(Table, ChunkVector.__table__)
ERASURES = cast(Table, Erasure.__table__)
RESPONSES = cast(Table, StoredResponse.__table__)
SERVER_SECRETS = cast(Table, ServerSecret.__table__)
EXCHANGE_TRACES = cast(Table, ExchangeTrace.__table__)

__all__ = [
    "ATTACHMENTS",
    "ATTACHMENT_CHUNKS",
    "CHUNK_VECTORS",
    "CONVERSATIONS",
    "ERASURES",
    "EXCHANGES",
    "EXCHANGE_TRACES",
    "JOBS",
    "MEMORIES",
    "MEMORY_VECTORS",
    "MESSAGES",
    "MESSAGE_VECTORS",
    "PK",
    "RESPONSES",
    "SERVER_SECRETS",
    "SUMMARIES",
    "USAGE_COUNTERS",
    "Attachment",
    "AttachmentChunk",
    "Base",
    "ChunkVector",
    "Conversation",
    "Erasure",
    "Exchange",
    "ExchangeTrace",
    "Job",
    "Memory",
    "MemoryVector",
    "Message",
    "MessageVector",
    "ServerSecret",
    "StoredResponse",
    "Summary",
    "UsageCounter",
]
