"""The spill: what storage could not take, kept in a local file until it can.

When the database is unreachable or slower than `server.storage_timeout_ms`, a chat request is
still answered (fail-open, `x-memory-status: degraded`), and what it would have stored goes
here instead: the user's turn, appended and fsynced before the upstream is called (as the
database write would have been), then the exchange's outcome when it ends. Outcomes whose
`finish()` failed, mode-off records whose batch failed, and what amends an exchange's record
after the fact but could not be written to it (the costs of the proxy's own model calls, an
LLM intent) come here too. `SpillReplayer` (proxy/pipeline/replay.py) writes it all to the database
when it answers again, each exchange once (entries are keyed by request id), and then deletes
the file.

The file is bounded (`server.spill_max_bytes`, counting the file being replayed): a new turn
that would not fit is refused, and the request gets a 503 rather than an answer that would be
forgotten. Outcomes and records of requests already answered are always written, so the file
may pass the bound by their size.

One JSON object per line. Appending, taking the file for replay and scrubbing a user hold an
exclusive lock (flock on `<path>.lock`), and one replay at a time holds `<path>.replay.lock`,
so replicas on one host may share the path. Lines that cannot be read go to `<path>.failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import structlog

log = structlog.get_logger("memproxy.spill")

Kind = Literal["turn", "outcome", "record", "charge", "intent"]
KINDS = ("turn", "outcome", "record", "charge", "intent")
# Entries that amend the record of a request (`Spilled.holds_user`).
AMENDS = ("charge", "intent")


class SpillFull(Exception):
    """The spill holds `spill_max_bytes` already: a new turn cannot be kept."""


@dataclass(frozen=True, slots=True)
class Spilled:
    """One line: a turn (what `begin()` was given), an outcome (what `finish()` was given), a
    whole exchange record (mode off), or an amendment of its record (a cost part of the
    proxy's own, a charge; the LLM's intent), of one request."""

    kind: Kind
    tenant_id: str
    user_id: str
    request_id: str
    at: datetime  # when the request began
    data: dict[str, Any]

    @property
    def holds_user(self) -> bool:
        """Whether the user's next turn must wait for it (`SpillFile.holds`): not for a charge
        or an intent, which amend a record and order nothing."""
        return self.kind not in AMENDS

    def line(self) -> bytes:
        entry = {
            "kind": self.kind,
            "tenant": self.tenant_id,
            "user": self.user_id,
            "request_id": self.request_id,
            "at": self.at.isoformat(),
            "data": self.data,
        }
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> Spilled:
        """Raises ValueError for a line that is not an entry."""
        try:
            entry = json.loads(line)
            kind = entry["kind"]
            if kind not in KINDS or not isinstance(entry["data"], dict):
                raise ValueError(f"not a spill entry: kind {kind!r}")
            return cls(
                kind=kind,
                tenant_id=str(entry["tenant"]),
                user_id=str(entry["user"]),
                request_id=str(entry["request_id"]),
                at=datetime.fromisoformat(entry["at"]),
                data=entry["data"],
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a spill entry: {exc}") from exc


class SpillFile:
    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.replaying = self.path.with_name(self.path.name + ".replaying")
        self.failed = self.path.with_name(self.path.name + ".failed")
        self._lock = self.path.with_name(self.path.name + ".lock")
        self._replay_lock = self.path.with_name(self.path.name + ".replay.lock")
        # (tenant, user) -> the number of the last entry this process added for them.
        self._users: dict[tuple[str, str], int] = {}
        self._added = 0
        # Held by this process's replay round, from `take` to its `close`: an erasure waits
        # on it here, not in a worker thread blocked on the file lock (erasures enough to
        # fill the default executor would leave the round no thread to close with).
        self._round = asyncio.Lock()
        # Why the last append (or probe) failed, None when it worked: a full or read-only
        # disk (/readyz and /metrics report it).
        self.unwritable: str | None = None

    async def add(self, entry: Spilled, *, bounded: bool) -> None:
        """Append and fsync `entry`. `bounded` (a new turn): SpillFull when it would not fit.
        OSError when the file cannot be written."""
        try:
            await asyncio.to_thread(self._add, entry, bounded)
        except OSError as exc:
            self.unwritable = _why(exc)
            raise
        self.unwritable = None
        self._added += 1
        if entry.holds_user:
            self._users[(entry.tenant_id, entry.user_id)] = self._added

    def _add(self, entry: Spilled, bounded: bool) -> None:
        line = entry.line()
        with _locked(self._lock):
            if bounded and self.size() + len(line) > self.max_bytes:
                raise SpillFull(f"the spill holds {self.size()} of {self.max_bytes} bytes")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not _ends_a_line(self.path):  # an append cut short (a crash, a full disk)
                line = b"\n" + line  # ends that fragment, which is then set aside alone
            _append(self.path, line)

    async def probe(self) -> str | None:
        """Whether the spill's directory takes a write now (a byte written, fsynced and
        removed beside the file): None when it does, else why not."""
        try:
            await asyncio.to_thread(self._probe)
        except OSError as exc:
            self.unwritable = _why(exc)
        else:
            self.unwritable = None
        return self.unwritable

    def _probe(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        probe = self.path.with_name(self.path.name + ".probe")
        created = not probe.is_symlink() and not probe.exists()  # (removed only if so)
        try:
            _write_synced(probe, b"\n", os.O_TRUNC)
        finally:
            if created:
                with contextlib.suppress(FileNotFoundError):
                    probe.unlink()

    def holds(self, tenant_id: str, user_id: str) -> bool:
        """Whether entries of this user that order their next turn (`Spilled.holds_user`),
        written by this process (or found at start-up), wait for the database."""
        return (tenant_id, user_id) in self._users

    async def load(self) -> None:
        """At start-up: note whose entries the files hold (see `holds`)."""
        for path in (self.replaying, self.path):
            if path.exists():
                for entry in await asyncio.to_thread(self._read, path, set_aside=False):
                    if entry.holds_user:
                        self._users[(entry.tenant_id, entry.user_id)] = self._added

    def size(self) -> int:
        """Bytes waiting, in the file and in the one being replayed."""
        return sum(_size(p) for p in (self.path, self.replaying))

    async def take(self) -> SpillRound | None:
        """The entries waiting, for one replay; None when there are none or another replay
        (another replica on this host) is running. New entries go to a fresh file meanwhile;
        a round that did not finish leaves what it did not get to for the next one."""
        if self._round.locked():
            return None  # (this process's round is running)
        await self._round.acquire()
        added = self._added
        try:
            batch = await asyncio.to_thread(self._take)
        except BaseException:
            self._round.release()
            raise
        if batch is None:
            self._round.release()
        else:
            batch.added = added
        return batch

    def _settled(self, entries: list[Spilled], left: list[Spilled], added: int) -> None:
        """A round stored `entries` and `left` the rest: the users of the first hold nothing
        more unless they have some of the rest, or added some since."""
        waiting = {(e.tenant_id, e.user_id) for e in left if e.holds_user}
        for key in {(e.tenant_id, e.user_id) for e in entries} - waiting:
            if self._users.get(key, 0) <= added:
                self._users.pop(key, None)

    def empty(self) -> bool:
        """Nothing waits (and so no user is held)."""
        if self.size():
            return False
        self._users.clear()
        return True

    def _waiting(self) -> bool:
        return self.path.exists() or self.replaying.exists()

    def _take(self) -> SpillRound | None:
        if not self._waiting():
            return None
        holder = _try_lock(self._replay_lock)
        if holder is None:
            return None
        try:
            with _locked(self._lock):
                if _size(self.path) > 0:
                    if not self.replaying.exists():
                        self.path.rename(self.replaying)
                    else:  # what a round left, then what came since: all of it, in order
                        _join(self.replaying, self.path)
            entries = self._read(self.replaying) if self.replaying.exists() else []
        except BaseException:
            os.close(holder)
            raise
        if not entries:
            with contextlib.suppress(FileNotFoundError):
                self.replaying.unlink()
            os.close(holder)
            return None
        return SpillRound(self, entries, holder)

    def _read(self, path: Path, *, set_aside: bool = True) -> list[Spilled]:
        """The entries in `path`; lines that are not entries go to `.failed` (and out of
        `path`, so the next round does not set them aside again)."""
        entries, bad = [], []
        lines = path.read_bytes().split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entries.append(Spilled.parse(line))
            except ValueError as exc:
                if number == len(lines):  # no newline after it: a write cut short by a crash
                    log.warning("spill_torn_line", path=str(path), bytes=len(line))
                else:
                    log.error("spill_unreadable_line", path=str(path), line=number, error=str(exc))
                bad.append(line + b"\n")
        if bad and set_aside:
            _append(self.failed, b"".join(bad))
            _rewrite(path, b"".join(e.line() for e in entries))
        return entries

    async def dead_letter(self, entries: list[Spilled], reason: str) -> None:
        """Entries that cannot be replayed: kept in `<path>.failed`, never dropped."""
        log.error("spill_not_replayed", request_id=entries[0].request_id, reason=reason)
        await asyncio.to_thread(_append, self.failed, b"".join(e.line() for e in entries))

    async def forget(self, tenant_id: str, user_id: str) -> int:
        """Remove a user's entries (an erasure), waiting for a replay round running now (this
        process's, or another replica's on this host). Returns how many there were."""
        async with self._round:  # (another replica's round is waited for in the thread)
            removed = await asyncio.to_thread(self._forget, tenant_id, user_id)
        self._users.pop((tenant_id, user_id), None)
        return removed

    def _forget(self, tenant_id: str, user_id: str) -> int:
        removed = 0
        if not (self._waiting() or self.failed.exists()):
            return removed  # (one written after this check is dropped at its replay)
        with _locked(self._replay_lock), _locked(self._lock):
            for path in (self.path, self.replaying, self.failed):
                if not path.exists():
                    continue
                lines = path.read_bytes().splitlines(keepends=True)
                kept = [line for line in lines if not _of(line, tenant_id, user_id)]
                if len(kept) == len(lines):
                    continue
                if path != self.failed:
                    removed += len(lines) - len(kept)
                _rewrite(path, b"".join(kept))
        return removed


class SpillRound:
    """One replay's entries; `close(done=True)` deletes them, `close(done=False)` keeps them
    for the next round. Replaying an entry twice is harmless (the replay skips exchanges
    already recorded)."""

    def __init__(self, spill: SpillFile, entries: list[Spilled], holder: int) -> None:
        self.spill, self.entries, self._holder = spill, entries, holder
        self.added = 0  # the spill's add count when the round began

    async def close(self, *, left: list[Spilled]) -> None:
        """End the round; `left`: the entries it did not get to, kept for the next one."""

        def close() -> None:
            try:
                if len(left) == len(self.entries):
                    pass  # nothing done: the file holds them as they are
                elif left:
                    _rewrite(self.spill.replaying, b"".join(e.line() for e in left))
                else:
                    with contextlib.suppress(FileNotFoundError):
                        self.spill.replaying.unlink()
            finally:
                os.close(self._holder)

        try:
            await asyncio.to_thread(close)
        finally:
            self.spill._round.release()
        gone = {id(e) for e in left}
        self.spill._settled([e for e in self.entries if id(e) not in gone], left, self.added)


def _why(exc: OSError) -> str:
    """An OSError in a few words, without the path (`[Errno 28] No space left on device`)."""
    if exc.errno is not None and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}"
    return str(exc)[:200]


def _of(line: bytes, tenant_id: str, user_id: str) -> bool:
    try:
        entry = Spilled.parse(line)
    except ValueError:
        return False
    return entry.tenant_id == tenant_id and entry.user_id == user_id


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _ends_a_line(path: Path) -> bool:
    """Whether `path` is empty or missing, or ends with a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return True
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except FileNotFoundError:
        return True


def _rewrite(path: Path, data: bytes) -> None:
    """Replace `path`'s content whole (a crash leaves the old or the new), mode 0600."""
    scratch = path.with_name(path.name + ".new")
    _write_synced(scratch, data, os.O_TRUNC)
    scratch.replace(path)


def _append(path: Path, data: bytes) -> None:
    _write_synced(path, data, os.O_APPEND)


def _join(path: Path, after: Path) -> None:
    """Move `after`'s lines to the end of `path` (a crash between the two leaves them in
    both: replayed twice, which is harmless)."""
    if not _ends_a_line(path):
        _append(path, b"\n")  # (a torn line's fragment ends there, and is set aside alone)
    _append(path, after.read_bytes())
    after.unlink()


def _write_synced(path: Path, data: bytes, mode: int) -> None:
    """Write all of `data` to `path` (created 0600; `mode`: O_APPEND or O_TRUNC) and fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _try_lock(path: Path) -> int | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
