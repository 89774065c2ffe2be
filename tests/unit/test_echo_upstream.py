from __future__ import annotations

import json

from policies.tokens import count_messages
from proxy.core.config import UpstreamConfig
from proxy.upstream.echo import EchoUpstream
from tests.fakes.openai_upstream import collect

MESSAGES = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "what is 2+2?"}]


def echo() -> EchoUpstream:
    return EchoUpstream("echo", UpstreamConfig(kind="echo"))


async def test_echo_describes_what_it_received_with_real_token_counts() -> None:
    reply = await echo().chat_completions({"model": "gpt-4o", "messages": MESSAGES}, stream=False)
    body = json.loads(reply.body or b"")
    content = body["choices"][0]["message"]["content"]
    tokens = count_messages(MESSAGES, "gpt-4o")
    assert content.startswith(
        f"echo: received 2 messages (system=1, user=1), {tokens} prompt tokens."
    )
    assert 'Last user message: "what is 2+2?"' in content
    assert body["usage"]["prompt_tokens"] == tokens


async def test_echo_is_deterministic_and_its_stream_says_the_same() -> None:
    request = {"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True}}
    first = json.loads((await echo().chat_completions(request, stream=False)).body or b"")
    second = json.loads((await echo().chat_completions(request, stream=False)).body or b"")
    assert first["choices"] == second["choices"] and first["id"] == second["id"]
    streamed = await echo().chat_completions(request, stream=True)
    assert streamed.chunks is not None
    events = (await collect(streamed.chunks)).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == first["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == first["usage"]


async def test_echo_stream_has_no_usage_chunk_unless_asked() -> None:
    streamed = await echo().chat_completions({"model": "m", "messages": MESSAGES}, stream=True)
    assert streamed.chunks is not None
    assert b'"usage"' not in await collect(streamed.chunks)
