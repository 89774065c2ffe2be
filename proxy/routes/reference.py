"""The API reference: what each route declares in the OpenAPI document, and `/docs`.

Handlers parse their own bodies and query strings (their own checks and error messages,
unknown fields refused by name), so the document cannot learn those from their signatures.
`api()` gives a route decorator everything else instead, from one place:

    @post("/v1/memory/memories", summary="Create a memory", status_code=201,
          **api("manage", body=CreateMemoryRequest, ok=Memory))

- `opt`: the scope the key needs and the query parameters the route reads (any other is a
  400: see proxy/deps.py), so what is documented is what is enforced;
- `security`: the bearer key, with the scope as its role;
- `responses`: the success body (`ResponseSpec`) and the error envelope for each error status;
- `operation_class`: an `Operation` that adds the request body and the query parameters.

Litestar puts into `components.schemas` only the schemas it generated itself (those of
signatures and `ResponseSpec`s), dropping any given in `OpenAPIConfig`; the request bodies'
schemas (msgspec's) and OpenAI's own (shipped in openai-schemas.json, from the official spec)
are added when the document is served (`DocumentPlugin`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import msgspec
from litestar import Request, get
from litestar.enums import MediaType
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Parameter,
    Reference,
    RequestBody,
    Schema,
    SecurityScheme,
)
from litestar.openapi.spec.enums import OpenAPIType
from litestar.router import Router
from litestar.static_files import create_static_files_router
from swagger_ui_bundle import swagger_ui_path

from proxy.core.config import Scope
from proxy.routes.api_types import REQUEST_BODIES, ErrorResponse

SCHEME = "apiKey"
MANAGE: dict[str, Any] = {"scope": "manage"}  # a management route taking no query parameters


def manage(*query: str) -> dict[str, Any]:
    """A management route's `opt`, naming the query parameters it reads: any other is a 400
    (a filter misspelt, or one the route does not have, is not left out unnoticed)."""
    return {**MANAGE, "query": query}


ASSETS = "/docs/assets"
_REF = "#/components/schemas/{name}"

# What each error status means on this API (the body is always the error envelope).
ERRORS = {
    400: "The body, a parameter or a header is invalid (`param` names it).",
    401: "No key, or one this server does not know.",
    403: "The key lacks the route's scope.",
    404: "Unknown id, or another tenant's.",
    409: "The id is taken.",
    413: "The body is larger than the server accepts.",
    415: "A content type the route cannot read.",
    429: "A rate limit or budget of the tenant is reached (see `retry-after`).",
    502: "The upstream could not be reached.",
    503: "Storage is down and the tenant fails closed, or the server is shutting down.",
    504: "The upstream did not answer in time.",
}
MANAGE_ERRORS = (400, 401, 403, 404, 429, 503)
CHAT_ERRORS = (400, 401, 403, 404, 413, 429, 502, 503, 504)


def _query(name: str, description: str, schema: Schema, *, required: bool = False) -> Parameter:
    return Parameter(
        name=name, param_in="query", description=description, schema=schema, required=required
    )


_STRING = Schema(type=OpenAPIType.STRING)
# Every query parameter of the management API. A route lists those it reads in `api(query=)`.
QUERY: dict[str, Parameter] = {
    p.name: p
    for p in (
        _query(
            "user",
            "Only this end user's (1-256 characters, not `.` or `..`).",
            Schema(type=OpenAPIType.STRING, min_length=1, max_length=256, pattern=r"^(?!\.\.?$)"),
        ),
        _query(
            "limit",
            "Page size.",
            Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=100, default=20),
        ),
        _query("after", "The next page: the `last_id` of the page before.", _STRING),
        _query(
            "order",
            "Oldest first (asc) or newest first (desc, the default).",
            Schema(type=OpenAPIType.STRING, enum=["asc", "desc"]),
        ),
        _query(
            "pinned",
            "Only pinned (true) or unpinned (false) ones.",
            Schema(type=OpenAPIType.BOOLEAN),
        ),
        _query(
            "q",
            "Search: memories holding these words, best match first; users whose id holds "
            "this text.",
            _STRING,
        ),
        _query(
            "status",
            "Only jobs in this state.",
            Schema(type=OpenAPIType.STRING, enum=["queued", "running", "done", "dead"]),
        ),
        _query("kind", "Only jobs of this kind (e.g. `extract`).", _STRING),
        _query("subject", "Only jobs about this (e.g. an exchange's request id).", _STRING),
        _query(
            "from", "Start (ISO 8601 or Unix seconds); 30 days before `to` by default.", _STRING
        ),
        _query("to", "End, excluded (ISO 8601 or Unix seconds); now by default.", _STRING),
        _query(
            "group_by",
            "Totals per model, user, day or intent (else only the total).",
            Schema(type=OpenAPIType.STRING, enum=["model", "user", "day", "intent"]),
        ),
    )
}

# The request extensions of DESIGN.md: headers every chat route reads.
CHAT_HEADERS = [
    Parameter(
        name="X-Memory-User-Id",
        param_in="header",
        description=(
            "The end user whose memory this is (else the body's `user`), trusted as given in "
            "header mode; a key bound to a user accepts only that user (else 403); refused "
            "(400) in token mode. See the trust model in the docs."
        ),
        schema=_STRING,
    ),
    Parameter(
        name="X-Memory-User-Token",
        param_in="header",
        description=(
            "Token mode: a JWT signed by the application's backend whose `sub` is the user "
            "(`exp` required); without a valid one the request is 401 `invalid_user_token`."
        ),
        schema=_STRING,
    ),
    Parameter(
        name="X-Memory-Conversation-Id",
        param_in="header",
        description="The conversation (else found by the messages' prefix, or a new one).",
        schema=Schema(type=OpenAPIType.STRING, pattern="^[A-Za-z0-9._:-]{1,128}$"),
    ),
    Parameter(
        name="X-Memory-Mode",
        param_in="header",
        description="full: attach and store; read: attach, store no messages; off: neither.",
        schema=Schema(type=OpenAPIType.STRING, enum=["full", "read", "off"], default="full"),
    ),
    Parameter(
        name="Idempotency-Key",
        param_in="header",
        description="A retried request with the same key is not stored twice.",
        schema=_STRING,
    ),
]

TURN_HEADERS = {
    "x-request-id": "The proxy's id for this exchange (see /v1/memory/exchanges/{id}).",
    "x-memory-conversation-id": "The conversation the exchange was stored in.",
    "x-memory-context-tokens": "Tokens the proxy added (history, recall, memories, documents).",
    "x-memory-history-messages": "Stored messages attached.",
    "x-memory-memories": "Recalled turns and memories attached.",
    "x-memory-attachments": "Documents attached.",
    "x-memory-intent": "label;confidence;method of the new user turn.",
    "x-memory-status": "ok, or degraded when memory was skipped.",
    "x-memory-stored": "Only as false: neither the database nor the spill could keep the turn.",
    "x-usage-prompt-tokens": "From the upstream's usage.",
    "x-usage-completion-tokens": "From the upstream's usage.",
    "x-cost-usd": "Upstream cost plus the proxy's own model calls, or unknown.",
}


def ref(name: str) -> Reference:
    return Reference(ref=_REF.format(name=name))


def json_body(schema: Schema | Reference, description: str | None = None) -> RequestBody:
    return RequestBody(
        content={"application/json": OpenAPIMediaType(schema=schema)},
        description=description,
        required=True,
    )


def _body(body: type[msgspec.Struct] | RequestBody | None) -> RequestBody | None:
    if body is None or isinstance(body, RequestBody):
        return body
    return json_body(ref(body.__name__))


def _operation(
    body: RequestBody | None,
    parameters: Sequence[Parameter],
    ok: tuple[str, OpenAPIResponse] | None,
) -> type[Operation]:
    """An `Operation` that adds what Litestar cannot see in the handler's signature."""

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            if body is not None:
                self.request_body = body
            if parameters:
                self.parameters = [*(self.parameters or []), *parameters]
            if ok is not None and self.responses is not None:
                self.responses[ok[0]] = ok[1]

    return Documented


def error_specs(statuses: Sequence[int]) -> dict[int, ResponseSpec]:
    return {
        status: ResponseSpec(
            data_container=ErrorResponse, description=ERRORS[status], generate_examples=False
        )
        for status in statuses
    }


def api(
    scope: Scope,
    *,
    query: Sequence[str] = (),
    body: type[msgspec.Struct] | RequestBody | None = None,
    ok: Any = None,
    status: int = 200,
    ok_description: str = "OK",
    ok_response: OpenAPIResponse | None = None,
    errors: Sequence[int] | None = None,
    headers: Sequence[Parameter] = (),
) -> dict[str, Any]:
    """A route decorator's keyword arguments: its scope and query parameters (`opt`, enforced),
    and what the OpenAPI document says of it. `ok` is the success body's type (a
    `ResponseSpec`); `ok_response` a whole success response instead (OpenAI's shapes)."""
    opt = manage(*query) if scope == "manage" else {"scope": scope}
    responses: dict[int, ResponseSpec] = error_specs(
        errors if errors is not None else (CHAT_ERRORS if scope == "chat" else MANAGE_ERRORS)
    )
    if ok is not None:
        responses[status] = ResponseSpec(
            data_container=ok, description=ok_description, generate_examples=False
        )
    parameters = [*headers, *(QUERY[name] for name in query)]
    success = None if ok_response is None else (str(status), ok_response)
    return {
        "opt": opt,
        "security": [{SCHEME: [scope]}],
        "responses": responses,
        "operation_class": _operation(_body(body), parameters, success),
    }


def openai_response(name: str, description: str, *, stream: str | None = None) -> OpenAPIResponse:
    """A success response whose body is OpenAI's schema `name` (with its SSE form when the
    route streams), carrying the turn's headers when it is a chat turn."""
    content = {"application/json": OpenAPIMediaType(schema=ref(name))}
    if stream is not None:
        content["text/event-stream"] = OpenAPIMediaType(
            schema=Schema(
                type=OpenAPIType.STRING,
                description=f"With `stream: true`: `data:` lines, each a {stream}, then "
                "`data: [DONE]`.",
            )
        )
    return OpenAPIResponse(
        description=description,
        content=content,
        headers={
            name: OpenAPIHeader(schema=_STRING, description=text)
            for name, text in TURN_HEADERS.items()
        }
        if stream is not None
        else None,
    )


@cache
def shipped_schemas() -> dict[str, Any]:
    """Component schemas Litestar does not generate: OpenAI's (from the official spec) and
    the request bodies'."""
    text = resources.files("proxy.routes").joinpath("openai-schemas.json").read_text()
    schemas: dict[str, Any] = json.loads(text)["components"]["schemas"]
    _, ours = msgspec.json.schema_components(REQUEST_BODIES, ref_template=_REF)
    return {**schemas, **ours}


def completed(document: dict[str, Any]) -> dict[str, Any]:
    """Litestar's document with the shipped component schemas added (its own win a clash)."""
    components = document.get("components") or {}
    schemas = {**shipped_schemas(), **(components.get("schemas") or {})}
    return {**document, "components": {**components, "schemas": schemas}}


class DocumentPlugin(JsonRenderPlugin):
    """`/schema/openapi.json`: the whole document (see `completed`)."""

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        return self.render_json(request, completed(openapi_schema))


def viewer_page(document_url: str, title: str) -> bytes:
    """Swagger UI, every asset from this server (the swagger-ui-bundle-v2 package's files)."""
    config = json.dumps(
        {
            "url": document_url,
            "dom_id": "#swagger-ui",
            "deepLinking": True,
            "validatorUrl": None,  # (else it sends the document to swagger.io to check)
            "tryItOutEnabled": False,
        }
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" type="image/png" href="{ASSETS}/favicon-32x32.png">
<link rel="stylesheet" href="{ASSETS}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{ASSETS}/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({config});</script>
</body>
</html>
""".encode()


class ViewerPlugin(OpenAPIRenderPlugin):
    """`/schema`: the same viewer as `/docs`."""

    def __init__(self) -> None:
        super().__init__(path=["/", "/swagger"], media_type=MediaType.HTML, favicon="")

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        return viewer_page(self.get_openapi_json_route(request), openapi_schema["info"]["title"])


@get("/docs", media_type=MediaType.HTML, include_in_schema=False, sync_to_thread=False)
def docs(request: Request[Any, Any, Any]) -> bytes:
    """The interactive API reference, offline."""
    return viewer_page(OpenAPIRenderPlugin.get_openapi_json_route(request), "memproxy API")


def docs_router() -> Router:
    """`/docs` and the viewer's files."""
    assets = create_static_files_router(
        path=ASSETS, directories=[swagger_ui_path], include_in_schema=False
    )
    return Router("/", route_handlers=[docs, assets], include_in_schema=False)


def openapi_config(version: str) -> OpenAPIConfig:
    return OpenAPIConfig(
        title="memproxy",
        version=version,
        description=(
            "An OpenAI-compatible proxy that gives any chat application memory. Point an "
            "OpenAI SDK at `/v1`; manage what was stored under `/v1/memory/`. Keys are "
            "sent as `Authorization: Bearer <key>`; a key has the scope `chat` (the OpenAI "
            "endpoints), `manage` (the management API) or both."
        ),
        path="/schema",
        render_plugins=[ViewerPlugin(), DocumentPlugin()],
        components=Components(
            security_schemes={
                SCHEME: SecurityScheme(
                    type="http",
                    scheme="bearer",
                    description="A tenant's API key (config.yaml `tenants.<name>.api_keys`). "
                    "Scopes: `chat` for the OpenAI endpoints, `manage` for /v1/memory/; "
                    "a key given as a plain string has both.",
                )
            }
        ),
    )
