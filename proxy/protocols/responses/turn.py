"""A `POST /v1/responses` turn: which way to the upstream (native or by translation), and what
a `previous_response_id` or `conversation` continues, before the turn pipeline takes over.

A `previous_response_id` names a response memproxy kept (storage/repositories/responses.py):
on a translated upstream its whole chain is sent again, as the upstream would have kept it
(each response's input items and output, in order; not earlier `instructions`, which the
API does not carry over); on a native one the upstream keeps the chain, and memproxy only
reads which conversation it continues. Either way the turn goes on in that conversation. A
`conversation` is memproxy's on a translated upstream (its stored history is attached); a
native upstream keeps the conversation's items itself, so none are sent again."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from sqlalchemy import Connection

from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, ServiceUnavailable
from proxy.pipeline.exchange import answer_turn
from proxy.pipeline.identify import CONVERSATION_ID, identify
from proxy.protocols.responses.adapter import ResponsesAPI, user_fields
from proxy.protocols.responses.items import output_to_messages, parse_input
from proxy.state import AppState
from storage.errors import BrokenChain, StorageError
from storage.records import ResponseRecord
from storage.repositories.responses import Responses


async def create_response_turn(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, body: dict[str, Any]
) -> Response[Any]:
    translate = services.responses_mode(principal) == "translate"
    named = _conversation(body, translate)
    conversation, history = None, []
    previous = body.get("previous_response_id")
    if isinstance(previous, str):
        chain = await _chain(request, services, principal, body, previous, whole=translate)
        conversation = chain[-1].conversation_id
        if translate:
            history = _chain_messages(chain)
    wire = ResponsesAPI(
        body,
        translate=translate,
        history=history,
        # (the conversation `previous_response_id` continues, else the one named)
        conversation_id=conversation or named,
        # A native upstream keeps a chain, and an OpenAI conversation, itself.
        held_upstream=not translate and (isinstance(previous, str) or named is not None),
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


async def _chain(
    request: Request[Any, Any, Any],
    services: AppState,
    principal: Principal,
    body: dict[str, Any],
    previous: str,
    *,
    whole: bool,
) -> list[ResponseRecord]:
    """`read_chain` for the user the request names (as its turn will be stored for)."""
    user = identify(request, principal, user_fields(body)).user_id
    return await read_chain(services, principal.tenant_id, user, previous, whole=whole)


async def read_chain(
    services: AppState, tenant: str, user: str | None, previous: str, *, whole: bool
) -> list[ResponseRecord]:
    """The stored responses `previous` continues, root first (`whole`), or `previous` alone:
    of the tenant, and of `user` when given; 400 `previous_response_not_found` for any other
    (or a chain with a link gone), 503 when storage cannot say."""

    def read(conn: Connection) -> list[ResponseRecord] | None:
        if whole:
            return Responses(conn).chain(tenant, previous, user)
        # A native upstream keeps the chain, for every tenant that shares its key: memproxy
        # forwards only a response it saw made for this tenant and user.
        found = Responses(conn).find(tenant, previous, user)
        return [found] if found is not None else None

    await services.memory.settle(tenant, user)  # (the user's last reply may be on its way)
    try:
        chain = await services.memory.in_time(services.db.read(read))
    except BrokenChain as exc:
        raise _not_found(exc.missing or previous) from None
    except StorageError as exc:
        raise ServiceUnavailable(
            "Memory storage is unavailable, and it holds the responses this one continues "
            "(or who they belong to). Try again later.",
            code="memory_unavailable",
            headers={"retry-after": "5"},
        ) from exc
    if chain is None:
        raise _not_found(previous)
    return chain


def _not_found(response_id: str) -> BadRequest:
    return BadRequest(
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _chain_messages(chain: list[ResponseRecord]) -> list[dict[str, Any]]:
    """A chain's input items and output as neutral messages, in order."""
    messages: list[dict[str, Any]] = []
    for stored in chain:
        messages += parse_input({"input": stored.input_items}).messages
        output = stored.response.get("output")
        messages += output_to_messages(output if isinstance(output, list) else [])
    return messages
