"""Watching a relayed chat stream without changing it: SSE events in, the reply reassembled.

The relay passes bytes on as they come; this only observes them, to store the assistant's reply
(content, tool calls, finish reason) and the usage chunk when the stream ends.
"""

from __future__ import annotations

from typing import Any

import msgspec

DONE = b"data: [DONE]"
# An event larger than this is not a chat chunk: the upstream broke the format (or never ends
# its events), and holding more of it would only grow the proxy's memory.
MAX_EVENT_BYTES = 16 * 2**20


class EventTooLarge(ValueError):
    """The upstream sent more than MAX_EVENT_BYTES without ending an event."""


class SSEDecoder:
    """Incremental SSE event splitter. Events end with a blank line; lines end with LF, CRLF or
    a lone CR (all read as LF), also when a CRLF is cut in two by the network. Each byte is
    looked at once, however an event is cut into reads."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._scanned = 0  # of the buffer, bytes known to hold no event's end
        self._cr = False  # the last read ended with CR: a LF starting the next one belongs to it

    def split(self, chunk: bytes) -> list[bytes]:
        """Every event completed by `chunk`, raw, each with its closing blank line; a partial
        event stays buffered until the chunk that completes it (EventTooLarge past
        MAX_EVENT_BYTES)."""
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        self._buffer += chunk
        events: list[bytes] = []
        start = 0
        at = max(0, self._scanned - 1)  # (a blank line may straddle the last read's end)
        while (end := self._buffer.find(b"\n\n", at)) >= 0:
            events.append(bytes(self._buffer[start : end + 2]))
            start = at = end + 2
        if start:
            del self._buffer[:start]
        self._scanned = len(self._buffer)
        if self._scanned > MAX_EVENT_BYTES:
            raise EventTooLarge(f"the upstream sent an event of over {MAX_EVENT_BYTES} bytes")
        return events

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data payloads of every event completed by `chunk`."""
        return [p for p in map(event_data, self.split(chunk)) if p is not None]

    def pending(self) -> bytes:
        """What arrived after the last complete event (and forget it)."""
        rest, self._buffer, self._scanned = bytes(self._buffer), bytearray(), 0
        return rest


def event_data(raw: bytes) -> bytes | None:
    """The data payload of one raw event, or None if it has no `data:` line."""
    data = [line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


class NotUnderstood(ValueError):
    """A chunk that cannot be folded into the reply (the upstream broke the format)."""


class ReplyAssembler:
    """Folds chat.completion.chunk events into one assistant message (choice 0); NotUnderstood
    for a chunk whose delta it cannot fold in."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.done = False
        self.chunks = 0

    def add(self, payload: bytes, *, fold: bool = True) -> bool:
        """Fold one event in; True if it is the usage-only chunk (usage, no choices) that
        `stream_options.include_usage` asks for. `fold=False`: only the end, an error and
        the usage are read (after a chunk not understood, the message is no longer
        reassembled)."""
        if payload == b"[DONE]":
            self.done = True
            return False
        try:
            event = msgspec.json.decode(payload)
        except (ValueError, RecursionError):
            return False
        if not isinstance(event, dict):
            return False
        if isinstance(event.get("error"), dict):
            self.error = event["error"]
            return False
        self.chunks += 1
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
            if not event.get("choices"):  # [], null or absent: nothing but the usage
                return True
        if not fold:
            return False
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self._add_delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return False

    def _add_delta(self, delta: Any) -> None:
        if not isinstance(delta, dict):
            raise NotUnderstood(f"a delta is {type(delta).__name__}, not an object")
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        if isinstance(delta.get("refusal"), str):
            self.refusal.append(delta["refusal"])
        calls = delta.get("tool_calls") or []
        if not isinstance(calls, list):
            raise NotUnderstood("a delta's tool_calls is not an array")
        for call in calls:
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                raise NotUnderstood(f"a tool call's index is {index!r}, not a number")
            slot = self.tool_calls.setdefault(
                index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            function = call.get("function") or {}
            if not isinstance(function, dict):
                raise NotUnderstood("a tool call's function is not an object")
            for key in ("name", "arguments"):
                piece = function.get(key)
                if piece is not None and not isinstance(piece, str):
                    raise NotUnderstood(f"a tool call's function.{key} is not a string")
                if piece:
                    slot["function"][key] += piece

    @property
    def received_anything(self) -> bool:
        return bool(self.content or self.tool_calls or self.refusal)

    def message(self) -> dict[str, Any]:
        """The reply as an assistant message, as a client would send it back."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        return message


def error_text(error: dict[str, Any]) -> str:
    """An upstream's `error` object as the exchange records it: its message, else the whole."""
    message = error.get("message")
    text = message if isinstance(message, str) and message else msgspec.json.encode(error).decode()
    return text[:2000]


def reply_from_completion(body: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(assistant message of choice 0, usage) from a non-streamed completion body."""
    try:
        data = msgspec.json.decode(body)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, usage
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return None, usage
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    return reply, usage
