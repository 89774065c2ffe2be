"""A Chat Completions stream as an Anthropic Messages event stream, as chunks arrive.

    message_start (usage: input_tokens), ping               start(): before anything else
    content_block_start (text), content_block_delta
      (text_delta) ...                                      text as it arrives
    content_block_start (tool_use), content_block_delta
      (input_json_delta) ...                                each tool call (by its index)
    content_block_stop                                      when the next block starts
    content_block_stop, message_delta (stop_reason, usage),
      message_stop                                          finish(): after the usage chunk
    error                                                   fail(): the upstream broke

`message_start` carries the prompt's input tokens, as the API's does: the proxy's own count of
the prompt it sent (the chat upstream reports its usage only at the end, in `message_delta`).

Blocks follow each other as the API sends them: one is stopped before the next starts. A chat
stream that goes back to an earlier tool call's arguments after starting another (no known
server does) has those pieces stored with the reply but not sent again as events.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.protocols.anthropic.from_chat import (
    STOP_REASONS,
    anthropic_usage,
    as_object,
    error_body,
    message_object,
)


def encode_event(event: dict[str, Any]) -> bytes:
    """One Messages stream event on the wire."""
    data: bytes = msgspec.json.encode(event)
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + data + b"\n\n"


class ChatToMessagesStream:
    """Translates chat.completion.chunk payloads (decoded) into Messages events (bytes)."""

    def __init__(self, model: str, message_id: str, prompt_tokens: int | None = None) -> None:
        self.model, self.message_id = model, message_id
        self.prompt_tokens = prompt_tokens
        self.started = self.finished = False
        self.index = -1  # the open block's index (-1: none open)
        self.open: str | None = None  # "text" or the chat tool call index it streams ("call:N")
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.arguments: dict[int, list[str]] = {}

    def start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        usage = anthropic_usage({"prompt_tokens": self.prompt_tokens, "completion_tokens": 1})
        start = message_object(self.message_id, self.model, [], None, usage)
        return encode_event({"type": "message_start", "message": start}) + encode_event(
            {"type": "ping"}
        )

    def _stop_block(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return encode_event({"type": "content_block_stop", "index": self.index})

    def _start_block(self, block: dict[str, Any], key: str) -> bytes:
        out = self._stop_block()
        self.index += 1
        self.open = key
        event = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + encode_event(event)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return encode_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """One decoded chat chunk's events."""
        out = b""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_object(choice.get("delta"))
            text = delta.get("content") or delta.get("refusal")
            if isinstance(text, str) and text:
                if self.open != "text":
                    out += self._start_block({"type": "text", "text": ""}, "text")
                out += self._delta({"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out += self._tool_call(call)
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        return out

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", 0)
        function = as_object(call.get("function"))
        key = f"call:{index}"
        out = b""
        if index not in self.arguments:
            self.arguments[index] = []
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{self.message_id.removeprefix('msg_')}_{index}",
                "name": function.get("name") or "",
                "input": {},
            }
            out += self._start_block(block, key)
        piece = function.get("arguments")
        if isinstance(piece, str) and piece:
            self.arguments[index].append(piece)
            if self.open == key:
                out += self._delta({"type": "input_json_delta", "partial_json": piece})
        return out

    def finish(self) -> bytes:
        """The end: the open block stopped, the stop reason and usage, `message_stop`."""
        if self.finished:
            return b""
        self.finished = True
        out = self.start() + self._stop_block()
        reason = STOP_REASONS.get(self.finish_reason or "stop", "end_turn")
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": None},
            "usage": anthropic_usage(self.usage),
        }
        return out + encode_event(delta) + encode_event({"type": "message_stop"})

    def fail(self, message: str, status: int = 500) -> bytes:
        """The stream broke: Anthropic's `error` event ends it."""
        if self.finished:
            return b""
        self.finished = True
        return encode_event(error_body(status, message))
