"""The realistic workload's headline per target and the targets of issue 37 ("a real turn at
the cost of a first turn"), as ratios with met / not met."""

from __future__ import annotations

from typing import Any

from bench.overhead_bench.servers import (
    FLOOR,
    HEAVY,
    KEYWORDS,
    LITELLM,
    OFF,
    ON,
    PREVIOUS,
)

MEMORY_RATIO = 2.0  # memory on's added p50 and CPU per request, over memproxy-off's
STREAM_RPS = 250.0  # at 32 streaming clients, one process
DEFAULT_EXTRA_MS = 6.0  # the default config (local embeddings): over memproxy-off's added p50
POSTGRES_EXTRA_MS = 3.0  # memory on over off, p50
HEAVY_RATIO = 1.2  # a user with many stored turns against one with few
FLOOR_RATIO = 1.25  # memproxy-off against the floor
RSS_START_MB = 150.0  # the default config at start


def headline(
    scenarios: dict[str, Any], rss: dict[str, dict[str, float | None]]
) -> dict[str, dict[str, Any]]:
    """Per proxy: added p50 (non-stream, sequential), TTFT added (stream, sequential), CPU
    per request (non-stream sequential, stream at 32 clients), stream req/s at 32 clients,
    RSS at start and end."""
    seq, sseq = scenarios["non-stream seq"]["targets"], scenarios["stream seq"]["targets"]
    c32 = scenarios["stream c32"]["targets"]
    out: dict[str, dict[str, Any]] = {}
    for name in seq:
        if name == "direct":
            continue
        out[name] = {
            "added_p50_ms": seq[name].get("added_p50_ms"),
            "added_ttft_ms": sseq.get(name, {}).get("added_ttft_p50_ms"),
            "cpu_ms_per_request": seq[name]["cpu_ms_per_request"],
            "cpu_ms_per_request_stream_c32": c32.get(name, {}).get("cpu_ms_per_request"),
            "stream_req_per_s_c32": c32.get(name, {}).get("req_per_s"),
            "rss_start_mb": rss.get(name, {}).get("start"),
            "rss_end_mb": rss.get(name, {}).get("end"),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _goal(what: str, value: float | None, limit: float, unit: str, at_least: bool = False) -> Any:
    met = value is not None and (value >= limit if at_least else value <= limit)
    shown = "n/a" if value is None else f"{value:.2f}{unit}"
    sign = ">=" if at_least else "<="
    return {"goal": what, "value": value, "text": f"{shown} {sign} {limit:g}{unit}", "met": met}


def goals(
    head: dict[str, dict[str, Any]], embeddings: dict[str, str | None], postgres: bool
) -> list[dict[str, Any]]:
    """`embeddings`: each memproxy target's `memory.embeddings` (None: the default config)."""
    out = []
    off = head.get(OFF, {})
    keywords = next((n for n in (KEYWORDS, ON) if n in head and embeddings.get(n) == "off"), None)
    if keywords is not None:
        mine = head[keywords]
        out.append(
            _goal(
                f"{keywords} (embeddings off) added p50 / {OFF}'s",
                _ratio(mine["added_p50_ms"], off.get("added_p50_ms")),
                MEMORY_RATIO,
                "x",
            )
        )
        out.append(
            _goal(
                f"{keywords} CPU per request / {OFF}'s",
                _ratio(mine["cpu_ms_per_request"], off.get("cpu_ms_per_request")),
                MEMORY_RATIO,
                "x",
            )
        )
        out.append(
            _goal(
                f"{keywords} stream req/s at 32 clients",
                mine["stream_req_per_s_c32"],
                STREAM_RPS,
                "",
                at_least=True,
            )
        )
    if ON in head and embeddings.get(ON) in (None, "local"):
        value = _minus(head[ON]["added_p50_ms"], off.get("added_p50_ms"))
        out.append(
            _goal(f"{ON} (default config) added p50 - {OFF}'s", value, DEFAULT_EXTRA_MS, " ms")
        )
        out.append(
            _goal(
                f"{ON} (default config) RSS at start", head[ON]["rss_start_mb"], RSS_START_MB, " MB"
            )
        )
    if FLOOR in head:
        out.append(
            _goal(
                f"{OFF} added p50 / {FLOOR}'s",
                _ratio(off.get("added_p50_ms"), head[FLOOR]["added_p50_ms"]),
                FLOOR_RATIO,
                "x",
            )
        )
    if postgres:
        on = keywords or ON
        value = _minus(head[on]["added_p50_ms"], off.get("added_p50_ms"))
        out.append(_goal(f"PostgreSQL: {on} over {OFF}, p50", value, POSTGRES_EXTRA_MS, " ms"))
    if HEAVY in head and keywords is not None:
        out.append(
            _goal(
                f"{HEAVY} added p50 / {keywords}'s",
                _ratio(head[HEAVY]["added_p50_ms"], head[keywords]["added_p50_ms"]),
                HEAVY_RATIO,
                "x",
            )
        )
    return out


def comparisons(head: dict[str, dict[str, Any]]) -> list[str]:
    """Lines with no target: memproxy against its previous revision and LiteLLM's proxy."""
    lines = []
    # memproxy-prev runs its revision's default config: it compares with memproxy's.
    for other, names in ((PREVIOUS, (ON,)), (LITELLM, (OFF, KEYWORDS, ON))):
        if other not in head:
            continue
        for name in names:
            if name not in head:
                continue
            ratio = _ratio(head[name]["added_p50_ms"], head[other]["added_p50_ms"])
            cpu = _ratio(head[name]["cpu_ms_per_request"], head[other]["cpu_ms_per_request"])
            lines.append(
                f"{name} / {other}: added p50 {'n/a' if ratio is None else f'{ratio:.2f}x'}, "
                f"CPU per request {'n/a' if cpu is None else f'{cpu:.2f}x'}"
            )
    return lines
