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
  Messages API has no system role among its messages.)
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec

from proxy.protocols.anthropic.from_chat import as_object
from proxy.protocols.anthropic.request import ParsedMessages, assistant_message, unmarked_error
from storage.records import KEPT_ITEMS


def native_body(
    body: dict[str, Any], parsed: ParsedMessages, assembled: list[dict[str, Any]]
) -> dict[str, Any]:
    """`body` with what the proxy attached (the neutral messages in `assembled` that are not
    the client's) placed where it leaves the client's prefix as it was."""
    if assembled is parsed.messages:
        return body
    client = {id(m) for m in parsed.messages}
    history: list[dict[str, Any]] = []
    context: list[str] = []
    before_client = True  # (before the client's first turn, after its system prompt)
    placed_first = False  # the context came before it (`after_system`)
    for message in assembled:
        if id(message) in client:
            before_client = before_client and message.get("role") == "system"
        elif message.get("role") == "system":
            context.append(_text(message.get("content")))
            placed_first = placed_first or before_client
        elif before_client:
            history.append(message)
    messages = [*to_native(history), *body["messages"]]
    if context:
        at = (
            _first_user(messages, len(messages) - len(body["messages"]))
            if placed_first
            else (_last_user(messages))
        )
        if at is not None:
            messages[at] = with_context(messages[at], "\n\n".join(context))
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


def _first_user(messages: list[dict[str, Any]], start: int) -> int | None:
    return next((i for i in range(start, len(messages)) if messages[i]["role"] == "user"), None)


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


def _parts(content: Any) -> list[dict[str, Any]]:
    """Neutral content as Messages API blocks."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            url = str((part.get("image_url") or {}).get("url", ""))
            head, _, data = url.partition(";base64,")
            if url.startswith("data:") and data:
                source = {"type": "base64", "media_type": head[5:], "data": data}
            else:
                source = {"type": "url", "url": url}
            blocks.append({"type": "image", "source": source})
        elif kind == "file":
            data = str((part.get("file") or {}).get("file_data", ""))
            head, _, encoded = data.partition(";base64,")
            if encoded:
                source = {"type": "base64", "media_type": head[5:], "data": encoded}
                blocks.append({"type": "document", "source": source})
    return blocks


def to_native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored neutral messages as Messages API turns: tool results in a user turn, turns of
    one role merged, starting with a user turn (the tail of a history may begin mid-way)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            blocks = [*message.get(KEPT_ITEMS, []), *_parts(message.get("content"))]
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except ValueError:
                    arguments = {}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": function.get("name"),
                        "input": arguments if isinstance(arguments, dict) else {},
                    }
                )
            turn_role = "assistant"
        elif role == "tool":
            content, failed = unmarked_error(message.get("content"))
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": message.get("tool_call_id"),
                "content": _parts(content),
            }
            if failed:
                result["is_error"] = True
            blocks = [result]
            turn_role = "user"
        elif role == "user":
            blocks = _parts(message.get("content"))
            turn_role = "user"
        else:
            continue
        if not blocks:
            continue
        if out and out[-1]["role"] == turn_role:
            out[-1]["content"].extend(blocks)
        elif out or turn_role == "user":
            out.append({"role": turn_role, "content": blocks})
    return out


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Anthropic usage in the Chat Completions shape: the prompt is the whole of it (input,
    cache writes and cache reads), as the pricer and x-usage-prompt-tokens count it."""
    if not isinstance(usage, dict):
        return None

    def count(name: str) -> int:
        value = usage.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    written, read = count("cache_creation_input_tokens"), count("cache_read_input_tokens")
    prompt = count("input_tokens") + written + read
    completion = count("output_tokens")
    chat: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": read},
    }
    if written:
        chat["cache_creation_input_tokens"] = written
    return chat


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
