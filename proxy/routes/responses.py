"""The Responses API's endpoints around `POST /v1/responses`: retrieving and deleting a
response, listing its input items, counting input tokens, cancelling and compacting.

On an upstream that serves the Responses API itself (`responses: native`, the default for
`openai`) each is passed through: the upstream keeps the responses. On one that memproxy
translates to chat completions (`responses: translate`) they are answered from memproxy's own
store (storage/repositories/responses.py), scoped by the tenant and, when the request has a
user (its key's or token's, or `X-Memory-User-Id`), by the user: another tenant's or user's
response, or one created
with `store: false`, is a 404 as an unknown id is. Cancelling and compacting need the
upstream's own state and are a 400 there.

Scope `chat`. `POST /v1/responses` itself is the Responses protocol adapter's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.openapi.spec import Schema
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.tokens import count_response_input
from proxy.core.auth import USER_HEADER, Principal
from proxy.core.errors import BadRequest, NotFound
from proxy.core.json_responses import json_response
from proxy.core.requests import check_responses_request, check_user_id, parse_json_object
from proxy.pipeline.identify import named_user as identify_user
from proxy.protocols.responses.stored import deleted, input_item_list, item_list
from proxy.protocols.responses.turn import create_response_turn, read_chain
from proxy.routes.api_types import Deleted
from proxy.routes.openai import answer_turn_request, check_model, forward
from proxy.routes.params import limit_param
from proxy.routes.reference import CHAT_HEADERS, api, json_body, openai_response, ref
from proxy.state import AppState
from storage.errors import UnknownCursor
from storage.records import ItemPage, ResponseRecord
from storage.repositories.responses import Order, Responses

ORDERS: dict[str, Order] = {"asc": "asc", "desc": "desc"}


RESPONSES_BODY = json_body(
    Schema(all_of=[ref("CreateResponse"), ref("ChatCompletionExtensions")]),
    "OpenAI's Responses API request; fields memproxy does not know pass through unchanged.",
)


@post(
    "/v1/responses",
    status_code=200,
    summary="Create response",
    **api(
        "chat",
        body=RESPONSES_BODY,
        headers=CHAT_HEADERS,
        ok_response=openai_response(
            "Response",
            "The response, or with `stream: true` its events as server-sent events.",
            stream="ResponseStreamEvent",
        ),
    ),
)
async def create_response(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body())
    check_responses_request(body, services.config.server.max_request_messages)
    return await answer_turn_request(request, principal, services, body, create_response_turn)


def _native(services: AppState, principal: Principal) -> bool:
    return services.responses_mode(principal) == "native"


def _path(request: Request[Any, Any, Any]) -> str:
    """The request's path after /v1, decoded, as the passthrough sends it on."""
    return str(request.scope["path"]).removeprefix("/v1")


def named_user(request: Request[Any, Any, Any], principal: Principal) -> str | None:
    """The user whose responses alone the request may see: its key's or token's, else the one
    `X-Memory-User-Id` names (proxy/pipeline/identify.py), else any of the tenant's."""
    user = identify_user(request, principal)
    return None if user is None else check_user_id(user, USER_HEADER)


def not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.")


async def _native_only(
    request: Request[Any, Any, Any],
    principal: Principal,
    services: AppState,
    response_id: str | None = None,
) -> Response[Any]:
    """Passed through to a native upstream; on a translated one, a 400 saying why not."""
    if _native(services, principal):
        return await _forward_owned(request, principal, services, response_id)
    raise not_translatable(request, principal)


async def _forward_owned(
    request: Request[Any, Any, Any],
    principal: Principal,
    services: AppState,
    response_id: str | None,
) -> Response[Any]:
    """Passed through to a native upstream, for a response of the tenant (and of the user the
    request names) only: the tenants of one upstream share its key, and so its responses."""
    if response_id is not None:
        user = named_user(request, principal)
        await services.memory.settle(principal.tenant_id)  # (replies still on their way)
        owner = await services.db.read(
            lambda conn: Responses(conn).owner(principal.tenant_id, response_id)
        )
        if owner is None or (user is not None and owner != user):
            raise not_found(response_id)
    return await forward(request, principal, services, _path(request))


def not_translatable(request: Request[Any, Any, Any], p: Principal) -> BadRequest:
    """What cancelling or compacting is on a translated upstream."""
    return BadRequest(
        f"{request.method} {request.url.path} is not available: the upstream "
        f"{p.tenant.upstream!r} serves the Responses API through memproxy's translation to "
        "chat completions (responses: translate), which "
        "runs no background responses and keeps no upstream state to cancel or compact. Use "
        "an upstream with the Responses API of its own (kind openai, responses: native).",
        code="unsupported_with_translation",
    )


@get(
    "/v1/responses/{response_id:str}",
    summary="Get a model response",
    **api("chat", ok_response=openai_response("Response", "The response as it was returned.")),
)
async def get_response(
    request: Request[Any, Any, Any],
    response_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    if _native(services, principal):
        return await _forward_owned(request, principal, services, response_id)
    if request.query_params.get("stream", "").lower() == "true":
        raise BadRequest(
            "stream=true replays a background response's events; translated responses are "
            "never run in the background. Retrieve it without stream.",
            param="stream",
        )
    user = named_user(request, principal)

    def work(conn: Connection) -> ResponseRecord | None:
        return Responses(conn).get(principal.tenant_id, response_id, user)

    await services.memory.settle(principal.tenant_id)  # (replies still on their way)
    found = await services.db.read(work)
    if found is None:
        raise not_found(response_id)
    return json_response(found.response)


@delete(
    "/v1/responses/{response_id:str}",
    status_code=200,
    summary="Delete a model response",
    **api("chat", ok=Deleted),
)
async def delete_response(
    request: Request[Any, Any, Any],
    response_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    if _native(services, principal):
        return await _forward_owned(request, principal, services, response_id)
    user = named_user(request, principal)

    def work(conn: Connection) -> bool:
        return Responses(conn).delete(principal.tenant_id, response_id, user)

    await services.memory.settle(principal.tenant_id)  # (replies still on their way)
    if not await services.db.write(work):
        raise not_found(response_id)
    return json_response(deleted(response_id))


@get(
    "/v1/responses/{response_id:str}/input_items",
    summary="List the input items of a model response",
    **api(
        "chat",
        query=("after", "limit", "order"),
        ok_response=openai_response("ResponseItemList", "A page of the response's input items."),
    ),
)
async def list_input_items(
    request: Request[Any, Any, Any],
    response_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    if _native(services, principal):
        return await _forward_owned(request, principal, services, response_id)
    user = named_user(request, principal)
    limit = limit_param(request)
    order = ORDERS.get(request.query_params.get("order", "desc"))
    if order is None:
        raise BadRequest("order must be asc or desc.", param="order")
    after = request.query_params.get("after")

    def work(conn: Connection) -> ItemPage | None:
        return Responses(conn).input_items(
            principal.tenant_id, response_id, user, after=after, limit=limit, order=order
        )

    try:
        await services.memory.settle(principal.tenant_id)  # (replies still on their way)
        page = await services.db.read(work)
    except UnknownCursor:
        raise BadRequest(
            f"after: response '{response_id}' has no input item '{after}'.", param="after"
        ) from None
    if page is None:
        raise not_found(response_id)
    return json_response(item_list(page))


@post(
    "/v1/responses/input_tokens",
    status_code=200,
    summary="Count the input tokens of a Responses request",
    **api(
        "chat",
        body=json_body(ref("TokenCountsBody"), "What a Responses request would send."),
        ok_response=openai_response("TokenCountsResource", "The count."),
    ),
)
async def input_tokens(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    """Translated: counted with tiktoken as the translation would send the request, the
    responses its `previous_response_id` chain stored included (instructions are not carried
    over, as OpenAI's are not). Tools and images are not counted."""
    if _native(services, principal):
        return await forward(request, principal, services, _path(request))
    body = parse_json_object(await request.body())
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string.", param="model")
        check_model(principal, model)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string.", param="instructions")
    given = body.get("input")
    if given is not None and not isinstance(given, (str, list)):
        raise BadRequest("'input' must be a string or a list of items.", param="input")
    items = await _earlier_items(request, principal, services, body.get("previous_response_id"))
    items += input_item_list(given)
    count = await asyncio.to_thread(count_response_input, instructions, items, model or "")
    return json_response({"object": "response.input_tokens", "input_tokens": count})


async def _earlier_items(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, previous: Any
) -> list[Any]:
    """The input and output items of the stored responses a request continues, in order."""
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise BadRequest("'previous_response_id' must be a string.", param="previous_response_id")
    chain = await read_chain(
        services, principal.tenant_id, named_user(request, principal), previous, whole=True
    )
    items: list[Any] = []
    for stored in chain:
        items += stored.input_items
        output = stored.response.get("output")
        items += output if isinstance(output, list) else []
    return items


@post(
    "/v1/responses/{response_id:str}/cancel",
    status_code=200,
    summary="Cancel a background response",
    **api("chat", ok_response=openai_response("Response", "The cancelled response.")),
)
async def cancel_response(
    request: Request[Any, Any, Any],
    response_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    return await _native_only(request, principal, services, response_id)


@post(
    "/v1/responses/compact",
    status_code=200,
    summary="Compact a conversation",
    **api(
        "chat",
        body=json_body(ref("CompactResponseMethodPublicBody"), "What to compact."),
        ok_response=openai_response("CompactResource", "The compacted conversation."),
    ),
)
async def compact(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    return await _native_only(request, principal, services)


ROUTES = [
    create_response,
    get_response,
    delete_response,
    list_input_items,
    input_tokens,
    cancel_response,
    compact,
]
