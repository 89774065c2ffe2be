"""Retry and circuit-breaker decisions, with plain data and a clock passed in."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from policies.resilience import CircuitBreaker, is_failure, retry_delay
from proxy.core.config import BreakerConfig, RetryConfig, UpstreamConfig
from proxy.core.errors import UpstreamStatusError, UpstreamTimeout, UpstreamUnreachable
from proxy.upstream.base import UpstreamReply
from proxy.upstream.resilient import CircuitOpen, ResilientUpstream

SETTINGS = {"attempts": 2, "base": 0.25, "cap": 4.0}


def test_failures_before_a_response_head_are_retried_with_growing_waits() -> None:
    rng = random.Random(7)
    first = retry_delay(1, **SETTINGS, rng=rng)
    second = retry_delay(2, **SETTINGS, rng=rng)
    assert first is not None and second is not None
    assert 0.1875 <= first <= 0.25 and 0.375 <= second <= 0.5
    assert retry_delay(3, **SETTINGS) is None  # attempts used up


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 529])
def test_statuses_the_sdks_retry_are_retried(status: int) -> None:
    assert retry_delay(1, **SETTINGS, status=status) is not None


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422, 501])
def test_other_statuses_are_answers(status: int) -> None:
    assert retry_delay(1, **SETTINGS, status=status) is None


def test_the_upstreams_own_wait_wins_unless_it_is_too_long() -> None:
    assert retry_delay(1, **SETTINGS, status=429, headers={"retry-after-ms": "1500"}) == 1.5
    assert retry_delay(1, **SETTINGS, status=429, headers={"retry-after": "2"}) == 2.0
    assert retry_delay(1, **SETTINGS, status=429, headers={"retry-after": "60"}) is None
    assert retry_delay(1, **SETTINGS, status=503, headers={"x-should-retry": "false"}) is None
    waited = retry_delay(1, **SETTINGS, status=503, headers={"retry-after": "Fri, 1 Jan"})
    assert waited is not None and waited <= 0.25  # a date: our own backoff


def test_no_retries_when_none_are_configured() -> None:
    assert retry_delay(1, attempts=0, base=0.25, cap=4.0) is None


def test_what_counts_as_an_upstream_failure() -> None:
    assert is_failure(None) and is_failure(500) and is_failure(503)
    assert not is_failure(200) and not is_failure(429) and not is_failure(400)
    assert not is_failure(501)


def test_the_circuit_opens_after_failures_in_a_row_and_a_trial_closes_it() -> None:
    breaker = CircuitBreaker(threshold=3, open_seconds=30)
    for now in (0.0, 1.0):
        assert breaker.admit(now) == (None, False)
        breaker.record(now, failed=True)
    breaker.record(1.5, failed=False)  # a success in between resets the count
    for now in (2.0, 3.0, 4.0):
        assert breaker.admit(now) == (None, False)
        breaker.record(now, failed=True)
    assert breaker.state(5.0) == "open"
    assert breaker.admit(5.0) == (pytest.approx(29.0), False)
    # After open_seconds: one trial at a time; the others are asked to wait a moment.
    assert breaker.state(34.0) == "half_open"
    assert breaker.admit(34.0) == (None, True)
    assert breaker.admit(34.1) == (CircuitBreaker.TRIAL_WAIT, False)
    breaker.record(35.0, failed=False, trial=True)
    assert breaker.state(35.0) == "closed" and breaker.admit(35.0) == (None, False)


def test_a_failed_trial_opens_the_circuit_again() -> None:
    breaker = CircuitBreaker(threshold=1, open_seconds=10)
    breaker.record(0.0, failed=True)
    assert breaker.admit(5.0) == (pytest.approx(5.0), False)
    assert breaker.admit(10.0) == (None, True)
    breaker.record(10.5, failed=True, trial=True)
    assert breaker.state(11.0) == "open" and breaker.admit(20.0)[0] is not None
    assert breaker.admit(20.5) == (None, True)  # the next trial


def test_only_the_trial_decides_a_half_open_circuit() -> None:
    breaker = CircuitBreaker(threshold=1, open_seconds=10)
    assert breaker.admit(0.0) == (None, False)  # a slow call admitted while closed...
    breaker.record(1.0, failed=True)  # ...and another that fails: open
    assert breaker.admit(11.0) == (None, True)  # the trial
    breaker.record(11.5, failed=False)  # the slow call answers late: decides nothing
    assert breaker.trial and breaker.admit(11.6) == (CircuitBreaker.TRIAL_WAIT, False)
    breaker.abandon(trial=False)  # nor does a late call's cancellation
    assert breaker.trial
    breaker.abandon(trial=True)  # the trial's client went away: another may try
    assert breaker.admit(12.0) == (None, True)


def test_evidence_from_outside_closes_the_circuit_at_once() -> None:
    breaker = CircuitBreaker(threshold=2, open_seconds=10)
    breaker.record(0.0, failed=True)
    breaker.record(1.0, failed=True)
    assert breaker.state(2.0) == "open"
    breaker.close()  # (e.g. the spill's replay stored a request)
    assert breaker.state(2.0) == "closed" and breaker.admit(2.0) == (None, False)
    breaker.record(3.0, failed=True)  # the count started again: one failure is not two
    assert breaker.state(3.0) == "closed"


def test_a_trial_under_way_when_the_circuit_closes_counts_as_any_call() -> None:
    breaker = CircuitBreaker(threshold=2, open_seconds=10)
    breaker.record(0.0, failed=True)
    breaker.record(0.0, failed=True)
    assert breaker.admit(10.0) == (None, True)
    breaker.close()
    breaker.record(11.0, failed=True, trial=True)  # one failure of a closed circuit...
    assert breaker.state(11.0) == "closed" and not breaker.trial
    breaker.record(12.0, failed=True)  # ...and a second one in a row opens it
    assert breaker.state(12.0) == "open"


class Scripted:
    """An upstream (the seam) that raises or answers from a script, counting its calls."""

    name, kind, stream_usage, reports_sent = "scripted", "litellm", True, False

    def __init__(self, *outcomes: BaseException | UpstreamReply) -> None:
        self.outcomes, self.calls = list(outcomes), 0

    async def chat_completions(
        self, body: dict[str, Any], *, stream: bool, sent: Callable[[], None] | None = None
    ) -> UpstreamReply:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def provider_error(status: int) -> UpstreamStatusError:
    return UpstreamStatusError(status, {"error": {"message": "no"}}, {})


async def no_wait(seconds: float) -> None:
    return None


async def test_a_providers_error_status_raised_as_an_error_is_judged_by_its_status() -> None:
    inner = Scripted(provider_error(400), provider_error(400), provider_error(503))
    config = UpstreamConfig(
        kind="litellm", retries=RetryConfig(attempts=1), breaker=BreakerConfig(failures=2)
    )
    upstream = ResilientUpstream(inner, config, sleep=no_wait)  # type: ignore[arg-type]
    for _ in range(2):  # a 400 is an answer: not retried, and never opens the circuit
        with pytest.raises(UpstreamStatusError):
            await upstream.chat_completions({}, stream=False)
    assert inner.calls == 2
    inner.outcomes += [UpstreamReply(200, body=b"{}")]
    reply = await upstream.chat_completions({}, stream=False)  # a 503, retried once: 200
    assert (reply.status, inner.calls) == (200, 4)
    assert upstream.breaker is not None and upstream.breaker.state(0) == "closed"


async def test_a_cancelled_trial_does_not_hold_the_circuit_half_open_forever() -> None:
    clock = [0.0]
    inner = Scripted(UpstreamUnreachable("down"), asyncio.CancelledError())
    config = UpstreamConfig(kind="openai", breaker=BreakerConfig(failures=1, open_seconds=10))
    upstream = ResilientUpstream(inner, config, clock=lambda: clock[0])  # type: ignore[arg-type]
    with pytest.raises(UpstreamUnreachable):
        await upstream.chat_completions({}, stream=False)
    with pytest.raises(CircuitOpen):
        await upstream.chat_completions({}, stream=False)
    clock[0] = 11.0
    with pytest.raises(asyncio.CancelledError):  # the trial's client went away
        await upstream.chat_completions({}, stream=False)
    inner.outcomes.append(UpstreamReply(200, body=b"{}"))
    assert (await upstream.chat_completions({}, stream=False)).status == 200


async def test_a_timeout_is_not_retried_the_provider_may_have_billed_it() -> None:
    inner = Scripted(UpstreamTimeout("slow"), UpstreamReply(200, body=b"{}"))
    config = UpstreamConfig(kind="openai", retries=RetryConfig(attempts=2))
    upstream = ResilientUpstream(inner, config, sleep=no_wait)  # type: ignore[arg-type]
    with pytest.raises(UpstreamTimeout):
        await upstream.chat_completions({}, stream=False)
    assert inner.calls == 1
