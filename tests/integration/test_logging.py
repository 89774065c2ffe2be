"""What a running server writes to its log: never message content unless `server.log_content`
says so, and never an API key (the tenant's or the upstream's)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.openai_upstream import FakeOpenAI, error_reply, model_said
from tests.fakes.server import ServerThread
from tests.polling import until
from tests.processes import ROOT, Replica, spawn, stop, wait_ready

KEY = "sk-tenant-key-0123456789"
UPSTREAM_KEY = "sk-upstream-key-9876543210"
SECRET = "my bank PIN is 4921-XYZZY"


@pytest.mark.parametrize("log_content", [False, True])
def test_content_is_logged_only_when_asked_and_keys_never(
    log_content: bool, tmp_path: Path
) -> None:
    fake = FakeOpenAI()
    with ServerThread(fake) as upstream:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "server": {"log_content": log_content},
                    "database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"},
                    "upstreams": {
                        "main": {
                            "kind": "openai",
                            "base_url": upstream.url + "/v1",
                            "api_key": UPSTREAM_KEY,
                        }
                    },
                    "tenants": {"t1": {"api_keys": [KEY], "upstream": "main"}},
                }
            )
        )
        replica = spawn("logged", config, tmp_path, log_level="info")
        try:
            wait_ready(replica)
            headers = {"authorization": f"Bearer {KEY}", "x-memory-user-id": "u1"}
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": SECRET}]}
            for stream in (False, True):
                answer = httpx.post(
                    replica.url + "/chat/completions",
                    json={**body, "stream": stream},
                    headers=headers,
                    timeout=30,
                )
                assert answer.status_code == 200
            refused = httpx.post(
                replica.url + "/chat/completions",
                json=body,
                headers={"authorization": "Bearer sk-wrong-key-5555"},
                timeout=30,
            )
            assert refused.status_code == 401
            fake.script.append(error_reply(400, "bad request upstream"))
            failed = httpx.post(
                replica.url + "/chat/completions", json=body, headers=headers, timeout=30
            )
            assert failed.status_code == 400
        finally:
            stop(replica)
    assert len(fake.chat_requests) == 3
    log = replica.log.read_text(errors="replace")
    assert "request_id" in log  # (the access lines are there)
    # Each access line says how the request ended, and an error's code.
    access = [
        (re.search(r"status=(\d+)", line), re.search(r"outcome=(\w+)", line), line)
        for line in log.splitlines()
        if "path=/v1/chat/completions" in line and "outcome=" in line
    ]
    assert [(s and s[1], o and o[1]) for s, o, _ in access] == [
        ("200", "ok"),
        ("200", "ok"),
        ("401", "refused"),
        ("400", "upstream_error"),
    ]
    assert "code=invalid_api_key" in access[2][2]
    assert (SECRET in log) is log_content
    assert ("fake reply to: " + SECRET in log) is log_content
    for key in (KEY, UPSTREAM_KEY, "sk-wrong-key-5555"):
        assert key not in log


def test_json_logs_are_json_throughout_and_probes_stay_quiet(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    database = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    config.write_text(
        yaml.safe_dump({"database": {"url": database}, "tenants": {"t1": {"api_keys": [KEY]}}})
    )
    replica = spawn("json", config, tmp_path, log_level="info", log_format="json")
    try:
        wait_ready(replica)
        base = replica.url.removesuffix("/v1")
        for probe in ("/healthz", "/readyz"):
            assert httpx.get(base + probe, timeout=30).status_code == 200
            assert httpx.head(base + probe, timeout=30).status_code == 200  # (uptime monitors)
        answer = httpx.post(
            replica.url + "/chat/completions",
            json={"model": "echo-1", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert answer.status_code == 200
    finally:
        stop(replica)
    lines = [json.loads(line) for line in replica.log.read_text().splitlines() if line.strip()]
    events = [line["event"] for line in lines]
    # uvicorn's and Alembic's records are JSON too, with their logger's name.
    assert any(line.get("logger") == "alembic.runtime.migration" for line in lines)
    assert any(line.get("logger") == "uvicorn.error" for line in lines)
    # One line at start-up says what the server runs with, before uvicorn takes requests.
    started = next(line for line in lines if line["event"] == "started")
    assert (started["tenants"], started["upstreams"], started["database"]) == (
        1,
        ["echo"],
        database,
    )
    assert events.index("started") < events.index("Application startup complete.")
    # The probes' answers are not logged at info; the chat request is.
    paths = [line["path"] for line in lines if line["event"] == "request"]
    assert paths == ["/v1/chat/completions"]


def test_litellm_records_come_once_as_json_and_not_its_debug_lines() -> None:
    script = """
import logging, warnings
from proxy.core.offline import prepare_offline_environment
from proxy.core.logs import configure_logging
from proxy.upstream.litellm import _import_litellm
prepare_offline_environment()
configure_logging("debug", "json")
_import_litellm()
logging.getLogger("LiteLLM").debug("POST Request Sent: my bank PIN")
logging.getLogger("LiteLLM").warning("litellm says")
warnings.warn("deprecated thing")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert [(line["logger"], line["event"]) for line in lines if "logger" in line] == [
        ("LiteLLM", "litellm says"),
        ("py.warnings", lines[-1]["event"]),
    ]
    assert "deprecated thing" in lines[-1]["event"] and "PIN" not in done.stderr


def test_a_client_that_leaves_before_its_whole_reply_is_logged_as_gone(tmp_path: Path) -> None:
    """A whole reply has nothing to send until it is ready, so nothing fails when its client
    has gone: the reply is still stored, and the access line says the client left."""
    fake = FakeOpenAI()
    fake.script.append(dataclasses.replace(model_said("Kept anyway."), hold=True))
    with ServerThread(fake) as upstream:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"},
                    "upstreams": {"main": {"kind": "openai", "base_url": upstream.url + "/v1"}},
                    "tenants": {"t1": {"api_keys": [KEY], "upstream": "main"}},
                }
            )
        )
        replica = spawn("gone", config, tmp_path, log_level="info", log_format="json")
        try:
            wait_ready(replica)
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            with socket.create_connection(("127.0.0.1", replica.port)) as client:
                client.sendall(
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n"
                    f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
                    "x-memory-user-id: alice\r\nx-memory-conversation-id: left\r\n"
                    f"content-length: {len(body)}\r\n\r\n{body}".encode()
                )
                until(lambda: len(fake.chat_requests) == 1, "the request reached the upstream")
            fake.release.set()
            until(lambda: access_lines(replica), "the access line")
            headers = {"authorization": f"Bearer {KEY}"}
            stored = httpx.get(
                replica.url + "/memory/conversations/left/messages", headers=headers, timeout=30
            )
            answered = httpx.post(
                replica.url + "/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "still there"}]},
                headers=headers,
                timeout=30,
            )
            assert answered.status_code == 200
        finally:
            stop(replica)
    reply = stored.json()["data"][-1]
    assert (reply["role"], reply["content"], reply["status"]) == (
        "assistant",
        "Kept anyway.",
        "complete",
    )
    gone, waited = access_lines(replica)
    assert (gone["status"], gone["outcome"]) == (200, "client_disconnected")
    assert (waited["status"], waited["outcome"]) == (200, "ok")


def access_lines(replica: Replica) -> list[dict[str, Any]]:
    """The chat completions' access lines a JSON-logging replica wrote so far."""
    lines = [json.loads(line) for line in replica.log.read_text().splitlines() if line.strip()]
    return [
        line
        for line in lines
        if line["event"] == "request" and line["path"] == "/v1/chat/completions"
    ]


def test_a_client_that_leaves_mid_body_is_a_client_disconnect_not_a_500(tmp_path: Path) -> None:
    """A request whose client closes the connection before its whole body arrived is the
    client's doing: logged and counted as a disconnect (status 499, as nginx logs it), never
    as the server's error."""
    fake = FakeOpenAI()
    with ServerThread(fake) as upstream:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"},
                    "upstreams": {"main": {"kind": "openai", "base_url": upstream.url + "/v1"}},
                    "tenants": {"t1": {"api_keys": [KEY], "upstream": "main"}},
                }
            )
        )
        replica = spawn("halfbody", config, tmp_path, log_level="info", log_format="json")
        try:
            wait_ready(replica)
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            for path in ("/v1/chat/completions", "/v1/memory/conversations"):
                with socket.create_connection(("127.0.0.1", replica.port)) as client:
                    client.sendall(
                        f"POST {path} HTTP/1.1\r\nhost: proxy\r\n"
                        f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\n\r\n{body[: len(body) // 2]}".encode()
                    )
            until(lambda: len(requests_logged(replica)) == 2, "both access lines")
            metrics = httpx.get(replica.url.removesuffix("/v1") + "/metrics", timeout=30).text
        finally:
            stop(replica)
    assert fake.chat_requests == []
    lines = requests_logged(replica)
    assert [(line["path"], line["status"], line["outcome"]) for line in lines] == [
        ("/v1/chat/completions", 499, "client_disconnected"),
        ("/v1/memory/conversations", 499, "client_disconnected"),
    ]
    log = replica.log.read_text()
    assert "unhandled_error" not in log and "Traceback" not in log
    assert 'memproxy_request_body_disconnects_total{tenant="t1"} 2.0' in metrics
    assert 'status="500"' not in metrics


def requests_logged(replica: Replica) -> list[dict[str, Any]]:
    """Every access line (but the probes') a JSON-logging replica wrote so far."""
    lines = [json.loads(line) for line in replica.log.read_text().splitlines() if line.strip()]
    return [line for line in lines if line["event"] == "request" and line["status"] != 200]
