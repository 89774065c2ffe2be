"""When to try an upstream call again, how long to wait, and when to stop calling an upstream
(or the database) that keeps failing (a circuit breaker). Plain decisions: the clock is passed
in.

- **Retries** (`retry_delay`): only what failed before anything reached the client: a call
  that could not connect, or a response head with a status worth retrying (408, 409, 429 and
  every 5xx but 501, as the OpenAI SDKs retry them),
  unless the upstream says `x-should-retry: false`. The wait doubles from `base` up to `cap`,
  with jitter; the upstream's `retry-after-ms` or `retry-after` (seconds) wins when it asks for
  no more than `cap` (asked for more, the call is not retried here: the client decides).
- **Circuit breaker** (`CircuitBreaker`): after `threshold` failures in a row (no connection,
  a timeout, a 5xx other than 501) the upstream is *open*: calls fail at once for
  `open_seconds`; then one trial call goes through (*half-open*), and its outcome closes or
  reopens the circuit. A success closes it; a 4xx counts as a success (the upstream answered).
  What counts as a failure is the caller's to say: the upstreams' (`is_failure`) in
  proxy/upstream/resilient.py, storage's (unreachable, too slow) in
  proxy/durability/storage_circuit.py,
  which also closes the circuit early (`close`) when its own work shows the database is back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

RETRY_STATUSES = frozenset({408, 409, 429})  # and every 5xx but 501 (see `retryable`)
State = Literal["closed", "open", "half_open"]


def _header_delay(headers: Mapping[str, str]) -> float | None:
    """The wait an upstream asks for, in seconds (None: it asks for none we can read)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / scale
        except ValueError:
            continue  # (an HTTP date: not worth parsing for a retry this short)
        if seconds >= 0:
            return seconds
    return None


def retry_delay(
    attempt: int,
    *,
    attempts: int,
    base: float,
    cap: float,
    status: int | None = None,
    headers: Mapping[str, str] | None = None,
    rng: random.Random | None = None,
) -> float | None:
    """Seconds to wait before try `attempt + 1` (`attempt` counts from 1), or None for no more.
    `status` None means the call failed before a response head (connect error, timeout)."""
    if attempt > attempts:
        return None
    headers = headers or {}
    if status is not None:
        if not retryable(status):
            return None
        if headers.get("x-should-retry", "").lower() == "false":
            return None
        asked = _header_delay(headers)
        if asked is not None:
            return asked if asked <= cap else None
    exponential = min(cap, base * 2.0 ** (attempt - 1))
    jitter: float = (rng or random.Random()).uniform(0.75, 1.0)
    return exponential * jitter


def retryable(status: int) -> bool:
    """A status worth trying again: a timeout, a conflict, rate limiting, or any server error
    but 501 (Anthropic's 529 "overloaded" among them)."""
    return status in RETRY_STATUSES or (status >= 500 and status != 501)


def is_failure(status: int | None) -> bool:
    """Whether an outcome counts against the upstream's health (None: no response at all)."""
    return status is None or (status >= 500 and status != 501)


@dataclass(slots=True)
class CircuitBreaker:
    threshold: int
    open_seconds: float
    failures: int = 0
    opened_at: float | None = None
    trial: bool = field(default=False)  # a half-open trial call is under way
    TRIAL_WAIT = 1.0  # what `admit` asks others to wait while a trial is under way

    def state(self, now: float) -> State:
        if self.opened_at is None:
            return "closed"
        return "open" if now - self.opened_at < self.open_seconds else "half_open"

    def admit(self, now: float) -> tuple[float | None, bool]:
        """(None, is_trial) if a call may go ahead now, the trial call of a half-open circuit
        or not; else (seconds until one may, False)."""
        state = self.state(now)
        if state == "closed":
            return None, False
        if state == "half_open" and not self.trial:
            self.trial = True
            return None, True
        if self.trial:
            return self.TRIAL_WAIT, False
        assert self.opened_at is not None
        return max(0.0, self.opened_at + self.open_seconds - now) or self.open_seconds, False

    def record(self, now: float, *, failed: bool, trial: bool = False) -> None:
        """The outcome of an admitted call (`trial`: the one `admit` said was the trial). The
        trial decides a half-open circuit; calls admitted while it was closed count only
        while it still is (a late answer does not decide an open one). A trial whose circuit
        was closed meanwhile (`close`) counts as any other call."""
        if trial and self.trial:
            self.trial = False
            if failed:
                self.opened_at = now  # open again
            else:
                self.failures, self.opened_at = 0, None
            return
        if self.opened_at is not None:
            return
        if not failed:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = now

    def close(self) -> None:
        """Closed at once, on evidence from outside the breaker's calls that the service is
        back (e.g. other work that succeeded): the failure count starts again."""
        self.failures, self.opened_at, self.trial = 0, None, False

    def abandon(self, *, trial: bool) -> None:
        """An admitted call that ended with no outcome (cancelled): a trial may be tried again."""
        if trial:
            self.trial = False
