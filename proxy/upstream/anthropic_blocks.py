"""Neutral messages (the stored OpenAI message shape) and usage as Anthropic's Messages API has
them: shared by the `/v1/messages` adapter (a native request's history rebuilt from storage,
proxy/protocols/anthropic) and the `anthropic` upstream's translation of chat completions
(anthropic_chat.py).

    system, developer (not at the head)   a text block in a user turn (the Messages API has no
                                          system role among its messages; the head's go to
                                          the top-level `system`, which the caller sets)
    user: text, image_url, file parts     text, image, document blocks
    assistant                             its text, then tool_use blocks for its tool_calls;
                                          blocks kept beside it (thinking) first
    tool                                  a tool_result block in a user turn (`is_error` when
                                          its content begins with TOOL_ERROR)

Turns of one role are merged, a user turn's tool_result blocks go first (as the API wants),
and the turns start with a user turn.
"""

from __future__ import annotations

import json
from typing import Any

from storage.records import KEPT_ITEMS

# A tool_result with `is_error: true`: its `tool` message's content begins with this, so a chat
# upstream sees the failure too, and a Messages request made from the stored message marks
# the block again.
TOOL_ERROR = "[tool error]\n"


def marked_error(content: Any) -> Any:
    """A failed tool's result (text, or content parts) with TOOL_ERROR at its head."""
    if isinstance(content, list):
        return [{"type": "text", "text": TOOL_ERROR.rstrip()}, *content]
    return TOOL_ERROR + (content or "")


def unmarked_error(content: Any) -> tuple[Any, bool]:
    """(`content` without TOOL_ERROR, whether it had it): marked_error undone."""
    if isinstance(content, str) and content.startswith(TOOL_ERROR):
        return content[len(TOOL_ERROR) :], True
    head = content[0] if isinstance(content, list) and content else None
    if isinstance(head, dict) and head.get("text") == TOOL_ERROR.rstrip():
        return content[1:], True
    return content, False


def content_blocks(content: Any) -> list[dict[str, Any]]:
    """Neutral content (a string, or chat content parts) as Messages API blocks; parts with no
    block (audio) are left out."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "refusal"):
            text = part.get(kind) if kind == "refusal" else part.get("text")
            if isinstance(text, str) and text:
                blocks.append({"type": "text", "text": text})
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


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": call.get("id"),
        "name": function.get("name"),
        "input": arguments if isinstance(arguments, dict) else {},
    }


def _turn(message: dict[str, Any]) -> tuple[str, list[dict[str, Any]]] | None:
    """(the Messages role, its blocks) of one neutral message; None: it has no place there."""
    role = message.get("role")
    if role == "assistant":
        blocks = [*message.get(KEPT_ITEMS, []), *content_blocks(message.get("content"))]
        blocks += [_tool_use(c) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        return "assistant", blocks
    if role == "tool":
        content, failed = unmarked_error(message.get("content"))
        result: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": message.get("tool_call_id"),
            "content": content_blocks(content),
        }
        if failed:
            result["is_error"] = True
        return "user", [result]
    if role in ("user", "system", "developer"):
        return "user", content_blocks(message.get("content"))
    return None


def to_native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neutral messages as Messages API turns (see the module's table): the tail of a stored
    history, which may begin mid-way, or a chat request's messages after its system prompt."""
    out: list[dict[str, Any]] = []
    for message in messages:
        turn = _turn(message)
        if turn is None or not turn[1]:
            continue
        role, blocks = turn
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        elif out or role == "user":
            out.append({"role": role, "content": blocks})
    for native in out:
        if native["role"] == "user":  # (a stable sort: tool results first, in their order)
            native["content"].sort(key=lambda b: b.get("type") != "tool_result")
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
    if written:  # (where the pricer reads it, and where OpenAI-shaped gateways put it)
        chat["cache_creation_input_tokens"] = written
        chat["prompt_tokens_details"]["cache_write_tokens"] = written
    return chat
