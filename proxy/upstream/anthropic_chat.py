"""Chat Completions on the Messages API: how the `anthropic` upstream serves the OpenAI shapes
(chat completions from clients, the Responses API through its translation to chat, and
memproxy's own calls: intent, extraction, summaries).

Request (`messages_request`):

    messages: the leading system/developer ones   top-level `system` (texts joined); when
                                                  only the newest user message follows them,
                                                  the last of two or more (the proxy's
                                                  context, by default) goes with that turn
    messages: the rest                            turns (anthropic_blocks.to_native): a later
                                                  system message (the proxy's context) as a
                                                  text block of the user turn it precedes
    max_tokens, max_completion_tokens             max_tokens (DEFAULT_MAX_TOKENS when absent:
                                                  the Messages API requires it)
    temperature, top_p                            as they are
    stop (a string or a list)                     stop_sequences
    tools (function tools)                        {name, description, input_schema}
    tool_choice auto | required | none | {function}   auto | any | none | {tool, name}
    parallel_tool_calls: false                    tool_choice.disable_parallel_tool_use
    user                                          metadata.user_id
    stream                                        stream

Left out: `response_format` (the Messages API has no JSON mode: the prompt asks for JSON),
`stream_options` (the usage chunk is made here), `n`, `logprobs`, `seed`, penalties and any
other field the Messages API would refuse.

Reply: a `message` becomes a `chat.completion` (`completion_from_message`), a Messages event
stream the chat chunks (`ChunksFromMessages`), usage through anthropic_blocks.chat_usage (cache
reads in `prompt_tokens_details.cached_tokens`, cache writes in `cache_creation_input_tokens`
and `prompt_tokens_details.cache_write_tokens`, all three in `prompt_tokens`). Thinking
blocks are not part of a chat reply.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from proxy.core.errors import BadRequest
from proxy.upstream.anthropic_blocks import chat_usage, content_blocks, to_native

# What a chat request with no max_tokens may produce (the Messages API requires the field).
DEFAULT_MAX_TOKENS = 4096
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(content: Any) -> str:
    return "".join(b["text"] for b in content_blocks(content) if b["type"] == "text")


def messages_request(chat: dict[str, Any]) -> dict[str, Any]:
    """The Messages API request for chat completion request `chat`."""
    messages = [m for m in chat.get("messages") or [] if isinstance(m, dict)]
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    if head >= 2 and head == len(messages) - 1:
        # [system prompt, context, newest user message]: the context goes with the user turn
        # as it would later in the conversation, leaving the system prompt as it was.
        head -= 1
    body: dict[str, Any] = {"model": chat["model"]}
    system = "\n\n".join(t for t in (_text(m.get("content")) for m in messages[:head]) if t)
    if system:
        body["system"] = system
    body["messages"] = to_native(messages[head:])
    limit = chat.get("max_completion_tokens") or chat.get("max_tokens")
    body["max_tokens"] = limit if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_TOKENS
    for key in ("temperature", "top_p"):
        if chat.get(key) is not None:
            body[key] = chat[key]
    stop = chat.get("stop")
    if stop:
        body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if chat.get("tools"):
        body["tools"] = [_tool(t, i) for i, t in enumerate(chat["tools"])]
        choice = _tool_choice(chat.get("tool_choice"))
        if chat.get("parallel_tool_calls") is False:
            choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
        if choice is not None:
            body["tool_choice"] = choice
    if isinstance(chat.get("user"), str) and chat["user"]:
        body["metadata"] = {"user_id": chat["user"]}
    if chat.get("stream") is True:
        body["stream"] = True
    return body


def _tool(tool: Any, i: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(
            f"tools.{i}: an anthropic upstream serves function tools only.", param=f"tools.{i}"
        )
    out: dict[str, Any] = {"name": function["name"]}
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    schema = function.get("parameters")
    out["input_schema"] = schema if isinstance(schema, dict) else {"type": "object"}
    return out


def _tool_choice(choice: Any) -> dict[str, Any] | None:
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return {"type": "tool", "name": function["name"]}
    return None


def _finish(stop_reason: Any) -> str:
    return FINISH_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def _call(block: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """A tool_use block as a chat tool call (its input as the arguments)."""
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    function = {"name": block.get("name"), "arguments": arguments}
    call: dict[str, Any] = {"id": block.get("id"), "type": "function", "function": function}
    return call if index is None else {"index": index, **call}


def completion_from_message(message: dict[str, Any], model: str) -> dict[str, Any]:
    """A whole Messages API `message` as a chat completion."""
    blocks = [b for b in message.get("content") or [] if isinstance(b, dict)]
    text = "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")
    reply: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    calls = [_call(b) for b in blocks if b.get("type") == "tool_use"]
    if calls:
        reply["tool_calls"] = calls
    choice = {
        "index": 0,
        "message": reply,
        "finish_reason": _finish(message.get("stop_reason")),
        "logprobs": None,
    }
    return {
        "id": "chatcmpl-" + str(message.get("id") or "").removeprefix("msg_"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": message.get("model") or model,
        "choices": [choice],
        "usage": chat_usage(message.get("usage")) or chat_usage({}),
    }


def error_completion(status: int, body: bytes) -> bytes:
    """The API's error body (`{"type": "error", "error": {type, message}}`) in OpenAI's."""
    try:
        payload = msgspec.json.decode(body)
    except (ValueError, RecursionError):
        payload = None
    error = _object(payload.get("error") if isinstance(payload, dict) else None)
    message = error.get("message")
    if not isinstance(message, str) or not message:
        message = f"The anthropic upstream answered {status}."
    kind = error.get("type") if isinstance(error.get("type"), str) else "upstream_error"
    out = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    return msgspec.json.encode(out)


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class ChunksFromMessages:
    """A Messages event stream (decoded event payloads) as chat.completion.chunk events."""

    def __init__(self, model: str, *, include_usage: bool) -> None:
        self.model, self.include_usage = model, include_usage
        self.id = "chatcmpl-"
        self.created = int(time.time())
        self.usage: dict[str, Any] = {}
        self.calls: dict[int, int] = {}  # block index -> tool call index
        self.done = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return _data(self._frame([choice]))

    def _frame(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def feed(self, payload: bytes) -> bytes:
        """What the client gets for one event's data."""
        try:
            event = msgspec.json.decode(payload)
        except (ValueError, RecursionError):
            return b""
        if not isinstance(event, dict) or self.done:
            return b""
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            start = event["message"]
            self.id = "chatcmpl-" + str(start.get("id") or "").removeprefix("msg_")
            self.model = start.get("model") or self.model
            self.usage.update(start.get("usage") or {})
            return self._chunk({"role": "assistant", "content": ""})
        if kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            block = event["content_block"]
            if block.get("type") == "tool_use":
                index = self.calls[event.get("index", 0)] = len(self.calls)
                call = _call({**block, "input": {}}, index)
                call["function"]["arguments"] = ""
                return self._chunk({"tool_calls": [call]})
            if block.get("type") == "text" and block.get("text"):
                return self._chunk({"content": block["text"]})
            return b""
        if kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            return self._delta(event.get("index", 0), event["delta"])
        if kind == "message_delta":
            delta, usage = _object(event.get("delta")), _object(event.get("usage"))
            self.usage.update({k: v for k, v in usage.items() if v is not None})
            return self._chunk({}, _finish(delta.get("stop_reason")))
        if kind == "message_stop":
            return self.finish()
        if kind == "error":
            self.done = True
            error = _object(event.get("error"))
            message = error.get("message") or "The anthropic upstream failed mid-stream."
            kind = error.get("type") or "upstream_error"
            return _data({"error": {"message": message, "type": kind, "code": kind}})
        return b""  # (ping, and events a chat stream has no place for)

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        kind = delta.get("type")
        if kind == "text_delta" and delta.get("text"):
            return self._chunk({"content": str(delta["text"])})
        if kind == "input_json_delta" and index in self.calls and delta.get("partial_json"):
            piece = {"arguments": str(delta["partial_json"])}
            return self._chunk({"tool_calls": [{"index": self.calls[index], "function": piece}]})
        return b""

    def finish(self) -> bytes:
        """The stream's end: the usage chunk (if the client asked for it), `[DONE]`."""
        if self.done:
            return b""
        self.done = True
        out = b""
        if self.include_usage:
            out += _data({**self._frame([]), "usage": chat_usage(self.usage) or chat_usage({})})
        return out + b"data: [DONE]\n\n"
