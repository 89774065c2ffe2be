"""A chat completion stream given to the client as another protocol's events: what the
Responses and Messages adapters share when their upstream speaks Chat Completions."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from proxy.core.errors import ProxyError
from proxy.upstream.sse import ReplyAssembler, error_text, event_data


class ChatEvents(Protocol):
    """A protocol's event sequence made from chat chunks."""

    def start(self) -> bytes: ...

    def feed(self, chunk: dict[str, Any]) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, message: str) -> bytes: ...


class TranslatedReader:
    """A chat completion stream, read as the pipeline reads any chat stream (`chat`), and given
    to the client as `events`."""

    end_markers: tuple[bytes, ...] = ()

    def __init__(self, events: ChatEvents) -> None:
        self.chat = ReplyAssembler()
        self.events = events

    @property
    def error(self) -> dict[str, Any] | None:
        return self.chat.error

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.chat.usage

    @property
    def ended(self) -> bool:
        return self.chat.done or bool(self.chat.finish_reason)

    @property
    def received_anything(self) -> bool:
        return self.chat.received_anything

    def message(self) -> dict[str, Any]:
        return self.chat.message()

    def read(self, raw: bytes, *, fold: bool = True) -> bytes:
        payload = event_data(raw)
        if payload is None:
            return b""  # (a comment or keep-alive)
        # Folded first: a chunk it cannot fold in (NotUnderstood) is not translated either.
        self.chat.add(payload, fold=fold)
        out = self.events.start()
        if payload == b"[DONE]":
            return out + self.events.finish()
        try:
            chunk = msgspec.json.decode(payload)
        except (ValueError, RecursionError):
            chunk = None
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            out += self.events.fail(error_text(chunk["error"]))
        elif isinstance(chunk, dict):
            out += self.events.feed(chunk)
        return out

    def unread(self, raw: bytes) -> bytes:
        """A chat chunk not understood is nothing the client's protocol could carry."""
        return b""

    def close(self) -> bytes:
        """The upstream's stream ended without `[DONE]`: the client's ends all the same."""
        return self.events.finish()

    def failed(self, error: ProxyError) -> bytes:
        return self.events.start() + self.events.fail(error.message)
