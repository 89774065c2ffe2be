"""The upstream seam: one small protocol that every kind of model provider implements.

An upstream answers with an `UpstreamReply`: a status, the headers worth passing on, and either
a whole body or an async iterator of raw SSE bytes. Failures before the first byte raise
`UpstreamUnreachable`/`UpstreamTimeout`; an error status from the provider is returned as a
normal reply with its own body (it is passed through). A stream that breaks later raises from
its iterator, and the relay turns that into a final error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from proxy.core.errors import NotFound


@dataclass(slots=True)
class UpstreamReply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None
    media_type: str = "application/json"

    @property
    def streamed(self) -> bool:
        return self.chunks is not None


class Upstream(Protocol):
    """What the proxy needs from a model provider."""

    name: str
    kind: str
    # Whether streams may carry `stream_options.include_usage` to this upstream.
    stream_usage: bool
    # Whether `chat_completions` calls its `sent` callback (else the caller cannot wait for it).
    reports_sent: bool

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        """Send a chat completion request; with `stream`, return before the body arrives.
        `sent`, when the upstream can tell, is called once the request has gone out (maybe
        again, if it is sent again): what the caller can leave until then runs while the
        provider works rather than before the request leaves."""
        ...

    async def responses(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        """Send a Responses API request (`POST /v1/responses`), as `chat_completions` does;
        NotFound from an upstream that speaks no Responses API (it is served by translation:
        see `responses_mode`)."""
        ...

    async def list_models(self) -> UpstreamReply:
        """The provider's model list in OpenAI's shape."""
        ...

    async def passthrough(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: Mapping[str, str],
        body: bytes,
    ) -> UpstreamReply:
        """Forward any other `/v1/*` request unchanged (raises NotFound where unsupported)."""
        ...

    async def aclose(self) -> None:
        """Release what the upstream holds itself; called once, at shutdown."""
        ...


def model_list(models: Iterable[str], owned_by: str) -> dict[str, Any]:
    """`GET /v1/models`'s body for models the proxy lists itself."""
    data = [{"id": m, "object": "model", "created": 0, "owned_by": owned_by} for m in models]
    return {"object": "list", "data": data}


def model_list_reply(models: Iterable[str], owned_by: str) -> UpstreamReply:
    return UpstreamReply(200, body=msgspec.json.encode(model_list(models, owned_by)))


def no_responses(kind: str, name: str) -> NotFound:
    """What an upstream without a Responses API says (its turns are translated instead)."""
    return NotFound(
        f"The {kind} upstream {name!r} has no Responses API; memproxy serves /v1/responses "
        "for it by translation to chat completions.",
        code="unsupported_endpoint",
    )


def no_passthrough(kind: str, name: str, method: str, path: str) -> NotFound:
    """What an upstream that only serves chat completions and models says to anything else."""
    return NotFound(
        f"The {kind} upstream {name!r} only serves chat completions and models; "
        f"{method} /v1{path} needs an openai-kind upstream.",
        code="unsupported_endpoint",
    )
