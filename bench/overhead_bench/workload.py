"""What the clients send: the first-turn workload and the realistic one, and the stored
history a realistic user starts with.

first-turn  every request the same one-message first turn of the anonymous user (or of
            `--user`): memproxy opens a conversation and stores the turn each time.
realistic   each client is a named user (`X-Memory-User-Id: bench-user-NN`) with one
            conversation of its own (`X-Memory-Conversation-Id: bench-conv-NN-chat`, one per shape) that grows
            through the run. The client is a thin one: it sends only its new message, and
            memproxy attaches the conversation's stored tail (up to `max_history_messages`,
            20 by default) and recalls from the user's other conversations on every turn.
            Before the run, each user of a memory-on target is given `--stored-turns` turns
            in earlier conversations (imported through `POST /v1/memory/conversations`), in
            the same words the questions use, so recall finds candidates to rank.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time

import httpx

from bench.overhead_bench.wire import Lane, Request, Requests, payload

# The fake answers "fake reply to: <prompt>" one word per chunk: with the role chunk, the stop
# chunk and [DONE], this prompt makes a stream of 10 chunks.
PROMPT = "say hi please now"
# Turns per imported conversation (two messages each).
SEEDED_TURNS_PER_CONVERSATION = 250

_COMMON = (
    "budget invoice travel flight hotel garden tomato recipe oven bread pasta sauce guitar"
    " concert ticket lesson piano violin marathon training knee doctor appointment insurance"
    " mortgage apartment lease landlord plumber kitchen paint carpet sofa lamp printer laptop"
    " battery charger router password backup server database migration release deadline"
    " meeting client proposal contract lawyer tax refund salary promotion manager team hiring"
    " interview resume course exam thesis chapter novel author poem museum gallery painting"
    " camera lens photo album wedding birthday gift party cake candle dinner restaurant menu"
    " wine cheese coffee tea bakery market bicycle helmet train station airport passport visa"
    " beach mountain hiking tent camping river lake fishing boat sailing weather storm snow"
    " winter summer spring autumn holiday vacation cousin sister brother parents grandmother"
    " puppy kitten veterinarian vaccine fence tree roses tulips harvest compost"
)
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vi", "do", "pe", "gu", "zo"]
# The content words of the run's messages: the common words above, then made-up ones (names,
# places, terms: about 1,900), drawn with Zipf-like weights (the word of rank r about as often
# as 1 / (r + 20)), so a question's words match a few stored turns or many, as in real
# conversations, rather than every word a large share of them.
WORDS = _COMMON.split() + [
    a + b + (c or "") for a in _SYLLABLES for b in _SYLLABLES for c in [None, *_SYLLABLES]
]
_WEIGHTS = list(itertools.accumulate(1 / (rank + 20) for rank in range(1, len(WORDS) + 1)))
OPENERS = (
    "what did we say about",
    "remind me of the",
    "can you help me plan the",
    "what was the plan for the",
    "I keep thinking about the",
    "let's go back to the",
)


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, cum_weights=_WEIGHTS, k=n))


def question(client: int, turn: int) -> str:
    """A user's `turn`-th message: the same for every target, different for every turn."""
    rng = random.Random(f"question:{client}:{turn}")
    return f"{rng.choice(OPENERS)} {_phrase(rng, 3)} and the {_phrase(rng, 2)}?"


def user_id(client: int) -> str:
    return f"bench-user-{client:02d}"


def conversation_id(client: int, shape: str) -> str:
    return f"bench-conv-{client:02d}-{shape}"


def first_turn(shapes: list[str]) -> Requests:
    bodies = {
        (shape, stream): payload(stream, PROMPT, shape=shape)
        for shape in shapes
        for stream in (False, True)
    }

    def requests(lane: Lane, stream: bool, client: int) -> Request:
        return Request(bodies[lane.shape.name, stream])

    return requests


def realistic() -> Requests:
    def requests(lane: Lane, stream: bool, client: int) -> Request:
        turn = lane.turns.get(client, 0)
        lane.turns[client] = turn + 1
        headers = {
            "x-memory-user-id": user_id(client),
            "x-memory-conversation-id": conversation_id(client, lane.shape.name),
        }
        body = payload(stream, question(client, turn), shape=lane.shape.name)
        return Request(body, headers)

    return requests


def seeded_conversation(client: int, number: int, turns: int) -> list[dict[str, str]]:
    """An earlier conversation of a user: `turns` exchanges on the questions' words."""
    rng = random.Random(f"seed:{client}:{number}")
    messages = []
    for _ in range(turns):
        messages.append({"role": "user", "content": f"{rng.choice(OPENERS)} {_phrase(rng, 8)}"})
        messages.append(
            {"role": "assistant", "content": f"Noted: {_phrase(rng, 12)}. Also {_phrase(rng, 6)}."}
        )
    return messages


async def seed(base_url: str, headers: dict[str, str], users: int, turns: int) -> None:
    """Give each of `users` users `turns` stored turns in earlier conversations, a few imports
    at a time."""
    if turns <= 0:
        return
    jobs: list[tuple[int, int, int]] = []
    for client in range(users):
        left, number = turns, 0
        while left > 0:
            size = min(left, SEEDED_TURNS_PER_CONVERSATION)
            jobs.append((client, number, size))
            left, number = left - size, number + 1
    gate = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as http:

        async def one(client: int, number: int, size: int) -> None:
            body = {
                "user": user_id(client),
                "messages": seeded_conversation(client, number, size),
            }
            async with gate:
                reply = await http.post("/v1/memory/conversations", json=body)
            if reply.status_code != 201 and reply.status_code != 200:
                raise SystemExit(f"seeding {base_url}: {reply.status_code} {reply.text[:300]}")

        await asyncio.gather(*(one(*job) for job in jobs))


async def backlog(base_url: str, headers: dict[str, str]) -> int | None:
    """Background jobs queued or running (embeddings of what was stored), up to 100 each;
    None if the target does not say."""
    total = 0
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as http:
        for status in ("queued", "running"):
            reply = await http.get("/v1/memory/jobs", params={"status": status, "limit": 100})
            if reply.status_code != 200:
                return None
            total += len(reply.json()["data"])
    return total


async def drained(base_url: str, headers: dict[str, str], name: str, limit: float) -> float:
    """Wait until the target's background jobs are done (at most `limit` s); seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        left = await backlog(base_url, headers)
        if not left:
            break
        await asyncio.sleep(1.0)
    else:
        print(f"  {name}: background jobs still queued after {limit:.0f} s", file=sys.stderr)
    return time.monotonic() - started


async def attached(base_url: str, headers: dict[str, str]) -> dict[str, str]:
    """What memproxy attached to one more turn of the first user (its `x-memory-*` reply
    headers: history messages, context tokens, ...), to show the workload is what it says."""
    request_headers = {
        **headers,
        "x-memory-user-id": user_id(0),
        "x-memory-conversation-id": conversation_id(0, "chat"),
    }
    async with httpx.AsyncClient(base_url=base_url, headers=request_headers, timeout=60) as http:
        reply = await http.post(
            "/v1/chat/completions", content=payload(False, question(0, 1_000_000))
        )
    return {k: v for k, v in reply.headers.items() if k.startswith("x-memory-")}
