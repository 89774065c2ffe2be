"""The trust model (docs/trust-model.md), as properties over random tenants, users, key
bindings and tokens (hypothesis, fixed seed), through the real server: no request acts as a
user its credentials do not allow, through chat completions, the Responses API and its stored
responses, and the management API.

The world: tenant `t1` in header mode (a trusted backend's key, keys bound to alice and bob);
`t2` in token mode (a key, one bound to alice, and an operator's manage-only key); `t3` in token mode that allows anonymous
requests. Each user of each tenant has a conversation with a secret in it, a memory, an
attachment, an exchange and a stored response. An oracle says, from the credentials alone,
which user a request may act as (or how it is refused); every answer is checked against it:
a turn's exchange is stored for that user and the model sees no other user's secret; a
management call about another user's data is a 404 (by id) or a 403 (by user name), and a list
shows that user's data alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.config import (
    ApiKeyConfig,
    Config,
    IdentityConfig,
    MemorySettings,
    TenantConfig,
    UpstreamConfig,
)
from storage.database import Database
from storage.repositories.exchanges import Exchanges
from tests.fakes.openai_upstream import FakeOpenAI

USERS = ("alice", "bob")
SECRETS = {"t2": "t2-signing-secret-" + "2" * 32, "t3": "t3-signing-secret-" + "3" * 32}
TOKEN_TENANTS = tuple(SECRETS)


@dataclass(frozen=True)
class Key:
    tenant: str
    scopes: tuple[str, ...] = ("chat", "manage")
    user: str | None = None


KEYS = {
    "t1-backend": Key("t1"),
    "t1-alice": Key("t1", user="alice"),
    "t1-bob-chat": Key("t1", ("chat",), user="bob"),
    "t2-app": Key("t2"),
    "t2-alice": Key("t2", user="alice"),
    "t2-ops": Key("t2", ("manage",)),  # an operator's: manages every user, no token needed
    "t3-app": Key("t3"),
}
ADMIN = {"t1": "t1-backend", "t2": "t2-app", "t3": "t3-app"}


def secret(tenant: str, user: str) -> str:
    return f"zebra{tenant}{user}code"


def token(signer: str, sub: str, *, expired: bool = False) -> str:
    now = int(time.time())
    exp = now - 3600 if expired else now + 600
    return jwt.encode({"sub": sub, "exp": exp}, SECRETS[signer], algorithm="HS256")


def tenant_config(name: str) -> TenantConfig:
    keys = [
        ApiKeyConfig(key=k, scopes=list(v.scopes), user=v.user)  # type: ignore[arg-type]
        for k, v in KEYS.items()
        if v.tenant == name
    ]
    identity = IdentityConfig()
    if name in SECRETS:
        identity = IdentityConfig(
            mode="token",
            algorithms=["HS256"],
            secret=SECRETS[name],
            allow_anonymous=name == "t3",
        )
    return TenantConfig(
        api_keys=keys,  # type: ignore[arg-type]
        upstream="main",
        identity=identity,
        memory=MemorySettings(embeddings="off"),
    )


def acting_as(tenant: str, user: str) -> dict[str, str]:
    """Headers of the tenant's own backend acting for `user` (a token in token mode)."""
    if tenant in SECRETS:
        return {"X-Memory-User-Token": token(tenant, user)}
    return {"X-Memory-User-Id": user}


@dataclass
class World:
    base: str
    upstream: FakeOpenAI
    owned: dict[tuple[str, str], dict[str, str]]
    db: Database
    loop: asyncio.AbstractEventLoop
    http: httpx.Client  # (no headers of its own: each request sends its own)

    def exchange_user(self, tenant: str, request_id: str) -> str | None:
        found = self.loop.run_until_complete(
            self.db.read(lambda conn: Exchanges(conn).get(tenant, request_id))
        )
        return None if found is None else found.user_id


@pytest.fixture
def world(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any) -> Iterator[World]:
    upstream = UpstreamConfig(
        kind="openai", base_url=fake_upstream[1], api_key="k", responses="translate"
    )
    config = Config(
        upstreams={"main": upstream},
        tenants={name: tenant_config(name) for name in ("t1", "t2", "t3")},
    )
    base = serve_proxy(config).removesuffix("/v1")
    owned: dict[tuple[str, str], dict[str, str]] = {}
    for tenant, key in ADMIN.items():
        for user in USERS:
            headers = {"authorization": f"Bearer {key}", **acting_as(tenant, user)}
            with httpx.Client(base_url=base, headers=headers) as http:
                said = f"my locker code is {secret(tenant, user)}"
                chat = http.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": said}]},
                )
                assert chat.status_code == 200, chat.text
                conversation = chat.headers["x-memory-conversation-id"]
                attachment = http.post(
                    f"/v1/memory/conversations/{conversation}/attachments",
                    json={"content": f"Notes of {user}."},
                )
                memory = http.post("/v1/memory/memories", json={"user": user, "text": said})
                response = http.post("/v1/responses", json={"model": "m", "input": said})
                assert response.status_code == 200, response.text
                owned[(tenant, user)] = {
                    "conversation": conversation,
                    "attachment": attachment.json()["id"],
                    "memory": memory.json()["id"],
                    "exchange": chat.headers["x-request-id"],
                    "response": response.json()["id"],
                }
    loop = asyncio.new_event_loop()
    db = Database("sqlite+aiosqlite:///./memproxy.db")
    with httpx.Client(base_url=base) as http:
        yield World(base, fake_upstream[0], owned, db, loop, http)
    loop.run_until_complete(db.dispose())
    loop.close()


@dataclass(frozen=True)
class Credentials:
    key: str
    signer: str | None  # the tenant whose secret signed the token; None: no token
    sub: str = "alice"
    expired: bool = False
    header: str | None = None  # X-Memory-User-Id
    body_user: str | None = None  # the protocol's own user field

    def headers(self) -> dict[str, str]:
        found = {"authorization": f"Bearer {self.key}"}
        if self.signer is not None:
            found["X-Memory-User-Token"] = token(self.signer, self.sub, expired=self.expired)
        if self.header is not None:
            found["X-Memory-User-Id"] = self.header
        return found


def allowed(c: Credentials, scope: str) -> tuple[int, str | None]:
    """The oracle: (0, user) for a request that may act as `user` alone (None: as any user
    it names, the trusted backend's key in header mode), or (status, None) for a refusal."""
    key = KEYS[c.key]
    if scope not in key.scopes:
        return 403, None
    if key.tenant not in SECRETS:  # header mode
        if c.signer is not None:
            return 400, None
        if key.user is not None and c.header not in (None, key.user):
            return 403, None
        return 0, key.user
    if c.header is not None:
        return 400, None
    if c.signer is None:
        if "chat" not in key.scopes and key.user is None:
            return 0, None  # an operator's manage-only key: any user it names
        return (0, "anonymous") if key.tenant == "t3" else (401, None)
    if c.signer != key.tenant or c.expired:
        return 401, None
    if key.user is not None and c.sub != key.user:
        return 403, None
    return 0, c.sub


users = st.sampled_from(USERS)


@st.composite
def as_a_client_would(draw: st.DrawFn) -> Credentials:
    """Credentials of the kind the tenant expects (a token of its own in token mode, no
    token in header mode), naming any user: mostly the refusals of bindings, not of form."""
    key = draw(st.sampled_from(sorted(KEYS)))
    tenant = KEYS[key].tenant
    token_mode = tenant in SECRETS
    return Credentials(
        key,
        tenant if token_mode else None,
        sub=draw(users),
        header=None if token_mode else draw(st.one_of(st.none(), users)),
        body_user=draw(st.one_of(st.none(), users)),
    )


anything = st.builds(
    Credentials,
    key=st.sampled_from(sorted(KEYS)),
    signer=st.one_of(st.none(), st.sampled_from(TOKEN_TENANTS)),
    sub=users,
    expired=st.booleans(),
    header=st.one_of(st.none(), users),
    body_user=st.one_of(st.none(), users),
)
credentials = st.one_of(as_a_client_would(), anything)


def refused_as(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_no_turn_acts_as_a_user_its_credentials_do_not_allow(world: World) -> None:
    @settings(max_examples=100, derandomize=True, deadline=None)
    @given(c=credentials, route=st.sampled_from(["chat", "responses"]), field=st.booleans())
    def one(c: Credentials, route: str, field: bool) -> None:
        status, user = allowed(c, "chat")
        tenant = KEYS[c.key].tenant
        named = {"safety_identifier" if field else "user": c.body_user} if c.body_user else {}
        ask = "what is my locker code? zebra code"
        if route == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": ask}]}
        else:
            path, body = "/v1/responses", {"input": ask}
        sent_before = len(world.upstream.chat_requests)
        response = world.http.post(path, json={"model": "m", **body, **named}, headers=c.headers())
        if status:
            refused_as(response, status)
            assert len(world.upstream.chat_requests) == sent_before  # (nothing forwarded)
            return
        assert response.status_code == 200, response.text
        acted = user or c.header or c.body_user or "anonymous"
        assert world.exchange_user(tenant, response.headers["x-request-id"]) == acted
        seen = str(world.upstream.chat_requests[-1]["messages"])
        others = [secret(t, u) for t, u in world.owned if (t, u) != (tenant, acted)]
        assert not [s for s in others if s in seen], (c, acted)

    one()


def management_calls(
    owned: dict[str, str], owner: str
) -> list[tuple[str, str, Any, dict[str, str], str]]:
    """(method, path, body, query, how another user's is refused: "id" 404, "user" 403)."""
    c, a, m, x, r = (
        owned[k] for k in ("conversation", "attachment", "memory", "exchange", "response")
    )
    return [
        ("GET", f"/v1/memory/conversations/{c}", None, {}, "id"),
        ("PATCH", f"/v1/memory/conversations/{c}", {"title": "renamed"}, {}, "id"),
        ("GET", f"/v1/memory/conversations/{c}/messages", None, {}, "id"),
        ("POST", f"/v1/memory/conversations/{c}/messages", {"messages": [{"role": "user", "content": "planted"}]}, {}, "id"),
        ("GET", f"/v1/memory/conversations/{c}/attachments", None, {}, "id"),
        ("POST", f"/v1/memory/conversations/{c}/attachments", {"content": "planted"}, {}, "id"),
        ("GET", f"/v1/memory/conversations/{c}/attachments/{a}", None, {}, "id"),
        ("GET", f"/v1/memory/memories/{m}", None, {}, "id"),
        ("PATCH", f"/v1/memory/memories/{m}", {"pinned": True}, {}, "id"),
        ("GET", f"/v1/memory/exchanges/{x}", None, {}, "id"),
        ("GET", f"/v1/responses/{r}", None, {}, "id"),
        ("GET", f"/v1/responses/{r}/input_items", None, {}, "id"),
        ("DELETE", f"/v1/memory/conversations/{c}/attachments/{a}", None, {}, "id"),
        ("DELETE", f"/v1/memory/memories/{m}", None, {}, "id"),
        ("DELETE", f"/v1/memory/conversations/{c}", None, {}, "id"),
        ("DELETE", f"/v1/responses/{r}", None, {}, "id"),
        ("GET", f"/v1/memory/users/{owner}/export", None, {}, "user"),
        ("DELETE", f"/v1/memory/users/{owner}", None, {}, "user"),
        ("GET", "/v1/memory/conversations", None, {"user": owner}, "user"),
        ("GET", "/v1/memory/memories", None, {"user": owner}, "user"),
        ("GET", "/v1/memory/usage", None, {"user": owner}, "user"),
        ("GET", "/v1/memory/jobs", None, {"user": owner}, "user"),
        ("POST", "/v1/memory/memories", {"user": owner, "text": "planted"}, {}, "user"),
        ("POST", "/v1/memory/conversations", {"user": owner}, {}, "user"),
    ]  # fmt: skip


def test_no_management_call_reaches_a_user_its_credentials_do_not_allow(world: World) -> None:
    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(c=credentials, owner=users)
    def one(c: Credentials, owner: str) -> None:
        tenant = KEYS[c.key].tenant
        for method, path, body, query, by in management_calls(world.owned[(tenant, owner)], owner):
            scope = "chat" if path.startswith("/v1/responses") else "manage"
            status, user = allowed(c, scope)
            if not status and (user is None or user == owner):
                continue  # allowed (and destructive calls would empty the world for the next)
            if not status:  # bound to another user than the owner
                status = 404 if by == "id" else 403
            headers = c.headers()
            response = world.http.request(method, path, json=body, params=query, headers=headers)
            refused_as(response, status)

    before = snapshot(world)
    one()
    assert snapshot(world) == before  # (nothing changed: every refusal changed nothing)
    lists_hold_their_user_alone(world)


def snapshot(world: World) -> dict[tuple[str, str], Any]:
    """Everything each user of each tenant holds, through the tenant's own backend."""
    found: dict[tuple[str, str], Any] = {}
    for (tenant, user), ids in world.owned.items():
        headers = {"authorization": f"Bearer {ADMIN[tenant]}", **acting_as(tenant, user)}
        exported = world.http.get(f"/v1/memory/users/{user}/export", headers=headers).json()
        exported.pop("exported_at")
        response = world.http.get(f"/v1/responses/{ids['response']}", headers=headers)
        found[(tenant, user)] = (exported, response.status_code)
    return found


def lists_hold_their_user_alone(world: World) -> None:
    """Without `?user=`, a bound key (or token) lists its own user's data only."""
    for key, token_of in (
        ("t1-alice", None),
        ("t2-alice", "t2"),
        ("t2-app", "t2"),
        ("t2-ops", "t2"),  # an operator's key with a token: that user alone
    ):
        headers = Credentials(key, token_of, sub="alice").headers()
        tenant = KEYS[key].tenant

        def get(path: str, **query: str) -> httpx.Response:
            return world.http.get(path, params=query, headers=headers)  # noqa: B023

        for path in ("/v1/memory/conversations", "/v1/memory/memories"):
            assert {x["user"] for x in get(path).json()["data"]} == {"alice"}, (key, path)
        usage = get("/v1/memory/usage").json()
        assert usage["user"] == "alice" and usage["total"]["requests"] == 2
        refused_as(get("/v1/memory/limits"), 403)
        theirs = world.owned[(tenant, "bob")]
        refused_as(get("/v1/memory/conversations", after=theirs["conversation"]), 400)
        refused_as(get("/v1/memory/memories", after=theirs["memory"]), 400)


def test_in_token_mode_only_an_operators_manage_only_key_sees_the_whole_tenant(
    world: World,
) -> None:
    """A token-mode tenant's tenant-wide views (every user's lists, usage, limits, jobs) are
    reached with a key of the `manage` scope alone, with no token; a key that can chat (the
    app's, which may sit in a browser) needs a token everywhere."""

    def get(key: str, path: str) -> httpx.Response:
        return world.http.get(path, headers={"authorization": f"Bearer {key}"})

    for path in ("/v1/memory/conversations", "/v1/memory/memories"):
        listed = get("t2-ops", path)
        assert listed.status_code == 200, listed.text
        assert {x["user"] for x in listed.json()["data"]} == set(USERS), path
        refused_as(get("t2-app", path), 401)
    assert get("t2-ops", "/v1/memory/usage").json()["total"]["requests"] == 4
    for path in ("/v1/memory/limits", "/v1/memory/jobs"):
        assert get("t2-ops", path).status_code == 200, path
        refused_as(get("t2-app", path), 401)
    # It cannot chat, and naming a user by header stays refused in token mode.
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ops = {"authorization": "Bearer t2-ops"}
    refused_as(world.http.post("/v1/chat/completions", json=chat, headers=ops), 403)
    named = world.http.get("/v1/memory/memories", headers={**ops, "X-Memory-User-Id": "alice"})
    refused_as(named, 400)
