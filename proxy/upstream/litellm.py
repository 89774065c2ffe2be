"""Providers that are not OpenAI-compatible (Anthropic, Gemini, Bedrock...) through litellm.

litellm is imported on first use: importing it costs seconds, and only tenants on this kind of
upstream need it. Its responses and stream chunks are re-serialised in OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from proxy.config import UpstreamConfig
from proxy.errors import (
    NotFound,
    ProxyError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
    error_body,
)
from proxy.upstream.base import UpstreamReply


class LiteLLMUpstream:
    kind = "litellm"

    def __init__(self, name: str, config: UpstreamConfig) -> None:
        self.name = name
        self._config = config

    async def chat_completions(self, body: dict[str, Any], *, stream: bool) -> UpstreamReply:
        import litellm

        params = dict(body)
        params["stream"] = stream
        try:
            result = await litellm.acompletion(
                **params,
                api_key=self._config.api_key,
                api_base=self._config.base_url,
                timeout=self._config.timeout.read,
                drop_params=True,
            )
        except Exception as exc:
            raise self._map_error(exc) from exc
        if not stream:
            return UpstreamReply(200, body=result.model_dump_json().encode())
        return UpstreamReply(200, chunks=self._relay(result), media_type="text/event-stream")

    async def _relay(self, stream: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield b"data: " + chunk.model_dump_json(exclude_none=True).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except Exception as exc:
            raise self._map_error(exc) from exc

    async def list_models(self) -> UpstreamReply:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": self.name}
            for m in self._config.models or []
        ]
        return UpstreamReply(200, body=msgspec.json.encode({"object": "list", "data": data}))

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> UpstreamReply:
        raise NotFound(
            f"The litellm upstream {self.name!r} only serves chat completions and models; "
            f"{method} /v1{path} needs an openai-kind upstream.",
            code="unsupported_endpoint",
        )

    def _map_error(self, exc: Exception) -> ProxyError:
        import litellm

        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, litellm.Timeout):
            return UpstreamTimeout(f"Upstream {self.name!r} timed out.")
        if isinstance(exc, litellm.APIConnectionError):
            return UpstreamUnreachable(f"Upstream {self.name!r} is unreachable: {exc}")
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and 400 <= status < 600:
            message = str(getattr(exc, "message", exc))
            type_ = "invalid_request_error" if status < 500 else "upstream_error"
            return UpstreamStatusError(status, error_body(message, type_), {})
        return UpstreamUnreachable(f"Upstream {self.name!r} failed: {type(exc).__name__}")
