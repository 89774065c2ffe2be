"""Intent classifier accuracy on tests/data/intent_eval.jsonl.

Each row is a user turn with its preceding history, a label, and a split: `dev` (what the
keyword rules may be tuned on), `test` (never tuned on), or `holdout` (written later, by someone
who had seen neither the rules nor the other rows, after the first look at `test`). Prints per-label precision and
recall, accuracy and a confusion table for the keyword classifier and, when an API key is
configured (`OPENAI_API_KEY`, or `--api-key`; `--base-url` for any OpenAI-compatible server),
for the LLM classifier through memproxy's own `openai` upstream.

    .venv/bin/python bench/intent_eval.py [--split test|dev|all] [--llm-model gpt-4o-mini]

tests/data/intent_tune.jsonl (split `tune`) is a second tuning set, written independently of the
rules and of the eval rows; `--split tune` reads it (unless `--data` names another file), and
`--ids t001-t120` keeps only the rows whose ids fall in a range (e.g. half of it, as a check):

    .venv/bin/python bench/intent_eval.py --split tune --ids t121-t240 --errors
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from policies.intent import Intent
from policies.intent_keywords import KeywordClassifier
from policies.intent_labels import DEFAULT_LABELS
from policies.intent_llm import llm_request, parse_llm_reply
from proxy.core.config import UpstreamConfig
from proxy.upstream.openai import OpenAIUpstream
from proxy.upstream.sse import reply_from_completion

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "intent_eval.jsonl"
TUNE = DATA.with_name("intent_tune.jsonl")
SPLITS = ("test", "holdout", "dev", "tune", "all")
TARGET_ACCURACY = 0.80


def load(path: Path, split: str, ids: str | None = None) -> list[dict[str, Any]]:
    """The rows of `split` (every row for `all`), only those with an id in `ids` ("a-b",
    inclusive, compared as strings of the same shape, e.g. "t001-t120") if it is given."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if split == "all" or r["split"] == split]
    if ids:
        first, _, last = ids.partition("-")
        rows = [r for r in rows if first <= str(r["id"]) <= (last or first)]
    return rows


def report(name: str, rows: list[dict[str, Any]], predicted: list[str]) -> dict[str, Any]:
    labels = list(DEFAULT_LABELS)
    truth = [r["label"] for r in rows]
    correct = sum(t == p for t, p in zip(truth, predicted, strict=True))
    per_label: dict[str, dict[str, float | int]] = {}
    for label in labels:
        tp = sum(t == p == label for t, p in zip(truth, predicted, strict=True))
        guessed = predicted.count(label)
        actual = truth.count(label)
        per_label[label] = {
            "precision": round(tp / guessed, 3) if guessed else 0.0,
            "recall": round(tp / actual, 3) if actual else 0.0,
            "support": actual,
        }
    confusion = Counter(zip(truth, predicted, strict=True))
    return {
        "classifier": name,
        "n": len(rows),
        "accuracy": round(correct / len(rows), 3) if rows else 0.0,
        "per_label": per_label,
        "confusion": {f"{t}->{p}": n for (t, p), n in sorted(confusion.items()) if t != p},
    }


def show(result: dict[str, Any]) -> str:
    lines = [f"{result['classifier']}: accuracy {result['accuracy']:.3f} on {result['n']} turns"]
    lines.append(f"  {'label':<11}{'precision':>10}{'recall':>8}{'n':>5}")
    for label, figures in result["per_label"].items():
        lines.append(
            f"  {label:<11}{figures['precision']:>10.2f}{figures['recall']:>8.2f}"
            f"{figures['support']:>5}"
        )
    if result["confusion"]:
        worst = sorted(result["confusion"].items(), key=lambda kv: -kv[1])[:8]
        lines.append("  most confused: " + ", ".join(f"{k} {v}" for k, v in worst))
    return "\n".join(lines)


# Long turns built to make a regular expression backtrack (an opener said again and again,
# one character repeated, an unclosed quote or fence), each timed against ordinary turns of
# the same length: what the classifier reads costs the same whatever it holds.
WORST_CASES = (
    "thanks for the " * 150,
    "ok, " * 500 + "x",
    "hi there, " * 200 + "?",
    "thanks, " * 500 + "what is rust?",
    "what is " * 400,
    "a" * 3000,
    '"' * 3000,
    "'" + "x " * 1500,
    ":" + " x" * 1500,
    "```" * 700,
)


def worst_case_ratio(rows: list[dict[str, Any]], rounds: int = 20) -> tuple[float, float]:
    """Microseconds per turn of `WORST_CASES` and of ordinary turns of the same length (the
    rows' texts run together), with the same history; best of `rounds`."""
    classifier = KeywordClassifier()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    prose = " ".join(r["text"] for r in rows) * 20
    ordinary = [prose[i * 97 : i * 97 + len(t)] for i, t in enumerate(WORST_CASES)]
    timings = []
    for texts in (WORST_CASES, ordinary):
        best = math.inf
        for _ in range(rounds):
            started = time.perf_counter()
            for text in texts:
                classifier.classify(text, history)
            best = min(best, time.perf_counter() - started)
        timings.append(best / len(texts) * 1e6)
    return timings[0], timings[1]


def keyword_predictions(rows: Iterable[dict[str, Any]]) -> tuple[list[str], float]:
    classifier = KeywordClassifier()
    started = time.perf_counter()
    labels = [classifier.classify(r["text"], r["history"]).label for r in rows]
    return labels, time.perf_counter() - started


async def llm_predictions(
    rows: list[dict[str, Any]], model: str, api_key: str, base_url: str
) -> list[str]:
    """The LLM classifier's labels (a failed call counts as `other`, as no label)."""
    config = UpstreamConfig(kind="openai", base_url=base_url, api_key=api_key)
    async with httpx.AsyncClient(timeout=60) as http:
        upstream = OpenAIUpstream("eval", config, http)
        limit = asyncio.Semaphore(8)

        async def one(row: dict[str, Any]) -> str:
            body = llm_request(model, row["text"], row["history"], DEFAULT_LABELS)
            async with limit:
                reply = await upstream.chat_completions(body, stream=False)
            message, _ = reply_from_completion(reply.body or b"")
            intent: Intent | None = parse_llm_reply((message or {}).get("content"), DEFAULT_LABELS)
            return intent.label if intent else "other"

        return list(await asyncio.gather(*(one(r) for r in rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument(
        "--data", type=Path, help=f"the rows (default {TUNE.name} for tune, else {DATA.name})"
    )
    parser.add_argument("--ids", help="only the rows with ids in this range, e.g. t001-t120")
    parser.add_argument("--llm-model", default="gpt-4o-mini")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--base-url", default="https://api.openai.com/v1")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--errors", action="store_true", help="list the keyword misses")
    args = parser.parse_args(argv)

    data = args.data or (TUNE if args.split == "tune" else DATA)
    rows = load(data, args.split, args.ids)
    if not rows:
        parser.error(f"no rows of split {args.split!r} in {data}")
    predicted, took = keyword_predictions(rows)
    results = [report("keyword", rows, predicted)]
    print(show(results[0]))
    print(f"  {took / len(rows) * 1e6:.0f} us per turn")
    worst, ordinary = worst_case_ratio(rows)
    results[0]["worst_case_us"], results[0]["same_length_us"] = round(worst), round(ordinary)
    print(
        f"  turns built to backtrack: {worst:.0f} us per turn, ordinary turns of the same "
        f"length {ordinary:.0f} us ({worst / ordinary:.1f}x)"
    )
    if args.errors:
        for row, label in zip(rows, predicted, strict=True):
            if label != row["label"]:
                context = " [history]" if row["history"] else ""
                print(f"    {row['id']} {row['label']} -> {label}: {row['text'][:90]!r}{context}")
    met = results[0]["accuracy"] >= TARGET_ACCURACY
    print(
        f"  target (keyword accuracy >= {TARGET_ACCURACY} on {args.split}"
        + (f" {args.ids}" if args.ids else "")
        + "): "
        + ("met" if met else "NOT met")
    )
    if args.api_key:
        labels = asyncio.run(llm_predictions(rows, args.llm_model, args.api_key, args.base_url))
        results.append(report(f"llm ({args.llm_model})", rows, labels))
        print()
        print(show(results[1]))
    else:
        print("\nllm: skipped (no OPENAI_API_KEY or --api-key)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
