"""A request body that stops arriving is answered 408 (`RequestTimeout`) and its connection
closed, instead of holding them and the handler for as long as the client likes: the ASGI
server waits for a body without a limit of its own. The limit is on each wait for the next
part (nginx's client_body_timeout), so a large body sent slowly but steadily is read whole.

A client that closes its connection before its body is whole raises `ClientDisconnected`
(499, as nginx logs it), where Litestar would raise a 500 of its own: the access line and the
metrics say the client left, not that the server failed.

(The request's headers are read before the app is called: their time limit is the server's,
proxy/core/slow_headers.py.)
"""

from __future__ import annotations

import asyncio

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, ReceiveMessage, Scope, Send

from proxy.core.errors import ClientDisconnected, RequestTimeout

CLOSE = {"connection": "close"}


def limit_body_waits(app: ASGIApp, seconds: float) -> ASGIApp:
    """`app` whose requests' `receive` raises `RequestTimeout` when a part of the body takes
    more than `seconds` to arrive; once the body is in, `receive` is the server's own again
    (a stream waits on it for the client's disconnect for as long as the stream lasts)."""

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        reading = True

        async def receive_in_time() -> ReceiveMessage:
            nonlocal reading
            if not reading:
                return await receive()
            try:
                async with asyncio.timeout(seconds):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"The request body stopped arriving: nothing more of it for {seconds:g} s.",
                    headers=CLOSE,  # (else the server would keep waiting for the rest)
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnected("The client closed the connection before the whole body.")
            reading = message["type"] == "http.request" and message.get("more_body", False)
            return message

        await app(scope, receive_in_time, send)

    return handle
