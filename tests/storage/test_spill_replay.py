"""The spill's replay into a real database (SQLite and PostgreSQL): each request stored once
however often it is replayed, exchanges begun in the database completed, erased users not
brought back, refused turns recorded, and an unreachable database leaves the spill as it was."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from policies.pricing import Usage
from proxy.accounting.costs import Bill
from proxy.accounting.metrics import Metrics
from proxy.core.config import UpstreamConfig
from proxy.core.requests import Inline
from proxy.durability.spill import Spilled, SpillFile
from proxy.durability.storage_circuit import StorageCircuit
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.replay import SpillReplayer
from proxy.pipeline.replay_writes import Wanted
from proxy.pipeline.reply import pending_row
from proxy.pipeline.spill_entries import (
    spilled_charge,
    spilled_intent,
    spilled_outcome,
    spilled_record,
    spilled_turn,
)
from proxy.pipeline.turn import Outcome
from storage.database import Database
from storage.errors import StorageUnavailable
from storage.repositories.attachments import Attachments
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.system import SystemRepository
from tests.conftest import make_config
from tests.postgres import free_port
from tests.storage.test_memory_service import assistant, begin, user

CONFIG = make_config(UpstreamConfig(kind="echo"))
EXTRACT = Wanted(extract=True, embed=False)


@pytest.fixture
def spill(tmp_path: Path) -> SpillFile:
    return SpillFile(tmp_path / "spill.jsonl", 2**20)


def replayer(
    spill: SpillFile, db: Database, wanted: Wanted = EXTRACT, circuit: StorageCircuit | None = None
) -> SpillReplayer:
    return SpillReplayer(
        spill,
        ConversationMemory(db, circuit=circuit),
        CONFIG,
        Metrics(),
        intent_of=lambda tenant: lambda messages: None,
        wanted=lambda tenant, user, mode: wanted,
        wake_jobs=lambda: None,
        interval=3600,
    )


def reply(text: str) -> Outcome:
    return Outcome("complete", 200, reply=assistant(text), bill=Bill(Usage(5, 3), None))


async def spill_turn(
    spill: SpillFile,
    request_id: str,
    text: str,
    answer: str | None,
    *,
    user_id: str = "alice",
    at: datetime | None = None,
    conversation_id: str = "c1",
    documents: Sequence[Inline] = (),
) -> Spilled:
    """A degraded request of a thin client: its turn (returned), then (if it ended) its
    outcome."""
    at = at or datetime.now(UTC)
    turn = spilled_turn(
        request_id=request_id,
        tenant_id="t1",
        user_id=user_id,
        started_at=at,
        mode="full",
        model="gpt-4o-mini",
        conversation_id=conversation_id,
        idempotency_key=None,
        messages=[user(text)],
        upstream="main",
        stream=False,
        documents=documents,
    )
    await spill.add(turn, bounded=True)
    if answer is not None:
        outcome = spilled_outcome("t1", user_id, request_id, at, reply(answer), turn=None)
        await spill.add(outcome, bounded=False)
    return turn


async def messages(db: Database, conversation_id: str = "c1") -> list[tuple[str, Any, str]]:
    def read(conn: Any) -> list[tuple[str, Any, str]]:
        conversations = Conversations(conn)
        conv = conversations.get("t1", conversation_id)
        if conv is None:
            return []
        return [(m.role, m.content, m.status) for m in conversations.messages("t1", conv.pk)]

    return await db.read(read)


async def exchange(db: Database, request_id: str) -> Any:
    return await db.read(lambda conn: Exchanges(conn).get("t1", request_id))


async def test_spilled_turns_are_stored_once_in_order_however_often_replayed(
    db: Database, spill: SpillFile
) -> None:
    await spill_turn(spill, "r1", "first", "one")
    await spill_turn(spill, "r2", "second", "two")
    lines = spill.path.read_bytes()
    assert await replayer(spill, db).replay() == {"replayed": 2}
    assert not spill.path.exists() and not spill.replaying.exists()
    expected = [
        ("user", "first", "complete"),
        ("assistant", "one", "complete"),
        ("user", "second", "complete"),
        ("assistant", "two", "complete"),
    ]
    assert await messages(db) == expected
    record = await exchange(db, "r2")
    assert (record.status, record.prompt_tokens, record.completion_tokens) == ("complete", 5, 3)
    jobs = await db.read(lambda conn: Jobs(conn).find("t1", user_id="alice", limit=10))
    assert sorted(j.ref for j in jobs) == ["r1", "r2"]  # extraction queued, as a live reply

    # A round that stopped before it could delete its file: the same entries again.
    spill.path.write_bytes(lines)
    assert await replayer(spill, db).replay() == {"duplicate": 2}
    assert await messages(db) == expected


async def test_only_a_replay_that_writes_closes_the_storage_circuit(
    db: Database, spill: SpillFile
) -> None:
    await spill_turn(spill, "r1", "first", "one")
    lines = spill.path.read_bytes()
    assert await replayer(spill, db).replay() == {"replayed": 1}
    circuit = StorageCircuit(1, 3600)
    with pytest.raises(StorageUnavailable), circuit.outcome(trial=circuit.admit()):
        raise StorageUnavailable("the database is away")
    assert circuit.state() == "open"
    # The same request again (a round that stopped before deleting its file): found recorded,
    # written nothing, so it says nothing of whether the database takes writes.
    spill.path.write_bytes(lines)
    assert await replayer(spill, db, circuit=circuit).replay() == {"duplicate": 1}
    assert circuit.state() == "open"
    await spill_turn(spill, "r2", "second", "two")
    assert await replayer(spill, db, circuit=circuit).replay() == {"replayed": 1}
    assert circuit.state() == "closed"


def intent_part(cost: float, at: str) -> dict[str, Any]:
    return {
        "kind": "intent",
        "model": "gpt-4o-mini",
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "estimated": False,
        "cost_usd": cost,
        "at": at,
    }


async def test_a_user_waits_for_a_turn_spilled_after_a_round_that_did_not_finish(
    db: Database, spill: SpillFile
) -> None:
    """The round's entries were kept for the next one; the user's next turn was spilled
    after them. Their turn after that must come after both."""
    await spill_turn(spill, "r1", "first", "one")
    batch = await spill.take()
    assert batch is not None
    await batch.close(left=batch.entries)  # (the database went away again)
    await spill_turn(spill, "r2", "second", "two")
    assert await replayer(spill, db).replay() == {"replayed": 2}
    assert not spill.holds("t1", "alice")
    await begin(ConversationMemory(db), [user("third")], conversation_id="c1")
    assert [m[1] for m in await messages(db) if m[0] == "user"] == ["first", "second", "third"]


async def test_a_spill_that_cannot_be_read_holds_its_users_turn_rather_than_failing_it(
    db: Database, spill: SpillFile
) -> None:
    """The file a round takes cannot be written (here a directory stands in its place): the
    user's next turn is told their earlier ones still wait, not handed the OSError (a 500)."""
    await spill_turn(spill, "r1", "first", "one")
    spill.replaying.mkdir()
    assert await replayer(spill, db).catch_up("t1", "alice") is False
    spill.replaying.rmdir()
    assert await replayer(spill, db).catch_up("t1", "alice") is True


async def test_the_costs_of_a_degraded_exchange_are_added_once_after_it(
    db: Database, spill: SpillFile
) -> None:
    at = datetime.now(UTC)
    await spill_turn(spill, "r1", "first", "one", at=at)
    first = intent_part(0.25, at.isoformat())
    await spill.add(spilled_charge("t1", "alice", "r1", at, first), bounded=False)
    lines = spill.path.read_bytes()
    assert await replayer(spill, db).replay() == {"replayed": 1}
    record = await exchange(db, "r1")
    assert (record.status, record.cost_parts, record.cost_memory_usd) == ("complete", [first], 0.25)

    # The same lines again, and a later cost (a charge whose own write failed): the first
    # is not added twice, the later one is.
    spill.path.write_bytes(lines)
    later = intent_part(0.5, (at + timedelta(seconds=1)).isoformat())
    await spill.add(spilled_charge("t1", "alice", "r1", at, later), bounded=False)
    assert await replayer(spill, db).replay() == {"amended": 1}
    record = await exchange(db, "r1")
    assert (record.cost_parts, record.cost_memory_usd) == ([first, later], 0.75)
    await spill.add(spilled_charge("t1", "alice", "r1", at, later), bounded=False)
    assert await replayer(spill, db).replay() == {"duplicate": 1}  # held already: nothing written
    assert (await exchange(db, "r1")).cost_memory_usd == 0.75

    # A cost for an exchange no longer there (erased, retention) goes nowhere.
    await spill.add(spilled_charge("t1", "alice", "r9", at, first), bounded=False)
    assert await replayer(spill, db).replay() == {"gone": 1}


async def test_the_llm_intent_of_a_spilled_exchange_replaces_the_keyword_one(
    db: Database, spill: SpillFile
) -> None:
    at = datetime.now(UTC)
    await spill_turn(spill, "r1", "first", "one", at=at)
    detail = {"label": "feedback", "confidence": 0.9, "method": "llm"}
    await spill.add(spilled_intent("t1", "alice", "r1", at, detail), bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    record = await exchange(db, "r1")
    assert (record.intent, record.intent_detail) == ("feedback", detail)

    def turn_meta(conn: Any) -> Any:
        conversations = Conversations(conn)
        conv = conversations.get("t1", "c1")
        assert conv is not None
        return [m.meta for m in conversations.messages("t1", conv.pk) if m.role == "user"]

    assert [m["intent"] for m in await db.read(turn_meta)] == [detail]
    # Alone (its write failed after the exchange was stored): it amends the record.
    again = {**detail, "label": "question"}
    await spill.add(spilled_intent("t1", "alice", "r1", at, again), bounded=False)
    assert not spill.holds("t1", "alice")  # her next turn need not wait for it
    assert await replayer(spill, db).replay() == {"amended": 1}
    assert (await exchange(db, "r1")).intent == "question"


async def test_a_turn_whose_outcome_is_not_spilled_yet_waits_in_progress(
    db: Database, spill: SpillFile
) -> None:
    """The request was still streaming when the round took the file: its turn goes in, and
    its outcome, in a later round, completes it."""
    at = datetime.now(UTC)
    await spill_turn(spill, "r1", "still streaming", None, at=at)
    assert await replayer(spill, db).replay() == {"begun": 1}
    assert (await exchange(db, "r1")).status == "in_progress"
    outcome = spilled_outcome("t1", "alice", "r1", at, reply("done now"), turn=None)
    await spill.add(outcome, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db) == [
        ("user", "still streaming", "complete"),
        ("assistant", "done now", "complete"),
    ]
    assert (await exchange(db, "r1")).status == "complete"


async def test_a_begin_that_landed_after_its_timeout_is_completed_not_repeated(
    db: Database, spill: SpillFile
) -> None:
    memory = ConversationMemory(db)
    turn = await begin(memory, [user("slow")], conversation_id="c1")
    # The request saw a timeout and spilled the same turn under the same request id.
    at = datetime.now(UTC)
    entry = spilled_turn(
        request_id=turn.request_id,
        tenant_id="t1",
        user_id="alice",
        started_at=at,
        mode="full",
        model="gpt-4o-mini",
        conversation_id="c1",
        idempotency_key=None,
        messages=[user("slow")],
        upstream="main",
        stream=False,
    )
    await spill.add(entry, bounded=True)
    outcome = spilled_outcome("t1", "alice", turn.request_id, at, reply("late"), turn=None)
    await spill.add(outcome, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db) == [("user", "slow", "complete"), ("assistant", "late", "complete")]


async def test_a_late_landed_turn_keeps_its_documents_when_its_outcome_comes_a_round_later(
    db: Database, spill: SpillFile
) -> None:
    """The turn's `begin()` landed after its timeout, without its inline document; a round
    ran while the reply still streamed, and the outcome came in the next one: the document is
    stored with the conversation, once."""
    turn = await begin(ConversationMemory(db), [user("read the notes")], conversation_id="c1")
    at = datetime.now(UTC)
    notes = [Inline("The launch code is PURPLE-42.", title="notes")]
    entry = await spill_turn(spill, turn.request_id, "read the notes", None, at=at, documents=notes)
    assert await replayer(spill, db).replay() == {"amended": 1}
    outcome = spilled_outcome("t1", "alice", turn.request_id, at, reply("read"), turn=None)
    await spill.add(outcome, bounded=False)
    await spill.add(entry, bounded=True)  # (a round that repeats itself stores it once)
    await replayer(spill, db).replay()

    def titles(conn: Any) -> list[str | None]:
        conv = Conversations(conn).get("t1", "c1")
        assert conv is not None
        return [a.title for a in Attachments(conn).for_conversation("t1", conv.pk, limit=10)]

    assert await db.read(titles) == ["notes"]
    assert await messages(db) == [
        ("user", "read the notes", "complete"),
        ("assistant", "read", "complete"),
    ]


async def test_an_outcome_whose_finish_failed_completes_even_a_swept_exchange(
    db: Database, spill: SpillFile
) -> None:
    memory = ConversationMemory(db)
    turn = await begin(memory, [user("question")], conversation_id="c1")
    turn.extract = False  # what the live request decided goes along with the outcome
    later = datetime.now(UTC) + timedelta(hours=1)
    swept = await db.write(lambda conn: SystemRepository(conn).sweep_in_progress(later, later))
    assert swept == 1 and (await exchange(db, turn.request_id)).status == "incomplete"
    entry = spilled_outcome("t1", "alice", turn.request_id, later, reply("answer"), turn=turn)
    await spill.add(entry, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db) == [
        ("user", "question", "complete"),
        ("assistant", "answer", "complete"),
    ]
    assert (await exchange(db, turn.request_id)).status == "complete"
    assert await db.read(lambda conn: Jobs(conn).find("t1", user_id="alice", limit=10)) == []


async def test_a_user_erased_after_the_turn_began_gets_nothing_back(
    db: Database, spill: SpillFile
) -> None:
    """Another replica's spill, which the erasure could not scrub."""
    before = datetime.now(UTC) - timedelta(seconds=5)
    await spill_turn(spill, "r1", "forget me", "ok", at=before)
    await db.write(lambda conn: Erasures(conn).record("t1", "alice", datetime.now(UTC)))
    await spill_turn(spill, "r2", "I am back", "welcome", conversation_id="c2")
    assert await replayer(spill, db).replay() == {"erased": 1, "replayed": 1}
    assert await messages(db) == []
    assert await exchange(db, "r1") is None
    assert [m[1] for m in await messages(db, "c2")] == ["I am back", "welcome"]


async def test_a_turn_the_database_would_have_refused_is_recorded_without_its_messages(
    db: Database, spill: SpillFile
) -> None:
    await begin(ConversationMemory(db), [user("bob's")], conversation_id="c1", user_id="bob")
    await spill_turn(spill, "r1", "alice's, into bob's conversation", "answered anyway")
    assert await replayer(spill, db).replay() == {"refused": 1}
    assert [m[1] for m in await messages(db)] == ["bob's"]
    record = await exchange(db, "r1")
    assert (record.status, record.http_status) == ("error", 404)
    assert "not stored" in record.error


async def test_a_mode_off_record_is_inserted_once(db: Database, spill: SpillFile) -> None:
    turn = await begin(ConversationMemory(db), [user("private")], mode="off")
    assert turn.pending is not None
    row = pending_row(turn, reply("ok"))
    for _ in range(2):
        await spill.add(spilled_record(row), bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    await spill.add(spilled_record(row), bounded=False)
    assert await replayer(spill, db).replay() == {"duplicate": 1}
    record = await exchange(db, turn.request_id)
    assert (record.mode, record.status, record.started_at) == ("off", "complete", row["started_at"])


async def test_an_unreachable_database_leaves_the_spill_for_the_next_round(
    db: Database, spill: SpillFile
) -> None:
    await spill_turn(spill, "r1", "first", "one")
    away = Database(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nowhere")
    try:
        assert await replayer(spill, away).replay() == {}  # (it does not even read the file)
    finally:
        await away.dispose()
    assert spill.size() > 0
    await spill_turn(spill, "r2", "second", "two")
    assert await replayer(spill, db).replay() == {"replayed": 2}
    assert [m[1] for m in await messages(db)] == ["first", "one", "second", "two"]
    assert spill.size() == 0


async def test_what_cannot_be_replayed_is_kept_aside_and_the_rest_goes_in(
    db: Database, spill: SpillFile
) -> None:
    entry = spilled_turn(
        request_id="r0",
        tenant_id="gone-tenant",
        user_id="alice",
        started_at=datetime.now(UTC),
        mode="full",
        model="m",
        conversation_id=None,
        idempotency_key=None,
        messages=[user("orphan")],
        upstream="main",
        stream=False,
    )
    await spill.add(entry, bounded=True)
    await spill_turn(spill, "r1", "first", "one")
    assert await replayer(spill, db).replay() == {"failed": 1, "replayed": 1}
    assert b"orphan" in spill.failed.read_bytes()
    assert spill.size() == 0


async def test_replayed_messages_keep_the_dates_they_were_sent_and_answered(
    db: Database, spill: SpillFile
) -> None:
    sent = datetime.now(UTC) - timedelta(days=2)
    await spill_turn(spill, "r1", "two days ago", None, at=sent)
    outcome = spilled_outcome("t1", "alice", "r1", sent, reply("indeed"), turn=None)
    outcome.data["fields"]["finished_at"] = (sent + timedelta(seconds=3)).isoformat()
    await spill.add(outcome, bounded=False)
    await replayer(spill, db).replay()

    def dates(conn: Any) -> list[datetime]:
        conversations = Conversations(conn)
        conv = conversations.get("t1", "c1")
        assert conv is not None
        return [m.created_at for m in conversations.messages("t1", conv.pk)]

    asked, answered = await db.read(dates)
    assert abs((asked - sent).total_seconds()) < 1
    assert abs((answered - sent).total_seconds() - 3) < 1  # when the reply had ended


async def test_a_late_reply_after_later_turns_is_kept_beside_the_answer_already_there(
    db: Database, spill: SpillFile
) -> None:
    """The reply's write failed and was spilled; the client, which resends its history,
    went on with the reply it had got before the replay."""
    memory = ConversationMemory(db)
    first = await begin(memory, [user("u1")])
    later = await begin(memory, [user("u1"), assistant("a1"), user("u2")])
    assert later.conversation_id == first.conversation_id
    at = datetime.now(UTC)
    entry = spilled_outcome("t1", "alice", first.request_id, at, reply("a1"), turn=first)
    await spill.add(entry, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db, first.conversation_id or "") == [
        ("user", "u1", "complete"),
        ("assistant", "a1", "complete"),
        ("user", "u2", "complete"),
        ("assistant", "a1", "superseded"),  # recorded, outside the chain: not twice in it
    ]


async def test_the_retry_of_an_answered_turn_does_not_store_its_reply_again(
    db: Database, spill: SpillFile
) -> None:
    memory = ConversationMemory(db)
    first = await begin(memory, [user("u1")], conversation_id="c1", idempotency_key="k1")
    await memory.finish(first, reply("a1"))
    # The retry's begin() timed out but landed; it was answered and its outcome spilled.
    retry = await begin(memory, [user("u1")], conversation_id="c1", idempotency_key="k1")
    outcome = spilled_outcome(
        "t1", "alice", retry.request_id, datetime.now(UTC), reply("a1 again"), turn=None
    )
    await spill.add(outcome, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db) == [("user", "u1", "complete"), ("assistant", "a1", "complete")]
    assert (await exchange(db, retry.request_id)).status == "complete"


async def test_the_retry_of_an_unanswered_turn_stores_its_reply_from_a_later_round(
    db: Database, spill: SpillFile
) -> None:
    """The retry stores no messages of its own; its turn was replayed in one round (still
    streaming) and its outcome in the next, without the live turn's word on the reply."""
    memory = ConversationMemory(db)
    first = await begin(memory, [user("u1")], conversation_id="c1")
    await memory.finish(first, Outcome("error", 502, error="the upstream failed"))
    at = datetime.now(UTC)
    await spill_turn(spill, "req_retry", "u1", None, at=at)
    assert await replayer(spill, db).replay() == {"begun": 1}
    outcome = spilled_outcome("t1", "alice", "req_retry", at, reply("a1"), turn=None)
    await spill.add(outcome, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db) == [("user", "u1", "complete"), ("assistant", "a1", "complete")]


async def test_a_replayed_retry_answers_its_original_turn_past_a_turn_stored_meanwhile(
    db: Database, spill: SpillFile
) -> None:
    memory = ConversationMemory(db)
    first = await begin(memory, [user("u1")], conversation_id="c1", idempotency_key="k1")
    other = await begin(memory, [user("u2")], conversation_id="c1")
    await memory.finish(other, reply("a2"))
    # The retry was answered while storage was away: its outcome comes from the spill.
    retry = await begin(memory, [user("u1")], conversation_id="c1", idempotency_key="k1")
    outcome = spilled_outcome(
        "t1", "alice", retry.request_id, datetime.now(UTC), reply("a1 again"), turn=retry
    )
    await spill.add(outcome, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    await memory.finish(first, reply("a1"))  # the original's answer comes last
    assert await messages(db) == [
        ("user", "u1", "complete"),
        ("user", "u2", "complete"),
        ("assistant", "a2", "complete"),
        ("assistant", "a1 again", "complete"),
        ("assistant", "a1", "superseded"),  # u1 is answered once in the chain
    ]


async def test_a_replayed_reply_whose_conversation_was_deleted_goes_to_no_one_else(
    db: Database, spill: SpillFile
) -> None:
    memory = ConversationMemory(db)
    turn = await begin(memory, [user("alice's question")], conversation_id="c1")
    assert await db.write(lambda conn: Conversations(conn).delete("t1", "c1"))
    bobs = await begin(memory, [user("bob only")], conversation_id="c1", user_id="bob")
    await memory.finish(bobs, reply("ok"))
    # Alice's finish() failed; her outcome waited in the spill while all this happened.
    entry = spilled_outcome(
        "t1", "alice", turn.request_id, datetime.now(UTC), reply("hers"), turn=turn
    )
    await spill.add(entry, bounded=False)
    assert await replayer(spill, db).replay() == {"replayed": 1}
    assert await messages(db) == [
        ("user", "bob only", "complete"),
        ("assistant", "ok", "complete"),
    ]
    assert (await exchange(db, turn.request_id)).status == "complete"


async def test_a_users_catch_up_replays_their_own_turns_not_everyones(
    spill: SpillFile, db: Database
) -> None:
    """A user whose turns wait in the spill replays them before their next turn: theirs only.
    Before, the catch-up replayed the whole spill, so a turn of another user (another tenant,
    in issue 34) waited, and was degraded, behind one user's flood of spilled requests."""
    for n in range(5):
        await spill_turn(spill, f"a{n}", f"alice {n}", f"to alice {n}", conversation_id=f"a{n}")
    await spill_turn(spill, "b", "bob's turn", "to bob", user_id="bob", conversation_id="b1")
    replaying = replayer(spill, db)
    assert spill.holds("t1", "alice") and spill.holds("t1", "bob")

    assert await replaying.catch_up("t1", "bob")
    assert await messages(db, "b1") == [
        ("user", "bob's turn", "complete"),
        ("assistant", "to bob", "complete"),
    ]
    assert [await messages(db, f"a{n}") for n in range(5)] == [[]] * 5  # still waiting
    assert spill.holds("t1", "alice") and not spill.holds("t1", "bob")

    assert await replaying.replay() == {"replayed": 5}  # the next round takes the rest
    assert await messages(db, "a4") == [
        ("user", "alice 4", "complete"),
        ("assistant", "to alice 4", "complete"),
    ]
    assert spill.empty()
