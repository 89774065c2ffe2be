"""Bad input against every endpoint of the real server: malformed JSON, wrong types, huge
strings, deep nesting, invalid UTF-8, unknown roles, hostile ids (SQL and path characters) in
paths, queries and headers. Every case is a 4xx in OpenAI's error shape, never a 500, and
writes nothing: the table-driven cases leave the database exactly as it was; a fuzz run
(hypothesis, fixed seed) throws random JSON and ids at every endpoint and then finds the
database intact."""

from __future__ import annotations

import http.client
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import ServerConfig, UpstreamConfig
from tests.conftest import KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI

USER = "alice"
SEEDED = "c1"
DEEP = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"
HUGE = "x" * 300_000
MAX_BODY = 200_000

# Bodies no endpoint that takes JSON accepts (each names why).
BAD_BODIES: dict[str, bytes] = {
    "empty": b"",
    "truncated": b'{"user": "alice"',
    "not an object": b'["user", "alice"]',
    "a string": b'"hello"',
    "null": b"null",
    "invalid utf-8": b'{"user": "\xff\xfe"}',
    "nested 5,000 deep": DEEP,
    "NaN": b'{"user": NaN}',
    "over max_body_bytes": json.dumps({"user": USER, "text": "y" * MAX_BODY}).encode(),
}
# Endpoint -> bodies that are well-formed JSON but wrong for it.
WRONG_FIELDS: dict[tuple[str, str], list[Any]] = {
    ("POST", "/v1/chat/completions"): [
        {"model": "m"},
        {"model": 5, "messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": "hello"},
        {"model": "m", "messages": []},
        {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": {"a": 1}}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"text": 5}]}]},
        {"model": "m", "messages": [{"role": "assistant", "tool_calls": "x"}]},
        {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]},
        {"model": "m", "messages": [{"role": "user", "content": "x", "name": HUGE}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "attachments": "doc"},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "attachments": [{}]},
        {"model": "\x00", "messages": [{"role": "user", "content": "x"}]},
    ],
    ("POST", "/v1/memory/conversations"): [
        {},
        {"user": ["alice"]},
        {"user": USER, "id": "'; DROP TABLE conversations;--"},
        {"user": USER, "id": "../../etc/passwd"},
        {"user": USER, "id": "a" * 129},
        {"user": USER, "title": 5},
        {"user": USER, "messages": "hello"},
        {"user": USER, "messages": [{"role": "user", "content": "x", "created_at": "2020-13-45"}]},
        {"user": USER, "messages": [{"role": "user", "content": "x"}, {"role": "alien"}]},
        {"user": HUGE},
        {"user": USER, "message": [{"role": "user", "content": "x"}]},  # (misspelt: not empty)
    ],
    ("POST", "/v1/memory/conversations/c1/messages"): [
        {},
        {"messages": []},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}, 7]},
        {"messages": [{"role": "user", "content": "x"}], "user": "bob"},
    ],
    ("PATCH", "/v1/memory/conversations/c1"): [
        {"title": 5},
        {"archived": "maybe"},
        {"metadata": [1, 2]},
        {"title": HUGE},
        {"titel": "x"},
    ],
    ("POST", "/v1/memory/conversations/c1/attachments"): [
        {},
        {"content": 5},
        {"content": "   "},
        {"content": "x", "media_type": "application/x-evil"},
        {"content": "x", "title": ["t"]},
    ],
    ("POST", "/v1/memory/memories"): [
        {},
        {"user": USER},
        {"user": USER, "text": ""},
        {"user": USER, "text": "x", "kind": 5},
        {"user": USER, "text": "x", "confidence": "high"},
        {"user": USER, "text": "x", "pinned": "yes"},
        {"user": 5, "text": "x"},
        {"user": USER, "text": "x", "pin": True},
    ],
}
HOSTILE_IDS = [
    "nope",
    "'%20OR%20'1'='1",
    "..%2F..%2Fetc%2Fpasswd",
    "%00",
    "%ff%fe",
    "a" * 300,
    "%E2%80%AE",
    "c1%3B%20DROP%20TABLE%20messages",
]
ID_ROUTES = [
    ("GET", "/v1/memory/conversations/{id}"),
    ("PATCH", "/v1/memory/conversations/{id}"),
    ("DELETE", "/v1/memory/conversations/{id}"),
    ("GET", "/v1/memory/conversations/{id}/messages"),
    ("POST", "/v1/memory/conversations/{id}/messages"),
    ("GET", "/v1/memory/conversations/{id}/attachments"),
    ("POST", "/v1/memory/conversations/{id}/attachments"),
    ("GET", "/v1/memory/conversations/c1/attachments/{id}"),
    ("DELETE", "/v1/memory/conversations/c1/attachments/{id}"),
    ("GET", "/v1/memory/memories/{id}"),
    ("PATCH", "/v1/memory/memories/{id}"),
    ("DELETE", "/v1/memory/memories/{id}"),
    ("GET", "/v1/memory/jobs/{id}"),
    ("GET", "/v1/memory/exchanges/{id}"),
]
BAD_QUERIES = [
    "/v1/memory/conversations?user=alice&limit=0",
    "/v1/memory/conversations?user=alice&limit=lots",
    "/v1/memory/conversations?user=alice&limit=99999999999999999999",
    "/v1/memory/conversations?user=alice&after=%00",
    "/v1/memory/memories?user=alice&pinned=perhaps",
    "/v1/memory/jobs?status=exploded",
    "/v1/memory/usage?group_by=colour",
    "/v1/memory/usage?from=yesterday",
    "/v1/memory/usage?from=2020-01-01&to=nonsense",
    # A parameter the route does not have (misspelt, or a filter it lacks) is not ignored.
    "/v1/memory/usage?model=gpt-4o",
    "/v1/memory/conversations?usr=alice",
    "/v1/memory/conversations/c1/messages?limt=5",
    "/v1/memory/conversations/c1/attachments?limit=5&befor=x",
    "/v1/memory/memories?user=alice&query=tea",
    "/v1/memory/jobs?state=dead",
    "/v1/memory/limits?tenant=t2",
    "/v1/memory/users/alice/export?format=csv",
]
BAD_HEADERS = [
    {"X-Memory-Conversation-Id": "'; DROP TABLE messages;--"},
    {"X-Memory-Conversation-Id": "a" * 129},
    {"X-Memory-Conversation-Id": "../../etc"},
    {"X-Memory-Mode": "sometimes"},
    {"X-Memory-User-Id": "u" * 1000},
]


@pytest.fixture
def server(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> Iterator[tuple[httpx.Client, FakeOpenAI]]:
    config = make_config(
        UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k"),
    )
    config = config.model_copy(update={"server": ServerConfig(max_body_bytes=MAX_BODY)})
    base = serve_proxy(config).removesuffix("/v1")
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as client:
        seeded = client.post(
            "/v1/memory/conversations",
            json={"id": SEEDED, "user": USER, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert seeded.status_code == 201, seeded.text
        yield client, fake_upstream[0]


def openai_error(response: httpx.Response) -> str | None:
    """What is wrong with a response that should be a 4xx OpenAI error (None: nothing)."""
    if not 400 <= response.status_code < 500:
        return f"status {response.status_code}: {response.text[:200]}"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {response.text[:200]}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"not OpenAI's error shape: {error}"
    return None


def snapshot(client: httpx.Client) -> dict[str, Any]:
    """What the tenant holds, through the API."""
    conversations = client.get("/v1/memory/conversations", params={"limit": 100}).json()["data"]
    return {
        "conversations": conversations,
        "messages": {
            c["id"]: client.get(f"/v1/memory/conversations/{c['id']}/messages").json()["data"]
            for c in conversations
        },
        "memories": client.get("/v1/memory/memories", params={"user": USER}).json()["data"],
        "attachments": client.get(f"/v1/memory/conversations/{SEEDED}/attachments").json()["data"],
    }


def test_every_bad_request_is_a_4xx_in_openais_shape_and_writes_nothing(
    server: tuple[httpx.Client, FakeOpenAI],
) -> None:
    client, upstream = server
    before = snapshot(client)
    wrong: list[str] = []

    def expect_error(method: str, path: str, case: str = "", **kwargs: Any) -> None:
        response = client.request(method, path, **kwargs)
        problem = openai_error(response)
        if problem is not None:
            wrong.append(f"{method} {path[:80]} {case or str(kwargs)[:80]}: {problem}")

    json_type = {"content-type": "application/json"}
    for method, path in WRONG_FIELDS:
        for case, raw in BAD_BODIES.items():
            expect_error(method, path, case, content=raw, headers=json_type)
        for body in WRONG_FIELDS[(method, path)]:
            expect_error(method, path, json=body)
    for method, template in ID_ROUTES:
        for hostile in HOSTILE_IDS:
            body = {"messages": [{"role": "user", "content": "x"}], "content": "x", "text": "x"}
            kwargs: dict[str, Any] = {"json": body} if method in ("POST", "PATCH") else {}
            expect_error(method, template.replace("{id}", hostile), **kwargs)
    for path in BAD_QUERIES:
        expect_error("GET", path)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for headers in BAD_HEADERS:
        expect_error("POST", "/v1/chat/completions", json=chat, headers=headers)
    # Another tenant's key on this tenant's ids, and no key at all.
    other = {"authorization": f"Bearer {OTHER_TENANT_KEY}"}
    for method, template in ID_ROUTES:
        expect_error(method, template.replace("{id}", SEEDED), headers=other)
    expect_error("GET", "/v1/memory/conversations", headers={"authorization": "Bearer nope"})

    assert wrong == []
    assert snapshot(client) == before
    assert upstream.chat_requests == []  # nothing bad was forwarded


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)
FIELDS = ["model", "messages", "role", "content", "user", "id", "title", "text", "kind", "pinned"]
BODIES = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), JSON_VALUES, max_size=6)
ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/memory/conversations"),
    ("POST", "/v1/memory/conversations/{id}/messages"),
    ("PATCH", "/v1/memory/conversations/{id}"),
    ("POST", "/v1/memory/conversations/{id}/attachments"),
    ("POST", "/v1/memory/memories"),
    ("PATCH", "/v1/memory/memories/{id}"),
    ("GET", "/v1/memory/conversations/{id}/messages"),
    ("DELETE", "/v1/memory/memories/{id}"),
    ("GET", "/v1/memory/users/{id}/export"),
]
IDS = st.sampled_from([SEEDED, "nope"]) | st.text(
    st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40
)


def test_fuzzed_bodies_and_ids_never_get_a_500_and_leave_the_database_intact(
    server: tuple[httpx.Client, FakeOpenAI],
) -> None:
    client, _ = server

    @settings(max_examples=200, derandomize=True, deadline=None)  # the same cases every run
    @given(route=st.sampled_from(ROUTES), body=BODIES, ident=IDS)
    def one(route: tuple[str, str], body: dict[str, Any], ident: str) -> None:
        method, template = route
        path = template.replace("{id}", quote(ident, safe=""))
        kwargs: dict[str, Any] = {"json": body} if method in ("POST", "PATCH") else {}
        response = client.request(method, path, **kwargs)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert openai_error(response) is None

    one()
    # What the fuzz was allowed to write reads back whole, and the file is consistent.
    for conversation in snapshot(client)["conversations"]:
        read = client.get(f"/v1/memory/conversations/{quote(conversation['id'], safe='')}/messages")
        assert read.status_code == 200
    with sqlite3.connect(Path("memproxy.db")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def test_a_nul_anywhere_is_a_400_on_both_databases_and_stores_nothing(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str], database_url: str
) -> None:
    """PostgreSQL cannot hold a NUL in text (nor compare one): every id, user and text with one
    is refused up front, on SQLite too, rather than failing in storage (a 503, or a degraded
    turn that could never be replayed)."""
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    base = serve_proxy(make_config(upstream, database_url=database_url)).removesuffix("/v1")
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    cases: list[tuple[str, str, Any]] = [
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "a\x00"}]}),
        ("POST", "/v1/memory/memories", {"user": "al\x00ice", "text": "likes tea"}),
        ("POST", "/v1/memory/memories", {"user": USER, "text": "likes\x00tea"}),
        ("POST", "/v1/memory/conversations", {"user": USER, "id": "c\x00"}),
        ("POST", "/v1/memory/conversations", {"user": USER, "messages": [{"role": "user", "content": "\x00"}]}),
        ("GET", "/v1/memory/memories/%00", None),
        ("GET", "/v1/memory/memories?user=al%00ice", None),
        ("GET", "/v1/memory/conversations/%00", None),
        ("GET", "/v1/memory/conversations?after=%00", None),
        ("GET", "/v1/memory/exchanges/%00", None),
        ("DELETE", "/v1/memory/users/a%00b", None),
    ]  # fmt: skip
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as client:
        wrong = []
        for method, path, body in cases:
            response = client.request(method, path, json=body)
            problem = openai_error(response) or (
                None if response.status_code == 400 else f"status {response.status_code}"
            )
            if problem is not None:
                wrong.append(f"{method} {path} {body!r:.60}: {problem}")
        assert wrong == []
        assert client.get("/v1/memory/conversations").json()["data"] == []
        assert client.get("/v1/memory/memories", params={"user": USER}).json()["data"] == []
        # The same without the NUL goes through; a backslash and "u0000" as text is no NUL.
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        text = client.post("/v1/memory/memories", json={"user": USER, "text": "a \\u0000 b"})
        assert text.status_code == 201 and text.json()["text"] == "a \\u0000 b"
        # An uploaded document's NULs (an extraction's artefacts) are dropped; a form field's
        # are refused.
        assert client.post("/v1/memory/conversations", json={"id": "d", "user": USER}).is_success
        upload = "/v1/memory/conversations/d/attachments"
        named = client.post(upload, files={"file": ("a.txt", b"x")}, data={"title": "t\x00"})
        assert named.status_code == 400 and openai_error(named) is None
        stored = client.post(upload, files={"file": ("a.txt", b"tea\x00time")})
        assert stored.status_code == 201, stored.text
        found = client.get(f"{upload}/{stored.json()['id']}")
        assert found.json()["content"] == "teatime"


def test_a_user_id_header_is_read_as_utf8_the_same_user_as_in_the_management_api(
    server: tuple[httpx.Client, FakeOpenAI],
) -> None:
    # Header values arrive as bytes; read as Latin-1, "José" became another user ("JosÃ©"),
    # whom listing, export and erasure by the real name would miss.
    client, _ = server
    chat = {"model": "m", "messages": [{"role": "user", "content": "hola"}]}
    sent = client.post(
        "/v1/chat/completions", json=chat, headers={"X-Memory-User-Id": "José".encode()}
    )
    assert sent.status_code == 200, sent.text
    [conversation] = client.get("/v1/memory/conversations", params={"user": "José"}).json()["data"]
    assert conversation["user"] == "José"
    erased = client.delete(f"/v1/memory/users/{quote('José')}").json()["deleted"]
    assert erased["conversations"] == 1
    # Bytes that are not UTF-8 name no user.
    bad = client.post("/v1/chat/completions", json=chat, headers={"X-Memory-User-Id": b"Jos\xe9"})
    assert bad.status_code == 400 and openai_error(bad) is None
    assert bad.json()["error"]["param"] == "X-Memory-User-Id"


def test_a_body_that_stops_arriving_is_a_408_and_one_sent_slowly_is_read_whole(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    config = make_config(UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k"))
    config = config.model_copy(update={"server": ServerConfig(body_timeout_seconds=1.0)})
    url = httpx.URL(serve_proxy(config))
    body = json.dumps({"id": "slow", "user": USER, "messages": [{"role": "user", "content": "hi"}]})

    def post(parts: list[bytes], pause: float) -> tuple[int, bytes, str | None]:
        conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
        conn.putrequest("POST", "/v1/memory/conversations")
        for name, value in [
            ("authorization", f"Bearer {KEY}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]:
            conn.putheader(name, value)
        conn.endheaders()
        try:
            for part in parts:
                conn.send(part)
                time.sleep(pause)
            response = conn.getresponse()
            return response.status, response.read(), response.getheader("connection")
        finally:
            conn.close()

    # Stalled after its first 10 bytes: answered, in OpenAI's shape, the connection closed
    # (the server would wait for the rest of the body on it), and nothing stored.
    status, answer, connection = post([body[:10].encode()], 0)
    error = json.loads(answer)["error"]
    assert (status, error["code"], connection) == (408, "request_timeout", "close"), error
    # A part every 50 ms for longer than the limit in all: each wait is well within it.
    raw = body.encode()
    status, answer, _ = post([raw[i : i + 4] for i in range(0, len(raw), 4)], 0.05)
    assert status == 201, answer
    with httpx.Client(base_url=str(url), headers={"authorization": f"Bearer {KEY}"}) as client:
        stored = client.get("/memory/conversations", params={"user": USER}).json()["data"]
    assert [c["id"] for c in stored] == ["slow"]


def test_more_messages_than_max_request_messages_is_a_413_naming_the_limit(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    """A request of 10,001 tiny messages fits the body limit; without a bound on the count,
    each became a stored row (issue 34: 200,001 rows and 230 MB from one request)."""
    config = make_config(UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k"))
    base = serve_proxy(config).removesuffix("/v1")
    limit = 10_000  # server.max_request_messages by default
    many = [{"role": "user", "content": "x"}] * (limit + 1)
    items = [{"role": "user", "content": "x"}] * (limit + 1)
    cases = [
        ("/v1/chat/completions", {"model": "m", "messages": many}, "messages"),
        ("/v1/responses", {"model": "m", "input": items}, "input"),
        ("/v1/memory/conversations", {"user": USER, "id": "big", "messages": many}, "messages"),
        ("/v1/memory/conversations/c1/messages", {"messages": many}, "messages"),
    ]
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as client:
        seeded = client.post(
            "/v1/memory/conversations",
            json={"id": SEEDED, "user": USER, "messages": many[:limit]},  # the limit itself is fine
        )
        assert seeded.status_code == 201, seeded.text
        before = snapshot(client)
        for path, body, param in cases:
            response = client.post(path, json=body)
            assert response.status_code == 413, (path, response.text)
            assert openai_error(response) is None
            error = response.json()["error"]
            assert (error["param"], error["code"]) == (param, "too_many_messages")
            assert "server.max_request_messages" in error["message"]
            assert str(limit) in error["message"]
        assert snapshot(client) == before
    assert fake_upstream[0].chat_requests == []
