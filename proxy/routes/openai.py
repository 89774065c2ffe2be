"""The OpenAI-compatible surface: chat completions, models, and everything else passed through."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response, get, post, route
from litestar.di import NamedDependency
from litestar.enums import HttpMethod
from litestar.exceptions import ClientException
from litestar.openapi.spec import Schema
from litestar.params import FromPath

from proxy.core.access import ClientWatch, request_info
from proxy.core.auth import Principal
from proxy.core.errors import NotFound
from proxy.core.json_responses import json_response
from proxy.core.requests import check_chat_request, parse_json_object
from proxy.protocols.chat import chat_completion
from proxy.protocols.relay import to_response
from proxy.routes.reference import CHAT_HEADERS, api, json_body, openai_response, ref
from proxy.state import AppState
from proxy.upstream.base import model_list

CHAT = {"scope": "chat"}
# The body is read as raw JSON (unknown fields pass through to the upstream untouched), so
# the document is told its shape: OpenAI's, plus memproxy's optional `attachments`.
CHAT_BODY = json_body(
    Schema(all_of=[ref("CreateChatCompletionRequest"), ref("ChatCompletionExtensions")]),
    "OpenAI's chat completion request; fields memproxy does not know pass through unchanged.",
)


@post(
    "/v1/chat/completions",
    status_code=200,
    summary="Create chat completion",
    **api(
        "chat",
        body=CHAT_BODY,
        headers=CHAT_HEADERS,
        ok_response=openai_response(
            "CreateChatCompletionResponse",
            "The completion, or with `stream: true` its chunks as server-sent events.",
            stream="CreateChatCompletionStreamResponse",
        ),
    ),
)
async def chat_completions(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body())
    check_chat_request(body, services.config.server.max_request_messages)
    return await answer_turn_request(request, principal, services, body, chat_completion)


TurnAnswer = Callable[
    [Request[Any, Any, Any], Principal, AppState, dict[str, Any]], Awaitable[Response[Any]]
]


async def answer_turn_request(
    request: Request[Any, Any, Any],
    principal: Principal,
    services: AppState,
    body: dict[str, Any],
    answer: TurnAnswer,
) -> Response[Any]:
    """A turn's route, once its body is checked: the model allow-list, what the access line
    says, and (a whole reply) the client's leaving noticed while the turn is answered."""
    info = request_info(request.scope)
    model: str = body["model"]
    info.model = model
    info.stream = body.get("stream") is True
    check_model(principal, model)
    if info.stream:  # (a stream notices its client leaving as it relays)
        return await answer(request, principal, services, body)
    watch = ClientWatch(request.receive)
    try:
        return await answer(request, principal, services, body)
    finally:
        watch.end(info)


def check_model(principal: Principal, model: object) -> None:
    """404 `model_not_found`, as OpenAI answers, for a model outside the tenant's allow-list."""
    allowed = principal.tenant.models
    if allowed is not None and model not in allowed:
        raise NotFound(
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


async def requested_model(request: Request[Any, Any, Any], body: bytes) -> object:
    """The `model` a passed-through request names (a JSON body's, or a form's field, as
    transcriptions send it), or None."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "application/json":
        try:
            parsed = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return None  # (the upstream says what is wrong with it)
        return parsed.get("model") if isinstance(parsed, dict) else None
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            return (await request.form()).get("model")
        except (ClientException, ValueError, LookupError):  # (a form Litestar cannot read,
            return None  # a charset it does not know: the upstream says what is wrong)
    return None


@get(
    "/v1/models",
    summary="List models",
    **api(
        "chat",
        ok_response=openai_response("ListModelsResponse", "The models the key may use."),
        errors=(401, 403, 429, 502, 504),
    ),
)
async def list_models(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    allowed = principal.tenant.models
    if allowed is not None:
        return json_response(model_list(allowed, "memproxy"))
    return to_response(request, await services.upstream_for(principal).list_models())


def check_passthrough_path(method: str, path: str) -> None:
    """404, as OpenAI answers an unknown URL, for a path (decoded) that could lead outside the
    upstream's base URL once joined to it: a `.` or `..` segment, or a `?`, `#` or `\\` that
    would move the rest into the query or cut it off, or a control character. The proxy's
    own upstream key goes with every request passed through."""
    if (
        any(segment in (".", "..") for segment in path.split("/"))
        or any(c in path for c in "?#\\")
        or not path.isprintable()
    ):
        raise NotFound(f"Invalid URL ({method} /v1{path}).", code="invalid_url")


@route(
    "/v1/{path:path}",
    http_method=[
        HttpMethod.GET,
        HttpMethod.POST,
        HttpMethod.PUT,
        HttpMethod.PATCH,
        HttpMethod.DELETE,
    ],
    opt=CHAT,
    include_in_schema=False,
)
async def passthrough(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
    path: FromPath[str],
) -> Response[Any]:
    """Any other OpenAI endpoint (embeddings, files, audio...), unchanged, no memory."""
    return await forward(request, principal, services, path)


async def forward(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, path: str
) -> Response[Any]:
    """The request sent on to the tenant's upstream unchanged (`path`: after /v1, decoded),
    without memory: the model allow-list applies, and it counts toward the tenant's limits."""
    check_passthrough_path(request.method, path)
    body = await request.body()
    if principal.tenant.models is not None:  # (a model named elsewhere than the body, as in
        # GET /v1/models/{id}, reaches the upstream: it spends nothing)
        model = await requested_model(request, body)
        if model is not None:
            check_model(principal, model)
    services.limits.admit(principal)  # counts the request; its tokens are not known here
    upstream = services.upstream_for(principal)
    started = time.perf_counter()
    reply = await upstream.passthrough(
        request.method,
        path,
        request.scope.get("query_string", b""),
        {k.lower(): v for k, v in request.headers.items()},
        body,
    )
    request_info(request.scope).upstream_ms = (time.perf_counter() - started) * 1000
    return to_response(request, reply)
