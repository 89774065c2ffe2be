"""The tables printed at the end of a run."""

from __future__ import annotations

from typing import Any

from bench.overhead_bench.figures import ACCOUNTING_BUDGET_MS, MEMORY_BUDGET_MS, TARGET_RATIO
from bench.overhead_bench.servers import KEYWORDS, UNTRACED


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
    first_turn: bool = True,
) -> str:
    """Every scenario's figures per target. `first_turn`: with the first-turn workload's
    target lines (memory on over off at most MEMORY_BUDGET_MS, the accounting budget)."""
    head = (
        f"{'scenario':<16}{'target':<19}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'ttft p50':>10}"
        f"{'added p50':>11}{'added ttft':>12}{'cpu/req':>9}{'req/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for scenario, result in results.items():
        for i, name in enumerate(result["targets"]):
            s = result["targets"][name]
            errors = f"  ({s['errors']} errors: {s['first_error']})" if s["errors"] else ""
            lines.append(
                f"{scenario if i == 0 else '':<16}{name:<19}{s['n']:>6}{fmt(s['p50_ms']):>9}"
                f"{fmt(s['p99_ms']):>9}{fmt(s['ttft_p50_ms']):>10}"
                f"{fmt(s.get('added_p50_ms'), True):>11}"
                f"{fmt(s.get('added_ttft_p50_ms'), True):>12}"
                f"{fmt(s['cpu_ms_per_request']):>9}"
                f"{s['req_per_s'] if s['req_per_s'] is not None else '-':>8}{errors}"
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
            + (f"  -> <= {MEMORY_BUDGET_MS:.0f} ms {memory}" if first_turn else "")
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
                + (f"  -> <= {ACCOUNTING_BUDGET_MS:.0f} ms {verdict}" if first_turn else "")
            )
        lines.append("")
    lines.append("no buffering (first chunk reaches the client before the upstream's end):")
    for name, check in buffering.items():
        lead = check["first_chunk_before_end_ms"]
        detail = "no first chunk" if lead is None else f"first chunk {lead:.1f} ms before the end"
        lines.append(f"  {name:<19}{'PASS' if check['pass'] else 'FAIL'}  {detail}")
    return "\n".join(lines)


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


def headline_table(head: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    """The realistic workload per proxy, as on the performance page. `labels`: what each
    target is (its embeddings, its revision)."""
    top = (
        f"{'target':<19}{'added p50':>10}{'ttft added':>11}{'cpu/req':>9}{'cpu/req c32':>12}"
        f"{'stream req/s c32':>17}{'rss start':>10}{'rss end':>9}  what"
    )
    lines = [top, "-" * len(top)]
    for name, row in head.items():
        lines.append(
            f"{name:<19}{fmt(row['added_p50_ms'], True):>10}{fmt(row['added_ttft_ms'], True):>11}"
            f"{fmt(row['cpu_ms_per_request']):>9}{fmt(row['cpu_ms_per_request_stream_c32']):>12}"
            f"{fmt(row['stream_req_per_s_c32']):>17}{fmt(row['rss_start_mb']):>10}"
            f"{fmt(row['rss_end_mb']):>9}  {labels.get(name, '')}"
        )
    lines.append(
        "(added p50: non-stream, sequential; ttft added: stream, sequential; cpu/req: each"
        " proxy process's CPU ms per request, non-stream sequential and stream at 32 clients;"
        " RSS in MB)"
    )
    return "\n".join(lines)


def goals_lines(goals: list[dict[str, Any]], comparisons: list[str]) -> str:
    lines = ["issue 37's targets (realistic workload, this run):"]
    for goal in goals:
        lines.append(f"  {goal['goal']}: {goal['text']}  -> {'met' if goal['met'] else 'NOT met'}")
    if comparisons:
        lines.append("compared (no target):")
        lines.extend(f"  {line}" for line in comparisons)
    return "\n".join(lines)
