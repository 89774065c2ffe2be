"""The spill file: bounded for new turns, never for outcomes; a replay round takes what is
there while new entries go to a fresh file; a torn last line (a crash mid-write) is set aside;
an erasure scrubs a user's lines from both files."""

from __future__ import annotations

import asyncio
import fcntl
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.durability.spill import Spilled, SpillFile, SpillFull
from proxy.pipeline.spill_entries import grouped

AT = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def entry(request_id: str, kind: str = "turn", user: str = "alice", size: int = 10) -> Spilled:
    return Spilled(kind, "t1", user, request_id, AT, {"text": "x" * size})  # type: ignore[arg-type]


async def test_entries_come_back_as_written_in_order(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    written = [entry("r1"), entry("r1", "outcome"), entry("r2", user="bob")]
    for e in written:
        await spill.add(e, bounded=e.kind == "turn")
    batch = await spill.take()
    assert batch is not None
    assert batch.entries == written
    await batch.close(left=[])
    assert spill.size() == 0 and await spill.take() is None


async def test_a_new_turn_that_would_not_fit_is_refused_but_outcomes_always_go_in(
    tmp_path: Path,
) -> None:
    one = len(entry("r1").line())
    spill = SpillFile(tmp_path / "spill.jsonl", one * 2)
    await spill.add(entry("r1"), bounded=True)
    await spill.add(entry("r2"), bounded=True)
    with pytest.raises(SpillFull):
        await spill.add(entry("r3"), bounded=True)
    await spill.add(entry("r1", "outcome"), bounded=False)  # its request was answered
    assert spill.size() == one * 2 + len(entry("r1", "outcome").line())


async def test_the_file_being_replayed_counts_toward_the_bound(tmp_path: Path) -> None:
    one = len(entry("r1").line())
    spill = SpillFile(tmp_path / "spill.jsonl", one)
    await spill.add(entry("r1"), bounded=True)
    batch = await spill.take()
    assert batch is not None
    with pytest.raises(SpillFull):
        await spill.add(entry("r2"), bounded=True)
    await batch.close(left=[])
    await spill.add(entry("r2"), bounded=True)


async def test_entries_added_during_a_round_wait_for_the_next_and_a_failed_round_keeps_its_own(
    tmp_path: Path,
) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    batch = await spill.take()
    assert batch is not None
    assert await spill.take() is None  # one round at a time
    await spill.add(entry("r2"), bounded=True)
    assert [e.request_id for e in batch.entries] == ["r1"]
    await batch.close(left=batch.entries)  # (the database went away)
    # The next round takes what that one left, then what came since: all of it, in order
    # (so a user is never settled while an entry of theirs waits in the other file).
    again = await spill.take()
    assert again is not None and [e.request_id for e in again.entries] == ["r1", "r2"]
    await again.close(left=[])
    assert await spill.take() is None and spill.size() == 0


async def test_a_torn_last_line_and_a_garbled_line_are_set_aside_once(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    with spill.path.open("ab") as out:
        out.write(b'{"kind": "nonsense"}\n')
    await spill.add(entry("r2"), bounded=True)
    with spill.path.open("ab") as out:
        out.write(entry("r3").line()[:25])  # the process died mid-write
    batch = await spill.take()
    assert batch is not None
    assert [e.request_id for e in batch.entries] == ["r1", "r2"]
    aside = [b'{"kind": "nonsense"}', entry("r3").line()[:25]]
    assert spill.failed.read_bytes().splitlines() == aside
    await batch.close(left=batch.entries)  # the database went away: all of it again
    again = await spill.take()
    assert again is not None and [e.request_id for e in again.entries] == ["r1", "r2"]
    assert spill.failed.read_bytes().splitlines() == aside  # not set aside twice


async def test_an_entry_written_after_a_torn_one_is_whole(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    with spill.path.open("ab") as out:
        out.write(entry("r2").line()[:25])  # an append cut short (a full disk)
    await spill.add(entry("r3"), bounded=True)
    batch = await spill.take()
    assert batch is not None and [e.request_id for e in batch.entries] == ["r1", "r3"]


async def test_forget_scrubs_a_user_from_the_file_and_the_one_being_replayed(
    tmp_path: Path,
) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    await spill.add(entry("r2", user="bob"), bounded=True)
    batch = await spill.take()
    assert batch is not None
    await batch.close(left=batch.entries)  # left for the next round
    await spill.add(entry("r3"), bounded=True)
    await spill.add(entry("r3", "outcome"), bounded=False)
    spill.failed.write_bytes(entry("r0").line() + entry("r9", user="bob").line())  # set aside
    assert spill.holds("t1", "alice") and spill.holds("t1", "bob")
    assert await spill.forget("t1", "alice") == 3
    assert spill.failed.read_bytes() == entry("r9", user="bob").line()
    for path in (spill.path, spill.replaying, spill.failed):
        assert path.stat().st_mode & 0o777 == 0o600
    kept = await spill.take()
    assert kept is not None and [e.request_id for e in kept.entries] == ["r2"]
    await kept.close(left=[])
    assert await spill.take() is None  # (the new file held alice's only)
    assert not spill.holds("t1", "bob")  # (stored by that round)


async def test_erasures_during_a_round_wait_for_it_without_taking_its_threads(
    tmp_path: Path,
) -> None:
    """As many erasures as the default executor has threads: each used to wait for the
    round's file lock in one, so the round had none left to close with (a deadlock)."""
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    await spill.add(entry("r2", user="user3"), bounded=True)
    batch = await spill.take()
    assert batch is not None
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's size
    erasures = [asyncio.create_task(spill.forget("t1", f"user{i}")) for i in range(workers)]
    await asyncio.sleep(0.2)
    assert not any(e.done() for e in erasures)  # they wait for the round
    try:
        await asyncio.wait_for(batch.close(left=batch.entries), 5)
    except TimeoutError:
        fcntl.flock(batch._holder, fcntl.LOCK_UN)  # (let the threads go, so the test ends)
        raise
    assert sorted(await asyncio.gather(*erasures)) == [0] * (workers - 1) + [1]
    again = await spill.take()  # user3's entry went with the erasure
    assert again is not None and [e.request_id for e in again.entries] == ["r1"]
    await again.close(left=[])


async def test_a_user_is_held_until_a_round_stores_everything_of_theirs(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    batch = await spill.take()
    assert batch is not None
    await spill.add(entry("r1", "outcome"), bounded=False)  # (during the round)
    await batch.close(left=[])
    assert spill.holds("t1", "alice")  # its outcome still waits
    last = await spill.take()
    assert last is not None
    await last.close(left=[])
    assert not spill.holds("t1", "alice")
    # A new process finds what a previous one left.
    await spill.add(entry("r2", user="carol"), bounded=True)
    fresh = SpillFile(spill.path, 10_000)
    await fresh.load()
    assert fresh.holds("t1", "carol") and not fresh.holds("t1", "alice")


async def test_a_user_with_an_entry_a_round_left_stays_held(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    await spill.add(entry("r2", user="bob"), bounded=True)
    await spill.add(entry("r1", "outcome"), bounded=False)
    batch = await spill.take()
    assert batch is not None
    await batch.close(left=batch.entries[2:])  # alice's turn stored, not yet her outcome
    assert spill.holds("t1", "alice") and not spill.holds("t1", "bob")


async def test_after_a_restart_a_round_settles_no_one_whose_entry_still_waits(
    tmp_path: Path,
) -> None:
    """A round cut short at shutdown left its entries; the drain added more after them."""
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    batch = await spill.take()
    assert batch is not None
    await batch.close(left=batch.entries)
    await spill.add(entry("r2"), bounded=True)
    restarted = SpillFile(spill.path, 10_000)
    await restarted.load()
    first = await restarted.take()
    assert first is not None and [e.request_id for e in first.entries] == ["r1", "r2"]
    await first.close(left=first.entries[1:])
    assert restarted.holds("t1", "alice")  # r2 waits still


def test_entries_group_by_request_in_first_appearance_order() -> None:
    entries = [entry("r2"), entry("r1"), entry("r2", "outcome"), entry("r3", "record")]
    requests = grouped(entries)
    assert [r.first.request_id for r in requests] == ["r2", "r1", "r3"]
    assert requests[0].turn == entries[0] and requests[0].outcome == entries[2]
    assert requests[1].outcome is None
    assert requests[2].record == entries[3] and requests[2].turn is None


async def test_an_erased_or_emptied_spill_holds_no_one(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill.jsonl", 10_000)
    await spill.add(entry("r1"), bounded=True)
    await spill.add(entry("r2", user="bob"), bounded=True)
    await spill.forget("t1", "alice")
    assert not spill.holds("t1", "alice")  # (its next turn does not wait for a replay)
    assert spill.holds("t1", "bob") and not spill.empty()
    await spill.forget("t1", "bob")
    assert spill.empty() and not spill.holds("t1", "bob")
