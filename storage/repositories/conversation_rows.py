"""Conversation rows: reading, listing, renaming and deleting them (one, an idle one, or a
user's). Every call takes the tenant; nothing crosses tenants."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, or_, select, update

from storage.models import CONVERSATIONS, EXCHANGES, MESSAGES
from storage.records import ConversationRecord
from storage.repositories.attachments import Attachments
from storage.repositories.responses import Responses
from storage.repositories.rows import columns, utc_row
from storage.repositories.search import MessageSearch
from storage.repositories.summaries import Summaries
from storage.repositories.traces import Traces
from storage.repositories.vectors import MessageVectors

C = CONVERSATIONS
M = MESSAGES
E = EXCHANGES
CONVERSATION_COLUMNS = columns(C, ConversationRecord)

# The request path's statements, built once: values travel as parameters, so SQLAlchemy
# neither rebuilds nor re-keys a statement per call.
_GET = select(*CONVERSATION_COLUMNS).where(
    C.c.tenant_id == bindparam("w_tenant"), C.c.id == bindparam("w_id")
)
_GET_FOR_UPDATE = _GET.with_for_update()


def conversation_record(row: Any) -> ConversationRecord:
    return ConversationRecord(**utc_row(row))


class ConversationRows:
    """The conversations themselves (their rows); their messages are `ConversationMessages`'s
    and their chain `Conversations`'s."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(
        self, tenant_id: str, conversation_id: str, *, for_update: bool = False
    ) -> ConversationRecord | None:
        query = _GET_FOR_UPDATE if for_update else _GET
        row = self.conn.execute(query, {"w_tenant": tenant_id, "w_id": conversation_id}).first()
        return conversation_record(row) if row else None

    def still(
        self,
        tenant_id: str,
        conversation_id: str,
        pk: int | None,
        user_id: str,
        *,
        for_update: bool = False,
    ) -> ConversationRecord | None:
        """The conversation `conversation_id` read again, if it is still the row `pk` of
        `user_id`; None once that one was deleted, even when the id names another conversation
        now (another user's, or a new one of theirs). What a turn, a job or a replay read
        earlier is found again this way, never by its id alone."""
        if pk is None:
            return None
        found = self.get(tenant_id, conversation_id, for_update=for_update)
        if found is None or found.pk != pk or found.user_id != user_id:
            return None
        return found

    def list(
        self,
        tenant_id: str,
        user_id: str | None,
        *,
        after: ConversationRecord | None = None,
        limit: int = 20,
        include_archived: bool = True,
    ) -> list[ConversationRecord]:
        """Newest first; `after` continues a previous page."""
        conditions = [C.c.tenant_id == tenant_id]
        if user_id is not None:
            conditions.append(C.c.user_id == user_id)
        if not include_archived:
            conditions.append(C.c.archived.is_(False))
        if after is not None:
            conditions.append(
                or_(
                    C.c.updated_at < after.updated_at,
                    and_(C.c.updated_at == after.updated_at, C.c.pk < after.pk),
                )
            )
        query = (
            select(*CONVERSATION_COLUMNS)
            .where(*conditions)
            .order_by(C.c.updated_at.desc(), C.c.pk.desc())
            .limit(limit)
        )
        return [conversation_record(r) for r in (self.conn.execute(query)).all()]

    def update(
        self, tenant_id: str, conversation_id: str, *, now: datetime, **changes: Any
    ) -> ConversationRecord | None:
        allowed = {k: v for k, v in changes.items() if k in ("title", "archived")}
        if "meta" in changes:
            allowed["metadata"] = changes["meta"]
        self.conn.execute(
            update(C)
            .where(C.c.tenant_id == tenant_id, C.c.id == conversation_id)
            .values(**allowed, updated_at=now)
        )
        return self.get(tenant_id, conversation_id)

    def delete(self, tenant_id: str, conversation_id: str) -> bool:
        """Delete a conversation, its messages, attachments, the summaries made of them (its
        history's, its documents' and tool results') and the Responses API responses stored in
        it; its exchanges keep their figures, not their traces (what was said)."""
        # Locked first: a job or turn writing for it finishes before (and is deleted with it)
        # or after (and finds it gone), never in between the statements below.
        found = self.get(tenant_id, conversation_id, for_update=True)
        if found is None:
            return False
        MessageVectors(self.conn).delete_conversation(tenant_id, found.pk)
        Summaries(self.conn).delete_subjects(tenant_id, found.user_id, [conversation_id])
        Attachments(self.conn).delete_conversation(tenant_id, found.pk)  # (theirs too)
        Responses(self.conn).delete_conversation(tenant_id, conversation_id)
        Traces(self.conn).delete_conversation(tenant_id, found.pk)
        self.conn.execute(
            delete(M).where(M.c.tenant_id == tenant_id, M.c.conversation_pk == found.pk)
        )
        self.conn.execute(
            update(E)
            .where(E.c.tenant_id == tenant_id, E.c.conversation_pk == found.pk)
            .values(conversation_pk=None)
        )
        self.conn.execute(delete(C).where(C.c.tenant_id == tenant_id, C.c.pk == found.pk))
        return True

    def lock(self, tenant_id: str, *, user_id: str | None = None, ids: Sequence[str] = ()) -> None:
        """Lock the user's conversations (`user_id`; else those `ids`), in one statement and in
        pk order, before deleting from several of them in one transaction. Writers lock a
        conversation's row before anything of its messages (on PostgreSQL their user's word
        counts, migration 0018), so a delete must too: holding one conversation's counts
        while waiting for another's row deadlocks with a writer holding that row. (SQLite:
        nothing to do, its one writer is alone.)"""
        if self.conn.dialect.name != "postgresql":
            return
        where = C.c.user_id == user_id if user_id is not None else C.c.id.in_(ids)
        query = select(C.c.pk).where(C.c.tenant_id == tenant_id, where).order_by(C.c.pk)
        self.conn.execute(query.with_for_update()).all()

    def delete_if_idle(self, tenant_id: str, conversation_id: str, cutoff: datetime) -> bool:
        """Delete the conversation if it is still idle since before `cutoff` (retention): its
        row is locked first, as a turn's is, so a turn stored meanwhile keeps it."""
        found = self.get(tenant_id, conversation_id, for_update=True)
        if found is None or found.updated_at >= cutoff:
            return False
        return self.delete(tenant_id, conversation_id)

    def idle_since(self, tenant_id: str, cutoff: datetime, *, limit: int) -> Sequence[str]:
        """Ids of the conversations last active before `cutoff` (retention), oldest first."""
        rows = self.conn.execute(
            select(C.c.id)
            .where(C.c.tenant_id == tenant_id, C.c.updated_at < cutoff)
            .order_by(C.c.updated_at)
            .limit(limit)
        )
        return [r.id for r in rows]

    def delete_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        """Erase everything stored for one user of one tenant."""
        self.lock(tenant_id, user_id=user_id)
        MessageVectors(self.conn).delete_user(tenant_id, user_id)  # (the messages' cascade too)
        Attachments(self.conn).delete_user(tenant_id, user_id)  # (the conversations' too)
        messages = self.conn.execute(
            delete(M).where(M.c.tenant_id == tenant_id, M.c.user_id == user_id)
        )
        MessageSearch(self.conn).delete_user(tenant_id, user_id)
        exchanges = self.conn.execute(
            delete(E).where(E.c.tenant_id == tenant_id, E.c.user_id == user_id)
        )
        conversations = self.conn.execute(
            delete(C).where(C.c.tenant_id == tenant_id, C.c.user_id == user_id)
        )
        return {
            "conversations": conversations.rowcount,
            "messages": messages.rowcount,
            "exchanges": exchanges.rowcount,
        }
