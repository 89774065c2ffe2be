"""The storage circuit breaker around storage on the request path (`ConversationMemory.in_time`):
which outcomes count, that an open circuit does not start the work at all, and that its
changes are logged once each. A clock is passed in; the database is a script."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from proxy.durability.storage_circuit import StorageCircuit, StorageCircuitOpen
from proxy.pipeline.memory import ConversationMemory
from storage.database import Database
from storage.errors import ConflictError, StorageTimeout, StorageUnavailable


class Storage:
    """Storage work from a script: each call answers, fails, or hangs past the timeout."""

    def __init__(self) -> None:
        self.started = 0

    async def call(self, outcome: str = "ok") -> str:
        self.started += 1
        if outcome == "down":
            raise StorageUnavailable("connection refused")
        if outcome == "conflict":
            raise ConflictError("taken")
        if outcome == "slow":
            await asyncio.sleep(10)
        return outcome


def memory(threshold: int, open_seconds: float, clock: list[float]) -> ConversationMemory:
    circuit = StorageCircuit(threshold, open_seconds, clock=lambda: clock[0])
    # (`in_time` does not touch the database itself)
    db = cast(Database, None)
    return ConversationMemory(db, reply_after_response=False, timeout=0.05, circuit=circuit)


def circuit_events(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["state"], e["by"]) for e in logs if e["event"] == "storage_circuit"]


async def test_storage_failing_in_a_row_is_not_tried_until_a_trial_closes_it() -> None:
    clock, storage = [0.0], Storage()
    mem = memory(2, 5, clock)
    with capture_logs() as logs:
        with pytest.raises(StorageUnavailable):
            await mem.in_time(storage.call("down"))
        assert await mem.in_time(storage.call()) == "ok"  # a success resets the count
        with pytest.raises(StorageTimeout):
            await mem.in_time(storage.call("slow"))
        with pytest.raises(StorageUnavailable):
            await mem.in_time(storage.call("down"))
        assert mem.circuit.state() == "open" and storage.started == 4
        for _ in range(3):  # refused at once: the work is never started
            with pytest.raises(StorageCircuitOpen):
                await mem.in_time(storage.call())
        assert storage.started == 4
        clock[0] = 5.0
        assert mem.circuit.state() == "half_open"
        assert await mem.in_time(storage.call()) == "ok"  # the trial
        assert mem.circuit.state() == "closed" and storage.started == 5
    assert circuit_events(logs) == [("open", "failures"), ("closed", "trial")]


async def test_a_failed_trial_opens_the_circuit_again_and_others_wait_for_it() -> None:
    clock, storage = [0.0], Storage()
    mem = memory(1, 5, clock)
    with capture_logs() as logs:
        with pytest.raises(StorageTimeout):
            await mem.in_time(storage.call("slow"))
        clock[0] = 5.0
        trial = asyncio.ensure_future(mem.in_time(storage.call("slow")))
        await asyncio.sleep(0)  # (the trial is under way)
        with pytest.raises(StorageCircuitOpen):  # not a second trial
            await mem.in_time(storage.call())
        with pytest.raises(StorageTimeout):
            await trial
        assert mem.circuit.state() == "open" and storage.started == 2
        with pytest.raises(StorageCircuitOpen):
            await mem.in_time(storage.call())
        clock[0] = 10.0
        assert await mem.in_time(storage.call()) == "ok"
    assert circuit_events(logs) == [("open", "failures"), ("open", "trial"), ("closed", "trial")]


async def test_a_trial_that_decides_nothing_leaves_the_next_call_to_try() -> None:
    clock, storage = [0.0], Storage()
    mem = memory(1, 5, clock)
    with pytest.raises(StorageUnavailable):
        await mem.in_time(storage.call("down"))
    clock[0] = 5.0
    with pytest.raises(ConflictError):  # the database answered, but not for the circuit
        await mem.in_time(storage.call("conflict"))
    cancelled = asyncio.ensure_future(mem.in_time(storage.call("slow")))
    await asyncio.sleep(0)
    cancelled.cancel()  # the trial's client went away
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert mem.circuit.state() == "half_open"
    assert await mem.in_time(storage.call()) == "ok"
    assert mem.circuit.state() == "closed"


async def test_storing_elsewhere_closes_an_open_circuit_at_once() -> None:
    clock, storage = [0.0], Storage()
    mem = memory(1, 3600, clock)
    with capture_logs() as logs:
        with pytest.raises(StorageUnavailable):
            await mem.in_time(storage.call("down"))
        mem.circuit.close(by="spill_replay")
        mem.circuit.close(by="spill_replay")  # (closed already: nothing to log)
        assert await mem.in_time(storage.call()) == "ok"
    assert circuit_events(logs) == [("open", "failures"), ("closed", "spill_replay")]


async def test_no_breaker_when_the_threshold_is_zero() -> None:
    clock, storage = [0.0], Storage()
    mem = memory(0, 5, clock)
    for _ in range(10):
        with pytest.raises(StorageUnavailable):
            await mem.in_time(storage.call("down"))
    assert await mem.in_time(storage.call()) == "ok"
    assert storage.started == 11 and mem.circuit.state() == "closed"
