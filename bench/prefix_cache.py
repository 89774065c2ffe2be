"""How much of each prompt a provider's prefix cache can serve, per protocol (Chat Completions,
Responses, Anthropic Messages), with memory on and off.

Workload (issue 36): a 1,500-token system prompt; a user with three earlier 40-turn
conversations on related topics (a trip to Norway, a kitchen renovation, training the dog), so
recall has something to attach every turn; a new 20-turn conversation whose turns refer back to
them, sent by a client that resends its whole history (and, on the Responses API, also by one
that chains `previous_response_id`). Replies are about 120 tokens. Memory off:
`X-Memory-Mode: off` (nothing attached, nothing stored; the Responses chain then resends its
input, since mode off keeps no response to chain onto).

For every turn, the request's effective prompt is what the provider assembles: the system
prompt (`instructions`, `system`), then the messages or items it gets (for a native Responses
upstream with `previous_response_id`: the stored chain's items, then the new input), each
tokenised with tiktoken (o200k_base) with its role as a header. The figure is the share of those
tokens that equal the previous request's effective prompt from its start (the longest common
token prefix: what a prefix cache could serve), averaged over turns 2-20; and memory on's share
over memory off's (the target: at least 0.90).

    protocol    upstream, client
    chat        openai (chat completions), history resent
    responses   native (a Responses API), previous_response_id: memproxy's context in
                `instructions` (the upstream keeps the chain; context must not enter it)
    responses   native, `store: false`, input resent: context before the newest user message
    responses   native, `store` left on, input resent: as with previous_response_id
    responses   translated (chat completions), previous_response_id: memproxy keeps the chain
    messages    translated (chat completions), history resent
    messages    anthropic (the Messages API), history resent: context as a text block at the
                head of the newest user turn

Every server is real, on 127.0.0.1: memproxy (SQLite in a temp dir, recall by words:
`memory.embeddings: off`, so every run attaches the same) and the tests' strict fakes (chat
completions, Responses API, Messages API), each a uvicorn server in a thread. Under a minute.

    .venv/bin/python bench/prefix_cache.py [--turns 20] [--budget 2000] [--keep-shown]
        [--json figures.json]

`--keep-shown` sets the tenant's `context.keep_shown` (what earlier turns were shown stays
where it was; each turn adds at most an eighth of the budget).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import tiktoken

from policies.tokens import encoding_name, message_text, response_item_text
from proxy.app import create_app
from proxy.core.config import (
    Config,
    ContextSettings,
    DatabaseConfig,
    MemorySettings,
    ServerConfig,
    TenantConfig,
    UpstreamConfig,
)
from proxy.core.logs import configure_logging
from proxy.core.offline import prepare_offline_environment
from tests.fakes.anthropic_upstream import API_KEY as ANTHROPIC_KEY
from tests.fakes.anthropic_upstream import FakeAnthropic
from tests.fakes.anthropic_upstream import Reply as AnthropicReply
from tests.fakes.openai_responses import FakeResponses
from tests.fakes.openai_upstream import FakeOpenAI, Recorded, Reply
from tests.fakes.server import ServerThread

MODEL = "gpt-4o"
# How memproxy's recalled context begins (policies/recall.py): found in the upstream's stored
# items, it would have accumulated in upstream state.
CONTEXT_MARK = "Excerpts from earlier conversations"
API_KEY = "bench-key"
INSTRUCTIONS_TOKENS = 1500
REPLY_WORDS = 90  # about 120 tokens with the fake's own sentence
EARLIER_TURNS = 40

# The user's earlier conversations: (title, what each turn is about, the details it names).
TOPICS = [
    (
        "Norway trip",
        "For the Norway trip, day {n} is {thing}: we agreed to book it early and pack layers.",
        [
            "the Flam railway",
            "Bergen fish market",
            "Trondheim cathedral",
            "Geiranger fjord",
            "the Lofoten ferry",
            "Tromso northern lights",
            "the Oslo opera house",
            "Preikestolen hike",
            "the Atlantic road",
            "Alesund viewpoint",
        ],
    ),
    (
        "kitchen renovation",
        "For the kitchen renovation, step {n} is {thing}: the budget allows it if we do it "
        "before the summer.",
        [
            "oak cabinets",
            "a quartz worktop",
            "terracotta floor tiles",
            "a ceramic sink",
            "brass handles",
            "an induction hob",
            "pendant lights",
            "a tiled splashback",
            "open shelving",
            "a larder cupboard",
        ],
    ),
    (
        "training Pixel",
        "For training Pixel the border collie, lesson {n} is {thing}: ten minutes twice a day "
        "with treats.",
        [
            "sit and stay",
            "recall in the park",
            "loose lead walking",
            "leave it",
            "the agility tunnel",
            "weaving poles",
            "a calm greeting",
            "crate rest",
            "fetch with a frisbee",
            "settling on a mat",
        ],
    ),
]
# The measured conversation: every turn refers back to one of them.
TURNS = [
    "What did we decide about the Flam railway on the Norway trip?",
    "Remind me which worktop we chose for the kitchen renovation.",
    "How was Pixel doing with recall in the park?",
    "Should we still do the Geiranger fjord day, or swap it?",
    "What floor tiles did we pick, and do they suit oak cabinets?",
    "Which lesson came after loose lead walking for Pixel?",
    "Is the Lofoten ferry worth it in the time we have in Norway?",
    "What lights did we want over the kitchen island?",
    "Can Pixel come on the Preikestolen hike?",
    "Remind me of the plan for the tiled splashback.",
    "What was the idea for the Atlantic road day?",
    "How many treats a day did we settle on for Pixel's training?",
    "Did we book the Bergen fish market visit early enough?",
    "Would brass handles clash with the induction hob?",
    "What should Pixel practise while we are in Norway?",
    "Which viewpoint near Alesund did we plan for?",
    "Is open shelving practical next to the larder cupboard?",
    "How do we keep the weaving poles lesson going at home?",
    "What layers do we pack for Tromso northern lights?",
    "Summarise the plans for the trip, the kitchen and Pixel.",
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


def context_in_upstream_state(fake: BenchResponses) -> int:
    """The items of the upstream's stored responses (their chains' inputs and outputs) that
    carry memproxy's context: 0 when the context never accumulates in upstream state."""
    return sum(
        CONTEXT_MARK in item_message(item)[1]
        for stored in fake.stored.values()
        for item in stored.context + stored.response["output"]
    )


class BenchAnthropic(FakeAnthropic):
    """The strict fake Messages API; `prompts` as BenchChat's (the system prompt, then each
    turn's blocks' text); replies padded to about 120 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[tuple[str, str]]] = []

    async def _send(self, reply: AnthropicReply, receive: Any, send: Any) -> None:
        body = self.requests[-1].json()
        if reply.status == 200 and isinstance(reply.body, dict):
            prompt = [("system", anthropic_text(body["system"]))] if body.get("system") else []
            prompt += [(m["role"], anthropic_text(m["content"])) for m in body["messages"]]
            self.prompts.append(prompt)
            # (the fake echoes the newest turn whole, the proxy's context block included:
            # answered to the user's own text, as BenchChat's fake is)
            newest = body["messages"][-1]["content"]
            asked = newest if isinstance(newest, str) else str(newest[-1].get("text", ""))
            text = f"fake claude reply to: {asked}"
            reply.body["content"][0]["text"] = text + " " + padding(text)
        await super()._send(reply, receive, send)


def anthropic_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for block in content:
        if block.get("type") == "tool_result":
            out.append(anthropic_text(block.get("content") or []))
        else:
            out.append(str(block.get("text", "")))
    return "\n".join(out)


# -- the clients ---------------------------------------------------------------------------------

# One client's turn: (system prompt, its state, the new user text) -> (request path, body).
Client = Callable[[str, dict[str, Any], str], tuple[str, dict[str, Any]]]


def chat_client(system: str, state: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
    history = state.setdefault("messages", [{"role": "system", "content": system}])
    history.append({"role": "user", "content": text})
    return "/v1/chat/completions", {"model": MODEL, "messages": list(history)}


def chat_reply(state: dict[str, Any], reply: dict[str, Any]) -> None:
    state["messages"].append(reply["choices"][0]["message"])


def responses_client(store: bool | None) -> Client:
    """A Responses client that resends its input (`store` as given; None: left out)."""

    def turn(system: str, state: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
        items = state.setdefault("items", [])
        items.append({"role": "user", "content": text})
        body: dict[str, Any] = {"model": MODEL, "instructions": system, "input": list(items)}
        if store is not None:
            body["store"] = store
        return "/v1/responses", body

    return turn


def chain_client(system: str, state: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "instructions": system, "input": text}
    if state.get("previous"):
        body["previous_response_id"] = state["previous"]
    return "/v1/responses", body


def responses_reply(state: dict[str, Any], reply: dict[str, Any]) -> None:
    state["previous"] = reply["id"]
    state.setdefault("items", []).extend(reply["output"])


def messages_client(system: str, state: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
    history = state.setdefault("messages", [])
    history.append({"role": "user", "content": text})
    body = {"model": MODEL, "max_tokens": 300, "system": system, "messages": list(history)}
    return "/v1/messages", body


def messages_reply(state: dict[str, Any], reply: dict[str, Any]) -> None:
    state["messages"].append({"role": "assistant", "content": reply["content"]})


@dataclass(frozen=True)
class Case:
    protocol: str
    how: str
    upstream: str  # "chat", "responses" or "anthropic": which fake serves it
    client: Client
    read: Callable[[dict[str, Any], dict[str, Any]], None]
    responses: str | None = None  # the upstream's `responses` mode
    chain: bool = False  # memory off resends instead (mode off keeps no response)


CASES = [
    Case("chat", "openai, history resent", "chat", chat_client, chat_reply),
    Case(
        "responses",
        "native, previous_response_id",
        "responses",
        chain_client,
        responses_reply,
        chain=True,
    ),
    Case(
        "responses",
        "native, store: false, input resent",
        "responses",
        responses_client(False),
        responses_reply,
    ),
    Case(
        "responses",
        "native, store on, input resent",
        "responses",
        responses_client(None),
        responses_reply,
    ),
    Case(
        "responses",
        "translated, previous_response_id",
        "chat",
        chain_client,
        responses_reply,
        responses="translate",
        chain=True,
    ),
    Case("messages", "translated, history resent", "chat", messages_client, messages_reply),
    Case("messages", "anthropic, history resent", "anthropic", messages_client, messages_reply),
]


# -- measuring -------------------------------------------------------------------------------------


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
    case: Case
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
            "protocol": self.case.protocol,
            "upstream": self.case.how,
            "memory": "on" if self.memory else "off",
            "prefix_share": round(self.share, 4),
            "per_turn": [round(s, 4) for s in self.shares],
            "prompt_tokens_last_turn": self.prompt_tokens[-1],
            "turns_with_recall": self.recalled_turns,
            "context_tokens_added": self.context_tokens,
        }


def converse(
    client: httpx.Client,
    prompts: list[list[tuple[str, str]]],
    run: Run,
    *,
    user: str,
    turns: int,
    system: str,
    encoding: tiktoken.Encoding,
) -> None:
    """One conversation of `turns` turns, the case's client sending each."""
    case = run.case
    send = case.client
    if case.chain and not run.memory:
        send = responses_client(False) if case.upstream == "responses" else responses_client(None)
    headers = {"x-memory-user-id": user}
    if not run.memory:
        headers["x-memory-mode"] = "off"
    state: dict[str, Any] = {}
    before = len(prompts)
    for text in TURNS[:turns]:
        path, body = send(system, state, text)
        reply = client.post(path, json=body, headers=headers)
        assert reply.status_code == 200, reply.text[:500]
        case.read(state, reply.json())
        run.recalled_turns += int(reply.headers.get("x-memory-memories", "0")) > 0
        run.context_tokens += int(reply.headers.get("x-memory-context-tokens", "0"))
    measured = [tokens_of(p, encoding) for p in prompts[before:]]
    assert len(measured) == turns, (len(measured), turns)
    run.prompt_tokens = [len(p) for p in measured]
    run.shares = [common_prefix(a, b) / len(b) for a, b in itertools.pairwise(measured)]


def earlier_conversations() -> list[list[dict[str, str]]]:
    """The three earlier conversations, EARLIER_TURNS turns each (user, then assistant)."""
    out = []
    for title, sentence, things in TOPICS:
        messages = []
        for n in range(1, EARLIER_TURNS + 1):
            thing = things[(n - 1) % len(things)]
            messages.append({"role": "user", "content": sentence.format(n=n, thing=thing)})
            answer = f"Noted for the {title}: {thing}, as turn {n} of the plan. " + padding(thing)
            messages.append({"role": "assistant", "content": answer[:400]})
        out.append(messages)
    return out


def seed(client: httpx.Client, user: str) -> None:
    """The user's earlier conversations (imported: no model is called)."""
    for i, messages in enumerate(earlier_conversations()):
        body = {"id": f"{user}-earlier-{i}", "user": user, "messages": messages}
        reply = client.post("/v1/memory/conversations", json=body)
        assert reply.status_code == 201, reply.text[:500]


@contextmanager
def memproxy(
    upstream: UpstreamConfig, workdir: Path, name: str, budget: int, keep_shown: bool
) -> Iterator[httpx.Client]:
    tenant = TenantConfig(
        api_keys=[API_KEY],
        upstream="main",
        memory=MemorySettings(embeddings="off"),
        context=ContextSettings(token_budget=budget, keep_shown=keep_shown),
    )
    config = Config(
        server=ServerConfig(spill_path=str(workdir / f"{name}-spill.jsonl")),
        database=DatabaseConfig(url=f"sqlite+aiosqlite:///{workdir}/{name}.db"),
        upstreams={"main": upstream},
        tenants={"bench": tenant},
    )
    with (
        ServerThread(create_app(config)) as server,
        httpx.Client(
            base_url=server.url,
            headers={"authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY},
            timeout=30,
        ) as client,
    ):
        yield client


def measure(
    turns: int, budget: int, workdir: Path, *, keep_shown: bool = False
) -> tuple[list[Run], int]:
    encoding = tiktoken.get_encoding(encoding_name(MODEL))
    system = instructions(encoding)
    runs: list[Run] = []
    fakes: dict[str, BenchChat | BenchResponses | BenchAnthropic] = {
        "chat": BenchChat(),
        "responses": BenchResponses(),
        "anthropic": BenchAnthropic(),
    }
    with (
        ServerThread(fakes["chat"]) as chat_server,
        ServerThread(fakes["responses"]) as responses_server,
        ServerThread(fakes["anthropic"]) as anthropic_server,
    ):
        urls = {
            "chat": chat_server.url + "/v1",
            "responses": responses_server.url + "/v1",
            "anthropic": anthropic_server.url,
        }
        for n, case in enumerate(CASES):
            if case.upstream == "anthropic":
                upstream = UpstreamConfig(
                    kind="anthropic", base_url=urls["anthropic"], api_key=ANTHROPIC_KEY
                )
            else:
                upstream = UpstreamConfig(
                    kind="openai",
                    base_url=urls[case.upstream],
                    api_key="k",
                    responses=case.responses,  # type: ignore[arg-type]
                )
            with memproxy(upstream, workdir, f"run{n}", budget, keep_shown) as client:
                for memory in (False, True):
                    user = f"user-{n}-{'on' if memory else 'off'}"
                    if memory:
                        seed(client, user)
                    run = Run(case, memory)
                    converse(
                        client,
                        fakes[case.upstream].prompts,
                        run,
                        user=user,
                        turns=turns,
                        system=system,
                        encoding=encoding,
                    )
                    runs.append(run)
        responses = fakes["responses"]
        assert isinstance(responses, BenchResponses)
        leaked = context_in_upstream_state(responses)
    return runs, leaked


def report(
    runs: list[Run], leaked: int, turns: int, budget: int, keep_shown: bool, elapsed: float
) -> str:
    lines = [
        f"Prompt prefix stability: {turns} turns, ~{INSTRUCTIONS_TOKENS}-token system prompt, "
        f"replies ~120 tokens, 3 earlier {EARLIER_TURNS}-turn conversations, "
        f"context.token_budget {budget}, keep_shown {'on' if keep_shown else 'off'}",
        "share of each request's effective prompt tokens equal to the previous request's "
        f"prompt prefix, mean of turns 2-{turns} (target: on/off >= 0.90):",
        "",
        f"  {'protocol':<11}{'upstream, client':<36}{'memory off':>11}{'memory on':>11}"
        f"{'on/off':>8}{'recall turns':>14}{'added/turn':>12}",
    ]
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        lines.append(
            f"  {on.case.protocol:<11}{on.case.how:<36}{off.share:>11.3f}{on.share:>11.3f}"
            f"{on.share / off.share:>8.2f}{on.recalled_turns:>10}/{turns}"
            f"{on.context_tokens / turns:>12.0f}"
        )
    lines.append(
        "  (memory off with previous_response_id: the client resends its input, as mode off"
        " keeps no response to chain onto)"
    )
    lines.append("")
    lines.append("prompt tokens at the last turn (off / on):")
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        lines.append(
            f"  {on.case.protocol:<11}{on.case.how:<36}{off.prompt_tokens[-1]:>7} / "
            f"{on.prompt_tokens[-1]:<7}"
        )
    lines.append(
        f"items of the native Responses upstream's stored responses that carry memproxy's "
        f"context: {leaked}"
    )
    lines.append(f"\n({elapsed:.1f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=len(TURNS), choices=range(2, len(TURNS) + 1))
    parser.add_argument("--budget", type=int, default=2000, help="context.token_budget")
    parser.add_argument("--keep-shown", action="store_true", help="context.keep_shown: true")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    prepare_offline_environment()  # (tiktoken's encodings from litellm's copy: no network)
    configure_logging("warning", "console")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memproxy-prefix-") as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # (anything a server writes beside its database stays in the temp dir)
        try:
            runs, leaked = measure(args.turns, args.budget, Path(tmp), keep_shown=args.keep_shown)
        finally:
            os.chdir(cwd)
    elapsed = time.perf_counter() - started
    print(report(runs, leaked, args.turns, args.budget, args.keep_shown, elapsed))
    if args.json:
        Path(args.json).write_text(json.dumps([r.figures() for r in runs], indent=2) + "\n")


if __name__ == "__main__":
    main()
