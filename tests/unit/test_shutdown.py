"""The shutdown deadline: guarded waits still running when it passes raise `ShuttingDown`;
waits cancelled for another reason (the client left) stay cancelled."""

from __future__ import annotations

import asyncio

import pytest

from proxy.core.shutdown import ShutdownDeadline, ShuttingDown


async def test_a_wait_still_running_at_the_deadline_is_cut_with_an_error() -> None:
    deadline = ShutdownDeadline()
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(deadline.guard(never))
    finished = asyncio.create_task(deadline.guard(asyncio.sleep(0, "done")))
    assert await finished == "done"
    deadline.start(0.2)  # cut at 0.1 s: half the grace, when it is under two seconds
    with pytest.raises(ShuttingDown) as cut:
        await asyncio.wait_for(waiting, 5)
    assert (cut.value.status, cut.value.code) == (503, "server_shutting_down")
    assert not waiting.cancelled()
    with pytest.raises(ShuttingDown):  # a wait that begins after the deadline
        await deadline.guard(asyncio.sleep(10))


async def test_a_wait_cancelled_for_another_reason_stays_cancelled() -> None:
    deadline = ShutdownDeadline()
    deadline.start(10)
    waiting = asyncio.create_task(deadline.guard(asyncio.sleep(10)))
    await asyncio.sleep(0)
    waiting.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert waiting.cancelled()
