"""memproxy's memory (RSS) at start, after its first turn and after many, on the shipped
config.yaml: the default (local embeddings on) and the same with `memory.embeddings: off`.

Each variant is `memproxy serve` on a copy of config.yaml (its database and spill in a temp
dir; its `echo` upstream answers, so no network), started on its own and measured alone:

- start: once /readyz answers 200 and a second has passed;
- first turn: after one chat completion of a named user (`demo` tenant);
- after N turns: after `--turns` more (`--clients` at once, each user its own growing
  conversation), once the embedding backlog (`memproxy_embedding_backlog`) is back to 0
  (`server.maintenance_seconds` is set to 1 so it is read often; nothing else differs). The
  backlog is sampled every second while the turns run: its largest and last size, and how
  long it took to drain after them, say whether indexing keeps up.

It also prints the time of the first turn (which builds the tokenizers and, with embeddings
on, loads the model), the p50 of a turn after it (time to the whole reply) and the peak RSS
(VmHWM). With
`--baseline-rev REV` the same is measured for that revision (exported with `git archive`),
variant by variant beside this checkout's.

    .venv/bin/python bench/rss.py [--turns 500] [--clients 4] [--baseline-rev REV] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.overhead import (
    ROOT,
    export_revision,
    percentile,
    spawn_memproxy,
    wait_ready,
)

KEY = "demo-key"
VARIANTS = ("default", "embeddings-off")
BACKLOG = re.compile(r'^memproxy_embedding_backlog\{tenant="demo"\} ([0-9.e+]+)$', re.M)


def status(pid: int, field: str) -> float:
    """A /proc/PID/status size field (VmRSS, VmHWM) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no {field} for {pid}")


def config_text(variant: str, home: Path) -> str:
    text = (ROOT / "config.yaml").read_text()
    text = text.replace("sqlite+aiosqlite:///./memproxy.db", f"sqlite+aiosqlite:///{home}/m.db")
    text = text.replace("./memproxy-spill.jsonl", f"{home}/spill.jsonl")
    text = text.replace("maintenance_seconds: 60", "maintenance_seconds: 1")
    text = text.replace("include: [tenants/*.yaml]", "")
    if variant == "embeddings-off":
        text = text.replace("embeddings: local}", "embeddings: off}", 1)
    return text


async def turn(http: httpx.AsyncClient, user: str, n: int) -> float:
    started = time.perf_counter()
    response = await http.post(
        "/v1/chat/completions",
        headers={"x-memory-user-id": user, "x-memory-conversation-id": f"rss-{user}"},
        json={
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "user", "content": f"Turn {n}: what did I say about topic {n % 37}?"}
            ],
        },
    )
    response.raise_for_status()
    return time.perf_counter() - started


async def backlog_drained(http: httpx.AsyncClient, seconds: float) -> float | None:
    """Seconds until the tenant's embedding backlog read 0 (None: not within `seconds`)."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        found = BACKLOG.search((await http.get("/metrics")).text)
        if found is None or float(found.group(1)) == 0:
            return round(time.monotonic() - started, 1)
        await asyncio.sleep(0.5)
    return None


async def measure_server(pid: int, url: str, args: argparse.Namespace) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        for _ in range(600):
            if (await http.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        ready = (await http.get("/readyz")).json()
        await asyncio.sleep(1.0)
        figures: dict[str, Any] = {"readyz": ready, "start_mb": status(pid, "VmRSS")}
        figures["first_turn_ms"] = round(1000 * await turn(http, "rss-first", 0), 1)
        await asyncio.sleep(0.5)
        figures["first_turn_mb"] = status(pid, "VmRSS")
        times: list[float] = []
        left = args.turns

        async def client(c: int) -> None:
            nonlocal left
            while left > 0:
                left -= 1
                times.append(await turn(http, f"rss-{c}", left))

        backlog: list[float] = []

        async def sample() -> None:
            while True:
                found = BACKLOG.search((await http.get("/metrics")).text)
                backlog.append(float(found.group(1)) if found else 0.0)
                await asyncio.sleep(1.0)

        sampler = asyncio.ensure_future(sample())
        await asyncio.gather(*(client(c) for c in range(args.clients)))
        sampler.cancel()
        figures["backlog_max"] = max(backlog, default=0.0)
        figures["backlog_at_end"] = backlog[-1] if backlog else 0.0
        figures["turn_p50_ms"] = round(1000 * percentile(times, 0.5), 1)
        figures["backlog_drained_s"] = await backlog_drained(http, args.drain_seconds)
        figures["after_turns_mb"] = status(pid, "VmRSS")
        figures["peak_mb"] = status(pid, "VmHWM")
    return figures


def run_variant(
    code: Path, variant: str, workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(dir=workdir))
    config = home / "config.yaml"
    config.write_text(config_text(variant, home))
    server = spawn_memproxy(f"memproxy-{variant}", config, home, code)
    try:
        wait_ready(server, timeout=120)
        return asyncio.run(measure_server(server.process.pid, server.url, args))
    finally:
        server.process.terminate()
        server.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=500)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--drain-seconds", type=float, default=120.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--baseline-rev", help="also measure this revision, variant by variant")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:  # (else measured as the default config, under a name that says otherwise)
        parser.error(f"--variants: {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="memproxy-rss-") as tmp:
        workdir = Path(tmp)
        codes = {"memproxy": ROOT}
        if args.baseline_rev:
            codes["memproxy-prev"] = export_revision(args.baseline_rev, workdir / "previous")
        for variant in args.variants.split(","):
            for target, code in codes.items():
                name = f"{target} {variant}"
                results[name] = run_variant(code, variant, workdir, args)
                print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    print(
        f"| target | RSS start MB | after first turn | after {args.turns} turns | peak | "
        "first turn ms | turn p50 ms | backlog max / at the end | then drained in (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['start_mb']} | {r['first_turn_mb']} | {r['after_turns_mb']} | "
            f"{r['peak_mb']} | {r['first_turn_ms']} | {r['turn_p50_ms']} | "
            f"{r['backlog_max']:.0f} / {r['backlog_at_end']:.0f} | {r['backlog_drained_s']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
