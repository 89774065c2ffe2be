"""Repositories against real SQLite and PostgreSQL databases, through their public methods."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, inspect, text

from policies.identity import chain_hashes
from storage import migrate
from storage.database import Database
from storage.errors import ConflictError, StaleConversation
from storage.models import Base
from storage.records import (
    ConversationRecord,
    ExchangeRecord,
    MessageRecord,
    NewExchange,
    NewMessage,
)
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.search import MessageSearch
from storage.repositories.system import SystemRepository

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def msg(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def dialogue(turns: int, prefix: str = "") -> list[dict[str, Any]]:
    """user/assistant pairs: u0, a0, u1, a1, ..."""
    out = []
    for i in range(turns):
        out += [msg("user", f"{prefix}u{i}"), msg("assistant", f"{prefix}a{i}")]
    return out


def chained(conversation: ConversationRecord, messages: list[dict[str, Any]]) -> list[NewMessage]:
    """Complete messages that continue `conversation`'s chain."""
    hashes = chain_hashes(messages, conversation.chain_hash)
    return [
        NewMessage(role=m["role"], content=m["content"], tokens=3, chain_hash=h)
        for m, h in zip(messages, hashes, strict=True)
    ]


def partial(text: str) -> NewMessage:
    """A reply cut off mid-stream: kept for the record, outside the chain."""
    return NewMessage(
        role="assistant", content=text, tokens=1, chain_hash=None, status="incomplete"
    )


async def new_conversation(
    db: Database,
    conversation_id: str,
    messages: Sequence[dict[str, Any]] = (),
    *,
    tenant: str = "t1",
    user: str = "alice",
    when: datetime = T0,
) -> ConversationRecord:
    def work(conn: Connection) -> ConversationRecord:
        repo = Conversations(conn)
        conv = repo.create(tenant, user, conversation_id, now=when)
        return repo.append(conv, user, chained(conv, list(messages)), now=when)

    return await db.write(work)


def exchange(
    request_id: str,
    *,
    tenant: str = "t1",
    user: str = "alice",
    started: datetime = T0,
    **extra: Any,
) -> NewExchange:
    return NewExchange(
        request_id=request_id,
        tenant_id=tenant,
        user_id=user,
        model="gpt-4o-mini",
        upstream="echo",
        mode="full",
        stream=False,
        started_at=started,
        **extra,
    )


# Conversations and messages


async def test_append_numbers_messages_contiguously_and_advances_the_chain(db: Database) -> None:
    history = dialogue(2)
    conv = await new_conversation(db, "c1", history[:3])
    assert (conv.next_seq, conv.chain_count) == (4, 3)
    assert conv.chain_hash == chain_hashes(history[:3])[-1]

    def append_the_rest(conn: Connection) -> None:
        repo = Conversations(conn)
        fresh = repo.get("t1", "c1", for_update=True)
        assert fresh == conv
        repo.append(fresh, "alice", chained(fresh, history[3:]), now=at(1))

    await db.write(append_the_rest)

    def read_back(conn: Connection) -> tuple[ConversationRecord, list[MessageRecord], int]:
        repo = Conversations(conn)
        stored = repo.get("t1", "c1")
        assert stored is not None
        return stored, repo.messages("t1", stored.pk), repo.count_messages("t1", stored.pk)

    stored, messages, count = await db.read(read_back)
    assert stored.chain_count == 4 and stored.chain_hash == chain_hashes(history)[-1]
    assert stored.updated_at == at(1) and stored.created_at == T0
    assert [m.seq for m in messages] == [1, 2, 3, 4] and count == 4
    assert [m.to_openai() for m in messages] == history


async def test_stored_message_keeps_the_openai_shape(db: Database) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]
    sent = [
        {"role": "user", "content": parts, "name": "al"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]

    def work(conn: Connection) -> ConversationRecord:
        repo = Conversations(conn)
        conv = repo.create("t1", "alice", "c1", now=T0)
        rows = [
            NewMessage(
                role=m["role"],
                content=m["content"],
                name=m.get("name"),
                tool_calls=m.get("tool_calls"),
                tool_call_id=m.get("tool_call_id"),
                tokens=5,
                chain_hash=h,
                meta={"source": "import"},
            )
            for m, h in zip(sent, chain_hashes(sent), strict=True)
        ]
        return repo.append(conv, "alice", rows, now=T0)

    conv = await db.write(work)
    stored = await db.read(lambda conn: Conversations(conn).messages("t1", conv.pk))
    assert [m.to_openai() for m in stored] == sent
    assert all(m.meta == {"source": "import"} and m.tokens == 5 for m in stored)
    assert all(m.created_at.tzinfo is not None for m in stored)


async def test_tail_returns_the_newest_complete_messages_oldest_first(db: Database) -> None:
    history = dialogue(5)  # u0 a0 ... u4 a4
    created = await new_conversation(db, "c1", history[:6])

    def append(conn: Connection) -> ConversationRecord:
        repo = Conversations(conn)
        conv = repo.append(created, "alice", [partial("cut off")], now=at(1))
        return repo.append(conv, "alice", chained(conv, history[6:]), now=at(2))

    conv = await db.write(append)

    def read_tails(conn: Connection) -> tuple[list[MessageRecord], ...]:
        repo = Conversations(conn)
        tail = repo.tail("t1", conv.pk, 3)
        everything = repo.tail("t1", conv.pk, 100)
        nothing = repo.tail("t2", conv.pk, 100)
        return tail, everything, nothing

    tail, everything, nothing = await db.read(read_tails)
    assert [m.content for m in tail] == ["a3", "u4", "a4"]
    assert [m.to_openai() for m in everything] == history
    assert all(m.status == "complete" for m in everything)
    assert nothing == []


async def test_messages_include_partial_replies_and_page_by_seq(db: Database) -> None:
    created = await new_conversation(db, "c1", dialogue(1))

    def append(conn: Connection) -> ConversationRecord:
        repo = Conversations(conn)
        conv = repo.append(created, "alice", [partial("half a rep")], now=at(1))
        return repo.append(conv, "alice", chained(conv, [msg("user", "again")]), now=at(2))

    conv = await db.write(append)
    # The partial reply is not part of the chain: the chain is u0 a0 again.
    assert conv.chain_count == 3
    assert conv.chain_hash == chain_hashes([*dialogue(1), msg("user", "again")])[-1]

    def read_pages(conn: Connection) -> tuple[list[MessageRecord], ...]:
        repo = Conversations(conn)
        first = repo.messages("t1", conv.pk, limit=2)
        rest = repo.messages("t1", conv.pk, after_seq=first[-1].seq, limit=2)
        foreign = repo.messages("t2", conv.pk)
        return first, rest, foreign

    first, rest, foreign = await db.read(read_pages)
    assert [(m.content, m.status) for m in first] == [("u0", "complete"), ("a0", "complete")]
    assert [(m.content, m.status) for m in rest] == [
        ("half a rep", "incomplete"),
        ("again", "complete"),
    ]
    assert foreign == []


async def test_list_is_newest_first_and_pages_with_after(db: Database) -> None:
    # Five distinct times, and three conversations sharing one: ties are ordered by creation.
    times = [at(1), at(2), at(3), at(3), at(3), at(4), at(5), at(6)]
    for i, when in enumerate(times):
        await new_conversation(db, f"c{i}", when=when)
    await new_conversation(db, "bob's", user="bob", when=at(10))

    def read_pages(
        conn: Connection,
    ) -> tuple[list[list[str]], list[ConversationRecord], list[ConversationRecord]]:
        repo = Conversations(conn)
        pages: list[list[str]] = []
        after = None
        while True:
            page = repo.list("t1", "alice", after=after, limit=3)
            if not page:
                break
            pages.append([c.id for c in page])
            after = page[-1]
        everyone = repo.list("t1", None, limit=100)
        other_tenant = repo.list("t2", None)
        return pages, everyone, other_tenant

    pages, everyone, other_tenant = await db.read(read_pages)
    assert pages == [["c7", "c6", "c5"], ["c4", "c3", "c2"], ["c1", "c0"]]
    assert [c.id for c in everyone] == ["bob's", "c7", "c6", "c5", "c4", "c3", "c2", "c1", "c0"]
    assert other_tenant == []


async def test_update_renames_and_archives_and_moves_to_the_front(db: Database) -> None:
    await new_conversation(db, "old", when=at(1))
    await new_conversation(db, "new", when=at(2))

    def update(conn: Connection) -> tuple[ConversationRecord | None, ...]:
        repo = Conversations(conn)
        renamed = repo.update("t1", "old", now=at(3), title="Trip", meta={"k": "v"})
        archived = repo.update("t1", "new", now=at(4), archived=True, user_id="mallory")
        missing = repo.update("t1", "nope", now=at(5), title="x")
        foreign = repo.update("t2", "old", now=at(5), title="x")
        return renamed, archived, missing, foreign

    renamed, archived, missing, foreign = await db.write(update)
    assert renamed is not None and (renamed.title, renamed.meta) == ("Trip", {"k": "v"})
    assert renamed.updated_at == at(3)
    # Only title, archived and meta can change.
    assert archived is not None and archived.archived and archived.user_id == "alice"
    assert missing is None and foreign is None

    def read_back(conn: Connection) -> tuple[list[str], list[str], ConversationRecord | None]:
        repo = Conversations(conn)
        listed = [c.id for c in repo.list("t1", "alice")]
        active = [c.id for c in repo.list("t1", "alice", include_archived=False)]
        old = repo.get("t1", "old")
        return listed, active, old

    listed, active, old = await db.read(read_back)
    assert listed == ["new", "old"] and active == ["old"]
    assert old is not None and old.title == "Trip"


async def test_delete_removes_the_conversation_and_keeps_its_exchanges(db: Database) -> None:
    conv = await new_conversation(db, "c1", dialogue(2))
    keep = await new_conversation(db, "c2", dialogue(1))

    def delete(conn: Connection) -> None:
        Exchanges(conn).start(exchange("req_1", conversation_pk=conv.pk, conversation_id="c1"))
        assert Conversations(conn).delete("t2", "c1") is False
        assert Conversations(conn).delete("t1", "c1") is True
        assert Conversations(conn).delete("t1", "c1") is False

    await db.write(delete)

    def read_back(conn: Connection) -> ExchangeRecord | None:
        repo = Conversations(conn)
        assert repo.get("t1", "c1") is None
        assert repo.count_messages("t1", conv.pk) == 0
        assert repo.count_messages("t1", keep.pk) == 2
        return Exchanges(conn).get("t1", "req_1")

    record = await db.read(read_back)
    assert record is not None
    assert (record.conversation_pk, record.conversation_id) == (None, "c1")


async def test_delete_user_erases_that_user_only_in_that_tenant(db: Database) -> None:
    alice = await new_conversation(db, "a1", dialogue(2))
    await new_conversation(db, "a2", dialogue(1))
    bob = await new_conversation(db, "b1", dialogue(1), user="bob")
    other = await new_conversation(db, "a1", dialogue(1), tenant="t2")

    def erase(conn: Connection) -> dict[str, int]:
        Exchanges(conn).start(exchange("req_a", conversation_pk=alice.pk))
        Exchanges(conn).start(exchange("req_b", user="bob", conversation_pk=bob.pk))
        Exchanges(conn).start(exchange("req_t2", tenant="t2", conversation_pk=other.pk))
        return Conversations(conn).delete_user("t1", "alice")

    erased = await db.write(erase)
    assert erased == {"conversations": 2, "messages": 6, "exchanges": 1}

    def check(conn: Connection) -> None:
        repo, exchanges = Conversations(conn), Exchanges(conn)
        assert repo.list("t1", "alice") == []
        assert [c.id for c in repo.list("t1", "bob")] == ["b1"]
        assert [c.id for c in repo.list("t2", "alice")] == ["a1"]
        assert repo.count_messages("t2", other.pk) == 2
        assert exchanges.get("t1", "req_a") is None
        assert exchanges.get("t1", "req_b") is not None
        assert exchanges.get("t2", "req_t2") is not None

    await db.read(check)


async def test_duplicate_conversation_id_is_a_conflict(db: Database) -> None:
    await new_conversation(db, "c1", dialogue(1))
    with pytest.raises(ConflictError):
        await db.write(lambda conn: Conversations(conn).create("t1", "bob", "c1", now=at(1)))
    stored = await db.read(lambda conn: Conversations(conn).get("t1", "c1"))
    assert stored is not None and stored.user_id == "alice" and stored.chain_count == 2


async def test_same_conversation_id_in_two_tenants_never_meets(db: Database) -> None:
    one = await new_conversation(db, "shared", dialogue(1, "t1-"), tenant="t1")
    two = await new_conversation(db, "shared", dialogue(2, "t2-"), tenant="t2")
    assert one.pk != two.pk

    def change_t2(conn: Connection) -> None:
        repo = Conversations(conn)
        fresh = repo.get("t2", "shared", for_update=True)
        assert fresh is not None and fresh.pk == two.pk
        repo.append(fresh, "alice", chained(fresh, [msg("user", "t2-more")]), now=at(1))
        repo.update("t2", "shared", now=at(2), title="only t2")

    await db.write(change_t2)

    def check(conn: Connection) -> None:
        repo = Conversations(conn)
        got_one = repo.get("t1", "shared")
        assert got_one is not None and got_one.title is None
        assert [m.content for m in repo.messages("t1", one.pk)] == ["t1-u0", "t1-a0"]
        assert [m.content for m in repo.tail("t1", two.pk, 10)] == []
        assert repo.count_messages("t2", two.pk) == 5

    await db.read(check)
    assert await db.write(lambda conn: Conversations(conn).delete("t1", "shared")) is True
    assert await db.read(lambda conn: Conversations(conn).get("t2", "shared")) is not None


# Continuing a conversation by its chain


async def test_find_by_chain_returns_the_longest_then_newest_conversation_continued(
    db: Database,
) -> None:
    history = dialogue(3)
    await new_conversation(db, "short", history[:2], when=at(1))
    await new_conversation(db, "longer", history[:4], when=at(2))
    await new_conversation(db, "same-start-newer", history[:2], when=at(3))
    await new_conversation(db, "diverged", [*history[:2], msg("user", "else")], when=at(9))
    await new_conversation(db, "empty", when=at(10))

    async def find(messages: list[dict[str, Any]]) -> str | None:
        found = await db.read(
            lambda conn: Conversations(conn).find_by_chain("t1", "alice", chain_hashes(messages))
        )
        return found.id if found else None

    # The longest stored prefix wins: a newer chat that only opened the same way does not
    # capture a request that continues an older, longer one.
    assert await find(history[:5]) == "longer"
    assert await find([*history[:4], msg("user", "u2")]) == "longer"
    # Among equally long prefixes, the newest.
    assert await find([*history[:2], msg("user", "other")]) == "same-start-newer"
    assert await find(history[:1]) is None  # no stored chain is a prefix of one message
    assert await find([msg("user", "unrelated")]) is None
    assert await find([]) is None

    locked = await db.write(
        lambda conn: Conversations(conn).find_by_chain(
            "t1", "alice", chain_hashes(history), for_update=True
        )
    )
    assert locked is not None and locked.id == "longer"


async def test_find_by_chain_never_returns_another_users_or_tenants_conversation(
    db: Database,
) -> None:
    history = dialogue(2)
    await new_conversation(db, "bob", history[:2], user="bob", when=at(5))
    await new_conversation(db, "t2", history[:2], tenant="t2", when=at(6))
    hashes = chain_hashes(history)

    def find(conn: Connection) -> tuple[ConversationRecord | None, ConversationRecord | None]:
        repo = Conversations(conn)
        assert repo.find_by_chain("t1", "alice", hashes) is None
        mine = repo.find_by_chain("t1", "bob", hashes)
        theirs = repo.find_by_chain("t2", "alice", hashes)
        return mine, theirs

    mine, theirs = await db.read(find)
    assert mine is not None and mine.id == "bob"
    assert theirs is not None and theirs.id == "t2" and theirs.tenant_id == "t2"


async def test_find_by_chain_compares_matches_across_long_requests(db: Database) -> None:
    """A request longer than one index probe: matches from different probes are compared."""
    history = dialogue(300)  # 600 messages: the probes cover 500 hashes each
    await new_conversation(db, "long-newer", history[:550], when=at(2))
    await new_conversation(db, "short-older", history[:2], when=at(1))
    hashes = chain_hashes(history)

    def find(conn: Connection) -> ConversationRecord | None:
        return Conversations(conn).find_by_chain("t1", "alice", hashes)

    found = await db.read(find)
    assert found is not None and found.id == "long-newer"

    # Length decides across probes, not recency: touching the short one changes nothing.
    await db.write(
        lambda conn: Conversations(conn).update("t1", "short-older", now=at(3), title="touched")
    )
    found = await db.read(find)
    assert found is not None and found.id == "long-newer"
    # Among equally long ones, the newest.
    await new_conversation(db, "long-newest", history[:550], when=at(4))
    found = await db.read(find)
    assert found is not None and found.id == "long-newest"


# Exchanges


async def test_exchange_start_finish_get_and_idempotency_key(db: Database) -> None:
    await db.write(
        lambda conn: Exchanges(conn).start(
            exchange("req_1", idempotency_key="key-1", attached={"a": 1})
        )
    )
    started = await db.read(lambda conn: Exchanges(conn).get("t1", "req_1"))
    assert started is not None
    assert (started.status, started.finished_at, started.attached) == (
        "in_progress",
        None,
        {"a": 1},
    )
    assert started.started_at == T0

    usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}

    def finish(conn: Connection) -> None:
        Exchanges(conn).finish(
            "t1",
            "req_1",
            status="complete",
            http_status=200,
            finished_at=at(2),
            latency_ms=12.5,
            usage=usage,
            prompt_tokens=10,
            completion_tokens=4,
        )
        Exchanges(conn).finish("t2", "req_1", status="error")  # not t2's: no effect

    await db.write(finish)

    def read_back(conn: Connection) -> tuple[ExchangeRecord | None, ExchangeRecord | None]:
        done = Exchanges(conn).get("t1", "req_1")
        by_key = Exchanges(conn).by_idempotency_key("t1", "alice", "key-1")
        return done, by_key

    done, by_key = await db.read(read_back)
    assert done is not None and done == by_key
    assert (done.status, done.http_status, done.finished_at) == ("complete", 200, at(2))
    assert (done.usage, done.prompt_tokens, done.completion_tokens) == (usage, 10, 4)
    assert done.latency_ms == 12.5


async def test_another_tenants_exchange_is_invisible(db: Database) -> None:
    def start(conn: Connection) -> None:
        Exchanges(conn).start(exchange("req_1", idempotency_key="key-1"))
        # The same key in another tenant is another key.
        Exchanges(conn).start(exchange("req_2", tenant="t2", idempotency_key="key-1"))

    await db.write(start)

    def read_back(conn: Connection) -> tuple[ExchangeRecord | None, ExchangeRecord | None]:
        exchanges = Exchanges(conn)
        assert exchanges.get("t2", "req_1") is None
        assert exchanges.get("t1", "req_2") is None
        mine = exchanges.by_idempotency_key("t1", "alice", "key-1")
        theirs = exchanges.by_idempotency_key("t2", "alice", "key-1")
        assert exchanges.by_idempotency_key("t3", "alice", "key-1") is None
        assert exchanges.by_idempotency_key("t1", "bob", "key-1") is None
        return mine, theirs

    mine, theirs = await db.read(read_back)
    assert mine is not None and mine.request_id == "req_1"
    assert theirs is not None and theirs.request_id == "req_2"


async def test_duplicate_idempotency_key_in_a_tenant_is_a_conflict(db: Database) -> None:
    await db.write(lambda conn: Exchanges(conn).start(exchange("req_1", idempotency_key="key-1")))
    with pytest.raises(ConflictError):
        await db.write(
            lambda conn: Exchanges(conn).start(exchange("req_2", idempotency_key="key-1"))
        )


async def test_finish_rejects_fields_that_are_not_outcomes(db: Database) -> None:
    def work(conn: Connection) -> None:
        Exchanges(conn).start(exchange("req_1"))
        with pytest.raises(ValueError, match="user_id"):
            Exchanges(conn).finish("t1", "req_1", status="complete", user_id="mallory")

    await db.write(work)


async def test_sweep_marks_only_stale_in_progress_exchanges_incomplete(db: Database) -> None:
    def start(conn: Connection) -> None:
        exchanges = Exchanges(conn)
        exchanges.start(exchange("stale", started=at(0)))
        exchanges.start(exchange("stale_t2", tenant="t2", started=at(1)))
        exchanges.start(exchange("fresh", started=at(100)))
        exchanges.start(exchange("done", started=at(0)))
        exchanges.finish("t1", "done", status="complete", finished_at=at(5))

    await db.write(start)
    swept = await db.write(
        lambda conn: SystemRepository(conn).sweep_in_progress(at(50), now=at(200))
    )
    assert swept == 2

    def read_back(conn: Connection) -> tuple[ExchangeRecord | None, ...]:
        exchanges = Exchanges(conn)
        stale = exchanges.get("t1", "stale")
        stale_t2 = exchanges.get("t2", "stale_t2")
        fresh = exchanges.get("t1", "fresh")
        done = exchanges.get("t1", "done")
        return stale, stale_t2, fresh, done

    stale, stale_t2, fresh, done = await db.read(read_back)
    assert stale is not None and stale_t2 is not None and fresh is not None and done is not None
    for swept_exchange in (stale, stale_t2):
        assert swept_exchange.status == "incomplete" and swept_exchange.finished_at == at(200)
        assert swept_exchange.error and "abandoned" in swept_exchange.error
    assert (fresh.status, fresh.finished_at) == ("in_progress", None)
    assert (done.status, done.finished_at, done.error) == ("complete", at(5), None)


# Transactions, migrations, concurrency


async def test_a_write_that_raises_leaves_nothing_behind(db: Database) -> None:
    existing = await new_conversation(db, "existing", dialogue(1))

    class Boom(Exception):
        pass

    def half_written(conn: Connection) -> None:
        repo = Conversations(conn)
        conv = repo.create("t1", "alice", "half-written", now=at(1))
        repo.append(conv, "alice", chained(conv, dialogue(2)), now=at(1))
        fresh = repo.get("t1", "existing", for_update=True)
        assert fresh is not None
        repo.append(fresh, "alice", chained(fresh, [msg("user", "lost")]), now=at(1))
        Exchanges(conn).start(exchange("req_lost"))
        raise Boom

    with pytest.raises(Boom):
        await db.write(half_written)

    def check(conn: Connection) -> None:
        repo = Conversations(conn)
        assert repo.get("t1", "half-written") is None
        assert repo.get("t1", "existing") == existing
        assert repo.count_messages("t1", existing.pk) == 2
        assert Exchanges(conn).get("t1", "req_lost") is None

    await db.read(check)
    # The database is still usable, and the id is free.
    await new_conversation(db, "half-written")


def schema(connection: Any) -> dict[str, tuple[set[str], set[str]]]:
    """Each table's columns (those the models describe) and indexes, as the database reports
    them."""
    inspector = inspect(connection)
    return {
        table: (
            {c["name"] for c in inspector.get_columns(table) if migrate.modelled(c["name"])},
            {i["name"] or "" for i in inspector.get_indexes(table)},
        )
        for table in inspector.get_table_names()
    }


async def test_migrations_build_the_models_schema_and_running_again_changes_nothing(
    database_url: str,
) -> None:
    await asyncio.to_thread(migrate.upgrade, database_url)
    db = Database(database_url)
    try:
        conv = await new_conversation(db, "c1", dialogue(1))
        before = await db.read(schema)
        await asyncio.to_thread(migrate.upgrade, database_url)
        await asyncio.to_thread(migrate.upgrade, database_url)

        def read_back(conn: Connection) -> tuple[dict[str, tuple[set[str], set[str]]], Any]:
            after = schema(conn)
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).all()
            assert Conversations(conn).get("t1", "c1") == conv
            return after, versions

        after, versions = await db.read(read_back)
    finally:
        await db.dispose()
    assert before == after and len(versions) == 1
    for table in Base.metadata.sorted_tables:
        columns, indexes = after[table.name]
        assert columns == {c.name for c in table.columns}
        assert {str(i.name) for i in table.indexes} <= indexes


async def test_autogenerate_finds_nothing_between_the_migrations_and_the_models(
    database_url: str,
) -> None:
    """What `alembic revision --autogenerate` would compare (types too), with migrations/env.py's
    filter, which leaves out the search structures made by hand (`migrate.UNMODELLED`): nothing
    differs, so a new migration starts from no spurious change."""
    await asyncio.to_thread(migrate.upgrade, database_url)

    def differences(conn: Connection) -> list[Any]:
        context = MigrationContext.configure(
            conn,
            opts={"include_object": migrate.include_object, "compare_type": True},
        )
        return list(compare_metadata(context, Base.metadata))

    db = Database(database_url)
    try:
        assert await db.read(differences) == []
    finally:
        await db.dispose()


async def test_migration_0012_keeps_every_row_and_its_search_and_keys_are_never_reused(
    database_url: str,
) -> None:
    """On SQLite the tables are rebuilt with AUTOINCREMENT (PostgreSQL's sequences never reused
    a key): rows, keys and the full-text index's triggers survive, down and up again."""

    async def zebras(before_0017: bool = False) -> list[int]:
        db = Database(database_url)  # one per schema: PostgreSQL's cached plans do not survive it
        try:
            if before_0017 and database_url.startswith("postgresql"):
                # (the search reads 0017's column; this is the query it made before 0017)
                found = (
                    "to_tsvector('english', coalesce(search_text, '')) "
                    "@@ to_tsquery('english', 'zebra')"
                )
                query = text(f"SELECT conversation_pk FROM messages WHERE {found}")
                return sorted(await db.read(lambda c: list(c.execute(query).scalars())))
            hits = await db.read(lambda c: MessageSearch(c).search("t1", "alice", ["zebra"]))
            return sorted(h.conversation_pk for h in hits)
        finally:
            await db.dispose()

    await asyncio.to_thread(migrate.upgrade, database_url, "0011")
    db = Database(database_url)
    try:
        kept = await new_conversation(db, "kept", [msg("user", "a zebra"), msg("assistant", "ok")])
    finally:
        await db.dispose()
    await asyncio.to_thread(migrate.upgrade, database_url)
    assert await zebras() == [kept.pk]
    db = Database(database_url)
    try:
        newer = await new_conversation(db, "newer", [msg("user", "another zebra")])
        assert await db.write(lambda conn: Conversations(conn).delete("t1", "newer"))
        newest = await new_conversation(db, "newest", [msg("user", "no stripes")])
        assert newest.pk > newer.pk > kept.pk  # the newest one's key was not given again
        assert len(await db.read(lambda c: Conversations(c).messages("t1", kept.pk))) == 2
    finally:
        await db.dispose()
    assert await zebras() == [kept.pk]  # the delete trigger took "another zebra" out
    await asyncio.to_thread(command.downgrade, migrate.alembic_config(database_url), "0011")
    assert await zebras(before_0017=True) == [kept.pk]
    await asyncio.to_thread(migrate.upgrade, database_url)
    assert await zebras() == [kept.pk]


async def test_migration_0021_makes_idempotency_keys_each_users_own(database_url: str) -> None:
    """Exchanges kept through the rebuild (SQLite), and afterwards another user of the tenant
    may use a key one user has; the same user may not use it twice."""
    await asyncio.to_thread(migrate.upgrade, database_url, "0020")
    db = Database(database_url)
    try:
        await db.write(lambda c: Exchanges(c).start(exchange("req_1", idempotency_key="k")))
        with pytest.raises(ConflictError):  # (as it was: one key per tenant)
            await db.write(
                lambda c: Exchanges(c).start(exchange("req_2", user="bob", idempotency_key="k"))
            )
    finally:
        await db.dispose()
    await asyncio.to_thread(migrate.upgrade, database_url)
    db = Database(database_url)
    try:
        await db.write(
            lambda c: Exchanges(c).start(exchange("req_2", user="bob", idempotency_key="k"))
        )
        with pytest.raises(ConflictError):
            await db.write(lambda c: Exchanges(c).start(exchange("req_3", idempotency_key="k")))

        def keys(conn: Connection) -> list[str | None]:
            exchanges = Exchanges(conn)
            found = [exchanges.by_idempotency_key("t1", u, "k") for u in ("alice", "bob")]
            return [x.request_id if x else None for x in found]

        assert await db.read(keys) == ["req_1", "req_2"]
    finally:
        await db.dispose()


async def test_a_conversation_is_found_again_only_while_it_is_the_same_one(db: Database) -> None:
    """`still`: what a turn, job or replay read earlier, never another conversation given its
    id since (another user's, or the same user's new one)."""
    first = await new_conversation(db, "c1", dialogue(1))

    async def found(pk: int | None, user: str = "alice") -> ConversationRecord | None:
        return await db.read(lambda conn: Conversations(conn).still("t1", "c1", pk, user))

    assert await found(first.pk) == first
    assert await found(first.pk, "bob") is None
    assert await found(None) is None  # (an exchange whose conversation was deleted)
    assert await db.write(lambda conn: Conversations(conn).delete("t1", "c1"))
    assert await found(first.pk) is None
    second = await new_conversation(db, "c1", dialogue(1), user="bob")
    assert await found(first.pk) is None and await found(first.pk, "bob") is None
    assert await found(second.pk, "bob") == second


async def test_concurrent_writers_never_find_the_database_locked(db: Database) -> None:
    """Many tasks writing at once (each to its own conversation), with reads in between."""

    async def writer(n: int) -> None:
        await db.write(lambda conn: Conversations(conn).create("t1", f"user{n}", f"c{n}", now=T0))
        for turn in range(3):
            await take_turn(n, turn)

    async def take_turn(n: int, turn: int) -> None:
        def work(conn: Connection) -> ConversationRecord:
            repo = Conversations(conn)
            conv = repo.get("t1", f"c{n}", for_update=True)
            assert conv is not None
            messages = [msg("user", f"{n}-{turn}"), msg("assistant", f"r{n}-{turn}")]
            repo.append(conv, f"user{n}", chained(conv, messages), now=at(turn))
            Exchanges(conn).start(exchange(f"req_{n}_{turn}"))
            return conv

        conv = await db.write(work)
        tail = await db.read(lambda conn: Conversations(conn).tail("t1", conv.pk, 2))
        assert [m.content for m in tail] == [f"{n}-{turn}", f"r{n}-{turn}"]

    await asyncio.gather(*(writer(n) for n in range(32)))

    def check(conn: Connection) -> None:
        repo = Conversations(conn)
        for n in range(32):
            conv = repo.get("t1", f"c{n}")
            assert conv is not None and conv.chain_count == 6 and conv.next_seq == 7
        assert len(repo.list("t1", None, limit=100)) == 32

    await db.read(check)


async def test_concurrent_appends_to_one_conversation_keep_seq_unique_and_contiguous(
    db: Database,
) -> None:
    """Writers that lock the conversation row take turns: no seq is lost or taken twice."""
    conv = await new_conversation(db, "busy")

    async def append(n: int) -> None:
        def work(conn: Connection) -> None:
            repo = Conversations(conn)
            fresh = repo.get("t1", "busy", for_update=True)
            assert fresh is not None
            # On PostgreSQL every statement awaits the driver on the event loop, so the others
            # run meanwhile and queue up on the row lock; SQLite's writer thread serializes.
            repo.append(fresh, "alice", chained(fresh, [msg("user", f"m{n}")]), now=at(n))

        await db.write(work)

    await asyncio.gather(*(append(n) for n in range(24)))

    def read_back(conn: Connection) -> tuple[list[MessageRecord], ConversationRecord | None]:
        repo = Conversations(conn)
        return repo.messages("t1", conv.pk), repo.get("t1", "busy")

    stored, final = await db.read(read_back)
    assert final is not None
    assert [m.seq for m in stored] == list(range(1, 25))
    assert sorted(str(m.content) for m in stored) == sorted(f"m{n}" for n in range(24))
    assert final.next_seq == 25 and final.chain_count == 24
    # The chain followed the order in which the writers got the lock.
    assert final.chain_hash == chain_hashes([m.to_openai() for m in stored])[-1]


async def test_append_with_a_stale_record_writes_nothing_and_says_so(db: Database) -> None:
    history = dialogue(2)
    before = await new_conversation(db, "c1", history[:2])

    def append(conn: Connection, at_: ConversationRecord, messages: list[dict[str, Any]]) -> None:
        Conversations(conn).append(at_, "alice", chained(at_, messages), now=at(1))

    await db.write(lambda conn: append(conn, before, history[2:3]))
    with pytest.raises(StaleConversation):
        # `before` no longer describes the row: its seq numbers are taken.
        await db.write(lambda conn: append(conn, before, history[3:]))

    def read_back(conn: Connection) -> list[MessageRecord]:
        repo = Conversations(conn)
        stored = repo.get("t1", "c1")
        assert stored is not None and stored.next_seq == 4 and stored.chain_count == 3
        return repo.messages("t1", stored.pk)

    assert [m.to_openai() for m in await db.read(read_back)] == history[:3]


async def test_create_with_messages_opens_the_chain_with_them(db: Database) -> None:
    history = dialogue(2)

    def create(conn: Connection) -> ConversationRecord:
        return Conversations(conn).create(
            "t1", "alice", "c1", now=T0, messages=[*chained_from_empty(history), partial("cut")]
        )

    created = await db.write(create)
    assert (created.next_seq, created.chain_count) == (6, 4)
    assert created.chain_hash == chain_hashes(history)[-1]
    stored = await db.read(lambda conn: Conversations(conn).messages("t1", created.pk))
    assert [(m.seq, m.status) for m in stored] == [
        (1, "complete"),
        (2, "complete"),
        (3, "complete"),
        (4, "complete"),
        (5, "incomplete"),
    ]


def chained_from_empty(messages: list[dict[str, Any]]) -> list[NewMessage]:
    hashes = chain_hashes(messages)
    return [
        NewMessage(role=m["role"], content=m["content"], tokens=3, chain_hash=h)
        for m, h in zip(messages, hashes, strict=True)
    ]
