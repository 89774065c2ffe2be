"""A chat completion through the proxy: identify, load and store, assemble, forward, record."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any

import structlog
from litestar import Request, Response

from policies.context import Assembly, Budget, assemble
from policies.tokens import count_messages, upper_bound_tokens
from proxy.access import RequestInfo, request_info
from proxy.auth import Principal
from proxy.errors import BadRequest, ProxyError, ServiceUnavailable
from proxy.memory import ANONYMOUS, Mode, Outcome, Turn
from proxy.relay import to_response
from proxy.sse import ReplyAssembler, SSEDecoder, reply_from_completion
from proxy.state import AppState
from storage.errors import StorageError

log = structlog.get_logger("memproxy.completions")
CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MODES: tuple[Mode, ...] = ("full", "read", "off")


@dataclass(frozen=True, slots=True)
class Extensions:
    """memproxy's optional request headers (DESIGN.md, request extensions)."""

    user_id: str
    conversation_id: str | None
    mode: Mode
    idempotency_key: str | None


def read_extensions(request: Request[Any, Any, Any], body: dict[str, Any]) -> Extensions:
    headers = request.headers
    user = headers.get("x-memory-user-id") or body.get("user")
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


def memory_headers(turn: Turn | None, assembly: Assembly | None, degraded: bool) -> dict[str, str]:
    headers = {
        "x-memory-context-tokens": str(assembly.context_tokens if assembly else 0),
        "x-memory-history-messages": str(assembly.history_messages if assembly else 0),
        "x-memory-memories": "0",
        "x-memory-attachments": "0",
        "x-memory-status": "degraded" if degraded else "ok",
    }
    if turn is not None and turn.conversation_id:
        headers["x-memory-conversation-id"] = turn.conversation_id
    return headers


class ChatStreamObserver:
    """Reassembles a streamed reply and records it when the stream ends."""

    def __init__(
        self, services: AppState, turn: Turn | None, info: RequestInfo, attached: dict[str, Any]
    ) -> None:
        self.services, self.turn, self.info, self.attached = services, turn, info, attached
        self.decoder = SSEDecoder()
        self.reply = ReplyAssembler()
        self.first_chunk_at: float | None = None
        self.broken = False

    def feed(self, chunk: bytes) -> None:
        if self.first_chunk_at is None:
            self.first_chunk_at = time.perf_counter()
        if self.broken:
            return
        try:
            for payload in self.decoder.feed(chunk):
                self.reply.add(payload)
        except Exception:
            # Chunks we cannot make sense of still reach the client; we stop reassembling.
            self.broken = True
            log.warning("stream_not_understood", request_id=self.info.request_id, exc_info=True)

    def _outcome(self, status: str, error: str | None) -> Outcome:
        if status == "complete" and not (self.reply.done or self.reply.finish_reason):
            status = "incomplete"
        started = self.info.started
        return Outcome(
            status=status,  # type: ignore[arg-type]
            http_status=200,
            reply=self.reply.message() if self.reply.received_anything else None,
            usage=self.reply.usage,
            error=error,
            latency_ms=(time.perf_counter() - started) * 1000,
            ttft_ms=None if self.first_chunk_at is None else (self.first_chunk_at - started) * 1000,
            upstream_ms=self.info.upstream_ms,
            attached=self.attached,
        )

    async def finish(self, status: str, error: str | None) -> None:
        if self.turn is not None:
            # Shielded: a client leaving during this write must not cancel it half-way.
            task = self.services.spawn(
                record(self.services, self.turn, self._outcome(status, error))
            )
            await asyncio.shield(task)

    def abandon(self) -> None:
        if self.turn is not None:
            # Complete if the reply had already finished when the client left.
            outcome = self._outcome("complete", "client disconnected")
            self.services.spawn(record(self.services, self.turn, outcome))


async def record(services: AppState, turn: Turn, outcome: Outcome) -> None:
    """Store the outcome; a storage failure here is logged, never raised into the response.

    A turn that stored nothing beforehand (mode off) is recorded later, in a batch; a reply may
    be written just after the response (ConversationMemory.reply_after_response), with the next
    request of the same user waiting for it. The client waits only for what it must."""
    if turn.pending is not None:
        services.deferred.add(turn, outcome)
    elif services.memory.reply_after_response:
        services.memory.track(turn, services.spawn(_record(services, turn, outcome)))
    else:
        await _record(services, turn, outcome)


async def _record(services: AppState, turn: Turn, outcome: Outcome) -> None:
    try:
        await services.memory.finish(turn, outcome)
    except StorageError as exc:
        log.error("exchange_not_recorded", request_id=turn.request_id, error=str(exc))


async def chat_completion(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, body: dict[str, Any]
) -> Response[Any]:
    info = request_info(request.scope)
    ext = read_extensions(request, body)
    tenant = principal.tenant
    model: str = body["model"]
    stream = info.stream
    upstream = services.upstream_for(principal)
    messages: list[dict[str, Any]] = body["messages"]
    # memproxy's own extension: never forwarded (attachments are handled by a later feature).
    body.pop("attachments", None)

    turn: Turn | None = None
    degraded = False
    try:
        turn = await services.memory.begin(
            request_id=info.request_id,
            tenant_id=principal.tenant_id,
            user_id=ext.user_id,
            conversation_id=ext.conversation_id,
            mode=ext.mode,
            idempotency_key=ext.idempotency_key,
            messages=messages,
            model=model,
            upstream=upstream.name,
            stream=stream,
            context=tenant.context,
        )
    except StorageError as exc:
        if not tenant.fail_open:
            raise ServiceUnavailable("Memory storage is unavailable.") from exc
        degraded = True
        log.warning("memory_degraded", request_id=info.request_id, error=str(exc))

    assembly: Assembly | None = None
    if turn is not None and turn.history:
        ctx = tenant.context
        window = services.context_window(model)
        budget = Budget(
            token_budget=ctx.token_budget,
            max_history_messages=ctx.max_history_messages,
            min_recent_messages=ctx.min_recent_messages,
            context_window=window,
            reserve_tokens=_reserve(body),
        )
        client_tokens = None
        if window is not None:
            client_tokens = upper_bound_tokens(messages)
            if client_tokens + ctx.token_budget + budget.reserve_tokens > window:
                client_tokens = await asyncio.to_thread(count_messages, messages, model)
        assembly = assemble(messages, turn.history, budget, client_tokens)
        body = {**body, "messages": assembly.messages}
    attached = {
        "history_messages": assembly.history_messages if assembly else 0,
        "context_tokens": assembly.context_tokens if assembly else 0,
        "dropped_for_window": assembly.dropped_for_window if assembly else 0,
    }
    headers = memory_headers(turn, assembly, degraded)

    started = time.perf_counter()
    try:
        reply = await upstream.chat_completions(body, stream=stream)
    except Exception as exc:
        if turn is not None:
            failure = exc if isinstance(exc, ProxyError) else ProxyError(repr(exc))
            outcome = Outcome("error", failure.status, error=failure.message, attached=attached)
            await record(services, turn, outcome)
        raise
    info.upstream_ms = (time.perf_counter() - started) * 1000

    if reply.chunks is not None:
        observer = ChatStreamObserver(services, turn, info, attached)
        return to_response(request, reply, headers=headers, observer=observer)
    if turn is not None:
        ok = reply.status < 400
        message, usage = reply_from_completion(reply.body or b"") if ok else (None, None)
        await record(
            services,
            turn,
            Outcome(
                status="complete" if ok else "error",
                http_status=reply.status,
                reply=message,
                usage=usage,
                error=None if ok else (reply.body or b"")[:2000].decode("utf-8", "replace"),
                latency_ms=(time.perf_counter() - info.started) * 1000,
                upstream_ms=info.upstream_ms,
                attached=attached,
            ),
        )
    return to_response(request, reply, headers=headers)


def _reserve(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0
