"""When a failed background job runs again, and when it is given up (dead-lettered)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 5
    first_delay_s: float = 10.0
    max_delay_s: float = 3600.0

    def delay(self, attempts: int) -> timedelta:
        """How long after its `attempts`-th failed attempt a job waits: doubling from the
        first delay, capped."""
        doublings = min(max(0, attempts - 1), 64)  # (past the cap long before: no overflow)
        seconds = self.first_delay_s * 2**doublings
        return timedelta(seconds=min(seconds, self.max_delay_s))

    def next_run(self, attempts: int, now: datetime) -> datetime | None:
        """When to run a job again after its `attempts`-th failure; None: give it up."""
        if attempts >= self.max_attempts:
            return None
        return now + self.delay(attempts)


def conversation_subject(conversation_id: str, began: datetime) -> str:
    """How a job's subject names the conversation it is about: its id and when it began (an id
    may be used again once its conversation is deleted), not its row's key, which would tell
    a client how many conversations all tenants have."""
    return f"{conversation_id}@{int(began.timestamp() * 1_000_000)}"
