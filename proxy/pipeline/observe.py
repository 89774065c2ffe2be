"""Observe: the reply as it comes back. A stream is watched one whole SSE event at a time by
the protocol's reader (never changing what the client gets, but the usage chunk it did not ask
for), and the exchange settles when it ends, before the client sees its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from proxy.core.errors import ProxyError
from proxy.pipeline.wire import StreamReader
from proxy.upstream.sse import NotUnderstood, SSEDecoder, error_text

log = structlog.get_logger("memproxy.pipeline")


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a watched stream ended: the exchange's status and error, the reply (None if
    nothing arrived), its usage, and when its first chunk came."""

    status: str
    error: str | None
    reply: dict[str, Any] | None
    usage: dict[str, Any] | None
    first_chunk_at: float | None
    native: dict[str, Any] | None = None


class StreamWatch:
    """Reassembles a streamed reply through the protocol's reader and settles the exchange
    when the stream ends (`settle`), shielded from a client that leaves."""

    def __init__(
        self,
        reader: StreamReader,
        *,
        request_id: str,
        settle: Callable[[StreamEnd], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]],
    ) -> None:
        self.reader = reader
        self.request_id = request_id
        self._settle, self._spawn = settle, spawn
        self.decoder = SSEDecoder()
        self.first_chunk_at: float | None = None
        self.broken: str | None = None  # why reassembling stopped (an event not understood)

    @property
    def end_markers(self) -> tuple[bytes, ...]:
        return self.reader.end_markers

    def failed(self, error: ProxyError) -> bytes:
        return self.reader.failed(error)

    def feed(self, chunk: bytes) -> bytes:
        if self.first_chunk_at is None:
            self.first_chunk_at = time.perf_counter()
        # Whole events only: an event can be left out wherever it falls, and a stream that
        # breaks ends with an error event of its own, not glued to half of one.
        return b"".join(self._read(raw) for raw in self.decoder.split(chunk))

    def flush(self) -> bytes:
        """A last event the upstream did not end with a blank line is still read."""
        rest = self.decoder.pending()
        return (self._read(rest) if rest.strip() else rest) + self.reader.close()

    def _read(self, raw: bytes) -> bytes:
        if self.broken is not None:  # still the usage (and an error, and the end)
            return self.reader.read(raw, fold=False)
        # Events we cannot make sense of still reach the client; we stop reassembling.
        try:
            return self.reader.read(raw)
        except NotUnderstood as exc:
            self.broken = str(exc)
            log.warning("stream_not_understood", request_id=self.request_id, error=str(exc))
        except Exception:
            self.broken = "a chunk the proxy could not read"
            log.warning("stream_not_understood", request_id=self.request_id, exc_info=True)
        return raw

    def end(self, status: str, error: str | None) -> StreamEnd:
        reader = self.reader
        if reader.error is not None:
            # The upstream said it failed, in the stream (vLLM and others, often followed by
            # `[DONE]`): what arrived is not an answer, whatever came after.
            status, error = "error", f"upstream error event: {error_text(reader.error)}"
        elif self.broken is not None:
            status = "incomplete" if status == "complete" else status
            error = error or (
                f"the upstream's stream was not understood ({self.broken}); what came before "
                "it is kept"
            )
        elif status == "complete" and not reader.ended:
            status = "incomplete"
        reply = reader.message() if reader.received_anything else None
        return StreamEnd(
            status, error, reply, reader.usage, self.first_chunk_at, native=reader.native
        )

    async def finish(self, status: str, error: str | None) -> None:
        # Shielded: a client leaving during this write must not cancel it half-way.
        task = self._spawn(self._settle(self.end(status, error)))
        await asyncio.shield(task)

    def abandon(self) -> None:
        # Complete if the reply had already finished when the client left.
        self._spawn(self._settle(self.end("complete", "client disconnected")))
