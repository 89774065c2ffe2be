"""CPU per memory-on turn of a named user with stored history, and where it goes.

The real server (`memproxy serve`, SQLite in a temp dir, embeddings off by default) in front
of bench/fake_upstream.py. A named user (alice) gets `--stored` turns imported through the
management API, spread over conversations of 20 turns on a handful of topics, so recall has
candidates to rank. Then `--turns` turns of a thin client (only its newest message, with
`X-Memory-Conversation-Id`) in one conversation that grows through the run: from the 11th turn
on, 20 stored messages are attached and recall runs on every turn.

Targets, each its own process and database, take turns request by request:

    memproxy-off   this checkout, every request with `X-Memory-Mode: off`
    memproxy       this checkout, memory on
    memproxy-prev  `--baseline-rev REV` exported with `git archive`, memory on (optional)

Printed per target: CPU per request of the server process (user + system from /proc, all its
threads, over the measured turns) and the added p50 (the target's p50 minus the fake upstream's
own, measured in the same rounds). With `--py-spy OUT`, py-spy (a dev dependency) samples
memproxy during the measured turns and writes a speedscope profile to OUT (`--py-spy-format
flamegraph` for an SVG); open it at https://www.speedscope.app or read it with
`--py-spy-top`, which prints the functions with the most time inside them.

    .venv/bin/python bench/profile_turn.py [--stored 800] [--turns 200] [--baseline-rev REV]
        [--py-spy profile.json] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench.overhead_bench.figures import percentile  # noqa: E402  (run as a script)
from bench.overhead_bench.servers import (  # noqa: E402
    API_KEY,
    PREVIOUS,
    Server,
    export_revision,
    free_port,
    memproxy_config,
    spawn,
    spawn_memproxy,
    wait_ready,
)

USER = "alice"
TOPICS = (
    "my sister's wedding in Lisbon next June and the hotel we booked near the river",
    "the sourdough starter that keeps failing because the kitchen is too cold in winter",
    "training for the half marathon in October with intervals on Tuesdays",
    "the Rust borrow checker errors in my parser when I keep references to tokens",
    "choosing a used electric car with enough range for the mountain cabin",
    "my cat Miso who stopped eating dry food after the vet visit",
    "learning Portuguese verbs before the trip and the subjunctive mood",
    "the garden beds with tomatoes, basil and the aphids on the peppers",
)
WORDS = [
    "because",
    "though",
    "maybe",
    "really",
    "plan",
    "price",
    "week",
    "morning",
    "friend",
    "budget",
    "weather",
    "schedule",
    "question",
    "answer",
    "idea",
    "problem",
    "reason",
    "detail",
    "option",
    "trip",
    "order",
    "list",
]


def turn_text(rng: random.Random, topic: str, i: int) -> str:
    extra = " ".join(rng.choice(WORDS) for _ in range(12))
    return f"About {topic}: point {i}, {extra}."


def seed_conversations(stored: int, rng: random.Random) -> list[dict[str, Any]]:
    """`stored` turns (a user message and a reply each) in conversations of 20 turns."""
    out: list[dict[str, Any]] = []
    for c in range(0, stored, 20):
        topic = TOPICS[(c // 20) % len(TOPICS)]
        messages: list[dict[str, str]] = []
        for i in range(min(20, stored - c)):
            messages.append({"role": "user", "content": turn_text(rng, topic, i)})
            messages.append({"role": "assistant", "content": "Noted. " + turn_text(rng, topic, i)})
        out.append({"id": f"seed-{c // 20}", "user": USER, "messages": messages})
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def thread_seconds(pid: int) -> dict[tuple[str, str], float]:
    """CPU time (user + system) each thread of a process has used so far, by (id, name)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[str, str], float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:  # (a thread that ended)
            continue
        out[task.name, name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def body(text: str, stream: bool) -> bytes:
    payload: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": text}],
    }
    if stream:
        payload["stream"] = True
    return json.dumps(payload).encode()


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, Server]]:
    with tempfile.TemporaryDirectory(prefix="memproxy-profile-") as tmp:
        workdir = Path(tmp)
        logdir = Path(args.logs) if args.logs else workdir
        logdir.mkdir(parents=True, exist_ok=True)
        started: list[Server] = []
        try:
            port = free_port()
            fake = spawn(
                "upstream",
                [sys.executable, str(BENCH / "fake_upstream.py"), f"--port={port}"],
                port,
                logdir,
            )
            started.append(fake)
            names = ["memproxy-off", "memproxy"]
            code = {name: BENCH.parent for name in names}
            if args.baseline_rev:
                names.append(PREVIOUS)
                code[PREVIOUS] = export_revision(args.baseline_rev, workdir / "previous")
            for name in names:
                home = workdir / name
                home.mkdir()
                config = home / "config.yaml"
                config.write_text(
                    memproxy_config(fake.url, home, embeddings=args.embeddings, trace=args.trace)
                )
                started.append(
                    spawn_memproxy(
                        name,
                        config,
                        logdir,
                        code[name],
                        options=("--log-level=warning", "--log-format=json"),
                    )
                )
            for server in started:
                wait_ready(server)
            yield dict(zip(("direct", *names), started, strict=True))
        finally:
            for server in started:
                server.process.terminate()
            for server in started:
                try:
                    server.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()


async def seed(client: httpx.AsyncClient, server: Server, args: argparse.Namespace) -> None:
    rng = random.Random(7)
    for conversation in seed_conversations(args.stored, rng):
        reply = await client.post(
            f"{server.url}/v1/memory/conversations",
            json=conversation,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        reply.raise_for_status()


async def one(
    client: httpx.AsyncClient, server: Server, name: str, text: str, stream: bool
) -> float:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    if name != "direct":
        headers |= {"X-Memory-User-Id": USER, "X-Memory-Conversation-Id": "live-1"}
    if name == "memproxy-off":
        headers["X-Memory-Mode"] = "off"
    started = time.perf_counter()
    async with client.stream(
        "POST", f"{server.url}/v1/chat/completions", content=body(text, stream), headers=headers
    ) as reply:
        async for _ in reply.aiter_raw():
            pass
    elapsed = time.perf_counter() - started
    if reply.status_code != 200:
        raise SystemExit(f"{name}: {reply.status_code}")
    return elapsed


def py_spy(server: Server, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    command = [
        str(Path(sys.executable).parent / "py-spy"),
        "record",
        f"--pid={server.process.pid}",
        f"--rate={args.py_spy_rate}",
        f"--format={args.py_spy_format}",
        f"--output={args.py_spy}",
        *(["--gil"] if args.py_spy_gil else []),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# Leaf frames where a thread waits rather than works (py-spy cannot tell them idle here): a
# pool thread waiting for work, and the event loop in its selector (uvloop's own C work is
# counted there too, and so left out).
IDLE = {"_worker thread.py", "Runner.run runners.py", "wait threading.py"}


def top_functions(path: str, turns: int, n: int = 40) -> str:
    """Time per function of a speedscope profile, in ms per turn (its own, then with what it
    calls), busy samples only (see IDLE)."""
    data = json.loads(Path(path).read_text())
    frames = data["shared"]["frames"]
    names = [f"{f['name']} {Path(f.get('file', '')).name}" for f in frames]
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    busy = 0.0
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if not stack or names[stack[-1]] in IDLE:
                continue
            busy += weight
            own[names[stack[-1]]] += weight
            for key in {names[i] for i in stack}:
                total[key] += weight
    scale = 1000 / turns
    lines = [f"busy samples: {busy * scale:.1f} ms per turn (wall time of busy threads)"]
    lines += [f"  self {w * scale:6.2f}  {k}" for k, w in own.most_common(n)]
    lines += [f"  cum  {w * scale:6.2f}  {k}" for k, w in total.most_common(n)]
    return "\n".join(lines)


async def run(args: argparse.Namespace, started: dict[str, Server]) -> None:
    rng = random.Random(11)
    async with httpx.AsyncClient(timeout=60) as client:
        for name, server in started.items():
            if name != "direct":
                await seed(client, server, args)
        questions = [
            f"What did I say about {rng.choice(TOPICS).split(' ', 3)[-1]}? turn {i}"
            for i in range(args.warmup + args.turns)
        ]
        names = list(started)
        for text in questions[: args.warmup]:
            for name in names:
                await one(client, started[name], name, text, args.stream)
        profiler = py_spy(started[args.py_spy_target], args) if args.py_spy else None
        cpu = {name: cpu_seconds(server.process.pid) for name, server in started.items()}
        threads = thread_seconds(started["memproxy"].process.pid)
        latencies: dict[str, list[float]] = {name: [] for name in names}
        for i, text in enumerate(questions[args.warmup :]):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                latencies[name].append(await one(client, started[name], name, text, args.stream))
        used = {
            name: tuple(
                now - then
                for now, then in zip(cpu_seconds(server.process.pid), cpu[name], strict=True)
            )
            for name, server in started.items()
        }
    by_thread = thread_seconds(started["memproxy"].process.pid)
    pid = str(started["memproxy"].process.pid)
    print("memproxy's threads (the event loop's, then the others by id), CPU ms per turn:")
    for key, seconds in sorted(by_thread.items(), key=lambda kv: (kv[0][0] != pid, int(kv[0][0]))):
        used_here = (seconds - threads.get(key, 0.0)) / args.turns * 1000
        if used_here >= 0.05:
            label = "event loop" if key[0] == pid else f"thread {key[0]}"
            print(f"  {label:<24}{used_here:8.2f}")
    if profiler is not None:
        profiler.send_signal(2)  # SIGINT: py-spy writes its output and exits
        _, err = profiler.communicate(timeout=60)
        if profiler.returncode:
            print(f"py-spy: {err.decode(errors='replace').strip()}", file=sys.stderr)
    direct = percentile(latencies["direct"], 0.5)
    print(f"{args.stored} stored turns, {args.turns} measured turns, stream={args.stream}")
    print(
        f"{'target':<16}{'cpu/req ms':>12}{'(user':>8}{'sys)':>7}"
        f"{'p50 added ms':>14}{'p90 added ms':>14}"
    )
    for name in names:
        if name == "direct":
            continue
        p50 = percentile(latencies[name], 0.5) - direct
        p90 = percentile(latencies[name], 0.9) - direct
        user, system = (t / args.turns * 1000 for t in used[name])
        print(
            f"{name:<16}{user + system:>12.2f}{user:>8.2f}{system:>7.2f}"
            f"{p50 * 1000:>14.2f}{p90 * 1000:>14.2f}"
        )
    if args.py_spy and args.py_spy_top and args.py_spy_format == "speedscope":
        print(top_functions(args.py_spy, args.turns, args.py_spy_top))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stored", type=int, default=800, help="turns imported for alice")
    parser.add_argument("--turns", type=int, default=200, help="measured turns per target")
    parser.add_argument("--warmup", type=int, default=20, help="turns before measuring")
    parser.add_argument("--stream", action="store_true", help="streamed chat completions")
    parser.add_argument("--embeddings", default="off", help="memory.embeddings (default off)")
    parser.add_argument("--trace", help="the tenant's trace level (default: the default's)")
    parser.add_argument("--baseline-rev", help="also run this revision (memory on)")
    parser.add_argument("--logs", metavar="DIR", help="keep the servers' logs in DIR")
    parser.add_argument("--py-spy", metavar="OUT", help="record memproxy's profile to OUT")
    parser.add_argument(
        "--py-spy-target", default="memproxy", help="the target profiled (default memproxy)"
    )
    parser.add_argument("--py-spy-rate", type=int, default=200)
    parser.add_argument("--py-spy-format", default="speedscope", help="speedscope|flamegraph")
    parser.add_argument(
        "--py-spy-gil",
        action="store_true",
        help="sample only the thread holding the GIL (Python's own CPU; SQLite's C work, done "
        "without the GIL, is then left out)",
    )
    parser.add_argument("--py-spy-top", type=int, default=0, help="print the N hottest functions")
    args = parser.parse_args(argv)
    with servers(args) as started:
        asyncio.run(run(args, started))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
