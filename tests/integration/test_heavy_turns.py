"""A heavy turn (a large import, HEAVY_TURN_MESSAGES or more) gets storage time in proportion
to its size: while the database is slow, an ordinary turn is answered degraded at the storage
timeout, and a heavy one sent beside it waits and is stored, answered `ok`. Before, it was
answered degraded at the same timeout, its client sent the next one at once, and the spill's
replay wrote the last: a flood the quiet tenants' turns waited behind (issue 34,
bench/tenant_fairness.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from proxy.pipeline.turn import HEAVY_TURN_MESSAGES
from tests.fakes.openai_upstream import FakeOpenAI
from tests.integration.test_degraded import OPEN, ServeProxy, on_sqlite, say, sdk, sqlite_locked


async def test_a_heavy_turn_waits_out_a_slow_database_that_degrades_an_ordinary_one(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    _, upstream_url = fake_upstream
    settings, _, db = on_sqlite(upstream_url, tmp_path)  # (storage timeout 0.5 s)
    base = serve_proxy(settings)
    size = 5 * HEAVY_TURN_MESSAGES  # five times the storage timeout
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"imported line {i}"}
        for i in range(size - 1)
    ] + [{"role": "user", "content": "and now?"}]
    headers = {
        "authorization": f"Bearer {OPEN}",
        "X-Memory-User-Id": "importer",
        "X-Memory-Conversation-Id": "import",
    }
    async with sdk(base) as client, httpx.AsyncClient(timeout=60) as http:
        with sqlite_locked(db):
            heavy = asyncio.ensure_future(
                http.post(
                    f"{base}/chat/completions",
                    json={"model": "gpt-4o-mini", "messages": messages},
                    headers=headers,
                )
            )
            _, ordinary = await say(client, "a quiet turn", user="quiet")
            assert ordinary["x-memory-status"] == "degraded"  # the lock outlasted its timeout
            assert not heavy.done()
        answered = await heavy  # the lock gone (about one storage timeout in)
        assert answered.status_code == 200, answered.text
        assert answered.headers["x-memory-status"] == "ok"
        conversation = await http.get(f"{base}/memory/conversations/import", headers=headers)
        assert conversation.json()["message_count"] in (size, size + 1)  # (+ the reply, once)
