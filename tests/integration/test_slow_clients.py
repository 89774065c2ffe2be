"""Clients that send their request slowly, as a slowloris attack does, against `memproxy
serve` itself (the headers' limit is the server's, not the app's): a request whose headers
dribble in is cut off after `server.header_timeout_seconds`; one whose headers are whole is
not, however long its body or its answer then takes (those have limits of their own)."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.core.slow_headers import bounded_headers
from tests.fakes.server import ServerThread
from tests.processes import Replica, spawn, stop, wait_ready

KEY = "slow-key"
HEADER_TIMEOUT = 1.0
# Far beyond the limit: a connection still open then was never going to be closed.
GIVE_UP = 20.0


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    """One server for the module's tests (starting one takes seconds)."""
    tmp_path = tmp_path_factory.mktemp("slow")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"header_timeout_seconds": HEADER_TIMEOUT},
                "database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"},
                "upstreams": {"echo": {"kind": "echo"}},
                "tenants": {"t1": {"api_keys": [KEY], "upstream": "echo"}},
            }
        )
    )
    server = spawn("slow", config, tmp_path)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def connect(replica: Replica) -> socket.socket:
    return socket.create_connection(("127.0.0.1", replica.port), timeout=GIVE_UP)


def dribble(conn: socket.socket, lines: Iterator[bytes], pause: float) -> bytes | None:
    """Send `lines` one every `pause` seconds until the server answers or closes; what it
    sent then (b"" for a bare close), or None if it never did."""
    deadline = time.monotonic() + GIVE_UP
    for line in lines:
        readable, _, _ = select.select([conn], [], [], pause)
        if readable:
            return read_all(conn)
        if time.monotonic() > deadline:
            return None
        try:
            conn.sendall(line)
        except OSError:  # (closed under us: read what came before)
            return read_all(conn)
    return None


def read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def endless_headers() -> Iterator[bytes]:
    yield b"GET /healthz HTTP/1.1\r\nhost: proxy\r\n"
    n = 0
    while True:
        n += 1
        yield f"x-slow-{n}: still coming\r\n".encode()


def test_headers_that_dribble_in_are_cut_off_with_a_408(replica: Replica) -> None:
    # A header line every 0.25 s: each within the limit, the headers never whole.
    with connect(replica) as conn:
        answer = dribble(conn, endless_headers(), 0.25)
    assert answer is not None, f"still open after {GIVE_UP:.0f} s of header lines"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_connection_that_sends_nothing_is_closed(replica: Replica) -> None:
    with connect(replica) as conn:
        readable, _, _ = select.select([conn], [], [], GIVE_UP)
        assert readable, f"still open after {GIVE_UP:.0f} s of silence"
        assert read_all(conn) == b""


def test_whole_headers_leave_the_body_and_the_next_request_their_own_time(
    replica: Replica,
) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(replica) as conn:
        # Headers in two quick parts, then the body a few bytes every 0.25 s: several header
        # timeouts in all, and the body's limit (60 s between parts) never reached.
        conn.sendall(head[:20])
        conn.sendall(head[20:])
        parts = [body[i : i + 4] for i in range(0, len(body), 4)]
        assert len(parts) * 0.25 > 2 * HEADER_TIMEOUT
        answer = dribble(conn, iter(parts), 0.25)
        assert answer is None or answer == b"", answer  # (nothing before the whole body)
        assert status_of(conn) == 200
        # The same connection, kept alive: the next request's headers are timed afresh.
        conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: proxy\r\n\r\n")
        assert status_of(conn) == 200


def status_of(conn: socket.socket) -> int:
    """The status of the response the server sends next on `conn`, read whole."""
    response = http.client.HTTPResponse(conn)
    response.begin()
    response.read()
    return response.status


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The smallest ASGI app: 200 to every request."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("base", [H11Protocol, HttpToolsProtocol], ids=["h11", "httptools"])
def test_either_of_uvicorns_http_protocols_bounds_the_headers(base: type[asyncio.Protocol]) -> None:
    # `memproxy serve` takes uvicorn's choice (httptools when installed, else h11).
    with ServerThread(_ok, http=bounded_headers(0.5, base), lifespan="off") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=GIVE_UP) as conn:
            answer = dribble(conn, endless_headers(), 0.1)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answer
        with socket.create_connection(("127.0.0.1", server.port), timeout=GIVE_UP) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert status_of(conn) == 200
            time.sleep(1.0)  # (idle between requests: uvicorn's keep-alive timeout, 5 s)
            conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert status_of(conn) == 200
