"""Recall's time against how much a named user has stored, this code against an earlier one.

For each size (stored turns: a user message and a reply each), a fresh SQLite database in a
temp dir gets one named user whose conversations are LoCoMo's sessions (../shared/data,
`"<speaker>: <text>"`, the speakers' names in every message, as a user who names someone in
every turn), cycled until the size is reached; then LoCoMo's questions are asked of recall
(`proxy.pipeline.recall.recall`, words alone: embeddings off), in the same process, the
searches of this code and of `--baseline-rev` (its storage/repositories/search.py) taking
turns question by question, so drift hits both alike. Reported per size and code: recall's
p50 and p95 (`recall()`: search, neighbours, ranking, packing, rendering), the full-text
search's alone, and how many questions had the same section attached by both (the bounded
ranking's effect on what is attached). Target (issue 37): a user with 5,000 stored turns within 1.2x
of a new user.

    .venv/bin/python bench/recall_stored.py [--sizes 100,1000,5000,50000] [--questions 200]
        [--baseline-rev main] [--budget 2000] [--json figures.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Connection

from bench.recall_locomo import DATA, percentile, questions, sessions, turn_text
from policies.identity import chain_hashes
from policies.recall import query_terms
from proxy.core.offline import prepare_offline_environment
from proxy.pipeline import recall as recall_module
from storage import migrate
from storage.database import Database
from storage.records import NewMessage
from storage.repositories.conversations import Conversations
from storage.repositories.search import MessageSearch

TENANT, USER = "bench", "alice"
SESSION_TURNS = 20  # turns per stored conversation
TOKENS_PER_CANDIDATE = 40  # as proxy/pipeline/recall_turn.py


def baseline_search(rev: str) -> ModuleType:
    """storage/repositories/search.py as it was at `rev`, loaded as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:storage/repositories/search.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("baseline_search", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    exec(compile(source, f"{rev}:search.py", "exec"), module.__dict__)
    return module


def stored_turns(samples: list[dict[str, Any]]) -> list[tuple[datetime, str, str]]:
    """LoCoMo's turns as (when, role, text), in order, speaker a as the user."""
    found = []
    for sample in samples:
        speaker_a = sample["conversation"]["speaker_a"]
        for _, when, turns in sessions(sample):
            for i, turn in enumerate(turns):
                role = "user" if turn["speaker"] == speaker_a else "assistant"
                found.append((when + timedelta(seconds=i), role, turn_text(turn)))
    return found


async def seed(db: Database, size: int, source: list[tuple[datetime, str, str]]) -> None:
    """`size` turns for the user: conversations of SESSION_TURNS turns, LoCoMo's cycled."""
    messages = [source[i % len(source)] for i in range(2 * size)]
    # Roles alternate, as a conversation's do (LoCoMo's speakers do not always).
    per = 2 * SESSION_TURNS
    for start in range(0, len(messages), per):
        chunk = messages[start : start + per]

        def work(
            conn: Connection, chunk: list[tuple[datetime, str, str]] = chunk, start: int = start
        ) -> None:
            repo = Conversations(conn)
            when = chunk[0][0]
            conv = repo.create(TENANT, USER, f"s{start}", now=when)
            said = [
                {"role": "user" if i % 2 == 0 else "assistant", "content": text}
                for i, (_, _, text) in enumerate(chunk)
            ]
            new = [
                NewMessage(m["role"], m["content"], len(m["content"]) // 4 + 4, chain_hash=h)
                for m, h in zip(said, chain_hashes(said, conv.chain_hash), strict=True)
            ]
            repo.append(conv, USER, new, now=when)

        await db.write(work)


async def ask(db: Database, question: str, budget: int) -> tuple[float, str]:
    """Recall's time for `question`, and what it attached."""
    started = time.perf_counter()
    found = await recall_module.recall(
        db,
        tenant_id=TENANT,
        user_id=USER,
        text=question,
        exclude=[],
        budget_tokens=budget,
        candidates=max(10, budget // TOKENS_PER_CANDIDATE),
        now=datetime(2024, 1, 1, tzinfo=UTC),
    )
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed, repr(found.section)


async def search_time(db: Database, search: type, question: str, budget: int) -> float:
    """The full-text search's own time for `question` (in the reader thread, as recall's)."""
    terms = query_terms(question)
    limit = max(10, budget // TOKENS_PER_CANDIDATE)

    def work(conn: Connection) -> float:
        started = time.perf_counter()
        search(conn).search(TENANT, USER, terms, limit=limit)
        return (time.perf_counter() - started) * 1000

    return await db.read(work)


def figures(times: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(times, 0.5), 2),
        "p95_ms": round(percentile(times, 0.95), 2),
        "mean_ms": round(sum(times) / len(times), 2),
    }


async def measure(
    size: int,
    searches: dict[str, type],
    asked: list[str],
    source: list[tuple[datetime, str, str]],
    budget: int,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'm.db'}"
        await asyncio.to_thread(migrate.upgrade, url)
        db = Database(url)
        try:
            started = time.perf_counter()
            await seed(db, size, source)
            seeded = time.perf_counter() - started
            times: dict[str, list[float]] = {}
            same = 0
            for _ in range(2):  # the first pass warms the page cache; the second is measured
                times = {name: [] for name in searches} | {f"{n} search": [] for n in searches}
                same = 0
                for question in asked:
                    ranked = []
                    for name, search in searches.items():
                        recall_module.MessageSearch = search  # type: ignore[misc]
                        ms, attached = await ask(db, question, budget)
                        times[name].append(ms)
                        ranked.append(attached)
                        times[f"{name} search"].append(
                            await search_time(db, search, question, budget)
                        )
                    same += all(r == ranked[0] for r in ranked)
        finally:
            recall_module.MessageSearch = MessageSearch  # type: ignore[misc]
            await db.dispose()
    return {
        "turns": size,
        "seeded_s": round(seeded, 1),
        "same_attached": f"{same}/{len(asked)}",
        **{name: figures(t) for name, t in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,5000,50000", help="stored turns, each run")
    parser.add_argument("--questions", type=int, default=200, help="LoCoMo questions asked")
    parser.add_argument("--baseline-rev", default="main", help="the search to compare against")
    parser.add_argument("--budget", type=int, default=2000, help="recall's token budget")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    prepare_offline_environment()
    samples = json.loads(DATA.read_text())
    source = stored_turns(samples)
    asked = [q["question"] for s in samples for q in questions(s)][: args.questions]
    searches = {"baseline": baseline_search(args.baseline_rev).MessageSearch, "now": MessageSearch}
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        result = asyncio.run(measure(size, searches, asked, source, args.budget))
        results.append(result)
        print(
            f"{size:>6} turns (seeded in {result['seeded_s']} s): "
            + "; ".join(
                f"{name} p50 {result[name]['p50_ms']:.2f} / p95 {result[name]['p95_ms']:.2f} ms"
                for name in [*searches, *(f"{n} search" for n in searches)]
            )
            + f"; same attached {result['same_attached']}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
