"""memproxy's added latency against the floor of any Python proxy, measured in one run.

Three targets answer the same chat completion requests:

    direct     the fake upstream itself (no proxy: the baseline)
    floor      bench/floor_proxy.py, a bare Litestar + httpx pass-through, in front of it
    memproxy   `memproxy serve` with its defaults (memory on, SQLite in a temp dir), its tenant
               on an `openai` upstream pointing at the fake

Every server runs in its own process (uvicorn with uvloop and httptools) so none shares a GIL
with this load generator. Each target has its own keep-alive client (bench/http1.py, or httpx
with `--client httpx`) and is warmed up first. Four scenarios: non-stream and stream,
sequential and 32 concurrent clients. Sequentially the targets take turns request by request;
concurrently they take turns in short segments (every client sends a few requests to one
target, then the next target), so each target sees its own 32 clients and drift on this noisy
machine hits all three alike. Every request is the same one-message first turn of an
anonymous user (or of `--user`, whose history then grows and is searched on every turn), so
memproxy opens a conversation and stores the turn and the reply each time, sequentially; at 32
clients, a request whose message is that of a conversation still waiting for its reply
continues it (a stored prefix), so concurrent requests share a few conversations.

Three shapes, in the same run (`--shapes chat,responses,messages`, all by default): chat
completions (`POST /v1/chat/completions`, a `messages` list), the Responses API (`POST
/v1/responses`, the same message as an `input` list), which memproxy forwards natively to its
`openai` upstream, and Anthropic's Messages API (`POST /v1/messages`, the same message and
`max_tokens`), which memproxy translates to chat completions for that upstream (direct and the
floor get the fake's own Messages API); the fake answers all three with the same text and,
streamed, in as many chunks with the same delays. Each scenario is measured in parts, the shapes taking turns part by part (a
sequential part is a sixth of `--requests`, a concurrent one a round of segments), so drift
hits both alike and each proxy's CPU time is counted per shape. `--requests` and
`--concurrent-requests` are per target and shape. Each shape gets its own table, then a table
of what every proxy adds over direct on the Responses shape against chat completions.

With `--trace-target`, memproxy-untraced is memproxy with its tenant's `trace: off`: "trace
summary over off" is memproxy's p50, TTFT and CPU per request minus memproxy-untraced's, what
recording each exchange's trace (the default, `summary`) costs.

With `--baseline-rev REV` (by default the commit that closed the conversation-memory issue)
a fifth target, memproxy-prev, is memproxy at that revision (memory on), exported with `git
archive` and run the same way: "accounting" is memproxy's p50 and TTFT minus memproxy-prev's,
what cost accounting, limits and metrics added (target: at most ACCOUNTING_BUDGET_MS); with a
later REV, it is what the commits since REV cost (the line "memproxy over memproxy-prev").
Both serve a tenant with every limit set (high enough never to refuse), and a priced model.
memproxy-prev is measured on a shape other than chat completions only if its revision serves
it with memory (a request with memory on gets memproxy's `x-memory-status` header back; an
older revision passes `POST /v1/responses` through without memory): otherwise the output says
it was left out of that shape.

"Added" is a target's p50 (or time to first token) minus direct's. The target: memproxy's
added p50 and added TTFT at most 1.25x the floor's from the same run, and no buffering (the
first chunk of a stream reaches the client before the upstream has finished it). `cpu/req` is
the CPU time each proxy process used over the scenario per request (all its threads), a
steadier figure than latency on a shared machine. Compare figures only within one run.

    .venv/bin/python bench/overhead.py [--requests 300] [--json figures.json] [--baseline-rev REV]
        [--shapes chat,responses,messages]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench import http1
from bench.fake_upstream import TAIL_MODEL
from bench.http1 import ProtocolError

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TARGET_RATIO = 1.25
API_KEY = "bench-key"
CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
# The fake answers "fake reply to: <prompt>" one word per chunk: with the role chunk, the stop
# chunk and [DONE], this prompt makes a stream of 10 chunks.
PROMPT = "say hi please now"
TARGETS = ("direct", "floor", "memproxy-off", "memproxy")
PREVIOUS = "memproxy-prev"
# memproxy with memory on but `memory.embeddings: off` (--keywords-target): what recall by
# meaning adds to a turn, measured beside it in the same run.
KEYWORDS = "memproxy-keywords"
# memproxy with its tenant's `trace: off` (--trace-target): what recording each exchange's
# trace (`summary`, the default, on the memproxy target) costs, measured beside it.
UNTRACED = "memproxy-untraced"
# The last commit of the conversation-memory issue: memproxy before cost accounting and limits.
BASELINE_REV = "5ab5a29"
ACCOUNTING_BUDGET_MS = 1.0
# memproxy-off is memproxy asked for `X-Memory-Mode: off`, in a process of its own: the proxy
# core, which the 1.25x target is about. memproxy (memory on) must add at most
# MEMORY_BUDGET_MS p50 over it (the conversation-memory issue's target).
MEMORY_BUDGET_MS = 2.0
# A sequential scenario is measured in this many parts, the shapes taking turns part by part.
SEQUENTIAL_PARTS = 6
SCENARIOS = (
    ("non-stream seq", False, False),
    ("stream seq", True, False),
    ("non-stream c32", False, True),
    ("stream c32", True, True),
)


# -- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def spawn(name: str, command: list[str], port: int, logdir: Path, code: Path = ROOT) -> Server:
    log = logdir / f"{name}.log"
    # The code of `code` (this checkout by default), also when the installed `memproxy` points
    # at another one: PYTHONPATH comes before the editable install's finder.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=code, env=env)
    return Server(name, port, process, log)


def export_revision(rev: str, into: Path) -> Path:
    """The tree of `rev` (a commit of this repository) as plain files under `into`."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        raise SystemExit(f"--baseline-rev {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def wait_ready(server: Server, timeout: float = 60.0) -> None:
    """uvicorn binds its socket only once the app's startup is done: a connect means ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"{server.name} exited at startup:\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server.port)):
            return
        time.sleep(0.05)
    raise SystemExit(f"{server.name} did not start within {timeout:.0f} s (log: {server.log})")


def memproxy_command() -> list[str]:
    script = Path(sys.executable).parent / "memproxy"
    found = str(script) if script.exists() else shutil.which("memproxy")
    return [found] if found else [sys.executable, "-m", "proxy.cli"]


def memproxy_config(
    upstream: str,
    workdir: Path,
    database_url: str | None = None,
    *,
    storage_breaker: int = 0,
    server: bool = True,
    embeddings: str | None = None,
    trace: str | None = None,
) -> str:
    """`storage_breaker`: `server.storage_breaker_threshold` (0: off, the default). Without
    `server`, no `server:` settings (for a revision older than them, which would refuse them;
    its spill, if it has one, is then in its working directory). `embeddings`: the tenant's
    `memory.embeddings` (None: the revision's default)."""
    database = database_url or f"sqlite+aiosqlite:///{workdir}/memproxy.db"
    settings = (
        # Turns answered degraded (storage slower than its timeout) wait here to be replayed.
        f'server: {{spill_path: "{workdir}/memproxy-spill.jsonl",'
        f" storage_breaker_threshold: {storage_breaker}}}\n"
    )
    return (
        (settings if server else "") + f'database: {{url: "{database}"}}\n'
        "upstreams:\n"
        f"  fake: {{kind: openai, base_url: {upstream}/v1, api_key: bench-upstream-key}}\n"
        "defaults: {upstream: fake}\n"
        f"tenants:\n  bench:\n    api_keys: [{API_KEY}]\n"
        # Every limit on (and never reached), so admitting and counting are measured.
        "    limits: {rpm: 100000000, tpm: 100000000000, budget_usd_day: 1000000,"
        " budget_usd_month: 1000000}\n"
        + ("" if embeddings is None else f"    memory: {{embeddings: {embeddings}}}\n")
        + ("" if trace is None else f"    trace: {trace}\n")
    )


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, Server]]:
    """The fake upstream, the floor and memproxy, each in its own process; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-") as tmp:
        workdir = Path(tmp)
        logdir = Path(args.logs) if args.logs else workdir
        logdir.mkdir(parents=True, exist_ok=True)
        started: list[Server] = []
        try:
            port = free_port()
            fake = spawn(
                "upstream",
                [
                    sys.executable,
                    str(BENCH / "fake_upstream.py"),
                    f"--port={port}",
                    f"--chunk-delay={args.chunk_delay}",
                    f"--tail={args.tail}",
                ],
                port,
                logdir,
            )
            started.append(fake)
            port = free_port()
            started.append(
                spawn(
                    "floor",
                    [
                        sys.executable,
                        str(BENCH / "floor_proxy.py"),
                        f"--upstream={fake.url}/v1",
                        f"--port={port}",
                    ],
                    port,
                    logdir,
                )
            )
            # Two memproxy processes, one per mode, so neither pays for the other's writes; and
            # the previous revision's, when asked for.
            names = ["memproxy-off", "memproxy"]
            if args.keywords_target:
                names.append(KEYWORDS)
            if args.trace_target:
                names.append(UNTRACED)
            code = {name: ROOT for name in names}
            if args.baseline_rev:
                names.append(PREVIOUS)
                code[PREVIOUS] = export_revision(args.baseline_rev, workdir / "previous")
            for name in names:
                home = workdir / name
                home.mkdir()
                config = home / "config.yaml"
                database_url = args.database_url
                if name == PREVIOUS:
                    # Its own database (by default a SQLite file): the schemas differ.
                    database_url = args.baseline_database_url
                embeddings = "off" if name == KEYWORDS else args.embeddings
                config.write_text(
                    memproxy_config(
                        fake.url,
                        home,
                        database_url,
                        server=name != PREVIOUS,
                        embeddings=None if name == PREVIOUS else embeddings,
                        trace="off" if name == UNTRACED else None,
                    )
                )
                port = free_port()
                command = (
                    memproxy_command() if name != PREVIOUS else [sys.executable, "-m", "proxy.cli"]
                )
                started.append(
                    spawn(
                        name,
                        [
                            *command,
                            "serve",
                            f"--config={config}",
                            f"--port={port}",
                            f"--log-level={args.memproxy_log_level}",
                            "--log-format=json",
                        ],
                        port,
                        logdir,
                        code[name],
                    )
                )
            for server in started:
                wait_ready(server)
            yield dict(zip(("direct", "floor", *names), started, strict=True))
        finally:
            for server in started:
                server.process.terminate()
            for server in started:
                try:
                    server.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()


# -- requests ------------------------------------------------------------------------------------


class Reply(Protocol):
    status_code: int

    def aiter_raw(self) -> AsyncIterator[bytes]: ...


@dataclass(frozen=True)
class Shape:
    """A wire protocol the targets are measured on: its route and its request bodies."""

    name: str
    path: str

    @property
    def label(self) -> str:
        return f"POST {self.path}"


SHAPES = {
    "chat": Shape("chat", CHAT_PATH),
    "responses": Shape("responses", RESPONSES_PATH),
    "messages": Shape("messages", MESSAGES_PATH),
}


@dataclass
class Target:
    name: str
    post: Callable[[str, bytes], AbstractAsyncContextManager[Reply]]
    close: Callable[[], Awaitable[None]]


@dataclass
class Lane:
    """One target on one shape: what the targets take turns between."""

    target: Target
    shape: Shape

    @property
    def name(self) -> str:
        return self.target.name


@dataclass
class Sample:
    latency: float  # seconds, request sent to body complete
    ttft: float | None  # seconds to the first chunk with content (streams only)


@dataclass
class Samples:
    ok: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def payload(stream: bool, model: str = "gpt-4o-mini", shape: str = "chat") -> bytes:
    """The one-message first turn: `messages` of a chat completion or of a Messages request
    (with its required `max_tokens`), or a Responses `input`."""
    message = {"role": "user", "content": PROMPT}
    body: dict[str, Any] = {"model": model}
    body["input" if shape == "responses" else "messages"] = [message]
    if shape == "messages":
        body["max_tokens"] = 100
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


BODIES = {
    (shape, stream): payload(stream, shape=shape) for shape in SHAPES for stream in (False, True)
}
# A Responses stream must end with its `response.completed` event (a whole response, about 2
# kB here): the last bytes of a stream are kept to look for it.
COMPLETED = b"event: response.completed"
# And a Messages stream with `message_stop`.
MESSAGE_STOP = b"event: message_stop"
TAIL_BYTES = 16384


def sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (a Responses event has an `event:` line first)."""
    if event.startswith(b"data: "):
        return event[6:].split(b"\n", 1)[0]
    found = event.find(b"\ndata: ")
    return None if found < 0 else event[found + 7 :].split(b"\n", 1)[0]


def first_content(buffer: bytes, shape: str = "chat") -> tuple[bool, bytes]:
    """Whether a complete SSE event in `buffer` carries content (a chat chunk's `delta.content`,
    a Responses `response.output_text.delta`); the unparsed rest."""
    while b"\n\n" in buffer:
        event, buffer = buffer.split(b"\n\n", 1)
        if shape == "responses":
            if event.startswith(b"event: response.output_text.delta\n"):
                data = sse_data(event)
                if data is not None and json.loads(data).get("delta"):
                    return True, buffer
            continue
        if shape == "messages":
            if event.startswith(b"event: content_block_delta\n"):
                data = sse_data(event)
                if data is not None and json.loads(data).get("delta", {}).get("text"):
                    return True, buffer
            continue
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        choices = json.loads(event[6:]).get("choices") or [{}]
        if (choices[0].get("delta") or {}).get("content"):
            return True, buffer
    return False, buffer


async def measure(lane: Lane, stream: bool) -> Sample:
    """One request; raises on anything but a complete 200 reply with content (a Responses
    stream: ending with `response.completed`)."""
    shape = lane.shape.name
    responses = shape == "responses"
    ending = {"responses": COMPLETED, "messages": MESSAGE_STOP}.get(shape)
    ttft: float | None = None
    buffer = b""
    tail = b""
    started = time.perf_counter()
    async with lane.target.post(lane.shape.path, BODIES[shape, stream]) as response:
        async for chunk in response.aiter_raw():
            if ttft is None:
                buffer += chunk
                if stream and response.status_code == 200:
                    found, buffer = first_content(buffer, shape)
                    if found:
                        ttft = time.perf_counter() - started
            elif ending is not None:
                tail = (tail + chunk)[-TAIL_BYTES:]
    latency = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code} {buffer[:200]!r}")
    if stream and ttft is None:
        raise RuntimeError("stream ended without a content chunk")
    if stream and ending is not None and ending not in buffer + tail:
        raise RuntimeError(f"stream ended without {ending!r}: {(buffer + tail)[-200:]!r}")
    if not stream and (b'"output_text"' if responses else b'"content"') not in buffer:
        raise RuntimeError(f"reply without content: {buffer[:200]!r}")
    return Sample(latency, ttft)


async def record(lane: Lane, stream: bool, into: dict[str, Samples]) -> None:
    try:
        into[lane.name].ok.append(await measure(lane, stream))
    except (OSError, httpx.HTTPError, ProtocolError, RuntimeError, ValueError) as exc:
        into[lane.name].errors.append(f"{type(exc).__name__}: {exc}")


def rotated(targets: list[Any], i: int) -> list[Any]:
    """The targets in turn, each round starting with the next one, so none always goes first."""
    k = i % len(targets)
    return targets[k:] + targets[:k]


async def sequential(
    lanes: list[Lane], n: int, stream: bool, start: int = 0, into: dict[str, Samples] | None = None
) -> dict[str, Samples]:
    """`n` rounds, one request to each lane per round (the first round starting at `start`);
    samples added to `into`, if given."""
    out = into if into is not None else {lane.name: Samples() for lane in lanes}
    for i in range(start, start + n):
        for lane in rotated(lanes, i):
            await record(lane, stream, out)
    return out


async def concurrent(
    lanes: list[Lane],
    n: int,
    stream: bool,
    clients: int,
    segment: int,
    start: int = 0,
    into: dict[str, Samples] | None = None,
) -> dict[str, Samples]:
    """`clients` concurrent clients per lane, lanes taking turns every `segment` requests
    per client; about `n` requests per lane (`start`, `into`: as `sequential`)."""
    out = into if into is not None else {lane.name: Samples() for lane in lanes}

    async def client_loop(lane: Lane) -> None:
        for _ in range(segment):
            await record(lane, stream, out)

    rounds = max(1, math.ceil(n / (clients * segment)))
    for r in range(start, start + rounds):
        for lane in rotated(lanes, r):
            await asyncio.gather(*(client_loop(lane) for _ in range(clients)))
    return out


async def no_buffering(lane: Lane) -> dict[str, Any]:
    """Stream a reply whose upstream waits `--tail` s before its end: the first chunk must
    reach the client before the upstream's end, not with it."""
    first_ns: int | None = None
    end_ns: int | None = None
    buffer = b""
    body = payload(True, TAIL_MODEL, lane.shape.name)
    async with lane.target.post(lane.shape.path, body) as response:
        async for chunk in response.aiter_raw():
            if first_ns is None:
                first_ns = time.monotonic_ns()
            buffer += chunk
    for event in buffer.split(b"\n\n"):
        data = sse_data(event) if b"upstream_end_ns" in event else None
        if data is not None:
            decoded = json.loads(data)
            # (a stream memproxy translated carries it in the text: TAIL_END in fake_upstream)
            found = re.search(r"upstream_end_ns=(\d+)", json.dumps(decoded))
            end_ns = decoded.get("upstream_end_ns") or (int(found[1]) if found else None)
    if first_ns is None or end_ns is None:
        return {"pass": False, "first_chunk_before_end_ms": None, "detail": buffer[:200].decode()}
    lead = (end_ns - first_ns) / 1e6
    return {"pass": lead > 0, "first_chunk_before_end_ms": round(lead, 1)}


# -- figures -------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (name)": state is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def summarize(
    samples: dict[str, Samples], stream: bool, cpu: dict[str, float | None]
) -> dict[str, Any]:
    """Percentiles per target, what each proxy adds over direct, and memproxy's ratios to the
    floor. `cpu` is each proxy process's CPU seconds over the scenario."""
    stats: dict[str, dict[str, Any]] = {}
    for name, s in samples.items():
        latencies = [x.latency for x in s.ok]
        ttfts = [x.ttft for x in s.ok if x.ttft is not None]
        stats[name] = {
            "n": len(s.ok),
            "errors": len(s.errors),
            "first_error": s.errors[0] if s.errors else None,
            "p50_ms": ms(percentile(latencies, 0.5)) if latencies else None,
            "p99_ms": ms(percentile(latencies, 0.99)) if latencies else None,
            "ttft_p50_ms": ms(percentile(ttfts, 0.5)) if stream and ttfts else None,
            "ttft_p99_ms": ms(percentile(ttfts, 0.99)) if stream and ttfts else None,
        }
        used = cpu.get(name)
        sent = len(s.ok) + len(s.errors)
        stats[name]["cpu_ms_per_request"] = ms(used / sent) if used is not None and sent else None
    base = stats["direct"]
    for name in [n for n in stats if n != "direct"]:
        for key in ("p50_ms", "ttft_p50_ms"):
            value, direct = stats[name][key], base[key]
            added = None if value is None or direct is None else round(value - direct, 3)
            stats[name]["added_" + key] = added
    ratios: dict[str, float | None] = {}
    for key in ("added_p50_ms", "added_ttft_p50_ms"):
        floor, mine = stats["floor"][key], stats["memproxy-off"][key]
        ratios[key] = None if floor is None or mine is None or floor <= 0 else mine / floor
    checked = [r for k, r in ratios.items() if stream or k == "added_p50_ms"]
    floor_cpu, mine_cpu = (
        stats["floor"]["cpu_ms_per_request"],
        stats["memproxy-off"]["cpu_ms_per_request"],
    )
    ratio_cpu = mine_cpu / floor_cpu if floor_cpu and mine_cpu is not None else None
    met = all(r is not None and r <= TARGET_RATIO for r in checked)
    on, off = stats["memproxy"], stats["memproxy-off"]
    memory_p50 = (
        None if on["p50_ms"] is None or off["p50_ms"] is None else on["p50_ms"] - off["p50_ms"]
    )
    memory_ttft = (
        None
        if on["ttft_p50_ms"] is None or off["ttft_p50_ms"] is None
        else on["ttft_p50_ms"] - off["ttft_p50_ms"]
    )
    accounting: dict[str, Any] = {}
    if KEYWORDS in stats:
        for key in ("p50_ms", "ttft_p50_ms"):
            now, before = on[key], stats[KEYWORDS][key]
            added = None if now is None or before is None else round(now - before, 3)
            accounting["embeddings_added_" + key] = added
    if UNTRACED in stats:
        for key in ("p50_ms", "ttft_p50_ms", "cpu_ms_per_request"):
            now, before = on[key], stats[UNTRACED][key]
            added = None if now is None or before is None else round(now - before, 3)
            accounting["trace_added_" + key] = added
    if PREVIOUS in stats:
        prev = stats[PREVIOUS]
        for key in ("p50_ms", "ttft_p50_ms"):
            now, before = on[key], prev[key]
            added = None if now is None or before is None else round(now - before, 3)
            accounting["accounting_added_" + key] = added
        accounting["accounting_target_met"] = (
            accounting["accounting_added_p50_ms"] is not None
            and accounting["accounting_added_p50_ms"] <= ACCOUNTING_BUDGET_MS
            and (
                not stream
                or (
                    accounting["accounting_added_ttft_p50_ms"] is not None
                    and accounting["accounting_added_ttft_p50_ms"] <= ACCOUNTING_BUDGET_MS
                )
            )
        )
    return {
        **accounting,
        "memory_added_p50_ms": None if memory_p50 is None else round(memory_p50, 3),
        "memory_added_ttft_ms": None if memory_ttft is None else round(memory_ttft, 3),
        "memory_target_met": memory_p50 is not None and memory_p50 <= MEMORY_BUDGET_MS,
        "targets": stats,
        "ratio_p50": None if ratios["added_p50_ms"] is None else round(ratios["added_p50_ms"], 3),
        "ratio_ttft": (
            None
            if not stream or ratios["added_ttft_p50_ms"] is None
            else round(ratios["added_ttft_p50_ms"], 3)
        ),
        "ratio_cpu": None if ratio_cpu is None else round(ratio_cpu, 3),
        "target_met": met,
    }


def fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if sign else f"{value:.2f}"


def ratio_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def table(
    results: dict[str, dict[str, Any]],
    buffering: dict[str, dict[str, Any]],
    baseline_rev: str | None = None,
) -> str:
    head = (
        f"{'scenario':<16}{'target':<15}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'ttft p50':>10}"
        f"{'added p50':>11}{'added ttft':>12}{'cpu/req':>9}"
    )
    lines = [head, "-" * len(head)]
    for scenario, result in results.items():
        for i, name in enumerate(result["targets"]):
            s = result["targets"][name]
            errors = f"  ({s['errors']} errors: {s['first_error']})" if s["errors"] else ""
            lines.append(
                f"{scenario if i == 0 else '':<16}{name:<15}{s['n']:>6}{fmt(s['p50_ms']):>9}"
                f"{fmt(s['p99_ms']):>9}{fmt(s['ttft_p50_ms']):>10}"
                f"{fmt(s.get('added_p50_ms'), True):>11}"
                f"{fmt(s.get('added_ttft_p50_ms'), True):>12}"
                f"{fmt(s['cpu_ms_per_request']):>9}{errors}"
            )
        verdict = "met" if result["target_met"] else "NOT met"
        ttft = f", ttft {ratio_text(result['ratio_ttft'])}" if result["ratio_ttft"] else ""
        lines.append(
            f"{'':<16}memproxy-off added / floor added: p50 {ratio_text(result['ratio_p50'])}"
            f"{ttft}  -> <= {TARGET_RATIO}x {verdict}"
            f"   (cpu/req {ratio_text(result['ratio_cpu'])})"
        )
        memory = "met" if result["memory_target_met"] else "NOT met"
        memory_ttft = result["memory_added_ttft_ms"]
        lines.append(
            f"{'':<16}memory on over off: p50 {fmt(result['memory_added_p50_ms'], True)} ms"
            + ("" if memory_ttft is None else f", ttft {fmt(memory_ttft, True)} ms")
            + f"  -> <= {MEMORY_BUDGET_MS:.0f} ms {memory}"
        )
        if "embeddings_added_p50_ms" in result:
            ttft_added = result["embeddings_added_ttft_p50_ms"]
            lines.append(
                f"{'':<16}embeddings on over off (memproxy over {KEYWORDS}): p50 "
                f"{fmt(result['embeddings_added_p50_ms'], True)} ms"
                + ("" if ttft_added is None else f", ttft {fmt(ttft_added, True)} ms")
            )
        if "trace_added_p50_ms" in result:
            ttft_added = result["trace_added_ttft_p50_ms"]
            lines.append(
                f"{'':<16}trace summary over off (memproxy over {UNTRACED}): p50 "
                f"{fmt(result['trace_added_p50_ms'], True)} ms"
                + ("" if ttft_added is None else f", ttft {fmt(ttft_added, True)} ms")
                + f", cpu/req {fmt(result['trace_added_cpu_ms_per_request'], True)} ms"
            )
        if "accounting_target_met" in result:
            verdict = "met" if result["accounting_target_met"] else "NOT met"
            ttft_added = result["accounting_added_ttft_p50_ms"]
            rev = f" at {baseline_rev}" if baseline_rev else ""
            lines.append(
                f"{'':<16}memproxy over memproxy-prev{rev}: p50 "
                f"{fmt(result['accounting_added_p50_ms'], True)} ms"
                + ("" if ttft_added is None else f", ttft {fmt(ttft_added, True)} ms")
                + f"  -> <= {ACCOUNTING_BUDGET_MS:.0f} ms {verdict}"
            )
        lines.append("")
    lines.append("no buffering (first chunk reaches the client before the upstream's end):")
    for name, check in buffering.items():
        lead = check["first_chunk_before_end_ms"]
        detail = "no first chunk" if lead is None else f"first chunk {lead:.1f} ms before the end"
        lines.append(f"  {name:<15}{'PASS' if check['pass'] else 'FAIL'}  {detail}")
    return "\n".join(lines)


COMPARED = ("floor", "memproxy-off", "memproxy")


def compare_shapes(chat: dict[str, Any], responses: dict[str, Any]) -> dict[str, Any]:
    """Per scenario and target, what each adds over direct on the Responses shape and on chat
    completions (and their CPU per request), and the Responses shape's extra."""
    out: dict[str, Any] = {}
    for scenario, result in responses.items():
        rows: dict[str, Any] = {}
        for name in COMPARED:
            c, r = chat[scenario]["targets"].get(name), result["targets"].get(name)
            if c is None or r is None:
                continue
            row: dict[str, Any] = {}
            for key in ("added_p50_ms", "added_ttft_p50_ms", "cpu_ms_per_request"):
                row["chat_" + key], row["responses_" + key] = c[key], r[key]
                both = c[key] is not None and r[key] is not None
                row["extra_" + key] = round(r[key] - c[key], 3) if both else None
            rows[name] = row
        out[scenario] = rows
    return out


def comparison_table(rows: dict[str, Any]) -> str:
    head = (
        f"{'scenario':<16}{'target':<15}{'chat p50':>10}{'resp p50':>10}{'extra':>8}"
        f"{'chat ttft':>11}{'resp ttft':>11}{'extra':>8}{'chat cpu':>10}{'resp cpu':>10}"
    )
    lines = [
        "POST /v1/responses against POST /v1/chat/completions (added over direct in ms; cpu/req):",
        head,
        "-" * len(head),
    ]
    for scenario, targets in rows.items():
        for i, (name, row) in enumerate(targets.items()):
            lines.append(
                f"{scenario if i == 0 else '':<16}{name:<15}"
                f"{fmt(row['chat_added_p50_ms'], True):>10}"
                f"{fmt(row['responses_added_p50_ms'], True):>10}"
                f"{fmt(row['extra_added_p50_ms'], True):>8}"
                f"{fmt(row['chat_added_ttft_p50_ms'], True):>11}"
                f"{fmt(row['responses_added_ttft_p50_ms'], True):>11}"
                f"{fmt(row['extra_added_ttft_p50_ms'], True):>8}"
                f"{fmt(row['chat_cpu_ms_per_request']):>10}"
                f"{fmt(row['responses_cpu_ms_per_request']):>10}"
            )
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------


def httpx_post(
    client: httpx.AsyncClient,
) -> Callable[[str, bytes], AbstractAsyncContextManager[Reply]]:
    def post(path: str, body: bytes) -> AbstractAsyncContextManager[Reply]:
        return client.stream("POST", path, content=body)

    return post


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


def headers_for(name: str, args: argparse.Namespace) -> dict[str, str]:
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    if name == "memproxy-off":
        headers["x-memory-mode"] = "off"
    elif name in ("memproxy", PREVIOUS, KEYWORDS, UNTRACED) and args.memory_mode:
        headers["x-memory-mode"] = args.memory_mode
    if args.user:
        headers["x-memory-user-id"] = args.user
    return headers


async def without_memory(server: Server, shape: Shape, args: argparse.Namespace) -> str | None:
    """Why `server` (a memproxy) does not serve `shape` with memory, or None if it does: one
    request with memory on, whose reply must carry memproxy's `x-memory-status` header (a
    revision older than a protocol's memory route passes the request through without it)."""
    headers = {**headers_for("memproxy", args), "x-memory-mode": "full"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
        reply = await client.post(shape.path, content=BODIES[shape.name, False])
    if reply.status_code != 200:
        return f"it answers {shape.label} with {reply.status_code}: {reply.text[:200]}"
    if "x-memory-status" not in reply.headers:
        return f"it passes {shape.label} through without memory (no x-memory-status header)"
    return None


async def skipped_targets(
    servers_: dict[str, Server], shapes: list[Shape], args: argparse.Namespace
) -> dict[str, dict[str, str]]:
    """Per shape, the targets left out and why: memproxy-prev on a shape its revision serves
    without memory. (Chat completions: every revision has memory on them.)"""
    skipped: dict[str, dict[str, str]] = {shape.name: {} for shape in shapes}
    for shape in shapes:
        if shape.name == "chat":
            continue
        if (why := await without_memory(servers_["memproxy"], shape, args)) is not None:
            raise SystemExit(f"memproxy: {why}")
        if PREVIOUS in servers_:
            why = await without_memory(servers_[PREVIOUS], shape, args)
            if why is not None:
                skipped[shape.name][PREVIOUS] = why
    return skipped


def split(n: int, parts: int) -> list[int]:
    """`n` in `parts` near-equal sizes (none empty)."""
    parts = max(1, min(n, parts))
    return [n // parts + (i < n % parts) for i in range(parts)]


async def run(args: argparse.Namespace, servers_: dict[str, Server]) -> dict[str, Any]:
    targets = targets_for(servers_, args)
    shapes = [SHAPES[name] for name in args.shapes]
    try:
        skipped = await skipped_targets(servers_, shapes, args)
        lanes = {
            shape.name: [Lane(t, shape) for t in targets if t.name not in skipped[shape.name]]
            for shape in shapes
        }
        every = [lane for shape in shapes for lane in lanes[shape.name]]
        # Every code path once, before anything counts.
        for stream in (False, True):
            await sequential(every, args.warmup, stream)
        results: dict[str, dict[str, Any]] = {shape.name: {} for shape in shapes}
        pids = {name: server.process.pid for name, server in servers_.items() if name != "direct"}
        for scenario, stream, parallel in SCENARIOS:
            # Warm the connections this scenario needs, the proxies' upstream pools included
            # (uvicorn closes connections idle for 5 s, e.g. during the sequential stream run).
            if parallel:
                await concurrent(every, args.concurrency * 2, stream, args.concurrency, 2)
            else:
                await sequential(every, args.warmup // 3 + 1, stream)
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
                per_round = args.concurrency * args.segment
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
                            args.concurrency,
                            args.segment,
                            start=part,
                            into=into,
                        )
                    else:
                        await sequential(lanes[shape.name], size, stream, start=done, into=into)
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
        return {
            "shapes": {
                shape.name: {
                    "path": shape.path,
                    "scenarios": results[shape.name],
                    "no_buffering": {
                        lane.name: await no_buffering(lane) for lane in lanes[shape.name]
                    },
                    "skipped": skipped[shape.name],
                }
                for shape in shapes
            }
        }
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


def shape_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(SHAPES)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="memproxy's added latency vs a bare pass-through, in one interleaved run."
    )
    parser.add_argument(
        "--requests", type=int, default=300, help="per target and shape, sequential"
    )
    parser.add_argument(
        "--concurrent-requests",
        type=int,
        default=640,
        help="about this many per target and shape, c32",
    )
    parser.add_argument(
        "--shapes",
        type=shape_list,
        default=list(SHAPES),
        help="wire protocols to measure, comma-separated (default: chat,responses,messages)",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--segment", type=int, default=5, help="requests per client before the next target"
    )
    parser.add_argument("--warmup", type=int, default=30, help="sequential warm-up requests")
    parser.add_argument("--chunk-delay", type=float, default=0.002, help="s between chunks")
    parser.add_argument("--tail", type=float, default=0.3, help="s the no-buffering stream waits")
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="load generator's HTTP client (httpx costs ~2 ms CPU per request here)",
    )
    parser.add_argument("--memory-mode", choices=["full", "read", "off"], default=None)
    parser.add_argument("--user", help="a named user for every request (default: anonymous)")
    parser.add_argument(
        "--database-url", help="memproxy's database (default: a fresh SQLite file in a temp dir)"
    )
    parser.add_argument(
        "--baseline-database-url",
        help="memproxy-prev's own database (default: a fresh SQLite file in a temp dir)",
    )
    parser.add_argument(
        "--baseline-rev",
        default=BASELINE_REV,
        help="also run memproxy at this git revision (memproxy-prev); '' to skip",
    )
    parser.add_argument(
        "--embeddings",
        choices=["local", "off"],
        default=None,
        help="memproxy's memory.embeddings (default: the default config's, local)",
    )
    parser.add_argument(
        "--keywords-target",
        action="store_true",
        help=f"also run {KEYWORDS} (memory on, embeddings off): what embeddings add; "
        "needs --user (the anonymous user's turns are not embedded)",
    )
    parser.add_argument(
        "--trace-target",
        action="store_true",
        help=f"also run {UNTRACED} (the tenant's trace off): what recording traces adds",
    )
    parser.add_argument("--memproxy-log-level", default="info")
    parser.add_argument("--logs", help="keep the servers' logs in this directory")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is not met")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("starting servers...", file=sys.stderr, flush=True)
    with servers(args) as servers_:
        print(
            f"measuring {', '.join(args.shapes)} (direct, floor and memproxy interleaved)...",
            file=sys.stderr,
            flush=True,
        )
        figures = run_loop(lambda: run(args, servers_))
    shapes = figures["shapes"]
    buffering_ok = all(c["pass"] for f in shapes.values() for c in f["no_buffering"].values())
    met = buffering_ok and all(
        s["target_met"] for f in shapes.values() for s in f["scenarios"].values()
    )
    figures["target_met"] = met
    if "chat" in shapes:  # where they were before the Responses shape
        figures["scenarios"] = shapes["chat"]["scenarios"]
        figures["no_buffering"] = shapes["chat"]["no_buffering"]
    if "chat" in shapes and "responses" in shapes:
        figures["responses_vs_chat"] = compare_shapes(
            shapes["chat"]["scenarios"], shapes["responses"]["scenarios"]
        )
    figures["settings"] = {
        k: getattr(args, k)
        for k in (
            "requests",
            "concurrent_requests",
            "concurrency",
            "segment",
            "chunk_delay",
            "client",
            "memory_mode",
            "database_url",
            "baseline_rev",
            "baseline_database_url",
            "memproxy_log_level",
            "shapes",
        )
    }
    figures["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    for name, shape in shapes.items():
        print()
        print(SHAPES[name].label)
        for target, why in shape["skipped"].items():
            rev = f" ({args.baseline_rev})" if target == PREVIOUS else ""
            print(f"  {target}{rev} not measured on {SHAPES[name].label}: {why}")
        print()
        print(table(shape["scenarios"], shape["no_buffering"], args.baseline_rev or None))
    if "responses_vs_chat" in figures:
        print()
        print(comparison_table(figures["responses_vs_chat"]))
    print()
    print(
        f"target (added p50 and TTFT <= {TARGET_RATIO}x the floor's, no buffering): "
        + ("MET" if met else "NOT MET")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    raise SystemExit(main())
