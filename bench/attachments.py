"""Attachments larger than the budget: does the passage that answers the question reach the model?

A seeded generator writes company reports (public-domain by construction: every name, place
and figure is made up). Each report is a few thousand tokens of paragraphs about one company;
each paragraph states one fact ("Norvex opened its research lab in Tallin in 1987, ...") among
sentences that share its words (the same company, the same kinds of places, years and people),
so lexical overlap alone does not find it. Each question asks for one fact and comes with
three reports (its own and two others, in a random order), about 10,000 tokens in all.

Measured at a 2,000-token budget, in one run:

- memproxy: the question through `/v1/chat/completions` with the three reports as inline
  `attachments` (`X-Memory-Mode: read`, the attachments' share is the whole budget), against a
  fake upstream that records what it was sent; the rule plans (no model is called);
- plain truncation: the reports joined, cut at 2,000 tokens;
- plain BM25 over fixed-size chunks: the reports cut every 200 tokens, ranked by BM25 for the
  question, the best taken while they fit.

Reported: the share of questions whose answer sentence reached the model whole, and the
proxy's time for the request (p50/p95).

    .venv/bin/python bench/attachments.py [--questions 120] [--seed 7]
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from policies.recall import STOPWORDS
from policies.tokens import _encoding, encoding_name
from proxy.app import create_app
from proxy.core.config import (
    AttachmentSettings,
    Config,
    ContextSettings,
    DatabaseConfig,
    IntentSettings,
    TenantConfig,
    UpstreamConfig,
)
from proxy.core.logs import configure_logging
from proxy.core.offline import prepare_offline_environment
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread

BUDGET = 2000
CHUNK_TOKENS = 200
MODEL = "gpt-4o-mini"
KEY = "bench-key"
SYLLABLES = [
    "nor",
    "vex",
    "tal",
    "in",
    "mar",
    "qu",
    "ill",
    "bra",
    "den",
    "sol",
    "ka",
    "ri",
    "fen",
    "dor",
    "lu",
    "ma",
    "zet",
    "or",
    "pol",
    "an",
]
UNITS = [
    ("research lab", "opened its research lab in {city} in {year}"),
    ("sales office", "opened its sales office in {city} in {year}"),
    ("warehouse", "built a warehouse in {city} in {year}"),
    ("training centre", "set up a training centre in {city} in {year}"),
    ("design studio", "founded a design studio in {city} in {year}"),
    ("repair shop", "ran a repair shop in {city} from {year}"),
    ("call centre", "moved its call centre to {city} in {year}"),
    ("factory", "bought a factory in {city} in {year}"),
]
FILLER = [
    "{company} reviewed its plans for the {unit} with the board, as it does every spring.",
    "Staff at {company} often describe the {unit} as busy but friendly.",
    "The annual report of {company} mentions the {unit} in a short paragraph on costs.",
    "Visitors to {company} sometimes ask about the {unit}, its history and its people.",
    "{person} wrote a memo about the {unit} that {company} still quotes in meetings.",
    "In {year}, {company} printed a booklet about its offices and the people in them.",
    "The city of {city} hosts several firms like {company}, each with its own story.",
    "Local newspapers in {city} covered {company} now and then, usually on slow days.",
]


def name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def report(rng: random.Random, company: str) -> tuple[str, list[tuple[str, str]]]:
    """A report on `company` and its facts: (question, answer sentence) pairs."""
    paragraphs: list[str] = []
    facts: list[tuple[str, str]] = []
    units = rng.sample(UNITS, len(UNITS))
    for unit, verb in units * 3:
        city, year, person = name(rng, 2), rng.randint(1950, 2020), f"{name(rng, 2)} {name(rng, 2)}"
        fact = f"{company} {verb.format(city=city, year=year)}, under {person}."
        filler = [
            rng.choice(FILLER).format(
                company=company,
                unit=rng.choice(UNITS)[0],
                city=name(rng, 2),
                year=rng.randint(1950, 2020),
                person=f"{name(rng, 2)} {name(rng, 2)}",
            )
            for _ in range(rng.randint(5, 8))
        ]
        at = rng.randint(0, len(filler))
        paragraphs.append(" ".join([*filler[:at], fact, *filler[at:]]))
        facts.append((f"Where and when did {company} get its {unit}, and who led it there?", fact))
    return "\n\n".join(paragraphs), facts


def tokens_of(text: str) -> list[int]:
    return _encoding(encoding_name(MODEL)).encode(text, disallowed_special=())


def decode(tokens: list[int]) -> str:
    return _encoding(encoding_name(MODEL)).decode(tokens)


def words(text: str) -> list[str]:
    return [w for w in re.findall(r"[^\W_]+", text.lower()) if w not in STOPWORDS]


def truncation(documents: list[str]) -> str:
    return decode(tokens_of("\n\n".join(documents))[:BUDGET])


def bm25_chunks(documents: list[str], question: str, k1: float = 1.2, b: float = 0.75) -> str:
    chunks: list[str] = []
    for document in documents:
        ids = tokens_of(document)
        chunks += [decode(ids[i : i + CHUNK_TOKENS]) for i in range(0, len(ids), CHUNK_TOKENS)]
    bags = [words(c) for c in chunks]
    average = sum(len(w) for w in bags) / len(bags)
    terms = set(words(question))
    df = {t: sum(t in set(w) for w in bags) for t in terms}
    n = len(bags)

    def score(bag: list[str]) -> float:
        total = 0.0
        for t in terms:
            tf = bag.count(t)
            if tf:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(bag) / average))
        return total

    ranked = sorted(range(n), key=lambda i: -score(bags[i]))
    chosen, used = [], 0
    for i in ranked:
        size = len(tokens_of(chunks[i]))
        if used + size > BUDGET:
            continue
        chosen.append(chunks[i])
        used += size
    return "\n\n".join(chosen)


def reached(sentence: str, text: str) -> bool:
    flat = " ".join(text.replace("> ", " ").split())
    return " ".join(sentence.split()) in flat


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=120)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    prepare_offline_environment()
    configure_logging("warning", "console")
    rng = random.Random(args.seed)
    companies = sorted({name(rng, 3) for _ in range(40)})[:24]
    reports = {c: report(rng, c) for c in companies}
    cases: list[tuple[str, str, list[str]]] = []
    for _ in range(args.questions):
        company = rng.choice(companies)
        question, answer = rng.choice(reports[company][1])
        others = rng.sample([c for c in companies if c != company], 2)
        documents = [reports[c][0] for c in [company, *others]]
        rng.shuffle(documents)
        cases.append((question, answer, documents))
    sizes = [sum(len(tokens_of(d)) for d in docs) for _, _, docs in cases[:10]]
    print(
        f"{len(cases)} questions, 3 reports each (~{statistics.mean(sizes):,.0f} tokens), "
        f"budget {BUDGET:,} tokens",
        flush=True,
    )

    fake = FakeOpenAI()
    with tempfile.TemporaryDirectory() as tmp, ServerThread(fake) as upstream:
        config = Config(
            database=DatabaseConfig(url=f"sqlite+aiosqlite:///{tmp}/bench.db"),
            upstreams={
                "fake": UpstreamConfig(kind="openai", base_url=upstream.url + "/v1", api_key="k")
            },
            tenants={
                "bench": TenantConfig(
                    api_keys=[KEY],
                    upstream="fake",
                    context=ContextSettings(token_budget=BUDGET),
                    intent=IntentSettings(mode="off"),
                    attachments=AttachmentSettings(share=1.0),
                )
            },
        )
        with ServerThread(create_app(config)) as proxy:
            results: dict[str, list[bool]] = {"memproxy": [], "truncation": [], "bm25": []}
            latency: list[float] = []
            client = httpx.Client(
                base_url=proxy.url + "/v1",
                headers={"authorization": f"Bearer {KEY}", "x-memory-mode": "read"},
                timeout=60,
            )
            for question, answer, documents in cases:
                body: dict[str, Any] = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": question}],
                    "attachments": [{"content": d} for d in documents],
                }
                started = time.perf_counter()
                response = client.post("/chat/completions", json=body)
                latency.append((time.perf_counter() - started) * 1000)
                response.raise_for_status()
                added = int(response.headers["x-memory-context-tokens"])
                assert added <= BUDGET, f"the budget rule broke: {added} tokens"
                sent = fake.chat_requests[-1]["messages"]
                context = "\n".join(m["content"] for m in sent if m["role"] == "system")
                results["memproxy"].append(reached(answer, context))
                results["truncation"].append(reached(answer, truncation(documents)))
                results["bm25"].append(reached(answer, bm25_chunks(documents, question)))
            client.close()
    print(f"\n| method | answer passage reached the model ({BUDGET:,} tokens) |\n|---|---|")
    shares = {k: sum(v) / len(v) for k, v in results.items()}
    labels = {
        "memproxy": "memproxy (rule plan)",
        "truncation": "plain truncation",
        "bm25": f"plain BM25, {CHUNK_TOKENS}-token chunks",
    }
    for key, label in labels.items():
        print(f"| {label} | **{shares[key]:.2f}** |")
    print(
        f"\nmemproxy over truncation: {shares['memproxy'] / max(shares['truncation'], 1e-9):.2f}x; "
        f"over BM25 chunks: {shares['memproxy'] / max(shares['bm25'], 1e-9):.2f}x"
    )
    print(
        f"request time through memproxy (fake upstream answers at once): "
        f"p50 {percentile(latency, 0.5):.1f} ms, p95 {percentile(latency, 0.95):.1f} ms"
    )


if __name__ == "__main__":
    main()
