"""Responses API objects that memproxy keeps itself, for upstreams that keep no state
(`responses: translate`): ids made as OpenAI makes them, a request's `input` as the list of
items its response keeps, and the objects the store's routes answer with."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from storage.records import ItemPage, ResponseRecord

# An item's id prefix by its type, as OpenAI's (`item` for types it has none known here).
_ITEM_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
# Types whose items OpenAI lists with a `status`.
_WITH_STATUS = frozenset({"message", "function_call", "function_call_output"})


def new_response_id() -> str:
    """`resp_` and 48 hex digits, as OpenAI's response ids."""
    return "resp_" + secrets.token_hex(24)


def new_item_id(kind: str) -> str:
    return f"{_ITEM_PREFIXES.get(kind, 'item')}_{secrets.token_hex(24)}"


def input_item_list(value: Any) -> list[dict[str, Any]]:
    """A request's `input` as the items its stored response lists (`/input_items`), in order,
    as OpenAI lists them: a string is one user message; a message given without `type` (the
    easy form) gets it, its string content becomes one text part, and an output text part
    its (empty) `annotations` and `logprobs`; an item with no id is given one, and `status:
    completed` where OpenAI shows one. Anything else is kept as given. The request's own
    items are not changed."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return []
    return [_listed(item) for item in value if isinstance(item, dict)]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    listed = dict(item)
    if "type" not in listed and "role" in listed:
        listed["type"] = "message"
    kind = str(listed.get("type", ""))
    content = listed.get("content")
    if kind == "message" and isinstance(content, str):
        part = "output_text" if listed.get("role") == "assistant" else "input_text"
        listed["content"] = [{"type": part, "text": content}]
    if kind == "message" and isinstance(listed.get("content"), list):
        listed["content"] = [_part(p) for p in listed["content"]]
    if not isinstance(listed.get("id"), str) or not listed["id"]:
        listed["id"] = new_item_id(kind)
    if kind in _WITH_STATUS:
        listed.setdefault("status", "completed")
    return listed


def _part(part: Any) -> Any:
    """An `output_text` part with the lists OpenAI always shows (empty when not given)."""
    if isinstance(part, dict) and part.get("type") == "output_text":
        return {"annotations": [], "logprobs": [], **part}
    return part


def response_record(
    response: dict[str, Any],
    given_input: Any,
    *,
    tenant_id: str,
    user_id: str,
    conversation_id: str | None,
    request_id: str,
    store: bool,
    created_at: datetime,
) -> ResponseRecord:
    """What to save of a response memproxy returned on a translated upstream: `response` as
    the client got it (its `id`, `model`, `status` and `previous_response_id` are read from
    it) and the request's `input` listed as its input items."""
    previous = response.get("previous_response_id")
    return ResponseRecord(
        tenant_id=tenant_id,
        id=str(response["id"]),
        user_id=user_id,
        conversation_id=conversation_id,
        request_id=request_id,
        model=str(response.get("model") or ""),
        previous_response_id=previous if isinstance(previous, str) else None,
        store=store,
        status=str(response.get("status") or "completed"),
        response=response,
        input_items=input_item_list(given_input),
        created_at=created_at,
    )


def item_list(page: ItemPage) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`'s answer (OpenAI's ResponseItemList)."""
    return {
        "object": "list",
        "data": page.items,
        "first_id": page.items[0]["id"] if page.items else None,
        "last_id": page.items[-1]["id"] if page.items else None,
        "has_more": page.has_more,
    }


def deleted(response_id: str) -> dict[str, Any]:
    """`DELETE /v1/responses/{id}`'s answer, as OpenAI's."""
    return {"id": response_id, "object": "response", "deleted": True}


def stored_response_object(r: ResponseRecord) -> dict[str, Any]:
    """A stored response as the user export shows it: the response as its client got it,
    its input items, and where it belongs."""
    return {
        "id": r.id,
        "object": "memory.response",
        "conversation_id": r.conversation_id,
        "request_id": r.request_id,
        "model": r.model,
        "previous_response_id": r.previous_response_id,
        "store": r.store,
        "status": r.status,
        "created_at": int(r.created_at.timestamp()),
        "response": r.response,
        "input_items": r.input_items,
    }
