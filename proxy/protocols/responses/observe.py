"""Watching a native Responses reply without changing it: events in, the reply reassembled.

The final `response` (from response.completed / .incomplete / .failed, or a whole body) is
the truth; until it comes, the items and deltas seen so far make the reply, so a stream that
breaks mid-way still leaves what arrived. Usage is handed on in the Chat Completions shape,
for the pricer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from proxy.protocols.responses.items import output_to_messages
from proxy.protocols.responses.usage import chat_usage

# Terminal events, and the exchange status each leaves.
_TERMINAL = {
    "response.completed": "complete",
    "response.incomplete": "incomplete",
    "response.failed": "error",
    "response.cancelled": "incomplete",
}


@dataclass(slots=True)
class _Seen:
    """One output item as the stream built it so far."""

    item: dict[str, Any]
    text: dict[int, list[str]] = field(default_factory=dict)  # content_index -> deltas
    refusal: dict[int, list[str]] = field(default_factory=dict)
    arguments: list[str] = field(default_factory=list)
    done: bool = False  # output_item.done gave the whole item


class ResponsesAssembler:
    """Folds Responses stream events (or a whole response) into the reply, status and usage."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None  # the final response object
        self.response_id: str | None = None
        self.model: str | None = None
        self.error: dict[str, Any] | None = None  # an `error` event, or the failed response's
        self.terminal: str | None = None  # the terminal event's type
        self.events = 0
        self._items: dict[int, _Seen] = {}

    # --- folding ------------------------------------------------------------------------------

    def add(self, payload: bytes | dict[str, Any]) -> None:
        """Fold one event in: its SSE data payload, or the payload decoded. A payload that is
        not a JSON object is ignored (it is still relayed)."""
        event: Any = payload
        if isinstance(payload, bytes):
            try:
                event = msgspec.json.decode(payload)
            except (ValueError, RecursionError):
                return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return
        self.events += 1
        kind: str = event["type"]
        if kind == "error":
            self.error = {
                k: event.get(k) for k in ("code", "message", "param") if event.get(k) is not None
            }
        elif isinstance(event.get("response"), dict):
            self._response_event(kind, event["response"])
        elif kind in ("response.output_item.added", "response.output_item.done"):
            self._item_event(kind, event)
        else:
            self._delta_event(kind, event)

    def add_response(self, response: dict[str, Any]) -> None:
        """A whole (non-streamed) response body."""
        status = response.get("status")
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status if isinstance(status, str) else "", "response.failed"
        )
        self._response_event(kind, response)

    def _response_event(self, kind: str, response: dict[str, Any]) -> None:
        if isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if isinstance(response.get("model"), str):
            self.model = response["model"]
        if kind in _TERMINAL:
            self.terminal = kind
            self.response = response
            if isinstance(response.get("error"), dict):
                self.error = response["error"]

    def _item_event(self, kind: str, event: dict[str, Any]) -> None:
        index, item = event.get("output_index"), event.get("item")
        if not isinstance(index, int) or not isinstance(item, dict):
            return
        done = kind == "response.output_item.done"
        seen = self._items.get(index)
        if seen is None:
            self._items[index] = _Seen(dict(item), done=done)
        elif done:
            seen.item, seen.done = dict(item), True

    def _delta_event(self, kind: str, event: dict[str, Any]) -> None:
        seen = self._items.get(event.get("output_index"))  # type: ignore[arg-type]
        delta = event.get("delta")
        if seen is None or seen.done or not isinstance(delta, str):
            return
        content_index = event.get("content_index", 0)
        if kind == "response.output_text.delta":
            seen.text.setdefault(content_index, []).append(delta)
        elif kind == "response.refusal.delta":
            seen.refusal.setdefault(content_index, []).append(delta)
        elif kind == "response.function_call_arguments.delta":
            seen.arguments.append(delta)

    # --- what it comes to ---------------------------------------------------------------------

    @property
    def status(self) -> str:
        """`complete`, `incomplete` (also: the stream ended before a terminal event) or `error`."""
        if self.terminal is None:
            return "error" if self.error is not None else "incomplete"
        return _TERMINAL[self.terminal]

    def output(self) -> list[dict[str, Any]]:
        """The output items: the final response's, else those built from the stream so far."""
        if self.response is not None and isinstance(self.response.get("output"), list):
            return list(self.response["output"])
        return [self._built(self._items[i]) for i in sorted(self._items)]

    def messages(self) -> list[dict[str, Any]]:
        """The reply as neutral messages, opaque items (reasoning...) included: to store."""
        return output_to_messages(self.output())

    def reply(self) -> dict[str, Any] | None:
        """The reply as ONE assistant message (all text, refusals and tool calls), or None if
        nothing arrived."""
        text: list[str] = []
        refusal: list[str] = []
        calls: list[dict[str, Any]] = []
        for message in self.messages():
            if message.get("opaque_item") is not None:
                continue
            if isinstance(message.get("content"), str):
                text.append(message["content"])
            if isinstance(message.get("refusal"), str):
                refusal.append(message["refusal"])
            calls.extend(message.get("tool_calls") or [])
        if not (text or refusal or calls):
            return None
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            reply["tool_calls"] = calls
        if refusal:
            reply["refusal"] = "".join(refusal)
        return reply

    @property
    def usage(self) -> dict[str, Any] | None:
        """The final response's usage in the Chat Completions shape (what the pricer reads)."""
        return chat_usage(self.response.get("usage")) if self.response is not None else None

    @property
    def error_text(self) -> str | None:
        if self.error is None:
            return None
        message = self.error.get("message")
        if isinstance(message, str) and message:
            return message[:2000]
        return msgspec.json.encode(self.error).decode()[:2000]

    def _built(self, seen: _Seen) -> dict[str, Any]:
        item = dict(seen.item)
        if seen.done:
            return item
        if item.get("type") == "function_call":
            item["arguments"] = (item.get("arguments") or "") + "".join(seen.arguments)
        elif item.get("type") == "message":
            parts = [p for p in item.get("content") or [] if isinstance(p, dict)]
            for index in sorted(set(seen.text) | set(seen.refusal)):
                while len(parts) <= index:
                    parts.append({})
                if index in seen.text:
                    parts[index] = {"type": "output_text", "text": "".join(seen.text[index])}
                else:
                    parts[index] = {"type": "refusal", "refusal": "".join(seen.refusal[index])}
            item["content"] = [p for p in parts if p]
        return item


def observe_body(body: bytes) -> ResponsesAssembler:
    """A whole (non-streamed) Responses body, observed; nothing folded if it is not a response."""
    assembler = ResponsesAssembler()
    try:
        data = msgspec.json.decode(body)
    except (ValueError, RecursionError):
        return assembler
    if isinstance(data, dict) and data.get("object") == "response":
        assembler.add_response(data)
    elif isinstance(data, dict) and isinstance(data.get("error"), dict):
        assembler.error = data["error"]
    return assembler
