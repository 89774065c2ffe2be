"""Parsing and checking request bodies before anything is forwarded."""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.errors import BadRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(
            f"We could not parse the JSON body of your request ({exc}). "
            "The OpenAI API expects a JSON payload."
        ) from None
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object, not {_kind(body)}.")
    return body


def check_chat_request(body: dict[str, Any]) -> None:
    """The fields the proxy itself relies on; everything else is the upstream's to judge."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        what = "missing" if model is None else f"{_kind(model)}, expected a non-empty string"
        raise BadRequest(f"'model' is {what}.", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        what = (
            "missing"
            if messages is None
            else ("empty" if messages == [] else f"{_kind(messages)}, expected an array")
        )
        raise BadRequest(f"'messages' is {what}; it must be a non-empty array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(
                f"messages[{i}] is {_kind(message)}, expected an object.", param=f"messages[{i}]"
            )
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"messages[{i}].role is {role!r}; expected one of {', '.join(sorted(ROLES))}.",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"messages[{i}].content is {_kind(content)}, expected a string or an array.",
                param=f"messages[{i}].content",
            )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"'stream' is {_kind(stream)}, expected a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(
            f"'stream_options' is {_kind(options)}, expected an object.", param="stream_options"
        )


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
