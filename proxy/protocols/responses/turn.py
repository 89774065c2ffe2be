"""A `POST /v1/responses` turn: which way to the upstream (native or by translation), and what
a `previous_response_id` or `conversation` names, before the turn pipeline takes over."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response

from proxy.core.auth import Principal
from proxy.core.errors import BadRequest
from proxy.pipeline.exchange import answer_turn
from proxy.pipeline.identify import CONVERSATION_ID
from proxy.protocols.responses.adapter import ResponsesAPI
from proxy.state import AppState


async def create_response_turn(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, body: dict[str, Any]
) -> Response[Any]:
    upstream = services.upstream_for(principal)
    translate = upstream.kind != "openai"
    conversation = _conversation(body, translate)
    wire = ResponsesAPI(
        body,
        translate=translate,
        conversation_id=conversation,
        held_upstream=not translate and body.get("previous_response_id") is not None,
    )
    return await answer_turn(request, principal, services, wire, wire.neutral())


def _conversation(body: dict[str, Any], translate: bool) -> str | None:
    """The memproxy conversation the `conversation` parameter names (any id of the header's
    form). A translated request does not forward it; a native one does."""
    value = body.get("conversation")
    if value is None:
        return None
    conversation = value.get("id") if isinstance(value, dict) else value
    if not isinstance(conversation, str) or not CONVERSATION_ID.fullmatch(conversation):
        raise BadRequest(
            "'conversation' must name a conversation: 1-128 characters of A-Z a-z 0-9 . _ : -",
            param="conversation",
        )
    if translate:
        body.pop("conversation")
    return conversation
