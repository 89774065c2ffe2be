"""A minimal HTTP/1.1 keep-alive client for the load generator.

httpx costs about 2 ms of CPU per request on this 2-core machine (h11, httpcore and anyio in
pure Python), ten times what the fake upstream needs to answer: with it the load generator,
not the proxies, becomes the bottleneck at 32 concurrent clients. This client speaks just
enough HTTP/1.1 for the benchmark (POST, `content-length` or chunked replies, keep-alive) and
hands out each body chunk as it arrives, so time to first token is measured faithfully.
Its responses look like httpx's where the benchmark needs them (`status_code`, `aiter_raw`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit


class ProtocolError(Exception):
    """The server's reply is not HTTP/1.1 this client understands."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class Response:
    def __init__(self, status_code: int, headers: dict[bytes, bytes], conn: _Connection) -> None:
        self.status_code = status_code
        self.headers = headers
        self._conn = conn
        self.complete = False
        length = headers.get(b"content-length")
        self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        self._remaining = int(length) if length is not None else None
        if not self._chunked and self._remaining is None:
            raise ProtocolError("reply has neither content-length nor chunked encoding")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives (chunked encoding removed)."""
        reader = self._conn.reader
        if not self._chunked:
            assert self._remaining is not None
            while self._remaining > 0:
                data = await reader.read(min(self._remaining, 65536))
                if not data:
                    raise ProtocolError("connection closed mid-body")
                self._remaining -= len(data)
                yield data
            self.complete = True
            return
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                # No trailers are expected: the blank line ends the message.
                if await reader.readuntil(b"\r\n") != b"\r\n":
                    raise ProtocolError("unexpected trailers")
                self.complete = True
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])


class Client:
    """Keep-alive connections to one `http://host:port`, reused last in, first out."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"expected http://host:port, got {base_url!r}")
        self._host, self._port = parts.hostname, parts.port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        self._host_line = f"host: {self._host}:{self._port}\r\n".encode("latin-1")
        self._idle: list[_Connection] = []

    @asynccontextmanager
    async def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        """`headers`: this request's own, after the client's."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode("latin-1")
        request = (
            b"POST "
            + path.encode("latin-1")
            + b" HTTP/1.1\r\n"
            + self._host_line
            + self._head
            + extra
            + b"content-length: %d\r\n\r\n" % len(body)
            + body
        )
        conn, response = await self._send(request)
        try:
            yield response
        finally:
            reusable = (
                response.complete and response.headers.get(b"connection", b"").lower() != b"close"
            )
            if reusable:
                self._idle.append(conn)
            else:
                conn.close()

    async def _send(self, request: bytes) -> tuple[_Connection, Response]:
        """Send on an idle connection, or a new one if the server has closed it meanwhile
        (uvicorn closes keep-alive connections idle for 5 s)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.reader.at_eof():
                conn.close()
                continue
            try:
                conn.writer.write(request)
                return conn, await self._read_head(conn)
            except (ConnectionError, ProtocolError):
                conn.close()  # closed by the server before it read the request: retry
        conn = await self._connect()
        try:
            conn.writer.write(request)
            return conn, await self._read_head(conn)
        except BaseException:
            conn.close()
            raise

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        return _Connection(reader, writer)

    async def _read_head(self, conn: _Connection) -> Response:
        try:
            head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("connection closed before the reply") from exc
        status_line, *lines = head[:-4].split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {status_line!r}")
        headers: dict[bytes, bytes] = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return Response(int(parts[1]), headers, conn)

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
