"""A request whose headers do not arrive whole within `server.header_timeout_seconds` has its
connection closed (with a 408 when part of the request came), as nginx's
`client_header_timeout`: uvicorn bounds only the idle time between two requests
(`timeout_keep_alive`), so a client sending a header line every few seconds held a connection,
and a slot of the server, for as long as it liked (two such clients stayed 70 s).

The headers are read by the server before the app is called, so the limit lives in the
server's protocol: `bounded_headers` is uvicorn's HTTP protocol class (httptools or h11,
whichever it would use) with a timer per connection, armed when a connection opens and when
the first bytes of a request arrive after an answered one, and stopped when the request's
headers are whole (uvicorn then starts the request's cycle). Between requests uvicorn's own
keep-alive timeout applies; the body's waits are the app's (proxy/core/slow_bodies.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import structlog
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from proxy.core.errors import RequestTimeout

log = structlog.get_logger("memproxy.server")


def _timeout_response(seconds: float) -> bytes:
    error = RequestTimeout(f"The request's headers did not arrive within {seconds:g} s.")
    body = msgspec.json.encode(error.body())
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def bounded_headers(seconds: float, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol class `base` (give it as `uvicorn.Config(http=...)`) whose
    connections are closed when a request's headers take more than `seconds`."""
    answer = _timeout_response(seconds)

    class BoundedHeaders(base):  # type: ignore[valid-type,misc]
        _header_timer: asyncio.TimerHandle | None = None
        _partial = False  # some of the request arrived (answered 408, not just closed)

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()  # (a connection that sends nothing at all is closed too)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if self._header_timer is None and (before is None or before.response_complete):
                self._arm()  # a new request begins
            if self._header_timer is not None:
                self._partial = True
            super().data_received(data)
            if self.cycle is not before:  # its headers are whole: the request has begun
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._partial = False
            self._header_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            transport: Any = self.transport
            if transport.is_closing():
                return
            if self._partial:
                log.info("request_header_timeout", client=_client(self.client), seconds=seconds)
                transport.write(answer)
            transport.close()

    BoundedHeaders.__name__ = BoundedHeaders.__qualname__ = f"BoundedHeaders{base.__name__}"
    return BoundedHeaders


def _client(address: tuple[str, int] | None) -> str | None:
    return None if address is None else f"{address[0]}:{address[1]}"
