"""memproxy's added latency and throughput against the floor of any Python proxy, in one run.

The targets answer the same requests, interleaved, each server in its own process (uvicorn
with uvloop and httptools, none sharing a GIL with this load generator):

    direct             the fake upstream itself (bench/fake_upstream.py; the baseline)
    floor              bench/floor_proxy.py, a bare Litestar + httpx pass-through
    litellm            LiteLLM's proxy, no memory (`--litellm`; an optional target installed
                       in a venv of its own: the run prints how when it is missing)
    memproxy-off       `memproxy serve`, requests with `X-Memory-Mode: off` (the proxy core)
    memproxy           memory on, the default config (local embeddings)
    memproxy-keywords  memory on, `memory.embeddings: off` (`--embeddings both`, the default)
    memproxy-heavy     as memproxy-keywords, every user with `--heavy-turns` stored turns
    memproxy-prev      memproxy at `--baseline-rev`, memory on, that revision's defaults
    memproxy-untraced  memproxy with its tenant's `trace: off` (`--trace-target`)

Two workloads (`--scenario`, bench/overhead_bench/workload.py): `realistic` (the default),
where each client is a named user whose own conversation grows through the run (a thin client:
it sends its new message with `X-Memory-Conversation-Id`, memproxy attaches up to 20 stored
messages and recalls from the user's `--stored-turns` earlier turns on every turn), and
`first-turn`, where every request is the same one-message first turn of the anonymous user
(or of `--user`).

Four scenarios each: non-stream and stream, sequential and `--concurrency` (32) concurrent
clients. Sequentially the targets take turns request by request; concurrently in short
segments (every client sends `--segment` requests to one target, then the next target), so
drift on a noisy machine hits all alike. `added` is a target's p50 (or time to first token)
minus direct's; `cpu/req` the CPU time each proxy process used per request (all its threads);
`req/s` the requests a target answered per second of its own segments at 32 clients. RSS is
each proxy's at start (before the stored history) and at the end. The realistic run ends with
the headline table and issue 37's targets (memory on within 2x the core's added p50 and CPU
per request, 250 stream req/s at 32 clients, the core within 1.25x the floor, ...); the
first-turn run with the targets of its day (the core within 1.25x the floor, memory on at most
2 ms over off, memproxy-prev's accounting budget). Compare figures only within one run.

    .venv/bin/python bench/overhead.py [--scenario realistic|first-turn] [--requests 300]
        [--concurrent-requests 640] [--embeddings both|off|local] [--postgres] [--litellm]
        [--baseline-rev REV|''] [--stored-turns 100] [--heavy-turns 5000]
        [--shapes chat,responses,messages] [--json figures.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (The names other benches take from here.)
from bench.overhead_bench.cli import main
from bench.overhead_bench.figures import percentile
from bench.overhead_bench.run import run_loop
from bench.overhead_bench.servers import (
    API_KEY,
    BENCH,
    ROOT,
    Server,
    export_revision,
    free_port,
    memproxy_config,
    spawn,
    spawn_memproxy,
    wait_ready,
)
from bench.overhead_bench.wire import CHAT_PATH

__all__ = [
    "API_KEY",
    "BENCH",
    "CHAT_PATH",
    "ROOT",
    "Server",
    "export_revision",
    "free_port",
    "main",
    "memproxy_config",
    "percentile",
    "run_loop",
    "spawn",
    "spawn_memproxy",
    "wait_ready",
]

if __name__ == "__main__":
    raise SystemExit(main())
