"""The summary cache: summaries the proxy made (of an attachment for a question, of a
conversation's oldest turns), found again by key so nothing is summarised twice. Every call
takes the tenant."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from storage.models import SUMMARIES
from storage.records import SummaryRecord
from storage.repositories.rows import columns, utc_row

S = SUMMARIES
_COLUMNS = columns(S, SummaryRecord)


def summary_key(*parts: str) -> str:
    """The cache key of a summary: a hash of what was summarised, the focus and the model
    (and anything else that changes the result)."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _record(row: Any) -> SummaryRecord:
    return SummaryRecord(**utc_row(row))


class Summaries:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, tenant_id: str, key: str) -> SummaryRecord | None:
        row = self.conn.execute(
            select(*_COLUMNS).where(S.c.tenant_id == tenant_id, S.c.key == key)
        ).first()
        return _record(row) if row else None

    def hit(self, tenant_id: str, key: str, now: datetime) -> None:
        """Count a use of a cached summary."""
        self.conn.execute(
            update(S)
            .where(S.c.tenant_id == tenant_id, S.c.key == key)
            .values(hits=S.c.hits + 1, used_at=now)
        )

    def put(
        self,
        tenant_id: str,
        key: str,
        *,
        kind: str,
        user_id: str,
        subject: str,
        model: str,
        text: str,
        tokens: int,
        now: datetime,
        covers: dict[str, Any] | None = None,
    ) -> bool:
        """Store a summary; False if one with the key is there already (made meanwhile)."""
        values = {
            "tenant_id": tenant_id,
            "key": key,
            "kind": kind,
            "user_id": user_id,
            "subject": subject,
            "model": model,
            "text": text,
            "tokens": tokens,
            "covers": covers or {},
            "hits": 0,
            "created_at": now,
            "used_at": now,
        }
        insert = pg_insert if self.conn.dialect.name == "postgresql" else sqlite_insert
        result = self.conn.execute(insert(S).values(values).on_conflict_do_nothing())
        return bool(result.rowcount)

    def latest(self, tenant_id: str, user_id: str, kind: str, subject: str) -> SummaryRecord | None:
        """The user's newest summary of a kind about a subject (e.g. a conversation's
        history: the user's only, as another user's conversation may have had its id)."""
        row = self.conn.execute(
            select(*_COLUMNS)
            .where(
                S.c.tenant_id == tenant_id,
                S.c.user_id == user_id,
                S.c.kind == kind,
                S.c.subject == subject,
            )
            .order_by(S.c.pk.desc())
            .limit(1)
        ).first()
        return _record(row) if row else None

    def for_user(
        self, tenant_id: str, user_id: str, *, limit: int, after_pk: int | None = None
    ) -> list[SummaryRecord]:
        """The summaries made for a user, oldest first, `limit` at a time (export)."""
        query = select(*_COLUMNS).where(S.c.tenant_id == tenant_id, S.c.user_id == user_id)
        if after_pk is not None:
            query = query.where(S.c.pk > after_pk)
        rows = self.conn.execute(query.order_by(S.c.pk).limit(limit))
        return [_record(r) for r in rows]

    def delete_subjects(
        self, tenant_id: str, user_id: str, subjects: Sequence[str], *, kind: str | None = None
    ) -> int:
        """Delete every summary (of any kind, or of `kind`) the user has about these subjects:
        a conversation's id (its history's, its tool results' and inline documents') or an
        attachment's. The user's only: a client may name a conversation like another user's
        attachment, and their summaries are not its."""
        if not subjects:
            return 0
        chosen = delete(S).where(
            S.c.tenant_id == tenant_id,
            S.c.user_id == user_id,
            S.c.subject.in_(list(subjects)),
        )
        if kind is not None:
            chosen = chosen.where(S.c.kind == kind)
        return int(self.conn.execute(chosen).rowcount)

    def delete_user(self, tenant_id: str, user_id: str) -> int:
        result = self.conn.execute(
            delete(S).where(S.c.tenant_id == tenant_id, S.c.user_id == user_id)
        )
        return int(result.rowcount)
