"""Fail-open memory: the database goes away (a PostgreSQL server stopped) or is too slow (a
SQLite file another process holds), chat requests are still answered with
`x-memory-status: degraded`, what they would have stored waits in the spill, and once the
database is back the spill's replay stores each turn and reply exactly once, in order. A tenant
with `fail_open: false` gets 503s, a full spill turns degradation into 503s, limits keep being
enforced from the last counts, and erasing a user removes their spilled turns."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.config import (
    Config,
    DatabaseConfig,
    Limits,
    PriceConfig,
    ServerConfig,
    TenantConfig,
    UpstreamConfig,
)
from tests.fakes.openai_upstream import FakeOpenAI
from tests.postgres import PostgresServer, start_server

ServeProxy = Callable[[Config], str]
OPEN, CLOSED, FRUGAL = "open-key", "closed-key", "frugal-key"


def config(upstream_url: str, database_url: str, spill: Path, **server: Any) -> Config:
    """Tenants: `open` (fails open), `closed` (`fail_open: false`) and `frugal` (a daily
    budget one priced call uses up)."""
    main = UpstreamConfig(kind="openai", base_url=upstream_url, api_key="upstream-key")
    settings = {
        "storage_timeout_ms": 500,
        "spill_path": str(spill),
        "spill_replay_seconds": 0.2,
        "limits_sync_seconds": 0.2,
        **server,
    }
    return Config(
        server=ServerConfig(**settings),
        database=DatabaseConfig(url=database_url),
        upstreams={"main": main},
        pricing={"priced-model": PriceConfig(input_per_mtok=1.0, output_per_mtok=2.0)},
        tenants={
            "open": TenantConfig(api_keys=[OPEN], upstream="main"),
            "closed": TenantConfig(api_keys=[CLOSED], upstream="main", fail_open=False),
            "frugal": TenantConfig(
                api_keys=[FRUGAL], upstream="main", limits=Limits(budget_usd_day=0.00001)
            ),
        },
    )


def sdk(base_url: str, key: str = OPEN) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def say(
    client: openai.AsyncOpenAI, text: str, conversation: str = "c1", *, stream: bool = False
) -> tuple[str, httpx.Headers]:
    """One turn of user `u1` in `conversation`; the reply's text and the response headers."""
    headers = {"X-Memory-User-Id": "u1", "X-Memory-Conversation-Id": conversation}
    messages: Any = [{"role": "user", "content": text}]
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=messages, extra_headers=headers
        )
        reply = raw.parse().choices[0].message.content
        return reply or "", raw.headers
    raw_stream = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=messages, extra_headers=headers, stream=True
    )
    parts = [c.choices[0].delta.content or "" async for c in raw_stream.parse() if c.choices]
    return "".join(parts), raw_stream.headers


async def stored(base_url: str, conversation: str = "c1") -> list[tuple[str, str, str]]:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
        got = await http.get(f"{base_url}/memory/conversations/{conversation}/messages")
        if got.status_code == 404:
            return []
        assert got.status_code == 200, got.text
        return [(m["role"], m["content"], m["status"]) for m in got.json()["data"]]


async def has(
    base_url: str, count: int, spill: Path | None = None, conversation: str = "c1"
) -> bool:
    """Whether `conversation` holds `count` messages (and the spill is replayed and gone)."""
    done = spill is None or not await asyncio.to_thread(spill.exists)
    return done and len(await stored(base_url, conversation)) == count


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, "the spill was not replayed in time"
        await asyncio.sleep(0.1)


async def ready(base_url: str) -> int:
    async with httpx.AsyncClient() as http:
        return (await http.get(base_url.removesuffix("/v1") + "/readyz")).status_code


def metric(base_url: str, name: str, label: str) -> float:
    """The sum of `name`'s samples that carry `label` (e.g. `reason="timeout"`)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own, to stop and start again."""
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


async def test_a_database_outage_is_answered_degraded_and_replayed_once_it_is_back(
    own_postgres: PostgresServer,
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    tmp_path: Path,
) -> None:
    fake, upstream_url = fake_upstream
    spill = tmp_path / "spill.jsonl"
    url = own_postgres.url(own_postgres.create_database())
    # No periodic replay: the first turn after the outage has to bring the spill in itself.
    base = serve_proxy(config(upstream_url, url, spill, spill_replay_seconds=3600))
    async with sdk(base) as client, sdk(base, CLOSED) as closed, sdk(base, FRUGAL) as frugal:
        first, headers = await say(client, "turn 1")
        assert headers["x-memory-status"] == "ok"

        own_postgres.pause()
        replies = [first]
        for n, stream in ((2, False), (3, True), (4, False)):
            reply, headers = await say(client, f"turn {n}", stream=stream)
            assert headers["x-memory-status"] == "degraded"
            assert "x-memory-conversation-id" not in headers  # (none was stored)
            replies.append(reply)
        assert spill.stat().st_size > 0
        assert metric(base, "memproxy_memory_degraded_requests_total", 'reason="unavailable"') == 3
        assert await ready(base) == 503
        # The export decides its status before it streams: an error, not a cut-off document.
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
            export = await http.get(f"{base}/memory/users/u1/export")
        assert export.status_code == 503
        assert export.json()["error"]["code"] == "service_unavailable"

        # A tenant that does not fail open is refused, and its upstream never called.
        calls = len(fake.chat_requests)
        with pytest.raises(openai.InternalServerError) as refused:
            await say(closed, "not without memory", "c9")
        assert refused.value.status_code == 503
        assert refused.value.response.json()["error"]["code"] == "memory_unavailable"
        assert len(fake.chat_requests) == calls

        # Limits go on from what this process counted: a priced call uses the day's budget.
        priced: Any = [{"role": "user", "content": "hello"}]
        await frugal.chat.completions.create(model="priced-model", messages=priced)
        with pytest.raises(openai.RateLimitError) as limited:
            await frugal.chat.completions.create(model="priced-model", messages=priced)
        assert limited.value.response.json()["error"]["code"] == "insufficient_quota"

        own_postgres.resume()
        # The user's next turn: their spilled turns go in first, so it finds its whole
        # conversation, and is stored after them.
        reply, headers = await say(client, "turn 5")
        assert headers["x-memory-status"] == "ok"
        assert headers["x-memory-history-messages"] == "8"
        replies.append(reply)

    expected = []
    for n, reply in enumerate(replies, 1):
        expected += [("user", f"turn {n}", "complete"), ("assistant", reply, "complete")]
    assert await stored(base) == expected
    assert not await asyncio.to_thread(spill.exists)
    replayed = 'result="replayed"'
    assert metric(base, "memproxy_spill_replayed_requests_total", replayed) == 4  # + frugal's
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
        exchanges = (await http.get(f"{base}/memory/users/u1/export")).json()["exchanges"]
    assert sorted(e["status"] for e in exchanges) == ["complete"] * 5
    assert await ready(base) == 200


def hold_sqlite(path: Path) -> sqlite3.Connection:
    """Another process's write lock on the file: our writes wait for it (busy_timeout)."""
    holder = sqlite3.connect(path, isolation_level=None, timeout=1)
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def test_a_slow_database_degrades_at_the_timeout_and_a_full_spill_is_a_503(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    fake, upstream_url = fake_upstream
    spill, db = tmp_path / "spill.jsonl", tmp_path / "memproxy.db"
    # Room for one turn of about 1,500 bytes and its outcome, not for a second turn.
    settings = config(upstream_url, f"sqlite+aiosqlite:///{db}", spill, spill_max_bytes=2500)
    base = serve_proxy(settings)
    async with sdk(base) as client:
        before, _ = await say(client, "before")
        await eventually(lambda: has(base, 2))  # (its reply is written after the response)
        holder = hold_sqlite(db)
        try:
            reply, headers = await say(client, "slow " + "x" * 1500)
            assert headers["x-memory-status"] == "degraded"
            assert metric(base, "memproxy_memory_degraded_requests_total", 'reason="timeout"') == 1
            calls = len(fake.chat_requests)
            with pytest.raises(openai.InternalServerError) as refused:
                await say(client, "refused " + "x" * 1500)
            assert refused.value.status_code == 503
            assert refused.value.response.json()["error"]["code"] == "memory_spill_full"
            assert refused.value.response.headers["retry-after"] == "5"
            assert len(fake.chat_requests) == calls  # the upstream was never asked
        finally:
            holder.execute("ROLLBACK")
            holder.close()

        # The turn that timed out was written once the lock went (its write was queued), and
        # the replay only adds its reply; the refused one was never stored.
        await eventually(lambda: has(base, 4, spill))
        assert await stored(base) == [
            ("user", "before", "complete"),
            ("assistant", before, "complete"),
            ("user", "slow " + "x" * 1500, "complete"),
            ("assistant", reply, "complete"),
        ]
        # The next turn sees the whole conversation again.
        _, headers = await say(client, "after")
        assert headers["x-memory-status"] == "ok"
        assert headers["x-memory-history-messages"] == "4"


async def test_erasing_a_user_removes_their_spilled_turns(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    _, upstream_url = fake_upstream
    spill, db = tmp_path / "spill.jsonl", tmp_path / "memproxy.db"
    # No replay while the test runs: only the next start-up's.
    settings = config(upstream_url, f"sqlite+aiosqlite:///{db}", spill, spill_replay_seconds=3600)
    base = serve_proxy(settings)
    async with sdk(base) as client:
        await say(client, "kept apart", "other")
        await eventually(lambda: has(base, 2, conversation="other"))
        holder = hold_sqlite(db)
        try:
            _, headers = await say(client, "forget me")
            assert headers["x-memory-status"] == "degraded"
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        kinds = [json.loads(line)["kind"] for line in spill.read_bytes().splitlines()]
        assert kinds == ["turn", "outcome"]
        assert b"forget me" in spill.read_bytes()
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
            erased = await http.delete(f"{base}/memory/users/u1")
        assert erased.status_code == 200, erased.text
        assert erased.json()["deleted"]["spilled"] == 2
        assert spill.read_bytes() == b""
    # A restart replays what the spill holds: nothing of u1 comes back.
    again = serve_proxy(settings)
    assert await stored(again) == []
    assert await stored(again, "other") == []
