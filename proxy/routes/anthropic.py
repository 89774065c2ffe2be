"""Anthropic's Messages API: `POST /v1/messages` (the turn, with memory) and
`POST /v1/messages/count_tokens`.

The proxy key comes in `x-api-key` (as Anthropic's SDKs send it) or `Authorization: Bearer`;
`anthropic-version` and `anthropic-beta` are accepted. Errors are in Anthropic's shape
(proxy/protocols/anthropic/errors.py). Scope `chat`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Reference, Schema
from litestar.openapi.spec.enums import OpenAPIType

from policies.tokens import count_messages, count_text
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest
from proxy.core.json_responses import json_response
from proxy.core.requests import check_count, parse_json_object
from proxy.pipeline.exchange import TurnExchange, answer_turn
from proxy.pipeline.identify import TurnRequest
from proxy.protocols.anthropic.adapter import MessagesAPI
from proxy.protocols.anthropic.errors import ANTHROPIC_ERRORS
from proxy.protocols.anthropic.request import check_request
from proxy.protocols.anthropic.to_chat import chat_messages
from proxy.routes.openai import answer_turn_request, check_model
from proxy.routes.reference import CHAT_HEADERS, ERRORS, api, json_body
from proxy.state import AppState

_OBJECT = Schema(type=OpenAPIType.OBJECT)
_ANY = Schema(description="As Anthropic's Messages API defines it.")


def _body(*, turn: bool) -> Schema:
    """Anthropic's request, as far as memproxy reads it (the API's own reference has the
    rest); `turn`: a message's (else count_tokens', which takes no sampling fields)."""
    fields: dict[str, Schema | Reference] = {
        "model": Schema(type=OpenAPIType.STRING),
        "messages": Schema(type=OpenAPIType.ARRAY, items=_OBJECT),
        "system": _ANY,
        "tools": Schema(type=OpenAPIType.ARRAY, items=_OBJECT),
        "tool_choice": _OBJECT,
        "metadata": Schema(
            type=OpenAPIType.OBJECT,
            properties={"user_id": Schema(type=OpenAPIType.STRING)},
            description="`user_id` names the memory user when no X-Memory-User-Id does.",
        ),
    }
    if not turn:
        return Schema(type=OpenAPIType.OBJECT, properties=fields, required=["model", "messages"])
    fields |= {
        "max_tokens": Schema(type=OpenAPIType.INTEGER, minimum=1),
        "stream": Schema(type=OpenAPIType.BOOLEAN),
        "stop_sequences": Schema(type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.STRING)),
        "temperature": Schema(type=OpenAPIType.NUMBER),
        "top_p": Schema(type=OpenAPIType.NUMBER),
        "attachments": Schema(
            type=OpenAPIType.ARRAY, items=_OBJECT, description="memproxy's documents extension."
        ),
    }
    required = ["model", "max_tokens", "messages"]
    return Schema(type=OpenAPIType.OBJECT, properties=fields, required=required)


@dataclass
class AnthropicErrorDetail:
    type: str
    message: str


@dataclass
class AnthropicError:
    """Anthropic's error envelope, which every error on these routes has."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def _anthropic(body: Schema, description: str, ok: str) -> dict[str, Any]:
    spec = api(
        "chat",
        body=json_body(body, description),
        headers=CHAT_HEADERS,
        ok_response=OpenAPIResponse(
            description=ok, content={"application/json": OpenAPIMediaType(schema=_OBJECT)}
        ),
    )
    spec["responses"] = {
        status: ResponseSpec(
            data_container=AnthropicError, description=ERRORS[status], generate_examples=False
        )
        for status in spec["responses"]
    }
    # The key may come as `x-api-key` here (proxy/deps.py).
    spec["opt"] = {**spec["opt"], "x_api_key": True}
    return spec


@post(
    "/v1/messages",
    status_code=200,
    summary="Create a message (Anthropic Messages API)",
    exception_handlers=ANTHROPIC_ERRORS,
    **_anthropic(
        _body(turn=True),
        "Anthropic's Messages request; `metadata.user_id` names the memory user.",
        "The message, or with `stream: true` its events as server-sent events.",
    ),
)
async def create_message(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    body = parse_json_object(await request.body())
    check_request(body)
    check_count(body["messages"], "messages", services.config.server.max_request_messages)
    return await answer_turn_request(request, principal, services, body, message_turn)


async def message_turn(
    request: Request[Any, Any, Any], principal: Principal, services: AppState, body: dict[str, Any]
) -> Response[Any]:
    native = services.upstream_for(principal).kind == "anthropic"
    wire = MessagesAPI(body, native=native, headers=request.headers)
    return await answer_turn(request, principal, services, wire, wire.neutral())


@post(
    "/v1/messages/count_tokens",
    status_code=200,
    summary="Count the tokens of a Messages request",
    exception_handlers=ANTHROPIC_ERRORS,
    **_anthropic(
        _body(turn=False), "What a Messages request would send.", '`{"input_tokens": n}`.'
    ),
)
async def count_tokens(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    """What the request would send now, counted with tiktoken as the translation to chat
    completions sends it: the system prompt, the proxy's context (history, recall, memories,
    documents: the turn pipeline's read stages, run without storing anything), the messages
    and the tools' definitions."""
    body = parse_json_object(await request.body())
    body.setdefault("max_tokens", 1)  # (count_tokens takes none)
    check_request(body)
    check_model(principal, body["model"])
    body.pop("attachments", None)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools: expected an array.", param="tools")
    native = services.upstream_for(principal).kind == "anthropic"
    wire = MessagesAPI(body, native=native, headers=request.headers)
    turn = TurnRequest.of(request, principal, services, wire.neutral(), dry_run=True)
    messages = chat_messages(await TurnExchange(turn, wire).prompt())

    def count() -> int:
        total = count_messages(messages, body["model"])
        for tool in tools or []:
            total += count_text(msgspec.json.encode(tool).decode(), body["model"])
        return total

    return json_response({"input_tokens": await asyncio.to_thread(count)})


ROUTES = [create_message, count_tokens]
