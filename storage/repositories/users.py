"""A tenant's users, as their stored data shows them: there is no table of users, so a user is
anyone with a conversation or a memory, with how much of each and when they were last active.
Every call takes the tenant; nothing crosses tenants."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, Connection, func, literal, select, union_all

from storage.models import CONVERSATIONS, MEMORIES
from storage.repositories.rows import utc

C = CONVERSATIONS
R = MEMORIES
_LIKE_SPECIAL = re.compile(r"([%_\\])")


@dataclass(frozen=True, slots=True)
class UserSummary:
    user_id: str
    conversations: int
    messages: int
    memories: int
    last_active_at: datetime


class Users:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def find(
        self,
        tenant_id: str,
        *,
        limit: int,
        contains: str | None = None,
        after: str | None = None,
        only: str | None = None,
    ) -> list[UserSummary]:
        """Users in order of their ids, after the id `after`; `contains`: those whose id holds
        that text (any case); `only`: that one user (a key bound to them)."""
        conversations = select(
            C.c.user_id.label("user_id"),
            literal(1).label("conversations"),
            C.c.chain_count.label("messages"),
            literal(0).label("memories"),
            C.c.updated_at.label("active"),
        ).where(C.c.tenant_id == tenant_id)
        memories = select(
            R.c.user_id.label("user_id"),
            literal(0).label("conversations"),
            literal(0).label("messages"),
            literal(1).label("memories"),
            R.c.updated_at.label("active"),
        ).where(R.c.tenant_id == tenant_id)

        def kept(column: ColumnElement[str]) -> list[ColumnElement[bool]]:
            conditions = []
            if only is not None:
                conditions.append(column == only)
            if after is not None:
                conditions.append(column > after)
            if contains:
                pattern = "%" + _LIKE_SPECIAL.sub(r"\\\1", contains.lower()) + "%"
                conditions.append(func.lower(column).like(pattern, escape="\\"))
            return conditions

        conversations = conversations.where(*kept(C.c.user_id))
        memories = memories.where(*kept(R.c.user_id))
        both = union_all(conversations, memories).subquery()
        query = (
            select(
                both.c.user_id,
                func.sum(both.c.conversations),
                func.sum(both.c.messages),
                func.sum(both.c.memories),
                func.max(both.c.active),
            )
            .group_by(both.c.user_id)
            .order_by(both.c.user_id)
            .limit(limit)
        )
        return [
            UserSummary(user, int(convs), int(msgs), int(mems), _when(active))
            for user, convs, msgs, mems, active in self.conn.execute(query)
        ]


def _when(value: datetime | str) -> datetime:
    # (SQLite hands a MAX over a union back as text, not through the column's type.)
    return utc(value if isinstance(value, datetime) else datetime.fromisoformat(value))
