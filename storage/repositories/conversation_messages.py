"""Reading a conversation's stored messages: the chain's tail, pages of it, an exchange's
own, tool results, replies; and the one write on a stored message, its turn's metadata. Every
call takes the tenant; nothing crosses tenants."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, exists, func, or_, select, update

from storage.models import ATTACHMENTS, CONVERSATIONS, MESSAGES
from storage.records import MessageRecord
from storage.repositories.rows import columns, utc, utc_row

M = MESSAGES
C = CONVERSATIONS
_MESSAGE_COLUMNS = columns(M, MessageRecord)
_CREATED_AT = [c.name for c in _MESSAGE_COLUMNS].index("created_at")
# A message left off the conversation's chain (a reply another answered first, a branch its
# client went away from): kept, never attached or searched.
SUPERSEDED = "superseded"

# Built once; values travel as parameters (see repositories/conversation_rows.py).
_TAIL = (
    select(*_MESSAGE_COLUMNS)
    .where(
        M.c.tenant_id == bindparam("w_tenant"),
        M.c.conversation_pk == bindparam("w_pk"),
        M.c.status == "complete",
    )
    .order_by(M.c.seq.desc())
    .limit(bindparam("w_limit"))
)
# Whether a conversation has attachments, or tool results after a seq: two index probes.
_HOLDS_ARTIFACTS = select(
    or_(
        exists().where(
            ATTACHMENTS.c.tenant_id == bindparam("a_tenant"),
            ATTACHMENTS.c.conversation_pk == bindparam("a_pk"),
        ),
        exists().where(
            M.c.tenant_id == bindparam("a_tenant"),
            M.c.conversation_pk == bindparam("a_pk"),
            M.c.seq > bindparam("a_after"),
            M.c.role == "tool",
            M.c.status == "complete",
        ),
    )
)


def message_record(row: Any) -> MessageRecord:
    """The record of a row of `_MESSAGE_COLUMNS` (those alone, in the record's order: built
    by position, quicker than by name, and a turn reads a few dozen)."""
    values = list(row)
    values[_CREATED_AT] = utc(values[_CREATED_AT])
    return MessageRecord(*values)


class ConversationMessages:
    """A conversation's messages, as stored (its chain is written by `Conversations`)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def tail(self, tenant_id: str, conversation_pk: int, limit: int) -> list[MessageRecord]:
        """The newest `limit` messages of the chain, oldest first (one index range read)."""
        params = {"w_tenant": tenant_id, "w_pk": conversation_pk, "w_limit": limit}
        rows = self.conn.execute(_TAIL, params).all()
        return [message_record(r) for r in reversed(rows)]

    def holds_artifacts(self, tenant_id: str, conversation_pk: int, *, tools_after: int) -> bool:
        """Whether the conversation has attachments, or tool results (as `tool_results`
        reads them) after seq `tools_after`: when it has neither, a turn need not read them."""
        params = {"a_tenant": tenant_id, "a_pk": conversation_pk, "a_after": tools_after}
        return bool(self.conn.execute(_HOLDS_ARTIFACTS, params).scalar())

    def message(self, tenant_id: str, pk: int) -> tuple[MessageRecord, str, str] | None:
        """One of the tenant's messages by its row, with its conversation's id and its user."""
        query = (
            select(*_MESSAGE_COLUMNS, C.c.id.label("conversation"), M.c.user_id.label("owner"))
            .join(C, C.c.pk == M.c.conversation_pk)
            .where(M.c.tenant_id == tenant_id, M.c.pk == pk, C.c.tenant_id == tenant_id)
        )
        row = self.conn.execute(query).first()
        if row is None:
            return None
        values = utc_row(row)
        conversation, owner = values.pop("conversation"), values.pop("owner")
        return MessageRecord(**values), conversation, owner

    def messages(
        self, tenant_id: str, conversation_pk: int, *, after_seq: int = 0, limit: int = 100
    ) -> list[MessageRecord]:
        """Every message (partial replies included) in order, for the management API."""
        query = (
            select(*_MESSAGE_COLUMNS)
            .where(
                M.c.tenant_id == tenant_id,
                M.c.conversation_pk == conversation_pk,
                M.c.seq > after_seq,
            )
            .order_by(M.c.seq)
            .limit(limit)
        )
        return [message_record(r) for r in (self.conn.execute(query)).all()]

    def replies_after(
        self, tenant_id: str, conversation_pk: int, after_seq: int
    ) -> Sequence[tuple[int, str, dict[str, Any]]]:
        """(seq, status, metadata) of the replies to chat requests (assistant messages an
        exchange stored) after `after_seq`, in order."""
        rows = self.conn.execute(
            select(M.c.seq, M.c.status, M.c["metadata"])
            .where(
                M.c.tenant_id == tenant_id,
                M.c.conversation_pk == conversation_pk,
                M.c.seq > after_seq,
                M.c.role == "assistant",
                M.c.exchange_id.is_not(None),
            )
            .order_by(M.c.seq)
        ).all()
        return [(int(r[0]), str(r[1]), r[2] or {}) for r in rows]

    def set_aside(self, tenant_id: str, conversation_pk: int, seq: int) -> bool:
        """Whether the message at `seq` was set aside (`superseded`: its client went
        another way from before it)."""
        status = self.conn.execute(
            select(M.c.status).where(
                M.c.tenant_id == tenant_id,
                M.c.conversation_pk == conversation_pk,
                M.c.seq == seq,
            )
        ).scalar_one_or_none()
        return status == SUPERSEDED

    def first_seq_of_exchange(
        self, tenant_id: str, conversation_pk: int, exchange_id: str, *, last: bool = False
    ) -> int | None:
        """Where the messages an exchange stored begin (`last`: end) in a conversation
        (None: it stored none there)."""
        found = self.conn.execute(
            select(func.max(M.c.seq) if last else func.min(M.c.seq)).where(
                M.c.tenant_id == tenant_id,
                M.c.exchange_id == exchange_id,
                M.c.conversation_pk == conversation_pk,
            )
        ).scalar()
        return int(found) if found is not None else None

    def exchange_messages(
        self, tenant_id: str, exchange_id: str, *, before: int = 0
    ) -> Sequence[MessageRecord]:
        """The messages an exchange stored (its turn and reply), in order, after the `before`
        messages of its conversation that came just before them (what the turn answers)."""
        rows = self.conn.execute(
            select(*_MESSAGE_COLUMNS, M.c.conversation_pk.label("conversation_pk"))
            .where(M.c.tenant_id == tenant_id, M.c.exchange_id == exchange_id)
            .order_by(M.c.conversation_pk, M.c.seq)
        ).all()
        if not rows:
            return []
        conversation_pk = rows[0].conversation_pk
        own = [
            MessageRecord(**{k: v for k, v in utc_row(r).items() if k != "conversation_pk"})
            for r in rows
            if r.conversation_pk == conversation_pk
        ]
        earlier: Sequence[MessageRecord] = ()
        if before > 0:
            query = (
                select(*_MESSAGE_COLUMNS)
                .where(
                    M.c.tenant_id == tenant_id,
                    M.c.conversation_pk == conversation_pk,
                    M.c.seq < own[0].seq,
                    M.c.status == "complete",
                )
                .order_by(M.c.seq.desc())
                .limit(before)
            )
            earlier = [message_record(r) for r in reversed(self.conn.execute(query).all())]
        return [*earlier, *own]

    def tool_results(
        self, tenant_id: str, conversation_pk: int, *, after_seq: int, limit: int
    ) -> Sequence[MessageRecord]:
        """The conversation's newest `limit` tool results (its `tool` messages) after
        `after_seq` (an index range: the caller bounds how far back to look), oldest first."""
        query = (
            select(*_MESSAGE_COLUMNS)
            .where(
                M.c.tenant_id == tenant_id,
                M.c.conversation_pk == conversation_pk,
                M.c.seq > after_seq,
                M.c.role == "tool",
                M.c.status == "complete",
            )
            .order_by(M.c.seq.desc())
            .limit(limit)
        )
        return [message_record(r) for r in reversed(self.conn.execute(query).all())]

    def set_turn_meta(self, tenant_id: str, exchange_id: str, key: str, value: Any) -> bool:
        """Set `key` in the metadata of the last user message an exchange stored (e.g. its
        intent, known only after the fact). False if it stored none (or it is gone)."""
        row = self.conn.execute(
            select(M.c.pk, M.c["metadata"].label("meta"))
            .where(M.c.tenant_id == tenant_id, M.c.exchange_id == exchange_id, M.c.role == "user")
            .order_by(M.c.seq.desc())
            .limit(1)
        ).first()
        if row is None:
            return False
        meta = {**(row.meta or {}), key: value}
        self.conn.execute(
            update(M).where(M.c.tenant_id == tenant_id, M.c.pk == row.pk).values({"metadata": meta})
        )
        return True

    def message_seq(self, tenant_id: str, conversation_pk: int, message_pk: int) -> int | None:
        query = select(M.c.seq).where(
            M.c.tenant_id == tenant_id, M.c.conversation_pk == conversation_pk, M.c.pk == message_pk
        )
        return (self.conn.execute(query)).scalar_one_or_none()

    def count_messages(self, tenant_id: str, conversation_pk: int) -> int:
        query = select(func.count()).where(
            M.c.tenant_id == tenant_id, M.c.conversation_pk == conversation_pk
        )
        return int((self.conn.execute(query)).scalar_one())
