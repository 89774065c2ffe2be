"""Anthropic's Messages API, spoken natively through the app's shared httpx client.

`base_url` is the API's root (default https://api.anthropic.com); requests go to
`{base_url}/v1/messages` with the key as `x-api-key` and an `anthropic-version` (the client's,
else DEFAULT_VERSION). It also serves chat completions, by translation (anthropic_chat.py):
a tenant on it works with OpenAI clients (the Responses API through its own translation to
chat) and with memproxy's own model calls (intent, extraction, summaries). Embeddings and
other OpenAI endpoints answer 404 `unsupported_endpoint`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import httpx
import msgspec

from proxy.core.config import UpstreamConfig
from proxy.core.errors import NotFound
from proxy.upstream.anthropic_chat import (
    ChunksFromMessages,
    completion_from_message,
    error_completion,
    messages_request,
)
from proxy.upstream.base import UpstreamReply, model_list_reply, no_passthrough, no_responses
from proxy.upstream.openai import OpenAIUpstream
from proxy.upstream.sse import SSEDecoder

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_VERSION = "2023-06-01"
# The client's request headers the API reads, passed on.
FORWARDED = ("anthropic-version", "anthropic-beta")


class MessagesUpstream(Protocol):
    """An upstream that speaks the Messages API itself."""

    async def messages(
        self,
        body: dict[str, Any],
        headers: Mapping[str, str],
        *,
        stream: bool,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        """`POST /v1/messages` with `body`; `headers`: the client's anthropic-* headers."""
        ...


async def _translated(
    events: AsyncIterator[bytes], chunks: ChunksFromMessages
) -> AsyncIterator[bytes]:
    """A Messages event stream's bytes as chat chunks, as the events arrive; the upstream's
    response closed whenever this ends (a client gone early included)."""
    decoder = SSEDecoder()
    try:
        async for raw in events:
            out = b"".join(chunks.feed(payload) for payload in decoder.feed(raw))
            if out:
                yield out
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


def no_openai_shape(name: str, what: str) -> NotFound:
    return NotFound(
        f"The anthropic upstream {name!r} serves the Messages API and chat completions; "
        f"{what} on it needs an upstream of kind openai or litellm.",
        code="unsupported_endpoint",
    )


class AnthropicUpstream(OpenAIUpstream):
    """The HTTP mechanics are OpenAIUpstream's (timeouts, when the request went out,
    redirects refused, transport errors mapped); the API and its key header are Anthropic's."""

    kind = "anthropic"

    def __init__(self, name: str, config: UpstreamConfig, client: httpx.AsyncClient) -> None:
        super().__init__(name, config, client)
        self._base = config.base_url or DEFAULT_BASE_URL
        self._auth = {"x-api-key": config.api_key} if config.api_key else {}
        self._models = config.models or []

    async def messages(
        self,
        body: dict[str, Any],
        headers: Mapping[str, str],
        *,
        stream: bool,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        out = {"content-type": "application/json", "anthropic-version": DEFAULT_VERSION}
        out.update({k: headers[k] for k in FORWARDED if headers.get(k)})
        out.update(self._auth)
        if stream:
            out["accept"] = "text/event-stream"
        content = msgspec.json.encode(body)
        reply = await self._send("POST", "/v1/messages", b"", out, content, stream, sent)
        return self._readable(reply)

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        """A chat completion, asked of the Messages API and answered in chat's shape."""
        request = messages_request(body)
        reply = await self.messages(request, {}, stream=stream, sent=sent)
        if reply.chunks is not None:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            chunks = ChunksFromMessages(body["model"], include_usage=usage)
            return UpstreamReply(
                reply.status,
                reply.headers,
                chunks=_translated(reply.chunks, chunks),
                media_type="text/event-stream",
            )
        if reply.status >= 400:
            return replace(reply, body=error_completion(reply.status, reply.body or b""))
        try:
            message = msgspec.json.decode(reply.body or b"")
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict):
            return reply  # (not a message: the pipeline reads it as the unreadable reply it is)
        completion = completion_from_message(message, body["model"])
        return replace(reply, body=msgspec.json.encode(completion))

    async def responses(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        raise no_responses(self.kind, self.name)

    async def embeddings(self, body: dict[str, Any]) -> UpstreamReply:
        raise no_openai_shape(self.name, "embeddings")

    async def list_models(self) -> UpstreamReply:
        return model_list_reply(self._models, "anthropic")

    async def passthrough(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: Mapping[str, str],
        body: bytes,
    ) -> UpstreamReply:
        raise no_passthrough(self.kind, self.name, method, path)
