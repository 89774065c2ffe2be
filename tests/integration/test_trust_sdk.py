"""The trust model (docs/trust-model.md) with the official openai client against the real
server: a key bound to a user, signed user tokens (as a browser would send them, CORS
included), a repeated header, and idempotency keys that are each user's own."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import openai
import pytest

from proxy.core.config import (
    ApiKeyConfig,
    Config,
    IdentityConfig,
    MemorySettings,
    ServerConfig,
    TenantConfig,
    UpstreamConfig,
)
from tests.fakes.openai_upstream import FakeOpenAI

BACKEND, ALICE_KEY = "backend-key", "alice-key"
APP_KEY, SECRET = "browser-app-key", "token-tenant-signing-secret-" + "x" * 32
OTHER_SECRET = "another-tenant-signing-secret-" + "y" * 32
ORIGIN = "https://app.example"
MESSAGES: Any = [{"role": "user", "content": "remember my locker code zebra1234"}]


@pytest.fixture
def proxy(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any) -> Iterator[str]:
    """`hdr`: header mode, a backend key and a key bound to alice; `tok`: token mode (HS256);
    `tok2`: token mode with a secret of its own."""
    upstream = UpstreamConfig(
        kind="openai", base_url=fake_upstream[1], api_key="k", responses="translate"
    )
    off = MemorySettings(embeddings="off")

    def token_tenant(key: str, secret: str) -> TenantConfig:
        identity = IdentityConfig(mode="token", algorithms=["HS256"], secret=secret)
        return TenantConfig(api_keys=[key], upstream="main", identity=identity, memory=off)

    config = Config(
        server=ServerConfig(cors_origins=[ORIGIN]),
        upstreams={"main": upstream},
        tenants={
            "hdr": TenantConfig(
                api_keys=[BACKEND, ApiKeyConfig(key=ALICE_KEY, user="alice")],
                upstream="main",
                memory=off,
            ),
            "tok": token_tenant(APP_KEY, SECRET),
            "tok2": token_tenant("other-app-key", OTHER_SECRET),
        },
    )
    yield serve_proxy(config)


def user_token(sub: str, secret: str = SECRET, lifetime: int = 300) -> str:
    """What the application's backend signs for its signed-in user (docs/trust-model.md)."""
    now = int(time.time())
    return jwt.encode({"sub": sub, "iat": now, "exp": now + lifetime}, secret, algorithm="HS256")


def exchange_user(proxy: str, request_id: str) -> str:
    """The user an exchange of tenant `hdr` was stored for, as its backend sees it."""
    with httpx.Client(headers={"authorization": f"Bearer {BACKEND}"}) as http:
        found = http.get(f"{proxy}/memory/exchanges/{request_id}")
        assert found.status_code == 200, found.text
        return str(found.json()["user"])


def test_a_bound_key_acts_as_its_user_only(proxy: str) -> None:
    with openai.OpenAI(base_url=proxy, api_key=ALICE_KEY, max_retries=0) as client:
        # The body's user fields are forwarded, and decide nothing.
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, user="bob", safety_identifier="bob"
        )
        assert exchange_user(proxy, raw.headers["x-request-id"]) == "alice"
        raw = client.responses.with_raw_response.create(model="m", input="hi", user="bob")
        assert exchange_user(proxy, raw.headers["x-request-id"]) == "alice"
        # Naming another user is refused, in OpenAI's error shape.
        with pytest.raises(openai.PermissionDeniedError) as denied:
            client.chat.completions.create(
                model="m", messages=MESSAGES, extra_headers={"X-Memory-User-Id": "bob"}
            )
        assert denied.value.code == "user_not_allowed"
        assert "alice" in denied.value.message and denied.value.body["param"] == "X-Memory-User-Id"
        # Naming its own user is fine; the passed-through endpoints are the tenant's.
        client.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"X-Memory-User-Id": "alice"}
        )
        assert client.embeddings.create(model="text-embedding-3-small", input="hi").data
        # Its management API is alice's: bob's data is another user's.
        with httpx.Client(base_url=proxy, headers={"authorization": f"Bearer {ALICE_KEY}"}) as http:
            listed = http.get("/memory/conversations").json()["data"]
            assert listed and {c["user"] for c in listed} == {"alice"}
            assert http.get("/memory/users/bob/export").status_code == 403
            assert http.get("/memory/users/alice/export").json()["user"] == "alice"
            assert http.delete("/memory/users/bob").status_code == 403
            assert http.delete("/memory/users/alice").status_code == 200  # (its own: erased)
            assert http.get("/memory/conversations").json()["data"] == []


def test_token_mode_takes_the_user_from_a_signed_token(proxy: str) -> None:
    with contextlib.ExitStack() as opened:  # (every client closed at the end)

        def client(token: str | None = None, **headers: str) -> openai.OpenAI:
            if token is not None:
                headers["X-Memory-User-Token"] = token
            made = openai.OpenAI(
                base_url=proxy, api_key=APP_KEY, max_retries=0, default_headers=headers
            )
            return opened.enter_context(made)

        carol = client(user_token("carol"))
        carol.chat.completions.create(model="m", messages=MESSAGES, user="mallory")
        stream = carol.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        carol.responses.create(model="m", input="hi")
        mine = {"authorization": f"Bearer {APP_KEY}", "X-Memory-User-Token": user_token("carol")}
        with httpx.Client(base_url=proxy, headers=mine) as http:
            listed = http.get("/memory/conversations").json()["data"]
            assert listed and {c["user"] for c in listed} == {"carol"}  # (not mallory)
            assert http.get("/memory/users/mallory/export").status_code == 403
        failures = {
            "no token": client(),
            "expired": client(user_token("carol", lifetime=-120)),
            "another tenant's": client(user_token("carol", OTHER_SECRET)),
            "unsigned": client(user_token("carol")[: -len("signature")] + "x" * 9),
        }
        for name, bad in failures.items():
            with pytest.raises(openai.AuthenticationError) as refused:
                bad.chat.completions.create(model="m", messages=MESSAGES)
            assert refused.value.code == "invalid_user_token", name
        with pytest.raises(openai.BadRequestError) as header:
            client(user_token("carol"), **{"X-Memory-User-Id": "carol"}).models.list()
        assert header.value.code == "user_header_not_accepted"


def test_a_browser_may_send_the_token_across_origins(proxy: str) -> None:
    preflight = httpx.options(
        f"{proxy}/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-memory-user-token",
        },
    )
    assert preflight.status_code in (200, 204), preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert "x-memory-user-token" in allowed or allowed == "*"


def test_a_memory_header_given_twice_is_a_400(proxy: str) -> None:
    """A gateway that appends its X-Memory-User-Id rather than replacing the client's: the
    first one used to win, and the client chose the user."""
    for name in ("X-Memory-User-Id", "X-Memory-Mode", "X-Memory-Conversation-Id"):
        headers = [("authorization", f"Bearer {BACKEND}"), (name, "bob"), (name, "alice")]
        if name == "X-Memory-Mode":
            headers[1:] = [(name, "off"), (name, "full")]
        answer = httpx.post(
            f"{proxy}/chat/completions", json={"model": "m", "messages": MESSAGES}, headers=headers
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "duplicate_header"
        assert answer.json()["error"]["param"] == name


def test_idempotency_keys_are_each_users_own(proxy: str) -> None:
    """Two users whose clients happen to send the same Idempotency-Key (a hash of the same
    prompt, say): the second was a 422, and a retry of the first user's would have been
    answered with the first user's conversation."""
    client = openai.OpenAI(base_url=proxy, api_key=BACKEND, max_retries=0)
    said = {}
    for user in ("alice", "bob"):
        raw = client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": f"I am {user}"}],
            extra_headers={"Idempotency-Key": "same-key", "X-Memory-User-Id": user},
        )
        said[user] = raw.headers["x-memory-conversation-id"]
        assert exchange_user(proxy, raw.headers["x-request-id"]) == user
    assert said["alice"] != said["bob"]
    with httpx.Client(headers={"authorization": f"Bearer {BACKEND}"}) as http:
        bob = http.get(f"{proxy}/memory/conversations/{said['bob']}/messages").json()["data"]
    assert [m["content"] for m in bob][:1] == ["I am bob"]
