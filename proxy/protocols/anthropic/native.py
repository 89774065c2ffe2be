"""The request for an upstream that speaks the Messages API itself (kind `anthropic`), and
its reply read back as a neutral message and Chat Completions usage.

Placement keeps the client's prompt prefix byte-identical: `tools`, `system` and every
message the client sent go as they came, every `cache_control` where the client put it. What
the proxy adds goes around them:

- stored history the client did not send (a thin client): before the client's messages,
  as Messages API turns;
- the proxy's context (recall, memories, attachments, summaries): one text block at the head
  of the newest user turn, after its `tool_result` blocks, which the API wants first.
  (`placement: after_system` puts it at the head of the first user turn instead: the
  Messages API has no system role among its messages.) With `context.keep_shown`, each
  section an earlier turn was shown goes back at the head of that turn's user message.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec

from proxy.protocols.anthropic.from_chat import as_object
from proxy.protocols.anthropic.request import ParsedMessages, assistant_message
from proxy.upstream.anthropic_blocks import chat_usage, to_native


def native_body(
    body: dict[str, Any], parsed: ParsedMessages, assembled: list[dict[str, Any]]
) -> dict[str, Any]:
    """`body` with what the proxy attached (the neutral messages in `assembled` that are not
    the client's) placed where it leaves the client's prefix as it was."""
    if assembled is parsed.messages:
        return body
    client = {id(m): o for m, o in zip(parsed.messages, parsed.origin, strict=True)}
    history: list[dict[str, Any]] = []
    pending: list[str] = []  # context sections waiting for the client's next user turn
    placed: dict[int, list[str]] = {}  # the client's user turns (by index): their sections
    before_client = True  # (before the client's first turn, after its system prompt)
    for message in assembled:
        if id(message) in client:
            before_client = before_client and message.get("role") == "system"
            at = client[id(message)]
            if pending and at is not None and body["messages"][at].get("role") == "user":
                placed.setdefault(at, []).extend(pending)
                pending = []
        elif message.get("role") == "system":
            pending.append(_text(message.get("content")))
        elif before_client:
            history.append(message)
    if pending:  # (none follows: the newest user turn)
        last = _last_user(body["messages"])
        if last is not None:
            placed.setdefault(last, []).extend(pending)
    native = to_native(history)
    messages = [*native, *body["messages"]]
    for at, texts in placed.items():
        messages[len(native) + at] = with_context(messages[len(native) + at], "\n\n".join(texts))
    return {**body, "messages": messages}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _last_user(messages: list[dict[str, Any]]) -> int | None:
    return next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None
    )


def with_context(message: dict[str, Any], text: str) -> dict[str, Any]:
    """`message` (a user turn) with a text block of `text` at its head, after its tool
    results; its own blocks are kept as they are, `cache_control` and all."""
    content = message.get("content")
    blocks: list[Any] = (
        [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    )
    at = 0
    while (
        at < len(blocks)
        and isinstance(blocks[at], dict)
        and blocks[at].get("type") == ("tool_result")
    ):
        at += 1
    blocks.insert(at, {"type": "text", "text": text})
    return {**message, "content": blocks}


def observe_message(body: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the reply as a neutral assistant message, usage in chat's shape) of a whole message."""
    try:
        message = msgspec.json.decode(body)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return None, None
    blocks = [
        b for b in message["content"] if isinstance(b, dict) and isinstance(b.get("type"), str)
    ]
    return assistant_message(blocks), chat_usage(message.get("usage"))


class MessageAssembler:
    """Folds a Messages event stream into the reply (its blocks) and its usage."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, list[str]] = {}
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.stopped = False
        self.error: dict[str, Any] | None = None

    def add(self, payload: bytes) -> None:
        try:
            event = msgspec.json.decode(payload)
        except (ValueError, RecursionError):
            return
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self.usage.update(event["message"].get("usage") or {})
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            self.blocks[event.get("index", 0)] = dict(event["content_block"])
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            self._delta(event.get("index", 0), event["delta"])
        elif kind == "message_delta":
            delta, usage = as_object(event.get("delta")), as_object(event.get("usage"))
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            self.usage.update({k: v for k, v in usage.items() if v is not None})
        elif kind == "message_stop":
            self.stopped = True
        elif kind == "error":
            self.error = as_object(event.get("error"))

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.blocks.get(index)
        if block is None:
            return
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + str(delta.get("text", ""))
        elif kind == "input_json_delta":
            self.json.setdefault(index, []).append(str(delta.get("partial_json", "")))
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")

    @property
    def received_anything(self) -> bool:
        return bool(self.blocks)

    def message(self) -> dict[str, Any]:
        blocks = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if block.get("type") == "tool_use" and index in self.json:
                with contextlib.suppress(ValueError):  # (cut off: the input as it started)
                    block = {**block, "input": json.loads("".join(self.json[index]) or "{}")}
            blocks.append(block)
        return assistant_message(blocks)

    def chat_usage(self) -> dict[str, Any] | None:
        return chat_usage(self.usage) if self.usage else None
