"""Crash safety with `memproxy serve` in a process of its own, mid-way through streamed replies:

- SIGKILL (a crash): after a restart every accepted user turn is stored exactly once, every
  exchange cut off is `incomplete`, and a client that retries its turn gets an answer without
  the turn being stored twice;
- SIGTERM (a deploy): the streams in flight run to their end, their replies are stored whole,
  and the process exits on its own.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import KEY
from tests.fakes.openai_upstream import FakeOpenAI, Reply
from tests.fakes.server import ServerThread
from tests.integration.test_sdk import wait_until
from tests.processes import Replica, kill, spawn, stop, wait_ready

STREAMS = 4
WORDS = " ".join(f"word{i}" for i in range(30))  # a reply of about 33 chunks


@pytest.fixture
def slow_upstream() -> Iterator[str]:
    """A fake OpenAI API that streams a chunk every 0.1 s."""
    with ServerThread(FakeOpenAI(chunk_delay=0.1)) as server:
        yield server.url + "/v1"


@pytest.fixture
def config_file(slow_upstream: str, tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'memproxy.db'}"},
                "upstreams": {"main": {"kind": "openai", "base_url": slow_upstream}},
                "tenants": {"t1": {"api_keys": [KEY], "upstream": "main"}},
            }
        )
    )
    return path


class Stream:
    """One streamed chat completion, read as it arrives."""

    def __init__(self, client: httpx.AsyncClient, n: int) -> None:
        self.client, self.n = client, n
        self.conversation = f"conv-{n}"
        self.text = f"turn {n}: {WORDS}"
        self.headers: httpx.Headers | None = None
        self.events: list[str] = []
        self.first = asyncio.Event()

    def body(self) -> dict[str, Any]:
        return {
            "model": "gpt-4o-mini",
            "stream": True,
            "messages": [{"role": "user", "content": self.text}],
        }

    async def run(self) -> None:
        headers = {"X-Memory-User-Id": "alice", "X-Memory-Conversation-Id": self.conversation}
        try:
            async with self.client.stream(
                "POST", "/chat/completions", json=self.body(), headers=headers
            ) as response:
                self.headers = response.headers
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except httpx.TransportError:
            pass  # the server died under it

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def content(self) -> str:
        parts = []
        for event in self.events[:-1] if self.done else self.events:
            delta = json.loads(event)["choices"][0]["delta"] if "choices" in event else {}
            parts.append(delta.get("content") or "")
        return "".join(parts).strip()  # (the fake streams a word and a space a chunk)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=60) as opened:
        yield opened


def on(replica: Replica, client: httpx.AsyncClient) -> httpx.AsyncClient:
    client.base_url = httpx.URL(replica.url + "/")
    return client


async def start_streams(client: httpx.AsyncClient) -> tuple[list[Stream], list[asyncio.Task[None]]]:
    streams = [Stream(client, n) for n in range(STREAMS)]
    tasks = [asyncio.create_task(s.run()) for s in streams]
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 30)
    return streams, tasks


async def messages(client: httpx.AsyncClient, conversation: str) -> list[dict[str, Any]]:
    response = await client.get(f"memory/conversations/{conversation}/messages")
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["data"]
    return found


async def test_a_crash_mid_stream_loses_and_doubles_nothing(
    config_file: Path, tmp_path: Path, client: httpx.AsyncClient
) -> None:
    first = spawn("first", config_file, tmp_path)
    try:
        wait_ready(first)
        streams, tasks = await start_streams(on(first, client))
        assert not any(s.done for s in streams)  # all of them mid-way
    finally:
        kill(first)
    await asyncio.gather(*tasks)
    assert not any(s.done for s in streams)

    second = spawn("second", config_file, tmp_path)
    try:
        wait_ready(second)
        on(second, client)
        for stream in streams:
            assert stream.headers is not None
            stored = await messages(client, stream.conversation)
            assert [(m["role"], m["content"]) for m in stored if m["role"] == "user"] == [
                ("user", stream.text)
            ]
            assert not [m for m in stored if m["role"] == "assistant" and m["status"] == "complete"]
            record = await client.get(f"memory/exchanges/{stream.headers['x-request-id']}")
            assert record.json()["status"] == "incomplete"
        # The client retries its turn: answered, and the turn is still stored once.
        retry = Stream(client, 0)  # the same turn again, read afresh
        await retry.run()
        assert retry.done and retry.content() == f"fake reply to: {retry.text}"
        stored = await messages(client, retry.conversation)
        assert [m["role"] for m in stored if m["status"] == "complete"] == ["user", "assistant"]
    finally:
        stop(second)


async def test_sigterm_lets_the_streams_in_flight_finish_and_stores_them(
    config_file: Path, tmp_path: Path, client: httpx.AsyncClient
) -> None:
    server = spawn("server", config_file, tmp_path)
    try:
        wait_ready(server)
        streams, tasks = await start_streams(on(server, client))
        assert not any(s.done for s in streams)  # all of them mid-way
        server.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(s.done for s in streams), [s.events[-1:] for s in streams]
        assert [s.content() for s in streams] == [f"fake reply to: {s.text}" for s in streams]
        # Then it exits by itself (uvicorn re-raises the signal once it has shut down).
        assert await asyncio.to_thread(server.process.wait, 30) in (0, -signal.SIGTERM)
    finally:
        stop(server)

    again = spawn("again", config_file, tmp_path)
    try:
        wait_ready(again)
        on(again, client)
        for stream in streams:
            stored = await messages(client, stream.conversation)
            assert [(m["role"], m["status"]) for m in stored] == [
                ("user", "complete"),
                ("assistant", "complete"),
            ]
            assert stored[1]["content"].strip() == f"fake reply to: {stream.text}"
    finally:
        stop(again)


async def test_what_still_waits_when_the_grace_period_ends_gets_an_error_and_is_stored(
    tmp_path: Path, client: httpx.AsyncClient
) -> None:
    # Replies far longer than the grace period: two streams mid-way, and a whole reply the
    # upstream has not begun. Near the end of the grace they get a 503 or a last error event
    # (uvicorn would only drop the connections), and what the streams had is stored.
    fake = FakeOpenAI(chunk_delay=0.5)
    with ServerThread(fake) as upstream:
        path = tmp_path / "config.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "server": {"shutdown_grace_seconds": 2},
                    "database": {"url": f"sqlite+aiosqlite:///{tmp_path / 'memproxy.db'}"},
                    "upstreams": {"main": {"kind": "openai", "base_url": upstream.url + "/v1"}},
                    "tenants": {"t1": {"api_keys": [KEY], "upstream": "main"}},
                }
            )
        )
        server = spawn("server", path, tmp_path)
        try:
            wait_ready(server)
            on(server, client)
            streams = [Stream(client, n) for n in range(2)]
            tasks = [asyncio.create_task(s.run()) for s in streams]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 30)
            fake.script.append(Reply(body={"unused": True}, hold=True))
            whole = asyncio.create_task(
                client.post(
                    "/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "wait"}]},
                    headers={"X-Memory-User-Id": "alice", "X-Memory-Conversation-Id": "whole"},
                )
            )
            await wait_until(lambda: len(fake.chat_requests) == 3)  # (the whole one held)
            server.process.send_signal(signal.SIGTERM)
            answered = await asyncio.wait_for(whole, 30)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert answered.status_code == 503, answered.text
            assert answered.json()["error"]["code"] == "server_shutting_down"
            assert answered.headers["x-memory-conversation-id"] == "whole"
            for stream in streams:
                assert not stream.done
                last = json.loads(stream.events[-1])
                assert last["error"]["code"] == "server_shutting_down", stream.events[-1]
            assert await asyncio.to_thread(server.process.wait, 30) in (0, -signal.SIGTERM)
        finally:
            fake.release.set()
            stop(server)

    again = spawn("again", path, tmp_path)
    try:
        wait_ready(again)
        on(again, client)
        assert [m["role"] for m in await messages(client, "whole")] == ["user"]
        for stream in streams:
            stored = await messages(client, stream.conversation)
            assert [(m["role"], m["status"]) for m in stored] == [
                ("user", "complete"),
                ("assistant", "error"),  # as a stream the upstream broke off
            ]
            assert stream.content() == stored[1]["content"].strip()
            assert f"fake reply to: {stream.text}".startswith(stream.content())
    finally:
        stop(again)
