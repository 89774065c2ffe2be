"""A Responses request as a Chat Completions request, for upstreams without `/v1/responses`.

What maps (Responses -> Chat Completions):

    model, temperature, top_p, parallel_tool_calls,   as they are
      user, safety_identifier, prompt_cache_key,
      prompt_cache_retention, service_tier
    tools: function {name, description, parameters,   function tools
      strict}
    tool_choice: "none" | "auto" | "required"         the same
    tool_choice: {type: function, name}               {type: function, function: {name}}
    tool_choice: {type: allowed_tools, mode, tools}   {type: allowed_tools, allowed_tools}
    text.format: text | json_object | json_schema     response_format
    text.verbosity                                    verbosity
    max_output_tokens                                 max_completion_tokens
    reasoning.effort                                  reasoning_effort
    top_logprobs                                      logprobs: true, top_logprobs
    stream                                            stream, stream_options.include_usage

What cannot be served is refused (400): tools other than functions (web_search, file_search,
mcp, code_interpreter...), a tool_choice naming one, `prompt` templates and `background: true`.
What has no chat equivalent is dropped, and listed in `ChatRequest.dropped`: see DROPPED.
Any other field passes through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.core.errors import BadRequest
from proxy.protocols.responses.items import is_opaque
from proxy.protocols.responses.parts import is_chat_part
from storage.records import KEPT_ITEMS

# Responses fields with no Chat Completions equivalent, left out of the translated request.
DROPPED: dict[str, str] = {
    "store": "the chat API's `store` means stored completions, not response state",
    "previous_response_id": "memproxy serves the chain from its own store",
    "conversation": "memproxy serves the conversation from its own store",
    "metadata": "the chat API refuses metadata without `store`; it is echoed in the response",
    "include": "no encrypted reasoning or tool outputs to include",
    "truncation": "no server-side truncation in the chat API",
    "max_tool_calls": "built-in tools are not served by translation",
    "reasoning.summary": "chat completions return no reasoning summary",
    "stream_options.include_obfuscation": "translated streams carry no obfuscation",
    "prompt_cache_options": "no chat equivalent",
    "moderation": "no chat equivalent",
}
# Fields this module maps itself (everything else passes through).
_MAPPED = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "text",
        "max_output_tokens",
        "reasoning",
        "stream",
        "stream_options",
        "top_logprobs",
        "prompt",
        "background",
        "attachments",
    }
)


@dataclass(slots=True)
class ChatRequest:
    """The Chat Completions body, and what of the Responses request it could not carry."""

    body: dict[str, Any]
    dropped: list[str] = field(default_factory=list)


def chat_request(body: dict[str, Any], messages: list[dict[str, Any]]) -> ChatRequest:
    """The Chat Completions request for Responses request `body` whose neutral messages (with
    memory context already placed) are `messages`."""
    if body.get("background") is True:
        raise BadRequest(
            "background responses are not supported on an upstream without a Responses API.",
            param="background",
        )
    if body.get("prompt") is not None:
        raise BadRequest(
            "prompt templates are not supported on an upstream without a Responses API.",
            param="prompt",
        )
    dropped: list[str] = []
    chat: dict[str, Any] = {}
    for key, value in body.items():
        if key in DROPPED:
            if value is not None:
                dropped.append(key)
        elif key not in _MAPPED:
            chat[key] = value
    chat["messages"] = chat_messages(messages, dropped)
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _text(body.get("text"), chat)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
        if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
            dropped.append("reasoning.summary")
    if body.get("top_logprobs") is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_obfuscation") is not None:
        dropped.append("stream_options.include_obfuscation")
    return ChatRequest(chat, dropped)


def chat_messages(messages: list[dict[str, Any]], dropped: list[str]) -> list[dict[str, Any]]:
    """Neutral messages as the chat API takes them: opaque items left out (their neighbours'
    tool calls joined again), Responses-only parts left out."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if is_opaque(message):
            _note(dropped, f"input items of type {message['opaque_item'].get('type')}")
            continue
        message = dict(message)
        message.pop(KEPT_ITEMS, None)  # (items with no chat equivalent, kept by memproxy)
        if (
            message.get("content") is None
            and message.get("refusal")
            and not message.get("tool_calls")
        ):
            message["content"] = message["refusal"]  # (the chat API wants content or calls)
        content = message.get("content")
        if isinstance(content, list):
            kept = [p for p in content if is_chat_part(p)]
            if len(kept) < len(content):
                _note(dropped, "content parts without a chat equivalent")
            if message.get("role") == "tool" and any(p.get("type") != "text" for p in kept):
                kept = [p for p in kept if p.get("type") == "text"]
                _note(dropped, "image and file parts of function call outputs")
            message["content"] = kept
        previous = out[-1] if out else None
        if (
            previous is not None
            and message.get("role") == "assistant"
            and message.get("tool_calls")
            and message.get("content") is None
            and previous.get("role") == "assistant"
            and previous.get("tool_calls")
        ):
            # A reasoning item between two function calls of one turn split them in two.
            out[-1] = {**previous, "tool_calls": previous["tool_calls"] + message["tool_calls"]}
            continue
        out.append(message)
    return out


def _note(dropped: list[str], what: str) -> None:
    if what not in dropped:
        dropped.append(what)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("Invalid type for 'tools': expected an array.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(
                f"Tools of type {kind!r} are not supported on an upstream without a Responses "
                "API: translation to Chat Completions serves function tools only.",
                param=f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str):
            raise BadRequest(
                f"Missing required parameter: 'tools[{i}].name'.", param=f"tools[{i}].name"
            )
        function = {
            key: tool[key]
            for key in ("name", "description", "parameters", "strict")
            if tool.get(key) is not None
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools = []
        for i, tool in enumerate(choice["tools"]):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise BadRequest(
                    "Only function tools can be allowed on an upstream without a Responses API.",
                    param=f"tool_choice.tools[{i}]",
                )
            tools.append({"type": "function", "function": {"name": tool.get("name")}})
        mode = choice.get("mode", "auto")
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}
    raise BadRequest(
        f"tool_choice {choice!r} is not supported on an upstream without a Responses API: "
        "translation serves none, auto, required and function choices.",
        param="tool_choice",
    )


def _text(text: Any, chat: dict[str, Any]) -> None:
    if not isinstance(text, dict):
        return
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    fmt = text.get("format")
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema = {
            key: fmt[key]
            for key in ("name", "description", "schema", "strict")
            if fmt.get(key) is not None
        }
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind != "text":
        raise BadRequest(f"Unknown text.format type {kind!r}.", param="text.format.type")
