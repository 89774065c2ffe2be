"""Conversations and their chains: finding a conversation by the messages a request
carries, creating one, appending to its chain, forking it. Every call takes the tenant;
nothing crosses tenants.

`Conversations` is the repository callers use: it also reads and deletes conversation rows
(`ConversationRows`, repositories/conversation_rows.py) and reads their messages
(`ConversationMessages`, repositories/conversation_messages.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Insert, bindparam, insert, select, union_all, update
from sqlalchemy.exc import IntegrityError

from storage.errors import ConflictError, StaleConversation
from storage.models import CONVERSATIONS, MESSAGES
from storage.records import ConversationRecord, NewMessage
from storage.repositories.conversation_messages import SUPERSEDED, ConversationMessages
from storage.repositories.conversation_rows import (
    CONVERSATION_COLUMNS,
    ConversationRows,
    conversation_record,
)
from storage.repositories.search import scope_token, searchable_text

C = CONVERSATIONS
M = MESSAGES
# Hashes per IN (...) probe; well under every driver's parameter limit.
_CHAIN_PROBE = 500

# The request path's statements, built once: values travel as parameters, so SQLAlchemy
# neither rebuilds nor re-keys a statement per call.
_BY_CHAIN = (
    select(*CONVERSATION_COLUMNS)
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
# What `append` changes in the conversation's row, and writes in each message's.
_ADVANCED = ("next_seq", "chain_count", "chain_hash", "updated_at")
_MESSAGE_COLUMNS = (
    "conversation_pk",
    "tenant_id",
    "user_id",
    "seq",
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "tokens",
    "status",
    "chain_hash",
    "exchange_id",
    "created_at",
    "metadata",
    "search_text",
    "search_scope",
)
# Appends of up to this many messages (every turn's) are one statement on PostgreSQL.
_FOLDED_MESSAGES = 16


@lru_cache(maxsize=_FOLDED_MESSAGES)
def _advance_and_insert(count: int) -> Insert:
    """PostgreSQL: `_ADVANCE` and the insert of `count` messages in one statement (one round
    trip rather than two): the messages are selected from the row the update returns, so
    none is written when the conversation moved on since it was read. Parameters: the
    update's (`a_` before the changed columns) and each message's columns (`_0`, `_1`...
    after them)."""
    advanced = (
        _ADVANCE.values({column: bindparam(f"a_{column}") for column in _ADVANCED})
        .returning(C.c.pk)
        .cte("advanced")
    )
    rows = [
        select(
            *(bindparam(f"{column}_{i}", type_=M.c[column].type) for column in _MESSAGE_COLUMNS)
        ).select_from(advanced)
        for i in range(count)
    ]
    source = rows[0] if count == 1 else union_all(*rows)
    return insert(M).add_cte(advanced).from_select(_MESSAGE_COLUMNS, source).returning(M.c.pk)


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


def _where(conversation: ConversationRecord) -> dict[str, Any]:
    """`_ADVANCE`'s WHERE: the conversation's row as it was read."""
    return {
        "w_tenant": conversation.tenant_id,
        "w_pk": conversation.pk,
        "w_id": conversation.id,
        "w_owner": conversation.user_id,
        "w_seq": conversation.next_seq,
    }


def _searchable(tenant_id: str, user_id: str, message: NewMessage) -> dict[str, Any]:
    text = searchable_text(message.role, message.content) if message.status == "complete" else None
    scope = scope_token(tenant_id, user_id) if text is not None else None
    return {"search_text": text, "search_scope": scope}


class Conversations(ConversationRows, ConversationMessages):
    """The conversation repository: the chain's writes here, its rows' and messages' reads
    and deletes inherited."""

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
            found = conversation_record(row)  # aware datetimes: SQLite's rows carry naive ones
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
        rows = _rows(conversation, user_id, seq, messages, now)
        if self.conn.dialect.name == "postgresql" and len(rows) <= _FOLDED_MESSAGES:
            self._advance_and_insert(conversation, changes, rows)
        else:
            self._advance(conversation, changes)
            self.conn.execute(_INSERT_MESSAGES, rows)
        return replace(conversation, **changes)

    def _advance_and_insert(
        self,
        conversation: ConversationRecord,
        changes: dict[str, Any],
        rows: list[dict[str, Any]],
    ) -> None:
        """`_advance` and the messages' insert in one statement (PostgreSQL)."""
        parameters = {f"a_{column}": value for column, value in changes.items()}
        parameters |= _where(conversation)
        for i, row in enumerate(rows):
            parameters |= {f"{column}_{i}": row[column] for column in _MESSAGE_COLUMNS}
        inserted = self.conn.execute(_advance_and_insert(len(rows)), parameters).all()
        if len(inserted) != len(rows):
            raise StaleConversation(f"conversation {conversation.id!r} changed since it was read")

    def _advance(self, conversation: ConversationRecord, changes: dict[str, Any]) -> None:
        """Write `changes` to the conversation's row if nothing was appended since it was read
        (its `next_seq`); StaleConversation otherwise."""
        if self.conn.execute(_ADVANCE, {**changes, **_where(conversation)}).rowcount != 1:
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
