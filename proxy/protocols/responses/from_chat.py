"""A Chat Completions reply as a Responses `response` object.

The response echoes the request's parameters as the API does (instructions, tools,
tool_choice, text, temperature, top_p, ...), with the API's defaults where the request left
them out, so that SDK types parse it. Finish reasons map to statuses:

    stop, tool_calls, function_call     completed
    length                              incomplete, incomplete_details.reason max_output_tokens
    content_filter                      incomplete, incomplete_details.reason content_filter
"""

from __future__ import annotations

from typing import Any

from proxy.protocols.responses.usage import responses_usage

INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def as_object(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one (for fields that may be anything)."""
    return value if isinstance(value, dict) else {}


def item_id(prefix: str, response_id: str, index: int) -> str:
    """Ids of a translated response's output items, derived from its own id: `msg_...`,
    `fc_...`, unique within the response and stable for it."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{index}"


def response_object(
    request: dict[str, Any],
    response_id: str,
    created_at: int,
    *,
    model: str | None = None,
    status: str = "in_progress",
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    completed_at: int | None = None,
    service_tier: str | None = None,
) -> dict[str, Any]:
    """A `response` object for `request`: its parameters echoed, its state as given."""
    reasoning, text = as_object(request.get("reasoning")), as_object(request.get("text"))
    conversation: Any = request.get("conversation")
    if isinstance(conversation, str):
        conversation = {"id": conversation}
    response = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": bool(request.get("background") or False),
        "completed_at": completed_at if status == "completed" else None,
        "conversation": conversation if isinstance(conversation, dict) else None,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "model": model or request.get("model") or "",
        "output": output or [],
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": request.get("previous_response_id"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "reasoning": {
            "effort": reasoning.get("effort"),
            "summary": reasoning.get("summary"),
        },
        "safety_identifier": request.get("safety_identifier"),
        "service_tier": service_tier or request.get("service_tier") or "default",
        "store": request.get("store") is not False,
        "temperature": _number(request.get("temperature"), 1.0),
        "text": {
            "format": text.get("format") or {"type": "text"},
            "verbosity": text.get("verbosity") or "medium",
        },
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [_echo_tool(tool) for tool in request.get("tools") or []],
        "top_logprobs": request.get("top_logprobs") or 0,
        "top_p": _number(request.get("top_p"), 1.0),
        "truncation": request.get("truncation") or "disabled",
        "metadata": request.get("metadata") or {},
    }
    # Both are left out rather than null (the spec does not let them be null).
    if usage is not None:
        response["usage"] = usage
    if isinstance(request.get("user"), str):
        response["user"] = request["user"]
    return response


def _number(value: Any, default: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else default


def _echo_tool(tool: Any) -> Any:
    """A function tool as the API echoes it: every field present (`strict` as given)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def message_item(
    item: str, text: str | None, refusal: str | None, status: str, logprobs: list[Any]
) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text is not None:
        content.append(
            {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        )
    if refusal is not None:
        content.append({"type": "refusal", "refusal": refusal})
    return {
        "id": item,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(item: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = as_object(call.get("function"))
    return {
        "id": item,
        "type": "function_call",
        "status": status,
        "call_id": call.get("id") or item,
        "name": function.get("name") or "",
        "arguments": function.get("arguments") or "",
    }


def output_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    """A chat choice's `logprobs.content` as an `output_text` part's `logprobs`."""
    content = chat_logprobs.get("content") if isinstance(chat_logprobs, dict) else None
    return [
        {
            "token": lp.get("token", ""),
            "logprob": lp.get("logprob", 0.0),
            "bytes": lp.get("bytes") or [],
            "top_logprobs": [
                {
                    "token": t.get("token", ""),
                    "logprob": t.get("logprob", 0.0),
                    "bytes": t.get("bytes") or [],
                }
                for t in lp.get("top_logprobs") or []
                if isinstance(t, dict)
            ],
        }
        for lp in content or []
        if isinstance(lp, dict)
    ]


def status_of(finish_reason: Any) -> tuple[str, str | None]:
    """(status, incomplete_details.reason) for a chat finish reason."""
    reason = INCOMPLETE_REASONS.get(finish_reason) if isinstance(finish_reason, str) else None
    return ("incomplete", reason) if reason else ("completed", None)


def response_from_chat(
    completion: dict[str, Any],
    request: dict[str, Any],
    response_id: str,
    created_at: int,
    *,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """The Responses `response` for a whole chat completion (choice 0) answering `request`."""
    choices = completion.get("choices")
    choice = as_object(choices[0] if isinstance(choices, list) and choices else None)
    message = as_object(choice.get("message"))
    status, reason = status_of(choice.get("finish_reason"))
    item_status = "completed" if status == "completed" else "incomplete"
    output: list[dict[str, Any]] = []
    text, refusal = message.get("content"), message.get("refusal")
    if isinstance(text, list):  # some servers answer in parts
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    text = text if isinstance(text, str) and text else None
    refusal = refusal if isinstance(refusal, str) and refusal else None
    if text is not None or refusal is not None:
        logprobs = output_logprobs(choice.get("logprobs"))
        output.append(
            message_item(item_id("msg", response_id, 0), text, refusal, item_status, logprobs)
        )
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            fc = item_id("fc", response_id, len(output))
            output.append(function_call_item(fc, call, item_status))
    model = completion.get("model")
    tier = completion.get("service_tier")
    return response_object(
        request,
        response_id,
        created_at,
        model=model if isinstance(model, str) else None,
        status=status,
        output=output,
        usage=responses_usage(completion.get("usage")),
        incomplete_reason=reason,
        completed_at=completed_at if completed_at is not None else created_at,
        service_tier=tier if isinstance(tier, str) else None,
    )
