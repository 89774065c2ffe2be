"""An Anthropic Messages request (`POST /v1/messages`) read as neutral messages.

    system (string, or text blocks)         a `system` message (blocks' texts joined)
    user: text blocks                       a `user` message, content the texts joined
    user: image, document blocks            content parts: `image_url`, `file`, `text`
    user: tool_result blocks                `tool` messages (tool_call_id), before the rest;
                                            `is_error: true` as TOOL_ERROR at the content's
                                            head, which a chat model reads too
    assistant: text blocks                  an `assistant` message, content the texts joined
    assistant: tool_use blocks              its `tool_calls` (arguments: `input` as JSON)
    assistant: thinking, redacted_thinking, kept whole beside the message (KEPT_ITEMS), never
      and any other block                   text, never in its chain hash

`cache_control` is never part of a neutral message: a client that moves its cache breakpoint
to the newest message each turn still resends the same history, so it continues the same
stored conversation. The native request keeps every `cache_control` where the client put it
(placement.py); translation to chat completions leaves them out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proxy.core.errors import BadRequest
from proxy.upstream.anthropic_blocks import marked_error
from storage.records import KEPT_ITEMS

USER_BLOCKS = frozenset({"text", "image", "document", "tool_result", "search_result"})


@dataclass(slots=True)
class ParsedMessages:
    """The request's neutral messages, and for each the index of the native message it came
    from (None: the top-level `system`)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origin: list[int | None] = field(default_factory=list)
    # What translation to chat completions could not carry (for the docs' and logs' sake).
    dropped: list[str] = field(default_factory=list)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return names.get(type(value), "null" if value is None else type(value).__name__)


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    """`isinstance`, where a boolean is not a number."""
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def check_request(body: dict[str, Any]) -> None:
    """The fields the proxy relies on, with the API's types; the blocks are checked as they are
    read. Everything else is the upstream's to judge."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > 256 or "\x00" in model:
        what = "missing" if model is None else "not a non-empty string of at most 256 characters"
        raise BadRequest(f"model: field is {what}.", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else f"{_kind(messages)}, expected a non-empty array"
        raise BadRequest(f"messages: field is {what}.", param="messages")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens: must be a positive integer.", param="max_tokens")
    for key, kinds, name in (
        ("stream", (bool,), "a boolean"),
        ("system", (str, list), "a string or an array of text blocks"),
        ("tools", (list,), "an array"),
        ("tool_choice", (dict,), "an object"),
        ("metadata", (dict,), "an object"),
        ("stop_sequences", (list,), "an array of strings"),
        ("temperature", (int, float), "a number"),
        ("top_p", (int, float), "a number"),
        ("top_k", (int,), "an integer"),
    ):
        value = body.get(key)
        if value is not None and not _is(value, kinds):
            raise BadRequest(f"{key}: {_kind(value)}, expected {name}.", param=key)
    metadata = body.get("metadata") or {}
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise BadRequest(
            f"metadata.user_id: {_kind(user)}, expected a string.", param="metadata.user_id"
        )
    if any(not isinstance(s, str) for s in body.get("stop_sequences") or []):
        raise BadRequest("stop_sequences: expected an array of strings.", param="stop_sequences")


def arguments_text(value: Any) -> str:
    """A tool_use's `input` as a chat tool call's `arguments`: one form whichever way the call
    came (resent by the client, or read from the upstream's reply), so its hash matches."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content: {_kind(content)}, expected a string or an array of blocks.",
            param=f"{where}.content",
        )
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(
                f"{where}.content.{i}: expected a content block object with a type.",
                param=f"{where}.content.{i}",
            )
    return content


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{where}.text: {_kind(text)}, expected a string.", param=f"{where}.text")
    return text


def _joined(texts: list[str]) -> str:
    return "\n\n".join(texts)


def system_message(system: Any) -> dict[str, Any] | None:
    """The top-level `system` as a neutral system message (None when there is none)."""
    if system is None or system == "" or system == []:
        return None
    blocks = _blocks(system, "system")
    texts = []
    for i, block in enumerate(blocks):
        if block.get("type") != "text":
            raise BadRequest(
                f"system.{i}.type: expected 'text', got {block.get('type')!r}.",
                param=f"system.{i}.type",
            )
        texts.append(_text(block, f"system.{i}"))
    return {"role": "system", "content": _joined(texts)}


def _source_part(block: dict[str, Any], where: str, dropped: list[str]) -> dict[str, Any] | None:
    """An image or document block as a chat content part (None: it has none)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise BadRequest(f"{where}.source: expected an object.", param=f"{where}.source")
    kind = source.get("type")
    if block["type"] == "image":
        if kind == "base64":
            url = f"data:{source.get('media_type')};base64,{source.get('data')}"
            return {"type": "image_url", "image_url": {"url": url}}
        if kind == "url" and isinstance(source.get("url"), str):
            return {"type": "image_url", "image_url": {"url": source["url"]}}
    elif kind == "text" and isinstance(source.get("data"), str):
        title = block.get("title")
        head = f"{title}\n\n" if isinstance(title, str) and title else ""
        return {"type": "text", "text": head + source["data"]}
    elif kind == "base64" and source.get("media_type") == "application/pdf":
        name = block.get("title") if isinstance(block.get("title"), str) else "document.pdf"
        data = f"data:application/pdf;base64,{source.get('data')}"
        return {"type": "file", "file": {"filename": name, "file_data": data}}
    if f"{block['type']} blocks with source {kind}" not in dropped:
        dropped.append(f"{block['type']} blocks with source {kind}")
    return None


def _user(content: Any, where: str, dropped: list[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results (as `tool` messages) first, then the rest as one message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        at = f"{where}.content.{i}"
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind in ("image", "document"):
            part = _source_part(block, at, dropped)
            if part is not None:
                parts.append(part)
        elif kind == "tool_result":
            call = block.get("tool_use_id")
            if not isinstance(call, str) or not call:
                raise BadRequest(f"{at}.tool_use_id: Field required", param=f"{at}.tool_use_id")
            result = _user(block.get("content") or "", at, dropped)
            reply = result[0].get("content") if result else ""
            if block.get("is_error") is True:
                reply = marked_error(reply)
            out.append({"role": "tool", "tool_call_id": call, "content": reply})
        elif kind not in USER_BLOCKS:
            raise BadRequest(
                f"{at}.type: {kind!r} is not a block a user message can hold.", param=f"{at}.type"
            )
    if parts:
        texts = [p["text"] for p in parts if p["type"] == "text"]
        only_text = len(texts) == len(parts)
        out.append({"role": "user", "content": _joined(texts) if only_text else parts})
    return out


def assistant_message(blocks: list[dict[str, Any]], where: str = "content") -> dict[str, Any]:
    """An assistant turn's blocks (a request's, or a native reply's) as one neutral message;
    blocks with no chat equivalent (thinking, server tools' blocks) kept beside it."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        at = f"{where}.{i}"
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise BadRequest(f"{at}: a tool_use block needs an id and a name.", param=at)
            arguments = arguments_text(block.get("input", {}))
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        else:
            kept.append(block)
    message: dict[str, Any] = {"role": "assistant", "content": _joined(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if kept:
        message[KEPT_ITEMS] = kept
    return message


def parse_messages(body: dict[str, Any]) -> ParsedMessages:
    """The request's `system` and `messages` as neutral messages (a 400 for a malformed one)."""
    parsed = ParsedMessages()
    system = system_message(body.get("system"))
    if system is not None:
        parsed.messages.append(system)
        parsed.origin.append(None)
    for i, message in enumerate(body["messages"]):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            read = _user(message.get("content"), where, parsed.dropped)
        elif role == "assistant":
            content = _blocks(message.get("content"), where)
            read = [assistant_message(content, f"{where}.content")]
        else:
            raise BadRequest(
                f"{where}.role: expected 'user' or 'assistant', got {role!r}.",
                param=f"{where}.role",
            )
        parsed.messages += read
        parsed.origin += [i] * len(read)
    if not any(m["role"] == "user" for m in parsed.messages):
        raise BadRequest(
            "messages: memproxy needs at least one user message with text or media.",
            param="messages",
        )
    return parsed
