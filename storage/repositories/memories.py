"""Memories: curated facts and preferences about a tenant's user. Every call takes the tenant;
listing and searching take the user too."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    bindparam,
    case,
    delete,
    insert,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.exc import IntegrityError

from storage.errors import ConflictError
from storage.models import MEMORIES
from storage.records import MemoryRecord
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.rows import advisory_lock, columns, utc_row

R = MEMORIES
_COLUMNS = columns(R, MemoryRecord)
UPDATABLE = frozenset({"text", "kind", "pinned", "confidence"})
_LIKE_SPECIAL = re.compile(r"([%_\\])")
# Unpinned memories holding any of a JSON array of lowercase terms (what `find` matches).
_CONTAINS = {
    "sqlite": "EXISTS (SELECT 1 FROM json_each(:terms) t "
    "WHERE instr(memories.folded, t.value) > 0)",
    "postgresql": "EXISTS (SELECT 1 FROM jsonb_array_elements_text(CAST(:terms AS jsonb)) t(term) "
    "WHERE strpos(memories.folded, t.term) > 0)",
}


def _pinned(limit: str) -> Select[Any]:
    """The user's oldest pinned memories, oldest first, as many as the parameter `limit`."""
    return (
        select(*_COLUMNS)
        .where(
            R.c.tenant_id == bindparam("tenant"),
            R.c.user_id == bindparam("user"),
            R.c.pinned.is_(True),
        )
        .order_by(R.c.pk)
        .limit(bindparam(limit))
    )


def _relevant(contains: str) -> Select[Any]:
    """The user's newest unpinned memories holding any of `:terms`, as many as `:limit`."""
    return (
        select(*_COLUMNS)
        .where(
            R.c.tenant_id == bindparam("tenant"),
            R.c.user_id == bindparam("user"),
            R.c.pinned.is_(False),
            text(contains),
        )
        .order_by(R.c.pk.desc())
        .limit(bindparam("limit"))
    )


def _pinned_and_relevant(contains: str) -> Select[Any]:
    """`_pinned` (as many as `:pinned_limit`) then `_relevant`, each in its order: one
    statement, one round trip (PostgreSQL) where two would take two."""
    both = union_all(
        select(_pinned("pinned_limit").subquery()), select(_relevant(contains).subquery())
    ).subquery()
    return select(both).order_by(
        both.c.pinned.desc(), case((both.c.pinned, both.c.pk), else_=-both.c.pk)
    )


# Built once (recall reads them on every turn): the same statement is compiled once.
_PINNED = _pinned("limit")
_RELEVANT = {dialect: _relevant(contains) for dialect, contains in _CONTAINS.items()}
_RECALLED = {dialect: _pinned_and_relevant(contains) for dialect, contains in _CONTAINS.items()}


def new_memory_id() -> str:
    return "mem_" + secrets.token_hex(12)


def _record(row: Any) -> MemoryRecord:
    return MemoryRecord(**utc_row(row))


def fold(text: str) -> str:
    """How a memory's text and the words searched for are compared: lowercased by Python."""
    return text.lower()


def _which(tenant_id: str, memory_id: str, user_id: str | None) -> list[Any]:
    """One memory of the tenant, by id, and of `user_id` when given."""
    found = [R.c.tenant_id == tenant_id, R.c.id == memory_id]
    return found if user_id is None else [*found, R.c.user_id == user_id]


class Memories:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def create(
        self,
        tenant_id: str,
        user_id: str,
        memory_id: str,
        text: str,
        *,
        now: datetime,
        kind: str = "fact",
        pinned: bool = False,
        confidence: float | None = None,
        source_exchange_id: str | None = None,
    ) -> MemoryRecord:
        """A new memory; ConflictError if the id is taken in the tenant."""
        values = {
            "id": memory_id,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "kind": kind,
            "text": text,
            "folded": fold(text),
            "pinned": pinned,
            "confidence": confidence,
            "source_exchange_id": source_exchange_id,
            "access_count": 0,
            "created_at": now,
            "updated_at": now,
        }
        try:
            self.conn.execute(insert(R).values(values))
        except IntegrityError as exc:
            raise ConflictError(f"memory {memory_id!r} exists") from exc
        found = self.get(tenant_id, memory_id)
        assert found is not None
        return found

    def get(
        self, tenant_id: str, memory_id: str, user_id: str | None = None
    ) -> MemoryRecord | None:
        """The memory, if it is the tenant's (and `user_id`'s, when given)."""
        row = self.conn.execute(
            select(*_COLUMNS).where(*_which(tenant_id, memory_id, user_id))
        ).first()
        return _record(row) if row else None

    def find(
        self,
        tenant_id: str,
        user_id: str | None,
        *,
        limit: int,
        after: MemoryRecord | None = None,
        pinned: bool | None = None,
        terms: Sequence[str] = (),
    ) -> list[MemoryRecord]:
        """Newest first (by pk); `terms`: memories containing any of them (case-insensitive)."""
        query = select(*_COLUMNS).where(R.c.tenant_id == tenant_id)
        if user_id is not None:
            query = query.where(R.c.user_id == user_id)
        if pinned is not None:
            query = query.where(R.c.pinned == pinned)
        if after is not None:
            query = query.where(R.c.pk < after.pk)
        if terms:
            query = query.where(
                or_(
                    *(
                        R.c.folded.like(
                            "%" + _LIKE_SPECIAL.sub(r"\\\1", fold(t)) + "%", escape="\\"
                        )
                        for t in terms
                    )
                )
            )
        rows = self.conn.execute(query.order_by(R.c.pk.desc()).limit(limit))
        return [_record(r) for r in rows]

    def lock_user(self, tenant_id: str, user_id: str) -> None:
        """Serialise this transaction with any other that locks the same user's memories, until
        it ends: a check of what they hold (`with_text`) then stays true while it writes. Two
        extraction jobs of one user deciding together both add otherwise, on PostgreSQL."""
        advisory_lock(self.conn, "memories", tenant_id, user_id)

    def with_text(self, tenant_id: str, user_id: str, folded: Sequence[str]) -> list[str]:
        """The ids of the user's memories whose text, lowercased, is one of `folded`."""
        rows = self.conn.execute(
            select(R.c.id).where(
                R.c.tenant_id == tenant_id, R.c.user_id == user_id, R.c.folded.in_(list(folded))
            )
        )
        return list(rows.scalars())

    def update(
        self,
        tenant_id: str,
        memory_id: str,
        *,
        now: datetime,
        user_id: str | None = None,
        **fields: Any,
    ) -> MemoryRecord | None:
        unknown = set(fields) - UPDATABLE
        if unknown:
            raise ValueError(f"not memory fields: {sorted(unknown)}")
        if fields.get("text") is not None:
            fields = {**fields, "folded": fold(fields["text"])}
        result = self.conn.execute(
            update(R)
            .where(*_which(tenant_id, memory_id, user_id))
            .values({**fields, "updated_at": now})
        )
        if not result.rowcount:
            return None
        found = self.get(tenant_id, memory_id)
        assert found is not None
        if fields.get("text") is not None:
            # Its vectors said the old text: gone (after the row's lock is taken, so a vector
            # being stored for the old text meanwhile goes too: memory_vectors.py).
            MemoryVectors(self.conn).delete_memories(tenant_id, [found.pk])
        return found

    def delete(self, tenant_id: str, memory_id: str, user_id: str | None = None) -> bool:
        found = self.get(tenant_id, memory_id, user_id)
        if found is None:
            return False
        MemoryVectors(self.conn).delete_memories(tenant_id, [found.pk])  # (the cascade's too)
        result = self.conn.execute(delete(R).where(R.c.tenant_id == tenant_id, R.c.pk == found.pk))
        return bool(result.rowcount)

    def delete_user(self, tenant_id: str, user_id: str) -> int:
        MemoryVectors(self.conn).delete_user(tenant_id, user_id)  # (the cascade's too)
        result = self.conn.execute(
            delete(R).where(R.c.tenant_id == tenant_id, R.c.user_id == user_id)
        )
        return int(result.rowcount)

    def delete_unused_since(self, tenant_id: str, cutoff: datetime, *, limit: int) -> int:
        """Delete up to `limit` of the tenant's memories neither pinned, changed nor used since
        `cutoff` (retention, in batches; pinned ones are the user's own choice and stay)."""
        stale = list(
            self.conn.execute(
                select(R.c.pk)
                .where(
                    R.c.tenant_id == tenant_id,
                    R.c.pinned.is_(False),
                    R.c.updated_at < cutoff,
                    or_(R.c.last_used_at.is_(None), R.c.last_used_at < cutoff),
                )
                .limit(limit)
            ).scalars()
        )
        if not stale:
            return 0
        MemoryVectors(self.conn).delete_memories(tenant_id, stale)  # (the cascade's too)
        result = self.conn.execute(delete(R).where(R.c.tenant_id == tenant_id, R.c.pk.in_(stale)))
        return int(result.rowcount)

    def pinned(self, tenant_id: str, user_id: str, *, limit: int) -> list[MemoryRecord]:
        """The user's oldest `limit` pinned memories, oldest first (the order they are shown
        in)."""
        rows = self.conn.execute(_PINNED, {"tenant": tenant_id, "user": user_id, "limit": limit})
        return [_record(r) for r in rows]

    def relevant(
        self, tenant_id: str, user_id: str, terms: Sequence[str], *, limit: int
    ) -> list[MemoryRecord]:
        """The user's unpinned memories containing any of `terms` (case-insensitive), newest
        first: what `find(..., pinned=False, terms=terms)` returns, with one statement built
        once (recall reads it on every turn)."""
        if not terms:
            return []
        statement = _RELEVANT["postgresql" if self.conn.dialect.name == "postgresql" else "sqlite"]
        rows = self.conn.execute(
            statement,
            {
                "tenant": tenant_id,
                "user": user_id,
                "terms": json.dumps([fold(t) for t in terms]),
                "limit": limit,
            },
        )
        return [_record(r) for r in rows]

    def pinned_and_relevant(
        self, tenant_id: str, user_id: str, terms: Sequence[str], *, pinned: int, limit: int
    ) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        """`pinned(..., limit=pinned)` and `relevant(..., terms, limit=limit)` read in one
        statement (recall's, on every turn)."""
        if not terms:
            return self.pinned(tenant_id, user_id, limit=pinned), []
        statement = _RECALLED["postgresql" if self.conn.dialect.name == "postgresql" else "sqlite"]
        rows = self.conn.execute(
            statement,
            {
                "tenant": tenant_id,
                "user": user_id,
                "terms": json.dumps([fold(t) for t in terms]),
                "pinned_limit": pinned,
                "limit": limit,
            },
        )
        records = [_record(r) for r in rows]
        return [m for m in records if m.pinned], [m for m in records if not m.pinned]

    def unpinned_of(self, tenant_id: str, user_id: str, pks: Sequence[int]) -> list[MemoryRecord]:
        """Those of the memories `pks` that are the user's, still there and not pinned (vector
        hits read back: what the search found counts only if it is still so)."""
        if not pks:
            return []
        rows = self.conn.execute(
            select(*_COLUMNS).where(
                R.c.tenant_id == tenant_id,
                R.c.user_id == user_id,
                R.c.pinned.is_(False),
                R.c.pk.in_(list(pks)),
            )
        )
        return [_record(r) for r in rows]

    def used(self, tenant_id: str, pks: Sequence[int], now: datetime) -> None:
        """Count that these memories were attached to a turn."""
        if pks:
            self.conn.execute(
                update(R)
                .where(R.c.tenant_id == tenant_id, R.c.pk.in_(list(pks)))
                .values(access_count=R.c.access_count + 1, last_used_at=now)
            )
