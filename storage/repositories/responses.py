"""Stored Responses API responses: memproxy's own store for upstreams that keep no state.
Every call takes the tenant; reads for a client take the user too when the request names one.

A response saved with `store: false` is kept (the exchange's record of what was answered, and
what erasure, export and retention handle) but is never found by id: `get`, `delete`,
`chain` and `input_items` treat it as unknown, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, and_, delete, insert, literal, or_, select
from sqlalchemy.exc import IntegrityError

from storage.errors import BrokenChain, ConflictError, UnknownCursor
from storage.models import RESPONSES
from storage.records import ItemPage, ResponseRecord
from storage.repositories.rows import columns, delete_chosen, utc_row

R = RESPONSES
_COLUMNS = columns(R, ResponseRecord)
# How far `chain` follows previous_response_id by default: far past any conversation a
# budget could hold, short of a walk that would read the whole table.
MAX_CHAIN = 1000
Order = Literal["asc", "desc"]


def _record(row: Any) -> ResponseRecord:
    return ResponseRecord(**utc_row(row))


def _visible(tenant_id: str, user_id: str | None) -> list[ColumnElement[bool]]:
    """The tenant's responses a client may see: stored ones, and the user's when named."""
    found = [R.c.tenant_id == tenant_id, R.c.store.is_(True)]
    return found if user_id is None else [*found, R.c.user_id == user_id]


class Responses:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def save(self, record: ResponseRecord) -> None:
        """Keep a response; ConflictError if the tenant has one with its id already."""
        values = {f.name: getattr(record, f.name) for f in fields(record)}
        try:
            self.conn.execute(insert(R), values)
        except IntegrityError as exc:
            raise ConflictError(f"response {record.id!r} exists") from exc

    def keep(self, record: ResponseRecord) -> bool:
        """Keep a response unless the tenant has one with its id already (an upstream that
        gave an id twice): whether it was kept. Never fails the transaction it is in."""
        taken = select(R.c.id).where(R.c.tenant_id == record.tenant_id, R.c.id == record.id)
        if self.conn.execute(taken).first() is not None:
            return False
        self.save(record)
        return True

    def find(
        self, tenant_id: str, response_id: str, user_id: str | None = None
    ) -> ResponseRecord | None:
        """The response of the tenant (and user), whatever its `store`: one a native upstream
        keeps may be continued there even when memproxy does not serve it."""
        conditions = [R.c.tenant_id == tenant_id, R.c.id == response_id]
        if user_id is not None:
            conditions.append(R.c.user_id == user_id)
        row = self.conn.execute(select(*_COLUMNS).where(*conditions)).first()
        return _record(row) if row else None

    def owner(self, tenant_id: str, response_id: str) -> str | None:
        """The user a response of the tenant belongs to (whatever its `store`), or None: what
        a native upstream's response may be reached by (it keeps the response itself)."""
        query = select(R.c.user_id).where(R.c.tenant_id == tenant_id, R.c.id == response_id)
        row = self.conn.execute(query).first()
        return str(row[0]) if row else None

    def get(
        self, tenant_id: str, response_id: str, user_id: str | None = None
    ) -> ResponseRecord | None:
        """The response, if the tenant stored it (`store: true`) and, with `user_id`, it is
        that user's; else None."""
        query = select(*_COLUMNS).where(R.c.id == response_id, *_visible(tenant_id, user_id))
        row = self.conn.execute(query).first()
        return _record(row) if row else None

    def delete(self, tenant_id: str, response_id: str, user_id: str | None = None) -> bool:
        """Delete a response `get` would find; whether there was one."""
        result = self.conn.execute(
            delete(R).where(R.c.id == response_id, *_visible(tenant_id, user_id))
        )
        return bool(result.rowcount)

    def chain(
        self,
        tenant_id: str,
        response_id: str,
        user_id: str | None = None,
        *,
        max_depth: int = MAX_CHAIN,
    ) -> list[ResponseRecord] | None:
        """The responses from the first of the chain to `response_id`, following each one's
        `previous_response_id`, in one query. None if `response_id` itself is not found (as
        `get`); BrokenChain if an earlier link is not (naming it), or if the chain holds
        more than `max_depth` responses: a caller never gets part of a chain as if whole."""
        visible = _visible(tenant_id, user_id)
        walk = (
            select(R.c.pk, R.c.previous_response_id, literal(1).label("depth"))
            .where(R.c.id == response_id, *visible)
            .cte("response_chain", recursive=True)
        )
        walk = walk.union_all(
            select(R.c.pk, R.c.previous_response_id, walk.c.depth + 1)
            .join(walk, R.c.id == walk.c.previous_response_id)
            .where(walk.c.depth < max_depth, *visible)
        )
        rows = self.conn.execute(
            select(*_COLUMNS).join(walk, R.c.pk == walk.c.pk).order_by(walk.c.depth.desc())
        ).all()
        if not rows:
            return None
        found = [_record(row) for row in rows]
        missing = found[0].previous_response_id
        if missing is not None:
            if len(found) >= max_depth:
                raise BrokenChain(
                    f"response {response_id!r} has more than {max_depth} earlier responses",
                    None,
                )
            raise BrokenChain(
                f"response {found[0].id!r} follows {missing!r}, which is not stored", missing
            )
        return found

    def input_items(
        self,
        tenant_id: str,
        response_id: str,
        user_id: str | None = None,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> ItemPage | None:
        """A page of the response's input items (`desc`: the last first), those after the
        item `after` in that order; None if the response is not found (as `get`), and
        UnknownCursor if it has no item `after`."""
        query = select(R.c.input_items).where(R.c.id == response_id, *_visible(tenant_id, user_id))
        items = self.conn.execute(query).scalar_one_or_none()
        if items is None:
            return None
        listed: list[dict[str, Any]] = list(items if order == "asc" else reversed(items))
        if after is not None:
            at = next((i for i, item in enumerate(listed) if item.get("id") == after), None)
            if at is None:
                raise UnknownCursor(f"response {response_id!r} has no input item {after!r}")
            listed = listed[at + 1 :]
        return ItemPage(listed[:limit], has_more=len(listed) > limit)

    def for_user(
        self, tenant_id: str, user_id: str, *, limit: int, after: ResponseRecord | None = None
    ) -> list[ResponseRecord]:
        """Every response of the user, `store: false` ones too, oldest first, `limit` at a
        time (export)."""
        query = select(*_COLUMNS).where(R.c.tenant_id == tenant_id, R.c.user_id == user_id)
        if after is not None:
            query = query.where(
                or_(
                    R.c.created_at > after.created_at,
                    and_(R.c.created_at == after.created_at, R.c.id > after.id),
                )
            )
        rows = self.conn.execute(query.order_by(R.c.created_at, R.c.id).limit(limit))
        return [_record(row) for row in rows]

    def delete_user(self, tenant_id: str, user_id: str) -> int:
        """Every response of the user (erasure); how many."""
        result = self.conn.execute(
            delete(R).where(R.c.tenant_id == tenant_id, R.c.user_id == user_id)
        )
        return int(result.rowcount)

    def delete_conversation(self, tenant_id: str, conversation_id: str) -> int:
        """Every response stored in the conversation (deleted with it); how many."""
        result = self.conn.execute(
            delete(R).where(R.c.tenant_id == tenant_id, R.c.conversation_id == conversation_id)
        )
        return int(result.rowcount)

    def delete_before(self, tenant_id: str, cutoff: datetime, *, limit: int) -> int:
        """Delete up to `limit` of the tenant's responses created before `cutoff` (retention,
        in batches, beside the exchange records as old); how many."""
        oldest = (
            select(R.c.pk)
            .where(R.c.tenant_id == tenant_id, R.c.created_at < cutoff)
            .order_by(R.c.created_at)
            .limit(limit)
        )
        return delete_chosen(self.conn, R, tenant_id, oldest)
