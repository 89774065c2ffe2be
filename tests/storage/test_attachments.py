"""Attachments and their chunks on SQLite and PostgreSQL: stored in order, searched within the
given attachments and tenant only, and gone (index entries included) with their attachment,
conversation or user."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy import Connection, func, select, text

from storage.database import Database
from storage.errors import ConflictError
from storage.models import ATTACHMENT_CHUNKS
from storage.records import AttachmentRecord
from storage.repositories.attachments import Attachments, ChunkHit, new_attachment_id
from storage.repositories.conversations import Conversations
from storage.repositories.summaries import Summaries
from tests.storage.test_repositories import T0, at, new_conversation

HARBOUR = [
    ("The harbour opens at dawn; fishing boats leave before the ferries.", 14),
    ("Ferry tickets are sold at the kiosk beside the lighthouse.", 12),
    ("The lighthouse keeper lives alone with two cats.", 10),
]
RECIPES = [
    ("Bake the bread at two hundred degrees for forty minutes.", 12),
    ("The sourdough starter needs feeding every morning.", 9),
]


async def attach(
    db: Database,
    conversation_id: str,
    chunks: Sequence[tuple[str, int]],
    *,
    tenant: str = "t1",
    user: str = "alice",
    attachment_id: str | None = None,
    when: int = 0,
    **extra: object,
) -> AttachmentRecord:
    def work(conn: Connection) -> AttachmentRecord:
        conversation = Conversations(conn).get(tenant, conversation_id)
        assert conversation is not None
        return Attachments(conn).create(
            tenant,
            user,
            conversation.pk,
            attachment_id or new_attachment_id(),
            content="\n\n".join(c for c, _ in chunks),
            chunks=chunks,
            now=at(when),
            **extra,  # type: ignore[arg-type]
        )

    return await db.write(work)


async def search(
    db: Database, pks: Sequence[int], terms: list[str], *, tenant: str = "t1", limit: int = 10
) -> list[ChunkHit]:
    return await db.read(lambda c: Attachments(c).search(tenant, pks, terms, limit=limit))


async def chunk_texts(db: Database, hits: Sequence[ChunkHit], tenant: str = "t1") -> list[str]:
    chunks = await db.read(
        lambda c: Attachments(c).chunks(tenant, sorted({h.attachment_pk for h in hits}))
    )
    by_pk = {c.pk: c.text for c in chunks}
    return [by_pk[h.pk] for h in hits]


async def indexed_rows(db: Database) -> int:
    """Chunks the SQLite index still knows (PostgreSQL indexes the table itself)."""

    def work(conn: Connection) -> int:
        if conn.dialect.name == "postgresql":
            return int(
                conn.execute(select(func.count()).select_from(ATTACHMENT_CHUNKS)).scalar_one()
            )
        query = "SELECT count(*) FROM attachment_chunks_fts WHERE attachment_chunks_fts MATCH :q"
        return int(conn.execute(text(query), {"q": 'text : "the"'}).scalar() or 0)

    return await db.read(work)


async def test_create_get_list_and_chunks_in_order(db: Database) -> None:
    conversation = await new_conversation(db, "c1")
    first = await attach(
        db, "c1", HARBOUR, title="Harbour guide", source="guide.md", media_type="text/markdown"
    )
    second = await attach(db, "c1", RECIPES, when=5, size_bytes=999, tokens=40)
    await new_conversation(db, "c2")
    await attach(db, "c2", RECIPES)

    assert first.id.startswith("att_") and len(first.id) == 28
    assert (first.title, first.source, first.media_type, first.origin) == (
        "Harbour guide",
        "guide.md",
        "text/markdown",
        "upload",
    )
    assert first.content == "\n\n".join(c for c, _ in HARBOUR)
    assert first.content_hash == hashlib.sha256(first.content.encode()).hexdigest()
    assert (first.tokens, first.size_bytes) == (36, len(first.content.encode()))
    assert (second.tokens, second.size_bytes) == (40, 999)
    assert (first.conversation_pk, first.created_at) == (conversation.pk, T0)

    assert await db.read(lambda c: Attachments(c).get("t1", first.id)) == first
    assert await db.read(lambda c: Attachments(c).get("t2", first.id)) is None

    listed = await db.read(
        lambda c: Attachments(c).for_conversation("t1", conversation.pk, limit=10)
    )
    assert [a.id for a in listed] == [first.id, second.id]  # oldest first
    paged = await db.read(
        lambda c: Attachments(c).for_conversation("t1", conversation.pk, limit=1, after_pk=first.pk)
    )
    assert [a.id for a in paged] == [second.id]
    bare = await db.read(
        lambda c: Attachments(c).for_conversation(
            "t1", conversation.pk, limit=1, with_content=False
        )
    )
    assert bare[0].content == "" and bare[0].content_hash == first.content_hash
    assert (
        await db.read(lambda c: Attachments(c).for_conversation("t2", conversation.pk, limit=9))
        == []
    )

    chunks = await db.read(lambda c: Attachments(c).chunks("t1", [second.pk, first.pk]))
    assert [(c.attachment_pk, c.seq, c.text, c.tokens) for c in chunks] == [
        *((first.pk, i, t, n) for i, (t, n) in enumerate(HARBOUR, start=1)),
        *((second.pk, i, t, n) for i, (t, n) in enumerate(RECIPES, start=1)),
    ]
    assert await db.read(lambda c: Attachments(c).chunks("t2", [first.pk])) == []
    counts = await db.read(lambda c: Attachments(c).chunk_counts("t1", [first.pk, second.pk]))
    assert counts == {first.pk: 3, second.pk: 2}


async def test_an_id_is_unique_per_tenant(db: Database) -> None:
    await new_conversation(db, "c1")
    await new_conversation(db, "c1", tenant="t2")
    await attach(db, "c1", HARBOUR, attachment_id="att_same")
    with pytest.raises(ConflictError):
        await attach(db, "c1", HARBOUR, attachment_id="att_same")
    await attach(db, "c1", HARBOUR, attachment_id="att_same", tenant="t2")


async def test_search_finds_the_right_chunk_first(db: Database) -> None:
    await new_conversation(db, "c1")
    harbour = await attach(db, "c1", HARBOUR)
    recipes = await attach(db, "c1", RECIPES)
    pks = [harbour.pk, recipes.pk]

    hits = await search(db, pks, ["ferry", "tickets", "kiosk"])
    assert await chunk_texts(db, hits[:1]) == [HARBOUR[1][0]]
    assert (hits[0].attachment_pk, hits[0].seq) == (harbour.pk, 2)
    assert all(a.score >= b.score for a, b in pairwise(hits))
    # stemmed: "baking" finds "Bake"; words in no chunk find nothing
    assert await chunk_texts(db, await search(db, pks, ["baking"])) == [RECIPES[0][0]]
    assert await search(db, pks, ["zebra"]) == []
    assert await search(db, pks, ["bread-and", ""]) == []  # not plain terms: ignored
    assert await search(db, [], ["bread"]) == []
    assert len(await search(db, pks, ["the"], limit=2)) <= 2


async def test_search_is_confined_to_the_given_attachments_and_tenant(db: Database) -> None:
    await new_conversation(db, "c1")
    await new_conversation(db, "c1", tenant="t2")
    mine = await attach(db, "c1", HARBOUR)
    other = await attach(db, "c1", [("The lighthouse in tenant two.", 6)], tenant="t2")
    also_mine = await attach(db, "c1", [("A lighthouse postcard.", 4)])

    found = await chunk_texts(db, await search(db, [mine.pk], ["lighthouse"]))
    assert sorted(found) == sorted([HARBOUR[1][0], HARBOUR[2][0]])
    # another tenant's attachment is not found even when its pk is named
    assert await search(db, [other.pk], ["lighthouse"]) == []
    both = await search(db, [mine.pk, other.pk, also_mine.pk], ["lighthouse"])
    assert {h.attachment_pk for h in both} == {mine.pk, also_mine.pk}
    theirs = await search(db, [other.pk, mine.pk], ["lighthouse"], tenant="t2")
    assert [h.attachment_pk for h in theirs] == [other.pk]


async def test_delete_removes_the_chunks_and_their_index_entries(db: Database) -> None:
    await new_conversation(db, "c1")
    gone = await attach(db, "c1", HARBOUR)
    kept = await attach(db, "c1", RECIPES)
    before = await indexed_rows(db)

    assert not await db.write(lambda c: Attachments(c).delete("t2", gone.id))  # other tenant
    assert await db.write(lambda c: Attachments(c).delete("t1", gone.id))
    assert not await db.write(lambda c: Attachments(c).delete("t1", gone.id))
    assert await db.read(lambda c: Attachments(c).get("t1", gone.id)) is None
    assert await db.read(lambda c: Attachments(c).chunks("t1", [gone.pk])) == []
    assert await search(db, [gone.pk, kept.pk], ["lighthouse"]) == []
    assert len(await search(db, [kept.pk], ["sourdough"])) == 1
    assert await indexed_rows(db) < before


async def test_erasing_a_user_or_deleting_a_conversation_takes_the_attachments(
    db: Database,
) -> None:
    await new_conversation(db, "alice-1")
    await new_conversation(db, "alice-2")
    await new_conversation(db, "bob-1", user="bob")
    await new_conversation(db, "alice-1", tenant="t2")
    a1 = await attach(db, "alice-1", HARBOUR)
    a2 = await attach(db, "alice-2", HARBOUR)
    b1 = await attach(db, "bob-1", HARBOUR, user="bob")
    t2 = await attach(db, "alice-1", HARBOUR, tenant="t2")

    assert await db.write(lambda c: Conversations(c).delete("t1", "alice-1"))
    assert await db.read(lambda c: Attachments(c).get("t1", a1.id)) is None
    assert await search(db, [a1.pk], ["lighthouse"]) == []
    assert len(await search(db, [a2.pk], ["lighthouse"])) == 2

    assert await db.write(lambda c: Attachments(c).delete_user("t1", "alice")) == 1
    assert await search(db, [a2.pk], ["lighthouse"]) == []
    assert await db.read(lambda c: Attachments(c).chunks("t1", [a1.pk, a2.pk])) == []
    # bob, and alice in another tenant, keep theirs
    assert len(await search(db, [b1.pk], ["lighthouse"])) == 2
    assert len(await search(db, [t2.pk], ["lighthouse"], tenant="t2")) == 2

    await db.write(lambda c: Conversations(c).delete_user("t1", "bob"))
    assert await db.read(lambda c: Attachments(c).get("t1", b1.id)) is None
    assert await search(db, [b1.pk], ["lighthouse"]) == []
    assert await indexed_rows(db) == len(HARBOUR)  # tenant two's only


async def test_the_newest_some_chunks_and_content_hashes(db: Database) -> None:
    conversation = await new_conversation(db, "c1")
    first = await attach(db, "c1", HARBOUR)
    second = await attach(db, "c1", RECIPES)
    newest = await db.read(
        lambda c: Attachments(c).for_conversation("t1", conversation.pk, limit=1, newest=True)
    )
    assert [a.id for a in newest] == [second.id]
    assert await db.read(lambda c: Attachments(c).content_hashes("t1", conversation.pk)) == {
        first.content_hash,
        second.content_hash,
    }
    assert await db.read(lambda c: Attachments(c).content_hashes("t2", conversation.pk)) == set()
    everything = await db.read(lambda c: Attachments(c).chunks("t1", [first.pk, second.pk]))
    third_of_first = next(c for c in everything if c.attachment_pk == first.pk and c.seq == 3)

    def some(tenant: str) -> Any:
        return lambda c: Attachments(c).some_chunks(
            tenant, whole=[second.pk], openings=[first.pk], opening=1, chunk_pks=[third_of_first.pk]
        )

    picked = await db.read(some("t1"))
    assert [(c.attachment_pk, c.seq) for c in picked] == [
        (first.pk, 1),
        (first.pk, 3),
        (second.pk, 1),
        (second.pk, 2),
    ]
    assert await db.read(some("t2")) == []


async def test_a_conversation_named_like_another_users_attachment_keeps_apart_from_it(
    db: Database,
) -> None:
    """Summaries are deleted with their subject (a conversation's id or an attachment's) and
    only the deleting owner's: a client may name a conversation like another's attachment."""
    await new_conversation(db, "c1")
    doc = await attach(db, "c1", HARBOUR)
    await new_conversation(db, doc.id, user="bob")  # conversation ids are the client's choice

    def summarise(conn: Connection, key: str, user: str) -> None:
        Summaries(conn).put(
            "t1",
            key,
            kind="attachment",
            user_id=user,
            subject=doc.id,
            model="m",
            text="a summary",
            tokens=3,
            now=T0,
        )

    await db.write(lambda c: summarise(c, "alice's", "alice"))
    await db.write(lambda c: summarise(c, "bob's", "bob"))
    assert await db.write(lambda c: Attachments(c).delete("t1", doc.id))
    assert await db.read(lambda c: Summaries(c).get("t1", "alice's")) is None
    assert await db.read(lambda c: Summaries(c).get("t1", "bob's")) is not None
    await db.write(lambda c: summarise(c, "alice's", "alice"))
    assert await db.write(lambda c: Conversations(c).delete("t1", doc.id))
    assert await db.read(lambda c: Summaries(c).get("t1", "bob's")) is None
    assert await db.read(lambda c: Summaries(c).get("t1", "alice's")) is not None


async def test_a_conversation_holds_artifacts_with_an_attachment_or_a_recent_tool_result(
    db: Database,
) -> None:
    plain = await new_conversation(db, "plain", [{"role": "user", "content": "hi"}])
    documented = await new_conversation(db, "documented")
    await attach(db, "documented", RECIPES)
    tooled = await new_conversation(
        db,
        "tooled",
        [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"}],
    )
    elsewhere = await new_conversation(db, "elsewhere", tenant="t2")
    await attach(db, "elsewhere", RECIPES, tenant="t2")

    async def read(conversation_pk: int, tools_after: int = -1, tenant: str = "t1") -> bool:
        return await db.read(
            lambda c: Conversations(c).holds_artifacts(
                tenant, conversation_pk, tools_after=tools_after
            )
        )

    assert not await read(plain.pk)
    assert await read(documented.pk)
    assert await read(tooled.pk)
    assert not await read(tooled.pk, tooled.next_seq - 1)  # (the tool result is older)
    assert not await read(elsewhere.pk)  # another tenant's conversation: nothing of it
    assert await read(elsewhere.pk, -1, "t2")
