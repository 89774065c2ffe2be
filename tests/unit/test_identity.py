"""policies.identity.rewind: the stored chain as it stood before its newest messages."""

from __future__ import annotations

from typing import Any

from policies.identity import EMPTY_CHAIN, UNKNOWN_CHAIN, chain_hashes, continues, rewind

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
