"""Fail-open memory: the database goes away (a PostgreSQL server stopped) or is too slow (a
SQLite file another process holds), chat requests are still answered with
`x-memory-status: degraded`, what they would have stored waits in the spill, and once the
database is back the spill's replay stores each turn and reply exactly once, in order. A tenant
with `fail_open: false` gets 503s, a full spill turns degradation into 503s, limits keep being
enforced from the last counts, and erasing a user removes their spilled turns. After
`storage_breaker_threshold` failures in a row the storage circuit opens: turns are degraded at
once, without trying the database, until a trial or a replay finds it taking writes again. A
database that turns slow after a turn was stored holds up neither the turn's documents nor its
answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from structlog.testing import capture_logs

from policies.chunks import counted_chunks
from proxy.app import create_app
from proxy.core.config import (
    Config,
    ContextSettings,
    DatabaseConfig,
    IntentSettings,
    Limits,
    MemorySettings,
    PriceConfig,
    ServerConfig,
    SummarySettings,
    TenantConfig,
    UpstreamConfig,
)
from proxy.durability.spill import Spilled, SpillFile
from proxy.pipeline.memory import ConversationMemory
from tests.fakes.openai_upstream import FakeOpenAI, model_said
from tests.fakes.server import ServerThread
from tests.postgres import PostgresServer

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
    client: openai.AsyncOpenAI,
    text: str,
    conversation: str = "c1",
    *,
    stream: bool = False,
    user: str = "u1",
    body: dict[str, Any] | None = None,
) -> tuple[str, httpx.Headers]:
    """One turn of `user` in `conversation` (`body`: more of the request's body); the reply's
    text and the response headers."""
    headers = {"X-Memory-User-Id": user, "X-Memory-Conversation-Id": conversation}
    messages: Any = [{"role": "user", "content": text}]
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=messages, extra_headers=headers, extra_body=body
        )
        reply = raw.parse().choices[0].message.content
        return reply or "", raw.headers
    raw_stream = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=messages, extra_headers=headers, extra_body=body, stream=True
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


def exchanged(texts: list[str], replies: list[str]) -> list[tuple[str, str, str]]:
    """A conversation of these turns and replies, each stored complete, as `stored` reads it."""
    return [
        message
        for text, reply in zip(texts, replies, strict=True)
        for message in (("user", text, "complete"), ("assistant", reply, "complete"))
    ]


async def has(
    base_url: str, count: int, spill: Path | None = None, conversation: str = "c1"
) -> bool:
    """Whether `conversation` holds `count` messages (and the spill is replayed and gone)."""
    done = spill is None or not await asyncio.to_thread(spill.exists)
    return done and len(await stored(base_url, conversation)) == count


async def eventually(
    check: Callable[[], Awaitable[bool]],
    seconds: float = 30.0,
    what: str = "the spill was not replayed in time",
) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def readiness(base_url: str) -> tuple[int, dict[str, Any]]:
    """/readyz's status and body; HEAD /readyz (an uptime monitor's) says the same, bodiless."""
    async with httpx.AsyncClient() as http:
        answer = await http.get(base_url.removesuffix("/v1") + "/readyz")
        headed = await http.head(base_url.removesuffix("/v1") + "/readyz")
        assert (headed.status_code, headed.content) == (answer.status_code, b""), answer.json()
        return answer.status_code, answer.json()


async def ready(base_url: str) -> int:
    return (await readiness(base_url))[0]


def circuit_is(base_url: str, state: str) -> Callable[[], Awaitable[bool]]:
    """A check that /readyz reports the storage circuit in `state` (and stays ready)."""

    async def check() -> bool:
        status, body = await readiness(base_url)
        assert status == 200, body  # an open circuit never makes a replica unready
        return body["storage_circuit"] == state

    return check


def metric(base_url: str, name: str, label: str) -> float:
    """The sum of `name`'s samples that carry `label` (e.g. `reason="timeout"`; "": all)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and label in line
    )


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
    # No storage circuit: every turn here tries the database (its own tests are below).
    settings = config(
        upstream_url, url, spill, spill_replay_seconds=3600, storage_breaker_threshold=0
    )
    base = serve_proxy(settings)
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
        assert refused.value.response.headers["retry-after"] == "5"
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

    texts = [f"turn {n}" for n in range(1, len(replies) + 1)]
    assert await stored(base) == exchanged(texts, replies)
    # The user's catch-up replayed their own turns only: frugal's (another tenant's) waits
    # for the next round (issue 34: no turn waits behind another tenant's spill).
    replayed = 'result="replayed"'
    assert metric(base, "memproxy_spill_replayed_requests_total", replayed) == 3
    assert not await asyncio.to_thread(spill.exists)
    assert await asyncio.to_thread(spill.with_name(spill.name + ".replaying").exists)
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
        exchanges = (await http.get(f"{base}/memory/users/u1/export")).json()["exchanges"]
    assert sorted(e["status"] for e in exchanges) == ["complete"] * 5
    assert await ready(base) == 200


async def test_a_hung_database_is_reported_unready_within_the_timeout(
    own_postgres: PostgresServer,
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    tmp_path: Path,
) -> None:
    _, upstream_url = fake_upstream
    url = own_postgres.url(own_postgres.create_database())
    base = serve_proxy(config(upstream_url, url, tmp_path / "spill.jsonl"))
    assert await ready(base) == 200
    own_postgres.freeze()
    try:
        # Every process of the server stopped where it stood: nothing answers, nothing is
        # refused. The probe still answers, while the database is hung.
        status, body = await readiness(base)
        async with sdk(base) as client:
            _, headers = await say(client, "said to a hung database")
    finally:
        own_postgres.thaw()
    assert (status, body["database"]) == (503, "timeout")
    assert headers["x-memory-status"] == "degraded"
    await eventually(lambda: _ready_again(base), what="not ready once the database went on")


async def _ready_again(base_url: str) -> bool:
    return await ready(base_url) == 200


def on_sqlite(upstream_url: str, tmp_path: Path, **server: Any) -> tuple[Config, Path, Path]:
    """`config` on a SQLite file: (the config, its spill, its database file)."""
    spill, db = tmp_path / "spill.jsonl", tmp_path / "memproxy.db"
    return config(upstream_url, f"sqlite+aiosqlite:///{db}", spill, **server), spill, db


@contextlib.contextmanager
def sqlite_locked(path: Path) -> Iterator[None]:
    """Another process's write lock on the file while in the block: our writes wait for it
    (busy_timeout)."""
    holder = sqlite3.connect(path, isolation_level=None, timeout=1)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


async def test_a_slow_database_degrades_at_the_timeout_and_a_full_spill_is_a_503(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    fake, upstream_url = fake_upstream
    # Room for one turn of about 1,500 bytes and its outcome, not for a second turn.
    settings, spill, db = on_sqlite(upstream_url, tmp_path, spill_max_bytes=2500)
    base = serve_proxy(settings)
    async with sdk(base) as client:
        before, _ = await say(client, "before")
        await eventually(lambda: has(base, 2))  # (its reply is written after the response)
        with sqlite_locked(db):
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


async def test_a_degraded_turns_own_document_is_attached_and_stored_once_it_is_back(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    """The request's inline document goes to the model while storage is away, and the spill
    keeps it with the turn: the replay stores it with the conversation, as live."""
    fake, upstream_url = fake_upstream
    settings, spill, db = on_sqlite(upstream_url, tmp_path, storage_timeout_ms=300)
    base = serve_proxy(settings)
    doc = {"attachments": [{"title": "notes", "content": "The launch code is PURPLE-42."}]}
    async with sdk(base) as client:
        with sqlite_locked(db):
            _, headers = await say(client, "what is the code?", body=doc)
        assert headers["x-memory-status"] == "degraded"
        assert "PURPLE-42" in str(fake.chat_requests[-1]["messages"])
        await eventually(lambda: has(base, 2, spill))
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
        listed = await http.get(f"{base}/memory/conversations/c1/attachments")
        assert listed.status_code == 200, listed.text
        assert [(a["title"], a["origin"]) for a in listed.json()["data"]] == [("notes", "inline")]


async def test_the_llm_intent_of_a_degraded_exchange_and_its_cost_join_its_record_once_stored(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    """A degraded request with an LLM intent: the classifier's label and its cost (counted
    against the tenant's budget at once) wait in the spill with the exchange, and join its
    record once that is replayed, as they would have live (the replay alone would classify
    the turn by keywords, and charge nothing)."""
    fake, upstream_url = fake_upstream
    settings, spill, db = on_sqlite(upstream_url, tmp_path)
    intent = IntentSettings(mode="llm", wait_for_llm=True, timeout_ms=60_000)
    settings.tenants["open"] = TenantConfig(api_keys=[OPEN], upstream="main", intent=intent)
    base = serve_proxy(settings)
    # The classifier is asked (and waited for) first, then the model. Its label is one the
    # keywords would not give this question.
    fake.script = [model_said('{"label": "feedback", "confidence": 0.9}', usage=(1000, 100))]
    async with sdk(base) as client:
        with sqlite_locked(db):
            _, headers = await say(client, "Is it degraded?")
            assert headers["x-memory-status"] == "degraded"
            assert headers["x-memory-intent"].startswith("feedback;")
            for kind in ("intent", "charge"):
                await eventually(lambda k=kind: _spilled(spill, k), what=f"no {kind} spilled")
        await eventually(lambda: has(base, 2, spill))
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
            got = await http.get(f"{base}/memory/exchanges/{headers['x-request-id']}")
        record = got.json()
        assert (record["status"], record["intent"]) == ("complete", "feedback")
        parts = [
            (p["kind"], p["prompt_tokens"], p["completion_tokens"]) for p in record["cost"]["parts"]
        ]
        assert parts == [("intent", 1000, 100)]


async def _spilled(spill: Path, kind: str) -> bool:
    """Whether the spill holds an entry of `kind` (in its file, or in the one a replay round
    has taken)."""

    def read() -> bytes:
        files = (spill, spill.with_name(spill.name + ".replaying"))
        return b"".join(f.read_bytes() for f in files if f.exists())

    lines = await asyncio.to_thread(read)
    return any(line.startswith(b'{"kind":"' + kind.encode() + b'"') for line in lines.splitlines())


async def test_erasing_a_user_removes_their_spilled_turns(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    _, upstream_url = fake_upstream
    # No replay while the test runs: only the next start-up's.
    settings, spill, db = on_sqlite(upstream_url, tmp_path, spill_replay_seconds=3600)
    base = serve_proxy(settings)
    async with sdk(base) as client:
        await say(client, "kept apart", "other")
        await eventually(lambda: has(base, 2, conversation="other"))
        with sqlite_locked(db):
            _, headers = await say(client, "forget me")
            assert headers["x-memory-status"] == "degraded"
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


DEGRADED = "memproxy_memory_degraded_requests_total"


def circuit_log(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["state"], e["by"]) for e in logs if e["event"] == "storage_circuit"]


async def test_a_slow_database_opens_the_storage_circuit_until_a_trial_finds_it_back(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    fake, upstream_url = fake_upstream
    settings, _, db = on_sqlite(
        upstream_url,
        tmp_path,
        storage_timeout_ms=800,
        storage_breaker_threshold=2,
        # Long enough that the turns meant to meet an open circuit (five requests, one a
        # stream) are all sent within it on a machine busy with other tests; a shorter one let
        # one of them become an extra trial in CI.
        storage_breaker_open_seconds=4,
        spill_replay_seconds=3600,  # no replay rounds: only a turn's catch-up writes the spill
    )
    base = serve_proxy(settings)

    def count(reason: str) -> float:
        return metric(base, DEGRADED, f'reason="{reason}"')

    texts, replies = ["before", "turn 1", "turn 2", "turn 3", "turn 4", "turn 5"], []
    with capture_logs() as logs:
        async with sdk(base) as client, sdk(base, CLOSED) as closed:
            reply, _ = await say(client, "before")
            replies.append(reply)
            await eventually(lambda: has(base, 2))  # (its reply is written after the response)
            with sqlite_locked(db):
                # Two slow turns in a row open the circuit. (Of two users: a second turn of u1
                # would first try to replay its first, and that replay, left waiting for the
                # lock, would close the circuit as soon as the lock goes, before any trial.)
                reply, headers = await say(client, "turn 1")
                assert headers["x-memory-status"] == "degraded"
                replies.append(reply)
                _, headers = await say(client, "elsewhere", "c2", user="u2")
                assert headers["x-memory-status"] == "degraded"
                assert count("timeout") == 2
                assert metric(base, "memproxy_storage_circuit_open", "") == 1
                assert await circuit_is(base, "open")()

                # Open: answered degraded at once, the database not tried (with the lock still
                # held, a try would have timed out), the turns kept in the spill.
                for n, stream in ((2, False), (3, True)):
                    reply, headers = await say(client, f"turn {n}", stream=stream)
                    assert headers["x-memory-status"] == "degraded"
                    replies.append(reply)
                assert (count("circuit_open"), count("timeout")) == (2, 2)
                # A tenant that does not fail open is refused at once, its upstream not called.
                calls = len(fake.chat_requests)
                with pytest.raises(openai.InternalServerError) as refused:
                    await say(closed, "not without memory", "c9")
                assert refused.value.status_code == 503
                assert refused.value.response.json()["error"]["code"] == "memory_unavailable"
                assert len(fake.chat_requests) == calls
                assert count("timeout") == 2

                # After open_seconds one turn tries, and (the lock still held) fails: the
                # circuit opens again, and the next turn is not tried.
                await eventually(circuit_is(base, "half_open"), what="never half-open")
                _, headers = await say(client, "the trial", "c3", user="u3")
                assert headers["x-memory-status"] == "degraded"
                assert count("timeout") == 3
                assert await circuit_is(base, "open")()
                reply, headers = await say(client, "turn 4")
                assert headers["x-memory-status"] == "degraded"
                replies.append(reply)
                assert (count("circuit_open"), count("timeout")) == (3, 3)

            # The next trial finds the database back: u1's spilled turns go in first, in
            # order, then the new one, which sees them all as history.
            await eventually(circuit_is(base, "half_open"), what="never half-open again")
            reply, headers = await say(client, "turn 5")
            assert headers["x-memory-status"] == "ok"
            assert headers["x-memory-history-messages"] == "10"
            replies.append(reply)
            assert await circuit_is(base, "closed")()
            assert metric(base, "memproxy_storage_circuit_open", "") == 0
            assert count("circuit_open") == 3
            await eventually(lambda: has(base, 12))
    assert await stored(base) == exchanged(texts, replies)
    # The circuit's changes are logged once each, the turns it turned away not at all.
    assert circuit_log(logs) == [
        ("open", "failures"),
        ("open", "trial"),
        ("closed", "spill_replay"),
    ], [e for e in logs if any(w in e["event"] for w in ("circuit", "degraded", "spill", "sto"))]
    degraded = [e["reason"] for e in logs if e["event"] == "memory_degraded"]
    assert degraded == ["timeout"] * 3


async def test_a_replay_that_stores_closes_the_storage_circuit_before_its_time(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    _, upstream_url = fake_upstream
    settings, spill, db = on_sqlite(
        upstream_url,
        tmp_path,
        storage_breaker_threshold=1,
        storage_breaker_open_seconds=3600,  # no trial while the test runs
    )
    base = serve_proxy(settings)
    replies = []
    async with sdk(base) as client:
        reply, _ = await say(client, "before")
        replies.append(reply)
        await eventually(lambda: has(base, 2))
        with sqlite_locked(db):
            for n in (1, 2):
                reply, headers = await say(client, f"turn {n}")
                assert headers["x-memory-status"] == "degraded"
                replies.append(reply)
            reasons = ('reason="timeout"', 'reason="circuit_open"')
            assert [metric(base, DEGRADED, reason) for reason in reasons] == [1, 1]
        # The periodic replay stores the spilled turns, and that closes the circuit.
        await eventually(circuit_is(base, "closed"), what="the replay did not close it")
        reply, headers = await say(client, "turn 3")
        assert headers["x-memory-status"] == "ok"
        replies.append(reply)
        await eventually(lambda: has(base, 8, spill))
    assert await stored(base) == exchanged(["before", "turn 1", "turn 2", "turn 3"], replies)


@pytest.mark.parametrize("then", ["half_open", "open"])
async def test_a_thin_client_repeating_its_answered_turn_keeps_both_while_the_reply_is_spilled(
    then: str,
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user says "yes" twice. The first "yes" is stored, but its reply goes to the spill (the
    circuit opened meanwhile), and the disk is slow to take it. The second "yes" is a new turn,
    not a retry of the first: the client had its answer. It is stored after the first's reply,
    whether it reaches the database (`half_open`: the circuit lets a trial through) or the
    spill (`open`), and never taken for the first resent."""
    fake, upstream_url = fake_upstream
    settings, spill, db = on_sqlite(
        upstream_url,
        tmp_path,
        storage_timeout_ms=1500,
        storage_breaker_threshold=1,
        storage_breaker_open_seconds=2 if then == "half_open" else 3600,
        spill_replay_seconds=3600,  # only a turn's catch-up, or a restart, replays
    )
    disk = threading.Event()  # set: the spill takes u1's outcomes again
    add = SpillFile._add

    def slow_disk(self: SpillFile, entry: Spilled, bounded: bool) -> None:
        if entry.kind == "outcome" and entry.user_id == "u1":
            assert disk.wait(30)
        add(self, entry, bounded)

    monkeypatch.setattr(SpillFile, "_add", slow_disk)
    waits = threading.Event()  # set: a turn of u1 waits for a reply write still under way
    settle = ConversationMemory.settle

    async def observed(
        self: ConversationMemory, tenant_id: str, user_id: str | None = None
    ) -> None:
        if user_id == "u1" and self._unsettled.get((tenant_id, user_id)):
            waits.set()
        await settle(self, tenant_id, user_id)

    monkeypatch.setattr(ConversationMemory, "settle", observed)
    with ServerThread(create_app(settings)) as first_run:  # (stopped however the test ends)
        base = first_run.url + "/v1"
        replies = []
        async with sdk(base) as client:
            reply, _ = await say(client, "before")
            replies.append(reply)
            await eventually(lambda: has(base, 2))
            fake.script = [dataclasses.replace(model_said("Yes to the first."), hold=True)]
            first = asyncio.ensure_future(say(client, "yes"))
            await eventually(lambda: _arrived(fake, 2))  # stored, and waiting for its answer
            with sqlite_locked(db):  # another user's turn times out: the circuit opens
                _, headers = await say(client, "elsewhere", "c2", user="u2")
                assert headers["x-memory-status"] == "degraded"
            assert await circuit_is(base, "open")()
            fake.release.set()
            reply, headers = await first  # answered; its reply waits for the disk
            assert headers["x-memory-status"] == "ok"
            replies.append(reply)

            await eventually(circuit_is(base, then), what=f"never {then}")
            second = asyncio.ensure_future(say(client, "yes"))
            try:  # it arrived while the reply was on its way
                assert await asyncio.to_thread(waits.wait, 30), (
                    "the turn did not wait for the reply"
                )
            finally:
                disk.set()
            reply, _ = await second
            replies.append(reply)
    # A restart replays whatever the spill still holds. The first process has stopped:
    # on SQLite one process writes, and a new one takes whatever is in progress for
    # abandoned.
    base = serve_proxy(settings)
    # (The spill file goes when its replay begins: wait for what the replay stores too.)
    await eventually(lambda: has(base, 6, spill))
    assert await stored(base) == exchanged(["before", "yes", "yes"], replies)


Slowed = Callable[[], contextlib.AbstractAsyncContextManager[None]]


@pytest.fixture
def slowed(database_kind: str, database_url: str) -> Slowed:
    """A way to make `database_url` slower than the storage timeout for a while: SQLite's file
    write-locked by another process (reads still answer; a write gives up after SQLite's busy
    timeout, 10 s), or PostgreSQL's attachment and summary tables locked by another
    transaction (whatever touches them waits for as long as it lasts)."""

    @contextlib.asynccontextmanager
    async def locked() -> AsyncIterator[None]:
        if database_kind == "sqlite":
            with sqlite_locked(Path(database_url.removeprefix("sqlite+aiosqlite:///"))):
                yield
            return
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn, conn.begin():
                tables = "attachments, attachment_chunks, summaries"
                await conn.execute(text(f"LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE"))
                yield  # (rolled back on the way out)
        finally:
            await engine.dispose()

    return locked


REPORT = "\n\n".join(
    ["The quarterly report covers regional sales figures and staffing in the north office."] * 60
)
GIST = "The report covers sales and staffing."


async def test_a_degraded_request_does_not_wait_for_the_summary_cache_too(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    """Storage away from the start: the turn's own write gives up at the timeout, and the
    summary of its large inline document is made without waiting for the cache's read and
    write as well (each would wait out the timeout again)."""
    fake, upstream_url = fake_upstream
    settings, _, db = on_sqlite(upstream_url, tmp_path, storage_timeout_ms=300)
    settings.tenants["open"] = TenantConfig(
        api_keys=[OPEN],
        upstream="main",
        context=ContextSettings(token_budget=1000),
        summaries=SummarySettings(mode="llm"),
    )
    base = serve_proxy(settings)
    fake.script = [model_said(GIST)]
    with capture_logs() as logs:
        async with sdk(base) as client:
            with sqlite_locked(db):
                body = {"attachments": [{"content": REPORT, "title": "report"}]}
                _, headers = await say(client, "What's the gist?", body=body)
    assert headers["x-memory-status"] == "degraded"
    assert GIST in fake.chat_requests[-1]["messages"][0]["content"]
    events = [e["event"] for e in logs]
    assert not {"summary_cache_unavailable", "summary_not_cached"} & set(events), events


async def test_a_request_with_a_document_is_answered_while_storage_is_slow_after_its_turn(
    database_url: str,
    slowed: Slowed,
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    tmp_path: Path,
) -> None:
    """The database turns slow once the turn is stored (while the tenant's LLM classifier
    holds its reply): storing the inline document (and on PostgreSQL reading the
    conversation's) and the summary cache around the summariser's call each give up at the
    timeout, and the request is answered with the document's summary before the database is
    fast again. The summariser itself, slower than the storage timeout, is not cut short by
    it. Afterwards the turn and its reply are stored once, and the document whole or not at
    all."""
    fake, upstream_url = fake_upstream
    spill = tmp_path / "spill.jsonl"
    settings = config(upstream_url, database_url, spill)
    settings.tenants["open"] = TenantConfig(
        api_keys=[OPEN],
        upstream="main",  # the classifier and the summariser too: the fake answers in turn
        context=ContextSettings(token_budget=1000),
        intent=IntentSettings(mode="llm", wait_for_llm=True, timeout_ms=120_000),
        summaries=SummarySettings(mode="llm"),
        # (Not about embeddings: loading the local model and embedding the turns on a machine
        # busy with the whole suite made the last turn's storage run past the timeout.)
        memory=MemorySettings(embeddings="off"),
    )
    fake.script = [
        dataclasses.replace(model_said('{"label": "question", "confidence": 0.9}'), hold=True),
        model_said(GIST, delay=2 * settings.server.storage_timeout_ms / 1000),
    ]
    base = serve_proxy(settings)
    question = "What's the gist?"  # no word of the report: it is summarised
    headers = {"X-Memory-User-Id": "u1", "X-Memory-Conversation-Id": "c1"}
    attachments = {"attachments": [{"content": REPORT, "title": "report"}]}
    events: list[str] = []
    async with sdk(base) as client:
        asked = asyncio.ensure_future(
            client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": question}],
                extra_headers=headers,
                extra_body=attachments,
                timeout=60,  # (a guard: unbounded, the request waits for the database)
            )
        )
        await eventually(lambda: _arrived(fake, 1))  # the turn is stored; its intent asked
        async with slowed():
            events.append("storage slow")
            fake.release.set()
            raw = await asked
            events.append("answered")
        events.append("storage back")
        assert events == ["storage slow", "answered", "storage back"]
        reply = raw.parse().choices[0].message.content
        # The turn was stored, but what it could not store or read was skipped.
        assert raw.headers["x-memory-status"] == "degraded"
        sent = fake.chat_requests[-1]
        assert [m["role"] for m in sent["messages"]] == ["system", "user"]
        assert GIST in sent["messages"][0]["content"]  # the summary the plan asked for

        # Nothing half-written: the turn and its reply once each (the reply's late write or
        # the spill's replay), and the document whole (its write landed once the database
        # answered: SQLite) or not at all (rolled back: PostgreSQL).
        await eventually(lambda: has(base, 2, spill))
        assert await stored(base) == [
            ("user", question, "complete"),
            ("assistant", reply, "complete"),
        ]
        assert await _documents(base) in ([], [REPORT])
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
            got = await http.get(f"{base}/memory/exchanges/{raw.headers['x-request-id']}")
        record = got.json()
        assert record["status"] == "complete"
        attached = record["attached"]["attachments"]
        assert attached["storage"] == "unavailable"
        assert [(i["strategy"], i["cache"]) for i in attached["items"]] == [("summarize", "miss")]

        # The same document again, the database answering: the conversation holds it once.
        _, headers_again = await say(client, question, body=attachments)
        assert headers_again["x-memory-status"] == "ok"
        assert await _documents(base) == [REPORT]


# (On SQLite a reader never waits for a lock: its reads fail only with the disk.)
@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_a_turn_whose_recall_cannot_be_read_in_time_is_answered_degraded(
    database_url: str,
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    tmp_path: Path,
) -> None:
    """The database turns slow for reads once the turn is stored (while the classifier holds
    its reply): recall gives up at the timeout, and the answer, without the user's
    memories, says so."""
    fake, upstream_url = fake_upstream
    settings = config(upstream_url, database_url, tmp_path / "spill.jsonl")
    settings.tenants["open"] = TenantConfig(
        api_keys=[OPEN],
        upstream="main",
        intent=IntentSettings(mode="llm", wait_for_llm=True, timeout_ms=120_000),
    )
    fake.script = [model_said('{"label": "question", "confidence": 0.9}')]
    base = serve_proxy(settings)
    async with sdk(base) as client:
        _, headers = await say(client, "my cat is called Tom", "c0")
        assert headers["x-memory-status"] == "ok"
        fake.script = [
            dataclasses.replace(model_said('{"label": "question", "confidence": 0.9}'), hold=True)
        ]
        fake.release.clear()
        asked = asyncio.ensure_future(say(client, "what is my cat called?", "c1"))
        await eventually(lambda: _arrived(fake, 3))  # the turn is stored; its intent asked
        async with memories_locked(database_url):
            fake.release.set()
            _, headers = await asked
    assert headers["x-memory-status"] == "degraded"
    assert metric(base, "memproxy_memory_degraded_requests_total", 'reason="partial"') == 1
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
        got = await http.get(f"{base}/memory/exchanges/{headers['x-request-id']}")
    assert got.json()["attached"]["recall_storage"] == "unavailable"


@contextlib.asynccontextmanager
async def memories_locked(database_url: str) -> AsyncIterator[None]:
    """Reads of the user's memories (recall's first read) wait while in the block: the table
    is locked by another transaction."""
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn, conn.begin():
            await conn.execute(text("LOCK TABLE memories IN ACCESS EXCLUSIVE MODE"))
            yield  # (rolled back on the way out)
    finally:
        await engine.dispose()


async def _arrived(fake: FakeOpenAI, count: int) -> bool:
    return len(fake.chat_requests) >= count


async def _documents(base_url: str) -> list[str]:
    """The texts of conversation c1's documents, each checked whole (all its passages)."""
    texts = []
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {OPEN}"}) as http:
        listed = await http.get(f"{base_url}/memory/conversations/c1/attachments")
        assert listed.status_code == 200, listed.text
        for item in listed.json()["data"]:
            got = await http.get(f"{base_url}/memory/conversations/c1/attachments/{item['id']}")
            content = got.json()["content"]
            assert item["chunks"] == len(counted_chunks(content))
            texts.append(content)
    return texts
