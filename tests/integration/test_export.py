"""`GET /v1/memory/users/{id}/export` through the real server: everything stored for the user
(conversations with messages and attachments, memories, exchange records, stored Responses API
responses, jobs), nothing of other users or tenants, management scope only, and nothing left
after the user is erased."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import openai
import pytest
from sqlalchemy import Connection, inspect, text

from proxy.app import create_app
from proxy.core.config import Config, ServerConfig, UpstreamConfig
from proxy.protocols.responses.stored import stored_response_object
from storage.database import Database
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.jobs import Jobs
from storage.repositories.responses import Responses
from storage.repositories.summaries import Summaries
from storage.repositories.vectors import MessageVectors, NewVector
from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread
from tests.polling import eventually
from tests.postgres import start_server
from tests.storage.test_responses import response as stored_response


@pytest.fixture
async def api(proxy_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=proxy_url, headers={"authorization": f"Bearer {KEY}"}
    ) as client:
        yield client


async def chat(proxy_url: str, user: str, text: str) -> str:
    async with openai.AsyncOpenAI(base_url=proxy_url, api_key=KEY, max_retries=0) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": text}],
            extra_headers={"X-Memory-User-Id": user},
        )
    return raw.headers["x-request-id"]


async def export(api: httpx.AsyncClient, user: str, key: str = KEY) -> httpx.Response:
    return await api.get(
        f"/memory/users/{quote(user, safe='')}/export", headers={"authorization": f"Bearer {key}"}
    )


def said(document: dict[str, Any]) -> list[str]:
    """What the user of an export said."""
    return [
        m["content"]
        for c in document["conversations"]
        for m in c["messages"]
        if m["role"] == "user"
    ]


async def test_export_holds_everything_of_the_user_and_nothing_else(
    proxy_url: str, api: httpx.AsyncClient
) -> None:
    request_id = await chat(proxy_url, "alice", "my favourite colour is teal")
    await chat(proxy_url, "bob", "my favourite colour is red")
    created = await api.post(
        "/memory/conversations",
        json={"id": "trip", "user": "alice", "messages": [{"role": "user", "content": "Oslo?"}]},
    )
    assert created.status_code == 201
    uploaded = await api.post(
        "/memory/conversations/trip/attachments", json={"content": "Packing list: boots."}
    )
    assert uploaded.status_code == 201
    memory = await api.post("/memory/memories", json={"user": "alice", "text": "likes teal"})
    assert memory.status_code == 201

    response = await export(api, "alice")
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    assert (data["object"], data["user"]) == ("memory.user.export", "alice")
    texts = [m["content"] for c in data["conversations"] for m in c["messages"]]
    assert "my favourite colour is teal" in texts and "Oslo?" in texts
    assert not any("red" in str(t) for t in texts)
    (trip,) = [c for c in data["conversations"] if c["id"] == "trip"]
    assert [a["content"] for a in trip["attachments"]] == ["Packing list: boots."]
    assert [m["text"] for m in data["memories"]] == ["likes teal"]
    assert [x["id"] for x in data["exchanges"]] == [request_id]
    assert [t["id"] for t in data["traces"]] == [request_id]  # (what the model saw, too)
    assert "bob" not in str(data)

    # Another tenant sees nothing of it; a chat-only key may not export.
    other = (await export(api, "alice", OTHER_TENANT_KEY)).json()
    assert other["conversations"] == other["memories"] == other["exchanges"] == []
    assert (await export(api, "alice", CHAT_ONLY_KEY)).status_code == 403

    # Erased: nothing to export.
    assert (await api.delete("/memory/users/alice")).status_code == 200
    after = (await export(api, "alice")).json()
    assert after["conversations"] == after["memories"] == after["exchanges"] == []
    assert after["traces"] == []
    assert after["summaries"] == after["jobs"] == [] and after["vectors"] == 0


async def test_a_bad_user_id_is_a_400(api: httpx.AsyncClient) -> None:
    response = await export(api, "x" * 300)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "user_id"


async def test_any_user_id_can_be_exported_and_erased_percent_encoded(
    proxy_url: str, api: httpx.AsyncClient
) -> None:
    # OpenAI's `user` is any string: "/" and "%" in it must not split it or change it.
    users = {"team": "red", "team/alice": "teal", "team/export": "ochre", "50%2Fx": "jade"}
    for user, colour in users.items():
        await chat(proxy_url, user, f"my favourite colour is {colour}")
    for user, colour in users.items():
        document = (await export(api, user)).json()
        assert (document["user"], said(document)) == (user, [f"my favourite colour is {colour}"])
    # (GET on the erasure's path is not the export of a shorter id)
    assert (await api.get("/memory/users/team%2Fexport")).status_code == 405

    erased = await api.delete("/memory/users/team%2Falice")
    assert erased.status_code == 200, erased.text
    assert (erased.json()["user"], erased.json()["deleted"]["conversations"]) == ("team/alice", 1)
    assert said((await export(api, "team/alice")).json()) == []
    assert said((await export(api, "team")).json()) == ["my favourite colour is red"]
    assert (await api.delete("/memory/users/50%252Fx")).json()["user"] == "50%2Fx"
    assert said((await export(api, "team/export")).json()) == ["my favourite colour is ochre"]


# A page of two rows (attachments too): every section of the users below spans several pages.
PAGE = 2
SMALL_BUFFER = 16 * 1024
HOUR = timedelta(hours=1)


def paged_config(upstream_url: str, database_url: str) -> Config:
    config = make_config(
        UpstreamConfig(kind="openai", base_url=upstream_url, api_key="k"), database_url=database_url
    )
    return config.model_copy(update={"server": ServerConfig(export_page_rows=PAGE)})


def small_buffered_listener() -> socket.socket:
    """A listening socket whose connections have small send buffers: a server writing to a
    client that does not read is held up after a few kilobytes, not megabytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture
def paged_proxy(
    fake_upstream: tuple[FakeOpenAI, str], database_url: str
) -> Iterator[tuple[str, str]]:
    """memproxy on each database, exporting two rows a page: (base URL, database URL)."""
    _, upstream_url = fake_upstream
    app = create_app(paged_config(upstream_url, database_url))
    with ServerThread(app, sock=small_buffered_listener()) as server:
        yield server.url + "/v1", database_url


@pytest.fixture
async def paged_api(paged_proxy: tuple[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    base, _ = paged_proxy
    async with httpx.AsyncClient(
        base_url=base, headers={"authorization": f"Bearer {KEY}"}
    ) as client:
        yield client


async def seed_everything(base: str, database_url: str, api: httpx.AsyncClient) -> dict[str, Any]:
    """Alice with three or more rows in every section of the export (bob with some too); what
    the export should show of what the management API cannot list (summaries, vectors)."""
    request_ids = [await chat(base, "alice", f"turn {n}") for n in range(3)]
    await chat(base, "bob", "bob's turn")
    imported = [{"role": "user", "content": f"line {n}"} for n in range(5)]
    created = await api.post(
        "/memory/conversations", json={"id": "trip", "user": "alice", "messages": imported}
    )
    assert created.status_code == 201, created.text
    for n in range(3):
        document = {"content": f"Packing list {n}: boots.", "title": f"list {n}"}
        uploaded = await api.post("/memory/conversations/trip/attachments", json=document)
        assert uploaded.status_code == 201, uploaded.text
    memories = [("alice", "likes teal"), ("alice", "lives in Oslo"), ("alice", "has a cat")]
    for user, memory in [*memories, ("bob", "likes red")]:
        assert (await api.post("/memory/memories", json={"user": user, "text": memory})).is_success

    summaries = [
        {"kind": "conversation", "subject": "trip", "model": "m", "text": f"they talked {n}"}
        for n in range(3)
    ]
    later = datetime.now(UTC) + timedelta(days=1)  # (queued, not due: the jobs stay as they are)
    responses = [
        stored_response(f"resp_{user}_{n}", user=user, items=2, conversation="trip")
        for user, n in [("alice", 0), ("alice", 1), ("alice", 2), ("bob", 0)]
    ]

    def work(conn: Connection) -> int:
        at = datetime.fromtimestamp(int(datetime.now(UTC).timestamp()), UTC)
        for n, summary in enumerate(summaries):
            Summaries(conn).put("t1", f"key {n}", user_id="alice", tokens=3, now=at, **summary)
            summary.update(tokens=3, created_at=int(at.timestamp()))
        for n in range(3):
            Jobs(conn).enqueue("t1", "alice", "memory.extract", f"ref {n}", now=later)
        Jobs(conn).enqueue("t1", "bob", "memory.extract", "bob's", now=later)
        for n, record in enumerate(responses):
            Responses(conn).save(
                replace(record, created_at=at + timedelta(seconds=n))
                if record.user_id == "alice"
                else record
            )
        trip = Conversations(conn).get("t1", "trip")
        assert trip is not None
        messages = Conversations(conn).messages("t1", trip.pk)
        vectors = [NewVector(m.pk, b"\x00" * 8, 2) for m in messages]
        return MessageVectors(conn).store("t1", "alice", "model", vectors, now=at)

    db = Database(database_url)
    try:
        vectors = await db.write(work)
    finally:
        await db.dispose()
    return {
        "request_ids": request_ids,
        "summaries": summaries,
        "vectors": vectors,
        "responses": [stored_response_object(r) for r in responses if r.user_id == "alice"],
    }


async def listed(api: httpx.AsyncClient, path: str, **params: str) -> list[dict[str, Any]]:
    response = await api.get(path, params={"limit": "100", **params})
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def as_the_api_shows_it(
    api: httpx.AsyncClient, user: str, request_ids: list[str]
) -> dict[str, Any]:
    """The export's sections as the rest of the management API shows them."""
    conversations = []
    for c in await listed(api, "/memory/conversations", user=user):
        path = f"/memory/conversations/{c['id']}"
        attachments = [
            (await api.get(f"{path}/attachments/{a['id']}")).json()
            for a in await listed(api, f"{path}/attachments")
        ]
        messages = await listed(api, f"{path}/messages")
        conversations.append({**c, "messages": messages, "attachments": attachments})
    return {
        "conversations": conversations,
        "memories": await listed(api, "/memory/memories", user=user),
        "exchanges": [(await api.get(f"/memory/exchanges/{r}")).json() for r in request_ids],
        "jobs": await listed(api, "/memory/jobs", user=user),
    }


async def test_the_export_streams_the_same_document_page_by_page(
    paged_proxy: tuple[str, str], paged_api: httpx.AsyncClient
) -> None:
    base, database_url = paged_proxy
    seeds = await seed_everything(base, database_url, paged_api)
    response = await export(paged_api, "alice")
    expected = await as_the_api_shows_it(paged_api, "alice", seeds["request_ids"])

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert "content-length" not in response.headers  # sent as it is read
    data: dict[str, Any] = response.json()
    # The document as one msgspec encoding of it: same field order, same compact form.
    assert response.content == msgspec.json.encode(data)
    assert list(data) == [
        "object",
        "user",
        "exported_at",
        "conversations",
        "memories",
        "exchanges",
        "traces",
        "responses",
        "summaries",
        "jobs",
        "vectors",
    ]
    assert (data["object"], data["user"]) == ("memory.user.export", "alice")
    for section in ("conversations", "memories", "exchanges", "jobs"):
        assert data[section] == expected[section], section
        assert len(data[section]) > PAGE
    (trip,) = [c for c in data["conversations"] if c["id"] == "trip"]
    assert len(trip["messages"]) == 5 and len(trip["attachments"]) == 3
    assert [a["content"] for a in trip["attachments"]] == [
        f"Packing list {n}: boots." for n in range(3)
    ]
    assert data["summaries"] == seeds["summaries"]
    # Oldest first, each whole: the response as its client got it and its input items.
    assert [r["id"] for r in data["responses"]] == ["resp_alice_0", "resp_alice_1", "resp_alice_2"]
    assert [r["input_items"] for r in data["responses"]] == [
        r["input_items"] for r in seeds["responses"]
    ]
    assert all(r["object"] == "memory.response" and r["response"] for r in data["responses"])
    assert data["vectors"] == seeds["vectors"] == 5
    assert "bob" not in str(data)


def rows_naming(conn: Connection, user: str) -> list[str]:
    """Every table and column whose stored value holds `user` anywhere in it (as text, in a
    JSON document or in the bytes of a blob), on whichever database this is."""
    found = []
    for table in inspect(conn).get_table_names():
        result = conn.execute(text(f'SELECT * FROM "{table}"'))
        for row in result:
            for column, value in zip(result.keys(), row, strict=True):
                shown = value if isinstance(value, bytes) else json.dumps(value, default=str)
                if (user.encode() if isinstance(shown, bytes) else user) in shown:
                    found.append(f"{table}.{column}")
    return found


async def test_after_an_erasure_no_row_anywhere_holds_the_user_id(
    paged_proxy: tuple[str, str], paged_api: httpx.AsyncClient
) -> None:
    base, database_url = paged_proxy
    await seed_everything(base, database_url, paged_api)
    assert (await paged_api.delete("/memory/users/alice")).status_code == 200

    db = Database(database_url)
    try:
        alice = await db.read(lambda conn: rows_naming(conn, "alice"))
        bob = await db.read(lambda conn: rows_naming(conn, "bob"))
        # The erasure is still known (a replayed turn of alice's is dropped), by its hash.
        erased = await db.read(
            lambda conn: Erasures(conn).erased_since("t1", "alice", datetime.now(UTC) - HOUR)
        )
    finally:
        await db.dispose()
    assert alice == []
    assert "exchanges.user_id" in bob and "memories.user_id" in bob  # (the scan finds ids)
    assert erased


async def test_after_an_erasure_no_sqlite_file_holds_the_users_words(
    proxy_url: str, api: httpx.AsyncClient, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    """Below the rows: deleted content is overwritten, not left in free space, the full-text
    indexes (messages' and documents') are rewritten without it, and the write-ahead log is
    emptied."""
    secret, kept = "zanzibarquux", "kumquatelle"
    await chat(proxy_url, "alice", f"my passphrase is {secret}")
    imported = [{"role": "user", "content": f"{secret} again, line {n}"} for n in range(3)]
    created = await api.post(
        "/memory/conversations", json={"id": "trip", "user": "alice", "messages": imported}
    )
    assert created.status_code == 201, created.text
    document = {"content": f"Notes: the word is {secret}.", "title": "notes"}
    uploaded = await api.post("/memory/conversations/trip/attachments", json=document)
    assert uploaded.status_code == 201, uploaded.text  # (a document's index is its own)
    for n in range(12):  # (the index merges its segments as they accumulate)
        await chat(proxy_url, "bob", f"{kept} number {n}")
    files = [Path("memproxy.db"), Path("memproxy.db-wal")]

    async def stored() -> bool:
        found = await api.get("/memory/conversations", params={"user": "alice"})
        chats = [c["id"] for c in found.json()["data"] if c["id"] != "trip"]
        if not chats:
            return False
        listed = await api.get(f"/memory/conversations/{chats[0]}/messages")
        return len(listed.json()["data"]) == 2 and secret.encode() in files[1].read_bytes()

    await eventually(stored, "alice's reply is stored")  # (after its response)
    assert (await api.delete("/memory/users/alice")).status_code == 200

    holding = {f.name: f.read_bytes().count(secret.encode()) for f in files if f.exists()}
    assert set(holding.values()) == {0}, holding
    assert sum(kept.encode() in f.read_bytes() for f in files if f.exists()) >= 1  # (it scans)
    # The rewritten index still finds what was left: bob's turns are recalled.
    await chat(proxy_url, "bob", f"what about {kept}?")
    sent = fake_upstream[0].chat_requests[-1]["messages"]
    recalled = " ".join(m["content"] for m in sent if m["role"] == "system")
    assert f"{kept} number 3" in recalled and secret not in recalled


def export_holds_a_snapshot(database_url: str) -> bool:
    """Whether a read snapshot is held open on the database: on PostgreSQL, a transaction
    left idle (waiting for its client); on SQLite, a reader begun before the last commit,
    which stops a checkpoint from copying that commit into the file."""
    if database_url.startswith("sqlite"):
        path = database_url.split("///", 1)[1]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return bool(copied < frames)
    return asyncio.run(_idle_in_transaction(database_url)) > 0


async def _idle_in_transaction(url: str) -> int:
    db = Database(url)
    try:
        query = text(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND state = 'idle in transaction'"
        )
        return int(await db.read(lambda conn: conn.execute(query).scalar_one()))
    finally:
        await db.dispose()


LINES = [{"role": "user", "content": f"{n} " + "x" * 4000} for n in range(300)]
# SQLite's pool holds 15 connections, PostgreSQL's 30 (storage/database.py).
STALLED_EXPORTS = 32


@contextlib.asynccontextmanager
async def large_export_begun(
    base: str, *, store: bool = True
) -> AsyncIterator[tuple[bytes, AsyncIterator[bytes]]]:
    """Alice with about a megabyte of messages (stored unless `store` is false: already
    there), and her export as a slow client reads it: its first part, and the rest still to
    read. The client's receive buffer is small, so the server cannot send far ahead of it."""
    if store:
        async with httpx.AsyncClient(
            base_url=base, headers={"authorization": f"Bearer {KEY}"}
        ) as api:
            created = await api.post(
                "/memory/conversations", json={"id": "big", "user": "alice", "messages": LINES}
            )
            assert created.status_code == 201, created.text
    slow_transport = httpx.AsyncHTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)]
    )
    async with (
        httpx.AsyncClient(
            base_url=base, headers={"authorization": f"Bearer {KEY}"}, transport=slow_transport
        ) as slow,
        slow.stream("GET", "/memory/users/alice/export") as response,
    ):
        assert response.status_code == 200
        body = response.aiter_raw()
        yield await anext(body), body


async def test_a_slow_client_holds_no_snapshot_while_other_requests_are_answered(
    paged_proxy: tuple[str, str], paged_api: httpx.AsyncClient
) -> None:
    base, database_url = paged_proxy
    events: list[str] = []
    async with large_export_begun(base) as (received, rest):
        events.append("export started")
        said = await chat(base, "alice", "said while the export was under way")
        events.append("chat answered")
        # The document was read before the first byte: the client's pace holds no snapshot
        # (on SQLite: nothing keeps the commit just made from being checkpointed).
        if not await asyncio.to_thread(export_holds_a_snapshot, database_url):
            events.append("no snapshot held")
        health = await paged_api.get(base.removesuffix("/v1") + "/healthz")
        assert health.status_code == 200
        events.append("healthz answered")
        async for chunk in rest:
            received += chunk
        events.append("export finished")

    assert events == [
        "export started",
        "chat answered",
        "no snapshot held",
        "healthz answered",
        "export finished",
    ]
    data = json.loads(received)
    (big,) = data["conversations"]  # one snapshot: the turn said meanwhile is not in it
    assert [m["content"] for m in big["messages"]] == [m["content"] for m in LINES]
    assert data["exchanges"] == []
    again = (await export(paged_api, "alice")).json()
    assert [x["id"] for x in again["exchanges"]] == [said]


async def test_more_stalled_exports_than_database_connections_block_nothing(
    paged_proxy: tuple[str, str], paged_api: httpx.AsyncClient
) -> None:
    base, _ = paged_proxy
    stalled = STALLED_EXPORTS  # more than either database's pool holds connections
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(large_export_begun(base))
        for _ in range(stalled - 1):  # (alice is stored once, by the first)
            await stack.enter_async_context(large_export_begun(base, store=False))
        # Every one has its first bytes and has stopped reading: the proxy still writes...
        said = await chat(base, "alice", "said while every export was stalled")
        # ... and reads.
        stored = await paged_api.get(f"/memory/exchanges/{said}")
        assert stored.status_code == 200, stored.text
    response = await export(paged_api, "alice")
    assert [x["id"] for x in response.json()["exchanges"]] == [said]


async def test_a_database_lost_while_the_export_is_read_leaves_it_whole(
    fake_upstream: tuple[FakeOpenAI, str],
) -> None:
    _, upstream_url = fake_upstream
    server = start_server()  # (its own, to stop)
    try:
        config = paged_config(upstream_url, server.url(server.create_database()))
        with ServerThread(create_app(config), sock=small_buffered_listener()) as proxy:
            async with large_export_begun(proxy.url + "/v1") as (received, rest):
                await asyncio.to_thread(server.pause)
                async for chunk in rest:
                    received += chunk
            (big,) = json.loads(received)["conversations"]
            assert [m["content"] for m in big["messages"]] == [m["content"] for m in LINES]
    finally:
        server.stop()
