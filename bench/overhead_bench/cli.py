"""The command line of bench/overhead.py: options, the run, the printed figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from bench.overhead_bench import goals as issue_goals
from bench.overhead_bench.figures import TARGET_RATIO, compare_shapes
from bench.overhead_bench.report import comparison_table, goals_lines, headline_table, table
from bench.overhead_bench.run import run, run_loop
from bench.overhead_bench.servers import (
    HEAVY,
    KEYWORDS,
    LITELLM,
    LITELLM_INSTALL,
    PREVIOUS,
    UNTRACED,
    embeddings_of,
    litellm_binary,
    memproxy_names,
    servers,
)
from bench.overhead_bench.wire import SHAPES

# The last commit of the conversation-memory issue: memproxy before cost accounting and limits
# (the first-turn workload's memproxy-prev).
FIRST_TURN_BASELINE = "5ab5a29"
# The code at the start of issue 37 (a real turn at the cost of a first turn), with its
# defaults: the realistic workload's memproxy-prev.
REALISTIC_BASELINE = "33cd0e8"


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
    add = parser.add_argument
    add(
        "--scenario",
        choices=["realistic", "first-turn"],
        default="realistic",
        help="named users with growing conversations and recall (default), or every request "
        "the same first turn",
    )
    add("--requests", type=int, default=300, help="per target and shape, sequential")
    add("--concurrent-requests", type=int, default=640, help="about this many, c32")
    add(
        "--shapes",
        type=shape_list,
        default=None,
        help="wire protocols, comma-separated, of chat,responses,messages (default: chat for "
        "realistic, all three for first-turn)",
    )
    add("--concurrency", type=int, default=32, help="clients (realistic: users) per target")
    add("--segment", type=int, default=5, help="requests per client before the next target")
    add("--warmup", type=int, default=30, help="sequential warm-up requests")
    add("--chunk-delay", type=float, default=0.002, help="s between chunks")
    add("--tail", type=float, default=0.3, help="s the no-buffering stream waits")
    add(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="load generator's HTTP client (httpx costs ~2 ms CPU per request here)",
    )
    add("--memory-mode", choices=["full", "read", "off"], default=None)
    add("--user", help="first-turn: a named user for every request (default: anonymous)")
    add(
        "--stored-turns",
        type=int,
        default=100,
        help="realistic: turns each user has stored before the run (default 100)",
    )
    add(
        "--heavy-turns",
        type=int,
        default=0,
        help=f"realistic: also run {HEAVY} (embeddings off) whose users each have this many "
        "stored turns, e.g. 5000",
    )
    add("--drain-timeout", type=float, default=900.0, help="s to wait for the seeds' embeddings")
    add(
        "--embeddings",
        choices=["local", "off", "both"],
        default=None,
        help=f"memproxy's memory.embeddings; both: memproxy (local) and {KEYWORDS} (off) in "
        "one run (default: both for realistic, the default config's for first-turn)",
    )
    add("--postgres", action="store_true", help="memproxy on a PostgreSQL server started here")
    add("--database-url", help="memproxy's database (default: a fresh SQLite file in a temp dir)")
    add("--baseline-database-url", help="memproxy-prev's own database (default: SQLite)")
    add(
        "--baseline-rev",
        default=None,
        help="also run memproxy at this git revision (memproxy-prev); '' to skip (default: "
        f"{REALISTIC_BASELINE} for realistic, {FIRST_TURN_BASELINE} for first-turn)",
    )
    add(
        "--baseline-embeddings",
        choices=["local", "off"],
        default=None,
        help="memproxy-prev's memory.embeddings, to compare a change at equal settings "
        "(default: the revision's default config)",
    )
    add("--litellm", action="store_true", help=f"also run LiteLLM's proxy ({LITELLM})")
    add("--trace-target", action="store_true", help=f"also run {UNTRACED} (the trace off)")
    add("--memproxy-log-level", default="info")
    add("--logs", help="keep the servers' logs in this directory")
    add("--json", help="also write the figures to this file")
    add("--strict", action="store_true", help="exit 1 when a target is not met")
    args = parser.parse_args(argv)
    realistic = args.scenario == "realistic"
    if args.shapes is None:
        args.shapes = ["chat"] if realistic else list(SHAPES)
    if args.embeddings is None and realistic:
        args.embeddings = "both"
    if args.baseline_rev is None:
        args.baseline_rev = REALISTIC_BASELINE if realistic else FIRST_TURN_BASELINE
    if not realistic:
        args.heavy_turns = 0
    return args


def litellm_available(args: argparse.Namespace) -> bool:
    if litellm_binary() is not None:
        return True
    print(
        f"LiteLLM's proxy is not installed (an optional target); to measure it, run\n"
        f"    {LITELLM_INSTALL}\nand add --litellm.",
        file=sys.stderr,
    )
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.litellm:
        args.litellm = litellm_available(args)
    elif litellm_binary() is None:
        litellm_available(args)
    print("starting servers...", file=sys.stderr, flush=True)
    with servers(args) as servers_:
        print(
            f"measuring {args.scenario} on {', '.join(args.shapes)} ({', '.join(servers_)}, "
            "interleaved)...",
            file=sys.stderr,
            flush=True,
        )
        figures = run_loop(lambda: run(args, servers_))
    realistic = args.scenario == "realistic"
    shapes = figures["shapes"]
    buffering_ok = all(c["pass"] for f in shapes.values() for c in f["no_buffering"].values())
    met = buffering_ok and all(
        s["target_met"] for f in shapes.values() for s in f["scenarios"].values()
    )
    if "chat" in shapes:  # where they were before the Responses shape
        figures["scenarios"] = shapes["chat"]["scenarios"]
        figures["no_buffering"] = shapes["chat"]["no_buffering"]
    if "chat" in shapes and "responses" in shapes:
        figures["responses_vs_chat"] = compare_shapes(
            shapes["chat"]["scenarios"], shapes["responses"]["scenarios"]
        )
    labels = labels_for(args)
    if realistic:
        embeddings = {name: embeddings_of(name, args) for name in memproxy_names(args)}
        for shape in shapes.values():
            head = issue_goals.headline(shape["scenarios"], figures["rss_mb"])
            shape["headline"] = head
            shape["goals"] = issue_goals.goals(head, embeddings, args.postgres)
            shape["comparisons"] = issue_goals.comparisons(head)
        met = buffering_ok and all(g["met"] for s in shapes.values() for g in s["goals"])
    figures["target_met"] = met
    figures["settings"] = {**vars(args), "labels": labels}
    figures["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
    }
    print_figures(figures, args, labels)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if args.strict and not met else 0


def labels_for(args: argparse.Namespace) -> dict[str, str]:
    out = {"floor": "bare Litestar + httpx pass-through", "memproxy-off": "X-Memory-Mode: off"}
    database = "PostgreSQL" if args.postgres else "SQLite"
    for name in memproxy_names(args):
        if name == "memproxy-off":
            continue
        if name == PREVIOUS:
            settings = (
                f"embeddings {args.baseline_embeddings}"
                if args.baseline_embeddings
                else "its defaults"
            )
            out[name] = f"memory on, at {args.baseline_rev}, {settings}, {database}"
            continue
        embeddings = embeddings_of(name, args) or "the default config's"
        out[name] = f"memory on, embeddings {embeddings}, {database}"
        if name == HEAVY:
            out[name] += f", {args.heavy_turns} stored turns per user"
    if args.litellm:
        out[LITELLM] = "LiteLLM's proxy (no memory)"
    return out


def print_figures(
    figures: dict[str, Any], args: argparse.Namespace, labels: dict[str, str]
) -> None:
    realistic = args.scenario == "realistic"
    for name, shape in figures["shapes"].items():
        print()
        print(SHAPES[name].label + (" (realistic workload)" if realistic else ""))
        for target, why in shape["skipped"].items():
            rev = f" ({args.baseline_rev})" if target == PREVIOUS else ""
            print(f"  {target}{rev} not measured on {SHAPES[name].label}: {why}")
        print()
        print(table(shape["scenarios"], shape["no_buffering"], args.baseline_rev, not realistic))
        if realistic:
            print()
            print(headline_table(shape["headline"], labels))
            print()
            print(goals_lines(shape["goals"], shape["comparisons"]))
    if "responses_vs_chat" in figures:
        print()
        print(comparison_table(figures["responses_vs_chat"]))
    if realistic:
        print()
        print(f"seeding and draining, s: {figures.get('seeded_in_s')}")
        print(f"background jobs queued or running at the end: {figures.get('backlog_at_end')}")
        for name, headers in figures.get("attached", {}).items():
            shown = ", ".join(f"{k.removeprefix('x-memory-')}={v}" for k, v in headers.items())
            print(f"one more turn of bench-user-00 on {name}: {shown}")
        return
    print()
    print(
        f"target (added p50 and TTFT <= {TARGET_RATIO}x the floor's, no buffering): "
        + ("MET" if figures["target_met"] else "NOT MET")
    )
