"""memproxy's own store of Responses API responses, on both databases: scoped by tenant and
user, `store: false` ones never found by id, chains followed in one query (a broken or too
long chain is an error, never part of a chain), input items paged, and deletes by user,
conversation and age."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection

from storage.database import Database
from storage.errors import BrokenChain, ConflictError, UnknownCursor
from storage.records import ItemPage, ResponseRecord
from storage.repositories.responses import Responses

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def response(
    response_id: str,
    *,
    tenant: str = "t1",
    user: str = "alice",
    previous: str | None = None,
    store: bool = True,
    conversation: str | None = "conv_1",
    items: int = 1,
    when: datetime = T0,
) -> ResponseRecord:
    return ResponseRecord(
        tenant_id=tenant,
        id=response_id,
        user_id=user,
        conversation_id=conversation,
        request_id=f"req_{response_id}",
        model="gpt-4o-mini",
        previous_response_id=previous,
        store=store,
        status="completed",
        response={"id": response_id, "object": "response", "output": [{"type": "message"}]},
        input_items=[
            {"id": f"msg_{response_id}_{i}", "type": "message", "role": "user", "content": []}
            for i in range(items)
        ],
        created_at=when,
    )


async def save(db: Database, *records: ResponseRecord) -> None:
    def work(conn: Connection) -> None:
        for record in records:
            Responses(conn).save(record)

    await db.write(work)


async def test_a_saved_response_reads_back_whole_and_only_for_its_tenant_and_user(
    db: Database,
) -> None:
    saved = response("resp_a", items=2)
    await save(db, saved, response("resp_a", tenant="t2", user="bob"))

    def read(conn: Connection) -> dict[str, Any]:
        responses = Responses(conn)
        return {
            "tenant": responses.get("t1", "resp_a"),
            "user": responses.get("t1", "resp_a", "alice"),
            "other user": responses.get("t1", "resp_a", "bob"),
            "other tenant's": responses.get("t2", "resp_a", "alice"),
            "unknown": responses.get("t1", "resp_b"),
        }

    found = await db.read(read)
    assert found["tenant"] == saved and found["user"] == saved
    assert found["other user"] is None and found["other tenant's"] is None
    assert found["unknown"] is None
    with pytest.raises(ConflictError):
        await save(db, response("resp_a"))


async def test_a_response_stored_with_store_false_is_never_found_by_id(db: Database) -> None:
    await save(db, response("resp_hidden", store=False), response("resp_next", previous=None))

    def read(conn: Connection) -> tuple[Any, ...]:
        responses = Responses(conn)
        return (
            responses.get("t1", "resp_hidden"),
            responses.chain("t1", "resp_hidden"),
            responses.input_items("t1", "resp_hidden"),
            responses.delete("t1", "resp_hidden"),
            [r.id for r in responses.for_user("t1", "alice", limit=10)],  # (export: all)
        )

    assert await db.read(read) == (None, None, None, False, ["resp_hidden", "resp_next"])


async def test_a_chain_runs_from_its_first_response_to_the_one_asked_for(db: Database) -> None:
    await save(
        db,
        response("resp_1"),
        response("resp_2", previous="resp_1", when=T0 + timedelta(seconds=1)),
        response("resp_3", previous="resp_2", when=T0 + timedelta(seconds=2)),
        response("resp_x", previous="resp_1", when=T0 + timedelta(seconds=3)),  # a fork
    )

    def read(conn: Connection) -> dict[str, Any]:
        responses = Responses(conn)

        def ids(response_id: str, user: str | None = None, **kw: Any) -> list[str] | None:
            found = responses.chain("t1", response_id, user, **kw)
            return None if found is None else [r.id for r in found]

        return {
            "3": ids("resp_3"),
            "fork": ids("resp_x", "alice"),
            "first": ids("resp_1"),
            "exactly as deep as allowed": ids("resp_3", max_depth=3),
            "other user": ids("resp_3", "bob"),
            "other tenant": responses.chain("t2", "resp_3"),
        }

    assert await db.read(read) == {
        "3": ["resp_1", "resp_2", "resp_3"],
        "fork": ["resp_1", "resp_x"],
        "first": ["resp_1"],
        "exactly as deep as allowed": ["resp_1", "resp_2", "resp_3"],
        "other user": None,
        "other tenant": None,
    }


@pytest.mark.parametrize(
    ("gap", "missing"),
    [
        ("deleted", "resp_1"),
        ("store false", "resp_1"),
        ("another user's", "resp_1"),
        ("too long", None),
    ],
)
async def test_a_chain_that_cannot_be_followed_whole_is_an_error_naming_the_gap(
    db: Database, gap: str, missing: str | None
) -> None:
    first = response(
        "resp_1", store=gap != "store false", user="bob" if gap == "another user's" else "alice"
    )
    await save(
        db,
        first,
        response("resp_2", previous="resp_1"),
        response("resp_3", previous="resp_2"),
    )
    if gap == "deleted":
        assert await db.write(lambda conn: Responses(conn).delete("t1", "resp_1"))

    def read(conn: Connection) -> Any:
        return Responses(conn).chain(
            "t1", "resp_3", "alice", max_depth=2 if gap == "too long" else 10
        )

    with pytest.raises(BrokenChain) as info:
        await db.read(read)
    assert info.value.missing == missing


async def test_input_items_page_in_either_order_after_a_cursor(db: Database) -> None:
    await save(db, response("resp_a", items=5))

    def page(**kw: Any) -> Any:
        def read(conn: Connection) -> Any:
            return Responses(conn).input_items("t1", "resp_a", **kw)

        return db.read(read)

    def ids(found: ItemPage) -> list[int]:
        return [int(item["id"].rsplit("_", 1)[1]) for item in found.items]

    first = await page(limit=2)
    assert (ids(first), first.has_more) == ([4, 3], True)  # desc: the last first
    after = first.items[-1]["id"]
    second = await page(limit=2, after=after)
    assert (ids(second), second.has_more) == ([2, 1], True)
    last = await page(limit=2, after=second.items[-1]["id"])
    assert (ids(last), last.has_more) == ([0], False)
    ascending = await page(limit=5, order="asc")
    assert (ids(ascending), ascending.has_more) == ([0, 1, 2, 3, 4], False)
    assert ids(await page(order="asc", after="msg_resp_a_3")) == [4]
    assert await page(user_id="bob") is None
    with pytest.raises(UnknownCursor):
        await page(after="msg_elsewhere")


async def test_delete_takes_only_the_tenants_and_named_users_response(db: Database) -> None:
    await save(db, response("resp_a"), response("resp_a", tenant="t2"))

    def work(conn: Connection) -> list[bool]:
        responses = Responses(conn)
        return [
            responses.delete("t1", "resp_a", "bob"),  # another user's
            responses.delete("t1", "resp_a", "alice"),
            responses.delete("t1", "resp_a"),  # gone already
            responses.get("t2", "resp_a") is not None,
        ]

    assert await db.write(work) == [False, True, False, True]


async def test_responses_go_with_their_user_their_conversation_and_their_age(
    db: Database,
) -> None:
    await save(
        db,
        response("resp_alice", when=T0),
        response("resp_alice_other_conversation", conversation="conv_2", when=T0),
        response("resp_bob", user="bob", conversation="conv_3", when=T0),
        response("resp_bob_new", user="bob", conversation="conv_3", when=T0 + timedelta(days=9)),
        response("resp_t2", tenant="t2", user="alice", when=T0),
    )

    def work(conn: Connection) -> dict[str, Any]:
        responses = Responses(conn)
        done = {
            "conversation": responses.delete_conversation("t1", "conv_2"),
            "user": responses.delete_user("t1", "alice"),
            "old": responses.delete_before("t1", T0 + timedelta(days=1), limit=10),
        }
        return {
            **done,
            "left": [r.id for r in responses.for_user("t1", "bob", limit=10)],
            "t2": [r.id for r in responses.for_user("t2", "alice", limit=10)],
        }

    assert await db.write(work) == {
        "conversation": 1,
        "user": 1,
        "old": 1,
        "left": ["resp_bob_new"],
        "t2": ["resp_t2"],
    }


async def test_a_users_responses_are_listed_a_page_at_a_time_for_export(db: Database) -> None:
    await save(
        db,
        *(response(f"resp_{i}", when=T0 + timedelta(seconds=i // 2)) for i in range(5)),
        response("resp_bob", user="bob"),
    )

    def read(conn: Connection) -> list[list[str]]:
        responses, pages, last = Responses(conn), [], None
        while found := responses.for_user("t1", "alice", limit=2, after=last):
            pages.append([r.id for r in found])
            last = found[-1]
        return pages

    assert await db.read(read) == [["resp_0", "resp_1"], ["resp_2", "resp_3"], ["resp_4"]]
