"""From samples to figures: percentiles, what each proxy adds over direct, and the ratios
the targets are about."""

from __future__ import annotations

import math
from typing import Any

from bench.overhead_bench.servers import DIRECT, FLOOR, KEYWORDS, OFF, ON, PREVIOUS, UNTRACED
from bench.overhead_bench.wire import Samples

TARGET_RATIO = 1.25
# memproxy (memory on) must add at most MEMORY_BUDGET_MS p50 over memproxy-off on a first
# turn (the conversation-memory issue's target).
MEMORY_BUDGET_MS = 2.0
ACCOUNTING_BUDGET_MS = 1.0


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def target_stats(s: Samples, stream: bool, used: float | None) -> dict[str, Any]:
    latencies = [x.latency for x in s.ok]
    ttfts = [x.ttft for x in s.ok if x.ttft is not None]
    sent = len(s.ok) + len(s.errors)
    return {
        "n": len(s.ok),
        "errors": len(s.errors),
        "first_error": s.errors[0] if s.errors else None,
        "p50_ms": ms(percentile(latencies, 0.5)) if latencies else None,
        "p99_ms": ms(percentile(latencies, 0.99)) if latencies else None,
        "ttft_p50_ms": ms(percentile(ttfts, 0.5)) if stream and ttfts else None,
        "ttft_p99_ms": ms(percentile(ttfts, 0.99)) if stream and ttfts else None,
        "cpu_ms_per_request": ms(used / sent) if used is not None and sent else None,
        "req_per_s": round(len(s.ok) / s.busy, 1) if s.busy > 0 else None,
    }


def summarize(
    samples: dict[str, Samples], stream: bool, cpu: dict[str, float | None]
) -> dict[str, Any]:
    """Percentiles per target, what each proxy adds over direct, and memproxy's ratios to the
    floor. `cpu` is each proxy process's CPU seconds over the scenario."""
    stats = {name: target_stats(s, stream, cpu.get(name)) for name, s in samples.items()}
    base = stats[DIRECT]
    for name in [n for n in stats if n != DIRECT]:
        for key in ("p50_ms", "ttft_p50_ms"):
            stats[name]["added_" + key] = difference(stats[name][key], base[key])
    ratios: dict[str, float | None] = {}
    for key in ("added_p50_ms", "added_ttft_p50_ms"):
        floor, mine = stats[FLOOR][key], stats[OFF][key]
        ratios[key] = None if floor is None or mine is None or floor <= 0 else mine / floor
    checked = [r for k, r in ratios.items() if stream or k == "added_p50_ms"]
    floor_cpu, mine_cpu = stats[FLOOR]["cpu_ms_per_request"], stats[OFF]["cpu_ms_per_request"]
    ratio_cpu = mine_cpu / floor_cpu if floor_cpu and mine_cpu is not None else None
    met = all(r is not None and r <= TARGET_RATIO for r in checked)
    on, off = stats[ON], stats[OFF]
    memory_p50 = difference(on["p50_ms"], off["p50_ms"])
    accounting: dict[str, Any] = {}
    if KEYWORDS in stats:
        for key in ("p50_ms", "ttft_p50_ms"):
            accounting["embeddings_added_" + key] = difference(on[key], stats[KEYWORDS][key])
    if UNTRACED in stats:
        for key in ("p50_ms", "ttft_p50_ms", "cpu_ms_per_request"):
            accounting["trace_added_" + key] = difference(on[key], stats[UNTRACED][key])
    if PREVIOUS in stats:
        for key in ("p50_ms", "ttft_p50_ms"):
            accounting["accounting_added_" + key] = difference(on[key], stats[PREVIOUS][key])
        p50, ttft = (
            accounting["accounting_added_p50_ms"],
            accounting["accounting_added_ttft_p50_ms"],
        )
        accounting["accounting_target_met"] = (
            p50 is not None
            and p50 <= ACCOUNTING_BUDGET_MS
            and (not stream or (ttft is not None and ttft <= ACCOUNTING_BUDGET_MS))
        )
    return {
        **accounting,
        "memory_added_p50_ms": memory_p50,
        "memory_added_ttft_ms": difference(on["ttft_p50_ms"], off["ttft_p50_ms"]),
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


COMPARED = (FLOOR, OFF, ON)


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
                row["extra_" + key] = difference(r[key], c[key])
            rows[name] = row
        out[scenario] = rows
    return out
