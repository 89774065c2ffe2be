"""Context assembly invariants, on plain data."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.context import Budget, StoredTurn, assemble, mandatory_tokens, select_history


def msg(role: str, text: str = "x", **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": text, **extra}


def call(call_id: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def reply(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "result"}


def turns(*messages: dict[str, Any], tokens: int = 10) -> list[StoredTurn]:
    return [StoredTurn(m, tokens) for m in messages]


def test_client_messages_unaltered_and_history_goes_after_leading_system() -> None:
    client = [msg("system", "sys"), msg("user", "new")]
    history = turns(msg("user", "old"), msg("assistant", "old reply"))
    result = assemble(client, history, Budget())
    assert result.messages == [client[0], history[0].message, history[1].message, client[1]]
    assert result.history_messages == 2 and result.context_tokens == 20


def test_budget_holds_and_history_is_contiguous_never_skipping_a_large_message() -> None:
    history = [
        StoredTurn(msg("user", "a"), 10),
        StoredTurn(msg("assistant", "huge"), 500),
        StoredTurn(msg("user", "b"), 10),
        StoredTurn(msg("assistant", "c"), 10),
    ]
    chosen = select_history(history, Budget(token_budget=100, min_recent_messages=0))
    # "a" would fit after skipping the huge message, but the run must stay contiguous.
    assert [t.message["content"] for t in chosen] == ["b", "c"]


def test_min_recent_messages_are_kept_even_over_budget() -> None:
    history = turns(*(msg("user", str(i)) for i in range(10)), tokens=100)
    chosen = select_history(history, Budget(token_budget=50, min_recent_messages=3))
    assert [t.message["content"] for t in chosen] == ["7", "8", "9"]


def test_max_history_messages_caps_the_run() -> None:
    history = turns(*(msg("user", str(i)) for i in range(10)), tokens=1)
    chosen = select_history(
        history, Budget(token_budget=1000, max_history_messages=4, min_recent_messages=0)
    )
    assert len(chosen) == 4


def test_tool_calls_travel_with_their_replies_and_orphans_are_dropped() -> None:
    history = turns(
        reply("orphan"), msg("user", "q"), call("c1"), reply("c1"), msg("assistant", "done")
    )
    # Budget for 2 messages: the [call, reply] unit does not fit whole after "done", so it is
    # not split; the run stops there.
    chosen = select_history(history, Budget(token_budget=25, min_recent_messages=0))
    assert [t.message.get("content") for t in chosen] == ["done"]
    everything = select_history(history, Budget(token_budget=1000, min_recent_messages=0))
    assert everything[0].message == msg("user", "q")  # the orphan tool reply never goes out


def test_client_tool_reply_keeps_the_call_it_answers_even_with_no_budget() -> None:
    history = turns(msg("user", "weather?"), call("c9"))
    result = assemble([reply("c9")], history, Budget(token_budget=0, min_recent_messages=0))
    assert result.messages == [call("c9"), reply("c9")]


def test_context_window_drops_history_oldest_first_never_the_client() -> None:
    client = [msg("user", "new")]
    history = turns(
        msg("user", "1"), msg("assistant", "2"), msg("user", "3"), msg("assistant", "4"), tokens=100
    )
    budget = Budget(
        token_budget=10_000, min_recent_messages=4, context_window=300, reserve_tokens=50
    )
    result = assemble(client, history, budget, client_tokens=40)
    assert [m["content"] for m in result.messages] == ["3", "4", "new"]
    assert result.dropped_for_window == 2
    # A client prompt bigger than the window still goes out whole, with nothing added.
    alone = assemble(client, history, budget, client_tokens=10_000)
    assert alone.messages == client and alone.dropped_for_window == 4


roles = st.sampled_from(["user", "assistant", "tool_pair", "tool_orphan", "system"])


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    kinds=st.lists(roles, max_size=30),
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=30, max_size=30),
    token_budget=st.integers(min_value=0, max_value=2000),
    max_history=st.integers(min_value=0, max_value=25),
    min_recent=st.integers(min_value=0, max_value=8),
)
def test_invariants_hold_for_any_history(
    kinds: list[str], sizes: list[int], token_budget: int, max_history: int, min_recent: int
) -> None:
    history: list[StoredTurn] = []
    for i, kind in enumerate(kinds):
        if kind == "tool_pair":
            history += [StoredTurn(call(f"c{i}"), sizes[i]), StoredTurn(reply(f"c{i}"), 5)]
        elif kind == "tool_orphan":
            history.append(StoredTurn(reply(f"gone{i}"), sizes[i]))
        else:
            history.append(StoredTurn(msg(kind, f"m{i}"), sizes[i]))
    budget = Budget(
        token_budget=token_budget, max_history_messages=max_history, min_recent_messages=min_recent
    )
    client = [msg("system", "s"), msg("user", "now")]
    result = assemble(client, history, budget)
    attached = result.messages[1:-1]
    # Client messages first and last, unaltered.
    assert result.messages[0] is client[0] and result.messages[-1] is client[1]
    # A contiguous suffix of the history (up to dropped orphan tool replies).
    ids = [id(t.message) for t in history]
    positions = [ids.index(id(m)) for m in attached]
    assert positions == sorted(positions)
    if positions:
        skipped = [
            history[p].message for p in range(positions[0], len(history)) if p not in positions
        ]
        assert all(m["role"] == "tool" for m in skipped)
    # Tool replies always right after their call; calls always with all their replies.
    for i, m in enumerate(attached):
        if m["role"] == "tool":
            assert (
                attached[i - 1].get("tool_calls")
                and attached[i - 1]["tool_calls"][0]["id"] == m["tool_call_id"]
            )
        if m.get("tool_calls"):
            assert i + 1 < len(attached) and attached[i + 1]["role"] == "tool"
    # Budget: over it only through the mandatory most recent messages (plus one tool unit).
    if result.context_tokens > token_budget:
        assert result.history_messages <= min_recent + 1


def test_a_call_missing_replies_ends_the_run_unless_it_is_the_newest() -> None:
    unanswered = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ],
    }
    history = turns(
        msg("user", "q"), unanswered, reply("a"), msg("user", "later"), msg("assistant", "ok")
    )
    chosen = select_history(history, Budget(token_budget=1000, min_recent_messages=0))
    assert [t.message.get("content") for t in chosen] == ["later", "ok"]
    budget = Budget(token_budget=1000, min_recent_messages=0)
    newest = select_history(history[:3], budget, answers_tool_call=True)
    assert newest[-1] == history[2]  # the client is about to send reply "b"
    # A client turn that is not the missing reply cannot follow the half-answered call: the
    # dangling newest call is left out and the history before it still goes.
    assert select_history(history[:3], budget) == history[:1]
    assert (
        select_history(history[:3], Budget(token_budget=1000, min_recent_messages=6)) == history[:1]
    )


def test_what_is_kept_over_any_budget_includes_the_whole_tool_unit_at_the_line() -> None:
    # The newest two messages are tool replies; the (large) call they answer comes with them.
    both = {**call("a"), "tool_calls": [*call("a")["tool_calls"], *call("b")["tool_calls"]]}
    history = [
        StoredTurn(msg("user", "check both"), 10, 1),
        StoredTurn(both, 750, 2),
        StoredTurn(reply("a"), 5, 3),
        StoredTurn(reply("b"), 5, 4),
    ]
    budget = Budget(token_budget=1000, min_recent_messages=2)
    kept = select_history(history, Budget(token_budget=0, min_recent_messages=2))
    assert [t.seq for t in kept] == [2, 3, 4]
    assert mandatory_tokens([msg("user", "next")], history, budget) == 760
    # A client's tool reply keeps the call it answers, whatever min_recent_messages says.
    answered = [StoredTurn(msg("user", "hi"), 10, 1), StoredTurn(call("z"), 400, 2)]
    none_kept = Budget(token_budget=1000, min_recent_messages=0)
    assert mandatory_tokens([reply("z")], answered, none_kept) == 400
    assert mandatory_tokens([msg("user", "hi")], answered[:1], none_kept) == 0
