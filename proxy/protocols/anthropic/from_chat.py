"""A Chat Completions reply as an Anthropic `message`, usage and errors in Anthropic's shape.

    finish_reason       stop_reason
    stop                end_turn (stop_sequence when the text ends before a stop sequence
                        cannot be told apart: end_turn)
    length              max_tokens
    tool_calls          tool_use
    content_filter      refusal

Usage: Anthropic's `input_tokens` are the prompt's tokens that were neither read from nor
written to the prompt cache, so

    input_tokens                  prompt_tokens - cache_read - cache_creation
    cache_read_input_tokens       prompt_tokens_details.cached_tokens (or cache_read_input_tokens)
    cache_creation_input_tokens   cache_creation_input_tokens (or ..._details.cache_write_tokens)
    output_tokens                 completion_tokens
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from proxy.protocols.anthropic.request import arguments_text

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def as_object(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _detail(usage: dict[str, Any], group: str, name: str) -> int:
    details = usage.get(group)
    return _count(details.get(name)) if isinstance(details, dict) else 0


def anthropic_usage(usage: Any) -> dict[str, int]:
    """Chat Completions usage in Anthropic's shape (zeros when there is none)."""
    usage = usage if isinstance(usage, dict) else {}
    read = _detail(usage, "prompt_tokens_details", "cached_tokens") or _count(
        usage.get("cache_read_input_tokens")
    )
    written = _count(usage.get("cache_creation_input_tokens")) or _detail(
        usage, "prompt_tokens_details", "cache_write_tokens"
    )
    prompt = _count(usage.get("prompt_tokens"))
    return {
        "input_tokens": max(0, prompt - read - written),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "output_tokens": _count(usage.get("completion_tokens")),
    }


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def as_error_body(status: int, payload: Any) -> dict[str, Any]:
    """An upstream's error body (OpenAI's shape, or Anthropic's already) in Anthropic's."""
    if isinstance(payload, dict) and payload.get("type") == "error":
        return payload
    error = payload.get("error") if isinstance(payload, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = f"The upstream answered {status}."
    return error_body(status, message)


def tool_input(arguments: Any) -> Any:
    """A chat tool call's `arguments` as a tool_use `input` (an object, as the API requires)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return {"arguments": arguments}
        return value if isinstance(value, dict) else {"value": value}
    return arguments if isinstance(arguments, dict) else {}


def message_object(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }


def message_from_chat(completion: dict[str, Any], model: str, message_id: str) -> dict[str, Any]:
    """A whole chat completion (choice 0) as an Anthropic message."""
    choices = completion.get("choices")
    choice = as_object(choices[0] if isinstance(choices, list) and choices else None)
    reply = as_object(choice.get("message"))
    content: list[dict[str, Any]] = []
    text = reply.get("content") or reply.get("refusal")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in reply.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                "name": function.get("name") or "",
                "input": tool_input(function.get("arguments")),
            }
        )
    finish = choice.get("finish_reason")
    stop = STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn"
    usage = anthropic_usage(completion.get("usage"))
    return message_object(message_id, model, content, stop, usage)


def stored_reply(message: dict[str, Any] | None) -> dict[str, Any] | None:
    """The assistant message to store for a reply: tool call arguments in the one form a
    client's resent tool_use `input` takes (request.arguments_text), so the next request's
    history hashes the same as what was stored."""
    if message is None or not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = arguments_text(tool_input(function.get("arguments")))
            call = {**call, "function": {**function, "arguments": arguments}}
        calls.append(call)
    return {**message, "tool_calls": calls}
