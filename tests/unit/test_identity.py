"""policies.identity: the stored chain as it stood before its newest messages (`rewind`), and
which of a request's messages are new to a named conversation (`split_request`)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from policies.identity import (
    EMPTY_CHAIN,
    UNKNOWN_CHAIN,
    Split,
    canonical,
    chain_hashes,
    continues,
    resent_run,
    rewind,
    split_request,
)

P = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
N = [{"role": "user", "content": "three"}]
REPLY = [{"role": "assistant", "content": "four"}]


def stored(messages: list[dict[str, Any]]) -> tuple[int, str]:
    return len(messages), chain_hashes(messages)[-1]


def test_a_request_that_resends_the_shorter_chain_continues_it() -> None:
    count, chain = stored([*P, *N, *REPLY])
    request = [*P, *N]
    hashes = chain_hashes(request)
    # Without the replayed turn (N and its reply) the chain is P, which the request starts with.
    assert rewind(count, chain, hashes, [*N, *REPLY]) == (2, hashes[1])
    assert continues(2, hashes[1], hashes)


def test_a_thin_request_does_not_continue_the_shorter_chain() -> None:
    count, chain = stored([*P, *N, *REPLY])
    hashes = chain_hashes(N)
    assert rewind(count, chain, hashes, [*N, *REPLY]) == (2, UNKNOWN_CHAIN)
    assert not continues(2, UNKNOWN_CHAIN, hashes)


def test_rewinding_everything_is_the_empty_chain() -> None:
    count, chain = stored([*N, *REPLY])
    assert rewind(count, chain, chain_hashes(N), [*N, *REPLY]) == (0, EMPTY_CHAIN)


def test_rewinding_nothing_keeps_the_chain_when_the_request_carries_it() -> None:
    count, chain = stored(P)
    hashes = chain_hashes([*P, *N])
    assert rewind(count, chain, hashes, []) == (2, chain)
    assert rewind(count, chain, chain_hashes([*N, *N]), []) == (2, UNKNOWN_CHAIN)


def sys(text: str = "Be brief.") -> dict[str, Any]:
    return {"role": "system", "content": text}


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def split(
    conversation: list[dict[str, Any]], request: list[dict[str, Any]], window: int = 28
) -> Split:
    """`split_request` as the proxy calls it for a conversation named by its header: the
    request's hashes, the stored chain, and the stored tail with its messages' hashes."""
    chain = chain_hashes(conversation)
    tail = conversation[-window:]
    return split_request(
        request, chain_hashes(request), len(conversation), chain[-1], tail, chain[-window:]
    )


STORED = [sys(), u("q1"), a("a1"), u("q2"), a("a2")]


def test_a_request_that_continues_the_chain_adds_what_follows_it() -> None:
    assert split(STORED, [*STORED, u("q3")]) == Split(new=[u("q3")], attach_history=False)


def test_a_regenerated_answer_forks_at_its_question_and_adds_nothing() -> None:
    assert split(STORED, STORED[:4]) == Split(new=[], attach_history=False, fork=4)


def test_an_edited_turn_forks_before_it_and_adds_only_the_edit() -> None:
    edited = [*STORED[:3], u("q2, said better")]
    assert split(STORED, edited) == Split(new=[u("q2, said better")], attach_history=False, fork=3)


def test_a_thin_clients_turn_is_no_fork_even_when_it_repeats_a_stored_one() -> None:
    """Its system prompt and one message matching the conversation's opening is not history
    resent: the stored tail goes with it."""
    assert split(STORED, [sys(), u("q1")]) == Split(new=[u("q1")], attach_history=True)
    assert split(STORED, [sys(), u("q3")]) == Split(new=[u("q3")], attach_history=True)


def test_a_thin_client_that_resends_the_last_reply_or_retries_adds_what_is_new() -> None:
    assert split(STORED, [sys(), a("a2"), u("q3")]) == Split(
        new=[u("q3")], attach_history=True, overlap=1
    )
    unanswered = [*STORED, u("q3")]
    assert split(unanswered, [sys(), u("q3")]) == Split(new=[], attach_history=True, overlap=1)


def test_history_resent_under_a_new_system_prompt_adds_only_the_new_turn() -> None:
    """A system prompt that changes each request (today's date, say): the rest of the request
    is the stored history, past the tail window too, and only the newest turn is new."""
    stored = [sys("Today is Monday.")]
    for i in range(20):
        stored += [u(f"q{i}"), a(f"a{i}")]
    request = [sys("Today is Tuesday."), *stored[1:], u("q20")]
    assert split(stored, request) == Split(new=[u("q20")], attach_history=False, overlap=28)
    short = [sys("Today is Tuesday."), *STORED[1:], u("q3")]  # all of it in the tail
    assert split(STORED, short) == Split(new=[u("q3")], attach_history=True, overlap=4)


def test_a_sliding_window_client_gets_the_older_history_it_left_out() -> None:
    stored = [sys()]
    for i in range(10):
        stored += [u(f"q{i}"), a(f"a{i}")]
    request = [sys(), *stored[-6:], u("q10")]
    result = split(stored, request)
    assert result == Split(new=[u("q10")], attach_history=True, overlap=6)


def test_a_fork_goes_back_only_to_the_points_it_is_given() -> None:
    """The proxy gives the stored messages from the first stored reply on: a request that
    repeats only what came before it (the opening request's greeting or examples, resent by a
    thin client every time) is no fork."""
    chain = chain_hashes(STORED)
    after_first_reply = [None, None, *chain[2:]]
    greeting = [sys(), u("q1"), u("q3")]
    assert split_request(greeting, chain_hashes(greeting), 5, chain[-1], STORED, chain).fork == 2
    result = split_request(
        greeting, chain_hashes(greeting), 5, chain[-1], STORED, after_first_reply
    )
    assert result == Split(new=[u("q1"), u("q3")], attach_history=True)


def test_a_client_that_keeps_the_first_exchange_and_the_latest_is_no_fork() -> None:
    """It drops the middle of its history: the latest stored messages, resent, say that it
    continues the conversation; nothing it resent is stored again."""
    stored = [sys()]
    for i in range(6):
        stored += [u(f"q{i}"), a(f"a{i}")]
    request = [sys(), *stored[1:3], *stored[-4:], u("q6")]
    assert split(stored, request) == Split(new=[u("q6")], attach_history=False, overlap=4)


def _every_run(turn: list[dict[str, Any]], tail: list[dict[str, Any]]) -> tuple[int, int]:
    """`resent_run` as first written: the whole tail in canonical form up front."""
    if not turn or not tail:
        return 0, 0
    sent = [canonical(m) for m in turn]
    held = [canonical(m) for m in tail]
    for end in range(len(sent), 0, -1):
        if sent[end - 1] != held[-1]:
            continue
        length = 1
        while length < min(end, len(held)) and sent[end - 1 - length] == held[-1 - length]:
            length += 1
        if length == end or length >= 2:
            return end, length
    return 0, 0


_MESSAGES = st.lists(
    st.builds(
        lambda role, text: {"role": role, "content": text},
        st.sampled_from(["user", "assistant"]),
        st.sampled_from(["a", "b", "c"]),
    ),
    max_size=8,
)


@given(turn=_MESSAGES, tail=_MESSAGES)
def test_the_resent_run_is_found_reading_only_the_tail_it_needs(
    turn: list[dict[str, Any]], tail: list[dict[str, Any]]
) -> None:
    assert resent_run(turn, tail) == _every_run(turn, tail)
