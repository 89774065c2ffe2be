"""Isolation, as properties over random tenants, users and ids (hypothesis, fixed seed), through
the real server:

- no management endpoint reads, updates or deletes another tenant's conversations, messages,
  attachments, memories, exchanges or usage: each answers 404 (or an empty list), and afterwards
  every tenant's data is exactly as it was;
- recall never crosses users: whatever a user asks, no other user's secret reaches the model;
- a `chat`-scoped key cannot use the management API.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import Config, TenantConfig, UpstreamConfig
from tests.fakes.openai_upstream import FakeOpenAI

TENANTS = {"t1": "key-one", "t2": "key-two"}
CHAT_ONLY = "key-one-chat"
USERS = ["alice", "bob"]


def secret(tenant: str, user: str) -> str:
    return f"zebra{tenant}{user}code"


@pytest.fixture
def world(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> Iterator[tuple[str, FakeOpenAI, dict[tuple[str, str], dict[str, str]]]]:
    """Two tenants of two users, each with a conversation (a secret in it), an attachment, a
    memory and an exchange; returns the base URL, the upstream and each owner's ids."""
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    config = Config(
        upstreams={"main": upstream},
        tenants={
            "t1": TenantConfig(
                api_keys=[TENANTS["t1"], {"key": CHAT_ONLY, "scopes": ["chat"]}], upstream="main"
            ),
            "t2": TenantConfig(api_keys=[TENANTS["t2"]], upstream="main"),
        },
    )
    base = serve_proxy(config).removesuffix("/v1")
    owned: dict[tuple[str, str], dict[str, str]] = {}
    for tenant, key in TENANTS.items():
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}) as http:
            for user in USERS:
                said = f"my locker code is {secret(tenant, user)}"
                chat = http.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": said}]},
                    headers={"X-Memory-User-Id": user},
                )
                assert chat.status_code == 200, chat.text
                conversation = chat.headers["x-memory-conversation-id"]
                attachment = http.post(
                    f"/v1/memory/conversations/{conversation}/attachments",
                    json={"content": f"Notes of {user}."},
                )
                memory = http.post("/v1/memory/memories", json={"user": user, "text": said})
                owned[(tenant, user)] = {
                    "conversation": conversation,
                    "attachment": attachment.json()["id"],
                    "memory": memory.json()["id"],
                    "exchange": chat.headers["x-request-id"],
                }
    yield base, fake_upstream[0], owned


# (method, path, body) of every endpoint that names a tenant's object.
def requests_on(ids: dict[str, str]) -> list[tuple[str, str, Any]]:
    c, a, m, x = (ids.get(k, "") for k in ("conversation", "attachment", "memory", "exchange"))
    return [
        ("GET", f"/v1/memory/conversations/{c}", None),
        ("PATCH", f"/v1/memory/conversations/{c}", {"title": "mine now"}),
        ("DELETE", f"/v1/memory/conversations/{c}", None),
        ("GET", f"/v1/memory/conversations/{c}/messages", None),
        ("POST", f"/v1/memory/conversations/{c}/messages", {"messages": [{"role": "user"}]}),
        ("GET", f"/v1/memory/conversations/{c}/attachments", None),
        ("POST", f"/v1/memory/conversations/{c}/attachments", {"content": "planted"}),
        ("GET", f"/v1/memory/conversations/{c}/attachments/{a}", None),
        ("DELETE", f"/v1/memory/conversations/{c}/attachments/{a}", None),
        ("GET", f"/v1/memory/memories/{m}", None),
        ("PATCH", f"/v1/memory/memories/{m}", {"text": "overwritten"}),
        ("DELETE", f"/v1/memory/memories/{m}", None),
        ("GET", f"/v1/memory/exchanges/{x}", None),
    ]


def snapshot(base: str) -> dict[str, Any]:
    """Everything each tenant holds, through its own key."""
    found: dict[str, Any] = {}
    for tenant, key in TENANTS.items():
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}) as http:
            for user in USERS:
                found[f"{tenant}/{user}"] = http.get(f"/v1/memory/users/{user}/export").json()
                found[f"{tenant}/{user}"].pop("exported_at")
    return found


def test_no_tenant_reaches_another_tenants_data(
    world: tuple[str, FakeOpenAI, dict[tuple[str, str], dict[str, str]]],
) -> None:
    base, _, owned = world
    before = snapshot(base)
    owners = sorted(owned)

    @settings(max_examples=80, derandomize=True, deadline=None)
    @given(owner=st.sampled_from(owners), which=st.integers(0, len(requests_on({})) - 1))
    def one(owner: tuple[str, str], which: int) -> None:
        actor = next(t for t in TENANTS if t != owner[0])  # the other tenant's key
        method, path, body = requests_on(owned[owner])[which]
        with httpx.Client(
            base_url=base, headers={"authorization": f"Bearer {TENANTS[actor]}"}
        ) as http:
            response = http.request(method, path, json=body)
            assert response.status_code == 404, (method, path, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            listed = http.get("/v1/memory/conversations", params={"user": owner[1]}).json()
            assert owned[owner]["conversation"] not in [c["id"] for c in listed["data"]]
            usage = http.get("/v1/memory/usage", params={"user": owner[1]}).json()
            # Its own user of that name made one exchange; the owner's is not counted here.
            assert usage["total"]["requests"] == 1

    one()
    assert snapshot(base) == before


def test_recall_never_crosses_users_or_tenants(
    world: tuple[str, FakeOpenAI, dict[tuple[str, str], dict[str, str]]],
) -> None:
    base, upstream, owned = world

    @settings(max_examples=40, derandomize=True, deadline=None)
    @given(
        tenant=st.sampled_from(sorted(TENANTS)),
        user=st.sampled_from(USERS),
        asked=st.sampled_from([*(secret(t, u) for t, u in owned), "what is my locker code?"]),
        own_conversation=st.booleans(),
    )
    def one(tenant: str, user: str, asked: str, own_conversation: bool) -> None:
        headers = {"authorization": f"Bearer {TENANTS[tenant]}", "X-Memory-User-Id": user}
        if own_conversation:
            headers["X-Memory-Conversation-Id"] = owned[(tenant, user)]["conversation"]
        with httpx.Client(base_url=base, headers=headers) as http:
            response = http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": asked}]},
                headers={"X-Memory-Mode": "read"},
            )
        assert response.status_code == 200, response.text
        sent = str(upstream.chat_requests[-1]["messages"][:-1])  # what the proxy added
        mine = secret(tenant, user)
        others = [secret(t, u) for t, u in owned if (t, u) != (tenant, user)]
        assert not [s for s in others if s in sent]
        if asked == mine:  # the control: recall does find the user's own
            assert mine in sent

    one()
    # Someone else's conversation named in the header is not found, not borrowed.
    alice = owned[("t1", "alice")]["conversation"]
    with httpx.Client(
        base_url=base,
        headers={"authorization": f"Bearer {TENANTS['t1']}", "X-Memory-User-Id": "bob"},
    ) as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "code?"}]},
            headers={"X-Memory-Conversation-Id": alice},
        )
    assert response.status_code == 404


def test_a_chat_key_cannot_use_the_management_api(
    world: tuple[str, FakeOpenAI, dict[tuple[str, str], dict[str, str]]],
) -> None:
    base, _, owned = world
    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {CHAT_ONLY}"}) as http:
        for method, path, body in requests_on(owned[("t1", "alice")]):
            assert http.request(method, path, json=body).status_code == 403, (method, path)
        for path in ("/v1/memory/users/alice/export", "/v1/memory/usage", "/v1/memory/jobs"):
            assert http.get(path).status_code == 403
        assert http.delete("/v1/memory/users/alice").status_code == 403
