"""`GET /v1/memory/users/{id}/export` through the real server: everything stored for the user
(conversations with messages and attachments, memories, exchange records, jobs), nothing of
other users or tenants, management scope only, and nothing left after the user is erased."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY


@pytest.fixture
async def api(proxy_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=proxy_url, headers={"authorization": f"Bearer {KEY}"}
    ) as client:
        yield client


async def chat(proxy_url: str, user: str, text: str) -> str:
    async with openai.AsyncOpenAI(base_url=proxy_url, api_key=KEY, max_retries=0) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": text}],
            extra_headers={"X-Memory-User-Id": user},
        )
    return raw.headers["x-request-id"]


async def export(api: httpx.AsyncClient, user: str, key: str = KEY) -> httpx.Response:
    return await api.get(f"/memory/users/{user}/export", headers={"authorization": f"Bearer {key}"})


async def test_export_holds_everything_of_the_user_and_nothing_else(
    proxy_url: str, api: httpx.AsyncClient
) -> None:
    request_id = await chat(proxy_url, "alice", "my favourite colour is teal")
    await chat(proxy_url, "bob", "my favourite colour is red")
    created = await api.post(
        "/memory/conversations",
        json={"id": "trip", "user": "alice", "messages": [{"role": "user", "content": "Oslo?"}]},
    )
    assert created.status_code == 201
    uploaded = await api.post(
        "/memory/conversations/trip/attachments", json={"content": "Packing list: boots."}
    )
    assert uploaded.status_code == 201
    memory = await api.post("/memory/memories", json={"user": "alice", "text": "likes teal"})
    assert memory.status_code == 201

    response = await export(api, "alice")
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    assert (data["object"], data["user"]) == ("memory.user.export", "alice")
    texts = [m["content"] for c in data["conversations"] for m in c["messages"]]
    assert "my favourite colour is teal" in texts and "Oslo?" in texts
    assert not any("red" in str(t) for t in texts)
    (trip,) = [c for c in data["conversations"] if c["id"] == "trip"]
    assert [a["content"] for a in trip["attachments"]] == ["Packing list: boots."]
    assert [m["text"] for m in data["memories"]] == ["likes teal"]
    assert [x["id"] for x in data["exchanges"]] == [request_id]
    assert "bob" not in str(data)

    # Another tenant sees nothing of it; a chat-only key may not export.
    other = (await export(api, "alice", OTHER_TENANT_KEY)).json()
    assert other["conversations"] == other["memories"] == other["exchanges"] == []
    assert (await export(api, "alice", CHAT_ONLY_KEY)).status_code == 403

    # Erased: nothing to export.
    assert (await api.delete("/memory/users/alice")).status_code == 200
    after = (await export(api, "alice")).json()
    assert after["conversations"] == after["memories"] == after["exchanges"] == []
    assert after["summaries"] == after["jobs"] == [] and after["vectors"] == 0


async def test_a_bad_user_id_is_a_400(api: httpx.AsyncClient) -> None:
    response = await export(api, "x" * 300)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "user_id"
