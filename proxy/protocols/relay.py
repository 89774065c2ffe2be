"""Turning an `UpstreamReply` into the client's response, streams relayed as they arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

import structlog
from litestar import Request, Response
from litestar.response import Stream

from proxy.core.access import log_access, request_info
from proxy.core.errors import ProxyError, UpstreamError, sse_error_event
from proxy.core.shutdown import ShutdownDeadline
from proxy.upstream.base import UpstreamReply
from proxy.upstream.sse import DONE, EventTooLarge, SSEDecoder

log = structlog.get_logger("memproxy.relay")
_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class StreamObserver(Protocol):
    """Watches a relayed stream; `finish` runs before the client sees `data: [DONE]`, so what
    it stores is in place before the client can send its next request."""

    def feed(self, chunk: bytes) -> bytes:
        """Observe `chunk`; return what the client gets of it (usually `chunk` itself)."""
        ...

    def flush(self) -> bytes:
        """At the end of the stream: anything `feed` held back."""
        ...

    async def finish(self, status: str, error: str | None) -> None: ...

    def abandon(self) -> None:
        """The client went away: finish in the background (this task is being cancelled)."""
        ...

    # Where the stream's end begins in what `feed` returns (Chat Completions' `data: [DONE]`,
    # a Responses stream's last event): held back until `finish` has stored the reply.
    @property
    def end_markers(self) -> tuple[bytes, ...]: ...

    def failed(self, error: ProxyError) -> bytes:
        """The last event of a stream that broke after its first byte."""
        ...


class _Unobserved:
    end_markers: tuple[bytes, ...] = (DONE,)

    def failed(self, error: ProxyError) -> bytes:
        return sse_error_event(error)

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def flush(self) -> bytes:
        return b""

    async def finish(self, status: str, error: str | None) -> None:
        pass

    def abandon(self) -> None:
        pass


class _WholeEvents(_Unobserved):
    """An event stream passed through (`/v1/responses`, say), an event at a time: when it
    breaks, the error event that ends it does not start inside half of one."""

    def __init__(self) -> None:
        self.decoder = SSEDecoder()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self.decoder.split(chunk))

    def flush(self) -> bytes:
        return self.decoder.pending()


def done_marker(chunk: bytes, line_start: bool, markers: tuple[bytes, ...] = (DONE,)) -> int:
    """Where one of `markers` (`data: [DONE]`) first begins a line in `chunk`, or -1. The same
    bytes inside a JSON string (a model explaining SSE) do not count: a JSON string holds no
    raw newline."""
    found = -1
    for marker in markers:
        at = chunk.find(marker)
        while at >= 0 and not ((at == 0 and line_start) or chunk[at - 1 : at] == b"\n"):
            at = chunk.find(marker, at + 1)
        if at >= 0 and (found < 0 or at < found):
            found = at
    return found


def to_response(
    request: Request[Any, Any, Any],
    reply: UpstreamReply,
    *,
    headers: dict[str, str] | None = None,
    observer: StreamObserver | None = None,
    deadline: ShutdownDeadline | None = None,
) -> Response[Any]:
    out_headers = {**reply.headers, **(headers or {})}
    if reply.status >= 400:  # the upstream's own error, passed on
        request_info(request.scope).failed(reply.status, None, upstream=True)
    if reply.chunks is None:
        return Response(
            content=reply.body or b"",
            status_code=reply.status,
            headers=out_headers,
            media_type=reply.media_type,
        )
    events = reply.media_type.startswith("text/event-stream")
    if events:
        out_headers.update(_STREAM_HEADERS)
        observer = observer or _WholeEvents()
    return Stream(
        _Relayed(request, reply.chunks, observer, deadline, events=events),
        status_code=reply.status,
        headers=out_headers,
        media_type=reply.media_type,
    )


class _Relayed:
    """`relay()` as the response iterates it. A response that is never iterated (its client
    left between the response head and the first byte, so the server never starts the body)
    still ends: when it is dropped, the upstream response is closed and the exchange settles
    as a client disconnect, as `relay()` would have done."""

    def __init__(
        self,
        request: Request[Any, Any, Any],
        chunks: AsyncIterator[bytes],
        observer: StreamObserver | None,
        deadline: ShutdownDeadline | None = None,
        *,
        events: bool = True,
    ) -> None:
        self._request, self._chunks, self._observer = request, chunks, observer
        self._deadline, self._events = deadline, events
        self._loop = asyncio.get_running_loop()
        self._started = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._started = True
        return relay(
            self._request, self._chunks, self._observer, self._deadline, events=self._events
        )

    def __del__(self) -> None:
        if self._started or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(_never_relayed, self._request, self._chunks, self._observer)


_closing: set[asyncio.Task[Any]] = set()
# After `data: [DONE]` the upstream usually has only its body's end left to send: read for at
# most this long (and this much) in the background, so that its connection goes back to the
# pool instead of being closed (a new connection costs the next request a TCP connect).
DRAIN_SECONDS = 1.0
DRAIN_BYTES = 65536


def _in_background(closing: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(closing)
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def _never_relayed(
    request: Request[Any, Any, Any], chunks: AsyncIterator[bytes], observer: StreamObserver | None
) -> None:
    info = request_info(request.scope)
    info.outcome = "client_disconnected"
    log_access(request.scope, info)
    if observer is not None:
        observer.abandon()
    _in_background(_close(chunks))


async def _close(chunks: AsyncIterator[bytes]) -> None:
    """Close the upstream's response (an iterator that can be closed)."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


async def _drain(iterator: AsyncIterator[bytes], chunks: AsyncIterator[bytes]) -> None:
    """Read what follows `[DONE]` (briefly, see DRAIN_SECONDS), then close the upstream."""
    left = DRAIN_BYTES
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            async for rest in iterator:
                left -= len(rest)
                if left < 0:
                    break
    except Exception:  # (a timeout, or the upstream failing after its answer: nothing lost)
        pass
    finally:
        await _close(chunks)


async def _unguarded(next_chunk: Awaitable[bytes]) -> bytes:
    return await next_chunk


async def relay(
    request: Request[Any, Any, Any],
    chunks: AsyncIterator[bytes],
    observer: StreamObserver | None = None,
    deadline: ShutdownDeadline | None = None,
    *,
    events: bool = True,
) -> AsyncIterator[bytes]:
    """Pass chunks on as they arrive (an observer may leave out an event the client did not
    ask for); in an event stream (`events`) a failure after the first byte becomes a final
    error event, as does a shutdown's `deadline` passing while the stream waits for its next
    chunk. Any other body (a file, audio) that breaks is cut off, not ended: no final chunk,
    so the client sees it incomplete rather than whole with an error glued on.

    Closing this generator (the client went away) closes the upstream iterator, which closes
    the upstream connection and so cancels the upstream request.
    """
    info = request_info(request.scope)
    finished = observer is None
    observer = observer or _Unobserved()
    line_start = True  # whether what the client got so far ends a line
    wait = deadline.guard if deadline is not None else _unguarded
    iterator = aiter(chunks)
    answered = False  # `[DONE]` passed on: the rest of the upstream's body is drained
    try:
        while True:
            try:
                chunk = await wait(anext(iterator))
            except StopAsyncIteration:
                break
            if finished:
                yield chunk
                continue
            chunk = observer.feed(chunk)
            if not chunk:
                continue
            at = done_marker(chunk, line_start, observer.end_markers)
            line_start = chunk.endswith(b"\n")
            if at < 0:
                yield chunk
                continue
            # Hold `data: [DONE]` back until the observer has stored the reply. (A marker split
            # across two network reads is missed here; the stream's end then finishes instead.)
            if at:
                yield chunk[:at]
            finished = True
            await observer.finish("complete", None)
            yield chunk[at:]
            answered = True
            return  # nothing follows `[DONE]`: not waited for (drained in the background)
        if not finished:
            rest = observer.flush()
            finished = True
            await observer.finish("complete", None)
            if rest:
                yield rest
    except Exception as exc:  # (cancellation and GeneratorExit are not Exceptions)
        # An upstream failure, a shutdown's deadline (ProxyError) or anything unexpected: the
        # client still gets a last event saying so, and what arrived is recorded.
        if isinstance(exc, EventTooLarge):
            exc = UpstreamError(f"The upstream's stream broke: {exc}.")
        error = exc if isinstance(exc, ProxyError) else ProxyError("The stream failed.")
        info.failed(error.status, error.code, upstream=isinstance(exc, UpstreamError))
        unexpected = not isinstance(exc, ProxyError)
        log.warning(
            "stream_broken", request_id=info.request_id, error=str(exc), exc_info=unexpected
        )
        if not finished:
            finished = True
            await observer.finish("error", error.message)
        if not events:
            raise
        yield observer.failed(error)
    except (asyncio.CancelledError, GeneratorExit):
        info.outcome = "client_disconnected"
        log_access(request.scope, info)
        if not finished:
            observer.abandon()
        raise
    finally:
        if answered:
            _in_background(_drain(iterator, chunks))
        else:
            await _close(chunks)
