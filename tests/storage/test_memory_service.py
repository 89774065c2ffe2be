"""ConversationMemory.begin/finish on real databases: what is stored, attached and recorded."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, func, select, text, update
from sqlalchemy.ext.asyncio import create_async_engine

from policies.pricing import Usage
from proxy.accounting.costs import Bill
from proxy.core.config import ContextSettings
from proxy.core.errors import Conflict, NotFound, Unprocessable
from proxy.durability.spill import SpillFile
from proxy.pipeline.exchange_batch import DeferredExchanges
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.turn import Mode, Outcome, TokenCounter, Turn
from proxy.pipeline.turn_store import import_messages
from proxy.routes.users import erase_user
from storage.database import Database
from storage.models import EXCHANGES
from storage.records import ConversationRecord, ExchangeRecord, MessageRecord
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from tests.integration.test_degraded import sqlite_locked
from tests.polling import eventually

SYSTEM = {"role": "system", "content": "You are terse."}
_request_ids = itertools.count(1)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
def memory(db: Database) -> ConversationMemory:
    return ConversationMemory(db)


async def begin(
    memory: ConversationMemory,
    messages: list[dict[str, Any]],
    *,
    conversation_id: str | None = None,
    user_id: str = "alice",
    tenant_id: str = "t1",
    mode: Mode = "full",
    idempotency_key: str | None = None,
    context: ContextSettings | None = None,
) -> Turn:
    return await memory.begin(
        request_id=f"req_{next(_request_ids)}",
        tenant_id=tenant_id,
        user_id=user_id,
        conversation_id=conversation_id,
        mode=mode,
        idempotency_key=idempotency_key,
        messages=messages,
        model="gpt-4o-mini",
        upstream="echo",
        stream=False,
        context=context or ContextSettings(),
    )


async def answer(memory: ConversationMemory, turn: Turn, text: str | None) -> None:
    """The upstream answered `text` (None: it failed before saying anything)."""
    if text is None:
        outcome = Outcome("error", http_status=502, error="upstream unreachable")
    else:
        outcome = Outcome("complete", http_status=200, reply=assistant(text))
    await memory.finish(turn, outcome)


async def exchange_turn(
    memory: ConversationMemory, messages: list[dict[str, Any]], reply: str | None, **options: Any
) -> Turn:
    turn = await begin(memory, messages, **options)
    await answer(memory, turn, reply)
    return turn


async def stored(db: Database, conversation_id: str | None, tenant_id: str = "t1") -> list[Any]:
    """The conversation's messages in order, as (role, content) or (role, content, status)."""
    assert conversation_id is not None

    def read(conn: Connection) -> list[MessageRecord]:
        repo = Conversations(conn)
        conv = repo.get(tenant_id, conversation_id)
        assert conv is not None
        return repo.messages(tenant_id, conv.pk)

    messages = await db.read(read)
    return [
        (m.role, m.content) if m.status == "complete" else (m.role, m.content, m.status)
        for m in messages
    ]


async def conversation(db: Database, conversation_id: str | None) -> ConversationRecord:
    assert conversation_id is not None
    conv = await db.read(lambda conn: Conversations(conn).get("t1", conversation_id))
    assert conv is not None
    return conv


async def exchange_of(db: Database, turn: Turn) -> ExchangeRecord:
    record = await db.read(lambda conn: Exchanges(conn).get(turn.tenant_id, turn.request_id))
    assert record is not None
    return record


def history(turn: Turn) -> list[dict[str, Any]]:
    return [t.message for t in turn.history]


async def test_thin_client_gets_the_stored_tail_as_history(
    memory: ConversationMemory, db: Database
) -> None:
    first = await exchange_turn(memory, [SYSTEM, user("hi")], "hello", conversation_id="c1")
    assert first.conversation_id == "c1" and first.history == []

    second = await begin(memory, [SYSTEM, user("how are you?")], conversation_id="c1")
    # The client sends its own system message; the stored one is not attached again.
    assert history(second) == [user("hi"), assistant("hello")]
    assert all(t.tokens > 0 for t in second.history)
    await answer(memory, second, "fine")

    third = await begin(memory, [user("and now?")], conversation_id="c1")
    assert history(third) == [
        user("hi"),
        assistant("hello"),
        user("how are you?"),
        assistant("fine"),
    ]
    assert await stored(db, "c1") == [
        ("system", "You are terse."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "how are you?"),
        ("assistant", "fine"),
        ("user", "and now?"),
    ]
    assert (await exchange_of(db, third)).status == "in_progress"


async def test_thin_client_history_is_bounded_by_the_window(
    memory: ConversationMemory, db: Database
) -> None:
    for i in range(12):
        await exchange_turn(memory, [user(f"q{i}")], f"a{i}", conversation_id="c1")
    small = ContextSettings(max_history_messages=4, min_recent_messages=2)
    turn = await begin(memory, [user("last")], conversation_id="c1", context=small)
    # The window, plus some slack so a tool call's replies are not cut off; never all 24.
    assert 4 <= len(turn.history) < 24
    assert history(turn)[-2:] == [user("q11"), assistant("a11")]


async def test_full_history_client_continues_by_chain_and_stores_only_new_messages(
    memory: ConversationMemory, db: Database
) -> None:
    first = await exchange_turn(memory, [SYSTEM, user("hi")], "hello")
    assert first.conversation_id is not None and first.conversation_id.startswith("conv_")

    second = await begin(memory, [SYSTEM, user("hi"), assistant("hello"), user("more")])
    assert second.conversation_id == first.conversation_id
    assert second.history == []  # the client sent it all
    await answer(memory, second, "sure")
    assert await stored(db, first.conversation_id) == [
        ("system", "You are terse."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "more"),
        ("assistant", "sure"),
    ]

    # An edited earlier turn is another conversation; so is another user's identical chat.
    edited = await begin(memory, [SYSTEM, user("hi"), assistant("HELLO"), user("more")])
    bobs = await begin(memory, [SYSTEM, user("hi"), assistant("hello")], user_id="bob")
    other_tenant = await begin(memory, [SYSTEM, user("hi"), assistant("hello")], tenant_id="t2")
    ids = {first.conversation_id, edited.conversation_id, bobs.conversation_id}
    assert len(ids) == 3 and None not in ids
    assert other_tenant.conversation is not None and other_tenant.conversation.tenant_id == "t2"
    assert len(await stored(db, first.conversation_id)) == 5


async def test_retried_unanswered_turn_is_not_stored_twice(
    memory: ConversationMemory, db: Database
) -> None:
    # A full-history client: the upstream failed, the client sends the same request again.
    failed = await exchange_turn(memory, [user("hi")], None)
    retry = await exchange_turn(memory, [user("hi")], "hello")
    assert retry.conversation_id == failed.conversation_id
    assert await stored(db, failed.conversation_id) == [("user", "hi"), ("assistant", "hello")]
    assert (await exchange_of(db, failed)).status == "error"

    # A thin client: its retried turn is neither stored again nor attached as history.
    await exchange_turn(memory, [user("q1")], "a1", conversation_id="thin")
    await exchange_turn(memory, [user("q2")], None, conversation_id="thin")
    again = await begin(memory, [user("q2")], conversation_id="thin")
    assert history(again) == [user("q1"), assistant("a1")]
    await answer(memory, again, "a2")
    assert await stored(db, "thin") == [
        ("user", "q1"),
        ("assistant", "a1"),
        ("user", "q2"),
        ("assistant", "a2"),
    ]


async def test_idempotency_key_replay_stores_nothing_new(
    memory: ConversationMemory, db: Database
) -> None:
    first = await exchange_turn(memory, [user("hi")], "hello", idempotency_key="k1")
    replay = await begin(memory, [user("hi")], idempotency_key="k1")
    assert replay.conversation_id == first.conversation_id
    assert not replay.store_reply
    await answer(memory, replay, "hello")

    # Thin clients replay too: the key, not the body, says it is the same request.
    thin = await exchange_turn(memory, [user("q")], "a", conversation_id="c1", idempotency_key="k2")
    thin_replay = await exchange_turn(
        memory, [user("q")], "a", conversation_id="c1", idempotency_key="k2"
    )
    assert thin_replay.conversation_id == thin.conversation_id == "c1"

    assert await stored(db, first.conversation_id) == [("user", "hi"), ("assistant", "hello")]
    assert await stored(db, "c1") == [("user", "q"), ("assistant", "a")]
    original = await db.read(lambda conn: Exchanges(conn).by_idempotency_key("t1", "alice", "k1"))
    assert original is not None and original.request_id == first.request_id
    replayed = await exchange_of(db, replay)
    assert (replayed.status, replayed.conversation_id) == ("complete", first.conversation_id)


async def test_an_idempotency_key_reused_with_other_messages_is_refused_and_stores_nothing(
    memory: ConversationMemory, db: Database
) -> None:
    first = await exchange_turn(memory, [user("hi")], "hello", idempotency_key="k1")
    for mode in ("full", "read", "off"):
        with pytest.raises(Unprocessable) as refused:
            await begin(memory, [user("something else")], idempotency_key="k1", mode=mode)
        assert (refused.value.param, refused.value.code) == (
            "Idempotency-Key",
            "idempotency_key_reused",
        )
    assert await stored(db, first.conversation_id) == [("user", "hi"), ("assistant", "hello")]
    # The same messages under it are still a retry of the first.
    retry = await begin(memory, [user("hi")], idempotency_key="k1")
    assert (retry.conversation_id, retry.store_reply) == (first.conversation_id, False)
    # An exchange recorded before requests were hashed has none: a request under its key is
    # taken for a retry, as it was then.
    await db.write(
        lambda conn: conn.execute(
            update(EXCHANGES).where(EXCHANGES.c.request_id == first.request_id),
            {"request_hash": None},
        )
    )
    older = await begin(memory, [user("something else")], idempotency_key="k1")
    assert (older.conversation_id, older.store_reply) == (first.conversation_id, False)


async def test_idempotency_keys_are_each_users_own(
    memory: ConversationMemory, db: Database
) -> None:
    """Another user's request under a key one user has used is a request of its own, stored
    for its user (it was a 422, and a key a client derives from its request, the same for
    every user, blocked all but the first user's)."""
    alice = await exchange_turn(memory, [user("hi")], "hello", idempotency_key="k1")
    bob = await exchange_turn(memory, [user("hi")], "hey", idempotency_key="k1", user_id="bob")
    assert bob.conversation_id != alice.conversation_id
    assert await stored(db, bob.conversation_id) == [("user", "hi"), ("assistant", "hey")]
    # Each user's retry is still a retry of that user's own request.
    for turn, who in ((alice, "alice"), (bob, "bob")):
        retry = await begin(memory, [user("hi")], idempotency_key="k1", user_id=who)
        assert (retry.conversation_id, retry.store_reply) == (turn.conversation_id, False)


async def test_concurrent_requests_with_one_idempotency_key_store_the_turn_once(
    memory: ConversationMemory, db: Database
) -> None:
    turns = await asyncio.gather(
        *(begin(memory, [user("hi")], idempotency_key="same") for _ in range(4))
    )
    conversation_ids = {t.conversation_id for t in turns}
    assert len(conversation_ids) == 1
    assert await stored(db, turns[0].conversation_id) == [("user", "hi")]
    assert sum(t.store_reply for t in turns) >= 1


async def test_concurrent_first_turns_of_a_new_conversation_id_share_it(
    memory: ConversationMemory, db: Database
) -> None:
    turns = await asyncio.gather(
        *(begin(memory, [user(f"q{i}")], conversation_id="fresh") for i in range(4))
    )
    assert {t.conversation_id for t in turns} == {"fresh"}
    contents = sorted(content for _, content in await stored(db, "fresh"))
    assert contents == ["q0", "q1", "q2", "q3"]


async def test_read_mode_attaches_history_stores_no_messages_and_records_the_exchange(
    memory: ConversationMemory, db: Database
) -> None:
    await exchange_turn(memory, [user("hi")], "hello", conversation_id="c1")
    before = await conversation(db, "c1")

    turn = await begin(memory, [user("peek")], conversation_id="c1", mode="read")
    assert history(turn) == [user("hi"), assistant("hello")]
    await answer(memory, turn, "peeked")
    assert await stored(db, "c1") == [("user", "hi"), ("assistant", "hello")]
    assert (await conversation(db, "c1")).chain_hash == before.chain_hash

    unknown = await exchange_turn(memory, [user("no such chat")], "ok", mode="read")
    assert unknown.conversation is None
    listed = await db.read(lambda conn: Conversations(conn).list("t1", "alice"))
    assert [c.id for c in listed] == ["c1"]
    for record in (await exchange_of(db, turn), await exchange_of(db, unknown)):
        assert (record.mode, record.status, record.http_status) == ("read", "complete", 200)
    assert (await exchange_of(db, turn)).conversation_id == "c1"


async def test_off_mode_attaches_and_stores_nothing_but_records_the_exchange(
    memory: ConversationMemory, db: Database
) -> None:
    await exchange_turn(memory, [user("hi")], "hello", conversation_id="c1")
    turn = await exchange_turn(memory, [user("private")], "ok", conversation_id="c1", mode="off")
    assert turn.conversation is None and turn.history == []
    assert await stored(db, "c1") == [("user", "hi"), ("assistant", "hello")]
    record = await exchange_of(db, turn)
    assert (record.mode, record.status, record.conversation_id) == ("off", "complete", "c1")


async def test_incomplete_reply_is_kept_outside_the_chain_and_the_conversation_continues(
    memory: ConversationMemory, db: Database
) -> None:
    turn = await begin(memory, [user("tell me a story")])
    conversation_id = turn.conversation_id
    await memory.finish(
        turn,
        Outcome("incomplete", http_status=200, reply=assistant("Once upon"), error="client left"),
    )
    assert await stored(db, conversation_id) == [
        ("user", "tell me a story"),
        ("assistant", "Once upon", "incomplete"),
    ]
    assert (await conversation(db, conversation_id)).chain_count == 1
    assert (await exchange_of(db, turn)).status == "incomplete"

    # The client retries the same request: same conversation, the turn is not stored again.
    retry = await exchange_turn(memory, [user("tell me a story")], "Once upon a time.")
    assert retry.conversation_id == conversation_id
    # It goes on with the whole history: still the same conversation.
    more = [user("tell me a story"), assistant("Once upon a time."), user("and then?")]
    follow_up = await begin(memory, more)
    assert follow_up.conversation_id == conversation_id and follow_up.history == []
    await answer(memory, follow_up, "The end.")
    # A thin client's history skips the partial reply.
    thin = await begin(memory, [user("thanks")], conversation_id=conversation_id)
    assert history(thin) == [*more, assistant("The end.")]

    assert await stored(db, conversation_id) == [
        ("user", "tell me a story"),
        ("assistant", "Once upon", "incomplete"),
        ("assistant", "Once upon a time."),
        ("user", "and then?"),
        ("assistant", "The end."),
        ("user", "thanks"),
    ]


async def test_another_users_conversation_id_is_not_found(
    memory: ConversationMemory, db: Database
) -> None:
    await exchange_turn(memory, [user("mine")], "ok", conversation_id="c1")
    with pytest.raises(NotFound):
        await begin(memory, [user("let me in")], conversation_id="c1", user_id="mallory")
    assert await stored(db, "c1") == [("user", "mine"), ("assistant", "ok")]
    # The same id in another tenant is another conversation.
    theirs = await exchange_turn(memory, [user("hi")], "yo", conversation_id="c1", tenant_id="t2")
    assert theirs.conversation is not None and theirs.conversation.tenant_id == "t2"
    assert await stored(db, "c1", "t2") == [("user", "hi"), ("assistant", "yo")]
    assert await stored(db, "c1") == [("user", "mine"), ("assistant", "ok")]


async def test_reply_lands_after_turns_stored_while_it_was_generated(
    db: Database, memory: ConversationMemory
) -> None:
    first = await exchange_turn(memory, [user("one")], "ONE", conversation_id="c1")
    # Two thin requests on one conversation overlap: the second stores its turn (and is
    # answered) while the first is still waiting for its reply.
    slow = await begin(memory, [user("two")], conversation_id="c1")
    fast = await begin(memory, [user("three")], conversation_id="c1")
    await answer(memory, fast, "THREE")
    await answer(memory, slow, "TWO")
    assert first.conversation_id == "c1"
    assert await stored(db, "c1") == [
        ("user", "one"),
        ("assistant", "ONE"),
        ("user", "two"),
        ("user", "three"),
        ("assistant", "THREE"),
        ("assistant", "TWO"),
    ]
    conv = await conversation(db, "c1")
    assert (conv.chain_count, conv.next_seq) == (6, 7)


async def test_each_of_two_overlapping_turns_keeps_its_reply_in_the_chain(
    db: Database, memory: ConversationMemory
) -> None:
    await exchange_turn(memory, [user("one")], "ONE", conversation_id="c1")
    # The first of two overlapping turns is answered first: its reply lands after the second
    # turn, and is no answer to it, so the second turn's reply continues the chain too.
    first = await begin(memory, [user("two")], conversation_id="c1")
    second = await begin(memory, [user("three")], conversation_id="c1")
    await answer(memory, first, "TWO")
    await answer(memory, second, "THREE")
    assert await stored(db, "c1") == [
        ("user", "one"),
        ("assistant", "ONE"),
        ("user", "two"),
        ("user", "three"),
        ("assistant", "TWO"),
        ("assistant", "THREE"),
    ]
    conv = await conversation(db, "c1")
    assert (conv.chain_count, conv.next_seq) == (6, 7)
    # Each reply says which message it answers.
    replies = await db.read(lambda c: Conversations(c).messages("t1", conv.pk, after_seq=4))
    assert [(m.content, m.meta.get("reply_to")) for m in replies] == [("TWO", 3), ("THREE", 4)]
    # The next thin turn gets both replies as history.
    follow = await begin(memory, [user("four")], conversation_id="c1")
    assert [t.message["content"] for t in follow.history][-2:] == ["TWO", "THREE"]


async def test_off_mode_records_are_written_in_one_batch_and_flushed_on_close(
    db: Database, memory: ConversationMemory, tmp_path: Path
) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 2**20)
    deferred = DeferredExchanges(db, spill, delay=3600)  # only close() writes them here
    turns = [await begin(memory, [user(f"q{i}")], mode="off") for i in range(3)]
    for turn in turns:
        assert turn.pending is not None  # nothing was written before the upstream call
        deferred.add(turn, Outcome("complete", http_status=200, bill=Bill(Usage(7, 0), None)))
    assert [await db.read(lambda c, t=t: Exchanges(c).get("t1", t.request_id)) for t in turns] == [
        None
    ] * 3
    await deferred.close()
    for turn in turns:
        record = await exchange_of(db, turn)
        assert (record.status, record.mode, record.prompt_tokens) == ("complete", "off", 7)


async def test_a_mode_off_record_added_while_a_batch_is_written_goes_in_the_next(
    db: Database, memory: ConversationMemory, tmp_path: Path
) -> None:
    """The batch's write waits behind another connection's lock; a record added meanwhile
    was left waiting in memory, with no batch to come for it."""
    deferred = DeferredExchanges(db, SpillFile(tmp_path / "spill.jsonl", 2**20), delay=0.01)
    first, second = [await begin(memory, [user(q)], mode="off") for q in ("q1", "q2")]
    done = Outcome("complete", http_status=200, bill=Bill(Usage(7, 0), None))
    async with holding_writes(db, "exchanges"):
        deferred.add(first, done)
        await asyncio.sleep(0.3)  # its batch is being written, waiting for the lock
        deferred.add(second, done)
    for turn in (first, second):
        await eventually(
            lambda t=turn: db.read(lambda c: Exchanges(c).get("t1", t.request_id)),
            f"{turn.request_id} recorded",
            attempts=250,
        )
    await deferred.close()


@contextlib.asynccontextmanager
async def holding_writes(db: Database, table: str) -> AsyncIterator[None]:
    """Another connection's lock that writes to `table` wait for, while in the block: the
    SQLite file's write lock, or PostgreSQL's table lock."""
    if db.is_sqlite:
        with sqlite_locked(Path(db.url.split(":///", 1)[1])):
            yield
        return
    engine = create_async_engine(db.url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))
            yield
    finally:
        await engine.dispose()


async def test_a_retry_that_overtakes_its_original_leaves_one_reply_in_the_chain(
    db: Database, memory: ConversationMemory
) -> None:
    original = await begin(memory, [user("q1")])
    retry = await begin(memory, [user("q1")])  # the SDK timed out and sent it again
    assert retry.conversation_id == original.conversation_id
    await answer(memory, retry, "A-retry")
    await answer(memory, original, "A-original")
    assert await stored(db, original.conversation_id) == [
        ("user", "q1"),
        ("assistant", "A-retry"),
        ("assistant", "A-original", "superseded"),
    ]
    # The client saw the retry's answer and continues from it: the same conversation.
    follow = await begin(memory, [user("q1"), assistant("A-retry"), user("q2")])
    assert follow.conversation_id == original.conversation_id


async def test_a_partial_reply_of_one_attempt_does_not_supersede_the_others_answer(
    db: Database, memory: ConversationMemory
) -> None:
    original = await begin(memory, [user("q1")])
    retry = await begin(memory, [user("q1")])
    # The retry's stream is cut first; the original then answers in full.
    cut = Outcome("incomplete", http_status=200, reply=assistant("A-par"))
    await memory.finish(retry, cut)
    await answer(memory, original, "A-original")
    assert await stored(db, original.conversation_id) == [
        ("user", "q1"),
        ("assistant", "A-par", "incomplete"),
        ("assistant", "A-original"),
    ]


@pytest.mark.parametrize("resent", [False, True])
async def test_a_keyed_retry_answers_its_original_turn_past_a_turn_stored_meanwhile(
    db: Database, memory: ConversationMemory, resent: bool
) -> None:
    if resent:  # q1 failed before: the keyed original resends it and stores nothing of its own
        await exchange_turn(memory, [user("q1")], None, conversation_id="c1")
    original = await begin(memory, [user("q1")], conversation_id="c1", idempotency_key="k1")
    other = await begin(memory, [user("q2")], conversation_id="c1")
    retry = await begin(memory, [user("q1")], conversation_id="c1", idempotency_key="k1")
    await answer(memory, other, "A2")
    await answer(memory, retry, "A1-retry")
    await answer(memory, original, "A1-original")
    assert await stored(db, "c1") == [
        ("user", "q1"),
        ("user", "q2"),
        ("assistant", "A2"),
        ("assistant", "A1-retry"),
        ("assistant", "A1-original", "superseded"),
    ]


async def test_an_imported_assistant_message_is_no_answer_to_a_live_turn(
    db: Database, memory: ConversationMemory
) -> None:
    first = await begin(memory, [user("q1")], conversation_id="c1")
    counter = TokenCounter("gpt-4o-mini")

    def add(conn: Connection) -> None:
        conv = Conversations(conn).get("t1", "c1", for_update=True)
        assert conv is not None
        import_messages(conn, conv, [assistant("imported")], counter)

    await db.write(add)
    await answer(memory, first, "A1")
    assert await stored(db, "c1") == [
        ("user", "q1"),
        ("assistant", "imported"),
        ("assistant", "A1"),
    ]


async def test_next_turn_waits_for_a_reply_still_being_written(
    db: Database, memory: ConversationMemory
) -> None:
    first = await begin(memory, [user("q1")], conversation_id="c1")
    written = asyncio.Event()
    release = asyncio.Event()

    async def reply_written_after_the_response() -> None:
        await release.wait()
        await answer(memory, first, "A1")
        written.set()

    memory.track(first, asyncio.create_task(reply_written_after_the_response()))
    second = asyncio.create_task(begin(memory, [user("q2")], conversation_id="c1"))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not second.done()  # held until the reply lands
    release.set()
    turn = await second
    assert written.is_set()
    assert history(turn) == [user("q1"), assistant("A1")]


async def delete(db: Database, conversation_id: str) -> None:
    assert await db.write(lambda conn: Conversations(conn).delete("t1", conversation_id))


async def test_a_reply_whose_conversation_was_deleted_never_lands_in_whatever_has_its_id_now(
    memory: ConversationMemory, db: Database
) -> None:
    turn = await begin(memory, [user("alice's private question")], conversation_id="chat-9")
    await delete(db, "chat-9")  # while the upstream is answering
    await exchange_turn(memory, [user("bob only")], "ok", conversation_id="chat-9", user_id="bob")
    await answer(memory, turn, "alice's answer")
    assert await stored(db, "chat-9") == [("user", "bob only"), ("assistant", "ok")]


async def test_a_reply_whose_conversation_was_deleted_never_lands_in_the_next_one_made(
    memory: ConversationMemory, db: Database
) -> None:
    """The deleted conversation was the newest: its key is not given to the next one."""
    turn = await begin(memory, [user("alice's private question")], conversation_id="slow-1")
    await delete(db, "slow-1")
    bobs = await exchange_turn(
        memory, [user("bob only")], None, conversation_id="bob-new", user_id="bob"
    )
    await answer(memory, turn, "alice's answer")
    assert await stored(db, "bob-new") == [("user", "bob only")]
    assert turn.conversation is not None and bobs.conversation is not None
    assert bobs.conversation.pk > turn.conversation.pk


async def test_a_retry_after_its_conversation_was_deleted_sees_nothing_of_whoever_has_its_id(
    memory: ConversationMemory, db: Database
) -> None:
    await exchange_turn(
        memory, [user("alice's question")], None, conversation_id="c-2", idempotency_key="k2"
    )  # the upstream failed
    await delete(db, "c-2")
    await exchange_turn(
        memory, [user("bob: my PIN is 4321")], "noted", conversation_id="c-2", user_id="bob"
    )
    with pytest.raises(NotFound):  # as any request naming bob's conversation
        await begin(memory, [user("alice's question")], conversation_id="c-2", idempotency_key="k2")
    retry = await begin(memory, [user("alice's question")], idempotency_key="k2")
    assert history(retry) == [] and retry.conversation_id != "c-2"
    await answer(memory, retry, "alice's answer")
    assert await stored(db, "c-2") == [("user", "bob: my PIN is 4321"), ("assistant", "noted")]
    # Her conversation went: the retry is stored as a new request would be, turn and reply.
    assert await stored(db, retry.conversation_id) == [
        ("user", "alice's question"),
        ("assistant", "alice's answer"),
    ]


@pytest.mark.parametrize("reply", ["an answer", None])
async def test_a_turn_whose_conversation_was_deleted_queues_no_work_for_it(
    memory: ConversationMemory, db: Database, reply: str | None
) -> None:
    """The user was erased (or the conversation deleted) while the upstream answered: neither
    the reply nor an embedding or summary job for the conversation is written back."""
    turn = await begin(memory, [user("q")], conversation_id="c1")
    turn.embed, turn.summarize_through = True, 1
    await delete(db, "c1")
    await answer(memory, turn, reply)
    assert await db.read(lambda conn: Jobs(conn).find("t1", limit=10)) == []
    # The same turn with its conversation there queues both.
    kept = await begin(memory, [user("q")], conversation_id="c2")
    kept.embed, kept.summarize_through = True, 1
    await answer(memory, kept, reply)
    jobs = await db.read(lambda conn: Jobs(conn).find("t1", limit=10))
    assert sorted(j.kind for j in jobs) == ["embed_messages", "summarize_history"]


async def test_a_mode_off_record_of_a_user_erased_while_it_ran_is_not_written_after(
    db: Database, memory: ConversationMemory, tmp_path: Path
) -> None:
    deferred = DeferredExchanges(db, SpillFile(tmp_path / "spill.jsonl", 2**20), delay=3600)
    erased = await begin(memory, [user("my SSN is 078-05-1120")], mode="off")
    kept = await begin(memory, [user("hello")], mode="off", user_id="bob")
    await db.write(lambda conn: Erasures(conn).record("t1", "alice", datetime.now(UTC)))
    for turn in (erased, kept):  # their upstreams answered after the erasure
        deferred.add(turn, Outcome("complete", http_status=200, bill=Bill(Usage(7, 0), None)))
    await deferred.close()
    assert await db.read(lambda conn: Exchanges(conn).get("t1", erased.request_id)) is None
    assert (await exchange_of(db, kept)).status == "complete"
    # A batch of erased users' records only leaves nothing to insert, and that is no error.
    await db.write(lambda conn: Exchanges(conn).insert_finished([]))


async def test_a_turn_begun_before_its_users_erasure_is_refused_not_stored_after_it(
    db: Database, memory: ConversationMemory
) -> None:
    """The turn waits for its user's reply write (`settle`) while the erasure runs: once the
    erasure is through, the turn stores nothing (conversation, message or record), as a
    replayed or batched one does not."""
    go = asyncio.Event()

    async def erasure() -> None:
        await go.wait()
        await db.write(lambda conn: erase_user(conn, "t1", "alice"))

    memory.track(Turn("req_reply", "t1", "alice", "full", "m"), asyncio.create_task(erasure()))
    turn = asyncio.create_task(begin(memory, [user("my PIN is 4321")], conversation_id="c1"))
    await asyncio.sleep(0)  # (the request has begun)
    go.set()
    with pytest.raises(Conflict) as refused:
        await turn
    assert refused.value.code == "user_erased"

    def left(conn: Connection) -> tuple[Any, int]:
        records = conn.execute(select(func.count()).select_from(EXCHANGES)).scalar_one()
        return Conversations(conn).get("t1", "c1"), records

    assert await db.read(left) == (None, 0)
    # A request that begins after the erasure is stored as usual.
    again = await begin(memory, [user("hello again")], conversation_id="c1")
    assert await stored(db, again.conversation_id) == [("user", "hello again")]
