"""What conversation memory costs as conversations grow, and under concurrent writers.

memproxy (memory on, SQLite in a temp dir) in front of the fake upstream, each in its own
process. Three conversations are imported through the management API with 100, 10,000 and
100,000 messages; then a thin client (X-Memory-Conversation-Id, newest message only) sends
the same kind of turn to each, interleaved round-robin so drift hits all three alike. Every
such request reads the conversation and its stored tail, attaches history within the default
budget, stores the turn and the reply. Target: the 100,000-message case within 1.2x of the
100-message case (only index-bounded reads).

Then 32 concurrent clients (half on conversations of their own, half sharing one) send turns
at once: no request may fail, and none with `database is locked`.

The added latency of memory on over memproxy's own pass-through mode (`X-Memory-Mode: off`)
and over a direct call is measured in the same run as the pass-through figures by
bench/overhead.py (its `memproxy` and `memproxy-off` rows).

    .venv/bin/python bench/history.py [--requests 200] [--json figures.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import http1
from bench.overhead import (
    API_KEY,
    CHAT_PATH,
    free_port,
    memproxy_config,
    percentile,
    run_loop,
    spawn,
    spawn_memproxy,
    wait_ready,
)

SIZES = (100, 10_000, 100_000)
TARGET_RATIO = 1.2
IMPORT_BATCH = 5_000
CONCURRENCY = 32


def turn(text: str) -> bytes:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}
    return json.dumps(body).encode()


def history(n: int, start: int = 0) -> list[dict[str, str]]:
    """Alternating user and assistant messages, a few words each."""
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"message {i} about topic {i % 97}",
        }
        for i in range(start, start + n)
    ]


async def post(client: http1.Client, path: str, body: bytes) -> tuple[int, bytes]:
    async with client.post(path, body) as reply:
        return reply.status_code, await reply.aread()


async def seed(base: str, size: int) -> str:
    """Import a conversation of `size` messages in batches; returns its id."""
    conversation = f"history-{size}"
    admin = http1.Client(
        base, {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    )
    try:
        first = min(size, IMPORT_BATCH)
        body = {"id": conversation, "user": "bench-user", "messages": history(first)}
        status, text = await post(admin, "/v1/memory/conversations", json.dumps(body).encode())
        assert status == 201, text
        for start in range(first, size, IMPORT_BATCH):
            batch = history(min(IMPORT_BATCH, size - start), start)
            path = f"/v1/memory/conversations/{conversation}/messages"
            status, text = await post(admin, path, json.dumps({"messages": batch}).encode())
            assert status == 201, text
    finally:
        await admin.aclose()
    return conversation


def thin_client(base: str, conversation: str) -> http1.Client:
    headers = {
        "authorization": f"Bearer {API_KEY}",
        "content-type": "application/json",
        "x-memory-user-id": "bench-user",
        "x-memory-conversation-id": conversation,
    }
    return http1.Client(base, headers)


async def timed(client: http1.Client, text: str) -> tuple[float, int, bytes]:
    started = time.perf_counter()
    status, body = await post(client, CHAT_PATH, turn(text))
    return time.perf_counter() - started, status, body


async def by_size(
    base: str, conversations: dict[int, str], requests: int, warmup: int
) -> dict[str, Any]:
    clients = {size: thin_client(base, c) for size, c in conversations.items()}
    latencies: dict[int, list[float]] = {size: [] for size in conversations}
    try:
        for i in range(warmup + requests):
            order = list(conversations)
            order = order[i % len(order) :] + order[: i % len(order)]
            for size in order:
                took, status, body = await timed(clients[size], f"question {i}?")
                assert status == 200, body[:300]
                if i >= warmup:
                    latencies[size].append(took)
    finally:
        for client in clients.values():
            await client.aclose()
    figures = {
        str(size): {
            "p50_ms": round(percentile(values, 0.5) * 1000, 3),
            "p99_ms": round(percentile(values, 0.99) * 1000, 3),
        }
        for size, values in latencies.items()
    }
    small, large = figures[str(SIZES[0])]["p50_ms"], figures[str(SIZES[-1])]["p50_ms"]
    return {
        "sizes": figures,
        "ratio": round(large / small, 3),
        "target_met": large / small <= TARGET_RATIO,
    }


async def concurrent(base: str, per_client: int) -> dict[str, Any]:
    """32 clients at once: half on their own conversations, half sharing one."""
    shared = "history-shared"
    clients = [
        thin_client(base, shared if i % 2 else f"history-own-{i}") for i in range(CONCURRENCY)
    ]
    statuses: dict[int, int] = {}
    locked = 0
    latencies: list[float] = []

    async def run_client(i: int, client: http1.Client) -> None:
        nonlocal locked
        for j in range(per_client):
            took, status, body = await timed(client, f"client {i} turn {j}")
            statuses[status] = statuses.get(status, 0) + 1
            locked += b"database is locked" in body
            latencies.append(took)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(run_client(i, c) for i, c in enumerate(clients)))
    finally:
        for client in clients:
            await client.aclose()
    elapsed = time.perf_counter() - started
    total = sum(statuses.values())
    return {
        "requests": total,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "database_is_locked": locked,
        "requests_per_s": round(total / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "ok": statuses.get(200, 0) == total and locked == 0,
    }


async def measure(base: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    conversations = {size: await seed(base, size) for size in SIZES}
    print(
        f"  seeded {sum(SIZES):,} messages in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    sized = await by_size(base, conversations, args.requests, args.warmup)
    print("  by conversation size: done", file=sys.stderr)
    together = await concurrent(base, args.per_client)
    return {"by_size": sized, "concurrent": together}


def report(figures: dict[str, Any], db_bytes: int) -> str:
    sized, together = figures["by_size"], figures["concurrent"]
    lines = ["thin-client turn, memory on (SQLite), by stored conversation size:"]
    lines.append(f"  {'messages':>9}{'p50 ms':>10}{'p99 ms':>10}")
    for size, f in sized["sizes"].items():
        lines.append(f"  {int(size):>9,}{f['p50_ms']:>10.2f}{f['p99_ms']:>10.2f}")
    verdict = "met" if sized["target_met"] else "NOT met"
    lines.append(
        f"  p50 {SIZES[-1]:,} / {SIZES[0]:,}: {sized['ratio']:.2f}x  -> <= {TARGET_RATIO}x {verdict}"
    )
    lines.append("")
    lines.append(
        f"{CONCURRENCY} concurrent clients (half sharing one conversation): {together['requests']} requests, "
        f"statuses {together['statuses']}, 'database is locked' {together['database_is_locked']}, "
        f"{together['requests_per_s']} req/s, p50 {together['p50_ms']:.1f} ms, p99 {together['p99_ms']:.1f} ms"
        f"  -> {'no failures' if together['ok'] else 'FAILURES'}"
    )
    lines.append(f"database size after the run: {db_bytes / 1e6:.1f} MB")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="measured turns per size")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--per-client", type=int, default=40, help="turns per concurrent client")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memproxy-history-") as tmp:
        workdir = Path(tmp)
        upstream_port, proxy_port = free_port(), free_port()
        fake = spawn(
            "upstream",
            [
                sys.executable,
                str(Path(__file__).parent / "fake_upstream.py"),
                f"--port={upstream_port}",
                "--chunk-delay=0",
            ],
            upstream_port,
            workdir,
        )
        config = workdir / "config.yaml"
        config.write_text(memproxy_config(fake.url, workdir))
        proxy = spawn_memproxy(
            "memproxy",
            config,
            workdir,
            port=proxy_port,
            options=("--log-level=warning", "--log-format=json"),
        )
        try:
            wait_ready(fake)
            wait_ready(proxy)
            print("measuring...", file=sys.stderr, flush=True)
            figures = run_loop(lambda: measure(proxy.url, args))
        finally:
            for server in (proxy, fake):
                server.process.terminate()
                server.process.wait(timeout=30)
        db_bytes = sum(p.stat().st_size for p in workdir.glob("memproxy.db*"))
        log = (workdir / "memproxy.log").read_text() if (workdir / "memproxy.log").exists() else ""
        figures["locked_in_server_log"] = log.count("database is locked")
    print()
    print(report(figures, db_bytes))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = figures["by_size"]["target_met"] and figures["concurrent"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
