"""The shipped config.yaml shows the whole product with no API key: on its `tour` tenant a
named user's first-person fact is extracted into a memory by the echo upstream, listed by the
management API, and recalled in a new conversation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from proxy.core.config import Config, ServerConfig
from proxy.core.config_file import load_config
from tests.polling import eventually

SHIPPED = Path(__file__).resolve().parents[2] / "config.yaml"
TOUR = {"Authorization": "Bearer tour-key", "X-Memory-User-Id": "ann"}


def shipped_config() -> Config:
    """config.yaml as shipped, with background jobs polled often (the test waits on them)."""
    config = load_config(SHIPPED)
    quick = ServerConfig(jobs_poll_seconds=0.05, job_retry_seconds=0.05)
    return config.model_copy(update={"server": quick})


async def chat(client: httpx.AsyncClient, text: str) -> httpx.Response:
    reply = await client.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]},
    )
    assert reply.status_code == 200, reply.text
    return reply


async def test_a_fact_told_on_the_tour_tenant_is_remembered_and_recalled(
    serve_proxy: Callable[[Config], str],
) -> None:
    base = serve_proxy(shipped_config()).removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base, headers=TOUR, timeout=30) as client:
        first = await chat(client, "Hello! I live in Lisbon. My favourite drink is green tea.")
        request_id = first.headers["x-request-id"]

        conversation = first.headers["x-memory-conversation-id"]

        async def intent() -> dict[str, Any] | None:
            url = f"/v1/memory/conversations/{conversation}/messages"
            turn = (await client.get(url)).json()["data"][0]
            found: dict[str, Any] | None = (turn["metadata"] or {}).get("intent")
            return found if found and found["method"] == "llm" else None

        await eventually(intent, "the LLM intent (echo's keyword rules)")

        async def memories() -> list[dict[str, Any]]:
            reply = await client.get("/v1/memory/memories", params={"user": "ann"})
            listed = reply.json()["data"]
            return list(listed) if len(listed) == 2 else []

        found = await eventually(memories, "the extraction job")
        assert sorted((m["kind"], m["text"]) for m in found) == [
            ("fact", "The user lives in Lisbon."),
            ("preference", "The user's favourite drink is green tea."),
        ]
        assert {m["source_exchange_id"] for m in found} == {request_id}

        later = await chat(client, "Where do I live, and what do I like to drink?")
        assert (
            later.headers["x-memory-conversation-id"] != first.headers["x-memory-conversation-id"]
        )
        assert int(later.headers["x-memory-memories"]) >= 1
        # The recalled memories reached the model as a system message of their own.
        content = later.json()["choices"][0]["message"]["content"]
        assert "system=1" in content and "user=1" in content


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}


async def test_echo_calls_a_forced_tool_through_the_proxy_streamed_and_not(
    serve_proxy: Callable[[Config], str],
) -> None:
    """What an SDK user sees on the demo tenant: a tool call it can parse, whole or streamed."""
    base = serve_proxy(shipped_config())
    forced = {"type": "function", "function": {"name": "get_weather"}}
    request: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Weather in Lisbon?"}],
        "tools": [WEATHER],
        "tool_choice": forced,
        "extra_headers": {"X-Memory-User-Id": "bob"},
    }
    async with openai.AsyncOpenAI(base_url=base, api_key="demo-key", max_retries=0) as sdk:
        whole = await sdk.chat.completions.create(**request)
        [call] = whole.choices[0].message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "echo", "unit": "c"}
        arguments = ""
        stream = await sdk.chat.completions.create(**request, stream=True)
        async for chunk in stream:
            for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                arguments += (delta_call.function and delta_call.function.arguments) or ""
        assert arguments == call.function.arguments
