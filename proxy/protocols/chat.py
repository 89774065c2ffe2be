"""A chat completion through the proxy: identify, load and store, assemble, forward, record."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from functools import partial
from typing import Any

import structlog
from litestar import Request, Response

from policies.context import (
    Assembly,
    Budget,
    Recalled,
    StoredTurn,
    assemble,
    history_for,
    mandatory_tokens,
)
from policies.intent import Intent
from policies.pricing import ZERO, Usage
from policies.tokens import count_message, count_messages, message_text, upper_bound_tokens
from proxy.accounting.charges import EMBEDDING
from proxy.accounting.costs import count_prompt, nothing_billed
from proxy.accounting.metrics import InFlight
from proxy.background.embeddings import EMBED_CHARS, Vector
from proxy.background.vector_index import SemanticQuery
from proxy.core.access import RequestInfo, request_info
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, ProxyError, RateLimited, ServiceUnavailable
from proxy.core.requests import header_text, parse_inline
from proxy.durability.spill import Spilled, SpillFull
from proxy.durability.storage_circuit import StorageCircuitOpen
from proxy.pipeline.artifacts import NOTHING_ATTACHED, Attached
from proxy.pipeline.intent import LLMIntent, record_intent
from proxy.pipeline.recall import NOTHING, Recall, recall
from proxy.pipeline.replay import spilled_charge, spilled_intent, spilled_outcome, spilled_turn
from proxy.pipeline.summaries import summarize_history
from proxy.pipeline.turn import ANONYMOUS, Mode, Outcome, Turn, classify, now
from proxy.protocols.relay import to_response
from proxy.state import AppState
from proxy.upstream.sse import (
    NotUnderstood,
    ReplyAssembler,
    SSEDecoder,
    error_text,
    event_data,
    reply_from_completion,
)
from storage.errors import StorageError, StorageTimeout, StorageUnavailable
from storage.repositories.memories import Memories
from storage.repositories.search import searchable_text

log = structlog.get_logger("memproxy.completions")
CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MODES: tuple[Mode, ...] = ("full", "read", "off")
# Recall ranks one search hit per this many tokens of its budget, unless configured.
TOKENS_PER_CANDIDATE = 40
MAX_CANDIDATES = 500
# The status a chat completion is counted with when its client left before the answer (nginx's).
CLIENT_CLOSED = 499


@dataclass(frozen=True, slots=True)
class Extensions:
    """memproxy's optional request headers (DESIGN.md, request extensions)."""

    user_id: str
    conversation_id: str | None
    mode: Mode
    idempotency_key: str | None


def read_extensions(request: Request[Any, Any, Any], body: dict[str, Any]) -> Extensions:
    headers = request.headers
    user = header_text(request, "X-Memory-User-Id") or body.get("user")
    if user is not None and (
        not isinstance(user, str) or not user.strip() or len(user) > 256 or "\x00" in user
    ):
        raise BadRequest(
            "The user id must be a non-empty string of at most 256 characters.", param="user"
        )
    conversation_id = headers.get("x-memory-conversation-id")
    if conversation_id is not None and not CONVERSATION_ID.fullmatch(conversation_id):
        raise BadRequest(
            "X-Memory-Conversation-Id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
            param="X-Memory-Conversation-Id",
        )
    mode = (headers.get("x-memory-mode") or "full").lower()
    if mode not in MODES:
        raise BadRequest("X-Memory-Mode must be full, read or off.", param="X-Memory-Mode")
    key = headers.get("idempotency-key")
    if key is not None and not 0 < len(key) <= 256:
        raise BadRequest("Idempotency-Key must be 1-256 characters.", param="Idempotency-Key")
    return Extensions(user or ANONYMOUS, conversation_id, mode, key)


def memory_headers(
    turn: Turn | None,
    assembly: Assembly | None,
    degraded: bool,
    recalled: int = 0,
    attachments: int = 0,
) -> dict[str, str]:
    headers = {
        "x-memory-context-tokens": str(assembly.context_tokens if assembly else 0),
        "x-memory-history-messages": str(assembly.history_messages if assembly else 0),
        "x-memory-memories": str(recalled),
        "x-memory-attachments": str(attachments),
        "x-memory-status": "degraded" if degraded else "ok",
    }
    if turn is not None and turn.conversation_id:
        headers["x-memory-conversation-id"] = turn.conversation_id
    return headers


class ChatStreamObserver:
    """Reassembles a streamed reply, leaves out the usage chunk the client did not ask for,
    and settles the exchange when the stream ends."""

    def __init__(self, chat: ChatExchange, *, drop_usage_chunk: bool) -> None:
        self.chat = chat
        self.drop_usage_chunk = drop_usage_chunk
        self.decoder = SSEDecoder()
        self.reply = ReplyAssembler()
        self.first_chunk_at: float | None = None
        self.broken: str | None = None  # why reassembling stopped (a chunk not understood)

    def feed(self, chunk: bytes) -> bytes:
        if self.first_chunk_at is None:
            self.first_chunk_at = time.perf_counter()
        # Whole events only: the usage chunk can be left out wherever it falls, and a stream
        # that breaks ends with an error event of its own, not glued to half of one.
        return b"".join(
            raw for raw in self.decoder.split(chunk) if not self._left_out(self._observe(raw))
        )

    def flush(self) -> bytes:
        """A last event the upstream did not end with a blank line is still read (and, if it
        is the usage chunk the client did not ask for, left out)."""
        rest = self.decoder.pending()
        usage_only = bool(rest.strip()) and self._observe(rest)
        return b"" if self._left_out(usage_only) else rest

    def _left_out(self, usage_only: bool) -> bool:
        return usage_only and self.drop_usage_chunk

    def _observe(self, raw: bytes) -> bool:
        """Fold one event into the reply; True if it is the usage-only chunk."""
        payload = event_data(raw)
        if payload is None:
            return False
        if self.broken is not None:  # still the usage (and an error, and the end)
            return self.reply.add(payload, fold=False)
        # Chunks we cannot make sense of still reach the client; we stop reassembling.
        try:
            return self.reply.add(payload)
        except NotUnderstood as exc:
            self.broken = str(exc)
            log.warning("stream_not_understood", request_id=self.chat.request_id, error=str(exc))
        except Exception:
            self.broken = "a chunk the proxy could not read"
            log.warning("stream_not_understood", request_id=self.chat.request_id, exc_info=True)
        return False

    async def _outcome(self, status: str, error: str | None) -> Outcome:
        if self.reply.error is not None:
            # The upstream said it failed, in the stream (vLLM and others, often followed by
            # `[DONE]`): what arrived is not an answer, whatever came after.
            status, error = "error", f"upstream error event: {error_text(self.reply.error)}"
        elif self.broken is not None:
            status = "incomplete" if status == "complete" else status
            error = error or (
                f"the upstream's stream was not understood ({self.broken}); what came before "
                "it is kept"
            )
        elif status == "complete" and not (self.reply.done or self.reply.finish_reason):
            status = "incomplete"
        reply = self.reply.message() if self.reply.received_anything else None
        chat = self.chat
        bill = await chat.services.pricer.final(
            chat.model,
            self.reply.usage,
            prompt_tokens=chat.prompt_tokens,
            prompt=chat.sent_messages,
            reply=reply,
        )
        started = chat.info.started
        return Outcome(
            status=status,  # type: ignore[arg-type]
            http_status=200,
            reply=reply,
            bill=bill,
            error=error,
            latency_ms=(time.perf_counter() - started) * 1000,
            ttft_ms=None if self.first_chunk_at is None else (self.first_chunk_at - started) * 1000,
            upstream_ms=chat.info.upstream_ms,
            overhead_ms=chat.overhead_ms,
            attached=chat.attached,
        )

    async def finish(self, status: str, error: str | None) -> None:
        # Shielded: a client leaving during this write must not cancel it half-way.
        task = self.chat.services.spawn(self._settle(status, error))
        await asyncio.shield(task)

    def abandon(self) -> None:
        # Complete if the reply had already finished when the client left.
        self.chat.services.spawn(self._settle("complete", "client disconnected"))

    async def _settle(self, status: str, error: str | None) -> None:
        await self.chat.settle(await self._outcome(status, error))


# How long a reply written after its response waits for that response to end (it normally
# ends a moment later; past this the write goes ahead).
RESPONSE_END_WAIT = 1.0


async def record(
    services: AppState, turn: Turn, outcome: Outcome, info: RequestInfo | None = None
) -> None:
    """Store the outcome; a storage failure here is logged, never raised into the response.

    A turn that stored nothing beforehand (mode off) is recorded later, in a batch; a reply may
    be written just after the response (ConversationMemory.reply_after_response), with the next
    request of the same user waiting for it: once the response has gone out (`info`), since the
    write's work in its thread would hold the interpreter while the response's last bytes wait.
    The client waits only for what it must."""
    if turn.pending is not None:
        services.deferred.add(turn, outcome)
    elif services.memory.reply_after_response:
        after = info.ended(RESPONSE_END_WAIT) if info is not None else None
        services.memory.track(turn, services.spawn(_record(services, turn, outcome, after)))
    else:
        await _record(services, turn, outcome)


async def _record(
    services: AppState, turn: Turn, outcome: Outcome, after: Awaitable[None] | None = None
) -> None:
    if after is not None:
        await after
    try:
        await services.memory.finish(turn, outcome)
    except StorageError as exc:
        # The reply and the record wait in the spill for the database.
        log.warning("exchange_spilled", request_id=turn.request_id, error=str(exc))
        head = (turn.tenant_id, turn.user_id, turn.request_id, now())
        await spill_outcome(services, spilled_outcome(*head, outcome, turn=turn))
        return
    if turn.extract or turn.embed or turn.summarize_through is not None:
        services.jobs.wake()  # its extraction / embedding / summary job was queued with the reply


async def spill_outcome(services: AppState, entry: Spilled) -> None:
    """Keep an outcome storage could not take (never refused: its request was answered)."""
    try:
        await services.spill.add(entry, bounded=False)
    except OSError as exc:
        log.error("exchange_not_recorded", request_id=entry.request_id, error=str(exc))


class ChatExchange:
    """One chat completion through the proxy, from the request to its settled record."""

    def __init__(
        self,
        request: Request[Any, Any, Any],
        principal: Principal,
        services: AppState,
        body: dict[str, Any],
    ) -> None:
        self.request, self.principal, self.services, self.body = request, principal, services, body
        self.info = request_info(request.scope)
        self.request_id = self.info.request_id
        self.ext = read_extensions(request, body)
        self.model: str = body["model"]
        self.model_label = services.metrics.model(self.model)
        self.upstream = services.upstream_for(principal)
        self.turn: Turn | None = None
        self.assembly: Assembly | None = None
        self.degraded = False
        self.spilled = False  # the turn went to the spill (storage was down)
        self.recall_failed = False  # recall's read failed or was too slow
        self.started_at = now()
        self.attached: dict[str, Any] = {}
        self.sent_messages: list[dict[str, Any]] = body["messages"]
        self.prompt_tokens: int | None = None  # our count of the prompt, when one was needed
        self.overhead_ms: float | None = None
        self.flight: InFlight | None = None
        self.settled = False
        self.intent: Intent | None = None
        self.llm_intent: asyncio.Task[LLMIntent] | None = None
        self.attached_by_policy: dict[str, Any] | None = None
        self.recalled_messages = 0
        self.recall_ms: float | None = None
        # Documents sent with the request (`attachments`, checked here: a bad one costs no rpm)
        # and what the attachments and tool results contributed.
        self.inline = parse_inline(body.get("attachments"))
        self.attached_artifacts = NOTHING_ATTACHED
        self.attachments_count = 0
        # The question's embedding for recall, started early to overlap the other work.
        self.question_vector: asyncio.Task[Vector | None] | None = None
        # What need not be done before the upstream call, done once its request has gone out
        # (while the provider works), or at the latest once the call has ended.
        self.while_upstream: list[Callable[[], None]] = []
        self.counting: asyncio.Future[int] | None = None  # the prompt, for a stream's headers

    async def answer(self) -> Response[Any]:
        self.flight = InFlight(self.services.metrics.in_flight)
        try:
            return await self._answer()
        except asyncio.CancelledError:
            # The client went away before the answer: the exchange still ends, as incomplete.
            if not self.settled:
                outcome = Outcome(
                    "incomplete",
                    CLIENT_CLOSED,
                    error="client disconnected",
                    latency_ms=(time.perf_counter() - self.info.started) * 1000,
                    upstream_ms=self.info.upstream_ms,
                    overhead_ms=self.overhead_ms,
                    attached=self.attached,
                )
                self.services.spawn(self.settle(outcome))
            raise
        except BaseException as exc:
            if not self.settled:
                status = exc.status if isinstance(exc, ProxyError) else 500
                self.services.metrics.count_request(
                    self.principal.tenant_id, self.model_label, status
                )
                self.flight.end()
                if self.attached_artifacts.calls or self.question_vector is not None:
                    self.services.spawn(self._charge_own_calls())  # paid for all the same
            raise

    async def _answer(self) -> Response[Any]:
        # memproxy's own extension (read in __init__): never forwarded, in any mode.
        self.body.pop("attachments", None)
        await self._remember()
        body = self.body
        if self.assembly is not None:
            body = {**body, "messages": self.assembly.messages}
            self.sent_messages = self.assembly.messages
        stream = self.info.stream
        drop_usage_chunk = False
        if stream:
            body, drop_usage_chunk = self._ask_for_usage(body)
            # The stream's headers carry the prompt side: counted while the upstream works
            # (from when its request has gone out, if the upstream says when).
            if self.upstream.reports_sent:
                self.while_upstream.append(self._start_counting)
            else:
                self._start_counting()
        forwarded = time.perf_counter()
        self.overhead_ms = (forwarded - self.info.started) * 1000
        try:
            reply = await self.services.shutdown.guard(
                self.upstream.chat_completions(body, stream=stream, sent=self._upstream_working)
            )
        except Exception as exc:
            self._upstream_working()
            if self.counting is not None:
                self.counting.cancel()
            if not isinstance(exc, ProxyError):  # (the upstreams raise only ProxyErrors)
                log.exception("upstream_call_failed", request_id=self.request_id)
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
            raise
        self.info.upstream_ms = (time.perf_counter() - forwarded) * 1000
        self._upstream_working()  # (if the upstream did not say when its request went out)

        headers = self._memory_headers()
        counting = self.counting
        if reply.chunks is not None:
            self.prompt_tokens = await counting if counting else await self._count_prompt()
            bill = self.services.pricer.prompt_side(self.model, self.prompt_tokens)
            observer = ChatStreamObserver(self, drop_usage_chunk=drop_usage_chunk)
            response = to_response(
                self.request,
                reply,
                headers=headers,
                observer=observer,
                deadline=self.services.shutdown,
            )
        else:
            if counting is not None:
                counting.cancel()
            if self.llm_intent is not None:
                # A whole reply waits for the LLM's intent, up to its timeout (it started
                # before the upstream call, so usually it is there already).
                await asyncio.wait([self.llm_intent])
            outcome = await self._whole_outcome(reply.status, reply.body or b"", forwarded)
            assert outcome.bill is not None
            bill = outcome.bill
            if self.turn is not None and self.turn.pending is not None:
                # Its record is written in a batch after the response: counting it (metrics,
                # the tenant's limits) waits until the response is on its way too.
                self.settled = True
                self.services.spawn(self._settle(outcome))
            else:
                await self.settle(outcome)
            response = to_response(self.request, reply, headers=headers)
        intent, intent_usd = self._intent_now()
        prices = self.services.pricer.prices
        own = (prices.cost(model, usage) for _, model, usage in self._own_calls())
        bill.memory_usd = intent_usd + sum((c for c in own if c is not None), ZERO)
        response.headers.update(bill.headers())
        if intent is not None:
            response.headers["x-memory-intent"] = intent.header()
        return response

    def _upstream_working(self) -> None:
        """The upstream's request has gone out: do what could wait until then, once."""
        work, self.while_upstream = self.while_upstream, []
        for step in work:
            step()

    def _start_counting(self) -> None:
        self.counting = asyncio.ensure_future(self._count_prompt())

    def _memory_headers(self) -> dict[str, str]:
        return memory_headers(
            self.turn,
            self.assembly,
            self.degraded,
            self.recalled_messages,
            self.attachments_count,
        )

    async def _remember(self) -> None:
        """Store the turn (per the memory mode) and attach the history the client did not send."""
        tenant = self.principal.tenant
        messages = self.sent_messages
        self._embed_question()
        refs = [i.attachment_id for i in self.inline if i.attachment_id is not None]
        if refs:  # an unknown id is a 400 before anything is stored
            try:
                await self.services.memory.in_time(
                    self.services.artifacts.check_refs(
                        self.principal.tenant_id, self.ext.user_id, refs
                    )
                )
            except StorageError:  # unchecked ids are not used; begin() degrades or refuses
                self.inline = [i for i in self.inline if i.attachment_id is None]
        try:
            await self._after_spilled_turns()
            self.turn = await self.services.memory.begin(
                intent_of=partial(self.services.intents.keyword, self.principal.tenant_id),
                request_id=self.request_id,
                tenant_id=self.principal.tenant_id,
                user_id=self.ext.user_id,
                conversation_id=self.ext.conversation_id,
                mode=self.ext.mode,
                idempotency_key=self.ext.idempotency_key,
                messages=messages,
                model=self.model,
                upstream=self.upstream.name,
                stream=self.info.stream,
                context=tenant.context,
            )
            self.turn.embed = self.services.embeddings.wanted(
                self.principal.tenant_id, self.turn.user_id, self.turn.mode, ANONYMOUS
            )
            self.turn.extract = self.services.extractor.wanted(
                self.principal.tenant_id, self.turn.user_id, self.turn.mode
            )
        except StorageError as exc:
            await self._degrade(exc)
        use_memory = await self._classify()
        turn = self.turn
        if turn is not None and turn.pending is not None and not self.inline:
            # Mode off, with no documents of its own: nothing to attach or to work out.
            self.attached = self._attached_record(None, NOTHING)
            return
        ctx = tenant.context
        window = self.services.context_window(self.model)
        budget = Budget(
            token_budget=ctx.token_budget,
            max_history_messages=ctx.max_history_messages,
            min_recent_messages=ctx.min_recent_messages,
            context_window=window,
            reserve_tokens=_reserve(self.body),
        )
        history = turn.history if turn is not None and use_memory else []
        # Attachments first (up to their share, never out of the newest messages that are
        # kept whatever the budget); then recall's share comes off the top of what they leave;
        # history is chosen for what recall leaves, and recall leaves out what history
        # attaches.
        attached = await self._attach(history, budget, use_memory)
        left = ctx.token_budget - attached.tokens
        recall_budget = left
        if history:
            recall_budget = min(
                int(ctx.token_budget * ctx.recall_share),
                left - mandatory_tokens(messages, history, budget),
            )
            history = history_for(
                messages,
                history,
                replace(budget, token_budget=left - max(0, recall_budget)),
            )
        # Stored turns older than that history: their summary, out of the history's share.
        summarized = await summarize_history(
            self.services,
            tenant,
            turn,
            messages,
            history,
            replace(budget, token_budget=left - max(0, recall_budget)),
        )
        history = summarized.history
        found = await self._recall(history, recall_budget) if use_memory else NOTHING
        self._note_skipped(
            attachments=attached.storage_failed,
            summary=(summarized.record or {}).get("reason") == "unavailable",
            recall=self.recall_failed,
        )
        section = _with_attachments(found.section, attached)
        if history or section is not None:
            client_tokens = None
            if window is not None:
                client_tokens = upper_bound_tokens(messages)
                if client_tokens + ctx.token_budget + budget.reserve_tokens > window:
                    client_tokens = await asyncio.to_thread(count_messages, messages, self.model)
            self.assembly = assemble(
                messages,
                history,
                budget,
                client_tokens,
                recalled=section,
                placement=ctx.placement,
                summary=summarized.section,
            )
        assembly = self.assembly
        sent = assembly is not None and assembly.recalled  # (not dropped for the window)
        recalled = found if sent else NOTHING
        self.recalled_messages = recalled.messages
        self.attachments_count = attached.count if sent else 0
        if recalled.memory_pks and turn is not None:
            self._count_memory_use(turn, recalled.memory_pks)
        self.attached = self._attached_record(assembly, recalled)
        if (summary := summarized.recorded(assembly)) is not None:
            self.attached["summary"] = summary
        if attached.items or attached.storage_failed:
            self.attached["attachments"] = attached.record(sent=sent)

    def _note_skipped(self, **failed: bool) -> None:
        """Parts of memory storage failed (or was too slow) for after the turn was stored:
        the request goes on without them, answered `degraded` and counted (reason
        `partial`)."""
        skipped = [part for part, yes in failed.items() if yes]
        if not skipped:
            return
        if not self.degraded:  # (a turn that was not stored is counted already, as such)
            self.services.metrics.degraded.labels(self.principal.tenant_id, "partial").inc()
        self.degraded = True
        log.warning("memory_partly_skipped", request_id=self.request_id, parts=skipped)

    def _attached_record(self, assembly: Assembly | None, recalled: Recall) -> dict[str, Any]:
        """What the exchange record says was attached (`attached`)."""
        record = {
            "history_messages": assembly.history_messages if assembly else 0,
            "context_tokens": assembly.context_tokens if assembly else 0,
            "dropped_for_window": assembly.dropped_for_window if assembly else 0,
            "recalled": recalled.record(),
            "recall_ms": self.recall_ms,
        }
        if self.attached_by_policy is not None:
            record["intent_policy"] = self.attached_by_policy
        if self.recall_failed:
            record["recall_storage"] = "unavailable"
        return record

    async def _after_spilled_turns(self) -> None:
        """Earlier turns of this user waiting in the spill go into the database first (or
        this one waits in the spill after them), so they keep their order and conversation.

        The reply of the user's previous turn may still be on its way (written after the
        response, `reply_after_response`), and may yet go to the spill: that is waited for
        first, whether this turn then goes to the database or to the spill. Otherwise a thin
        client's turn stored before that reply would follow an unanswered turn, and one with
        the same text (a "yes" twice) would be taken for that turn resent."""
        services, tenant_id, user_id = self.services, self.principal.tenant_id, self.ext.user_id
        replayer = services.replayer
        if replayer is None or self.ext.mode == "off":
            return
        # (At most that write's storage timeout, plus appending to the spill when it fails;
        # this turn's own timeout starts after.)
        await services.memory.settle(tenant_id, user_id)
        if not services.spill.holds(tenant_id, user_id):
            return

        async def caught_up() -> None:
            if not await replayer.catch_up(tenant_id, user_id):
                raise StorageUnavailable("earlier turns of this user still wait in the spill")

        # Storage on the request path like the turn's own: bounded, and not tried at all
        # while the storage circuit is open.
        await services.memory.in_time(caught_up())

    async def _degrade(self, error: StorageError) -> None:
        """Storage failed (or was too slow for) the turn: answer without memory and keep the
        turn in the spill, to be stored when the database is back; or refuse with 503 when
        the tenant says `fail_open: false` or the spill is full."""
        tenant_id, services = self.principal.tenant_id, self.services
        reason = "timeout" if isinstance(error, StorageTimeout) else "unavailable"
        if isinstance(error, StorageCircuitOpen):
            reason = "circuit_open"  # (not tried: the circuit logs its opening, not each request)
        if not self.principal.tenant.fail_open:
            raise ServiceUnavailable(
                "Memory storage is unavailable. Try again later.",
                code="memory_unavailable",
                headers={"retry-after": "5"},
            ) from error
        entry = spilled_turn(
            documents=[]
            if self._shared_conversation
            else [i for i in self.inline if i.content is not None],
            request_id=self.request_id,
            tenant_id=tenant_id,
            user_id=self.ext.user_id,
            started_at=self.started_at,
            mode=self.ext.mode,
            model=self.model,
            conversation_id=self.ext.conversation_id,
            idempotency_key=self.ext.idempotency_key,
            messages=self.sent_messages,
            upstream=self.upstream.name,
            stream=self.info.stream,
        )
        try:
            await services.spill.add(entry, bounded=True)
        except (SpillFull, OSError) as exc:
            services.metrics.spill_refused.labels(tenant_id).inc()
            log.error(
                "memory_spill_refused", request_id=self.request_id, reason=reason, error=str(exc)
            )
            why = "its spill is full" if isinstance(exc, SpillFull) else "its spill failed"
            raise ServiceUnavailable(
                "Memory storage is unavailable and the proxy cannot keep the turn until it is "
                f"back ({why}). Try again later.",
                code="memory_spill_full" if isinstance(exc, SpillFull) else "memory_unavailable",
                headers={"retry-after": "5"},
            ) from error
        self.spilled = True
        self.degraded = True
        services.metrics.degraded.labels(tenant_id, reason).inc()
        if reason != "circuit_open":
            log.warning(
                "memory_degraded", request_id=self.request_id, reason=reason, error=str(error)
            )

    def _embed_question(self) -> None:
        """Start embedding the newest user message when recall will want it (the tenant has
        embeddings on, the user is named, memory is not off): it runs while the turn is
        stored and classified."""
        tenant, messages = self.principal.tenant, self.sent_messages
        if (
            tenant.memory.embeddings == "off"
            or not tenant.context.recall
            or self.ext.mode == "off"
            or self.ext.user_id == ANONYMOUS
            or not messages
            or messages[-1].get("role") != "user"
        ):
            return
        text = message_text(messages[-1])[:EMBED_CHARS]
        self.question_vector = asyncio.ensure_future(
            self.services.embeddings.query(
                self.principal.tenant_id, text, request_id=self.request_id
            )
        )

    async def _semantic(self) -> SemanticQuery | None:
        """Recall's vector half, when the question's embedding arrived in time."""
        task, index = self.question_vector, self.services.vectors
        if task is None or index is None:
            return None
        vector = await task  # bounded by the tenant's embedding_timeout_ms; never raises
        if vector is None:
            return None
        memory = self.principal.tenant.memory
        return SemanticQuery(
            index,
            vector.model,
            vector.values,
            weight=memory.embedding_weight,
            min_similarity=memory.embedding_min_similarity,
        )

    @property
    def _shared_conversation(self) -> bool:
        """The anonymous user is every client that names none: a conversation found by its
        messages alone (two clients opening with the same template) may be another client's.
        Its documents are kept and attached only for requests that name it; the request's
        own go in all the same."""
        return self.ext.user_id == ANONYMOUS and not self.ext.conversation_id

    async def _attach(
        self, history: list[StoredTurn], budget: Budget, use_memory: bool
    ) -> Attached:
        """The conversation's attachments, the request's own (inline, or stored ones it names)
        and earlier tool results, fitted into the attachments' share of the budget. The
        request's inline documents are stored with the conversation first in mode `full`. The
        request's own go in every mode; the conversation's not in mode `off` nor when an intent
        policy says `memory: false`."""
        turn, tenant = self.turn, self.principal.tenant
        # (No turn: storage is away. The request's own documents go in all the same; the
        # spill keeps them with the turn, stored with it when the database is back.)
        keep = conversation = None
        if turn is not None and not self._shared_conversation:
            keep = turn.conversation if turn.mode == "full" and self.inline else None
            conversation = turn.conversation if turn.mode != "off" and use_memory else None
        if (conversation is None or (turn is not None and turn.opened)) and not self.inline:
            return NOTHING_ATTACHED  # (a conversation this turn opened holds none yet)
        ctx = tenant.context
        room = int(ctx.token_budget * tenant.attachments.share)
        if history:
            room = min(
                room, ctx.token_budget - mandatory_tokens(self.sent_messages, history, budget)
            )
        artifacts = self.services.artifacts
        # Tool results the prompt may hold: the client's, and those of the most history could
        # attach (the stored tail read covers a little more than the history window).
        at_most = history_for(self.sent_messages, history, budget)
        in_prompt = {
            str(m.get("tool_call_id"))
            for m in [*self.sent_messages, *(h.message for h in at_most)]
            if m.get("role") == "tool"
        }
        try:  # (what the database fails to do in time is left out inside, and recorded)
            attached = await artifacts.attach(
                tenant,
                request_id=self.request_id,
                tenant_id=self.principal.tenant_id,
                user_id=self.ext.user_id,
                conversation_pk=conversation.pk if conversation else None,
                conversation_id=conversation.id if conversation else None,
                conversation_end=conversation.next_seq if conversation else 0,
                inline=self.inline,
                store_in=keep.pk if keep is not None else None,
                in_prompt_calls=in_prompt,
                question=_last_user_text(self.sent_messages),
                budget=room,
                started_at=self.started_at,
                storage_away=turn is None,
            )
        except Exception:  # a bug here must not fail the chat: logged, the request goes on
            log.exception("attachments_error", request_id=self.request_id)
            return NOTHING_ATTACHED
        self.attached_artifacts = attached
        return attached

    async def _recall(self, history: list[StoredTurn], budget: int) -> Recall:
        """The user's memories and the stored turns of their conversations that match this
        one, within `budget` tokens, leaving out what the prompt holds (the client's messages,
        `history`). Memories go with every call, a tool loop's too (those relevant to the
        user's turn it answers); stored turns are searched for a user's turn, when
        `context.recall` is on."""
        turn, ctx = self.turn, self.principal.tenant.context
        if turn is None or turn.mode == "off" or budget <= 0:
            return NOTHING
        anonymous = turn.user_id == ANONYMOUS
        newest = self.sent_messages[-1]
        asks = newest.get("role") == "user"
        search = ctx.recall and asks
        if anonymous and (turn.conversation is None or turn.opened or not search):
            # No memories and no cross-conversation recall for the anonymous user (and a
            # conversation this turn opened holds only what the prompt does).
            return NOTHING
        in_prompt = [
            searchable_text(str(m.get("role")), m.get("content")) or ""
            for m in [*self.sent_messages, *(h.message for h in history)]
        ]
        started = time.perf_counter()
        semantic = await self._semantic() if search else None
        try:
            found = await self.services.memory.in_time(
                recall(
                    self.services.db,
                    tenant_id=turn.tenant_id,
                    user_id=turn.user_id,
                    text=_last_user_text(self.sent_messages),
                    exclude=in_prompt,
                    budget_tokens=budget,
                    candidates=ctx.recall_candidates
                    or min(MAX_CANDIDATES, max(10, budget // TOKENS_PER_CANDIDATE)),
                    now=now(),
                    conversation_pk=turn.conversation.pk
                    if anonymous and turn.conversation
                    else None,
                    hidden=(turn.conversation.pk, turn.visible_before)
                    if turn.conversation is not None and turn.visible_before is not None
                    else None,
                    memory_share=ctx.memory_share,
                    semantic=semantic,
                    excerpts=search,
                )
            )
        except StorageError as exc:  # recall is an addition: without it the request goes on
            log.warning("recall_failed", request_id=self.request_id, error=str(exc))
            found, self.recall_failed = NOTHING, True
        self.recall_ms = round((time.perf_counter() - started) * 1000, 3)
        return found

    def _count_memory_use(self, turn: Turn, pks: list[int]) -> None:
        """Memories attached to the turn: their access counts, off the request path (a
        management call waits for it)."""

        async def write() -> None:
            try:
                await self.services.db.write(
                    lambda conn: Memories(conn).used(turn.tenant_id, pks, now())
                )
            except StorageError as exc:
                log.warning("memory_use_not_counted", request_id=self.request_id, error=str(exc))

        self.services.memory.track(turn, self.services.spawn(write()), metadata=True)

    async def _classify(self) -> bool:
        """The turn's intent: the keyword one (from begin(), where the history is known), and
        the LLM classifier started alongside; False if the tenant's policy for the label
        says to attach no stored context."""
        intents, tenant_id = self.services.intents, self.principal.tenant_id
        history = [t.message for t in self.turn.history] if self.turn else []
        if self.turn is not None:
            if self.turn.unclassified is not None and not intents.uses_llm(tenant_id):
                # Mode off: nothing attached depends on it; found while the upstream works.
                self.while_upstream.append(self._classify_later)
                return True
            self.intent = classify(self.turn)
        else:  # storage failed: the request's own messages are all there is
            self.intent = intents.keyword(tenant_id, self.sent_messages)
        settings = self.principal.tenant.intent
        if self.intent is not None and intents.uses_llm(tenant_id):
            self.llm_intent = self.services.spawn(
                intents.llm(tenant_id, history + self.sent_messages)
            )
            if settings.wait_for_llm:
                # Bounded by the classifier's own timeout; shielded so a client leaving does
                # not cancel what the record still wants.
                self.intent = (await asyncio.shield(self.llm_intent)).intent or self.intent
        return self._policy_allows_memory()

    def _policy_allows_memory(self) -> bool:
        """False if the tenant's policy for the intent says to attach no stored context."""
        policies = self.principal.tenant.intent.policies
        policy = policies.get(self.intent.label) if self.intent else None
        if self.intent is not None and policy is not None and not policy.memory:
            self.attached_by_policy = {"label": self.intent.label, "memory": False}
            return False
        return True

    def _classify_later(self) -> None:
        """Mode off: the keyword intent `begin()` left for later, found now (once)."""
        if self.turn is None or self.turn.unclassified is None:
            return
        self.intent = classify(self.turn)
        if not self._policy_allows_memory():  # (in mode off, for the record only)
            self.attached["intent_policy"] = self.attached_by_policy

    def _intent_now(self) -> tuple[Intent | None, Decimal]:
        """The intent for the headers (the LLM's if it has answered) and what the LLM call
        cost so far (nothing when its model has no price: see Bill)."""
        task = self.llm_intent
        if task is None or not task.done() or task.cancelled():
            return self.intent, ZERO
        result: LLMIntent = task.result()
        if result.usage is None:
            return result.intent or self.intent, ZERO
        cost = self.services.pricer.prices.cost(result.model, result.usage)
        return result.intent or self.intent, ZERO if cost is None else cost

    def _ask_for_usage(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Ask the upstream for the usage chunk; True if the client did not ask for it."""
        options = body.get("stream_options") or {}
        if options.get("include_usage") is True or not self.upstream.stream_usage:
            return body, False
        return {**body, "stream_options": {**options, "include_usage": True}}, True

    async def _count_prompt(self) -> int:
        """The prompt's tokens: the client's messages counted now, plus the stored ones the
        proxy attached (counted when they were stored)."""
        client = await count_prompt(self.body["messages"], self.model)
        return client + (self.assembly.context_tokens if self.assembly else 0)

    async def _whole_outcome(self, status: int, body: bytes, forwarded: float) -> Outcome:
        ok = status < 400
        message, usage = reply_from_completion(body) if ok else (None, None)
        if ok:
            bill = await self.services.pricer.final(
                self.model, usage, prompt_tokens=None, prompt=self.sent_messages, reply=message
            )
        else:
            bill = nothing_billed()
        now = time.perf_counter()
        upstream_ms = self.info.upstream_ms or 0.0
        return Outcome(
            status="complete" if ok else "error",
            http_status=status,
            reply=message,
            bill=bill,
            error=None if ok else body[:2000].decode("utf-8", "replace"),
            latency_ms=(now - self.info.started) * 1000,
            upstream_ms=upstream_ms,
            overhead_ms=(now - self.info.started) * 1000 - upstream_ms,
            attached=self.attached,
        )

    async def settle(self, outcome: Outcome) -> None:
        """Count the exchange (metrics, the tenant's limits) and record it."""
        if self.settled:
            return
        self.settled = True
        await self._settle(outcome)

    async def _settle(self, outcome: Outcome) -> None:
        self._classify_later()  # (if it ended before its upstream call: for the record)
        if self.flight is not None:
            self.flight.end()
        tenant = self.principal.tenant_id
        self.services.metrics.observe_chat(tenant, self.model_label, outcome)
        if self.services.config.server.log_content:  # debugging only: off by default
            log.info(
                "chat_content",
                request_id=self.request_id,
                tenant=tenant,
                user=self.ext.user_id,
                sent=self.sent_messages,
                reply=outcome.reply,
                status=outcome.status,
            )
        if outcome.bill is not None:
            # The upstream call only: the proxy's own calls are counted as they are charged.
            usage = outcome.bill.usage
            self.services.limits.spend(tenant, usage.total_tokens, outcome.bill.upstream_usd)
        if self.turn is not None:
            await record(self.services, self.turn, outcome, self.info)
        elif self.spilled:  # its turn is in the spill: the outcome goes after it
            head = self._spill_head()
            await spill_outcome(self.services, spilled_outcome(*head, outcome, turn=None))
        if self.llm_intent is not None:
            task = self.services.spawn(self._record_llm_intent(self.llm_intent))
            if self.turn is not None:
                # Management calls (the exchange record, usage reports) wait for it.
                self.services.memory.track(self.turn, task, metadata=True)
        if self.attached_artifacts.calls or self.question_vector is not None:
            task = self.services.spawn(self._charge_own_calls())
            if self.turn is not None:
                self.services.memory.track(self.turn, task, metadata=True)

    def _own_calls(self) -> list[tuple[str, str, Usage]]:
        """The proxy's own paid calls for this request so far, but the LLM intent's (kind,
        model, usage): the planner's and summariser's, and the question's embedding."""
        calls = list(self.attached_artifacts.calls)
        task = self.question_vector
        if task is not None and task.done() and not task.cancelled():
            vector = task.result()
            if vector is not None and vector.usage is not None:
                calls.append((EMBEDDING, vector.model, vector.usage))
        return calls

    async def _charge_own_calls(self) -> None:
        """`_own_calls`, charged to the exchange once it is recorded (those made before the
        headers went out are in the response's `x-cost-memory-usd` already)."""
        turn = self.turn
        if turn is not None and turn.pending is not None:
            await self.services.deferred.settle()  # its record is written in a batch
        if self.question_vector is not None:
            await asyncio.wait([self.question_vector])  # (bounded by its own timeout)
        for kind, model, usage in self._own_calls():
            await self._charge(kind, model, usage)

    async def _record_llm_intent(self, task: asyncio.Task[LLMIntent]) -> None:
        """When the LLM's intent arrives (maybe after the response), it replaces the keyword
        one in the records, and its cost is charged to the exchange. When storage was down
        for the exchange, or fails for this write, the intent waits in the spill with it."""
        result = await task
        turn, tenant, services = self.turn, self.principal.tenant_id, self.services
        if turn is not None and turn.pending is not None:
            await services.deferred.settle()  # its record is written in a batch
        if result.intent is not None and (turn is not None or self.spilled):
            detail = result.intent.as_dict()
            recorded = False
            if turn is not None:
                try:
                    recorded = await services.db.write(
                        partial(
                            record_intent,
                            tenant_id=tenant,
                            request_id=turn.request_id,
                            detail=detail,
                        )
                    )
                except StorageError as exc:
                    log.warning("intent_spilled", request_id=self.request_id, error=str(exc))
            if not recorded:
                entry = spilled_intent(*self._spill_head(), detail)
                await spill_outcome(services, entry)
        if result.usage is not None:
            await self._charge("intent", result.model, result.usage)

    async def _charge(self, kind: str, model: str, usage: Usage) -> None:
        """One of the proxy's own model calls, charged to the exchange (record, budgets,
        metrics). When storage was down for the exchange, or fails for this write, the part
        waits in the spill with the exchange (it is counted against the budgets at once)."""
        turn, tenant, services = self.turn, self.principal.tenant_id, self.services
        part, usd = services.charges.priced(kind, model, usage)
        services.charges.count(tenant, model, usage, usd, kind)
        if turn is not None:
            try:
                if await services.charges.record(tenant, turn.request_id, part) != "missing":
                    return
                # (Its record is not there: a mode-off record whose batch went to the spill,
                # or one erased since, which the replay then drops.)
                log.warning("memory_cost_spilled", request_id=turn.request_id, error="no record")
            except StorageError as exc:
                log.warning("memory_cost_spilled", request_id=turn.request_id, error=str(exc))
        elif not self.spilled:
            return  # no exchange to charge it to
        await spill_outcome(services, spilled_charge(*self._spill_head(), part))

    def _spill_head(self) -> tuple[str, str, str, datetime]:
        """What a spill entry of this request starts with: tenant, user, request id and when
        the request began."""
        return (self.principal.tenant_id, self.ext.user_id, self.request_id, self.started_at)


async def chat_completion(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, body: dict[str, Any]
) -> Response[Any]:
    metrics, tenant = services.metrics, principal.tenant_id
    try:
        chat = ChatExchange(request, principal, services, body)  # a bad header costs no rpm
        # Then the limits: a refused request stores nothing and never reaches the upstream.
        services.limits.admit(principal)
    except ProxyError as exc:
        if isinstance(exc, RateLimited):
            metrics.rate_limited.labels(tenant, exc.type).inc()
        metrics.count_request(tenant, metrics.model(body["model"]), exc.status)
        _bill_nothing(exc)
        raise
    try:
        return await chat.answer()
    except ProxyError as exc:
        _bill_nothing(exc)
        chat._classify_later()  # (mode off, if it failed before its upstream call)
        if chat.intent is not None:  # classified before it failed (e.g. the upstream timed out)
            exc.headers = {"x-memory-intent": chat.intent.header(), **exc.headers}
        raise


def _bill_nothing(exc: ProxyError) -> None:
    """Every chat completion says what it cost: a refused or failed one, nothing."""
    exc.headers = {**nothing_billed().headers(), **exc.headers}


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    """The newest user turn's text (a tool loop's calls answer it too)."""
    return next((message_text(m) for m in reversed(messages) if m.get("role") == "user"), "")


def _with_attachments(recalled: Recalled | None, attached: Attached) -> Recalled | None:
    """One context section: recall's (memories, excerpts), then the attachments'."""
    if not attached.text:
        return recalled
    if recalled is None:
        return Recalled(attached.text, attached.tokens)
    text = recalled.text + "\n\n" + attached.text  # (one message: its overhead counts once)
    return Recalled(text, count_message({"role": "system", "content": text}))


def _reserve(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0
