"""Load and soak: many concurrent streaming clients against memproxy, with a fake upstream of
realistic latency, and a direct run against the same upstream as the baseline.

The upstream (bench/fake_upstream.py in its own process) waits `--latency` (200 ms) before
each response head and streams its reply a chunk every `--chunk-delay` (20 ms, ten chunks).
`--clients` (200) clients each hold one conversation (a named user, thin client: header
`X-Memory-Conversation-Id`) and send streamed turns one after another, all at once. Per
backend:

- `sqlite`: one `memproxy serve` process on a SQLite file;
- `postgresql`: two processes on one PostgreSQL database (a throwaway cluster, as in the
  tests), the clients split between them.

Each run: a warm-up, then `--requests` measured requests (requests per second, p50/p99 of the
time to the first content chunk and to the end, memproxy's p50/p99 over the direct run's,
errors), then a soak of `--soak` more (RSS of every memproxy process before and after it,
open connections, database size). Afterwards every conversation is read back through the
management API: a stored user turn for every request that was answered, no more, no fewer
("lost" counts the difference), once the spill of the requests answered degraded (storage
slower than its timeout: counted by reason from /metrics) is replayed and the writes still
queued have landed.

    .venv/bin/python bench/load.py [--backend sqlite|postgresql|both] [--clients 200]
        [--requests 4000] [--soak 20000] [--json figures.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench import http1
from bench.overhead import (
    API_KEY,
    BENCH,
    Server,
    free_port,
    memproxy_config,
    percentile,
    spawn,
    spawn_memproxy,
    wait_ready,
)

CHAT = "/v1/chat/completions"
PROMPT = "tell me about nine small things"  # "fake reply to: ..." in ten chunks


@dataclass
class Phase:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        done = len(self.total)
        return {
            "requests": done + len(self.errors),
            "errors": len(self.errors),
            "error_samples": sorted(set(self.errors))[:5],
            "rps": round(done / self.seconds, 1) if self.seconds else None,
            "ttft_p50_ms": ms(percentile(self.ttft, 0.5)) if self.ttft else None,
            "ttft_p99_ms": ms(percentile(self.ttft, 0.99)) if self.ttft else None,
            "p50_ms": ms(percentile(self.total, 0.5)) if self.total else None,
            "p99_ms": ms(percentile(self.total, 0.99)) if self.total else None,
        }


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class Client:
    """One simulated user: its own keep-alive connection and conversation."""

    def __init__(self, n: int, base_url: str, memory: bool) -> None:
        headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
        if memory:
            headers |= {"x-memory-user-id": f"user-{n}", "x-memory-conversation-id": f"load-{n}"}
        self.http = http1.Client(base_url, headers)
        self.answered = 0
        self.body = json.dumps(
            {
                "model": "gpt-4o-mini",
                "stream": True,
                "messages": [{"role": "user", "content": PROMPT}],
            }
        ).encode()

    async def turn(self, into: Phase) -> None:
        started = time.perf_counter()
        first: float | None = None
        tail = b""
        try:
            async with self.http.post(CHAT, self.body) as response:
                async for chunk in response.aiter_raw():
                    if first is None and b'"content"' in chunk:
                        first = time.perf_counter() - started
                    tail = (tail + chunk)[-64:]
            if response.status_code != 200 or b"[DONE]" not in tail or first is None:
                raise RuntimeError(f"status {response.status_code}, tail {tail[-40:]!r}")
        except (OSError, http1.ProtocolError, RuntimeError, asyncio.IncompleteReadError) as exc:
            into.errors.append(f"{type(exc).__name__}: {exc}")
            return
        self.answered += 1
        into.ttft.append(first)
        into.total.append(time.perf_counter() - started)


async def drive(clients: list[Client], requests: int) -> Phase:
    """`requests` turns in all, every client sending its next as soon as the last ended."""
    phase = Phase()
    left = requests

    async def loop(client: Client) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.turn(phase)

    started = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in clients))
    phase.seconds = time.perf_counter() - started
    return phase


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def sockets(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


async def settled_losses(
    base_urls: list[str], clients: list[Client], seconds: float = 60.0
) -> tuple[int, float]:
    """`lost_messages` once the writes still under way have landed: a turn answered degraded
    after its write timed out may still be in SQLite's writer queue when its spill is replayed
    (the write then lands, the replay finds it stored). Read again until nothing is missing,
    or `seconds` have passed; the count and how long it took."""
    started = time.monotonic()
    for _ in range(int(seconds)):
        lost = await lost_messages(base_urls, clients, quiet=True)
        if not lost:
            break
        await asyncio.sleep(1.0)
    if lost:
        lost = await lost_messages(base_urls, clients)  # (this time naming them)
    return lost, round(time.monotonic() - started, 1)


async def lost_messages(base_urls: list[str], clients: list[Client], quiet: bool = False) -> int:
    """Answered requests whose user turn is not stored, plus stored turns never answered."""
    lost = 0
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {API_KEY}"}) as http:
        for n, client in enumerate(clients):
            stored, after = 0, 0
            while True:
                got = await http.get(
                    base_urls[n % len(base_urls)] + f"/v1/memory/conversations/load-{n}/messages",
                    params={"limit": 100, "after": after} if after else {"limit": 100},
                )
                page = got.json()
                stored += sum(1 for m in page["data"] if m["role"] == "user")
                if not page["has_more"]:
                    break
                after = page["last_id"]
            if client.answered != stored and not quiet:
                print(
                    f"load-{n}: {client.answered} answered, {stored} user turns stored",
                    file=sys.stderr,
                )
            lost += abs(client.answered - stored)
    return lost


SPILL = "memproxy-spill.jsonl"  # (overhead.memproxy_config puts it beside the config)


async def degraded_requests(base_urls: list[str]) -> dict[str, int]:
    """Requests answered without memory (storage too slow or away), by reason, from every
    process's metrics: their turns went to the spill, to be replayed."""
    found: dict[str, int] = {}
    async with httpx.AsyncClient() as http:
        for url in base_urls:
            for line in (await http.get(url + "/metrics")).text.splitlines():
                if line.startswith("memproxy_memory_degraded_requests_total{"):
                    reason = line.split('reason="', 1)[1].split('"', 1)[0]
                    found[reason] = found.get(reason, 0) + int(float(line.rsplit(" ", 1)[1]))
    return found


async def spill_replayed(spill: Path, seconds: float = 300.0) -> float:
    """Seconds until the spill is replayed into the database (its file gone), so that the
    read-back counts what was answered degraded too."""
    started = time.monotonic()
    while await asyncio.to_thread(spill.exists):
        if time.monotonic() - started > seconds:
            raise SystemExit(f"the spill {spill} was not replayed in {seconds:g} s")
        await asyncio.sleep(0.5)
    return round(time.monotonic() - started, 1)


@contextlib.contextmanager
def upstream(args: argparse.Namespace, workdir: Path) -> Iterator[Server]:
    port = free_port()
    command = [
        sys.executable,
        str(BENCH / "fake_upstream.py"),
        f"--port={port}",
        f"--latency={args.latency}",
        f"--chunk-delay={args.chunk_delay}",
    ]
    server = spawn("upstream", command, port, workdir)
    try:
        wait_ready(server)
        yield server
    finally:
        server.process.terminate()
        server.process.wait()


@contextlib.contextmanager
def memproxies(
    backend: str, fake: Server, workdir: Path, storage_breaker: int
) -> Iterator[tuple[list[Server], Any]]:
    """memproxy in one process (sqlite) or two on one PostgreSQL database; and a function
    that tells the database's size in MB."""
    with contextlib.ExitStack() as stack:
        if backend == "sqlite":
            url, count = None, 1

            def size() -> float:
                files = workdir.glob("sqlite/memproxy.db*")
                return round(sum(f.stat().st_size for f in files) / 2**20, 1)

        else:
            from tests.postgres import PostgresServer, PostgresUnavailable, find_bin_dir

            try:
                cluster = PostgresServer(find_bin_dir())
            except PostgresUnavailable as exc:
                raise SystemExit(f"postgresql: {exc}") from None
            cluster.start()
            stack.callback(cluster.stop)
            name = cluster.create_database()
            url, count = cluster.url(name), 2

            def size() -> float:
                import asyncpg

                async def query() -> int:
                    conn = await asyncpg.connect(cluster.url(name).replace("+asyncpg", ""))
                    try:
                        return int(await conn.fetchval("SELECT pg_database_size($1)", name))
                    finally:
                        await conn.close()

                return round(asyncio.run(query()) / 2**20, 1)

        home = workdir / backend
        home.mkdir()
        config = home / "config.yaml"
        config.write_text(memproxy_config(fake.url, home, url, storage_breaker=storage_breaker))
        servers = []
        for i in range(count):
            servers.append(spawn_memproxy(f"memproxy-{backend}-{i}", config, workdir))
            wait_ready(servers[-1])  # one at a time: the first migrates
        try:
            yield servers, size
        finally:
            for server in servers:
                server.process.terminate()
                server.process.wait()


async def run_backend(
    args: argparse.Namespace, backend: str, fake: Server, workdir: Path
) -> dict[str, Any]:
    with memproxies(backend, fake, workdir, args.storage_breaker) as (servers, size):
        urls = [s.url for s in servers]
        clients = [Client(n, urls[n % len(urls)], memory=True) for n in range(args.clients)]
        await drive(clients, args.clients * 2)  # warm-up: every client's connection, twice
        load = await drive(clients, args.requests)
        pids = [s.process.pid for s in servers]
        rss_before = [rss_mb(p) for p in pids]
        soak = await drive(clients, args.soak)
        rss_after = [rss_mb(p) for p in pids]
        open_sockets = [sockets(p) for p in pids]
        degraded = await degraded_requests(urls)
        replayed_in = await spill_replayed(workdir / backend / SPILL)
        lost, settled_in = await settled_losses(urls, clients)
        for client in clients:
            await client.http.aclose()
        return {
            "processes": len(servers),
            "load": load.summary(),
            "soak": soak.summary(),
            "rss_mb_before_soak": rss_before,
            "rss_mb_after_soak": rss_after,
            "rss_growth_pct": [
                round(100 * (a - b) / b, 1) for a, b in zip(rss_after, rss_before, strict=True)
            ],
            "open_sockets": open_sockets,
            "database_mb": await asyncio.to_thread(size),
            "lost_messages": lost,
            "degraded_requests": degraded,
            "spill_replayed_s": replayed_in,
            "writes_settled_s": settled_in,
        }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="memproxy-load-") as tmp:
        workdir = Path(args.logs) if args.logs else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        with upstream(args, workdir) as fake:
            direct = [Client(n, fake.url, memory=False) for n in range(args.clients)]
            await drive(direct, args.clients * 2)
            baseline = await drive(direct, args.requests)
            for client in direct:
                await client.http.aclose()
            results: dict[str, Any] = {"direct": {"load": baseline.summary()}}
            backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
            for backend in backends:
                print(f"{backend}...", file=sys.stderr, flush=True)
                results[backend] = await run_backend(args, backend, fake, workdir)
            return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    direct = results["direct"]["load"]
    lines = [
        f"{args.clients} concurrent streaming clients; upstream {args.latency * 1000:.0f} ms to "
        f"the head, a chunk every {args.chunk_delay * 1000:.0f} ms; {args.requests} measured "
        f"requests, then a soak of {args.soak}",
        "",
        "| target | processes | req/s | TTFT p50 / p99 ms | total p50 / p99 ms | added p50 / p99 ms | errors | degraded (spill replayed in) | lost | RSS before -> after soak (growth) | sockets | DB MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| direct | - | {direct['rps']} | {direct['ttft_p50_ms']} / {direct['ttft_p99_ms']} | "
        f"{direct['p50_ms']} / {direct['p99_ms']} | - | {direct['errors']} | - | - | - | - | - |",
    ]
    for backend in ("sqlite", "postgresql"):
        if backend not in results:
            continue
        r = results[backend]
        load, soak = r["load"], r["soak"]
        added = (
            f"{load['p50_ms'] - direct['p50_ms']:+.1f} / {load['p99_ms'] - direct['p99_ms']:+.1f}"
            if load["p50_ms"] is not None
            else "-"
        )
        rss = ", ".join(
            f"{b} -> {a} ({g:+.1f}%)"
            for b, a, g in zip(
                r["rss_mb_before_soak"], r["rss_mb_after_soak"], r["rss_growth_pct"], strict=True
            )
        )
        reasons = r["degraded_requests"]
        degraded = (
            f"{sum(reasons.values())} ("
            + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
            + f"; replayed in {r['spill_replayed_s']} s, settled in {r['writes_settled_s']} s)"
            if reasons
            else "0"
        )
        lines.append(
            f"| memproxy {backend} | {r['processes']} | {load['rps']} (soak {soak['rps']}) | "
            f"{load['ttft_p50_ms']} / {load['ttft_p99_ms']} | {load['p50_ms']} / {load['p99_ms']} | "
            f"{added} | {load['errors'] + soak['errors']} | {degraded} | {r['lost_messages']} | "
            f"{rss} | "
            f"{', '.join(map(str, r['open_sockets']))} | {r['database_mb']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--soak", type=int, default=20000)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--chunk-delay", type=float, default=0.02)
    parser.add_argument(
        "--storage-breaker",
        type=int,
        default=0,
        help="server.storage_breaker_threshold for memproxy (default 0: off, as shipped)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--logs", help="keep the servers' logs and databases in this folder")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print(report(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
