"""Heavy turns (large imports) give way to ordinary turns on their way to the database, for a
bounded time, and are stored one at a time (proxy/pipeline/heavy_turns.py)."""

from __future__ import annotations

import asyncio

from proxy.pipeline.heavy_turns import HeavyTurns


async def test_a_heavy_turn_starts_once_no_ordinary_turn_is_on_its_way() -> None:
    turns = HeavyTurns(1, yield_seconds=60)
    events: list[str] = []

    async def heavy() -> None:
        async with turns.slot("flood"):
            events.append("heavy stored")

    with turns.ordinary():
        with turns.ordinary():  # two ordinary turns, of any tenants
            started = asyncio.ensure_future(heavy())
            await asyncio.sleep(0.05)
            events.append("first stored")
        await asyncio.sleep(0.05)
        events.append("second stored")
    await started
    assert events == ["first stored", "second stored", "heavy stored"]
    assert turns.ordinary_on_their_way() == 0


async def test_with_no_ordinary_turn_about_a_heavy_turn_starts_at_once() -> None:
    turns = HeavyTurns(1, yield_seconds=60)
    async with asyncio.timeout(5):  # (would wait the minute out if it gave way to nobody)
        async with turns.slot("flood"):
            pass


async def test_ordinary_turns_that_never_pause_hold_a_heavy_turn_back_only_so_long() -> None:
    turns = HeavyTurns(1, yield_seconds=0.05)
    with turns.ordinary():
        async with asyncio.timeout(5):
            async with turns.slot("flood"):
                assert turns.ordinary_on_their_way() == 1  # went anyway


async def test_heavy_turns_are_stored_one_at_a_time() -> None:
    turns = HeavyTurns(1, yield_seconds=60)
    inside: list[int] = []
    most = 0

    async def heavy(tenant: str) -> None:
        nonlocal most
        async with turns.slot(tenant):
            inside.append(1)
            most = max(most, len(inside))
            await asyncio.sleep(0.01)
            inside.pop()

    await asyncio.gather(*(heavy(t) for t in ("a", "a", "b", "c")))
    assert most == 1
