"""`memproxy serve` against a database that is not there: it waits for one that is starting
(a database container beside the proxy), and says in one line why it gives up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import httpx
import pytest
import yaml

from storage import migrate
from tests.postgres import PostgresServer, free_port
from tests.processes import Replica, spawn, stop, wait_ready

KEY = "sk-tenant-key-0123456789"


def write_config(path: Path, url: str, wait_seconds: float) -> Path:
    database = {"url": url, "connect_wait_seconds": wait_seconds}
    path.write_text(yaml.safe_dump({"database": database, "tenants": {"t1": {"api_keys": [KEY]}}}))
    return path


def wait_for_line(replica: Replica, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in replica.log.read_text(errors="replace"):
        if time.monotonic() > deadline or replica.process.poll() is not None:
            pytest.fail(f"no {text!r} in the log:\n{replica.tail()}")
        time.sleep(0.05)


def test_a_database_that_never_answers_ends_start_up_with_one_line(tmp_path: Path) -> None:
    port = free_port()
    url = f"postgres://memproxy:hunter2@127.0.0.1:{port}/memproxy"
    replica = spawn("no-db", write_config(tmp_path / "c.yaml", url, 1.0), tmp_path)
    try:
        assert replica.process.wait(timeout=60) == 1
    finally:
        stop(replica)
    log = replica.log.read_text(errors="replace")
    assert "database_unreachable" in log and "attempt=1" in log  # (the waits, as warnings)
    last = log.strip().splitlines()[-1]
    assert last.startswith(
        f"memproxy: database: postgresql+asyncpg://memproxy:***@127.0.0.1:{port}"
    )
    assert "Connect call failed" in last and "tried" in last
    assert "Traceback" not in log and "hunter2" not in log


def test_start_up_waits_for_a_database_that_is_starting(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    url = own_postgres.url(own_postgres.create_database())
    own_postgres.pause()  # the database's container is still starting
    replica = spawn("waits", write_config(tmp_path / "c.yaml", url, 120), tmp_path)
    try:
        wait_for_line(replica, "database_unreachable")
        own_postgres.resume()
        wait_ready(replica)
        answer = httpx.post(
            replica.url + "/chat/completions",
            json={"model": "echo-1", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-memory-status"] == "ok"
    finally:
        stop(replica)


async def test_start_up_migrates_around_a_long_transaction(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """A long transaction holds a table the next migration changes: the migration gives up
    its wait every few seconds (so the table's other users are not held back behind it),
    says so, and is done once that transaction ends."""
    url = postgres_server.url(postgres_server.create_database())
    await asyncio.to_thread(migrate.upgrade, url, "0017")
    holder = await asyncpg.connect(url.replace("+asyncpg", "", 1))
    await holder.execute("BEGIN")
    await holder.execute("UPDATE messages SET status = status")
    replica = spawn("busy", write_config(tmp_path / "c.yaml", url, 30), tmp_path)
    try:
        try:
            await asyncio.to_thread(wait_for_line, replica, "migration_waiting_for_lock")
        finally:
            await holder.execute("COMMIT")
            await holder.close()
        await asyncio.to_thread(wait_ready, replica)
    finally:
        stop(replica)
    log = replica.log.read_text(errors="replace")
    assert "canceling statement due to lock timeout" in log and "attempt=1" in log
