"""Responses items <-> neutral messages (Chat Completions messages in the stored shape).

    Responses item                              neutral message
    message (typed or easy), role user /        {"role": same, "content": str | chat parts}
      system / developer
    message, role assistant                     {"role": "assistant", "content": text,
                                                 "refusal"?: text}  (output_text joined)
    function_call (a run of them, and the       ONE {"role": "assistant", "content": text|None,
      assistant message just before it)              "tool_calls": [{"id": call_id, ...}]}
    function_call_output                        {"role": "tool", "tool_call_id": call_id,
                                                 "content": str | chat parts}
    reasoning, item_reference and every other   {"role": "assistant", "content": None,
      item type                                  "opaque_item": <the item as it came>}

**Opaque items.** An item with no chat equivalent is kept whole under `opaque_item`, in a
message whose `content` is None: recall, search and token counts read `content` (and
`tool_calls`), so they never see it as text, and `messages_to_items` gives it back unchanged.
Its role is always `assistant` (whoever produced it), so an opaque item never counts as the
newest user turn. Translation to Chat Completions leaves these messages out.

Input and output fold the same way, so the output items of one response, sent back as the
next request's input (a `store: false` client), give the very messages stored for them: the
longest-prefix rule that finds a conversation works for Responses clients too. Ids of
`message` and `function_call` items are not kept (a function call is known by its call_id).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.core.errors import BadRequest
from proxy.protocols.responses.parts import (
    Malformed,
    chat_parts,
    responses_parts,
)

OPAQUE = "opaque_item"
ROLES = frozenset({"user", "assistant", "system", "developer"})


def opaque_message(item: dict[str, Any]) -> dict[str, Any]:
    """The neutral message that keeps an item with no chat equivalent (see the module)."""
    return {"role": "assistant", "content": None, OPAQUE: item}


def is_opaque(message: dict[str, Any]) -> bool:
    return isinstance(message.get(OPAQUE), dict)


@dataclass(slots=True)
class ParsedInput:
    """A request's neutral messages and, for each, the index in `input` of the first item it
    came from (None for the system message made from `instructions`)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origin: list[int | None] = field(default_factory=list)


def parse_input(body: dict[str, Any]) -> ParsedInput:
    """`instructions` and `input` of a Responses request as neutral messages; BadRequest (with
    the field's `param`, e.g. `input[3].role`) for a malformed item."""
    parsed = ParsedInput()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest(
                "Invalid type for 'instructions': expected a string.", param="instructions"
            )
        parsed.messages.append({"role": "system", "content": instructions})
        parsed.origin.append(None)
    raw = body.get("input")
    if raw is None:
        return parsed
    if isinstance(raw, str):
        parsed.messages.append({"role": "user", "content": raw})
        parsed.origin.append(0)
        return parsed
    if not isinstance(raw, list):
        raise BadRequest(
            "Invalid type for 'input': expected a string or an array of items.", param="input"
        )
    try:
        _fold(raw, "input", parsed, _strict)
    except Malformed as exc:
        raise BadRequest(exc.message, param=exc.param) from None
    return parsed


def output_to_messages(output: list[Any]) -> list[dict[str, Any]]:
    """A response's `output` items as neutral messages; an item the upstream malformed is
    kept opaque rather than refused (it was the upstream's answer, not the client's)."""
    parsed = ParsedInput()
    _fold(output, "output", parsed, _lenient)
    return parsed.messages


def messages_to_items(
    messages: list[dict[str, Any]], *, keep_reasoning: bool = True
) -> list[dict[str, Any]]:
    """Neutral (stored) messages as Responses input items, to send stored history to a
    native Responses upstream. `keep_reasoning=False` leaves out `reasoning` items (an upstream
    that keeps no state cannot resolve ones without `encrypted_content`)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if is_opaque(message):
            item = message[OPAQUE]
            if keep_reasoning or item.get("type") != "reasoning":
                items.append(dict(item))
            continue
        role = message.get("role")
        content = message.get("content")
        if role == "assistant":
            text = _assistant_text(content) or message.get("refusal")
            if text:
                items.append({"type": "message", "role": "assistant", "content": text})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": function.get("name"),
                        "arguments": function.get("arguments") or "",
                    }
                )
        elif role in ("tool", "function"):
            call_id = message.get("tool_call_id") or message.get("name")
            output = responses_parts(content) if isinstance(content, list) else content or ""
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        else:
            if isinstance(content, list):
                content = responses_parts(content)
            items.append({"type": "message", "role": role, "content": content or ""})
    return items


def _assistant_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


# --- folding items into messages ------------------------------------------------------------

Convert = Callable[[Any, str], tuple[str, dict[str, Any]]]


def _fold(items: list[Any], name: str, parsed: ParsedInput, convert: Convert) -> None:
    """Append the messages of `items` to `parsed`: a run of function calls joins the assistant
    message (or function call) just before it."""
    calls_join: dict[str, Any] | None = None  # the assistant message a function call joins
    for i, raw in enumerate(items):
        kind, message = convert(raw, f"{name}[{i}]")
        if kind == "function_call" and calls_join is not None:
            calls_join.setdefault("tool_calls", []).extend(message["tool_calls"])
            continue
        parsed.messages.append(message)
        parsed.origin.append(i)
        joins = kind == "function_call" or (kind == "message" and message["role"] == "assistant")
        calls_join = message if joins else None


def _strict(raw: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(raw, dict):
        raise Malformed(f"Invalid type for '{where}': expected an object.", where)
    kind = raw.get("type")
    if kind is None:
        if "role" in raw:
            kind = "message"
        elif "id" in raw:
            kind = "item_reference"
        else:
            raise Malformed(f"Missing required parameter: '{where}.type'.", f"{where}.type")
    if not isinstance(kind, str):
        raise Malformed(f"Invalid type for '{where}.type': expected a string.", f"{where}.type")
    if kind == "message":
        return kind, _message(raw, where)
    if kind == "function_call":
        call = {
            "id": _text(raw, "call_id", where, nonempty=True),
            "type": "function",
            "function": {
                "name": _text(raw, "name", where, nonempty=True),
                "arguments": _text(raw, "arguments", where),
            },
        }
        return kind, {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        call_id = _text(raw, "call_id", where, nonempty=True)
        output = raw.get("output")
        if isinstance(output, list):
            output = chat_parts(output, f"{where}.output")
        elif not isinstance(output, str):
            raise Malformed(
                f"Invalid type for '{where}.output': expected a string or an array of parts.",
                f"{where}.output",
            )
        return kind, {"role": "tool", "tool_call_id": call_id, "content": output}
    if kind == "item_reference":
        _text(raw, "id", where, nonempty=True)
    return kind, opaque_message(raw)


def _lenient(raw: Any, where: str) -> tuple[str, dict[str, Any]]:
    try:
        return _strict(raw, where)
    except Malformed:
        item = raw if isinstance(raw, dict) else {"type": "unknown", "value": raw}
        return "opaque", opaque_message(item)


def _text(raw: dict[str, Any], key: str, where: str, *, nonempty: bool = False) -> str:
    value = raw.get(key)
    if value is None:
        raise Malformed(f"Missing required parameter: '{where}.{key}'.", f"{where}.{key}")
    if not isinstance(value, str) or (nonempty and not value):
        expected = "a non-empty string" if nonempty else "a string"
        raise Malformed(f"Invalid type for '{where}.{key}': expected {expected}.", f"{where}.{key}")
    return value


def _message(raw: dict[str, Any], where: str) -> dict[str, Any]:
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLES:  # (an object or an array is unhashable)
        raise Malformed(
            f"Invalid value for '{where}.role': {role!r:.80}; expected one of 'assistant', "
            "'developer', 'system', 'user'.",
            f"{where}.role",
        )
    content = raw.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise Malformed(
            f"Invalid type for '{where}.content': expected a string or an array of parts.",
            f"{where}.content",
        )
    parts = chat_parts(content, f"{where}.content")
    if role != "assistant":
        if len(parts) == 1 and parts[0].get("type") == "text":
            # One text part is the message its text is (as the API lists a string's content):
            # one form, so that a message memproxy sends again in a chain (listed so) is the
            # message the client sent, byte for byte, and keeps its chain hash.
            return {"role": role, "content": parts[0]["text"]}
        return {"role": role, "content": parts}
    # An assistant's text parts join into one string (as a chat reply stores it); a refusal
    # goes beside it; parts of other kinds keep the list.
    if all(p["type"] in ("text", "refusal") for p in parts):
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        refusals = [p["refusal"] for p in parts if p["type"] == "refusal"]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not refusals else None,
        }
        if refusals:
            message["refusal"] = "".join(refusals)
        return message
    return {"role": "assistant", "content": parts}


__all__ = [
    "OPAQUE",
    "ParsedInput",
    "is_opaque",
    "messages_to_items",
    "opaque_message",
    "output_to_messages",
    "parse_input",
]
