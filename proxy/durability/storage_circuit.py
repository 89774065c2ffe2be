"""The storage circuit breaker (policies/resilience.py decides; this module keeps the clock,
says which outcomes count and logs the changes).

A database that is slow rather than unreachable would cost every request up to
`server.storage_timeout_ms` before it is answered degraded. After
`server.storage_breaker_threshold` failures or timeouts in a row of storage on the request path
(`ConversationMemory.in_time`), the circuit opens: storage is not tried at all
(`StorageCircuitOpen`, degraded at once with reason `circuit_open`) for
`storage_breaker_open_seconds`; then one call goes through as the trial, and its outcome closes
or reopens the circuit. Work outside the request path that shows the database takes writes
again (a spill replay that stored a request) closes it at once. The opening and the closing
are logged once each (`storage_circuit`), not the requests in between.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import structlog

from policies.resilience import CircuitBreaker, State
from storage.errors import StorageUnavailable

log = structlog.get_logger("memproxy.storage")


class StorageCircuitOpen(StorageUnavailable):
    """Storage was not tried: its circuit is open."""


class StorageCircuit:
    """`threshold` 0: no breaker, every call is tried."""

    def __init__(
        self,
        threshold: int,
        open_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.breaker = CircuitBreaker(threshold, open_seconds) if threshold else None
        self._clock = clock

    def state(self) -> State:
        return self.breaker.state(self._clock()) if self.breaker is not None else "closed"

    def admit(self) -> bool:
        """Whether a call may go (else StorageCircuitOpen); True when it is the trial."""
        if self.breaker is None:
            return False
        wait, trial = self.breaker.admit(self._clock())
        if wait is not None:
            raise StorageCircuitOpen(
                f"storage failed {self.breaker.threshold} times in a row: not tried for "
                f"{math.ceil(wait)} s more"
            )
        return trial

    @contextlib.contextmanager
    def outcome(self, *, trial: bool) -> Iterator[None]:
        """Around an admitted call: StorageUnavailable (unreachable, too slow) is a failure,
        a return a success; anything else (a conflict, a refusal, a cancellation) decides
        nothing, and a trial that ends so may be tried again by the next call."""
        try:
            yield
        except StorageUnavailable as exc:
            self._record(failed=True, trial=trial, error=str(exc))
            raise
        except BaseException:
            if self.breaker is not None:
                self.breaker.abandon(trial=trial)
            raise
        self._record(failed=False, trial=trial)

    def close(self, by: str) -> None:
        """The database is known to take writes again (`by` says how): closed at once."""
        if self.breaker is not None and self.breaker.opened_at is not None:
            self.breaker.close()
            log.warning("storage_circuit", state="closed", by=by)

    def _record(self, *, failed: bool, trial: bool, error: str | None = None) -> None:
        if self.breaker is None:
            return
        was = self.breaker.state(self._clock())
        self.breaker.record(self._clock(), failed=failed, trial=trial)
        now = self.breaker.state(self._clock())
        if now == "open" and was != "open":
            log.warning(
                "storage_circuit",
                state="open",
                by="trial" if was == "half_open" else "failures",
                open_seconds=self.breaker.open_seconds,
                error=error,
            )
        elif now == "closed" and was != "closed":
            log.warning("storage_circuit", state="closed", by="trial")
