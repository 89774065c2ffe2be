"""Context assembly: which stored messages go with a request, and where.

A pure function of the client's messages, the stored history the client did not send, and the
tenant's budget. The invariants it keeps (each pinned by a test):

- the client's messages are never altered, dropped or reordered;
- attached history is the contiguous most-recent run of the stored history: a message that does
  not fit ends the run, older ones are never taken instead;
- what is attached stays within `token_budget`, except that the last `min_recent_messages`
  stored messages are kept even when they alone exceed it;
- an assistant message with `tool_calls` travels with its `tool` replies, and no `tool`
  message is ever attached without the call it answers;
- when the whole prompt would not fit the model's context window, history is dropped (oldest
  first) until it does; the client's own messages are never rejected or trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from policies.identity import leading_instructions
from policies.tokens import TOKENS_PER_REPLY

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredTurn:
    """A stored message with its token count (counted once, when it was stored)."""

    message: Message
    tokens: int
    seq: int = 0  # its place in the conversation (0: not known)
    pk: int = 0  # its row (0: not known), for the trace's references


@dataclass(frozen=True, slots=True)
class Budget:
    token_budget: int = 2000
    max_history_messages: int = 20
    min_recent_messages: int = 6
    # The model's input window, when known; None skips the window check.
    context_window: int | None = None
    # Tokens the reply needs (the request's max_tokens), kept free in the window.
    reserve_tokens: int = 0


@dataclass(slots=True)
class Assembly:
    messages: list[Message]
    history_messages: int = 0
    context_tokens: int = 0
    dropped_for_window: int = 0
    recalled: bool = False  # the recall section went out (not dropped for the window)
    summarized: bool = False  # the history summary went out (not dropped for the window)


@dataclass(frozen=True, slots=True)
class Recalled:
    """The recall section: its text and its size as budgeted."""

    text: str
    tokens: int


def _call_ids(message: Message) -> set[Any]:
    if message.get("role") != "assistant":
        return set()
    calls = message.get("tool_calls")
    return {c.get("id") for c in calls if isinstance(c, dict)} if isinstance(calls, list) else set()


def _units(history: Sequence[StoredTurn]) -> list[list[StoredTurn]]:
    """Split history into units that must be attached whole: an assistant message with
    tool_calls plus the tool replies after it; any other message alone. Tool messages whose
    call is not in the history (cut off by the stored tail) form no unit and are dropped."""
    units: list[list[StoredTurn]] = []
    for turn in history:
        role = turn.message.get("role")
        if role == "tool":
            opener = units[-1][0].message if units else {}
            if turn.message.get("tool_call_id") in _call_ids(opener):
                units[-1].append(turn)
            continue
        units.append([turn])
    return units


def _answered(unit: list[StoredTurn]) -> bool:
    replies = {t.message.get("tool_call_id") for t in unit[1:]}
    return _call_ids(unit[0].message) <= replies


def select_history(
    history: Sequence[StoredTurn], budget: Budget, *, answers_tool_call: bool = False
) -> list[StoredTurn]:
    """The most recent contiguous run of history that the budget allows. With
    `answers_tool_call` (the client's turn starts with tool replies) the newest unit, the call
    those replies answer, is always kept."""
    chosen: list[list[StoredTurn]] = []
    count = tokens = 0
    for position, unit in enumerate(reversed(_units(history))):
        if not _answered(unit) and not (answers_tool_call and position == 0):
            # The upstream rejects a call whose replies are missing, unless the client's own
            # turn starts with them. A dangling newest call (the client moved on without
            # answering it) is left out; an older one ends the run.
            if position == 0:
                continue
            break
        size = len(unit)
        cost = sum(t.tokens for t in unit)
        mandatory = count < budget.min_recent_messages or (answers_tool_call and not chosen)
        fits = count + size <= budget.max_history_messages and tokens + cost <= budget.token_budget
        if not (mandatory or fits):
            break
        chosen.append(unit)
        count += size
        tokens += cost
    return [turn for unit in reversed(chosen) for turn in unit]


def history_for(
    client: Sequence[Message], history: Sequence[StoredTurn], budget: Budget
) -> list[StoredTurn]:
    """The stored history `assemble` would attach with this budget (before the window)."""
    at = leading_instructions(client)
    answers_tool_call = at < len(client) and client[at].get("role") == "tool"
    return select_history(history, budget, answers_tool_call=answers_tool_call)


def mandatory_tokens(
    client: Sequence[Message], history: Sequence[StoredTurn], budget: Budget
) -> int:
    """Tokens of the stored messages attached over any budget: the newest
    `min_recent_messages`, with the whole tool unit (a call and its replies) that reaches past
    them, and the call a client's tool reply answers. The most that may be left for anything
    else is the budget less these."""
    return sum(t.tokens for t in history_for(client, history, replace(budget, token_budget=0)))


def assemble(
    client: Sequence[Message],
    history: Sequence[StoredTurn],
    budget: Budget,
    client_tokens: int | None = None,
    *,
    recalled: Recalled | None = None,
    placement: str = "before_last_user",
    summary: Recalled | None = None,
    kept: Sequence[tuple[int, Recalled]] = (),
) -> Assembly:
    """Final messages for the upstream. `client_tokens` (the client's prompt tokens) is needed
    only when `budget.context_window` is set; pass None to skip the window check.

    `recalled` (sized to fit the budget) takes its share first; history gets the rest. It goes
    into a system message right before the newest user message (`before_last_user`, which
    keeps the prompt's prefix stable for providers' prompt caches) or after the client's
    leading instructions (`after_system`). When the prompt would not fit the window, the
    recall section goes first, then history from the oldest end.

    `summary` (a summary of the stored turns older than the history, sized like `recalled`)
    also takes its share first; it goes in a system message just before the recall section's,
    and when the prompt would not fit the window it goes after the recall section, before any
    history.

    `kept`: sections earlier turns were shown, each with the index of the client message it
    goes before again (`context.keep_shown`), counted in the context's tokens (the caller
    sized `recalled` for what they leave); dropped with the recall section for the window."""
    # History goes after the client's leading system/developer messages, before the rest.
    at = leading_instructions(client)
    answers_tool_call = at < len(client) and client[at].get("role") == "tool"
    recall_tokens = recalled.tokens if recalled else 0
    summary_tokens = summary.tokens if summary else 0
    history_budget = replace(
        budget, token_budget=max(0, budget.token_budget - recall_tokens - summary_tokens)
    )
    turns = select_history(history, history_budget, answers_tool_call=answers_tool_call)
    dropped = 0
    if budget.context_window is not None and client_tokens is not None:
        room = budget.context_window - budget.reserve_tokens - client_tokens - TOKENS_PER_REPLY
        history_tokens = sum(t.tokens for t in turns)
        kept_tokens = sum(k.tokens for _, k in kept)
        if (
            recalled is not None or kept
        ) and history_tokens + recall_tokens + kept_tokens + summary_tokens > room:
            recalled, recall_tokens, kept = None, 0, ()
        if summary is not None and history_tokens + summary_tokens > room:
            summary, summary_tokens = None, 0
        keep = 1 if answers_tool_call else 0  # the call a client's tool reply answers stays
        while len(_units(turns)) > keep and sum(t.tokens for t in turns) > room:
            # Drop from the oldest end, keeping tool calls with their replies.
            units = _units(turns)
            dropped += len(units[0])
            turns = [t for unit in units[1:] for t in unit]
    rest = list(client[at:])
    for i, section in sorted(kept, key=lambda k: k[0], reverse=True):
        if i >= at:  # (before the client message it preceded; the later ones first)
            rest.insert(i - at, {"role": "system", "content": section.text})
    messages = [*client[:at], *(t.message for t in turns), *rest]
    sections = [{"role": "system", "content": s.text} for s in (summary, recalled) if s]
    if sections:
        last_user = max(
            (i for i, m in enumerate(messages) if m.get("role") == "user"), default=None
        )
        where = at if placement == "after_system" or last_user is None else last_user
        messages[where:where] = sections
    return Assembly(
        messages=messages,
        history_messages=len(turns),
        context_tokens=sum(t.tokens for t in turns)
        + recall_tokens
        + summary_tokens
        + sum(k.tokens for _, k in kept),
        dropped_for_window=dropped,
        recalled=recalled is not None,
        summarized=summary is not None,
    )
