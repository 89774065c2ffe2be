"""Conversations and their messages. Every call takes the tenant; nothing crosses tenants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from storage.errors import ConflictError, StaleConversation
from storage.models import CONVERSATIONS, EXCHANGES, MESSAGES
from storage.records import ConversationRecord, MessageRecord, NewMessage
from storage.repositories.attachments import Attachments
from storage.repositories.responses import Responses
from storage.repositories.rows import columns, utc_row
from storage.repositories.search import MessageSearch, scope_token, searchable_text
from storage.repositories.summaries import Summaries
from storage.repositories.vectors import MessageVectors

C = CONVERSATIONS
M = MESSAGES
E = EXCHANGES
_CONVERSATION_COLUMNS = columns(C, ConversationRecord)
_MESSAGE_COLUMNS = columns(M, MessageRecord)
# A message left off the conversation's chain (a reply another answered first, a branch its
# client went away from): kept, never attached or searched.
SUPERSEDED = "superseded"
# Hashes per IN (...) probe; well under every driver's parameter limit.
_CHAIN_PROBE = 500

# The request path's statements, built once: values travel as parameters, so SQLAlchemy
# neither rebuilds nor re-keys a statement per call.
_GET = select(*_CONVERSATION_COLUMNS).where(
    C.c.tenant_id == bindparam("w_tenant"), C.c.id == bindparam("w_id")
)
_GET_FOR_UPDATE = _GET.with_for_update()
_BY_CHAIN = (
    select(*_CONVERSATION_COLUMNS)
    .where(
        C.c.tenant_id == bindparam("w_tenant"),
        C.c.user_id == bindparam("w_user"),
        C.c.chain_hash.in_(bindparam("w_hashes", expanding=True)),
    )
    .order_by(C.c.chain_count.desc(), C.c.updated_at.desc(), C.c.pk.desc())
    .limit(1)
)
_INSERT_CONVERSATION = insert(C).returning(C.c.pk)
_INSERT_MESSAGES = insert(M)
# SET comes from the parameters' column keys; the WHERE binds are named apart from them.
# The id and owner are checked with the pk: the row read may have been deleted meanwhile and
# its pk taken by another conversation.
_ADVANCE = update(C).where(
    C.c.tenant_id == bindparam("w_tenant"),
    C.c.pk == bindparam("w_pk"),
    C.c.id == bindparam("w_id"),
    C.c.user_id == bindparam("w_owner"),
    C.c.next_seq == bindparam("w_seq"),
)
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


def _chain_after(count: int, chain_hash: str, messages: Sequence[NewMessage]) -> tuple[int, str]:
    """The chain's length and hash once `messages` are stored (partial replies are outside)."""
    for m in messages:
        if m.chain_hash is not None:
            count, chain_hash = count + 1, m.chain_hash
    return count, chain_hash


def _rows(
    conversation: ConversationRecord,
    user_id: str,
    first_seq: int,
    messages: Sequence[NewMessage],
    now: datetime,
) -> list[dict[str, Any]]:
    return [
        {
            "conversation_pk": conversation.pk,
            "tenant_id": conversation.tenant_id,
            "user_id": user_id,
            "seq": first_seq + offset,
            "role": m.role,
            "content": m.content,
            "name": m.name,
            "tool_calls": m.tool_calls,
            "tool_call_id": m.tool_call_id,
            "tokens": m.tokens,
            "status": m.status,
            "chain_hash": m.chain_hash,
            "exchange_id": m.exchange_id,
            "created_at": m.created_at or now,
            "metadata": m.meta,
            **_searchable(conversation.tenant_id, user_id, m),
        }
        for offset, m in enumerate(messages)
    ]


def _searchable(tenant_id: str, user_id: str, message: NewMessage) -> dict[str, Any]:
    text = searchable_text(message.role, message.content) if message.status == "complete" else None
    scope = scope_token(tenant_id, user_id) if text is not None else None
    return {"search_text": text, "search_scope": scope}


def _conversation(row: Any) -> ConversationRecord:
    return ConversationRecord(**utc_row(row))


def _message(row: Any) -> MessageRecord:
    return MessageRecord(**utc_row(row))


class Conversations:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(
        self, tenant_id: str, conversation_id: str, *, for_update: bool = False
    ) -> ConversationRecord | None:
        query = _GET_FOR_UPDATE if for_update else _GET
        row = self.conn.execute(query, {"w_tenant": tenant_id, "w_id": conversation_id}).first()
        return _conversation(row) if row else None

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

    def find_by_chain(
        self, tenant_id: str, user_id: str, hashes: Sequence[str], *, for_update: bool = False
    ) -> ConversationRecord | None:
        """The conversation of this user whose whole chain is the longest prefix of the request
        (the newest, among equally long ones).

        A chain hash covers every message before it, so a stored conversation whose chain hash
        equals any of the request's prefix hashes is exactly a prefix of the request. The
        longest wins: a newer conversation that merely opened the same way (say a new chat
        whose first reply failed) is a shorter prefix of a request that continues an old one."""
        for _ in range(3):
            best = self._longest_prefix(tenant_id, user_id, hashes)
            if best is None or not for_update:
                return best
            locked = self.still(tenant_id, best.id, best.pk, user_id, for_update=True)
            # A concurrent request may have moved it on between the probe and the lock.
            if locked is not None and locked.chain_hash == best.chain_hash:
                return locked
        return None

    def _longest_prefix(
        self, tenant_id: str, user_id: str, hashes: Sequence[str]
    ) -> ConversationRecord | None:
        best: ConversationRecord | None = None
        for start in range(0, len(hashes), _CHAIN_PROBE):
            probe = list(hashes[start : start + _CHAIN_PROBE])
            params = {"w_tenant": tenant_id, "w_user": user_id, "w_hashes": probe}
            row = self.conn.execute(_BY_CHAIN, params).first()
            if row is None:
                continue
            found = _conversation(row)  # aware datetimes: SQLite's rows carry naive ones
            rank = (found.chain_count, found.updated_at, found.pk)
            if best is None or rank > (best.chain_count, best.updated_at, best.pk):
                best = found
        return best

    def create(
        self,
        tenant_id: str,
        user_id: str,
        conversation_id: str,
        *,
        now: datetime,
        title: str | None = None,
        fingerprint: str | None = None,
        meta: dict[str, Any] | None = None,
        messages: Sequence[NewMessage] = (),
    ) -> ConversationRecord:
        """A new conversation, with its first messages (chain hashes from the empty chain)."""
        chain_count, chain_hash = _chain_after(0, "", messages)
        values: dict[str, Any] = {
            "tenant_id": tenant_id,
            "id": conversation_id,
            "user_id": user_id,
            "title": title,
            "fingerprint": fingerprint,
            "archived": False,
            "chain_count": chain_count,
            "chain_hash": chain_hash,
            "next_seq": 1 + len(messages),
            "created_at": now,
            "updated_at": now,
        }
        try:
            result = self.conn.execute(_INSERT_CONVERSATION, {**values, "metadata": meta or {}})
        except IntegrityError as exc:
            raise ConflictError(f"conversation {conversation_id!r} exists") from exc
        created = ConversationRecord(pk=result.scalar_one(), meta=meta or {}, **values)
        if messages:
            self.conn.execute(_INSERT_MESSAGES, _rows(created, user_id, 1, messages, now))
        return created

    def append(
        self,
        conversation: ConversationRecord,
        user_id: str,
        messages: Sequence[NewMessage],
        *,
        now: datetime,
    ) -> ConversationRecord:
        """Store messages after the conversation's last one and advance its chain.

        Each complete message's chain hash continues `conversation.chain_hash`. The row is
        advanced only if nothing was appended since `conversation` was read; otherwise
        StaleConversation is raised and nothing is written (read it again, `for_update`)."""
        if not messages:
            return conversation
        seq = conversation.next_seq
        chain_count, chain_hash = _chain_after(
            conversation.chain_count, conversation.chain_hash, messages
        )
        changes: dict[str, Any] = {
            "next_seq": seq + len(messages),
            "chain_count": chain_count,
            "chain_hash": chain_hash,
            "updated_at": now,
        }
        self._advance(conversation, changes)
        self.conn.execute(_INSERT_MESSAGES, _rows(conversation, user_id, seq, messages, now))
        return replace(conversation, **changes)

    def _advance(self, conversation: ConversationRecord, changes: dict[str, Any]) -> None:
        """Write `changes` to the conversation's row if nothing was appended since it was read
        (its `next_seq`); StaleConversation otherwise."""
        where = {
            "w_tenant": conversation.tenant_id,
            "w_pk": conversation.pk,
            "w_id": conversation.id,
            "w_owner": conversation.user_id,
            "w_seq": conversation.next_seq,
        }
        if self.conn.execute(_ADVANCE, {**changes, **where}).rowcount != 1:
            raise StaleConversation(f"conversation {conversation.id!r} changed since it was read")

    def fork(
        self,
        conversation: ConversationRecord,
        at_seq: int,
        chain_count: int,
        chain_hash: str,
        *,
        now: datetime,
    ) -> ConversationRecord:
        """Move the conversation's chain back to its message `at_seq` (the chain then
        `chain_count` long, ending in `chain_hash`): its client went another way from there.
        The complete messages after it stay stored, as `superseded`: outside the chain, not
        attached, searched or embedded. StaleConversation, nothing written, if anything was
        appended since `conversation` was read; a writer that read it before the fork finds
        it stale in turn."""
        changes: dict[str, Any] = {
            # One seq left unused: the conversation changed for whoever read it before
            # (a turn of the branch left, still waiting for its reply, finds it stale).
            "next_seq": conversation.next_seq + 1,
            "chain_count": chain_count,
            "chain_hash": chain_hash,
            "updated_at": now,
        }
        self._advance(conversation, changes)
        self.conn.execute(
            update(M)
            .where(
                M.c.tenant_id == conversation.tenant_id,
                M.c.conversation_pk == conversation.pk,
                M.c.seq > at_seq,
                M.c.status == "complete",
            )
            .values(status=SUPERSEDED, search_text=None, search_scope=None)
        )
        return replace(conversation, **changes)

    def tail(self, tenant_id: str, conversation_pk: int, limit: int) -> list[MessageRecord]:
        """The newest `limit` messages of the chain, oldest first (one index range read)."""
        params = {"w_tenant": tenant_id, "w_pk": conversation_pk, "w_limit": limit}
        rows = self.conn.execute(_TAIL, params).all()
        return [_message(r) for r in reversed(rows)]

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
        return [_message(r) for r in (self.conn.execute(query)).all()]

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
            select(*_CONVERSATION_COLUMNS)
            .where(*conditions)
            .order_by(C.c.updated_at.desc(), C.c.pk.desc())
            .limit(limit)
        )
        return [_conversation(r) for r in (self.conn.execute(query)).all()]

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
        it; its exchanges keep their figures."""
        # Locked first: a job or turn writing for it finishes before (and is deleted with it)
        # or after (and finds it gone), never in between the statements below.
        found = self.get(tenant_id, conversation_id, for_update=True)
        if found is None:
            return False
        MessageVectors(self.conn).delete_conversation(tenant_id, found.pk)
        Summaries(self.conn).delete_subjects(tenant_id, found.user_id, [conversation_id])
        Attachments(self.conn).delete_conversation(tenant_id, found.pk)  # (theirs too)
        Responses(self.conn).delete_conversation(tenant_id, conversation_id)
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
            earlier = [_message(r) for r in reversed(self.conn.execute(query).all())]
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
        return [_message(r) for r in reversed(self.conn.execute(query).all())]

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
