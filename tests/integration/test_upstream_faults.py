"""Upstream faults through the real server and the official SDK (which retries nothing here):
429 and 5xx pass through with their retry headers; with `retries` on, what failed before
anything reached the client is tried again (a 503, a refused connection) and what is an answer
(a 400, a 429 asking for a long wait) is not; the circuit breaker fails fast with a 503 and
`retry-after` once an upstream keeps failing, without calling it."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import openai
import pytest

from proxy.core.config import BreakerConfig, RetryConfig, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply, error_reply

ASK = [{"role": "user", "content": "hello"}]


def start(
    serve_proxy: Callable[..., str], base_url: str, sdk_retries: int = 0, **settings: Any
) -> openai.AsyncOpenAI:
    """memproxy in front of `base_url` (the upstream's `settings`), and an SDK client of it
    that retries `sdk_retries` times."""
    upstream = UpstreamConfig(kind="openai", base_url=base_url, api_key="k", **settings)
    return openai.AsyncOpenAI(
        base_url=serve_proxy(make_config(upstream)), api_key=KEY, max_retries=sdk_retries
    )


QUICK = RetryConfig(attempts=2, backoff_ms=10, max_backoff_ms=1000)


async def test_errors_pass_through_with_their_retry_headers_when_retries_are_off(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    fake, url = fake_upstream
    sdk = start(serve_proxy, url)
    fake.script = [
        error_reply(429, "slow down", "rate_limit_error", **{"retry-after": "7"}),
        error_reply(503, "overloaded", "server_error", **{"retry-after-ms": "1500"}),
    ]
    with pytest.raises(openai.RateLimitError) as limited:
        await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert limited.value.response.headers["retry-after"] == "7"
    with pytest.raises(openai.InternalServerError) as overloaded:
        await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert overloaded.value.status_code == 503
    assert overloaded.value.response.headers["retry-after-ms"] == "1500"
    assert len(fake.chat_requests) == 2  # each tried once
    await sdk.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retryable_failure_is_tried_again_before_anything_reaches_the_client(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str], stream: bool
) -> None:
    fake, url = fake_upstream
    sdk = start(serve_proxy, url, retries=QUICK)
    fake.script = [error_reply(503, "overloaded", "server_error"), error_reply(500, "oops")]
    if stream:
        chunks = await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    else:
        reply = await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
        text = reply.choices[0].message.content or ""
    assert text.strip() == "fake reply to: hello"
    assert len(fake.chat_requests) == 3
    await sdk.close()


async def test_answers_are_not_retried(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    fake, url = fake_upstream
    sdk = start(serve_proxy, url, retries=QUICK)
    fake.script = [
        error_reply(400, "bad request"),
        error_reply(429, "come back later", "rate_limit_error", **{"retry-after": "120"}),
    ]
    with pytest.raises(openai.BadRequestError):
        await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    with pytest.raises(openai.RateLimitError) as limited:  # longer than max_backoff_ms
        await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert limited.value.response.headers["retry-after"] == "120"
    assert len(fake.chat_requests) == 2
    await sdk.close()


async def test_a_connection_dropped_before_the_head_is_tried_again_then_a_502(
    serve_proxy: Callable[..., str],
) -> None:
    # An upstream that takes each connection and closes it at once, counting them.
    accepted = 0
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        stop = threading.Event()

        def hang_up() -> None:
            nonlocal accepted
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn, _ = listener.accept()
                    conn.close()
                    accepted += 1

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        sdk = start(serve_proxy, url, retries=QUICK)
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
        finally:
            stop.set()
            thread.join()
            await sdk.close()
    assert caught.value.status_code == 502
    assert caught.value.response.json()["error"]["code"] == "upstream_unreachable"
    # Each try: the connection, and once more on a fresh one (a dropped keep-alive connection
    # is reopened once by the openai upstream itself).
    assert accepted == 2 * (1 + QUICK.attempts)


async def test_the_breaker_fails_fast_once_an_upstream_keeps_failing(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    fake, url = fake_upstream
    sdk = start(serve_proxy, url, breaker=BreakerConfig(failures=3, open_seconds=60))
    fake.script = [error_reply(502, "bad gateway", "server_error")] * 3
    for _ in range(3):
        with pytest.raises(openai.InternalServerError):
            await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert len(fake.chat_requests) == 3
    with pytest.raises(openai.APIStatusError) as caught:
        await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert caught.value.status_code == 503
    assert caught.value.response.json()["error"]["code"] == "upstream_circuit_open"
    assert 0 < int(caught.value.response.headers["retry-after"]) <= 60
    assert len(fake.chat_requests) == 3  # not called while open
    # Other endpoints are not held back by it.
    models = await sdk.models.list()
    assert [m.id async for m in models]
    await sdk.close()


async def test_client_errors_never_open_the_circuit(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    fake, url = fake_upstream
    sdk = start(serve_proxy, url, breaker=BreakerConfig(failures=2))
    fake.script = [error_reply(400, "bad")] * 3 + [error_reply(429, "slow", "rate_limit_error")]
    for _ in range(4):
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
        assert caught.value.status_code in (400, 429)
    reply = await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK)
    assert reply.choices[0].message.content
    await sdk.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_error_body_not_in_openais_shape_reaches_the_client_in_it(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str], stream: bool
) -> None:
    # A gateway in front of the model answers for it: HTML, plain text, someone else's JSON.
    fake, url = fake_upstream
    sdk = start(serve_proxy, url)
    gateway = {"content-type": "text/html", "retry-after": "2"}
    fake.script = [
        Reply(status=502, body=b"<html><h1>502 Bad Gateway</h1></html>", headers=gateway),
        Reply(status=500, body={"error": "boom"}),
        Reply(status=503, body=b""),
    ]
    for status, said in [(502, "<html><h1>502 Bad Gateway</h1></html>"), (500, "boom"), (503, "")]:
        with pytest.raises(openai.APIStatusError) as failed:
            await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK, stream=stream)
        error = failed.value.response.json()["error"]
        assert failed.value.status_code == status
        assert (error["type"], error["code"]) == ("upstream_error", "upstream_error")
        assert error["message"].startswith(f"Upstream 'main' answered {status}")
        assert said in error["message"]
        headers = failed.value.response.headers
        assert headers["content-type"] == "application/json"
        assert headers.get("retry-after") == ("2" if status == 502 else None)
    # An error object at the top level (older vLLM's) is nested, its text fields kept.
    top_level = {"object": "error", "message": "no such model", "type": "NotFound", "code": 404}
    fake.script = [Reply(status=404, body=top_level)]
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK, stream=stream)
    error = missing.value.response.json()["error"]
    assert error == {
        "message": "no such model",
        "type": "NotFound",
        "param": None,
        "code": "upstream_error",
    }
    await sdk.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_redirect_is_a_502_saying_where_not_followed_by_the_client(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str], stream: bool
) -> None:
    # (The SDK follows redirects: passed on, it would go past the proxy, or back to it.)
    fake, url = fake_upstream
    # The SDK's own retries on (2, its default): the answer tells it not to.
    breaker = BreakerConfig(failures=1, open_seconds=3600)
    sdk = start(serve_proxy, url, sdk_retries=2, retries=QUICK, breaker=breaker)
    moved = {"location": "https://api.example.com/v1/chat/completions"}
    fake.script = [Reply(status=308, body=b"", headers=moved) for _ in range(2)]
    for asked in (1, 2):
        with pytest.raises(openai.APIStatusError) as failed:
            await sdk.chat.completions.create(model="gpt-4o-mini", messages=ASK, stream=stream)
        error = failed.value.response.json()["error"]
        # Not "failing" either: the circuit would hide what to change behind a 503.
        assert (failed.value.status_code, error["code"]) == (502, "upstream_redirect")
        assert "https://api.example.com/v1/chat/completions" in error["message"]
        assert "base_url" in error["message"]
        # Asked once each time, by neither memproxy nor the SDK again (the same would come).
        assert len(fake.chat_requests) == asked
    await sdk.close()
