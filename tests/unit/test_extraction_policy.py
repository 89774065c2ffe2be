"""Memory extraction's pure halves: the request it sends and the checks on the model's answer;
the memory ranking that picks what the model is shown; the queue's retry policy."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from policies.extraction import (
    MAX_DECISIONS,
    BadExtraction,
    Decision,
    Known,
    extraction_request,
    parse_decisions,
    spellings,
    turn_of,
)
from policies.jobs import RetryPolicy
from policies.memories import rank_memories, stem
from policies.model_json import clamp01, json_object

KNOWN = [
    Known("mem_a", "preference", "The user is vegetarian.", pinned=False),
    Known("mem_b", "fact", "The user lives in Lisbon.", pinned=True),
]


def reply(*decisions: Any) -> str:
    return json.dumps({"memories": list(decisions)})


def test_the_request_shows_the_exchange_and_the_known_memories_with_their_ids() -> None:
    body = extraction_request(
        "m",
        [
            {"role": "assistant", "content": "Where do you live?"},
            {"role": "user", "content": "I moved to Porto last month."},
            {"role": "tool", "content": "not shown", "tool_call_id": "x"},
        ],
        KNOWN,
    )
    assert body["model"] == "m"
    assert body["response_format"] == {"type": "json_object"}
    assert body["temperature"] == 0
    user = body["messages"][1]["content"]
    assert "id=mem_a kind=preference\n> The user is vegetarian." in user
    assert "id=mem_b kind=fact (pinned)\n> The user lives in Lisbon." in user
    assert "user:\n> I moved to Porto last month." in user
    assert "assistant:\n> Where do you live?" in user
    assert "not shown" not in user


def test_add_update_delete_are_accepted_as_said() -> None:
    accepted, rejected = parse_decisions(
        reply(
            {
                "action": "add",
                "kind": "Goal",
                "text": "The user  wants to run\na marathon.",
                "confidence": 1.7,
            },
            {"action": "update", "id": "mem_a", "text": "The user is vegan.", "confidence": "0.9"},
            {"action": "none"},
        ),
        KNOWN,
    )
    assert rejected == []
    assert accepted == [
        Decision("add", "The user wants to run a marathon.", "goal", 1.0),
        Decision("update", "The user is vegan.", "preference", 0.9, "mem_a"),
    ]
    accepted, _ = parse_decisions(reply({"action": "DELETE", "id": "mem_a"}), KNOWN)
    assert accepted == [Decision("delete", memory_id="mem_a")]


@pytest.mark.parametrize(
    ("decision", "reason"),
    [
        ({"action": "update", "id": "mem_b", "text": "The user lives in Porto."}, "pinned"),
        ({"action": "delete", "id": "mem_b"}, "pinned"),
        ({"action": "delete", "id": "mem_zzz"}, "no such memory"),
        ({"action": "update", "text": "no id"}, "no such memory"),
        ({"action": "add", "text": "  "}, "no text"),
        ({"action": "add"}, "no text"),
        ({"action": "add", "text": "x" * 501}, "longer than"),
        ({"action": "forget", "id": "mem_a"}, "unknown action"),
        ({"action": "add", "text": "the user is VEGETARIAN"}, "already remembered"),
        ("add this", "not an object"),
    ],
)
def test_unsafe_or_malformed_decisions_are_rejected_with_the_reason(
    decision: Any, reason: str
) -> None:
    accepted, rejected = parse_decisions(reply(decision), KNOWN)
    assert accepted == []
    assert [r.decision for r in rejected] == [decision]
    assert reason in rejected[0].reason


def test_two_decisions_about_one_memory_keep_the_first() -> None:
    accepted, rejected = parse_decisions(
        reply(
            {"action": "update", "id": "mem_a", "text": "The user is vegan."},
            {"action": "delete", "id": "mem_a"},
            {"action": "add", "text": "The user has a cat."},
            {"action": "add", "text": "The user has a cat"},
        ),
        KNOWN,
    )
    assert [d.action for d in accepted] == ["update", "add"]
    assert [r.reason for r in rejected] == [
        "a second decision about the same memory",
        "already remembered",
    ]


def test_an_unknown_kind_becomes_a_fact_and_an_update_keeps_the_memorys_kind() -> None:
    accepted, _ = parse_decisions(
        reply(
            {"action": "add", "kind": "trivia", "text": "The user collects stamps."},
            {"action": "update", "id": "mem_a", "text": "The user is pescatarian."},
        ),
        KNOWN,
    )
    assert [d.kind for d in accepted] == ["fact", "preference"]


def test_too_many_decisions_are_cut_and_the_rest_recorded() -> None:
    items = [{"action": "add", "text": f"Fact number {i}."} for i in range(MAX_DECISIONS + 2)]
    accepted, rejected = parse_decisions(reply(*items), [])
    assert len(accepted) == MAX_DECISIONS
    assert [r.decision for r in rejected] == items[MAX_DECISIONS:]


@pytest.mark.parametrize(
    "content",
    [None, "", "I think the user likes tea.", "[1, 2]", '{"memory": []}', '{"memories": {}}'],
)
def test_a_reply_that_is_not_the_object_asked_for_raises(content: Any) -> None:
    with pytest.raises(BadExtraction):
        parse_decisions(content, KNOWN)


def test_a_fenced_reply_is_read() -> None:
    fenced = '```json\n{"memories": [{"action": "add", "text": "The user plays chess."}]}\n```'
    accepted, _ = parse_decisions(fenced, [])
    assert [d.text for d in accepted] == ["The user plays chess."]
    assert json_object("```\n[1]\n```") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.25, 0.25),
        (-3, 0.0),
        ("2", 1.0),
        (True, 0.5),
        (None, 0.5),
        ("high", 0.5),
        (float("nan"), 0.5),
        (10**400, 1.0),  # valid JSON, too large for a float
        (-(10**400), 0.0),
        ("1e999", 1.0),
    ],
)
def test_confidence_is_clamped_to_0_1(value: Any, expected: float) -> None:
    assert clamp01(value) == expected


def test_memories_sharing_rarer_words_rank_first() -> None:
    memories = [
        ("tea", "The user drinks green tea every morning."),
        ("hike", "The user hikes in the Alps every summer."),
        ("dog", "The user has a dog called Rex."),
        ("long", "The user likes hiking, and also " + "many other things " * 20),
    ]
    ranked = rank_memories(["hiking", "summer", "plans"], memories)
    assert ranked == ["hike", "long"]
    assert rank_memories([], memories) == []
    assert stem("hiking") == stem("hikes") == "hik"
    assert stem("is") == "is"


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        (["assistant", "user", "assistant"], (0, 1)),  # the message before, the turn, the reply
        (["user", "assistant"], (0, 0)),  # the conversation's first turn
        (["user", "assistant", "user", "assistant", "user", "assistant"], (3, 4)),  # resent
        (["user", "assistant", "tool", "assistant"], (1, 2)),  # a tool's result is the turn
        (["user"], (0, 0)),  # no reply (yet)
        (["assistant", "user", "system", "assistant"], (0, 1)),  # a system message after it
        ([], (0, 0)),
    ],
)
def test_the_turn_is_the_last_message_not_from_the_assistant(
    roles: list[str], expected: tuple[int, int]
) -> None:
    assert turn_of(roles, before=1) == expected


def test_a_repeat_is_looked_for_in_each_spelling_a_normalised_text_has() -> None:
    assert spellings("The  user is\nVegetarian!") == [
        "the user is vegetarian",
        "the user is vegetarian.",
        "the user is vegetarian!",
    ]


def test_retries_back_off_doubling_up_to_a_cap_then_give_up() -> None:
    policy = RetryPolicy(max_attempts=4, first_delay_s=10, max_delay_s=25)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert [policy.next_run(n, now) for n in (1, 2, 3)] == [
        now + timedelta(seconds=10),
        now + timedelta(seconds=20),
        now + timedelta(seconds=25),
    ]
    assert policy.next_run(4, now) is None
    # Retried for weeks: the thousandth attempt waits the cap, rather than overflowing.
    patient = RetryPolicy(max_attempts=100_000, first_delay_s=10.0, max_delay_s=3600)
    assert patient.next_run(1100, now) == now + timedelta(hours=1)
