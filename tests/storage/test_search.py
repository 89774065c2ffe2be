"""Full-text search over stored messages, on SQLite (FTS5) and PostgreSQL (tsvector): kept in
sync with inserts, edits and deletes, and scoped to one tenant's user."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, event, inspect, text, update
from sqlalchemy.ext.asyncio import create_async_engine

from proxy.background.maintenance import Maintenance
from proxy.core.config import Config, TenantConfig
from proxy.routes.users import erase_user
from storage import migrate
from storage.database import Database
from storage.errors import StaleConversation
from storage.models import MESSAGES
from storage.records import ConversationRecord
from storage.repositories import search as search_module
from storage.repositories import tsvector
from storage.repositories.conversations import Conversations
from storage.repositories.search import Hit, MessageSearch, searchable_text
from tests.polling import eventually
from tests.postgres import lock_waits
from tests.storage.test_attachments import attach
from tests.storage.test_attachments import search as search_chunks
from tests.storage.test_repositories import at, chained, msg, new_conversation, partial


async def search(db: Database, terms: list[str], **scope: Any) -> list[Hit]:
    tenant, user = scope.pop("tenant", "t1"), scope.pop("user", "alice")
    return await db.read(lambda c: MessageSearch(c).search(tenant, user, terms, **scope))


async def found_texts(db: Database, terms: list[str], **scope: Any) -> list[str]:
    hits = await search(db, terms, **scope)
    tenant, user = scope.get("tenant", "t1"), scope.get("user", "alice")
    around = await db.read(
        lambda c: MessageSearch(c).around(tenant, user, hits, radius=0, further_after=0)
    )
    return sorted(f.text for f in around)


async def test_messages_are_found_by_their_words_stemmed_best_first(db: Database) -> None:
    await new_conversation(
        db,
        "c1",
        [
            msg("user", "I adopted two cats last spring"),
            msg("assistant", "Cats are lovely. What are their names?"),
            msg("user", "Luna and Pixel; Luna loves climbing"),
            msg("assistant", "Climbing cats need tall trees indoors"),
        ],
    )
    assert await found_texts(db, ["climbing"]) == [
        "Climbing cats need tall trees indoors",
        "Luna and Pixel; Luna loves climbing",
    ]
    # "cat" finds "cats" (stemming); the message with more matching words ranks first.
    hits = await search(db, ["cat", "climbing"])
    assert hits[0].seq == 4
    assert await search(db, ["zebra"]) == []


async def test_search_never_crosses_users_or_tenants(db: Database) -> None:
    await new_conversation(db, "mine", [msg("user", "my passport number is secret")])
    await new_conversation(db, "bobs", [msg("user", "bob's passport expired")], user="bob")
    await new_conversation(db, "other", [msg("user", "passport office hours")], tenant="t2")
    assert await found_texts(db, ["passport"]) == ["my passport number is secret"]
    assert await found_texts(db, ["passport"], user="bob") == ["bob's passport expired"]
    assert await found_texts(db, ["passport"], tenant="t2", user="alice") == [
        "passport office hours"
    ]


async def test_search_can_be_narrowed_to_one_conversation(db: Database) -> None:
    first = await new_conversation(db, "c1", [msg("user", "the blue bicycle")])
    await new_conversation(db, "c2", [msg("user", "the red bicycle")])
    assert await found_texts(db, ["bicycle"], conversation_pk=first.pk) == ["the blue bicycle"]


async def indexed(db: Database, word: str) -> int:
    """Index entries holding `word`, read from the index itself (a search joins its hits back
    to the messages, so a stale entry would not show there)."""

    def work(conn: Connection) -> int:
        if conn.dialect.name == "postgresql":  # (the indexed column of the table itself)
            query = (
                "SELECT count(*) FROM messages "
                "WHERE search_vector @@ plainto_tsquery('english', :word)"
            )
            return int(conn.execute(text(query), {"word": word}).scalar_one())
        query = "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH :q"
        return int(conn.execute(text(query), {"q": f'search_text : "{word}"'}).scalar_one())

    return await db.read(work)


async def test_deletes_and_edits_reach_the_index(db: Database) -> None:
    await new_conversation(db, "gone", [msg("user", "remember the gazebo")])
    await new_conversation(db, "kept", [msg("user", "remember the pergola")])
    await new_conversation(db, "erased", [msg("user", "a gazebo too")], user="carol")
    assert await db.write(lambda c: Conversations(c).delete("t1", "gone"))
    assert await found_texts(db, ["gazebo"]) == []
    await db.write(lambda c: Conversations(c).delete_user("t1", "carol"))
    assert await found_texts(db, ["gazebo"], user="carol") == []
    assert await indexed(db, "gazebo") == 0

    def edit(conn: Connection) -> None:
        conn.execute(
            update(MESSAGES)
            .where(MESSAGES.c.search_text == "remember the pergola")
            .values(search_text="remember the trellis")
        )

    await db.write(edit)
    assert await found_texts(db, ["pergola"]) == []
    assert await found_texts(db, ["trellis"]) == ["remember the trellis"]
    assert (await indexed(db, "pergola"), await indexed(db, "trellis")) == (0, 1)


async def test_a_forked_conversation_keeps_the_branch_left_out_of_its_chain_and_search(
    db: Database,
) -> None:
    """The client went another way from the first message: the messages after it stay
    stored, `superseded`, out of the tail and the index (and PostgreSQL's word counts); the
    chain ends at the fork, and whoever read the conversation before finds it changed."""
    conv = await new_conversation(
        db,
        "c1",
        [msg("user", "which gazebo"), msg("assistant", "the pergola"), msg("user", "a trellis")],
    )

    def fork(conn: Connection) -> ConversationRecord:
        repo = Conversations(conn)
        first = repo.tail("t1", conv.pk, 10)[0]
        assert first.chain_hash is not None
        return repo.fork(conv, first.seq, 1, first.chain_hash, now=at(60))

    forked = await db.write(fork)
    assert (forked.chain_count, forked.next_seq) == (1, conv.next_seq + 1)
    listed = await db.read(lambda c: Conversations(c).messages("t1", conv.pk))
    assert [(m.content, m.status) for m in listed] == [
        ("which gazebo", "complete"),
        ("the pergola", "superseded"),
        ("a trellis", "superseded"),
    ]
    tail = await db.read(lambda c: Conversations(c).tail("t1", conv.pk, 10))
    assert [m.content for m in tail] == ["which gazebo"]
    assert await found_texts(db, ["pergola"]) == [] and await found_texts(db, ["trellis"]) == []
    assert (await indexed(db, "pergola"), await indexed(db, "gazebo")) == (0, 1)
    if not db.is_sqlite:
        kept, recounted = await db.read(word_counts)
        assert kept == recounted
    reply = [msg("assistant", "late")]
    with pytest.raises(StaleConversation):  # a writer that read it before the fork
        await db.write(
            lambda c: Conversations(c).append(conv, "alice", chained(conv, reply), now=at(61))
        )
    with pytest.raises(StaleConversation):  # nor forked again from what it read
        await db.write(lambda c: Conversations(c).fork(conv, 1, 1, "x", now=at(62)))


async def test_partial_replies_system_and_tool_messages_are_not_searched(db: Database) -> None:
    conversation = await new_conversation(db, "c1", [msg("system", "you are a walrus")])
    await db.write(
        lambda c: Conversations(c).append(
            conversation, "alice", [partial("walrus facts, cut off")], now=conversation.created_at
        )
    )
    assert await found_texts(db, ["walrus"]) == []
    assert searchable_text("tool", "walrus") is None
    assert searchable_text("user", [{"type": "text", "text": "a"}, {"text": None}]) == "a"


async def test_hostile_terms_are_ignored_not_executed(db: Database) -> None:
    await new_conversation(db, "c1", [msg("user", "plain words")])
    for term in ['" OR 1=1 --', "words*", "NEAR(plain words)", "a|b", "x'); DROP TABLE"]:
        assert await search(db, [term]) == []
    assert len(await search(db, ["words", '"; --'])) == 1


async def test_migration_0017_finds_what_was_stored_before_it_down_and_up_again(
    database_url: str,
) -> None:
    """On PostgreSQL the messages and chunks stored before it get their stored tsvector (and
    its index in place of the expression index); on SQLite it changes nothing."""

    async def in_database(work: Any) -> Any:
        db = Database(database_url)  # one per schema: PostgreSQL's cached plans do not survive it
        try:
            return await work(db)
        finally:
            await db.dispose()

    async def found(db: Database) -> tuple[list[str], int]:
        pks = await db.read(lambda c: [r[0] for r in c.execute(text("SELECT pk FROM attachments"))])
        return await found_texts(db, ["zebra"]), len(await search_chunks(db, pks, ["zebra"]))

    def search_structures(conn: Connection) -> set[str]:
        inspector = inspect(conn)
        return {
            f"{table}.{name}"
            for table in ("messages", "attachment_chunks")
            for name in [c["name"] for c in inspector.get_columns(table)]
            + [str(i["name"]) for i in inspector.get_indexes(table)]
            if "search" in name
        }

    async def stored_before(db: Database) -> None:
        await new_conversation(db, "c1", [msg("user", "a zebra crossing")])
        await attach(db, "c1", [("zebra stripes, chunk one", 5), ("plain chunk two", 3)])

    await asyncio.to_thread(migrate.upgrade, database_url, "0016")
    await in_database(stored_before)
    before = await in_database(lambda db: db.read(search_structures))
    await asyncio.to_thread(migrate.upgrade, database_url)
    assert await in_database(found) == (["a zebra crossing"], 1)
    after = await in_database(lambda db: db.read(search_structures))
    await asyncio.to_thread(command.downgrade, migrate.alembic_config(database_url), "0016")
    assert await in_database(lambda db: db.read(search_structures)) == before
    await asyncio.to_thread(migrate.upgrade, database_url)
    assert await in_database(found) == (["a zebra crossing"], 1)
    if database_url.startswith("postgresql"):
        assert after - before == {
            "messages.search_vector",
            "messages.ix_messages_search_vector",
            "attachment_chunks.search_vector",
            "attachment_chunks.ix_attachment_chunks_search_vector",
        }
        assert before - after == {
            "messages.ix_messages_search",
            "attachment_chunks.ix_attachment_chunks_search",
        }
    else:
        assert after == before


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_equal_scores_go_to_the_newer_message_every_time(
    db: Database,
) -> None:
    await new_conversation(db, "c1", [msg("user", "the heron again"), msg("assistant", "ok")])
    await new_conversation(db, "c2", [msg("user", "the heron again")])
    await new_conversation(db, "c3", [msg("user", "the heron again, the heron")])
    hits = [await search(db, ["heron"]) for _ in range(3)]
    assert hits[0] == hits[1] == hits[2]
    texts = await db.read(
        lambda c: {f.pk: f.conversation_id for f in MessageSearch(c).around("t1", "alice", hits[0])}
    )
    # "heron" twice ranks first; then the two equal ones, the newer first.
    assert [texts[h.pk] for h in hits[0]] == ["c3", "c2", "c1"]


@contextmanager
def executed(conn: Connection) -> Iterator[list[tuple[str, Any]]]:
    """The statements `conn` runs within, with their parameters."""
    ran: list[tuple[str, Any]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        ran.append((statement, parameters))

    event.listen(conn, "before_cursor_execute", seen)
    try:
        yield ran
    finally:
        event.remove(conn, "before_cursor_execute", seen)


def same(found: list[Hit], expected: list[Hit]) -> bool:
    """The same hits in the same order, their scores equal but for rounding."""
    pks = [(h.pk, h.seq) for h in found] == [(h.pk, h.seq) for h in expected]
    return pks and [h.score for h in found] == pytest.approx([h.score for h in expected])


def ranked_matches(ran: list[tuple[str, Any]]) -> list[str]:
    """What each SQLite ranking statement among `ran` matched (its FTS5 query)."""
    return [
        str(p)
        for statement, parameters in ran
        if "bm25" in statement
        for p in parameters
        if "search_text :" in str(p)
    ]


@pytest.mark.parametrize("database_kind", ["sqlite"], indirect=True)
async def test_on_sqlite_only_the_rare_words_rows_are_ranked_with_every_words_score(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "zed" is in most messages (a name said in every turn); five also hold rarer words (six
    # times), and another user's rows hold them too (they count in the index, never found).
    turns = [msg("user", f"zed: plain turn number {i}") for i in range(20)]
    turns += [msg("user", f"zed: the kayak trip {i}, kayak") for i in range(2)]
    turns += [msg("user", "a kayak"), msg("assistant", "zed: a glacier walk")]
    turns += [msg("user", "zed zed zed zed"), msg("user", "kayak by the glacier")]
    await new_conversation(db, "c1", turns)
    await new_conversation(db, "c2", [msg("user", "zed and a kayak glacier")] * 2, user="bob")
    terms = ["zed", "kayak", "glacier"]
    monkeypatch.setattr(search_module, "RANKED_ROWS", 10**6)  # every row ranked at once
    everything = {n: await search(db, terms, limit=n) for n in (4, 6, 7)}
    monkeypatch.setattr(search_module, "RANKED_ROWS", 10)  # "kayak" and "glacier": 10 rows
    scope = search_module.scope_token("t1", "alice")
    whole = f'search_scope : "{scope}" AND search_text : ("zed" OR "kayak" OR "glacier")'

    async def found(limit: int) -> tuple[list[Hit], list[str]]:
        def work(conn: Connection) -> tuple[list[Hit], list[str]]:
            with executed(conn) as ran:
                hits = MessageSearch(conn).search("t1", "alice", terms, limit=limit)
            return hits, ranked_matches(ran)

        return await db.read(work)

    # The best four hold a rare word, each scored with "zed" too where it holds it: the same
    # hits, with the same scores, as when every row is ranked; none of bob's.
    hits, matched = await found(4)
    assert same(hits, everything[4])
    rare = 'search_text : ("glacier" OR "kayak")'  # (the rarest first; no scope token)
    assert matched == [rare, f'{rare} AND search_text : ("zed")']
    texts = await found_texts(db, terms, limit=4)
    assert all("kayak" in t or "glacier" in t for t in texts) and "zed zed zed zed" not in texts
    # Five of alice's rows hold the rare words: six hits need the whole search too...
    hits, matched = await found(6)
    assert same(hits, everything[6]) and matched == [
        rare,
        f'{rare} AND search_text : ("zed")',
        whole,
    ]
    # ...and seven, more than they are counted in, the whole search at once.
    hits, matched = await found(7)
    assert same(hits, everything[7]) and matched == [whole]
    # The index holds more rows of the rare words than the bound (bob's): the user's scope
    # token narrows them, and the hits are the same.
    monkeypatch.setattr(search_module, "RANKED_ROWS", 7)
    hits, matched = await found(4)
    assert same(hits, everything[4]) and len(matched) == 2
    assert all(m.startswith(f'search_scope : "{scope}" AND ') for m in matched)
    assert matched[1].endswith('AND search_text : ("zed")')


@pytest.mark.parametrize("database_kind", ["sqlite"], indirect=True)
async def test_on_sqlite_a_rare_word_outranks_rows_of_common_words_said_more_often(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bounded search still finds the best hits for a rare word: the rows holding it,
    # before any row of the common word alone (said three times in each).
    turns = [msg("user", f"weather report {i}: weather weather") for i in range(30)]
    turns += [msg("user", "the heron flew"), msg("assistant", "heron and weather today")]
    await new_conversation(db, "c1", turns)
    others = [msg("user", f"nothing of note {i}") for i in range(100)]
    await new_conversation(db, "c2", others, user="bob")
    words = ["weather", "heron"]
    monkeypatch.setattr(search_module, "RANKED_ROWS", 5)
    assert await found_texts(db, words, limit=2) == ["heron and weather today", "the heron flew"]
    bounded = {n: await search(db, words, limit=n) for n in (2, 5)}
    monkeypatch.setattr(search_module, "RANKED_ROWS", 10**6)  # every row ranked at once
    assert same(bounded[2], await search(db, words, limit=2))
    # Fewer rows hold it than asked for: the rows of the common word follow.
    assert same(bounded[5], await search(db, words, limit=5))


@pytest.mark.parametrize("database_kind", ["sqlite"], indirect=True)
async def test_on_sqlite_the_rarest_word_is_ranked_first_when_all_are_held_by_many_rows(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counts are read as far as one past RANKED_ROWS: "beta" (5 rows) is still the rarest
    # when both words are held by more rows than that, and "alpha" (7) comes first.
    turns = [msg("user", f"alpha note {i}") for i in range(6)]
    turns += [msg("user", f"beta note {i}") for i in range(4)]
    turns += [msg("assistant", "alpha and beta")]
    await new_conversation(db, "c1", turns)
    terms = ["alpha", "beta"]
    monkeypatch.setattr(search_module, "RANKED_ROWS", 10**6)  # every row ranked at once
    everything = await search(db, terms, limit=2)
    monkeypatch.setattr(search_module, "RANKED_ROWS", 3)

    def work(conn: Connection) -> tuple[list[Hit], list[str]]:
        with executed(conn) as ran:
            hits = MessageSearch(conn).search("t1", "alice", terms, limit=2)
        return hits, ranked_matches(ran)

    hits, matched = await db.read(work)
    scope = search_module.scope_token("t1", "alice")
    rare = f'search_scope : "{scope}" AND search_text : ("beta")'
    assert matched == [rare, f'{rare} AND search_text : ("alpha")']
    assert same(hits, everything)


async def test_around_gives_the_neighbours_of_a_hit(db: Database) -> None:
    await new_conversation(
        db,
        "c1",
        [
            msg("user", "one"),
            msg("assistant", "two"),
            msg("user", "three oboe"),
            msg("assistant", "four"),
            msg("user", "five"),
            msg("assistant", "six"),
        ],
    )
    hits = await search(db, ["oboe"])
    around = await db.read(lambda c: MessageSearch(c).around("t1", "alice", hits))
    # One either side and, by default, one more after (where a reply may go on).
    assert [(f.seq, f.text, f.conversation_id) for f in around] == [
        (2, "two", "c1"),
        (3, "three oboe", "c1"),
        (4, "four", "c1"),
        (5, "five", "c1"),
    ]
    around = await db.read(
        lambda c: MessageSearch(c).around("t1", "alice", hits, radius=1, further_after=0)
    )
    assert [f.seq for f in around] == [2, 3, 4]
    # A wide hit reaches `wide_radius` either side, whatever the others reach.
    around = await db.read(
        lambda c: MessageSearch(c).around(
            "t1", "alice", [], radius=0, further_after=0, wide=hits, wide_radius=2
        )
    )
    assert [f.seq for f in around] == [1, 2, 3, 4, 5]


async def test_around_reads_every_window_of_every_conversation_in_order(db: Database) -> None:
    words = ["one", "two", "three oboe", "four", "five", "six", "seven oboe", "eight"]
    await new_conversation(db, "c1", [msg("user", w) for w in words])
    await new_conversation(db, "c2", [msg("user", "nine oboe"), msg("assistant", "ten")])
    await new_conversation(db, "bobs", [msg("user", "oboe lessons")], user="bob")
    hits = await search(db, ["oboe"])
    around = await db.read(
        lambda c: MessageSearch(c).around("t1", "alice", hits, radius=1, further_after=0)
    )
    # The windows around seqs 3 and 7 of c1 and seq 1 of c2, each conversation's in order;
    # overlapping or touching windows are read once; no other user's messages.
    assert [(f.conversation_id, f.seq, f.text) for f in around] == [
        ("c1", 2, "two"),
        ("c1", 3, "three oboe"),
        ("c1", 4, "four"),
        ("c1", 6, "six"),
        ("c1", 7, "seven oboe"),
        ("c1", 8, "eight"),
        ("c2", 1, "nine oboe"),
        ("c2", 2, "ten"),
    ]
    assert all(f.created_at.tzinfo is not None for f in around)
    wide = await db.read(
        lambda c: MessageSearch(c).around(
            "t1", "alice", hits, radius=1, further_after=0, wide=hits[:1], wide_radius=3
        )
    )
    assert len({(f.conversation_id, f.seq) for f in wide}) == len(wide)
    assert await db.read(lambda c: MessageSearch(c).around("t1", "bob", hits)) == []


def word_counts(conn: Connection) -> tuple[dict[tuple[str, str, str], int], dict[Any, int]]:
    """PostgreSQL: `message_words` as kept, and as counted again from the messages."""
    kept = "SELECT tenant_id, user_id, word, messages FROM message_words"
    recounted = (
        "SELECT tenant_id, user_id, word, count(*) FROM (SELECT tenant_id, user_id, "
        "unnest(array_append(tsvector_to_array(search_vector), '')) AS word FROM messages "
        "WHERE search_text IS NOT NULL) w GROUP BY tenant_id, user_id, word"
    )
    return (
        {(t, u, w): n for t, u, w, n in conn.execute(text(kept))},
        {(t, u, w): n for t, u, w, n in conn.execute(text(recounted))},
    )


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_each_users_word_counts_follow_every_write(db: Database) -> None:
    async def in_step() -> dict[tuple[str, str, str], int]:
        kept, recounted = await db.read(word_counts)
        assert kept == {k: n for k, n in recounted.items() if k[1] != "anonymous"}
        return kept

    await new_conversation(db, "c1", [msg("user", "Kayaks, kayaks"), msg("assistant", "a kayak")])
    await new_conversation(db, "c2", [msg("system", "kayak rules"), msg("user", "a glacier")])
    await new_conversation(db, "c3", [msg("user", "kayak")], user="bob")
    await new_conversation(db, "c4", [msg("user", "kayak")], tenant="t2")
    await new_conversation(db, "c5", [msg("user", "kayak")], user="anonymous")
    counts = await in_step()
    # Each word counts the messages holding it (not its occurrences, not the system message);
    # '' counts the user's searchable messages. The anonymous user has none kept.
    assert {w: n for (t, u, w), n in counts.items() if (t, u) == ("t1", "alice")} == {
        "": 3,
        "kayak": 2,
        "glacier": 1,
    }
    assert not [k for k in counts if k[1] == "anonymous"]

    def edit(conn: Connection) -> None:
        conn.execute(update(MESSAGES).values(status="complete"))  # no word changes
        conn.execute(
            update(MESSAGES)
            .where(MESSAGES.c.search_text == "a glacier")
            .values(search_text="a kayak again")
        )

    await db.write(edit)
    counts = await in_step()
    assert counts[("t1", "alice", "kayak")] == 3 and ("t1", "alice", "glacier") not in counts
    assert await db.write(lambda c: Conversations(c).delete("t1", "c1"))
    assert counts[("t1", "alice", "")] - (await in_step())[("t1", "alice", "")] == 2
    await db.write(lambda c: c.execute(text("DELETE FROM conversations WHERE id = 'c3'")))
    assert ("t1", "bob", "kayak") not in await in_step()  # (the messages went by cascade)
    await new_conversation(db, "c6", [msg("user", "a kayak")], user="bob")
    await db.write(lambda c: Conversations(c).delete_user("t1", "alice"))
    # Erased: none of the user's words are left, not even at zero; the others' are untouched.
    assert set(await in_step()) == {
        ("t1", "bob", ""),
        ("t1", "bob", "kayak"),
        ("t2", "alice", ""),
        ("t2", "alice", "kayak"),
    }
    await db.write(lambda c: c.execute(text("TRUNCATE messages CASCADE")))
    assert await in_step() == {}


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_concurrent_writes_of_one_user_lose_no_count(db: Database) -> None:
    await asyncio.gather(
        *(
            new_conversation(db, f"c{i}", [msg("user", f"zebra yak {i}"), msg("user", "yak")])
            for i in range(12)
        )
    )
    kept, recounted = await db.read(word_counts)
    assert kept == recounted and kept[("t1", "alice", "yak")] == 24


@contextlib.asynccontextmanager
async def holding(
    db: Database, conversation_id: str
) -> AsyncIterator[Callable[[Callable[[Connection, ConversationRecord], Any]], Awaitable[None]]]:
    """A transaction on its own connection holding the conversation's row, as a turn, a
    message import or a retention delete does first; it runs `then(work)` on that
    connection when awaited, and commits when the block is left."""
    engine = create_async_engine(db.url)
    try:
        async with engine.begin() as conn:
            conv = await conn.run_sync(
                lambda c: Conversations(c).get("t1", conversation_id, for_update=True)
            )
            assert conv is not None

            async def then(work: Callable[[Connection, ConversationRecord], Any]) -> None:
                await conn.run_sync(lambda c: work(c, conv))

            yield then
    finally:
        await engine.dispose()


def append_a_message(conn: Connection, conv: ConversationRecord) -> None:
    messages = chained(conv, [msg("user", "a late kayak")])
    Conversations(conn).append(conv, "alice", messages, now=at(900))


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_an_erasure_waits_for_a_write_holding_a_conversation(
    db: Database,
) -> None:
    """Writers lock a conversation's row before the user's word counts (a message import, say:
    a turn also holds the user's share of the erasure lock, so never meets one). An erasure
    that took the counts first (deleting the messages of another conversation) and then
    waited for the import's row deadlocked with it."""
    await new_conversation(db, "c1", [msg("user", "a kayak")])
    await new_conversation(db, "c2", [msg("user", "a glacier")])
    async with holding(db, "c2") as then:
        erasure = asyncio.create_task(db.write(lambda c: erase_user(c, "t1", "alice")))
        await eventually(lambda: lock_waits(db.url), "the erasure waiting for the row")
        await then(append_a_message)
    erased = await erasure
    assert (erased["conversations"], erased["messages"]) == (2, 3)
    kept, recounted = await db.read(word_counts)
    assert kept == recounted == {}


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_an_erasure_waits_for_a_retention_delete(db: Database) -> None:
    """Retention locks an idle conversation's row, then deletes its vectors and attachments:
    an erasure that deleted the user's attachments before locking their conversations
    deadlocked with it."""
    await new_conversation(db, "c1", [msg("user", "a kayak")])
    await new_conversation(db, "c2", [msg("user", "a glacier")])
    await attach(db, "c1", [("notes on kayaks", 3)])
    async with holding(db, "c1") as then:
        erasure = asyncio.create_task(db.write(lambda c: erase_user(c, "t1", "alice")))
        await eventually(lambda: lock_waits(db.url), "the erasure waiting for the row")
        await then(lambda c, conv: Conversations(c).delete("t1", conv.id))
    erased = await erasure
    assert (erased["conversations"], erased["attachments"]) == (1, 0)  # (c1 went first)


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_retention_waits_for_a_turn_of_the_user_without_deadlock(
    db: Database,
) -> None:
    """Retention, which deletes several idle conversations per transaction, and a turn (which
    takes no erasure lock that retention would wait on): the conversation the turn holds is
    kept (it is no longer idle), the other goes."""
    await new_conversation(db, "c1", [msg("user", "a kayak")])
    await new_conversation(db, "c2", [msg("user", "a glacier")])
    config = Config(tenants={"t1": TenantConfig(api_keys=["k1"], retention_days=1)})
    async with holding(db, "c2") as then:
        retention = asyncio.create_task(Maintenance(db, config).retain("t1", at(600)))
        await eventually(lambda: lock_waits(db.url), "retention waiting for the turn")
        await then(append_a_message)
    assert (await retention)["conversations"] == 1
    left = await db.read(lambda c: Conversations(c).list("t1", None, limit=10))
    assert [c.id for c in left] == ["c2"]
    kept, recounted = await db.read(word_counts)
    assert kept == recounted and kept[("t1", "alice", "")] == 2


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_a_rare_word_outweighs_a_word_most_rows_hold(db: Database) -> None:
    # "zed" is in every turn; `ts_rank` alone put the row saying it three times first.
    turns = [msg("user", f"zed said plain thing {i}") for i in range(8)]
    turns += [msg("user", "zed zed zed"), msg("user", "a kayak")]
    await new_conversation(db, "c1", turns)
    await new_conversation(db, "c2", [msg("user", "a kayak"), msg("user", "a kayak")], user="bob")
    await new_conversation(db, "c3", turns, user="anonymous")

    async def first_two(**scope: Any) -> list[str]:
        hits = await search(db, ["zed", "kayak"], limit=3, **scope)
        user = scope.get("user", "alice")
        found = await db.read(lambda c: MessageSearch(c).around("t1", user, hits, radius=0))
        texts = {f.pk: f.text for f in found}
        return [texts[h.pk] for h in hits][:2]

    assert await first_two() == ["a kayak", "zed zed zed"]
    # The anonymous user's words are counted in the conversation searched.
    anonymous = await db.read(lambda c: Conversations(c).get("t1", "c3"))
    assert anonymous is not None
    assert await first_two(user="anonymous", conversation_pk=anonymous.pk) == [
        "a kayak",
        "zed zed zed",
    ]
    # Counts lost by other means than the triggers: found still, unweighted.
    await db.write(lambda c: c.execute(text("DELETE FROM message_words")))
    assert await first_two() == ["zed zed zed", "a kayak"]


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_rows_of_only_common_words_are_ranked_when_too_few_others(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = [msg("user", f"zed: plain turn number {i}") for i in range(20)]
    turns += [msg("user", f"zed: the kayak trip {i}") for i in range(3)]
    await new_conversation(db, "c1", [*turns, msg("assistant", "a glacier walk")])
    monkeypatch.setattr(search_module, "RANKED_ROWS", 5)  # "kayak" and "glacier" only

    async def found(limit: int) -> tuple[list[str], list[str]]:
        """The hits' texts, and what each ranking statement matched."""
        matched: list[str] = []

        def work(conn: Connection) -> list[str]:
            with executed(conn) as ran:
                hits = MessageSearch(conn).search(
                    "t1", "alice", ["zed", "kayak", "glacier"], limit=limit
                )
            for statement, parameters in ran:
                if "WITH listed" in statement:  # (counted and ranked at once, unless narrowed)
                    matched.append("at once")
                elif "ts_rank" in statement:  # (its tsqueries: each word's, the longest :match)
                    matched.append(max((p for p in parameters if str(p)[:1] == "'"), key=len))
            texts = {f.pk: f.text for f in MessageSearch(conn).around("t1", "alice", hits)}
            return [texts[h.pk] for h in hits]

        return await db.read(work), matched

    # Four rows hold the rarer words: enough for four hits, not for six.
    four, matched = await found(4)
    assert matched == ["at once", "'glacier' | 'kayak'"]  # (held by too many rows at once)
    assert all("kayak" in t or "glacier" in t for t in four)
    six, matched = await found(6)
    assert matched == ["at once", "'glacier' | 'kayak'", "'glacier' | 'kayak' | 'zed'"]
    assert sorted(six[:4]) == sorted(four) and all("plain" in t for t in six[4:])
    monkeypatch.setattr(search_module, "RANKED_ROWS", 10**6)  # every row ranked at once
    assert await found(6) == (six, ["at once"])


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_counting_and_ranking_at_once_finds_what_two_statements_find(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(5)
    vocabulary = [f"word{i}" for i in range(30)] + ["kayak", "glacier", "zed", "running"]
    for c in range(6):
        turns = [
            msg(rng.choice(["user", "assistant"]), " ".join(rng.choices(vocabulary, k=9)))
            for _ in range(15)
        ]
        await new_conversation(db, f"c{c}", turns)
    questions = [rng.sample(vocabulary, k) for k in (1, 2, 3, 5, 8) for _ in range(6)]
    questions += [["kayak", "runs", "nothing"], ["absent"], ["zed", "zed"]]
    at_once = [await search(db, q, limit=12) for q in questions]
    # The statement counting and ranking at once, made to hand every search over to the
    # two statements (as for words too many rows hold): the same hits, the same scores.
    monkeypatch.setattr(
        tsvector,
        "FOLDED",
        text(
            "SELECT NULL AS pk, CAST(:words AS TEXT), CAST(:tenant AS TEXT), "
            "CAST(:user AS TEXT), CAST(:most AS INTEGER), CAST(:limit AS INTEGER)"
        ),
    )
    assert [await search(db, q, limit=12) for q in questions] == at_once
    assert sum(len(hits) for hits in at_once) > 100
    # Without counts (lost by other means than the triggers), unweighted alike.
    await db.write(lambda c: c.execute(text("DELETE FROM message_words")))
    apart = [await search(db, q, limit=12) for q in questions]
    monkeypatch.undo()
    assert [await search(db, q, limit=12) for q in questions] == apart


async def test_migration_0018_counts_what_was_stored_before_it_down_and_up_again(
    database_url: str,
) -> None:
    """On PostgreSQL the users' word counts start from the messages already stored; on SQLite
    it changes nothing."""

    async def in_database(work: Any) -> Any:
        db = Database(database_url)  # one per schema: PostgreSQL's cached plans do not survive it
        try:
            return await work(db)
        finally:
            await db.dispose()

    def tables(conn: Connection) -> set[str]:
        return set(inspect(conn).get_table_names())

    await asyncio.to_thread(migrate.upgrade, database_url, "0017")
    await in_database(lambda db: new_conversation(db, "c1", [msg("user", "a zebra, a yak")]))
    before = await in_database(lambda db: db.read(tables))
    for _ in range(2):
        await asyncio.to_thread(migrate.upgrade, database_url)
        await in_database(lambda db: new_conversation(db, "c2", [msg("user", "a zebra")]))
        if database_url.startswith("postgresql"):
            kept, recounted = await in_database(lambda db: db.read(word_counts))
            assert kept == recounted and kept[("t1", "alice", "zebra")] == 2
        assert await in_database(lambda db: found_texts(db, ["zebra"])) == [
            "a zebra",
            "a zebra, a yak",
        ]
        await in_database(lambda db: db.write(lambda c: Conversations(c).delete("t1", "c2")))
        await asyncio.to_thread(command.downgrade, migrate.alembic_config(database_url), "0017")
        assert await in_database(lambda db: db.read(tables)) == before
