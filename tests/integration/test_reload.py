"""SIGHUP reloads config.yaml in a running `memproxy serve`: a new key works (key rotation), a
new tenant is served, a removed key is refused, limits change, a stream in flight finishes
untouched, a file that does not load changes nothing, and `database:` needs a restart."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import yaml

from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread
from tests.processes import Replica, spawn, stop, wait_ready

OLD, NEW, OTHER = "old-key", "new-key", "other-key"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}


def settings(database: str, upstream_url: str, tenants: dict[str, Any]) -> dict[str, Any]:
    return {
        "database": {"url": database},
        "upstreams": {"main": {"kind": "openai", "base_url": upstream_url + "/v1"}},
        "tenants": tenants,
    }


def status(replica: Replica, key: str) -> int:
    return httpx.post(
        replica.url + "/chat/completions",
        json=BODY,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ).status_code


def until(check: Any, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "the reload did not take effect"
        time.sleep(0.05)


def test_sighup_reloads_keys_tenants_and_limits_without_dropping_a_stream(
    tmp_path: Path,
) -> None:
    fake = FakeOpenAI(chunk_delay=0.3)  # a streamed reply takes a few seconds
    database = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    with ServerThread(fake) as upstream:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                settings(database, upstream.url, {"t1": {"api_keys": [OLD], "upstream": "main"}})
            )
        )
        replica = spawn("reloaded", config, tmp_path, log_level="info")
        try:
            wait_ready(replica)
            assert (status(replica, OLD), status(replica, NEW), status(replica, OTHER)) == (
                200,
                401,
                401,
            )
            with (
                httpx.Client(timeout=60) as client,
                client.stream(
                    "POST",
                    replica.url + "/chat/completions",
                    json={**BODY, "stream": True},
                    headers={"authorization": f"Bearer {OLD}"},
                ) as streaming,
            ):
                assert streaming.status_code == 200
                # Rotation: both keys for a while; a second tenant; t1 gets an rpm limit.
                tenants = {
                    "t1": {"api_keys": [OLD, NEW], "upstream": "main", "limits": {"rpm": 2}},
                    "t2": {"api_keys": [OTHER], "upstream": "main"},
                }
                config.write_text(yaml.safe_dump(settings(database, upstream.url, tenants)))
                replica.process.send_signal(signal.SIGHUP)
                until(lambda: status(replica, OTHER) == 200)
                body = b"".join(streaming.iter_bytes())
            assert body.rstrip().endswith(b"data: [DONE]")  # the stream was not cut
            # rpm 2 counts from the reload on: NEW uses one, OLD one, then the limit holds
            # (all three in one calendar minute).
            if (left := 60.0 - time.time() % 60.0) < 5.0:
                time.sleep(left + 0.05)
            assert [status(replica, NEW), status(replica, OLD), status(replica, NEW)] == [
                200,
                200,
                429,
            ]

            # The end of the rotation: the old key goes.
            tenants["t1"] = {"api_keys": [NEW], "upstream": "main"}
            config.write_text(yaml.safe_dump(settings(database, upstream.url, tenants)))
            replica.process.send_signal(signal.SIGHUP)
            until(lambda: status(replica, OLD) == 401)
            assert status(replica, NEW) == 200  # and without the limit now

            # A file that does not load, then a change that needs a restart: neither applies.
            config.write_text("tenants: {t1: {api_keys: [x], context: {token_budget: lots}}}")
            replica.process.send_signal(signal.SIGHUP)
            until(lambda: "config_reload_failed" in replica.log.read_text(errors="replace"))
            assert (status(replica, NEW), status(replica, OLD)) == (200, 401)  # as it was
            moved = settings(f"sqlite+aiosqlite:///{tmp_path / 'elsewhere.db'}", upstream.url, {})
            moved["tenants"] = {"t1": {"api_keys": [NEW, OLD], "upstream": "main"}}
            config.write_text(yaml.safe_dump(moved))
            replica.process.send_signal(signal.SIGHUP)
            until(lambda: status(replica, OLD) == 200)  # the tenants did change
            assert replica.process.poll() is None
        finally:
            stop(replica)
    log = replica.log.read_text(errors="replace")
    assert "token_budget" in log  # the failed reload named the key
    assert "config_reload_needs_restart" in log and "database" in log
    assert not (tmp_path / "elsewhere.db").exists()


def test_sighup_picks_up_key_bindings_and_identity_settings(tmp_path: Path) -> None:
    """A key bound to a user, token mode turned on, its secret rotated and a key file that
    does not load: each reload takes effect on the next request (or, the bad one, none)."""

    def token(secret: str) -> str:
        return jwt.encode({"sub": "alice", "exp": int(time.time()) + 600}, secret, "HS256")

    def asks(user: str | None = None, token: str | None = None) -> int:
        headers = {"authorization": f"Bearer {OLD}"}
        if user is not None:
            headers["X-Memory-User-Id"] = user
        if token is not None:
            headers["X-Memory-User-Token"] = token
        url = replica.url + "/chat/completions"
        return httpx.post(url, json=BODY, headers=headers, timeout=30).status_code

    first, second = "first-signing-secret-" + "1" * 32, "second-signing-secret-" + "2" * 32
    database = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    with ServerThread(FakeOpenAI()) as upstream:
        config = tmp_path / "config.yaml"

        def write(t1: dict[str, Any]) -> None:
            config.write_text(yaml.safe_dump(settings(database, upstream.url, {"t1": t1})))
            replica.process.send_signal(signal.SIGHUP)

        config.write_text(
            yaml.safe_dump(
                settings(database, upstream.url, {"t1": {"api_keys": [OLD], "upstream": "main"}})
            )
        )
        replica = spawn("identities", config, tmp_path, log_level="info")
        try:
            wait_ready(replica)
            assert asks("bob") == 200
            write({"api_keys": [{"key": OLD, "user": "alice"}], "upstream": "main"})
            until(lambda: asks("bob") == 403)
            assert asks("alice") == 200
            identity = {"mode": "token", "algorithms": ["HS256"], "secret": first}
            write({"api_keys": [OLD], "upstream": "main", "identity": identity})
            until(lambda: asks() == 401)
            assert (asks(token=token(first)), asks("alice", token(first))) == (200, 400)
            write(
                {"api_keys": [OLD], "upstream": "main", "identity": {**identity, "secret": second}}
            )
            until(lambda: asks(token=token(first)) == 401)
            assert asks(token=token(second)) == 200
            missing = {"mode": "token", "algorithms": ["RS256"], "public_key_file": "nope.pem"}
            write({"api_keys": [OLD], "upstream": "main", "identity": missing})
            until(lambda: "nope.pem" in replica.log.read_text(errors="replace"))
            assert asks(token=token(second)) == 200  # (as it was)
        finally:
            stop(replica)
