"""Any OpenAI-compatible HTTP API, spoken through the app's shared httpx client."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import structlog

from proxy.core.config import UpstreamConfig
from proxy.core.errors import (
    UpstreamError,
    UpstreamRedirect,
    UpstreamTimeout,
    UpstreamUnreachable,
    error_body,
)
from proxy.upstream.base import UpstreamReply
from proxy.upstream.headers import passthrough_headers

log = structlog.get_logger("memproxy.upstream")
# Request headers a client may set that the provider should still see.
_FORWARD = ("content-type", "accept", "openai-beta", "idempotency-key")
_PATH_SAFE = "/:@!$&'()*+,;="  # besides letters, digits and -._~


def map_transport_error(exc: httpx.HTTPError, upstream: str) -> UpstreamError:
    """Translate httpx's failures into the proxy's (502 unreachable / 504 timeout)."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"Upstream {upstream!r} timed out ({type(exc).__name__}).")
    return UpstreamUnreachable(f"Upstream {upstream!r} is unreachable ({type(exc).__name__}).")


class OpenAIUpstream:
    kind = "openai"
    reports_sent = True

    def __init__(self, name: str, config: UpstreamConfig, client: httpx.AsyncClient) -> None:
        self.name = name
        self.stream_usage = config.stream_usage
        self._client = client
        self._base = config.base_url or "https://api.openai.com/v1"
        self._auth = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        timeout = httpx.Timeout(config.timeout.read, connect=config.timeout.connect)
        self._timeout = {"timeout": timeout.as_dict()}  # (the request extension)
        # The request as `build_request` would make it (the client's default headers under
        # ours), made directly: merging each request's URL, headers and cookies with the
        # client's cost a quarter of a millisecond of the proxy's own time on every call.
        self._defaults = dict(client.headers)

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        return await self._post("/chat/completions", body, stream, sent)

    async def responses(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        return await self._post("/responses", body, stream, sent)

    async def _post(
        self,
        path: str,
        body: dict[str, Any],
        stream: bool,
        sent: Callable[[], None] | None,
    ) -> UpstreamReply:
        """A request memproxy itself makes (a JSON body), its reply readable by a client."""
        headers = {"content-type": "application/json", **self._auth}
        if stream:
            headers["accept"] = "text/event-stream"
        reply = await self._send(
            "POST", path, b"", headers, msgspec.json.encode(body), stream, sent
        )
        return self._readable(reply)

    async def list_models(self) -> UpstreamReply:
        return self._readable(await self._send("GET", "/models", b"", dict(self._auth), b"", False))

    def _readable(self, reply: UpstreamReply) -> UpstreamReply:
        """A reply to what memproxy itself asks, as an OpenAI client can read it.

        - A redirect is a 502 naming where it points, which the client's SDK is told not to
          retry: memproxy follows none (the upstream's `base_url` is what to change), and
          passed on, the SDK would follow it past the proxy, or back to it for a second turn.
        - An error status whose body is not OpenAI's error object gets one: a top-level error
          (`{"message", "type", "code"}`, as older vLLM sends) nested, anything else (a
          gateway's HTML page, plain text) as the upstream's status and the start of its text.
        """
        if 300 <= reply.status < 400:
            where = reply.headers.get("location")
            raise UpstreamRedirect(
                f"Upstream {self.name!r} answered {reply.status}"
                + (f", a redirect to {where[:300]!r}" if where else "")
                + "; memproxy follows no redirects: check the upstream's base_url.",
                headers={"x-should-retry": "false"},
            )
        if reply.status < 400 or reply.chunks is not None:
            return reply
        body = _openai_error(reply.body or b"", f"Upstream {self.name!r} answered {reply.status}")
        return reply if body is None else UpstreamReply(reply.status, reply.headers, body=body)

    async def embeddings(self, body: dict[str, Any]) -> UpstreamReply:
        """The proxy's own embeddings request (recall), read whole."""
        headers = {"content-type": "application/json", **self._auth}
        return await self._send(
            "POST", "/embeddings", b"", headers, msgspec.json.encode(body), False
        )

    async def passthrough(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: Mapping[str, str],
        body: bytes,
    ) -> UpstreamReply:
        forwarded = {k: headers[k] for k in _FORWARD if k in headers}
        forwarded.update(self._auth)
        return await self._send(method, path, query, forwarded, body, None)

    async def aclose(self) -> None:
        pass  # the shared client belongs to the app

    async def _send(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: dict[str, str],
        content: bytes,
        stream: bool | None,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        """Send and wait for the response head; `stream=None` streams whatever comes back."""
        # The path as sent: percent-encoded again (the route has it decoded), so nothing in it
        # reads as a query, a fragment or a dot segment (the passthrough also refuses those).
        url = _parsed(self._base + quote(path, safe=_PATH_SAFE))
        if query:  # (a client's query string is not kept in the cache)
            url = url.copy_with(query=query)
        extensions: dict[str, Any] = {**self._timeout}  # (its own: httpcore may add to it)
        if sent is not None:
            extensions["trace"] = _when_sent(sent)
        request = httpx.Request(
            method,
            url,
            headers={**self._defaults, **headers},
            content=content,
            extensions=extensions,
        )
        try:
            try:
                response = await self._client.send(request, stream=True)
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # Most often a pooled keep-alive connection the server closed just as the
                # request went out (its idle timeout): nothing reached it, so once more (a new
                # connection). Measured: 2 in 21,000 streamed requests under load without this.
                log.info("upstream_reconnect", upstream=self.name)
                response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.name) from exc
        out_headers = passthrough_headers(response.headers.multi_items())
        media_type = response.headers.get("content-type", "application/json")
        relay = (stream is True and 200 <= response.status_code < 300) or stream is None
        if not relay:
            try:
                data = await response.aread()
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, self.name) from exc
            finally:
                await response.aclose()
            return UpstreamReply(
                response.status_code, out_headers, body=data, media_type=media_type
            )
        return UpstreamReply(
            response.status_code,
            out_headers,
            chunks=ResponseChunks(response, self.name),
            media_type=media_type,
        )


def _openai_error(body: bytes, prefix: str) -> bytes | None:
    """An upstream's error `body` in OpenAI's shape, or None when it is in it already: a
    top-level error object nested under "error", anything else said after `prefix`."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        if isinstance(data.get("error"), dict) and isinstance(data["error"].get("message"), str):
            return None
        if isinstance(data.get("message"), str):
            text = {k: v if isinstance(v, str) else None for k, v in data.items()}
            return msgspec.json.encode(
                error_body(
                    data["message"],
                    text.get("type") or "upstream_error",
                    text.get("param"),
                    text.get("code") or "upstream_error",
                )
            )
    sent = body.decode("utf-8", "replace")[:300].strip()
    message = prefix + (f": {sent}" if sent else ".")
    return msgspec.json.encode(error_body(message, "upstream_error", code="upstream_error"))


@functools.lru_cache(maxsize=1024)
def _parsed(url: str) -> httpx.URL:
    """A URL parsed once (an upstream's paths are asked for again and again)."""
    return httpx.URL(url)


def _when_sent(sent: Callable[[], None]) -> Callable[[str, Any], Awaitable[None]]:
    """An httpcore trace callback (the request's `trace` extension) that calls `sent` once
    the request's body has been written."""

    async def trace(event: str, info: Any) -> None:
        if event.endswith(".send_request_body.complete"):
            sent()

    return trace


class ResponseChunks:
    """A streamed response's body as it arrives. `aclose()` releases the connection whether
    or not reading began (a generator that never started could not)."""

    def __init__(self, response: httpx.Response, upstream: str) -> None:
        self._response, self._upstream = response, upstream
        self._body: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> ResponseChunks:
        return self

    async def __anext__(self) -> bytes:
        if self._body is None:
            self._body = self._response.aiter_bytes()
        try:
            return await anext(self._body)
        except StopAsyncIteration:
            await self.aclose()
            raise
        except httpx.HTTPError as exc:
            await self.aclose()
            raise map_transport_error(exc, self._upstream) from exc
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        await self._response.aclose()
