"""A full disk (issue 34): neither the database nor the spill can write. A fail-open tenant's
turn is still answered, degraded and marked `x-memory-stored: false` (fail-open promises
availability; nothing of the turn is kept), a fail-closed tenant's is a 503, and /readyz's
body and /metrics say the spill is unwritable (before, fail-open tenants got 503
`memory_unavailable` while /readyz said ok).

No small filesystem can be made here (and the tests run as root, whom a read-only directory
does not stop), so the spill file and its probe are links to /dev/full, which fails every
write with ENOSPC as a full disk does; the database cannot write behind another process's
lock on its file."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from structlog.testing import capture_logs

from tests.fakes.openai_upstream import FakeOpenAI
from tests.integration.test_degraded import (
    CLOSED,
    ServeProxy,
    eventually,
    exchanged,
    has,
    metric,
    on_sqlite,
    readiness,
    say,
    sdk,
    sqlite_locked,
    stored,
)

FULL = Path("/dev/full")

pytestmark = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")


def fill(spill: Path) -> None:
    """Every write to the spill (and to its probe beside it) fails: no space left."""
    for path in (spill, spill.with_name(spill.name + ".probe")):
        path.symlink_to(FULL)


def free(spill: Path) -> None:
    for path in (spill, spill.with_name(spill.name + ".probe")):
        path.unlink()


async def test_with_the_disk_full_fail_open_turns_are_answered_unstored_and_readyz_says_so(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    fake, upstream_url = fake_upstream
    settings, spill, db = on_sqlite(upstream_url, tmp_path)
    base = serve_proxy(settings)
    async with sdk(base) as client:
        before, headers = await say(client, "before the disk filled")
        assert headers["x-memory-status"] == "ok" and "x-memory-stored" not in headers
        fill(spill)

        status, body = await readiness(base)
        assert status == 200  # reported, not judged: fail-open tenants are still answered
        assert body["spill"] == "unwritable: [Errno 28] No space left on device", body
        assert metric(base, "memproxy_spill_writable", "") == 0

        with sqlite_locked(db):
            calls = len(fake.chat_requests)
            with capture_logs() as logs:
                reply, headers = await say(client, "while the disk is full")
            assert reply.startswith("fake reply to: while the disk is full")
            assert headers["x-memory-status"] == "degraded"
            assert headers["x-memory-stored"] == "false"
            assert len(fake.chat_requests) == calls + 1
            (logged,) = [e for e in logs if e["event"] == "memory_not_stored"]
            assert logged["spill_error"].startswith("[Errno 28]")
            assert metric(base, "memproxy_memory_not_stored_requests_total", 'tenant="open"') == 1
            assert metric(base, "memproxy_memory_degraded_requests_total", 'tenant="open"') == 1
            # Fail-closed is refused, as when the database alone is away.
            async with sdk(base, CLOSED) as closed:
                with pytest.raises(openai.InternalServerError) as refused:
                    await say(closed, "refused")
            assert refused.value.status_code == 503
            assert refused.value.response.json()["error"]["code"] == "memory_unavailable"

        free(spill)
        status, body = await readiness(base)
        assert (status, body["spill"]) == (200, "ok")
        assert metric(base, "memproxy_spill_writable", "") == 1
        after, headers = await say(client, "after")
        assert headers["x-memory-status"] == "ok" and "x-memory-stored" not in headers
        # The turn answered unstored was not stored later either: its write, still waiting for
        # the lock when the timeout answered the turn, was abandoned, not run once the lock went.
        turns = exchanged(["before the disk filled", "after"], [before, after])
        await eventually(lambda: has(base, 4), what="the turn after was not stored")
        assert await stored(base) == turns
