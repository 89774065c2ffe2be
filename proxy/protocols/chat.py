"""The Chat Completions protocol (`POST /v1/chat/completions`): the request is already the
neutral turn's shape; the assembled messages replace the client's, and a stream carries the
usage chunk the proxy asks for (left out again for a client that did not ask for it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request, Response

from proxy.core.auth import Principal
from proxy.core.errors import ProxyError, sse_error_event
from proxy.pipeline.exchange import answer_turn
from proxy.pipeline.wire import NeutralTurn, WholeReply
from proxy.state import AppState
from proxy.upstream.base import Upstream, UpstreamReply
from proxy.upstream.sse import DONE, ReplyAssembler, event_data, reply_from_completion


class ChatReader:
    """A chat.completion.chunk stream, folded into one assistant message (choice 0)."""

    end_markers: tuple[bytes, ...] = (DONE,)

    def __init__(self, *, drop_usage_chunk: bool) -> None:
        self.reply = ReplyAssembler()
        self.drop_usage_chunk = drop_usage_chunk

    @property
    def error(self) -> dict[str, Any] | None:
        return self.reply.error

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.reply.usage

    def read(self, raw: bytes, *, fold: bool = True) -> bytes:
        payload = event_data(raw)
        if payload is None:
            return raw
        usage_only = self.reply.add(payload, fold=fold)
        return b"" if usage_only and self.drop_usage_chunk else raw

    @property
    def ended(self) -> bool:
        return self.reply.done or bool(self.reply.finish_reason)

    @property
    def received_anything(self) -> bool:
        return self.reply.received_anything

    def message(self) -> dict[str, Any]:
        return self.reply.message()

    def failed(self, error: ProxyError) -> bytes:
        return sse_error_event(error)

    def close(self) -> bytes:
        return b""

    def unread(self, raw: bytes) -> bytes:
        return raw  # (relayed as it came: only the proxy stops reading the stream)

    @property
    def native(self) -> None:
        return None


class ChatCompletions:
    """One chat completion request's adapter."""

    name = "chat"

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.drop_usage_chunk = False

    def neutral(self) -> NeutralTurn:
        body = self.body
        return NeutralTurn(
            model=body["model"],
            messages=body["messages"],
            stream=body.get("stream") is True,
            user_fields=[
                ("safety_identifier", body.get("safety_identifier")),
                ("user", body.get("user")),
            ],
            reserve_tokens=_reserve(body),
            # memproxy's own extension: never forwarded, in any mode.
            attachments=body.pop("attachments", None),
        )

    async def call(
        self,
        upstream: Upstream,
        messages: list[dict[str, Any]],
        *,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        body = self.body
        if messages is not body["messages"]:
            body = {**body, "messages": messages}
        stream = body.get("stream") is True
        if stream:
            body = self._ask_for_usage(body, upstream)
        return await upstream.chat_completions(body, stream=stream, sent=sent)

    def _ask_for_usage(self, body: dict[str, Any], upstream: Upstream) -> dict[str, Any]:
        """Ask the upstream for the usage chunk (left out again if the client did not ask)."""
        options = body.get("stream_options") or {}
        if options.get("include_usage") is True or not upstream.stream_usage:
            return body
        self.drop_usage_chunk = True
        return {**body, "stream_options": {**options, "include_usage": True}}

    def keep(
        self, native: dict[str, Any] | None, *, tenant_id: str, user_id: str, request_id: str
    ) -> None:
        return None  # (a chat completion is not kept apart from its messages)

    def stream_reader(self, prompt_tokens: int | None = None) -> ChatReader:
        return ChatReader(drop_usage_chunk=self.drop_usage_chunk)

    def whole(self, reply: UpstreamReply) -> WholeReply:
        if reply.status >= 400:
            return WholeReply(None, None, reply)
        message, usage = reply_from_completion(reply.body or b"")
        return WholeReply(message, usage, reply)


async def chat_completion(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, body: dict[str, Any]
) -> Response[Any]:
    wire = ChatCompletions(body)
    return await answer_turn(request, principal, services, wire, wire.neutral())


def _reserve(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0
