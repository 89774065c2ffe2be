"""An Anthropic Messages request as a Chat Completions request, for upstreams that speak only
the OpenAI shape (kinds openai, litellm, echo).

    model, temperature, top_p                   as they are
    max_tokens                                  max_tokens
    stop_sequences                              stop
    system, messages                            the neutral messages (request.py), with what
                                                the proxy attached, in chat's shape
    tools: {name, description, input_schema}    function tools {name, description, parameters}
    tool_choice: auto | any | none              "auto" | "required" | "none"
    tool_choice: {type: tool, name}             {type: function, function: {name}}
    tool_choice.disable_parallel_tool_use       parallel_tool_calls: false
    stream                                      stream, stream_options.include_usage

Left out (see DROPPED): `metadata` (its user_id names the memory user), `top_k`, `thinking`,
`service_tier`, `container`, `mcp_servers`, every `cache_control`, and blocks with no chat
equivalent (thinking, documents by URL or file id). Tools other than custom ones (Anthropic's
server tools: web search, code execution...) cannot be served by translation: a 400.
"""

from __future__ import annotations

from typing import Any

from proxy.core.errors import BadRequest
from storage.records import KEPT_ITEMS

DROPPED: dict[str, str] = {
    "metadata": "metadata.user_id names the memory user; the chat API has no metadata",
    "top_k": "no chat equivalent",
    "thinking": "no chat equivalent (reasoning effort is the upstream's default)",
    "service_tier": "Anthropic's tiers mean nothing to another provider",
    "container": "no chat equivalent",
    "mcp_servers": "no chat equivalent",
    "context_management": "no chat equivalent",
}
_MAPPED = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "tools",
        "tool_choice",
        "stream",
        "temperature",
        "top_p",
    }
)


def chat_request(
    body: dict[str, Any], messages: list[dict[str, Any]], *, stream_usage: bool = True
) -> dict[str, Any]:
    """The chat completion request for Messages request `body` whose neutral messages, with
    what the proxy attached placed among them, are `messages`."""
    chat: dict[str, Any] = {"model": body["model"], "messages": chat_messages(messages)}
    chat["max_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        mapped, parallel = chat_tool_choice(choice)
        if mapped is not None and body.get("tools"):
            chat["tool_choice"] = mapped
        if parallel is False and body.get("tools"):
            chat["parallel_tool_calls"] = False
    if body.get("stream") is True:
        chat["stream"] = True
        if stream_usage:
            chat["stream_options"] = {"include_usage": True}
    return chat


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neutral messages as the chat API takes them: what memproxy keeps beside a message
    (thinking blocks) left out."""
    out = []
    for message in messages:
        if KEPT_ITEMS in message:
            message = {k: v for k, v in message.items() if k != KEPT_ITEMS}
        out.append(message)
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools.{i}.name: Field required", param=f"tools.{i}.name")
        kind = tool.get("type")
        if kind not in (None, "custom") or "input_schema" not in tool:
            raise BadRequest(
                f"tools.{i}: the tool {tool['name']!r} (type {kind!r}) is one of Anthropic's "
                "server tools; they are not supported on an upstream memproxy reaches by "
                "translation to chat completions, which serves custom tools only.",
                param=f"tools.{i}.type",
            )
        schema = tool["input_schema"]
        if not isinstance(schema, dict):
            raise BadRequest(
                f"tools.{i}.input_schema: expected an object.", param=f"tools.{i}.input_schema"
            )
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) for Anthropic's `tool_choice`."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise BadRequest(
        "tool_choice.type: expected 'auto', 'any', 'tool' (with a name) or 'none'.",
        param="tool_choice.type",
    )
