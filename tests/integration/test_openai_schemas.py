"""Bodies the proxy writes itself conform to OpenAI's published schemas.

Errors the proxy raises, the echo upstream's completions and stream chunks, and the model list
it builds from an allow-list are validated against the official OpenAPI component schemas
(tests/data/openai-schemas.json, checked with tests/openapi_check.py). Bodies that come from an
upstream are that upstream's, passed through unchanged, and are tested where they are built.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from proxy.core.config import Config, ServerConfig, TimeoutConfig, UpstreamConfig
from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply, chat_reply
from tests.openapi_check import assert_openai_shape, openai_shape_errors

ServeProxy = Callable[[Config], str]
AUTH = {"authorization": f"Bearer {KEY}"}
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
MAX_BODY = 4_096
ALLOWED = ["echo", "gpt-4o-mini"]


@pytest.fixture
async def echo_proxy(serve_proxy: ServeProxy) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client for memproxy on the echo upstream (tenant t1 has an allow-list)."""
    config = make_config(UpstreamConfig(kind="echo"), models=ALLOWED).model_copy(
        update={"server": ServerConfig(max_body_bytes=MAX_BODY)}
    )
    base = serve_proxy(config).removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base) as http:
        yield http


def assert_openai_error(response: httpx.Response, status: int, code: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert_openai_shape("ErrorResponse", body)
    assert body["error"]["code"] == code
    assert body["error"]["message"]


ERROR_CASES: dict[str, tuple[str, str, dict[str, str], bytes, int, str | None]] = {
    "malformed_json": (
        "POST",
        "/v1/chat/completions",
        AUTH,
        b'{"model": "echo", "messages": [',
        400,
        None,
    ),
    "empty_body": ("POST", "/v1/chat/completions", AUTH, b"", 400, None),
    "body_not_an_object": ("POST", "/v1/chat/completions", AUTH, b"[1, 2]", 400, None),
    "missing_messages": ("POST", "/v1/chat/completions", AUTH, b'{"model": "echo"}', 400, None),
    "bad_role": (
        "POST",
        "/v1/chat/completions",
        AUTH,
        b'{"model": "echo", "messages": [{"role": "robot", "content": "hi"}]}',
        400,
        None,
    ),
    "no_key": ("POST", "/v1/chat/completions", {}, b"{}", 401, "invalid_api_key"),
    "wrong_key": (
        "GET",
        "/v1/models",
        {"authorization": "Bearer nope"},
        b"",
        401,
        "invalid_api_key",
    ),
    "chat_only_key_on_management_api": (
        "GET",
        "/v1/memory/conversations?user=u1",
        {"authorization": f"Bearer {CHAT_ONLY_KEY}"},
        b"",
        403,
        "insufficient_scope",
    ),
    "unknown_route": ("GET", "/no/such/route", AUTH, b"", 404, "not_found"),
    "model_not_allowed": (
        "POST",
        "/v1/chat/completions",
        AUTH,
        b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}',
        404,
        "model_not_found",
    ),
    "endpoint_unsupported_by_upstream": (
        "POST",
        "/v1/embeddings",
        AUTH,
        b'{"model": "m", "input": "x"}',
        404,
        "unsupported_endpoint",
    ),
    "wrong_method": ("DELETE", "/v1/chat/completions", AUTH, b"", 405, "method_not_allowed"),
    "too_large": (
        "POST",
        "/v1/chat/completions",
        AUTH,
        b'{"model": "echo", "messages": [{"role": "user", "content": "' + b"x" * MAX_BODY + b'"}]}',
        413,
        "request_too_large",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
async def test_proxy_errors_match_openai_error_schema(
    echo_proxy: httpx.AsyncClient, case: str
) -> None:
    method, path, headers, body, status, code = ERROR_CASES[case]
    response = await echo_proxy.request(method, path, headers=headers, content=body)
    assert_openai_error(response, status, code)
    assert response.headers["x-request-id"].startswith("req_")


async def test_unreachable_upstream_error_matches_openai_error_schema(
    serve_proxy: ServeProxy,
) -> None:
    # Bound but not listening: connections are refused, and no server started meanwhile can
    # be given the port (a closed socket's port could go to the proxy itself).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        upstream = UpstreamConfig(kind="openai", base_url=f"http://127.0.0.1:{port}/v1")
        async with httpx.AsyncClient() as http:
            response = await http.post(
                serve_proxy(make_config(upstream)) + "/chat/completions",
                headers=AUTH,
                json={"model": "gpt-4o-mini", "messages": HELLO},
            )
    assert_openai_error(response, 502, "upstream_unreachable")


async def test_upstream_timeout_error_matches_openai_error_schema(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    upstream = UpstreamConfig(kind="openai", base_url=upstream_url, timeout=TimeoutConfig(read=0.2))
    fake.script.append(Reply(body={"never": "seen"}, delay=1.0))
    async with httpx.AsyncClient() as http:
        response = await http.post(
            serve_proxy(make_config(upstream)) + "/chat/completions",
            headers=AUTH,
            json={"model": "gpt-4o-mini", "messages": HELLO},
        )
    assert_openai_error(response, 504, "upstream_timeout")


async def test_mid_stream_error_event_matches_openai_error_schema(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    upstream = chat_reply({"model": "gpt-4o-mini", "messages": HELLO, "stream": True})
    fake.script.append(Reply(chunks=upstream.chunks, die_after=1))
    url = serve_proxy(make_config(UpstreamConfig(kind="openai", base_url=upstream_url)))
    async with httpx.AsyncClient() as http:
        response = await http.post(
            url + "/chat/completions",
            headers=AUTH,
            json={"model": "gpt-4o-mini", "messages": HELLO, "stream": True},
        )
    last = [line for line in response.text.splitlines() if line.startswith("data: ")][-1]
    assert_openai_shape("ErrorResponse", json.loads(last.removeprefix("data: ")))


@pytest.mark.parametrize("n", [1, 2])
async def test_echo_completion_matches_openai_schema(echo_proxy: httpx.AsyncClient, n: int) -> None:
    response = await echo_proxy.post(
        "/v1/chat/completions",
        headers=AUTH,
        json={"model": "echo", "messages": HELLO, "n": n},
    )
    assert response.status_code == 200
    body = response.json()
    assert_openai_shape("CreateChatCompletionResponse", body)
    assert len(body["choices"]) == n


@pytest.mark.parametrize(
    "options",
    [{}, {"stream_options": {"include_usage": True}}, {"n": 2}],
    ids=["plain", "include_usage", "n_2"],
)
async def test_every_echo_stream_chunk_matches_openai_schema(
    echo_proxy: httpx.AsyncClient, options: dict[str, Any]
) -> None:
    payload = {"model": "echo", "messages": HELLO, "stream": True, **options}
    response = await echo_proxy.post("/v1/chat/completions", headers=AUTH, json=payload)
    assert response.status_code == 200
    data = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) > 2
    for chunk in chunks:
        assert_openai_shape("CreateChatCompletionStreamResponse", chunk)
    assert (chunks[-1]["choices"] == []) is ("stream_options" in options)


async def test_model_list_from_allow_list_matches_openai_schema(
    echo_proxy: httpx.AsyncClient,
) -> None:
    response = await echo_proxy.get("/v1/models", headers=AUTH)
    assert response.status_code == 200
    body = response.json()
    assert_openai_shape("ListModelsResponse", body)
    assert [m["id"] for m in body["data"]] == ALLOWED


async def test_echo_model_list_matches_openai_schema(echo_proxy: httpx.AsyncClient) -> None:
    response = await echo_proxy.get(
        "/v1/models", headers={"authorization": f"Bearer {OTHER_TENANT_KEY}"}
    )
    assert response.status_code == 200
    assert_openai_shape("ListModelsResponse", response.json())


def test_schema_check_is_not_vacuous() -> None:
    """The checker rejects what OpenAI's schemas reject, including through `$ref` and the
    spec's `nullable` fields."""
    error_without_code = {"error": {"message": "m", "type": "t", "param": None}}
    assert openai_shape_errors("ErrorResponse", error_without_code)
    chunk: dict[str, Any] = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
        "usage": None,
    }
    assert openai_shape_errors("CreateChatCompletionStreamResponse", chunk) == []
    bad_reason = {**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "done"}]}
    assert openai_shape_errors("CreateChatCompletionStreamResponse", bad_reason)
    bad_usage = {**chunk, "usage": {"prompt_tokens": "1"}}
    assert openai_shape_errors("CreateChatCompletionStreamResponse", bad_usage)
    no_refusal = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
    }
    assert openai_shape_errors("CreateChatCompletionResponse", no_refusal)
    with pytest.raises(KeyError):
        openai_shape_errors("NoSuchSchema", {})
