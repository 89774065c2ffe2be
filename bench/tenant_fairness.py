"""One tenant floods the write path; another tenant's ordinary turns must stay `ok`.

Issue 34: while one tenant's 200,000-message request was written (and then replayed from the
spill), another tenant's ordinary requests were answered degraded at 3-5.4 s for about 65 s:
every write waited in one first-come-first-served queue behind the flood's. Now a request
holds at most `server.max_request_messages` (10,000) and writes are shared between tenants
in turn (storage/fair_slots.py).

One memproxy process (SQLite) and the fake upstream (bench/fake_upstream.py) in processes of
their own; tenant `flood` and tenant `quiet`. Per target:

- baseline: `quiet` sends `--turns` ordinary turns (a thin client, one short message each),
  one after another, nothing else running;
- flood: the same, while `--workers` clients of `flood` send requests of `--messages` messages
  each (every one new, so all of them are stored), back to back.

It prints `quiet`'s p50/p95 and its turns answered degraded, in both phases, and the flood's
requests and rows. `--compare REV` runs the same against another commit (e.g. the one before
the fix) in the same run, as the before figure.

    .venv/bin/python bench/tenant_fairness.py [--turns 40] [--workers 4] [--messages 10000]
        [--compare REV] [--json figures.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.overhead import (
    BENCH,
    ROOT,
    Server,
    export_revision,
    free_port,
    percentile,
    spawn,
    spawn_memproxy,
    wait_ready,
)

CHAT = "/v1/chat/completions"
FLOOD_KEY, QUIET_KEY = "flood-key", "quiet-key"


def config(upstream: str, home: Path) -> str:
    return (
        f'server: {{spill_path: "{home}/spill.jsonl"}}\n'
        f'database: {{url: "sqlite+aiosqlite:///{home}/memproxy.db"}}\n'
        "upstreams:\n"
        f"  fake: {{kind: openai, base_url: {upstream}/v1, api_key: bench-upstream-key}}\n"
        "defaults: {upstream: fake, memory: {embeddings: off}}\n"
        "tenants:\n"
        f"  flood: {{api_keys: [{FLOOD_KEY}]}}\n"
        f"  quiet: {{api_keys: [{QUIET_KEY}]}}\n"
    )


@contextlib.contextmanager
def upstream(workdir: Path) -> Iterator[Server]:
    port = free_port()
    command = [sys.executable, str(BENCH / "fake_upstream.py"), f"--port={port}"]
    server = spawn("upstream", [*command, "--latency=0.02", "--chunk-delay=0"], port, workdir)
    try:
        wait_ready(server)
        yield server
    finally:
        server.process.terminate()
        server.process.wait()


@contextlib.contextmanager
def memproxy(name: str, fake: Server, workdir: Path, code: Path) -> Iterator[Server]:
    home = workdir / name
    home.mkdir()
    (home / "config.yaml").write_text(config(fake.url, home))
    server = spawn_memproxy(name, home / "config.yaml", workdir, code)
    try:
        wait_ready(server, timeout=300)  # (a revision's tree compiles its modules first)
        yield server
    finally:
        server.process.terminate()
        server.process.wait()


async def quiet_turns(base: str, turns: int, label: str) -> dict[str, Any]:
    """`turns` ordinary turns of tenant `quiet`, one after another: their times and statuses."""
    headers = {
        "authorization": f"Bearer {QUIET_KEY}",
        "x-memory-user-id": "carol",
        "x-memory-conversation-id": f"quiet-{label}",
    }
    times, statuses = [], []
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
        for n in range(turns):
            body = {"model": "m", "messages": [{"role": "user", "content": f"ordinary turn {n}"}]}
            start = time.perf_counter()
            response = await client.post(CHAT, json=body)
            times.append(time.perf_counter() - start)
            statuses.append(
                response.headers.get("x-memory-status", str(response.status_code))
                if response.status_code == 200
                else str(response.status_code)
            )
            await asyncio.sleep(0.05)
    return {
        "p50_ms": round(percentile(times, 0.5) * 1000, 1),
        "p95_ms": round(percentile(times, 0.95) * 1000, 1),
        "max_ms": round(max(times) * 1000, 1),
        "degraded": sum(s == "degraded" for s in statuses),
        "errors": sum(s not in ("ok", "degraded") for s in statuses),
        "turns": turns,
    }


async def flood(base: str, messages: int, stop: asyncio.Event, worker: int) -> tuple[int, int]:
    """Requests of `messages` new messages each until `stop`: (requests, rows sent)."""
    headers = {"authorization": f"Bearer {FLOOD_KEY}", "x-memory-user-id": f"mallory-{worker}"}
    sent = rows = 0
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600) as client:
        while not stop.is_set():
            tag = uuid.uuid4().hex
            history = [
                {"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag} line {i}"}
                for i in range(messages - 1)
            ]
            history.append({"role": "user", "content": f"{tag} and now?"})
            response = await client.post(CHAT, json={"model": "m", "messages": history})
            sent += 1
            rows += messages if response.status_code == 200 else 0
    return sent, rows


async def scenario(base: str, args: argparse.Namespace) -> dict[str, Any]:
    baseline = await quiet_turns(base, args.turns, "baseline")
    stop = asyncio.Event()
    workers = [
        asyncio.create_task(flood(base, args.messages, stop, n)) for n in range(args.workers)
    ]
    await asyncio.sleep(args.warmup)  # the flood's first requests are being written
    flooded = await quiet_turns(base, args.turns, "flood")
    stop.set()
    done = await asyncio.gather(*workers)
    return {
        "baseline": baseline,
        "flood": flooded,
        "flood_requests": sum(d[0] for d in done),
        "flood_rows": sum(d[1] for d in done),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="memproxy-fairness-") as tmp:
        workdir = Path(tmp)
        targets = [("this checkout", ROOT)]
        if args.compare:
            targets.append((args.compare, export_revision(args.compare, workdir / "rev")))
        with upstream(workdir) as fake:
            for n, (label, code) in enumerate(targets):
                with memproxy(f"memproxy-{n}", fake, workdir, code) as server:
                    results[label] = await scenario(server.url, args)
                print(report({label: results[label]}, args), flush=True)
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"tenant `quiet`: {args.turns} ordinary turns; tenant `flood`: {args.workers} clients "
        f"sending {args.messages:,}-message requests back to back",
        f"{'target':<16}{'phase':<10}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}"
        f"{'degraded':>10}{'errors':>8}",
    ]
    for label, figures in results.items():
        for phase in ("baseline", "flood"):
            f = figures[phase]
            lines.append(
                f"{label[:15]:<16}{phase:<10}{f['p50_ms']:>9}{f['p95_ms']:>9}{f['max_ms']:>9}"
                f"{f['degraded']:>10}{f['errors']:>8}"
            )
        lines.append(
            f"{'':<16}flood: {figures['flood_requests']} requests, "
            f"{figures['flood_rows']:,} messages sent"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--compare", help="another commit, run the same way as the before figure")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
