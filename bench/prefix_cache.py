"""How much of each Responses API prompt a provider's prefix cache can serve, for the two ways
memproxy can keep the state of a `previous_response_id` chain, with memory on and off.

    upstream state   (a) a native upstream keeps the chain: the client sends only its new input
                     with `previous_response_id`; memproxy forwards it and puts its context in
                     `instructions` (what memproxy does on a native upstream with `store` on).
    memproxy state   (b) the whole assembled input goes up every turn, without
                     `previous_response_id`; memproxy's context is a system message right before
                     the newest user message. Measured two ways that send the same prompt:
                     a `store: false` client resending its input on the native upstream, and a
                     client chaining `previous_response_id` on a translated upstream (memproxy
                     sends the chain it keeps as chat messages).
    client state     a client that resends its whole input but leaves `store` on (the API's
                     default, the Agents SDK's without `previous_response_id`): the upstream
                     stores each response, so memproxy's context goes into `instructions` as in
                     (a), although no request continues one.

Workload: a ~1,500-token `instructions` prompt and 20 turns of one conversation, replies of
about 120 tokens. Memory on: the user has ten earlier conversations, one fact each, and most
turns mention one of them, so recall attaches something on most turns. Memory off:
`X-Memory-Mode: off` (nothing attached, nothing stored; on the translated upstream the client
then resends its input, since mode off keeps no response to chain onto).

For every turn, the request's effective prompt is what the provider assembles: (a)
`instructions`, then the stored chain's input and output items, then the new input; (b) the
input as sent (`instructions` first). It is tokenised with tiktoken (o200k_base, the model's
encoding in policies/tokens.py), one message at a time with its role as a header. The
figure is the share of those tokens that equal the previous request's effective prompt from
its start (the longest common token prefix: what a prefix cache could serve), averaged over
turns 2-20. It also counts the items of the responses the native upstream stored that carry
memproxy's context (0: the context never accumulates in upstream state).

Every server is real, on 127.0.0.1: memproxy (SQLite in a temp dir) and the tests' strict fake
Responses API (tests/fakes/openai_responses.py) or fake chat completions API, each a uvicorn
server in a thread. About 15 s.

    .venv/bin/python bench/responses_prefix.py [--turns 20] [--json figures.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import tiktoken

from policies.tokens import encoding_name, message_text, response_item_text
from proxy.app import create_app
from proxy.core.config import Config, DatabaseConfig, ServerConfig, TenantConfig, UpstreamConfig
from proxy.core.logs import configure_logging
from proxy.core.offline import prepare_offline_environment
from tests.fakes.openai_responses import FakeResponses
from tests.fakes.openai_upstream import FakeOpenAI, Recorded, Reply
from tests.fakes.server import ServerThread

MODEL = "gpt-4o"
# The clients: new input and previous_response_id; the whole input resent with `store: false`;
# the same with `store` left on (the API's default).
CHAIN, RESEND, RESEND_STORED = "chain", "resend", "resend-stored"
# How memproxy's recalled context begins (policies/recall.py): found in the upstream's stored
# items, it would have accumulated in upstream state.
CONTEXT_MARK = "Excerpts from earlier conversations"
API_KEY = "bench-key"
INSTRUCTIONS_TOKENS = 1500
REPLY_WORDS = 90  # about 120 tokens with the fake's own sentence

# Facts of the user's earlier conversations (one conversation each) ...
FACTS = [
    ("My sister Ingrid lives in Trondheim and I visit her every May.", "Noted: Trondheim."),
    ("I am allergic to peanuts, so keep them out of any recipe.", "Understood, no peanuts."),
    ("Our dog Pixel is a border collie who needs long walks.", "Pixel sounds lovely."),
    ("I work night shifts as a nurse at the Riverside clinic.", "Night shifts are hard."),
    ("My car is an old Volvo estate with a roof box.", "A practical car."),
    ("I am learning Portuguese for a trip to Lisbon next year.", "Boa sorte!"),
    ("My daughter Mira plays the cello in the school orchestra.", "How nice."),
    ("I run a small bakery that opens at six on weekdays.", "Early mornings, then."),
    ("We are renovating the kitchen with oak cabinets.", "Oak is durable."),
    ("I keep bees on the allotment behind the railway.", "Bees are fascinating."),
]
# ... and the turns of the measured conversation: most mention one of them.
TURNS = [
    "What should I pack for Trondheim?",
    "Can you suggest a snack for the flight without peanuts?",
    "Which walks near the station would suit Pixel?",
    "How do I sleep well after night shifts?",
    "Will the roof box fit skis for the Volvo?",
    "Give me three Portuguese phrases for a café.",
    "What is a good cello piece for a beginner like Mira?",
    "How early should the bakery order flour?",
    "Which finish protects oak cabinets best?",
    "When do bees swarm in spring?",
    "Summarise what we discussed so far.",
    "And what about Trondheim in winter?",
    "Any peanuts-free dessert for a bakery menu?",
    "Is Pixel too old for agility classes?",
    "What should a nurse keep in a night-shift bag?",
    "How do I say 'thank you very much' in Portuguese?",
    "Thanks. Anything else I should know?",
    "Should the kitchen get oak or tiled floors?",
    "What do bees need in a dry summer?",
    "Which cello strings last longest?",
]


# -- the workload ----------------------------------------------------------------------------------


def instructions(encoding: tiktoken.Encoding) -> str:
    """A deterministic system prompt of INSTRUCTIONS_TOKENS tokens."""
    rules = []
    for i in range(1, 400):
        rules.append(
            f"Rule {i}: when the user asks about topic {i % 37}, answer in plain words, cite the "
            f"relevant section {i % 11} of the handbook, and keep the tone friendly and brief."
        )
        text = "You are a helpful assistant for a travel and household app.\n" + "\n".join(rules)
        tokens = encoding.encode(text)
        if len(tokens) >= INSTRUCTIONS_TOKENS:
            return encoding.decode(tokens[:INSTRUCTIONS_TOKENS])
    raise AssertionError("unreachable")


def padding(seed: str) -> str:
    """A deterministic reply body of REPLY_WORDS words that differs from turn to turn."""
    words = [f"w{(len(seed) * 7 + i * 13) % 997}" for i in range(REPLY_WORDS)]
    return " ".join(words)


# -- fake upstreams that remember each request's effective prompt ----------------------------------


class BenchResponses(FakeResponses):
    """The strict fake Responses API; `prompts` holds each request's effective prompt as
    (role, text) pairs: `instructions`, then the chain it continues, then the new input."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[tuple[str, str]]] = []

    def _answer(
        self, body: dict[str, Any], context: list[dict[str, Any]], prior: int, number: int
    ) -> list[dict[str, Any]]:
        prompt = [("system", body["instructions"])] if body.get("instructions") else []
        prompt += [item_message(item) for item in context]
        self.prompts.append(prompt)
        output = super()._answer(body, context, prior, number)
        for item in output:
            for part in item.get("content") or []:
                part["text"] += " " + padding(part["text"])
        return output


class BenchChat(FakeOpenAI):
    """The fake chat completions API (no Responses API); `prompts` as BenchResponses'."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[tuple[str, str]]] = []

    def _default(self, request: Recorded) -> Reply:
        reply = super()._default(request)
        if request.path.endswith("/chat/completions") and isinstance(reply.body, dict):
            messages = request.json()["messages"]
            self.prompts.append([(m["role"], message_text(m)) for m in messages])
            message = reply.body["choices"][0]["message"]
            message["content"] += " " + padding(message["content"])
        return reply


def item_message(item: dict[str, Any]) -> tuple[str, str]:
    kind = item.get("type", "message")
    role = {"function_call": "assistant", "function_call_output": "tool"}.get(kind)
    return (role or str(item.get("role", kind)), response_item_text(item))


# -- measuring ---------------------------------------------------------------------------------------


def tokens_of(prompt: list[tuple[str, str]], encoding: tiktoken.Encoding) -> list[int]:
    out: list[int] = []
    for role, text in prompt:
        out += encoding.encode(f"<|start|>{role}\n{text}<|end|>\n", disallowed_special=())
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Run:
    mode: str
    upstream: str
    memory: bool
    shares: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    recalled_turns: int = 0
    context_tokens: int = 0

    @property
    def share(self) -> float:
        return sum(self.shares) / len(self.shares)

    def figures(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "upstream": self.upstream,
            "memory": "on" if self.memory else "off",
            "prefix_share": round(self.share, 4),
            "per_turn": [round(s, 4) for s in self.shares],
            "prompt_tokens_last_turn": self.prompt_tokens[-1],
            "turns_with_recall": self.recalled_turns,
            "context_tokens_added": self.context_tokens,
        }


def converse(
    client: httpx.Client,
    fake: BenchResponses | BenchChat,
    run: Run,
    *,
    user: str,
    client_kind: str,
    turns: int,
    system: str,
    encoding: tiktoken.Encoding,
) -> None:
    """One conversation of `turns` turns. `client_kind`: CHAIN sends its new input with
    `previous_response_id`; RESEND resends its whole input with `store: false`, and
    RESEND_STORED the same with `store` left on."""
    headers = {"x-memory-user-id": user}
    if not run.memory:
        headers["x-memory-mode"] = "off"
    items: list[Any] = []
    previous: str | None = None
    before = len(fake.prompts)
    for text in TURNS[:turns]:
        body: dict[str, Any] = {"model": MODEL, "instructions": system}
        if client_kind == CHAIN:
            body["input"] = text
            if previous is not None:
                body["previous_response_id"] = previous
        else:
            items.append({"role": "user", "content": text})
            body["input"] = list(items)
            if client_kind == RESEND:
                body["store"] = False
        reply = client.post("/v1/responses", json=body, headers=headers)
        assert reply.status_code == 200, reply.text[:500]
        response = reply.json()
        previous = response["id"]
        items += response["output"]
        recalled = int(reply.headers.get("x-memory-memories", "0"))
        run.recalled_turns += recalled > 0
        run.context_tokens += int(reply.headers.get("x-memory-context-tokens", "0"))
    prompts = [tokens_of(p, encoding) for p in fake.prompts[before:]]
    assert len(prompts) == turns, (len(prompts), turns)
    run.prompt_tokens = [len(p) for p in prompts]
    run.shares = [common_prefix(a, b) / len(b) for a, b in itertools.pairwise(prompts)]


def seed(client: httpx.Client, user: str) -> None:
    """The user's earlier conversations, one fact each (imported: no model is called)."""
    for i, (fact, answer) in enumerate(FACTS):
        messages = [{"role": "user", "content": fact}, {"role": "assistant", "content": answer}]
        body = {"id": f"{user}-earlier-{i}", "user": user, "messages": messages}
        reply = client.post("/v1/memory/conversations", json=body)
        assert reply.status_code == 201, reply.text[:500]


@contextmanager
def memproxy(upstream: UpstreamConfig, workdir: Path, name: str) -> Iterator[httpx.Client]:
    config = Config(
        server=ServerConfig(spill_path=str(workdir / f"{name}-spill.jsonl")),
        database=DatabaseConfig(url=f"sqlite+aiosqlite:///{workdir}/{name}.db"),
        upstreams={"main": upstream},
        tenants={"bench": TenantConfig(api_keys=[API_KEY], upstream="main")},
    )
    with (
        ServerThread(create_app(config)) as server,
        httpx.Client(
            base_url=server.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=30
        ) as client,
    ):
        yield client


def context_in_upstream_state(fake: BenchResponses) -> int:
    """The items of the upstream's stored responses (their chains' inputs and outputs) that
    carry memproxy's context: 0 when the context never accumulates in upstream state."""
    return sum(
        CONTEXT_MARK in item_message(item)[1]
        for stored in fake.stored.values()
        for item in stored.context + stored.response["output"]
    )


def measure(turns: int, workdir: Path) -> tuple[list[Run], int]:
    encoding = tiktoken.get_encoding(encoding_name(MODEL))
    system = instructions(encoding)
    runs: list[Run] = []
    native_fake, chat_fake = BenchResponses(), BenchChat()
    with ServerThread(native_fake) as native_server, ServerThread(chat_fake) as chat_server:
        native = UpstreamConfig(kind="openai", base_url=native_server.url + "/v1", api_key="k")
        translated = UpstreamConfig(
            kind="openai", base_url=chat_server.url + "/v1", api_key="k", responses="translate"
        )
        plan: list[tuple[str, str, UpstreamConfig, BenchResponses | BenchChat, str]] = [
            ("(a) upstream state", "native, previous_response_id", native, native_fake, CHAIN),
            (
                "(b) memproxy state",
                "native, store: false, input resent",
                native,
                native_fake,
                RESEND,
            ),
            (
                "(b) memproxy state",
                "translated, previous_response_id",
                translated,
                chat_fake,
                CHAIN,
            ),
            ("client state", "native, store on, input resent", native, native_fake, RESEND_STORED),
        ]
        for n, (mode, how, upstream, fake, kind) in enumerate(plan):
            with memproxy(upstream, workdir, f"run{n}") as client:
                for memory in (False, True):
                    user = f"user-{n}-{'on' if memory else 'off'}"
                    if memory:
                        seed(client, user)
                    run = Run(mode, how, memory)
                    # Mode off keeps no response to chain onto: that client resends its input.
                    converse(
                        client,
                        fake,
                        run,
                        user=user,
                        client_kind=RESEND
                        if kind == CHAIN and not memory and upstream is translated
                        else kind,
                        turns=turns,
                        system=system,
                        encoding=encoding,
                    )
                    runs.append(run)
        leaked = context_in_upstream_state(native_fake)
    return runs, leaked


def report(runs: list[Run], leaked: int, turns: int, elapsed: float) -> str:
    lines = [
        f"Responses API prompt prefix stability: {turns} turns, ~{INSTRUCTIONS_TOKENS}-token "
        "instructions, replies ~120 tokens",
        "share of each request's effective prompt tokens equal to the previous request's "
        f"prompt prefix, mean of turns 2-{turns}:",
        "",
        f"  {'state':<20}{'upstream, client':<36}{'memory off':>11}{'memory on':>11}"
        f"{'on/off':>8}{'recall turns':>14}",
    ]
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        lines.append(
            f"  {on.mode:<20}{on.upstream:<36}{off.share:>11.3f}{on.share:>11.3f}"
            f"{on.share / off.share:>8.2f}{on.recalled_turns:>10}/{turns}"
        )
    lines.append(
        "  (memory off on the translated upstream: the client resends its input, as mode off"
        " keeps no response to chain onto)"
    )
    lines.append("")
    lines.append(
        "prompt tokens at the last turn (off / on) and tokens memproxy added over the run:"
    )
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        lines.append(
            f"  {on.mode:<20}{on.upstream:<36}{off.prompt_tokens[-1]:>7} / "
            f"{on.prompt_tokens[-1]:<7}{on.context_tokens:>8} added"
        )
    lines.append(
        f"items of the native upstream's stored responses that carry memproxy's context: {leaked}"
    )
    lines.append(f"\n({elapsed:.1f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=len(TURNS), choices=range(2, len(TURNS) + 1))
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    prepare_offline_environment()  # (tiktoken's encodings from litellm's copy: no network)
    configure_logging("warning", "console")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memproxy-prefix-") as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # (anything a server writes beside its database stays in the temp dir)
        try:
            runs, leaked = measure(args.turns, Path(tmp))
        finally:
            os.chdir(cwd)
    print(report(runs, leaked, args.turns, time.perf_counter() - started))
    if args.json:
        Path(args.json).write_text(json.dumps([r.figures() for r in runs], indent=2) + "\n")


if __name__ == "__main__":
    main()
