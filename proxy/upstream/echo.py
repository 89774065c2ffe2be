"""The built-in offline upstream: answers every request by describing what it received, and
memproxy's own calls, tools and structured outputs by simple rules (proxy/upstream/echo_answers.py).

Deterministic (same request, same content), streams when asked (tool calls as OpenAI streams
them), reports usage counted with tiktoken. Useful for demos, debugging what the proxy
attached, and tests.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec

from policies.tokens import count_messages, count_text
from proxy.core.config import UpstreamConfig
from proxy.upstream.base import UpstreamReply, model_list_reply, no_passthrough, no_responses
from proxy.upstream.echo_answers import Answer, answer, describe

__all__ = ["ECHO_EMBEDDING_DIMS", "EchoUpstream", "describe", "hashed_bag_of_words"]

ECHO_EMBEDDING_DIMS = 256
_WORD = re.compile(r"[^\W_]+")
MAX_CHOICES = 128  # OpenAI's own limit on `n`
ARGUMENT_PIECE = 16  # characters of a tool call's arguments per stream chunk


class EchoUpstream:
    kind = "echo"
    reports_sent = False

    def __init__(self, name: str, config: UpstreamConfig) -> None:
        self.name = name
        self.stream_usage = config.stream_usage
        self._models = config.models or ["echo"]

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        # (`sent` is not called: the answer is made here, at once.)
        messages = body.get("messages") or []
        model = str(body.get("model", "echo"))
        prompt_tokens = count_messages(messages, model)
        reply = answer(body, prompt_tokens)
        completion_tokens = count_text(reply.content or "", model) + sum(
            count_text(c["function"]["name"] + c["function"]["arguments"], model)
            for c in reply.tool_calls
        )
        n_field = body.get("n")
        n = min(n_field, MAX_CHOICES) if isinstance(n_field, int) and n_field > 0 else 1
        digest = hashlib.sha256(msgspec.json.encode(messages)).hexdigest()[:24]
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens * n,
            "total_tokens": prompt_tokens + completion_tokens * n,
        }
        head = {"id": f"chatcmpl-echo{digest}", "created": int(time.time()), "model": model}
        headers = {"x-upstream-request-id": f"echo-{digest}"}
        finish = "tool_calls" if reply.tool_calls else "stop"
        if not stream:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": reply.content,
                "refusal": None,
            }
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choices = [
                {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
                for i in range(n)
            ]
            payload = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
            return UpstreamReply(200, headers, body=msgspec.json.encode(payload))
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        chunks = _stream(head, reply, n, usage if include_usage else None)
        return UpstreamReply(200, headers, chunks=chunks, media_type="text/event-stream")

    async def responses(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        raise no_responses(self.kind, self.name)

    async def list_models(self) -> UpstreamReply:
        return model_list_reply(self._models, "memproxy")

    async def embeddings(self, body: dict[str, Any]) -> UpstreamReply:
        """The proxy's own embeddings requests (recall with `embeddings: upstream` on the
        default install): deterministic hashed bags of words, not a model. Clients still get
        a 404 for /v1/embeddings, like every other endpoint the echo upstream does not serve."""
        raw = body.get("input")
        inputs = raw if isinstance(raw, list) else [raw]
        data = [
            {"object": "embedding", "index": i, "embedding": hashed_bag_of_words(str(text))}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(count_text(str(text)) for text in inputs)
        payload = {
            "object": "list",
            "data": data,
            "model": str(body.get("model", "echo")),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return UpstreamReply(200, body=msgspec.json.encode(payload))

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> UpstreamReply:
        raise no_passthrough(self.kind, self.name, method, path)

    async def aclose(self) -> None:
        pass


def hashed_bag_of_words(text: str, dims: int = ECHO_EMBEDDING_DIMS) -> list[float]:
    """Each word adds +-1 to a dimension its hash picks; unit length (a text without words
    gets one fixed dimension)."""
    vector = [0.0] * dims
    for word in _WORD.findall(text.lower()):
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        index = int.from_bytes(digest[:4], "little") % dims
        vector[index] += 1.0 if digest[4] & 1 else -1.0
    norm = sum(v * v for v in vector) ** 0.5
    if norm == 0:
        vector[0], norm = 1.0, 1.0
    return [v / norm for v in vector]


def _deltas(reply: Answer) -> list[dict[str, Any]]:
    """The deltas after the first (role) one: content in pieces of a few words, or each tool
    call's name and then its arguments in pieces, as OpenAI streams them."""
    if reply.tool_calls:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(reply.tool_calls):
            function = call["function"]
            opening = {"name": function["name"], "arguments": ""}
            deltas.append(
                {"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                 "function": opening}]}
            )  # fmt: skip
            arguments = function["arguments"]
            for at in range(0, len(arguments), ARGUMENT_PIECE):
                piece = {"arguments": arguments[at : at + ARGUMENT_PIECE]}
                deltas.append({"tool_calls": [{"index": index, "function": piece}]})
        return deltas
    words = (reply.content or "").split(" ")
    pieces = [" ".join(words[i : i + 8]) + " " for i in range(0, len(words), 8)]
    pieces[-1] = pieces[-1].rstrip(" ")
    return [{"content": piece} for piece in pieces]


async def _stream(
    head: dict[str, Any], reply: Answer, n: int, usage: dict[str, int] | None
) -> AsyncIterator[bytes]:
    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {**head, "object": "chat.completion.chunk", "choices": choices, **extra}
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    deltas = _deltas(reply)
    opening = {"role": "assistant", "content": None if reply.tool_calls else ""}
    finish = "tool_calls" if reply.tool_calls else "stop"
    for i in range(n):
        for delta in [opening, *deltas]:
            yield event([{"index": i, "delta": delta, "finish_reason": None, "logprobs": None}])
        yield event([{"index": i, "delta": {}, "finish_reason": finish, "logprobs": None}])
    if usage is not None:
        yield event([], usage=usage)
    yield b"data: [DONE]\n\n"
