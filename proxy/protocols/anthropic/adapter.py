"""The Anthropic Messages protocol (`POST /v1/messages`) on the turn pipeline.

The request's `system` and `messages` become the neutral turn's messages (request.py). Two
ways to the upstream:

- **native** (kind `anthropic`): the client's request goes as it came, byte for byte up to
  its newest user turn, with what the proxy attached placed around it (native.py); the reply
  or event stream comes back as the API sent it, read to observe.
- **translate** (any other kind): the request becomes a chat completion (to_chat.py), and the
  reply an Anthropic `message` or event stream again (from_chat.py, chat_stream.py). What the
  proxy attaches is placed by the pipeline (a system message right before the newest user
  message, by default): the translated client prefix before it is the same, request after
  request, as it would be without memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec

from proxy.core.errors import ProxyError
from proxy.pipeline.wire import NeutralTurn, WholeReply
from proxy.protocols import translated
from proxy.protocols.anthropic.chat_stream import ChatToMessagesStream, encode_event
from proxy.protocols.anthropic.from_chat import (
    as_error_body,
    error_body,
    message_from_chat,
    new_message_id,
    stored_reply,
)
from proxy.protocols.anthropic.native import MessageAssembler, native_body, observe_message
from proxy.protocols.anthropic.request import ParsedMessages, parse_messages
from proxy.protocols.anthropic.to_chat import chat_request
from proxy.upstream.anthropic import FORWARDED, MessagesUpstream
from proxy.upstream.base import Upstream, UpstreamReply
from proxy.upstream.sse import event_data, reply_from_completion

# A Messages stream ends with this event: held back until the exchange is stored.
END_MARKERS = (b"event: message_stop",)


class TranslatedReader(translated.TranslatedReader):
    """A chat completion stream given to the client as the Messages event sequence."""

    end_markers = END_MARKERS
    events: ChatToMessagesStream

    def __init__(self, model: str, message_id: str, prompt_tokens: int | None = None) -> None:
        super().__init__(ChatToMessagesStream(model, message_id, prompt_tokens))

    @property
    def native(self) -> None:
        return None

    def message(self) -> dict[str, Any]:
        reply = stored_reply(self.chat.message())
        assert reply is not None
        return reply

    def failed(self, error: ProxyError) -> bytes:
        return self.events.start() + self.events.fail(error.message, error.status)


class NativeReader:
    """A Messages event stream from the upstream, relayed as it is and folded to observe."""

    end_markers = END_MARKERS

    def __init__(self) -> None:
        self.reply = MessageAssembler()

    @property
    def error(self) -> dict[str, Any] | None:
        return self.reply.error

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.reply.chat_usage()

    @property
    def ended(self) -> bool:
        return self.reply.stopped

    @property
    def received_anything(self) -> bool:
        return self.reply.received_anything

    @property
    def native(self) -> None:
        return None

    def message(self) -> dict[str, Any]:
        return self.reply.message()

    def read(self, raw: bytes, *, fold: bool = True) -> bytes:
        payload = event_data(raw)
        if payload is not None:
            self.reply.add(payload)
        return raw

    def unread(self, raw: bytes) -> bytes:
        return raw

    def close(self) -> bytes:
        return b""

    def failed(self, error: ProxyError) -> bytes:
        return encode_event(error_body(error.status, error.message))


def user_fields(body: dict[str, Any]) -> list[tuple[str, object]]:
    """The request's own field that may name its user."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return [("metadata.user_id", user)]


class MessagesAPI:
    """One `POST /v1/messages` request's adapter."""

    name = "messages"

    def __init__(
        self,
        body: dict[str, Any],
        *,
        native: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """`native`: the upstream speaks the Messages API; `headers`: the client's request
        headers (its anthropic-version and anthropic-beta go on to a native upstream)."""
        self.body, self.native = body, native
        given = headers or {}
        self.headers = {k: given[k] for k in FORWARDED if k in given}
        self.message_id = new_message_id()
        # memproxy's own extension: never forwarded.
        self.attachments = body.pop("attachments", None)
        self.parsed: ParsedMessages = parse_messages(body)  # (malformed: 400, nothing stored)
        self.messages = self.parsed.messages
        if not native:  # (what translation cannot serve: 400 before anything is stored)
            chat_request(body, self.messages)

    def neutral(self) -> NeutralTurn:
        body = self.body
        return NeutralTurn(
            model=body["model"],
            messages=self.messages,
            stream=body.get("stream") is True,
            user_fields=user_fields(body),
            reserve_tokens=body["max_tokens"],
            attachments=self.attachments,
        )

    async def call(
        self,
        upstream: Upstream,
        messages: list[dict[str, Any]],
        *,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        if self.native:
            body = native_body(self.body, self.parsed, messages)
            stream = body.get("stream") is True
            native = cast(MessagesUpstream, upstream)
            return await native.messages(body, self.headers, stream=stream, sent=sent)
        chat = chat_request(self.body, messages, stream_usage=upstream.stream_usage)
        return await upstream.chat_completions(chat, stream=chat.get("stream") is True, sent=sent)

    def keep(
        self, native: dict[str, Any] | None, *, tenant_id: str, user_id: str, request_id: str
    ) -> None:
        return None  # (a message is not kept apart from the conversation's messages)

    def stream_reader(self, prompt_tokens: int | None = None) -> TranslatedReader | NativeReader:
        if self.native:
            return NativeReader()
        return TranslatedReader(self.body["model"], self.message_id, prompt_tokens)

    def whole(self, reply: UpstreamReply) -> WholeReply:
        if self.native:  # (an error passes on as the API said it)
            if reply.status >= 400:
                return WholeReply(None, None, reply)
            message, usage = observe_message(reply.body or b"")
            return WholeReply(message, usage, reply)
        if reply.status >= 400:
            try:
                payload = msgspec.json.decode(reply.body or b"")
            except (ValueError, RecursionError):
                payload = None
            body = msgspec.json.encode(as_error_body(reply.status, payload))
            return WholeReply(None, None, UpstreamReply(reply.status, dict(reply.headers), body))
        message, usage = reply_from_completion(reply.body or b"")
        try:
            completion = msgspec.json.decode(reply.body or b"")
        except (ValueError, RecursionError):
            completion = None
        if not isinstance(completion, dict):
            return WholeReply(stored_reply(message), usage, reply)
        native = message_from_chat(completion, self.body["model"], self.message_id)
        translated = UpstreamReply(reply.status, dict(reply.headers), msgspec.json.encode(native))
        return WholeReply(stored_reply(message), usage, translated)
