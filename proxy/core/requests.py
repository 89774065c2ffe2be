"""Parsing and checking request bodies before anything is forwarded."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
from litestar import Request

from proxy.core.access import request_info
from proxy.core.config_identity import user_id_problem
from proxy.core.errors import BadRequest, PayloadTooLarge

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_INLINE = 20  # entries of a request's `attachments`
MAX_TITLE, MAX_SOURCE = 512, 2048  # a document's title and source, as stored


def parse_json_object(raw: bytes, fields: Collection[str] | None = None) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it: a field not among
    `fields` (when given) too, rather than a misspelt one left out unnoticed."""
    if not raw.strip():
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        body = msgspec.json.decode(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(
            f"We could not parse the JSON body of your request ({exc}). "
            "The OpenAI API expects a JSON payload."
        ) from None
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object, not {_kind(body)}.")
    # JSON can only carry a NUL as the escape \u0000; look closer only when that is there.
    if b"\\u0000" in raw and _holds_nul(body):
        raise BadRequest(NUL_IN_BODY)
    if fields is not None:
        refuse_unknown(body, fields)
    return body


def refuse_unknown(names: Iterable[str], known: Collection[str], what: str = "field") -> None:
    """A 400 naming the first of `names` not among `known` (a misspelt field is not left out
    unnoticed)."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise BadRequest(f"Unknown {what} '{unknown[0]}'.", param=unknown[0])


NUL_IN_BODY = (
    "A string in the request body contains the NUL character (U+0000), which cannot be "
    "stored; remove it."
)


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(v) for v in value)
    return False


async def before_handler(request: Request[Any, Any, Any]) -> None:
    """Litestar's `before_request` hook, before every handler and its dependencies: the
    request's info (proxy/core/access.py) is created now, so what is timed from it (the access
    line's latency, an exchange's `overhead_ms`) includes routing and dependency injection,
    not only what follows authentication; then a NUL in the URL is refused. A coroutine,
    though it awaits nothing: Litestar runs a plain function hook in a worker thread, a
    thread hand-off on every request."""
    request_info(request.scope)
    reject_nul_in_url(request)


def reject_nul_in_url(request: Request[Any, Any, Any]) -> None:
    """A NUL in the path or the query (`%00`) is a 400, not an id or a user to look up
    (PostgreSQL cannot even compare text holding one)."""
    if "\x00" in request.scope.get("path", "") or b"%00" in request.scope.get("query_string", b""):
        raise BadRequest("The request's path or query contains the NUL character (%00).")


def header_text(request: Request[Any, Any, Any], name: str) -> str | None:
    """A request header's value as UTF-8 text (`header_value`)."""
    return header_value(request.headers, name)


def header_value(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value as UTF-8 text (the server hands values over read as Latin-1), so that
    a user id sent as UTF-8 is the same user the JSON body or a query names; 400 if the bytes
    are not UTF-8."""
    value = headers.get(name)
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise BadRequest(f"The {name} header must be UTF-8.", param=name) from None


def check_user_id(value: Any, param: str = "user", *, stored_before: bool = False) -> str:
    """A user id as every route takes it (config_identity.user_id_problem), else a 400 naming
    `param`."""
    problem = user_id_problem(value, stored_before=stored_before)
    if problem:
        raise BadRequest(f"'{param}' {problem}.", param=param)
    return value  # type: ignore[no-any-return]


def check_chat_request(body: dict[str, Any], max_messages: int) -> None:
    """The fields the proxy itself relies on; everything else is the upstream's to judge."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > 256 or "\x00" in model:
        what = "missing" if model is None else "not a non-empty string of at most 256 characters"
        raise BadRequest(f"'model' is {what}.", param="model")
    check_messages(body.get("messages"), max_messages=max_messages)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"'stream' is {_kind(stream)}, expected a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(
            f"'stream_options' is {_kind(options)}, expected an object.", param="stream_options"
        )


def check_responses_request(body: dict[str, Any], max_messages: int) -> None:
    """The Responses API fields the proxy itself relies on (the items are checked as they are
    read); everything else is the upstream's to judge."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > 256 or "\x00" in model:
        what = "missing" if model is None else "not a non-empty string of at most 256 characters"
        raise BadRequest(f"'model' is {what}.", param="model")
    value = body.get("input")
    if value is None or value == [] or value == "":
        what = "missing" if value is None else "empty"
        raise BadRequest(f"'input' is {what}: memproxy needs the turn's input.", param="input")
    if isinstance(value, list):
        check_count(value, "input", max_messages)
    for key, kind, name in (
        ("stream", bool, "a boolean"),
        ("store", bool, "a boolean"),
        ("previous_response_id", str, "a string"),
        ("instructions", str, "a string"),
        ("tools", list, "an array"),
        ("metadata", dict, "an object"),
        ("stream_options", dict, "an object"),
    ):
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"'{key}' is {_kind(value)}, expected {name}.", param=key)
    conversation = body.get("conversation")
    if conversation is not None and not isinstance(conversation, str | dict):
        raise BadRequest(
            f"'conversation' is {_kind(conversation)}, expected a string or an object.",
            param="conversation",
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


def check_count(items: list[Any], param: str, max_messages: int) -> None:
    """At most `server.max_request_messages` messages (or input items) in one request: each
    becomes a stored row, and the body limit alone lets through hundreds of thousands."""
    if len(items) > max_messages:
        raise PayloadTooLarge(
            f"'{param}' holds {len(items)} items; this server accepts at most {max_messages} "
            "in one request (server.max_request_messages).",
            param=param,
            code="too_many_messages",
        )


def check_messages(
    messages: Any, param: str = "messages", *, max_messages: int, imported: bool = False
) -> None:
    """A non-empty array of at most `max_messages` OpenAI chat messages whose stored fields
    have the right types. Imported messages may also carry `created_at` (ISO 8601)."""
    if not isinstance(messages, list) or not messages:
        what = (
            "missing"
            if messages is None
            else ("empty" if messages == [] else f"{_kind(messages)}, expected an array")
        )
        raise BadRequest(f"'{param}' is {what}; it must be a non-empty array.", param=param)
    check_count(messages, param, max_messages)
    for i, message in enumerate(messages):
        _check_message(message, f"{param}[{i}]", imported=imported)


def reply_problem(reply: dict[str, Any]) -> str | None:
    """Why an upstream's reply cannot be stored as a message of its conversation (what a
    client sending it back would be told), or None: the checks a client's messages get."""
    try:
        _check_message(reply, "the reply", imported=False)
    except BadRequest as exc:
        return exc.message
    return None


def _check_message(message: Any, where: str, *, imported: bool) -> None:
    """One message: an object with a known role, and its stored fields of the right types."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} is {_kind(message)}, expected an object.", param=where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # (an object or an array is unhashable)
        shown = repr(role) if isinstance(role, str) else _kind(role)
        raise BadRequest(
            f"{where}.role is {shown}; expected one of {', '.join(sorted(ROLES))}.",
            param=f"{where}.role",
        )
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise BadRequest(
            f"{where}.content is {_kind(content)}, expected a string or an array.",
            param=f"{where}.content",
        )
    if isinstance(content, list):
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content[{j}]")
    for name in ("name", "tool_call_id"):
        if not _short_text(message.get(name), optional=True):
            raise BadRequest(
                f"{where}.{name} must be a string of at most 256 characters.",
                param=f"{where}.{name}",
            )
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls must be an array.", param=f"{where}.tool_calls")
        for j, call in enumerate(calls):
            _check_tool_call(call, f"{where}.tool_calls[{j}]")
    if imported and "created_at" in message:
        parse_timestamp(message["created_at"], f"{where}.created_at")


# Content parts whose fields the proxy reads (stores, searches, counts): the field each must
# have, and its type. Other types pass on as they are, for the upstream to judge.
_PART_FIELDS: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "text": ("text", str),
    "refusal": ("refusal", str),
    "image_url": ("image_url", (dict, str)),  # (litellm takes the URL alone too)
}


def _check_part(part: Any, where: str) -> None:
    """One content part: an object with a `type`, and the field that type names."""
    if not isinstance(part, dict):
        raise BadRequest(f"{where} is {_kind(part)}, expected an object.", param=where)
    kind = part.get("type")
    if not isinstance(kind, str) or not kind:
        raise BadRequest(f"{where}.type must be a string (e.g. 'text').", param=f"{where}.type")
    field, expected = _PART_FIELDS.get(kind, (None, object))
    if field is None:
        return
    value = part.get(field)
    if not isinstance(value, expected):
        wanted = "a string" if expected is str else "an object or a string"
        raise BadRequest(
            f"{where}.{field} is {_kind(value)}, expected {wanted}.", param=f"{where}.{field}"
        )
    if isinstance(value, dict) and not isinstance(value.get("url"), str):  # (image_url)
        raise BadRequest(f"{where}.image_url.url must be a string.", param=f"{where}.image_url.url")


def parse_timestamp(value: Any, param: str) -> datetime:
    """An ISO 8601 string (or unix seconds) as an aware UTC datetime."""
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, UTC)
        if isinstance(value, str):
            parsed = datetime.fromisoformat(value)
            return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValueError, OverflowError, OSError):
        pass
    raise BadRequest(f"{param} must be an ISO 8601 date-time.", param=param)


@dataclass(frozen=True, slots=True)
class Inline:
    """One entry of a request's `attachments`: a document's text, or a stored one's id."""

    content: str | None = None
    attachment_id: str | None = None
    title: str | None = None
    source: str | None = None


def parse_inline(value: Any) -> list[Inline]:
    """The request body's `attachments`, checked (400 naming the field that is wrong)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest("'attachments' must be an array.", param="attachments")
    if len(value) > MAX_INLINE:
        raise BadRequest(f"'attachments' may hold at most {MAX_INLINE} items.", param="attachments")
    found: list[Inline] = []
    for i, item in enumerate(value):
        where = f"attachments[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"'{where}' must be an object.", param=where)
        unknown = sorted(set(item) - {"content", "attachment_id", "title", "source"})
        if unknown:
            raise BadRequest(
                f"Unknown field '{where}.{unknown[0]}'.", param=f"{where}.{unknown[0]}"
            )
        content, attachment_id = item.get("content"), item.get("attachment_id")
        if content is None and attachment_id is None:
            raise BadRequest(
                f"'{where}' needs 'content' or 'attachment_id'.", param=f"{where}.content"
            )
        for key in ("content", "attachment_id", "title", "source"):
            if item.get(key) is not None and not isinstance(item[key], str):
                raise BadRequest(f"'{where}.{key}' must be a string.", param=f"{where}.{key}")
        for key, limit in (("title", MAX_TITLE), ("source", MAX_SOURCE)):
            if len(item.get(key) or "") > limit:
                raise BadRequest(
                    f"'{where}.{key}' must be at most {limit} characters.", param=f"{where}.{key}"
                )
        if content is not None and not content.strip():
            raise BadRequest(f"'{where}.content' is empty.", param=f"{where}.content")
        found.append(Inline(content, attachment_id, item.get("title"), item.get("source")))
    return found


def _short_text(value: Any, *, optional: bool = False) -> bool:
    if value is None:
        return optional
    return isinstance(value, str) and len(value) <= 256 and "\x00" not in value


def _check_tool_call(call: Any, where: str) -> None:
    """An assistant's tool call: `{"id": str, "type"?: str, "function": {"name": str,
    "arguments": str}}` (what the proxy hashes, stores and pairs with its reply)."""
    if not isinstance(call, dict):
        raise BadRequest(f"{where} is {_kind(call)}, expected an object.", param=where)
    if not _short_text(call.get("id")):
        raise BadRequest(
            f"{where}.id must be a string of at most 256 characters.", param=f"{where}.id"
        )
    if not _short_text(call.get("type"), optional=True):
        raise BadRequest(f"{where}.type must be a string.", param=f"{where}.type")
    function = call.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{where}.function must be an object.", param=f"{where}.function")
    if not _short_text(function.get("name")):
        raise BadRequest(f"{where}.function.name must be a string.", param=f"{where}.function.name")
    if not isinstance(function.get("arguments", ""), str):
        raise BadRequest(
            f"{where}.function.arguments must be a string.", param=f"{where}.function.arguments"
        )
