"""The real server on each database: SQLite (reply written just after the response) and
PostgreSQL (reply written before the response ends, as for several replicas)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from proxy.app import create_app
from proxy.core.config import UpstreamConfig
from storage.repositories.erasures import Erasures
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread
from tests.polling import eventually
from tests.postgres import lock_waits

MODEL = "gpt-4o-mini"
THIN = {"X-Memory-Conversation-Id": "c1", "X-Memory-User-Id": "alice"}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def reply_to(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": f"fake reply to: {text}"}


async def stored(base: str, conversation: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http:
        response = await http.get(f"/memory/conversations/{conversation}/messages")
    assert response.status_code == 200, response.text
    return [{"role": m["role"], "content": m["content"]} for m in response.json()["data"]]


async def test_conversations_survive_turns_streams_and_a_restart_on_each_database(
    fake_upstream: tuple[FakeOpenAI, str], database_url: str
) -> None:
    fake, upstream_url = fake_upstream
    config = make_config(
        UpstreamConfig(kind="openai", base_url=upstream_url, api_key="k"), database_url=database_url
    )
    with ServerThread(create_app(config)) as server:
        base = server.url + "/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
            await client.chat.completions.create(
                model=MODEL, messages=[user("one")], extra_headers=THIN
            )
            stream = await client.chat.completions.create(
                model=MODEL, messages=[user("two")], stream=True, extra_headers=THIN
            )
            streamed = "".join(
                [c.choices[0].delta.content or "" async for c in stream if c.choices]
            )
            # A full-history client, straight after: its previous reply is found by its chain.
            first = await client.chat.completions.create(
                model=MODEL, messages=[user("hello")], extra_headers={"X-Memory-User-Id": "bob"}
            )
            again = [
                user("hello"),
                {"role": "assistant", "content": first.choices[0].message.content},
                user("more"),
            ]
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=again, extra_headers={"X-Memory-User-Id": "bob"}
            )
        bob_conversation = raw.headers["x-memory-conversation-id"]
        assert await stored(base, "c1") == [
            user("one"),
            reply_to("one"),
            user("two"),
            {"role": "assistant", "content": streamed},
        ]
        assert len(await stored(base, bob_conversation)) == 4  # no duplicates
    with ServerThread(create_app(config)) as server:
        base = server.url + "/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
            await client.chat.completions.create(
                model=MODEL, messages=[user("three")], extra_headers=THIN
            )
        assert fake.chat_requests[-1]["messages"] == [
            user("one"),
            reply_to("one"),
            user("two"),
            {"role": "assistant", "content": streamed},
            user("three"),
        ]
        assert len(await stored(base, "c1")) == 6


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_on_postgresql_imports_and_creates_wait_for_the_users_erasure(
    database_url: str,
) -> None:
    """Importing messages, creating a conversation or a memory take the user's share of the
    erasure lock, as a turn does: while an erasure of the user is under way (its lock held
    here) each waits, then goes ahead, never in between the erasure's deletes (an import
    could deadlock with them; a create committed there would outlive an erasure that
    answered after it)."""
    config = make_config(UpstreamConfig(kind="echo"), database_url=database_url)
    with ServerThread(create_app(config)) as server:
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.url + "/v1", headers=headers) as http:
            opened = {"id": "c1", "user": "alice", "messages": [user("one")]}
            assert (await http.post("/memory/conversations", json=opened)).status_code == 201

            async def all_waiting() -> bool:
                return await lock_waits(database_url, "advisory") >= 4

            engine = create_async_engine(database_url)
            try:
                async with engine.connect() as erasure:
                    await erasure.run_sync(lambda c: Erasures(c).lock("t1", "alice"))
                    imports = [
                        asyncio.create_task(
                            http.post(
                                "/memory/conversations/c1/messages",
                                json={"messages": [user("two")]},
                            )
                        ),
                        asyncio.create_task(
                            http.post(
                                "/memory/conversations",
                                json={"id": "c2", "user": "alice", "messages": [user("three")]},
                            )
                        ),
                        asyncio.create_task(
                            http.post("/memory/conversations", json={"id": "c3", "user": "alice"})
                        ),
                        asyncio.create_task(
                            http.post("/memory/memories", json={"user": "alice", "text": "tea"})
                        ),
                    ]
                    await eventually(all_waiting, "the imports and creates waiting")
                    assert not any(task.done() for task in imports)
                    await erasure.rollback()
            finally:
                await engine.dispose()
            assert [(await task).status_code for task in imports] == [201] * 4
        assert await stored(server.url + "/v1", "c1") == [user("one"), user("two")]
