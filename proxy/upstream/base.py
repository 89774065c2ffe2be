"""The upstream seam: one small protocol that every kind of model provider implements.

An upstream answers with an `UpstreamReply`: a status, the headers worth passing on, and either
a whole body or an async iterator of raw SSE bytes. Failures before the first byte raise
`UpstreamUnreachable`/`UpstreamTimeout`; an error status from the provider is returned as a
normal reply with its own body (it is passed through). A stream that breaks later raises from
its iterator, and the relay turns that into a final error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


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

    async def chat_completions(self, body: dict[str, Any], *, stream: bool) -> UpstreamReply:
        """Send a chat completion request; with `stream`, return before the body arrives."""
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
