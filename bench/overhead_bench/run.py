"""One run: a client per target, the realistic users' stored history, the warm-up, and the four
scenarios with the targets (and the shapes) taking turns."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import sys
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx

from bench import http1
from bench.overhead_bench import workload
from bench.overhead_bench.figures import summarize
from bench.overhead_bench.servers import (
    API_KEY,
    DIRECT,
    HEAVY,
    LITELLM,
    LITELLM_KEY,
    MEMORY_ON,
    OFF,
    ON,
    PREVIOUS,
    Server,
    cpu_seconds,
    rss_mb,
)
from bench.overhead_bench.wire import (
    SHAPES,
    Lane,
    Post,
    Reply,
    Requests,
    Samples,
    Shape,
    Target,
    concurrent,
    no_buffering,
    payload,
    rotated,
    sequential,
    split,
)

# A sequential scenario is measured in this many parts, the shapes taking turns part by part.
SEQUENTIAL_PARTS = 6
SCENARIOS = (
    ("non-stream seq", False, False),
    ("stream seq", True, False),
    ("non-stream c32", False, True),
    ("stream c32", True, True),
)


def httpx_post(client: httpx.AsyncClient) -> Post:
    def post(
        path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> AbstractAsyncContextManager[Reply]:
        return client.stream("POST", path, content=body, headers=headers)

    return post


def headers_for(name: str, args: argparse.Namespace) -> dict[str, str]:
    key = LITELLM_KEY if name == LITELLM else API_KEY
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if name == OFF:
        headers["x-memory-mode"] = "off"
    elif name in MEMORY_ON and args.memory_mode:
        headers["x-memory-mode"] = args.memory_mode
    if args.user and args.scenario == "first-turn":
        headers["x-memory-user-id"] = args.user
    return headers


def targets_for(servers_: dict[str, Server], args: argparse.Namespace) -> list[Target]:
    """One keep-alive client per target (for every shape)."""
    targets = []
    for name in servers_:
        headers = headers_for(name, args)
        base = servers_[name].url
        if args.client == "httpx":
            pool = args.concurrency * 2
            limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
            client = httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60)
            targets.append(Target(name, httpx_post(client), client.aclose))
        else:
            raw = http1.Client(base, headers)
            targets.append(Target(name, raw.post, raw.aclose))
    return targets


async def without_memory(server: Server, shape: Shape, args: argparse.Namespace) -> str | None:
    """Why `server` (a memproxy) does not serve `shape` with memory, or None if it does: one
    request with memory on, whose reply must carry memproxy's `x-memory-status` header (a
    revision older than a protocol's memory route passes the request through without it)."""
    headers = {**headers_for(ON, args), "x-memory-mode": "full"}
    body = payload(False, workload.PROMPT, shape=shape.name)
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
        reply = await client.post(shape.path, content=body)
    if reply.status_code != 200:
        return f"it answers {shape.label} with {reply.status_code}: {reply.text[:200]}"
    if "x-memory-status" not in reply.headers:
        return f"it passes {shape.label} through without memory (no x-memory-status header)"
    return None


async def skipped_targets(
    servers_: dict[str, Server], shapes: list[Shape], args: argparse.Namespace
) -> dict[str, dict[str, str]]:
    """Per shape, the targets left out and why: memproxy-prev on a shape its revision serves
    without memory, LiteLLM's proxy on any but chat completions. (Chat completions: every
    revision has memory on them.)"""
    skipped: dict[str, dict[str, str]] = {shape.name: {} for shape in shapes}
    for shape in shapes:
        if shape.name == "chat":
            continue
        if LITELLM in servers_:
            skipped[shape.name][LITELLM] = "measured on chat completions only"
        if (why := await without_memory(servers_[ON], shape, args)) is not None:
            raise SystemExit(f"memproxy: {why}")
        if PREVIOUS in servers_:
            why = await without_memory(servers_[PREVIOUS], shape, args)
            if why is not None:
                skipped[shape.name][PREVIOUS] = why
    return skipped


async def prepare(servers_: dict[str, Server], args: argparse.Namespace) -> dict[str, float]:
    """The realistic users' stored history on every memory-on target, then the background
    jobs (their embeddings) drained; seconds each target took."""
    took: dict[str, float] = {}

    async def one(name: str) -> None:
        started = time.monotonic()
        turns = args.heavy_turns if name == HEAVY else args.stored_turns
        url, headers = servers_[name].url, headers_for(name, args)
        await workload.seed(url, headers, args.concurrency, turns)
        await workload.drained(url, headers, name, args.drain_timeout)
        took[name] = round(time.monotonic() - started, 1)

    await asyncio.gather(*(one(name) for name in servers_ if name in MEMORY_ON))
    return took


async def run(args: argparse.Namespace, servers_: dict[str, Server]) -> dict[str, Any]:
    realistic = args.scenario == "realistic"
    requests: Requests = workload.realistic() if realistic else workload.first_turn(args.shapes)
    clients = args.concurrency
    targets = targets_for(servers_, args)
    shapes = [SHAPES[name] for name in args.shapes]
    pids = {name: server.process.pid for name, server in servers_.items() if name != DIRECT}
    rss: dict[str, dict[str, float | None]] = {
        name: {"start": rss_mb(pid)} for name, pid in pids.items()
    }
    out: dict[str, Any] = {}
    try:
        if realistic:
            print("  storing the users' earlier turns...", file=sys.stderr, flush=True)
            out["seeded_in_s"] = await prepare(servers_, args)
        skipped = await skipped_targets(servers_, shapes, args)
        lanes = {
            shape.name: [Lane(t, shape) for t in targets if t.name not in skipped[shape.name]]
            for shape in shapes
        }
        every = [lane for shape in shapes for lane in lanes[shape.name]]
        # Every code path once, before anything counts.
        for stream in (False, True):
            await sequential(every, args.warmup, stream, requests, clients)
        results: dict[str, dict[str, Any]] = {shape.name: {} for shape in shapes}
        for scenario, stream, parallel in SCENARIOS:
            # Warm the connections this scenario needs, the proxies' upstream pools included
            # (uvicorn closes connections idle for 5 s, e.g. during the sequential stream run).
            if parallel:
                await concurrent(every, clients * 2, stream, requests, clients, 2)
            else:
                await sequential(every, args.warmup // 3 + 1, stream, requests, clients)
            gc.collect()
            started = time.monotonic()
            samples = {
                shape.name: {lane.name: Samples() for lane in lanes[shape.name]} for shape in shapes
            }
            cpu: dict[str, dict[str, float | None]] = {
                shape.name: dict.fromkeys(pids, 0.0) for shape in shapes
            }
            # The shapes take turns in parts (a concurrent part is one round of segments), so
            # drift hits both alike and each proxy's CPU time is counted per shape.
            if parallel:
                per_round = clients * args.segment
                sizes = [per_round] * max(1, math.ceil(args.concurrent_requests / per_round))
            else:
                sizes = split(args.requests, SEQUENTIAL_PARTS)
            done = 0
            for part, size in enumerate(sizes):
                for shape in rotated(shapes, part):
                    into = samples[shape.name]
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    if parallel:
                        await concurrent(
                            lanes[shape.name],
                            size,
                            stream,
                            requests,
                            clients,
                            args.segment,
                            start=part,
                            into=into,
                        )
                    else:
                        await sequential(
                            lanes[shape.name], size, stream, requests, clients, done, into
                        )
                    for name, pid in pids.items():
                        used, after = cpu[shape.name][name], cpu_seconds(pid)
                        start = before[name]
                        cpu[shape.name][name] = (
                            None
                            if used is None or start is None or after is None
                            else used + after - start
                        )
                done += size
            for shape in shapes:
                results[shape.name][scenario] = summarize(
                    samples[shape.name], stream, cpu[shape.name]
                )
            took = time.monotonic() - started
            print(f"  {scenario}: {took:.1f} s", file=sys.stderr, flush=True)
        for name, pid in pids.items():
            rss[name]["end"] = rss_mb(pid)
        if realistic:
            out["backlog_at_end"] = {
                name: await workload.backlog(servers_[name].url, headers_for(name, args))
                for name in servers_
                if name in MEMORY_ON
            }
            out["attached"] = {
                name: await workload.attached(servers_[name].url, headers_for(name, args))
                for name in servers_
                if name in MEMORY_ON
            }
        out["rss_mb"] = rss
        out["shapes"] = {
            shape.name: {
                "path": shape.path,
                "scenarios": results[shape.name],
                "no_buffering": {lane.name: await no_buffering(lane) for lane in lanes[shape.name]},
                "skipped": skipped[shape.name],
            }
            for shape in shapes
        }
        return out
    finally:
        for target in targets:
            await target.close()


def run_loop(main: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
