"""Two `memproxy serve` processes on one PostgreSQL database, started together on an empty one
(the migrations take a lock, so they do not race), under concurrent traffic whose turns
alternate between the replicas: no message is lost or stored twice, each conversation keeps
its order, two turns sent to the same conversation at once through both replicas are both
stored (one reply continues the conversation, the other is kept beside it), and every
background job (memory extraction, one per reply that continues its conversation) runs
exactly once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from policies.extraction import JOB_KIND
from tests.fakes.openai_upstream import FakeOpenAI, Reply, model_said
from tests.fakes.server import ServerThread
from tests.postgres import fresh_database
from tests.processes import Replica, spawn, stop, wait_ready

KEY = "scale-key"
CONVERSATIONS = 6
TURNS = 4


def nothing_to_remember() -> Reply:
    return model_said(json.dumps({"memories": []}), model="memory-model", usage=(10, 2))


@pytest.fixture
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Replica, ...]]:
    memory = FakeOpenAI()
    memory.script = [nothing_to_remember() for _ in range(CONVERSATIONS * TURNS + 10)]
    request.node.memory_model = memory
    with (
        ServerThread(FakeOpenAI(latency=0.01)) as upstream,
        ServerThread(memory) as memory_server,
        fresh_database("postgresql", request, tmp_path) as url,  # empty: not migrated
    ):
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "server": {"jobs_poll_seconds": 0.1, "limits_sync_seconds": 0.2},
                    "database": {"url": url},
                    "upstreams": {
                        "main": {"kind": "openai", "base_url": upstream.url + "/v1"},
                        "memory": {"kind": "openai", "base_url": memory_server.url + "/v1"},
                    },
                    "tenants": {
                        "t1": {
                            "api_keys": [KEY],
                            "upstream": "main",
                            "memory": {"extract": "llm", "upstream": "memory"},
                        }
                    },
                }
            )
        )
        started = (spawn("a", config, tmp_path), spawn("b", config, tmp_path))
        try:
            for replica in started:
                wait_ready(replica)
            yield started
        finally:
            for replica in started:
                stop(replica)


async def turn(
    http: httpx.AsyncClient, replica: Replica, conversation: str, text: str
) -> httpx.Response:
    return await http.post(
        replica.url + "/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]},
        headers={
            "X-Memory-User-Id": f"user-{conversation}",
            "X-Memory-Conversation-Id": conversation,
        },
    )


async def test_replicas_on_one_database_lose_nothing_and_run_each_job_once(
    replicas: tuple[Replica, Replica], request: pytest.FixtureRequest
) -> None:
    a, b = replicas
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=60) as http:

        async def chat(n: int) -> None:
            for t in range(TURNS):
                replica = (a, b)[(n + t) % 2]  # every turn on the other replica
                response = await turn(http, replica, f"conv-{n}", f"conv {n} turn {t}")
                assert response.status_code == 200, response.text

        await asyncio.gather(*(chat(n) for n in range(CONVERSATIONS)))
        # Two turns of one conversation at the same moment, one through each replica.
        both = await asyncio.gather(
            turn(http, a, "conv-0", "at once via a"), turn(http, b, "conv-0", "at once via b")
        )
        assert [r.status_code for r in both] == [200, 200]

        async def messages(replica: Replica, conversation: str) -> list[dict[str, Any]]:
            got = await http.get(replica.url + f"/memory/conversations/{conversation}/messages")
            assert got.status_code == 200, got.text
            found: list[dict[str, Any]] = got.json()["data"]
            return found

        for n in range(CONVERSATIONS):
            stored = await messages((a, b)[n % 2], f"conv-{n}")
            assert [m["seq"] for m in stored] == list(range(1, len(stored) + 1))
            complete = [(m["role"], m["content"]) for m in stored if m["status"] == "complete"]
            expected = []
            for t in range(TURNS):
                said = f"conv {n} turn {t}"
                expected += [("user", said), ("assistant", f"fake reply to: {said}")]
            assert complete[: 2 * TURNS] == expected
        last = (await messages(b, "conv-0"))[2 * TURNS :]
        assert sorted(m["content"] for m in last if m["role"] == "user") == [
            "at once via a",
            "at once via b",
        ]
        # Both replies are stored and continue the conversation, each naming its own turn,
        # whichever replica answered first.
        seqs = {m["content"]: m["seq"] for m in last if m["role"] == "user"}
        replies = sorted(
            (m["content"], m["status"], m["metadata"]["reply_to"])
            for m in last
            if m["role"] == "assistant"
        )
        assert replies == [
            ("fake reply to: at once via a", "complete", seqs["at once via a"]),
            ("fake reply to: at once via b", "complete", seqs["at once via b"]),
        ]
        extracted = CONVERSATIONS * TURNS + 2  # one extraction per reply

        async def extractions_done() -> list[dict[str, Any]]:
            got = await http.get(a.url + "/memory/jobs", params={"kind": JOB_KIND, "limit": 100})
            return [j for j in got.json()["data"] if j["status"] == "done"]

        for _ in range(600):
            done = await extractions_done()
            if len(done) == extracted:
                break
            await asyncio.sleep(0.05)
        assert len(done) == extracted, f"{len(done)} of {extracted} jobs done"
        assert {j["attempts"] for j in done} == {1}
        memory: FakeOpenAI = request.node.memory_model
        assert len(memory.chat_requests) == extracted  # each job ran once, on one replica
