"""How a request is matched to a stored conversation, in O(request) and without reading history.

Each stored message carries a chained hash of the conversation up to and including it, and the
conversation keeps the hash of its whole chain. A client that resends its history continues a
stored conversation exactly when `chain_hashes(request)[count - 1]` equals the stored chain hash,
where `count` is the stored chain's length: one comparison, whatever the history's size.

Hashes are over a canonical form of each message (role, content, name, tool calls, tool call
id), so the same message hashes the same whether it came from the client or was reassembled
from an upstream reply (`refusal: null`, key order and empty content do not matter).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
EMPTY_CHAIN = ""
UNKNOWN_CHAIN = "unknown"  # never a hash of a request's prefix


def canonical(message: Message) -> bytes:
    content = message.get("content")
    if content == "" or content == []:
        content = None
    calls = message.get("tool_calls") or None
    if isinstance(calls, list):
        calls = [
            {
                "id": c.get("id"),
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments"),
            }
            if isinstance(c, dict)
            else c
            for c in calls
        ]
    form = [message.get("role"), content, message.get("name"), calls, message.get("tool_call_id")]
    return json.dumps(form, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def chain_next(previous: str, message: Message) -> str:
    return hashlib.sha256(previous.encode() + b"\n" + canonical(message)).hexdigest()


def chain_hashes(messages: Iterable[Message], start: str = EMPTY_CHAIN) -> list[str]:
    """The chained hash after each message."""
    out: list[str] = []
    current = start
    for message in messages:
        current = chain_next(current, message)
        out.append(current)
    return out


def fingerprint(messages: Sequence[Message]) -> str:
    """Identifies how a conversation opened: its first system and first user message."""
    first_system = next((m for m in messages if m.get("role") in ("system", "developer")), {})
    first_user = next((m for m in messages if m.get("role") == "user"), {})
    return hashlib.sha256(canonical(first_system) + b"\n" + canonical(first_user)).hexdigest()


def continues(stored_count: int, stored_hash: str, hashes: Sequence[str]) -> bool:
    """Whether a stored chain of `stored_count` messages is a prefix of the request."""
    if stored_count == 0:
        return False
    return stored_count <= len(hashes) and hashes[stored_count - 1] == stored_hash


def rewind(
    count: int, chain_hash: str, hashes: Sequence[str], dropped: Sequence[Message]
) -> tuple[int, str]:
    """The stored chain without its newest messages `dropped`: (length, hash). The hash is
    read off the request when the request starts with that shorter chain (rolling `dropped`
    forward from it gives `chain_hash`); otherwise it is UNKNOWN_CHAIN, which no request
    continues."""
    count -= len(dropped)
    if count <= 0:
        return 0, EMPTY_CHAIN
    if count <= len(hashes):
        start = hashes[count - 1]
        rolled = chain_hashes(dropped, start)
        if (rolled[-1] if rolled else start) == chain_hash:
            return count, start
    return count, UNKNOWN_CHAIN


LEADING_ROLES = frozenset({"system", "developer"})


def leading_instructions(messages: Sequence[Message]) -> int:
    """How many system/developer messages open the list: the client's own instructions."""
    count = 0
    while count < len(messages) and messages[count].get("role") in LEADING_ROLES:
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class Split:
    """What a request adds to a stored conversation, and what of it the client already sent."""

    new: list[Message]  # messages to store
    attach_history: bool  # a thin client: the stored tail goes with the request
    overlap: int = 0  # newest stored messages the client resent (not attached again)
    # The request's first `fork` messages are a prefix of the conversation that it has moved
    # on from (the client regenerated or edited a turn): `new` continues from there.
    fork: int = 0


def split_request(
    messages: Sequence[Message],
    hashes: Sequence[str],
    chain_count: int,
    chain_hash: str,
    tail: Sequence[Message] = (),
    tail_hashes: Sequence[str | None] = (),
) -> Split:
    """Decide, in O(request + tail), which of the request's messages are new. `tail`: the
    stored conversation's newest messages, `tail_hashes` their chain hashes.

    - the stored chain is a prefix of the request: the client resent its history; the rest is
      new and nothing needs attaching (a retry of an unanswered turn adds nothing);
    - an empty conversation: everything is new;
    - the request resends the tail's newest messages (`resent_run`) in an arrangement of its
      own (under a system prompt that changes each time, say, or keeping the first exchange
      and the latest ones): what follows them is new, and when the run opens the request, the
      stored history before it goes with it;
    - the request resends the conversation up to a message of the tail, and then goes
      another way (a regenerated answer, an edited turn): the rest is new, continuing from
      that message (`forked_at`);
    - otherwise a thin client: its leading system/developer messages are its own instructions,
      the rest is new and the stored tail goes with it.
    """
    if continues(chain_count, chain_hash, hashes):
        return Split(new=list(messages[chain_count:]), attach_history=False)
    if chain_count == 0:
        return Split(new=list(messages), attach_history=False)
    turn = list(messages[leading_instructions(messages) :])
    end, run = resent_run(turn, tail)
    if run:
        # (A run that opens the request: the stored history before it was not sent.)
        return Split(new=turn[end:], attach_history=end == run, overlap=run)
    fork = forked_at(messages, hashes, tail_hashes)
    if fork:
        return Split(new=list(messages[fork:]), attach_history=False, fork=fork)
    return Split(new=turn, attach_history=True)


def forked_at(
    messages: Sequence[Message], hashes: Sequence[str], stored_hashes: Sequence[str | None]
) -> int:
    """How many of the request's messages are a prefix of the stored conversation ending at
    one of `stored_hashes`' messages (the longest such prefix; a chain hash covers every
    message before it), for a request that resends history: two messages or more after its
    instructions (a thin client's one new message that repeats a stored one is no fork). 0
    when there is none."""
    lead = leading_instructions(messages)
    if len(messages) - lead < 2:
        return 0
    known = {h for h in stored_hashes if h}
    for count in range(len(hashes), lead, -1):
        if hashes[count - 1] in known:
            return count
    return 0


def resent_run(turn: Sequence[Message], tail: Sequence[Message]) -> tuple[int, int]:
    """(end, length): the newest stored messages (`tail`'s last `length`) that `turn` repeats
    as a run ending at `turn[end - 1]`, the run ending latest; (0, 0) when there is none. A
    run counts when it opens the turn (a thin client that resent the last reply, or retried
    its turn) or holds two messages or more (a client that resends its history in its own
    arrangement). O(turn + tail): the first place a run of two or more ends is the answer,
    and a place where none does costs one comparison."""
    if not turn or not tail:
        return 0, 0
    sent = [canonical(m) for m in turn]
    held: list[bytes] = []  # the tail's newest first, as far as compared (often one message)

    def stored(back: int) -> bytes:
        """The canonical form of `tail[-1 - back]`."""
        while len(held) <= back:
            held.append(canonical(tail[-1 - len(held)]))
        return held[back]

    for end in range(len(sent), 0, -1):
        if sent[end - 1] != stored(0):
            continue
        length = 1
        while length < min(end, len(tail)) and sent[end - 1 - length] == stored(length):
            length += 1
        if length == end or length >= 2:
            return end, length
    return 0, 0
