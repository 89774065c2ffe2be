"""The management API under /v1/memory/, on the real server (SQLite file in the test's
directory), with chats through the official openai SDK where a test needs stored history.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY
from tests.fakes.openai_upstream import FakeOpenAI

MODEL = "gpt-4o-mini"
Message = dict[str, Any]
ERROR_FIELDS = {"message", "type", "param", "code"}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str | None) -> Message:
    return {"role": "assistant", "content": text}


def sent(stored: list[Message]) -> list[Message]:
    """Stored messages in the shape a chat request carries them."""
    keys = ("role", "content", "name", "tool_calls", "tool_call_id")
    return [{k: m[k] for k in keys if k in m} for m in stored]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of a response that must have failed with `status`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    return dict(error)


def timestamp(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp())


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


def http_for(proxy_url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=proxy_url + "/memory", headers={"authorization": f"Bearer {key}"}
    )


@pytest.fixture
async def api(proxy_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """Tenant t1's management client."""
    async with http_for(proxy_url, KEY) as http:
        yield http


@pytest.fixture
async def other_api(proxy_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """Tenant t2's management client."""
    async with http_for(proxy_url, OTHER_TENANT_KEY) as http:
        yield http


@pytest.fixture
async def client(proxy_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=proxy_url, api_key=KEY, max_retries=0) as client:
        yield client


async def create(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/conversations", json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


async def messages(http: httpx.AsyncClient, conversation: str) -> list[Message]:
    response = await http.get(f"/conversations/{conversation}/messages")
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


async def listed(http: httpx.AsyncClient, user_id: str) -> list[str]:
    response = await http.get("/conversations", params={"user": user_id, "limit": 100})
    assert response.status_code == 200, response.text
    return [c["id"] for c in response.json()["data"]]


async def chat(
    client: openai.AsyncOpenAI, messages: list[Message], headers: dict[str, str]
) -> httpx.Headers:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, extra_headers=headers
    )
    raw.parse()
    return raw.headers


# --- access ------------------------------------------------------------------------------------


async def test_chat_only_key_gets_403_on_the_memory_api(proxy_url: str) -> None:
    calls = [
        ("GET", "/conversations?user=alice", None),
        ("POST", "/conversations", {"user": "alice"}),
        ("GET", "/conversations/c1", None),
        ("PATCH", "/conversations/c1", {"title": "x"}),
        ("DELETE", "/conversations/c1", None),
        ("GET", "/conversations/c1/messages", None),
        ("POST", "/conversations/c1/messages", {"messages": [user("hi")]}),
        ("DELETE", "/users/alice", None),
    ]
    async with http_for(proxy_url, CHAT_ONLY_KEY) as chat_only, http_for(proxy_url, KEY) as api:
        for method, path, body in calls:
            response = await chat_only.request(method, path, json=body)
            error = error_of(response, 403)
            assert (error["type"], error["code"]) == ("permission_error", "insufficient_scope")
        # Nothing was created on the way.
        assert await listed(api, "alice") == []


async def test_another_tenants_conversation_is_404_everywhere(
    api: httpx.AsyncClient, other_api: httpx.AsyncClient
) -> None:
    await create(api, id="c1", user="alice", title="Mine", messages=[user("secret")])
    for method, path, body in [
        ("GET", "/conversations/c1", None),
        ("PATCH", "/conversations/c1", {"title": "Stolen"}),
        ("PATCH", "/conversations/c1", {"archived": True}),
        ("DELETE", "/conversations/c1", None),
        ("GET", "/conversations/c1/messages", None),
        ("POST", "/conversations/c1/messages", {"messages": [user("injected")]}),
    ]:
        error = error_of(await other_api.request(method, path, json=body), 404)
        assert error["code"] == "conversation_not_found", (method, path)
    assert await listed(other_api, "alice") == []
    # Another tenant's id is not even a valid cursor.
    error = error_of(await other_api.get("/conversations", params={"after": "c1"}), 400)
    assert error["param"] == "after"
    # The other tenant may use the same id for a conversation of its own, and erasing its
    # "alice" erases only that.
    await create(other_api, id="c1", user="alice", messages=[user("theirs")])
    assert sent(await messages(other_api, "c1")) == [user("theirs")]
    erased = await other_api.delete("/users/alice")
    assert erased.status_code == 200
    assert erased.json()["deleted"] == {
        "conversations": 1,
        "messages": 1,
        "exchanges": 0,
        "attachments": 0,
        "memories": 0,
        "responses": 0,
        "jobs": 0,
        "summaries": 0,
        "vectors": 0,
        "spilled": 0,
    }

    mine = (await api.get("/conversations/c1")).json()
    assert (mine["title"], mine["archived"], mine["message_count"]) == ("Mine", False, 1)
    assert sent(await messages(api, "c1")) == [user("secret")]


# --- conversations -----------------------------------------------------------------------------


async def test_list_pages_newest_first(api: httpx.AsyncClient) -> None:
    created = [(await create(api, user="alice", title=f"#{i}"))["id"] for i in range(5)]
    await create(api, user="bob")

    seen: list[str] = []
    pages = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"user": "alice", "limit": 2}
        if after:
            params["after"] = after
        response = await api.get("/conversations", params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        assert page["object"] == "list"
        ids = [c["id"] for c in page["data"]]
        assert (page["first_id"], page["last_id"]) == (ids[0], ids[-1])
        assert {c["user"] for c in page["data"]} == {"alice"}
        pages.append((len(ids), page["has_more"]))
        seen += ids
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == [(2, True), (2, True), (1, False)]
    assert seen == created[::-1]

    # New messages move a conversation to the top.
    appended = await api.post(
        f"/conversations/{created[0]}/messages", json={"messages": [user("bump")]}
    )
    assert appended.status_code == 201
    newest_first = await listed(api, "alice")
    assert newest_first == [created[0], *created[:0:-1]]

    # Past the end: an empty page in the same shape.
    response = await api.get("/conversations", params={"user": "alice", "after": newest_first[-1]})
    assert response.json() == {
        "object": "list",
        "data": [],
        "has_more": False,
        "first_id": None,
        "last_id": None,
    }


async def test_created_conversation_imports_history_that_chats_continue(
    api: httpx.AsyncClient, client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'},
    }
    imported = [
        {"role": "system", "content": "Be concise."},
        {**user("Weather in Oslo?"), "created_at": "2024-01-02T03:04:05Z"},
        {"role": "assistant", "content": None, "tool_calls": [call], "created_at": 1704164700},
        {
            "role": "tool",
            "tool_call_id": "call_9",
            "content": "-5 C",
            "created_at": "2024-01-02T04:04:05+01:00",
        },
        {**assistant("It is -5 C in Oslo."), "created_at": "2024-01-02T03:06:00"},
    ]
    before = int(datetime.now(UTC).timestamp())
    created = await create(api, id="imported", user="alice", title="Oslo", messages=imported)
    assert created["object"] == "memory.conversation"
    assert (created["id"], created["user"], created["title"]) == ("imported", "alice", "Oslo")
    assert created["message_count"] == 5
    assert created["created_at"] >= before

    stored = await messages(api, "imported")
    assert sent(stored) == [{k: v for k, v in m.items() if k != "created_at"} for m in imported]
    assert [m["seq"] for m in stored] == [1, 2, 3, 4, 5]
    assert [m["created_at"] for m in stored[1:]] == [
        timestamp("2024-01-02T03:04:05+00:00"),
        1704164700,
        timestamp("2024-01-02T03:04:05+00:00"),
        timestamp("2024-01-02T03:06:00+00:00"),  # no offset: UTC
    ]
    assert stored[0]["created_at"] >= before  # not given: the time of the import

    # A thin client continues it: the model sees the imported turns (not the system message).
    await chat(
        client,
        [user("And tomorrow?")],
        {"X-Memory-Conversation-Id": "imported", "X-Memory-User-Id": "alice"},
    )
    assert fake.chat_requests[-1]["messages"] == [
        *sent(stored[1:]),
        user("And tomorrow?"),
    ]
    # A client that resends the imported history continues it too, without the header.
    history = [*sent(stored), user("And tomorrow?"), assistant("fake reply to: And tomorrow?")]
    history.append(user("Thanks."))
    headers = await chat(client, history, {"X-Memory-User-Id": "alice"})
    assert headers["x-memory-conversation-id"] == "imported"
    assert fake.chat_requests[-1]["messages"] == history
    assert len(await messages(api, "imported")) == 9

    # Without an id the server picks one.
    generated = await create(api, user="alice")
    assert generated["id"].startswith("conv_")
    assert (generated["title"], generated["message_count"]) == (None, 0)


async def test_patch_renames_and_archives_and_delete_removes(
    api: httpx.AsyncClient, client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    await create(api, id="p", user="alice", title="Draft")
    renamed = await api.patch("/conversations/p", json={"title": "Final"})
    assert renamed.status_code == 200
    assert (renamed.json()["title"], renamed.json()["archived"]) == ("Final", False)

    archived = await api.patch("/conversations/p", json={"archived": True, "metadata": {"k": 1}})
    assert archived.status_code == 200
    got = (await api.get("/conversations/p")).json()
    assert (got["title"], got["archived"], got["metadata"]) == ("Final", True, {"k": 1})

    cleared = await api.patch("/conversations/p", json={"title": None, "archived": False})
    assert (cleared.json()["title"], cleared.json()["archived"]) == (None, False)
    # Archived or not, a conversation is listed.
    assert await listed(api, "alice") == ["p"]

    headers = {"X-Memory-Conversation-Id": "gone", "X-Memory-User-Id": "alice"}
    await chat(client, [user("Forget this.")], headers)
    await create(api, id="kept", user="alice", messages=[user("keep me")])
    assert (await api.delete("/conversations/p")).status_code == 200

    deleted = await api.delete("/conversations/gone")
    assert deleted.status_code == 200
    assert deleted.json() == {
        "id": "gone",
        "object": "memory.conversation.deleted",
        "deleted": True,
    }
    for method, path in [
        ("GET", "/conversations/gone"),
        ("GET", "/conversations/gone/messages"),
        ("DELETE", "/conversations/gone"),
    ]:
        assert error_of(await api.request(method, path), 404)["code"] == "conversation_not_found"
    assert await listed(api, "alice") == ["kept"]
    assert sent(await messages(api, "kept")) == [user("keep me")]

    # The id is free again, and nothing of the old conversation comes back.
    response = await chat(client, [user("Hello again.")], headers)
    assert fake.chat_requests[-1]["messages"] == [user("Hello again.")]
    assert response["x-memory-history-messages"] == "0"


async def test_append_adds_messages_after_the_last_one(
    api: httpx.AsyncClient, client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    await create(api, id="a", user="alice", messages=[user("one"), assistant("two")])
    appended = await api.post(
        "/conversations/a/messages",
        json={
            "messages": [user("three"), {**assistant("four"), "created_at": "2020-05-06T07:08:09Z"}]
        },
    )
    assert appended.status_code == 201
    page = appended.json()
    assert page["object"] == "list"
    assert [(m["seq"], m["content"]) for m in page["data"]] == [(3, "three"), (4, "four")]
    assert page["data"][1]["created_at"] == timestamp("2020-05-06T07:08:09+00:00")
    assert [m["content"] for m in await messages(api, "a")] == ["one", "two", "three", "four"]
    assert (await api.get("/conversations/a")).json()["message_count"] == 4

    await chat(
        client, [user("five")], {"X-Memory-Conversation-Id": "a", "X-Memory-User-Id": "alice"}
    )
    assert [m["content"] for m in fake.chat_requests[-1]["messages"]] == [
        "one",
        "two",
        "three",
        "four",
        "five",
    ]

    # Messages page in order, with `after` a message id.
    first = (await api.get("/conversations/a/messages", params={"limit": 2})).json()
    assert [m["seq"] for m in first["data"]] == [1, 2]
    assert first["has_more"] is True
    rest = (
        await api.get("/conversations/a/messages", params={"after": first["last_id"], "limit": 100})
    ).json()
    assert [m["seq"] for m in rest["data"]] == [3, 4, 5, 6]
    assert rest["has_more"] is False


async def test_erasing_a_user_removes_everything_of_that_user_only(
    api: httpx.AsyncClient,
    other_api: httpx.AsyncClient,
    client: openai.AsyncOpenAI,
    fake: FakeOpenAI,
) -> None:
    alice = {"X-Memory-Conversation-Id": "alice-chat", "X-Memory-User-Id": "alice"}
    await chat(client, [user("I am Alice.")], alice)
    await chat(client, [user("Full history.")], {"X-Memory-User-Id": "alice"})
    await create(api, id="alice-import", user="alice", messages=[user("imported")])
    await create(api, id="bob-chat", user="bob", messages=[user("I am Bob.")])
    await create(other_api, id="alice-t2", user="alice", messages=[user("Alice in t2.")])

    erased = await api.delete("/users/alice")
    assert erased.status_code == 200
    assert erased.json() == {
        "object": "memory.user.deleted",
        "user": "alice",
        "deleted": {
            "conversations": 3,
            "messages": 5,
            "exchanges": 2,
            "attachments": 0,
            "memories": 0,
            "responses": 0,
            "jobs": 0,
            "summaries": 0,
            "vectors": 0,
            "spilled": 0,
        },
    }
    assert await listed(api, "alice") == []
    for conversation in ("alice-chat", "alice-import"):
        assert (await api.get(f"/conversations/{conversation}")).status_code == 404
    # Another user of the tenant, and the same user id in another tenant, keep everything.
    assert sent(await messages(api, "bob-chat")) == [user("I am Bob.")]
    assert sent(await messages(other_api, "alice-t2")) == [user("Alice in t2.")]

    # Alice's next turn finds nothing to attach.
    headers = await chat(client, [user("Who am I?")], alice)
    assert fake.chat_requests[-1]["messages"] == [user("Who am I?")]
    assert headers["x-memory-history-messages"] == "0"

    again = await api.delete("/users/alice")
    assert again.json()["deleted"]["conversations"] == 1


# --- bad requests ------------------------------------------------------------------------------


async def test_bad_bodies_are_openai_errors_that_write_nothing(api: httpx.AsyncClient) -> None:
    good = user("fine")
    cases: list[tuple[bytes | dict[str, Any] | list[Any], str | None]] = [
        (b'{"user": "alice", "messages": [', None),
        (b"", None),
        ([{"user": "alice"}], None),
        ({"title": "no user"}, "user"),
        ({"user": 5}, "user"),
        ({"user": "  "}, "user"),
        ({"user": "alice", "id": "has space"}, "id"),
        ({"user": "alice", "id": 7}, "id"),
        ({"user": "alice", "title": 7}, "title"),
        ({"user": "alice", "messages": "hello"}, "messages"),
        ({"user": "alice", "messages": []}, "messages"),
        ({"user": "alice", "messages": [good, {"role": "wizard"}]}, "messages[1].role"),
        (
            {"user": "alice", "messages": [good, {"role": "user", "content": 5}]},
            "messages[1].content",
        ),
        ({"user": "alice", "messages": [good, "text"]}, "messages[1]"),
        (
            {"user": "alice", "messages": [good, {**good, "created_at": "yesterday"}]},
            "messages[1].created_at",
        ),
        ({"user": "alice", "messages": [{**good, "tool_calls": "x"}]}, "messages[0].tool_calls"),
        ({"user": "alice", "messages": [{**good, "name": 3}]}, "messages[0].name"),
    ]
    for body, param in cases:
        if isinstance(body, bytes):
            response = await api.post(
                "/conversations", content=body, headers={"content-type": "application/json"}
            )
        else:
            response = await api.post("/conversations", json=body)
        error = error_of(response, 400)
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, body
    assert await listed(api, "alice") == []

    await create(api, id="taken", user="alice", messages=[user("original")])
    duplicate = await api.post(
        "/conversations", json={"id": "taken", "user": "bob", "messages": [user("overwrite")]}
    )
    error = error_of(duplicate, 409)
    assert (error["code"], error["param"]) == ("conversation_exists", "id")
    assert sent(await messages(api, "taken")) == [user("original")]
    assert await listed(api, "bob") == []

    # Updates and appends.
    await create(api, id="c", user="alice", title="Kept", messages=[user("one")])
    patches: list[tuple[bytes | dict[str, Any] | list[Any], str | None]] = [
        (b"{not json", None),
        ([], None),
        ({"title": 5}, "title"),
        ({"title": "x" * 513}, "title"),
        ({"archived": "yes"}, "archived"),
        ({"metadata": ["a"]}, "metadata"),
        ({"title": "New", "owner": "bob"}, "owner"),
    ]
    appends: list[tuple[bytes | dict[str, Any] | list[Any], str | None]] = [
        (b"[1, 2", None),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": {"role": "user"}}, "messages"),
        ({"messages": [user("ok"), {"role": "robot", "content": "x"}]}, "messages[1].role"),
        (
            {"messages": [user("ok"), {**user("late"), "created_at": "2024-13-45"}]},
            "messages[1].created_at",
        ),
    ]
    for method, path, bodies in [
        ("PATCH", "/conversations/c", patches),
        ("POST", "/conversations/c/messages", appends),
    ]:
        for body, param in bodies:
            if isinstance(body, bytes):
                response = await api.request(
                    method, path, content=body, headers={"content-type": "application/json"}
                )
            else:
                response = await api.request(method, path, json=body)
            assert error_of(response, 400)["param"] == param, (path, body)
    got = (await api.get("/conversations/c")).json()
    assert (got["title"], got["archived"], got["metadata"], got["message_count"]) == (
        "Kept",
        False,
        {},
        1,
    )
    assert sent(await messages(api, "c")) == [user("one")]

    # Unknown ids are 404 with a valid body, and bad query parameters are 400s.
    for method, path, body in [
        ("GET", "/conversations/nope", None),
        ("PATCH", "/conversations/nope", {"title": "x"}),
        ("DELETE", "/conversations/nope", None),
        ("GET", "/conversations/nope/messages", None),
        ("POST", "/conversations/nope/messages", {"messages": [user("x")]}),
    ]:
        assert error_of(await api.request(method, path, json=body), 404)["code"] == (
            "conversation_not_found"
        )
    for path, params, param in [
        ("/conversations", {"limit": "0"}, "limit"),
        ("/conversations", {"limit": "101"}, "limit"),
        ("/conversations", {"limit": "ten"}, "limit"),
        ("/conversations", {"after": "nope"}, "after"),
        ("/conversations", {"user": " "}, "user"),
        ("/conversations/c/messages", {"after": "msg_999999"}, "after"),
        ("/conversations/c/messages", {"after": "garbage"}, "after"),
        ("/conversations/c/messages", {"limit": "-1"}, "limit"),
    ]:
        assert error_of(await api.get(path, params=params), 400)["param"] == param, params
