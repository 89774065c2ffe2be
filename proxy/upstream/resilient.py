"""Retries and a circuit breaker around any upstream's chat completions
(policies/resilience.py decides; this module waits and counts).

A call is retried only while nothing has reached the client: a failed connection, or a head
with a retryable status (then its body has been read whole and is dropped). A timeout is not
retried here: the provider may have run, and billed, the whole generation.
A stream whose head came back fine is relayed as it is, and a failure after that reaches the
client as the stream's final error event, as before. While the circuit is open, calls fail at
once with a 503 (`upstream_circuit_open`) and `retry-after`. Everything else (models,
embeddings, pass-through) goes to the upstream as it is.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, cast

import structlog

from policies.resilience import CircuitBreaker, is_failure, retry_delay
from proxy.core.config import UpstreamConfig
from proxy.core.errors import (
    ServiceUnavailable,
    UpstreamError,
    UpstreamRedirect,
    UpstreamStatusError,
    UpstreamTimeout,
)
from proxy.upstream.anthropic import MessagesUpstream
from proxy.upstream.base import Upstream, UpstreamReply

log = structlog.get_logger("memproxy.upstream")


class CircuitOpen(ServiceUnavailable):
    code = "upstream_circuit_open"


class ResilientUpstream:
    def __init__(
        self,
        inner: Upstream,
        config: UpstreamConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.inner = inner
        self.name, self.kind, self.stream_usage = inner.name, inner.kind, inner.stream_usage
        self.reports_sent = inner.reports_sent
        self._retries = config.retries
        breaker = config.breaker
        self.breaker = (
            CircuitBreaker(breaker.failures, breaker.open_seconds) if breaker.failures else None
        )
        self._clock, self._sleep = clock, sleep

    def __getattr__(self, name: str) -> Any:  # list_models, passthrough, embeddings, load...
        return getattr(self.inner, name)

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        return await self._call(
            partial(self.inner.chat_completions, body, stream=stream, sent=sent)
        )

    async def responses(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        return await self._call(partial(self.inner.responses, body, stream=stream, sent=sent))

    async def messages(
        self,
        body: dict[str, Any],
        headers: Mapping[str, str],
        *,
        stream: bool,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        """Anthropic's Messages API (an anthropic-kind upstream's), retried as chat is."""
        inner = cast(MessagesUpstream, self.inner)
        return await self._call(partial(inner.messages, body, headers, stream=stream, sent=sent))

    async def _call(self, send: Callable[[], Awaitable[UpstreamReply]]) -> UpstreamReply:
        """`send`, retried and counted by the circuit breaker as the upstream's settings say."""
        attempt = 0
        while True:
            attempt += 1
            trial = self._admit()
            try:
                reply = await send()
            except UpstreamStatusError as exc:  # (litellm's: the provider's own error status)
                self._record(exc.status, trial)
                wait = self._wait(attempt, exc.status, exc.headers)
                if wait is None:
                    raise
                log.info("upstream_retry", upstream=self.name, attempt=attempt, status=exc.status)
            except UpstreamTimeout:
                # Maybe a whole generation the provider bills: for the client to decide.
                self._record(None, trial)
                raise
            except UpstreamRedirect:
                # The configuration's to fix: asking again gets the same one, and an open
                # circuit would hide what to fix behind "is failing".
                if self.breaker is not None:
                    self.breaker.abandon(trial=trial)
                raise
            except UpstreamError as exc:  # no response head: unreachable
                self._record(None, trial)
                wait = self._wait(attempt, None, {})
                if wait is None:
                    raise
                log.info("upstream_retry", upstream=self.name, attempt=attempt, error=exc.code)
            except BaseException:
                if self.breaker is not None:  # (cancelled: neither a success nor a failure)
                    self.breaker.abandon(trial=trial)
                raise
            else:
                self._record(reply.status, trial)
                wait = None if reply.streamed else self._wait(attempt, reply.status, reply.headers)
                if wait is None:
                    return reply
                log.info("upstream_retry", upstream=self.name, attempt=attempt, status=reply.status)
            await self._sleep(wait)

    def _wait(self, attempt: int, status: int | None, headers: dict[str, str]) -> float | None:
        settings = self._retries
        return retry_delay(
            attempt,
            attempts=settings.attempts,
            base=settings.backoff_ms / 1000,
            cap=settings.max_backoff_ms / 1000,
            status=status,
            headers=headers,
        )

    def _admit(self) -> bool:
        """Whether the call may go (else CircuitOpen); True when it is the half-open trial."""
        if self.breaker is None:
            return False
        wait, trial = self.breaker.admit(self._clock())
        if wait is not None:
            raise CircuitOpen(
                f"Upstream {self.name!r} is failing; calls resume in {math.ceil(wait)} s.",
                headers={"retry-after": str(math.ceil(wait))},
            )
        return trial

    def _record(self, status: int | None, trial: bool) -> None:
        if self.breaker is None:
            return
        was = self.breaker.state(self._clock())
        self.breaker.record(self._clock(), failed=is_failure(status), trial=trial)
        now = self.breaker.state(self._clock())
        if now != was:
            log.warning("upstream_circuit", upstream=self.name, state=now, status=status)
