"""The Responses API protocol (`POST /v1/responses`) on the turn pipeline.

The request's `instructions` and `input` items become the neutral turn's messages (items.py).
Two ways to the upstream:

- **native** (an `openai` upstream with its own Responses API): the client's items go as they
  came, in order; what the proxy attaches is placed among them as items, except that on a
  response the upstream stores (`store` not false) the proxy's context goes into
  `instructions`, which `previous_response_id` does not carry over, so it never accumulates in
  the upstream's state. With `previous_response_id` the upstream holds the history: the proxy
  sends none of it again (recall, memories and documents still go).
- **translate** (any other upstream): the request becomes a chat completion (to_chat.py), the
  reply a Responses `response` or event stream again (from_chat.py, chat_stream.py), and
  memproxy keeps the responses itself to serve `previous_response_id` and the `GET` routes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from proxy.core.errors import BadRequest, ProxyError
from proxy.pipeline.wire import NeutralTurn, WholeReply
from proxy.protocols import translated
from proxy.protocols.responses.chat_stream import ChatToResponsesStream, encode_event
from proxy.protocols.responses.from_chat import response_from_chat
from proxy.protocols.responses.items import (
    OPAQUE,
    ParsedInput,
    is_opaque,
    messages_to_items,
    parse_input,
)
from proxy.protocols.responses.observe import ResponsesAssembler, observe_body
from proxy.protocols.responses.stored import new_response_id, response_record
from proxy.protocols.responses.to_chat import chat_request
from proxy.upstream.base import Upstream, UpstreamReply
from proxy.upstream.sse import event_data, reply_from_completion
from storage.records import KEPT_ITEMS, ResponseRecord

# Output items the reply message holds (the others are kept beside it).
REPLY_ITEMS = frozenset({"message", "function_call"})
# A Responses stream ends with one of these events: held back until the exchange is stored.
END_MARKERS = (
    b"event: response.completed",
    b"event: response.incomplete",
    b"event: response.failed",
)


class TranslatedReader(translated.TranslatedReader):
    """A chat completion stream given to the client as the Responses event sequence."""

    end_markers = END_MARKERS
    events: ChatToResponsesStream

    def __init__(self, request: dict[str, Any], response_id: str, created_at: int) -> None:
        super().__init__(ChatToResponsesStream(request, response_id, created_at))

    @property
    def native(self) -> dict[str, Any] | None:
        return self.events.response


class NativeReader:
    """A Responses event stream from the upstream, relayed as it is and folded to observe."""

    end_markers = END_MARKERS

    def __init__(self) -> None:
        self.response = ResponsesAssembler()
        self.sequence = -1

    @property
    def error(self) -> dict[str, Any] | None:
        return self.response.error if self.response.status == "error" else None

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.response.usage

    @property
    def ended(self) -> bool:
        return self.response.terminal is not None

    @property
    def received_anything(self) -> bool:
        return self.response.reply() is not None

    @property
    def native(self) -> dict[str, Any] | None:
        return self.response.response

    def message(self) -> dict[str, Any]:
        reply = reply_with_items(self.response.reply(), self.response.output())
        return reply or {"role": "assistant", "content": None}

    def read(self, raw: bytes, *, fold: bool = True) -> bytes:
        payload = event_data(raw)
        if payload is not None:
            self.response.add(payload)
            self.sequence += 1
        return raw

    def close(self) -> bytes:
        return b""

    def unread(self, raw: bytes) -> bytes:
        return raw

    def failed(self, error: ProxyError) -> bytes:
        event = {
            "type": "error",
            "code": error.code or error.type,
            "message": error.message,
            "param": error.param,
            "sequence_number": self.sequence + 1,
        }
        return encode_event(event)


def with_kept_items(parsed: ParsedInput) -> list[tuple[dict[str, Any], int | None]]:
    """The turn's messages and their origins, each carrying the items with no chat
    equivalent that came just before it (those after the last message, with it)."""
    kept: list[tuple[dict[str, Any], int | None]] = []
    pending: list[Any] = []
    for message, origin in zip(parsed.messages, parsed.origin, strict=True):
        if is_opaque(message):
            pending.append(message[OPAQUE])
            continue
        kept.append(({**message, KEPT_ITEMS: pending} if pending else message, origin))
        pending = []
    if pending and kept:
        last, origin = kept[-1]
        kept[-1] = ({**last, KEPT_ITEMS: [*last.get(KEPT_ITEMS, []), *pending]}, origin)
    return kept


def reply_with_items(reply: dict[str, Any] | None, output: list[Any]) -> dict[str, Any] | None:
    """A native reply as one assistant message, with the output items it has no place for
    (reasoning...) kept beside it."""
    kept = [i for i in output if isinstance(i, dict) and i.get("type") not in REPLY_ITEMS]
    if reply is None or not kept:
        return reply
    return {**reply, KEPT_ITEMS: kept}


def user_fields(body: dict[str, Any]) -> list[tuple[str, object]]:
    """The request's own fields that may name its user, most specific first."""
    return [("safety_identifier", body.get("safety_identifier")), ("user", body.get("user"))]


class ResponsesAPI:
    """One `POST /v1/responses` request's adapter."""

    name = "responses"

    def __init__(
        self,
        body: dict[str, Any],
        *,
        translate: bool,
        history: list[dict[str, Any]] | None = None,
        conversation_id: str | None = None,
        held_upstream: bool = False,
    ) -> None:
        """`history`: the messages of a `previous_response_id` chain memproxy keeps itself
        (translate), the prompt's prefix: sent after the request's `instructions` and before
        its input, as the upstream would have kept them; `held_upstream`: the upstream keeps
        that chain (native). Either way the pipeline stores the request's own messages in a
        known conversation, and attaches no stored history."""
        self.body, self.translate = body, translate
        self.history = history or []
        self.conversation_id, self.held_upstream = conversation_id, held_upstream
        self.response_id = new_response_id() if translate else None
        self.created_at = int(time.time())
        # memproxy's own extension: never forwarded.
        self.attachments = body.pop("attachments", None)
        parsed: ParsedInput = parse_input(body)  # (a malformed item: 400, nothing stored)
        # Items with no chat equivalent (reasoning...) are not messages of the turn: they go to
        # a native upstream as they came, and are stored whole with the message after them
        # (never as text, nor in its chain hash), so a client sending a reasoning item back
        # continues the conversation its reply was stored in.
        kept = with_kept_items(parsed)
        if not any(o is not None for _, o in kept):
            raise BadRequest("'input' holds no message memproxy can read.", param="input")
        self.messages = [m for m, _ in kept]
        self.origin = [o for _, o in kept]
        if translate:  # (what translation cannot serve: 400 before anything is stored)
            chat_request(body, self.neutral().prompt)

    def neutral(self) -> NeutralTurn:
        body = self.body
        limit = body.get("max_output_tokens")
        return NeutralTurn(
            model=body["model"],
            messages=self.messages,
            stream=body.get("stream") is True,
            user_fields=user_fields(body),
            reserve_tokens=limit if isinstance(limit, int) and limit > 0 else 0,
            attachments=self.attachments,
            conversation_id=self.conversation_id,
            prefix=self.history,
            # (the request's `instructions` stay first: the upstream gets them before a chain)
            prefix_at=1 if self.origin[:1] == [None] else 0,
            attach_history=not (self.held_upstream or self.history),
        )

    async def call(
        self,
        upstream: Upstream,
        messages: list[dict[str, Any]],
        *,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        stream = self.body.get("stream") is True
        if self.translate:
            chat = chat_request(self.body, messages).body  # (the chain in it: the prompt)
            if not upstream.stream_usage:  # (a server that refuses the option: counted instead)
                chat.pop("stream_options", None)
            return await upstream.chat_completions(chat, stream=stream, sent=sent)
        return await upstream.responses(self.native_body(messages), stream=stream, sent=sent)

    def native_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The request for a native upstream: the client's items unaltered and in order, with
        what the proxy attached placed among them (or its context in `instructions`)."""
        if messages is self.messages:
            return self.body
        raw = self.body.get("input")
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
        origin = self.origin
        ends = [*(o for o in origin if o is not None), len(items)]
        first = ends[0]  # (items before the first message travel with it)
        client = {id(m): i for i, m in enumerate(self.messages)}
        out: list[Any] = []
        context: list[str] = []
        stored_upstream = self.body.get("store") is not False
        for message in messages:
            i = client.get(id(message))
            if i is not None:
                start = origin[i]
                if start is not None:  # (the instructions stay where they are)
                    end = next(e for e in ends if e > start)
                    out.extend(items[0 if start == first else start : end])
            elif message.get("role") == "system" and stored_upstream:
                context.append(str(message.get("content") or ""))
            else:
                out.extend(messages_to_items([message]))
        body = {**self.body, "input": out}
        if context:
            own = self.body.get("instructions")
            body["instructions"] = "\n\n".join([*([own] if own else []), *context])
        return body

    def keep(
        self, native: dict[str, Any] | None, *, tenant_id: str, user_id: str, request_id: str
    ) -> ResponseRecord | None:
        """The response as the client got it, kept with the reply (its conversation filled in
        as it is stored): served by id and continued by `previous_response_id` on a translated
        upstream; on a native one, it says which conversation a response id continues."""
        if native is None or not isinstance(native.get("id"), str):
            return None
        return response_record(
            native,
            self.body.get("input"),
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_id=None,
            request_id=request_id,
            store=self.body.get("store") is not False,
            created_at=datetime.now(UTC),
        )

    def stream_reader(self, prompt_tokens: int | None = None) -> TranslatedReader | NativeReader:
        if self.translate:
            assert self.response_id is not None
            return TranslatedReader(self.body, self.response_id, self.created_at)
        return NativeReader()

    def whole(self, reply: UpstreamReply) -> WholeReply:
        if reply.status >= 400:
            return WholeReply(None, None, reply)
        if not self.translate:
            seen = observe_body(reply.body or b"")
            message = reply_with_items(seen.reply(), seen.output())
            return WholeReply(message, seen.usage, reply, native=seen.response)
        message, usage = reply_from_completion(reply.body or b"")
        try:
            completion = msgspec.json.decode(reply.body or b"")
        except (ValueError, RecursionError):
            completion = None
        if not isinstance(completion, dict):
            return WholeReply(message, usage, reply)
        assert self.response_id is not None
        response = response_from_chat(completion, self.body, self.response_id, self.created_at)
        translated = UpstreamReply(
            reply.status, dict(reply.headers), body=msgspec.json.encode(response)
        )
        return WholeReply(message, usage, translated, native=response)
