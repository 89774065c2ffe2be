"""Providers that are not OpenAI-compatible (Anthropic, Gemini, Bedrock...) through litellm.

litellm translates the request into the provider's API and the answer back; this module decides
what reaches litellm, re-serialises what comes back so it validates against OpenAI's schema, and
translates litellm's exceptions into the proxy's. litellm is imported on first use and off the
event loop: the import takes seconds, and only tenants on this kind of upstream need it.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any

import httpx
import msgspec
import structlog

from proxy.core.config import UpstreamConfig
from proxy.core.errors import (
    ProxyError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
    error_body,
)
from proxy.core.logs import LITELLM_LOGGERS
from proxy.upstream.base import UpstreamReply, model_list_reply, no_passthrough, no_responses
from proxy.upstream.headers import passthrough_headers

log = structlog.get_logger("memproxy.upstream.litellm")

# OpenAI's chat request fields that litellm maps for other providers, plus `top_k`, which it
# passes to those that have it. Nothing else in the body reaches litellm: it would read other
# names as its own arguments (api_base, mock_response, aws_* credentials, metadata...), letting
# a client redirect the tenant's key or fake an answer.
REQUEST_FIELDS = frozenset(
    {
        "model",
        "messages",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "logprobs",
        "top_logprobs",
        "reasoning_effort",
        "thinking",
        "verbosity",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "store",
    }
)
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def _import_litellm() -> Any:
    module: Any = importlib.import_module("litellm")
    module.suppress_debug_info = True  # else it print()s hints to stdout on some failures
    # Its records go to memproxy's handler only (one format, once), not also to its own.
    for name in LITELLM_LOGGERS:
        logging.getLogger(name).handlers.clear()
    return module


class LiteLLMUpstream:
    kind = "litellm"
    reports_sent = False

    def __init__(self, name: str, config: UpstreamConfig) -> None:
        self.name = name
        self.stream_usage = config.stream_usage
        self._config = config
        self._litellm: Any = None

    async def load(self) -> Any:
        """The litellm module, imported in a worker thread the first time."""
        if self._litellm is None:
            self._litellm = await asyncio.to_thread(_import_litellm)
        return self._litellm

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        # (`sent` is not called: litellm does not say when its request has gone out.)
        litellm = await self.load()
        params = {k: v for k, v in body.items() if k in REQUEST_FIELDS}
        if ignored := body.keys() - REQUEST_FIELDS - {"stream"}:
            log.debug("fields_not_forwarded", upstream=self.name, fields=sorted(ignored))
        timeout = self._config.timeout
        try:
            result = await litellm.acompletion(
                **params,
                stream=stream,
                api_key=self._config.api_key,
                api_base=self._config.base_url,
                timeout=httpx.Timeout(timeout.read, connect=timeout.connect),
                # An OpenAI client sends parameters some providers lack (seed, n, logit_bias):
                # drop them rather than fail requests that work against OpenAI.
                drop_params=True,
                num_retries=0,  # the client's SDK retries; retrying here too multiplies them
                # Tool calls go back to the client. Without this, litellm checks for its MCP
                # gateway, which needs the optional `mcp` package and fails without it.
                _skip_mcp_handler=True,
            )
        except Exception as exc:
            raise self.map_error(exc) from exc
        headers = _provider_headers(getattr(result, "_hidden_params", {}) or {})
        if not stream:
            return UpstreamReply(200, headers, body=msgspec.json.encode(completion_json(result)))
        return UpstreamReply(
            200, headers, chunks=self._relay(result), media_type="text/event-stream"
        )

    async def _relay(self, stream: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                data = chunk_json(chunk)
                if data is not None:
                    yield b"data: " + msgspec.json.encode(data) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except Exception as exc:
            raise self.map_error(exc) from exc
        finally:
            await stream.aclose()  # releases the provider connection when the client left early

    async def responses(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        raise no_responses(self.kind, self.name)

    async def list_models(self) -> UpstreamReply:
        return model_list_reply(self._config.models or [], self.name)

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> UpstreamReply:
        raise no_passthrough(self.kind, self.name, method, path)

    async def aclose(self) -> None:
        """Close the HTTP clients litellm caches process-wide; it never closes them itself."""
        if self._litellm is not None:
            await self._litellm.close_litellm_async_clients()

    def map_error(self, exc: Exception) -> ProxyError:
        """The proxy's error for a litellm failure, judged by the HTTP failure underneath it.

        litellm reports a refused connection as a 500 and a provider's 529 as a 500, so its own
        class says less than the httpx error it wraps; its class is the fallback.
        """
        if isinstance(exc, ProxyError):
            return exc
        for cause in _causes(exc):
            if isinstance(cause, httpx.TimeoutException) or (
                self._litellm is not None and isinstance(cause, self._litellm.Timeout)
            ):
                return UpstreamTimeout(f"Upstream {self.name!r} timed out.")
            if isinstance(cause, httpx.HTTPStatusError):
                return _status_error(cause.response)
            if isinstance(cause, httpx.TransportError):
                return UpstreamUnreachable(
                    f"Upstream {self.name!r} is unreachable ({type(cause).__name__})."
                )
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and 400 <= status < 600:
            message = str(getattr(exc, "message", exc))
            headers = getattr(exc, "litellm_response_headers", None) or {}
            return UpstreamStatusError(
                status, error_body(message, _error_type(status)), _headers(headers.items())
            )
        return UpstreamError(f"Upstream {self.name!r} failed ({type(exc).__name__}).")


def completion_json(response: Any) -> dict[str, Any]:
    """A litellm `ModelResponse` as OpenAI's `chat.completion` object."""
    data: dict[str, Any] = _clean(response.model_dump(exclude_none=True))
    for choice in data.get("choices", []):
        message = choice.setdefault("message", {"role": "assistant"})
        message.setdefault("content", None)
        message.setdefault("refusal", None)
        for call in message.get("tool_calls", []):
            call.pop("index", None)  # the provider's content-block index; not in OpenAI's shape
        choice.setdefault("logprobs", None)
    return data


def chunk_json(chunk: Any) -> dict[str, Any] | None:
    """A litellm stream chunk as OpenAI's `chat.completion.chunk`, or None if it carries nothing.

    litellm puts the usage on a chunk with one empty choice; OpenAI's usage chunk has none.
    """
    data: dict[str, Any] = _clean(chunk.model_dump(exclude_none=True))
    choices = []
    for choice in data.get("choices", []):
        choice.setdefault("delta", {})
        choice.setdefault("finish_reason", None)
        if choice["delta"] or choice["finish_reason"] or choice.get("logprobs"):
            choices.append(choice)
    if not choices and "usage" not in data:
        return None
    data["choices"] = choices
    return data


def _clean(data: Any) -> Any:
    """Drop litellm's `provider_specific_fields` bags, wherever they are.

    `exclude_none` already removed litellm's nulls for fields OpenAI declares as non-nullable
    (e.g. usage details); other extras that are set (`reasoning_content`) stay.
    """
    if isinstance(data, dict):
        return {k: _clean(v) for k, v in data.items() if k != "provider_specific_fields"}
    if isinstance(data, list):
        return [_clean(v) for v in data]
    return data


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it wraps: litellm's `original_exception`, then `__cause__`/`__context__`."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        original = getattr(current, "original_exception", None)
        todo += [
            original if isinstance(original, BaseException) else None,
            current.__cause__,
            current.__context__,
        ]


def _status_error(response: httpx.Response) -> UpstreamStatusError:
    """The provider's error status, with its message and type in OpenAI's error shape."""
    try:
        payload = msgspec.json.decode(response.content)
    except (ValueError, RecursionError, httpx.ResponseNotRead):
        payload = None
    # Anthropic, Gemini and OpenAI nest it under "error"; Bedrock does not.
    error = payload.get("error", payload) if isinstance(payload, dict) else None
    error = error if isinstance(error, dict) else {}

    def text(key: str) -> str | None:
        value = error.get(key)
        return value if isinstance(value, str) and value else None

    status = response.status_code
    message = text("message") or f"Upstream answered {status} {response.reason_phrase}."
    body = error_body(message, text("type") or _error_type(status), text("param"), text("code"))
    return UpstreamStatusError(status, body, _headers(response.headers.multi_items()))


def _error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "api_error")


def _headers(raw: Iterable[tuple[str, str]]) -> dict[str, str]:
    headers = passthrough_headers(raw)
    if "request-id" in headers:  # Anthropic's name for it
        headers["x-upstream-request-id"] = headers.pop("request-id")
    return headers


def _provider_headers(hidden: Mapping[str, Any]) -> dict[str, str]:
    """The provider's response headers, which litellm keeps prefixed with `llm_provider-`."""
    raw = hidden.get("additional_headers") or {}
    prefix = "llm_provider-"
    return _headers((k[len(prefix) :], str(v)) for k, v in raw.items() if k.startswith(prefix))
