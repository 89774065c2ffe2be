"""Input an attacker sends on purpose: a `role` that is an object or an array, user ids that
URL clients rewrite (`.` and `..`). Each is a 400 naming the parameter, in the route's error
shape, and stores nothing."""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.core.config import UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI

HOSTILE_ROLES: list[Any] = [{"a": 1}, ["user"], [], {}]


@pytest.fixture
def client(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> Iterator[httpx.Client]:
    config = make_config(UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k"))
    base = serve_proxy(config).removesuffix("/v1")
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as client:
        yield client


def error_param(response: httpx.Response) -> tuple[int, str | None]:
    """The status and the `param` of an OpenAI-shaped error (AssertionError if not one)."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return response.status_code, error["param"]


@pytest.mark.parametrize("role", HOSTILE_ROLES, ids=repr)
def test_a_role_that_is_an_object_or_an_array_is_a_400_naming_it_everywhere(
    client: httpx.Client, fake_upstream: tuple[FakeOpenAI, str], role: Any
) -> None:
    ok = {"role": "user", "content": "hi"}
    bad = {"role": role, "content": "x"}
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": [ok, bad]})
    assert error_param(chat) == (400, "messages[1].role")
    created = client.post(
        "/v1/memory/conversations", json={"id": "c", "user": "alice", "messages": [ok, bad]}
    )
    assert error_param(created) == (400, "messages[1].role")
    assert client.post("/v1/memory/conversations", json={"id": "c", "user": "alice"}).is_success
    appended = client.post("/v1/memory/conversations/c/messages", json={"messages": [bad]})
    assert error_param(appended) == (400, "messages[0].role")
    responses = client.post("/v1/responses", json={"model": "m", "input": [ok, bad]})
    assert error_param(responses) == (400, "input[1].role")
    typed = client.post("/v1/responses", json={"model": "m", "input": [{"type": "message", **bad}]})
    assert error_param(typed) == (400, "input[0].role")
    assert client.get("/v1/memory/conversations/c/messages").json()["data"] == []
    assert fake_upstream[0].chat_requests == []


@pytest.mark.parametrize("user", [".", ".."])
def test_dot_segment_user_ids_are_refused_wherever_a_user_is_named(
    client: httpx.Client, fake_upstream: tuple[FakeOpenAI, str], user: str
) -> None:
    # URL clients collapse "." and ".." path segments (and their %2E forms): such a user's
    # /v1/memory/users/{id}/export and erasure could never be reached, so no data is stored
    # for one in the first place.
    hi = [{"role": "user", "content": "hi"}]
    chat = {"model": "m", "messages": hi}
    refused = [
        (client.post("/v1/chat/completions", json=chat, headers={"X-Memory-User-Id": user}),
         "X-Memory-User-Id"),
        (client.post("/v1/chat/completions", json={**chat, "user": user}), "user"),
        (client.post("/v1/chat/completions", json={**chat, "safety_identifier": user}),
         "safety_identifier"),
        (client.post("/v1/responses", json={"model": "m", "input": "hi", "user": user}), "user"),
        (client.post("/v1/responses", json={"model": "m", "input": "hi"},
                     headers={"X-Memory-User-Id": user}), "X-Memory-User-Id"),
        (client.post("/v1/memory/conversations", json={"user": user, "messages": hi}), "user"),
        (client.post("/v1/memory/memories", json={"user": user, "text": "likes tea"}), "user"),
        (client.get("/v1/memory/conversations", params={"user": user}), "user"),
        (client.get("/v1/memory/memories", params={"user": user}), "user"),
    ]  # fmt: skip
    assert [error_param(r) for r, _ in refused] == [(400, param) for _, param in refused]
    assert client.get("/v1/memory/conversations").json()["data"] == []
    assert fake_upstream[0].chat_requests == []
    # Ids that merely hold dots are users like any other, reachable by the URL recipe.
    for name in ("...", ".alice", "a.b"):
        sent = client.post("/v1/chat/completions", json=chat, headers={"X-Memory-User-Id": name})
        assert sent.status_code == 200, sent.text
        export = client.get(f"/v1/memory/users/{name}/export")
        assert export.status_code == 200 and export.json()["user"] == name
    # A user named so before they were refused can still be erased (and exported), by a
    # client that keeps dot segments.
    conn = http.client.HTTPConnection(httpx.URL(str(client.base_url)).host, client.base_url.port)
    try:
        conn.request(
            "DELETE", f"/v1/memory/users/{user}", headers={"authorization": f"Bearer {KEY}"}
        )
        erased = conn.getresponse()
        body = erased.read()
    finally:
        conn.close()
    assert erased.status == 200, body
