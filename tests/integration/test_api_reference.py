"""The API reference: the OpenAPI document declares every route's body, parameters,
responses and auth, and `/docs` works with no network (every asset from the server)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import msgspec
import pytest
from jsonschema import Draft202012Validator
from litestar.routes import HTTPRoute

from proxy.app import create_app
from proxy.core.config import Config, UpstreamConfig
from proxy.routes import api_types
from proxy.routes.reference import SCHEME
from tests.conftest import KEY, make_config

BODY_METHODS = {"POST", "PUT", "PATCH"}
# POSTs that take no body, as their OpenAI counterparts.
BODYLESS = {"/v1/responses/{response_id}/cancel", "/v1/memory/jobs/{job_id}/retry"}


@pytest.fixture
def server(serve_proxy: Callable[[Config], str]) -> str:
    """memproxy on echo; its root URL."""
    return serve_proxy(make_config(UpstreamConfig(kind="echo"))).removesuffix("/v1")


@pytest.fixture
def document(server: str) -> dict[str, Any]:
    reply = httpx.get(f"{server}/schema/openapi.json")
    assert reply.status_code == 200
    return dict(reply.json())


def _resolve(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/components/schemas/")
        node = document["components"]["schemas"][name]
    return node


def _properties(document: dict[str, Any], schema: dict[str, Any]) -> set[str]:
    """The fields an object schema declares, through `$ref` and `allOf`."""
    schema = _resolve(document, schema)
    found = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        found |= _properties(document, part)
    return found


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _operations() -> Iterator[tuple[str, str, Any, HTTPRoute]]:
    """(path as documented, method, handler, route) for every documented route."""
    app = create_app(make_config(UpstreamConfig(kind="echo")))
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            if handler.resolve_include_in_schema():
                yield route.path_format, method, handler, route


def test_every_route_declares_its_body_parameters_responses_and_scope(
    document: dict[str, Any],
) -> None:
    operations = list(_operations())
    assert len(operations) > 20
    for path, method, handler, route in operations:
        where = f"{method} {path}"
        operation = document["paths"][path][method.lower()]
        declared = {(p["in"], p["name"]) for p in operation.get("parameters", [])}
        for name in route.path_parameters:
            assert ("path", name) in declared, f"{where}: path parameter {name}"
        for name in handler.opt.get("query", ()):
            assert ("query", name) in declared, f"{where}: query parameter {name}"
        if method in BODY_METHODS and path not in BODYLESS:
            body = operation.get("requestBody")
            assert body is not None, f"{where}: no request body"
            for media_type, content in body["content"].items():
                fields = _properties(document, content["schema"])
                assert fields, f"{where}: the {media_type} body declares no fields"
        scope = handler.opt.get("scope")
        if scope is not None:
            assert operation["security"] == [{SCHEME: [scope]}], where
            error = operation["responses"]["401"]["content"]["application/json"]["schema"]
            envelope = _resolve(document, error)
            details = _resolve(document, envelope["properties"]["error"])
            shape = {"message", "type", "param", "code"}
            if path.startswith("/v1/messages"):  # (Anthropic's API: its own envelope)
                shape = {"type", "message"}
            assert set(details["properties"]) == shape, where
        success = [s for s in operation["responses"] if s.startswith("2")]
        assert success, f"{where}: no success response"
        for status in success:
            for content in operation["responses"][status].get("content", {}).values():
                assert content["schema"] != {}, f"{where}: {status} has an empty schema"


def test_auth_schemes_and_every_reference_resolve(document: dict[str, Any]) -> None:
    scheme = document["components"]["securitySchemes"][SCHEME]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    assert "chat" in scheme["description"] and "manage" in scheme["description"]
    schemas = document["components"]["schemas"]
    for ref in set(_refs(document)):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_chat_completions_documents_openais_request_and_memproxys_extensions(
    document: dict[str, Any],
) -> None:
    operation = document["paths"]["/v1/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    fields = _properties(document, body)
    assert {"model", "messages", "tools", "tool_choice", "response_format"} <= fields
    assert "attachments" in fields
    headers = {p["name"] for p in operation["parameters"] if p["in"] == "header"}
    assert {"X-Memory-User-Id", "X-Memory-Conversation-Id", "X-Memory-Mode"} <= headers
    ok = operation["responses"]["200"]
    assert set(ok["content"]) == {"application/json", "text/event-stream"}
    assert "x-memory-conversation-id" in ok["headers"]


def test_openais_schemas_are_shipped_whole_and_never_shadowed(document: dict[str, Any]) -> None:
    """A name in both OpenAI's schemas and memproxy's types would show one where the other
    is meant."""
    text = resources.files("proxy.routes").joinpath("openai-schemas.json").read_text()
    openai = set(json.loads(text)["components"]["schemas"])
    ours = {
        name
        for name, value in vars(api_types).items()
        if isinstance(value, type) and issubclass(value, msgspec.Struct)
    }
    assert not openai & ours
    assert openai <= set(document["components"]["schemas"])


def _validator(document: dict[str, Any], name: str) -> Draft202012Validator:
    root = {"components": document["components"], "$ref": f"#/components/schemas/{name}"}
    return Draft202012Validator(root)


def test_replies_match_their_documented_schemas(server: str, document: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, headers=headers) as client:
        created = client.post(
            "/v1/memory/conversations",
            json={"user": "ann", "messages": [{"role": "user", "content": "hi"}]},
        )
        memory = client.post("/v1/memory/memories", json={"user": "ann", "text": "I like tea"})
        replies = {
            "Conversation": created,
            "MessageList": client.get(f"/v1/memory/conversations/{created.json()['id']}/messages"),
            "Memory": memory,
            "MemoryList": client.get("/v1/memory/memories", params={"user": "ann"}),
            "ErrorResponse": client.get("/v1/memory/memories/nope"),
            "Limits": client.get("/v1/memory/limits"),
        }
    for name, reply in replies.items():
        errors = [e.message for e in _validator(document, name).iter_errors(reply.json())]
        assert not errors, f"{name}: {errors}"


_ASSET = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


@pytest.mark.parametrize("page", ["/docs", "/schema"])
def test_the_viewer_loads_everything_from_the_server_itself(server: str, page: str) -> None:
    with httpx.Client(base_url=server) as client:
        reply = client.get(page)
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/html")
        html = reply.text
        assets = _ASSET.findall(html)
        assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
        document_url = re.search(r'"url": "([^"]+)"', html)
        assert document_url is not None
        for url in [*assets, document_url.group(1)]:
            absolute = urljoin(server + page, url)
            assert urlsplit(absolute).netloc == urlsplit(server).netloc, url
            fetched = client.get(absolute)
            assert fetched.status_code == 200 and fetched.content, url
        assert "http://" not in html.replace(server, "") and "https://" not in html
