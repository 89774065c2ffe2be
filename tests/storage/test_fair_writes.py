"""Writes are shared fairly between tenants (storage/fair_slots.py): one tenant with many
writes queued does not hold up another's, which goes next after the writes already running,
not after all of the first tenant's (issue 34: another tenant's turns degraded for about
65 s while one tenant's flood was written). Order of events only, no clocks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sqlalchemy import Connection

from storage.database import Database

FLOOD = 6


async def held(db: Database) -> int:
    """Every write slot taken (by a tenant of its own), as writes that run long would."""
    for _ in range(db.write_slots.slots):
        await db.write_slots.acquire("holder")
    return db.write_slots.slots


async def test_another_tenants_write_goes_before_a_flooding_tenants_queue(db: Database) -> None:
    ran: list[str] = []

    def unit(name: str) -> Callable[[Connection], None]:
        return lambda conn: ran.append(name)

    slots = await held(db)
    queued = [
        asyncio.create_task(db.write(unit(f"flood-{n}"), tenant="flood")) for n in range(FLOOD)
    ]
    await asyncio.sleep(0)  # (each task runs up to its wait for a slot)
    assert db.write_slots.waiting("flood") == FLOOD
    other = asyncio.create_task(db.write(unit("other"), tenant="other"))
    await asyncio.sleep(0)
    assert db.write_slots.waiting("other") == 1
    db.write_slots.release()  # one slot goes round; the others stay held
    await asyncio.gather(*queued, other)
    # The lanes take turns: the flood's first write (its lane was first in line), then the
    # other tenant's, then the rest of the flood; first come, first served would have put
    # the other tenant's write behind all six.
    assert ran == ["flood-0", "other", *(f"flood-{n}" for n in range(1, FLOOD))]
    for _ in range(slots - 1):
        db.write_slots.release()
    assert db.write_slots.waiting() == 0


async def test_a_write_that_stops_waiting_for_its_slot_is_never_run(db: Database) -> None:
    ran: list[str] = []
    slots = await held(db)
    late = asyncio.create_task(db.write(lambda conn: ran.append("late"), tenant="b"))
    await asyncio.sleep(0)
    assert db.write_slots.waiting("b") == 1
    late.cancel()  # (as a request's storage timeout does)
    await asyncio.gather(late, return_exceptions=True)
    for _ in range(slots):
        db.write_slots.release()
    await db.write(lambda conn: ran.append("after"), tenant="b")
    assert ran == ["after"]
    assert db.write_slots.waiting() == 0


async def test_a_large_write_gives_way_to_the_small_writes_on_their_way(db: Database) -> None:
    """An ordinary turn announces its write from its arrival (`expecting`); a large write
    (a 10,000-message import) waits until no such turn is on its way, then goes."""
    ran: list[str] = []
    with db.write_slots.expecting():
        large = asyncio.create_task(
            db.write(lambda conn: ran.append("large"), tenant="flood", large=True)
        )
        with db.write_slots.expecting():  # two ordinary turns, of any tenants
            await asyncio.sleep(0.05)
            assert not large.done()
            await db.write(lambda conn: ran.append("first"), tenant="a")
        await db.write(lambda conn: ran.append("second"), tenant="b")
        assert not large.done()
    await large
    assert ran == ["first", "second", "large"]
    assert db.write_slots.expected() == 0
    await db.write(lambda conn: ran.append("large, none on their way"), large=True)
    assert ran[-1] == "large, none on their way"


async def test_small_writes_that_never_pause_hold_a_large_one_back_only_so_long(
    db: Database,
) -> None:
    db.write_slots.large_yields_seconds = 0.05
    ran: list[str] = []
    with db.write_slots.expecting():  # (a turn that never gets to its write)
        await db.write(lambda conn: ran.append("large"), tenant="flood", large=True)
        assert db.write_slots.expected() == 1
    assert ran == ["large"]
