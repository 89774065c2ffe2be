"""One turn through the proxy, whatever its wire protocol: identify, load, classify, assemble,
forward, observe, then persist and account (DESIGN.md, "One turn, end to end"). Each stage is
a module of its own; this one runs them in order and answers in the protocol's shape through
its adapter (pipeline/wire.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog
from litestar import Request, Response

from policies.pricing import ZERO
from proxy.accounting.costs import count_prompt, nothing_billed, ready_to_count
from proxy.accounting.metrics import InFlight
from proxy.core.access import CLIENT_CLOSED
from proxy.core.auth import Principal
from proxy.core.errors import ProxyError, RateLimited
from proxy.core.requests import parse_inline
from proxy.pipeline.account import Ledger
from proxy.pipeline.artifacts import Attached
from proxy.pipeline.assemble import Assembled, assemble_turn
from proxy.pipeline.classify import TurnIntent
from proxy.pipeline.headers import memory_headers
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.load import Loaded, load
from proxy.pipeline.observe import StreamEnd, StreamWatch, stream_outcome, whole_outcome
from proxy.pipeline.recall_turn import embed_question
from proxy.pipeline.turn import Outcome, is_heavy
from proxy.pipeline.wire import NeutralTurn, WireProtocol
from proxy.protocols.relay import to_response
from proxy.state import AppState

log = structlog.get_logger("memproxy.pipeline")


class TurnExchange:
    """One turn, from the request to its settled record."""

    def __init__(self, req: TurnRequest, wire: WireProtocol) -> None:
        self.req, self.wire = req, wire
        self.services = req.services
        # Documents sent with the request (checked here: a bad one costs no rpm).
        self.inline = parse_inline(req.turn.attachments)
        self.intent = TurnIntent(req)
        self.ledger = Ledger(req)
        self.loaded = Loaded(None, self.inline)
        self.assembled = Assembled(None)
        self.attached: dict[str, Any] = {}
        self.sent: list[dict[str, Any]] = req.turn.prompt
        self.prompt_tokens: int | None = None  # our count of the prompt, when one was needed
        self.overhead_ms: float | None = None
        self.flight: InFlight | None = None
        self.settled = False
        # What need not be done before the upstream call, done once its request has gone out
        # (while the provider works), or at the latest once the call has ended.
        self.while_upstream: list[Callable[[], None]] = []
        self.counting: asyncio.Future[int] | None = None  # the prompt, for a stream's headers

    @property
    def degraded(self) -> bool:
        return self.loaded.degraded or self.assembled.partial

    async def answer(self, request: Request[Any, Any, Any]) -> Response[Any]:
        self.flight = InFlight(self.services.metrics.in_flight)
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            # The client went away before the answer: the exchange still ends, as incomplete.
            if not self.settled:
                outcome = Outcome(
                    "incomplete",
                    CLIENT_CLOSED,
                    error="client disconnected",
                    latency_ms=(time.perf_counter() - self.req.info.started) * 1000,
                    upstream_ms=self.req.info.upstream_ms,
                    overhead_ms=self.overhead_ms,
                    attached=self.attached,
                )
                self.services.spawn(self.settle(outcome))
            raise
        except BaseException as exc:
            if not self.settled:
                status = exc.status if isinstance(exc, ProxyError) else 500
                metrics = self.services.metrics
                metrics.count_request(
                    self.req.tenant_id, metrics.model(self.req.turn.model), status
                )
                self.flight.end()
                if self.ledger.owes:
                    self.services.spawn(self.ledger.charge_own_calls())  # paid for all the same
            raise

    async def _answer(self, request: Request[Any, Any, Any]) -> Response[Any]:
        req = self.req
        await self._remember()
        if self.assembled.assembly is not None:
            self.sent = self.assembled.assembly.messages
        if req.turn.stream:
            # The stream's headers carry the prompt side: counted while the upstream works
            # (from when its request has gone out, if the upstream says when).
            if req.upstream.reports_sent:
                self.while_upstream.append(self._start_counting)
            else:
                self._start_counting()
        forwarded = time.perf_counter()
        self.overhead_ms = (forwarded - req.info.started) * 1000
        try:
            reply = await self.services.shutdown.guard(
                self.wire.call(req.upstream, self.sent, sent=self._upstream_working)
            )
        except Exception as exc:
            await self._failed_upstream(exc)
            raise
        req.info.upstream_ms = (time.perf_counter() - forwarded) * 1000
        self._upstream_working()  # (if the upstream did not say when its request went out)

        headers = self._memory_headers()
        counting = self.counting
        if reply.chunks is not None:
            self.prompt_tokens = await counting if counting else await self._count_prompt()
            bill = self.services.pricer.prompt_side(req.turn.model, self.prompt_tokens)
            watch = StreamWatch(
                self.wire.stream_reader(self.prompt_tokens),
                request_id=req.request_id,
                settle=self._settle_stream,
                spawn=self.services.spawn,
            )
            response = to_response(
                request, reply, headers=headers, observer=watch, deadline=self.services.shutdown
            )
        else:
            if counting is not None:
                counting.cancel()
            if self.intent.llm is not None:
                # A whole reply waits for the LLM's intent, up to its timeout (it started
                # before the upstream call, so usually it is there already).
                await asyncio.wait([self.intent.llm])
            whole = self.wire.whole(reply)
            ok = whole.reply.status < 400
            outcome = await whole_outcome(
                req,
                whole,
                sent=self.sent,
                attached=self.attached,
                keep=self._keep(whole.native) if ok else None,
            )
            assert outcome.bill is not None
            bill = outcome.bill
            if self.loaded.turn is not None and self.loaded.turn.pending is not None:
                # Its record is written in a batch after the response: counting it (metrics,
                # the tenant's limits) waits until the response is on its way too.
                self.settled = True
                self.services.spawn(self._settle(outcome))
            else:
                await self.settle(outcome)
            response = to_response(request, whole.reply, headers=headers)
        intent, intent_usd = self.intent.now()
        prices = self.services.pricer.prices
        own = (prices.cost(model, usage) for _, model, usage in self.ledger.own_calls())
        bill.memory_usd = intent_usd + sum((c for c in own if c is not None), ZERO)
        response.headers.update(bill.headers())
        if intent is not None:
            response.headers["x-memory-intent"] = intent.header()
        return response

    async def prompt(self) -> list[dict[str, Any]]:
        """The messages the upstream would be sent for this turn now, the proxy's context
        placed among them: the read stages alone, for a request made with `dry_run`
        (count_tokens), which store, queue and charge nothing."""
        assert self.req.dry_run
        await self._remember()
        assembly = self.assembled.assembly
        return assembly.messages if assembly is not None else self.req.turn.prompt

    async def _remember(self) -> None:
        """Store the turn (per the memory mode), classify it and assemble what it gets."""
        req, trace = self.req, self.req.trace
        self.ledger.question = embed_question(req)
        await ready_to_count(req.turn.model)  # (the first turn builds the tokenizers, off the loop)
        with trace.timed("load"):
            if is_heavy(len(req.turn.messages)):
                # (waited for outside the storage timeout: a large turn waits its turn, and
                # is not degraded for it)
                async with self.services.heavy_turns.slot(req.tenant_id):
                    self.loaded = await load(req, self.inline)
            else:
                # (large writes give way to it meanwhile)
                with self.services.db.write_slots.expecting():
                    self.loaded = await load(req, self.inline)
        self.ledger.turn, self.ledger.spilled = self.loaded.turn, self.loaded.spilled
        with trace.timed("classify"):
            use_memory = await self.intent.classify(self.loaded.turn)
        if self.intent.deferred:
            self.while_upstream.append(self.classify_later)
        with trace.timed("assemble"):
            self.assembled = await assemble_turn(
                req,
                self.loaded,
                use_memory=use_memory,
                by_policy=self.intent.by_policy,
                question=self.ledger.question,
                paid=self._paid,
            )
        self.attached = self.assembled.record

    def _paid(self, attached: Attached) -> None:
        self.ledger.calls = list(attached.calls)

    def classify_later(self) -> None:
        """Mode off: the keyword intent left for later, found now (once), for the record."""
        self.intent.classify_later(self.attached)

    async def _failed_upstream(self, exc: Exception) -> None:
        self._upstream_working()
        if self.counting is not None:
            self.counting.cancel()
        if not isinstance(exc, ProxyError):  # (the upstreams raise only ProxyErrors)
            log.exception("upstream_call_failed", request_id=self.req.request_id)
        failure = exc if isinstance(exc, ProxyError) else ProxyError(repr(exc))
        outcome = Outcome(
            "error",
            failure.status,
            bill=nothing_billed(),
            error=failure.message,
            overhead_ms=self.overhead_ms,
            attached=self.attached,
        )
        await self.settle(outcome)
        if isinstance(exc, ProxyError):  # (the turn is stored: say where, as a reply does)
            exc.headers = {**self._memory_headers(), **exc.headers}

    def _upstream_working(self) -> None:
        """The upstream's request has gone out: do what could wait until then, once."""
        work, self.while_upstream = self.while_upstream, []
        for step in work:
            step()

    def _start_counting(self) -> None:
        self.counting = asyncio.ensure_future(self._count_prompt())

    def _memory_headers(self) -> dict[str, str]:
        return memory_headers(
            self.loaded.turn,
            self.assembled.assembly,
            self.degraded,
            self.assembled.recalled,
            self.assembled.attachments,
            unstored=self.loaded.unstored,
        )

    async def _count_prompt(self) -> int:
        """The prompt's tokens: the client's messages counted now, plus the stored ones the
        proxy attached (counted when they were stored)."""
        turn = self.req.turn
        client = await count_prompt(turn.prompt, turn.model)
        assembly = self.assembled.assembly
        return client + (assembly.context_tokens if assembly else 0)

    async def _settle_stream(self, end: StreamEnd) -> None:
        outcome = await stream_outcome(
            self.req,
            end,
            prompt_tokens=self.prompt_tokens,
            sent=self.sent,
            overhead_ms=self.overhead_ms,
            attached=self.attached,
            keep=self._keep(end.native),
        )
        await self.settle(outcome)

    def _keep(self, native: dict[str, Any] | None) -> Any:
        """The protocol's object for the reply, to keep with it (not in mode off); a turn in
        the spill keeps it too, stored with the reply when the database is back."""
        req = self.req
        if native is None or req.identity.mode == "off":
            return None  # (mode off stores nothing of the conversation's)
        if self.loaded.turn is None and not self.loaded.spilled:
            return None
        kept = self.wire.keep(
            native, tenant_id=req.tenant_id, user_id=req.user_id, request_id=req.request_id
        )
        # (dated when the request began: an erasure since then keeps it out)
        return None if kept is None else replace(kept, created_at=req.started_at)

    async def settle(self, outcome: Outcome) -> None:
        """Count the exchange (metrics, the tenant's limits) and record it, once."""
        if self.settled:
            return
        self.settled = True
        await self._settle(outcome)

    async def _settle(self, outcome: Outcome) -> None:
        self.classify_later()  # (if it ended before its upstream call: for the record)
        if self.req.trace.on:
            self.intent.traced()
            outcome.trace = self.req.trace
        if self.flight is not None:
            self.flight.end()
        await self.ledger.settle(outcome, self.sent, self.intent.llm)


async def answer_turn(
    request: Request[Any, Any, Any],
    principal: Principal,
    services: AppState,
    wire: WireProtocol,
    turn: NeutralTurn,
) -> Response[Any]:
    """Answer one turn: the limits first (a refused request stores nothing and never reaches
    the upstream), then the pipeline; every answer says what it cost."""
    metrics, tenant = services.metrics, principal.tenant_id
    try:
        exchange = TurnExchange(TurnRequest.of(request, principal, services, turn), wire)
        services.limits.admit(principal)  # (after the request is read: a bad one costs no rpm)
    except ProxyError as exc:
        if isinstance(exc, RateLimited):
            metrics.rate_limited.labels(tenant, exc.type).inc()
        metrics.count_request(tenant, metrics.model(turn.model), exc.status)
        _bill_nothing(exc)
        raise
    try:
        return await exchange.answer(request)
    except ProxyError as exc:
        _bill_nothing(exc)
        exchange.classify_later()  # (mode off, if it failed before its upstream call)
        if exchange.intent.intent is not None:  # classified before it failed (a timeout, say)
            exc.headers = {"x-memory-intent": exchange.intent.intent.header(), **exc.headers}
        raise


def _bill_nothing(exc: ProxyError) -> None:
    """Every turn says what it cost: a refused or failed one, nothing."""
    exc.headers = {**nothing_billed().headers(), **exc.headers}
