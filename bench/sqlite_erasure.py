"""What leaving nothing of an erased user in the SQLite file costs.

memproxy runs SQLite with `secure_delete` on (deleted content overwritten, not left in free
pages), and an erasure rewrites the full-text index without the deleted rows' words (FTS5
`optimize`) and empties the write-ahead log. This stores LoCoMo's turns (the five
conversations, `--users` times over, one user each, one turn of two messages per write
transaction, as a chat turn is stored) through the storage layer, alternately with
`secure_delete` off and on, and prints the mean time per stored turn of each and their ratio;
then, with it on, the time to erase one user (rows, index rewrite) and to empty the log.

    .venv/bin/python bench/sqlite_erasure.py [--users 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Connection

import storage.database
from storage import migrate
from storage.database import Database
from storage.records import NewMessage
from storage.repositories.conversations import Conversations
from storage.repositories.system import SystemRepository

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo-dev.json"
TENANT = "bench"


def turns(data: list[dict[str, object]]) -> list[list[str]]:
    """Each conversation's turns' texts, in order."""
    found = []
    for sample in data:
        conversation = sample["conversation"]
        assert isinstance(conversation, dict)
        texts = [
            str(t["text"])
            for key, session in conversation.items()
            if key.startswith("session_") and isinstance(session, list)
            for t in session
        ]
        found.append(texts)
    return found


async def store(db: Database, conversations: list[list[str]], users: int) -> tuple[float, int]:
    """Store every conversation `users` times, a turn (two messages) per transaction; returns
    (seconds, turns)."""
    now = datetime.now(UTC)
    stored = 0
    started = time.perf_counter()
    for user in range(users):
        for n, texts in enumerate(conversations):
            name = f"u{user}-c{n}"
            record = await db.write(
                lambda conn, name=name, user=user: Conversations(conn).create(
                    TENANT, f"user-{user}", name, now=now
                )
            )
            for i in range(0, len(texts) - 1, 2):
                pair = [
                    NewMessage(role, text, len(text) // 4, f"h{i + j}")
                    for j, (role, text) in enumerate(
                        zip(("user", "assistant"), texts[i : i + 2], strict=True)
                    )
                ]

                def append(conn: Connection, pair: list[NewMessage] = pair) -> None:
                    nonlocal record
                    record = Conversations(conn).append(record, record.user_id, pair, now=now)

                await db.write(append)
                stored += 1
    return time.perf_counter() - started, stored


async def run(secure: bool, conversations: list[list[str]], users: int) -> dict[str, float]:
    pragmas = storage.database.SQLITE_PRAGMAS
    if not secure:
        storage.database.SQLITE_PRAGMAS = tuple(p for p in pragmas if "secure_delete" not in p)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite+aiosqlite:///{tmp}/bench.db"
            migrate.upgrade(url)
            db = Database(url)
            try:
                seconds, count = await store(db, conversations, users)
                figures = {"turn_ms": seconds / count * 1000, "turns": count}

                def erase(conn: Connection) -> None:
                    Conversations(conn).delete_user(TENANT, "user-0")
                    SystemRepository(conn).drop_deleted_from_search()

                started = time.perf_counter()
                await db.write(erase)
                figures["erase_ms"] = (time.perf_counter() - started) * 1000
                started = time.perf_counter()
                await db.checkpoint()
                figures["checkpoint_ms"] = (time.perf_counter() - started) * 1000
                return figures
            finally:
                await db.dispose()
    finally:
        storage.database.SQLITE_PRAGMAS = pragmas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=10, help="copies of the five conversations")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args(argv)
    conversations = turns(json.loads(args.data.read_text()))
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for secure in (False, True):
            results[secure].append(asyncio.run(run(secure, conversations, args.users)))
    off = min(r["turn_ms"] for r in results[False])
    on = min(r["turn_ms"] for r in results[True])
    turns_stored = int(results[True][0]["turns"])
    print(f"{turns_stored} turns ({2 * turns_stored} messages) stored, best of {args.rounds} runs:")
    print(f"  secure_delete off: {off:.3f} ms per turn")
    print(f"  secure_delete on:  {on:.3f} ms per turn ({on / off:.2f}x)")
    erase = min(r["erase_ms"] for r in results[True])
    checkpoint = min(r["checkpoint_ms"] for r in results[True])
    print(
        f"  erasing one user of {args.users} (their rows, the index rewritten): {erase:.0f} ms;"
        f" emptying the log: {checkpoint:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
