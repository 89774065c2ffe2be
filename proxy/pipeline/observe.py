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

from proxy.accounting.costs import nothing_billed
from proxy.core.errors import ProxyError
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.turn import Outcome
from proxy.pipeline.wire import StreamReader, WholeReply
from proxy.upstream.sse import NotUnderstood, SSEDecoder, error_text
from storage.records import ResponseRecord

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
        return self.reader.unread(raw)

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


async def whole_outcome(
    req: TurnRequest,
    whole: WholeReply,
    *,
    sent: list[dict[str, Any]],
    attached: dict[str, Any],
    keep: ResponseRecord | None,
) -> Outcome:
    """How a whole (non-streamed) reply ends the exchange: priced from its usage (or our
    count), or an upstream error passed on."""
    status = whole.reply.status
    ok = status < 400
    if ok:
        bill = await req.services.pricer.final(
            req.turn.model, whole.usage, prompt_tokens=None, prompt=sent, reply=whole.message
        )
    else:
        bill = nothing_billed()
    info = req.info
    now = time.perf_counter()
    upstream_ms = info.upstream_ms or 0.0
    body = whole.reply.body or b""
    return Outcome(
        status="complete" if ok else "error",
        http_status=status,
        reply=whole.message if ok else None,
        bill=bill,
        error=None if ok else body[:2000].decode("utf-8", "replace"),
        latency_ms=(now - info.started) * 1000,
        upstream_ms=upstream_ms,
        overhead_ms=(now - info.started) * 1000 - upstream_ms,
        attached=attached,
        keep=keep,
    )


async def stream_outcome(
    req: TurnRequest,
    end: StreamEnd,
    *,
    prompt_tokens: int | None,
    sent: list[dict[str, Any]],
    overhead_ms: float | None,
    attached: dict[str, Any],
    keep: ResponseRecord | None,
) -> Outcome:
    """How a watched stream ends the exchange, priced from the usage it carried."""
    bill = await req.services.pricer.final(
        req.turn.model, end.usage, prompt_tokens=prompt_tokens, prompt=sent, reply=end.reply
    )
    started = req.info.started
    return Outcome(
        status=end.status,  # type: ignore[arg-type]
        http_status=200,
        reply=end.reply,
        bill=bill,
        error=end.error,
        latency_ms=(time.perf_counter() - started) * 1000,
        ttft_ms=None if end.first_chunk_at is None else (end.first_chunk_at - started) * 1000,
        upstream_ms=req.info.upstream_ms,
        overhead_ms=overhead_ms,
        attached=attached,
        keep=keep,
    )
