"""Nearest stored messages, memories or passages by cosine similarity, for one user at a time.

Brute force with numpy over the user's vectors (about 3 ms for 27,000 of 384 dimensions). The
vectors live in the database, a table for each kind (`SOURCES`); each user's are kept here
too, per (kind, tenant, user, model), and brought up to date on every search inside the
caller's read transaction: the newest vector's pk (one index seek) tells whether anything was
stored since they were loaded, and what was is read and appended. Deletions, and vectors
committed out of order (PostgreSQL's sequences), are found by counting the user's vectors (a
scan of their index range: 0.55 ms at 2,760 messages on SQLite, growing with them), at most
every `verify_seconds`, and at once when an item held is embedded again (a memory's text
edited: its old vector went with the edit); when the count disagrees the user's vectors are
reloaded whole. Until then a search may still compare a deleted item, and may miss one
committed out of order (found by its words meanwhile): a hit is only ever used once its
message (memory, passage) has been read back in the same snapshot (proxy/pipeline/recall.py,
proxy/pipeline/artifact_sources.py), so a deleted one never comes back. Memory is bounded
(`max_bytes`): the least recently searched users go first, and a user too large to keep is
read whole for each search.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Connection

from policies.vectors import DTYPE
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.search import Hit
from storage.repositories.vectors import MessageVectors, StoredVector

if TYPE_CHECKING:  # numpy: imported when first used (a tenant with embeddings on)
    import numpy as np
    from numpy.typing import NDArray


class VectorSource(Protocol):
    """A table of one kind's vectors, as the index reads it (storage/repositories/*vectors)."""

    def stats(self, tenant_id: str, user_id: str, model: str) -> tuple[int, int]: ...

    def newest(self, tenant_id: str, user_id: str, model: str) -> int: ...

    def load(
        self, tenant_id: str, user_id: str, model: str, *, after_pk: int = 0
    ) -> list[StoredVector]: ...


Source = Callable[[Connection], VectorSource]
Key = tuple[str, str, str, str]  # kind, tenant, user, model
# How long a user's kept vectors go without being counted against the database (deletions).
VERIFY_SECONDS = 5.0
# The kinds: the vectors of stored messages, of memories and of attachments' passages.
SOURCES: dict[str, Source] = {
    "messages": MessageVectors,
    "memories": MemoryVectors,
    "passages": ChunkVectors,
}


@dataclass(frozen=True, slots=True)
class Near:
    """A vector hit: its item (message, memory, passage) and where it is (a message's
    conversation and seq, a passage's attachment and seq; 0 for a memory)."""

    item_pk: int
    group_pk: int
    seq: int
    score: float  # cosine similarity


@dataclass(slots=True)
class _Buffer:
    """Rows [0, used) hold vectors; the rest is room to append. Grows by doubling into a new
    buffer; a search keeps reading the arrays it started with."""

    matrix: NDArray[np.float32]
    items: NDArray[np.int64]
    groups: NDArray[np.int64]
    seqs: NDArray[np.int64]
    used: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.matrix.nbytes + self.items.nbytes + self.groups.nbytes + self.seqs.nbytes)


@dataclass(frozen=True, slots=True)
class _Vectors:
    """One user's vectors as of one database state: the first `n` rows of `buffer`."""

    buffer: _Buffer
    n: int
    count: int  # vectors in the database then
    last_pk: int  # the newest vector's pk then
    verified_at: float  # (monotonic) when `count` was last checked against the database

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


class VectorIndex:
    def __init__(
        self,
        *,
        max_bytes: int = 256 * 2**20,
        verify_seconds: float = VERIFY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.verify_seconds = verify_seconds
        self._clock = clock
        self._users: OrderedDict[Key, _Vectors] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.loads = 0  # whole loads (tests and figures)

    @property
    def _np(self) -> Any:
        """numpy, imported by the first search (10 MB a process that never searches by
        meaning never holds)."""
        import numpy

        return numpy

    def nearest(
        self,
        conn: Connection,
        tenant_id: str,
        user_id: str,
        model: str,
        query: Sequence[float],
        *,
        limit: int,
        min_similarity: float = -1.0,
        conversation_pk: int | None = None,
    ) -> list[Hit]:
        """The user's stored messages most similar to `query` (unit length), best first, at
        most `limit` of them and none below `min_similarity`; `conversation_pk` keeps it to
        one conversation."""
        return self.search(
            "messages",
            conn,
            tenant_id,
            user_id,
            model,
            query,
            limit=limit,
            min_similarity=min_similarity,
            groups=None if conversation_pk is None else (conversation_pk,),
        ).message_hits()

    def nearest_of(
        self,
        kind: str,
        conn: Connection,
        tenant_id: str,
        user_id: str,
        model: str,
        query: Sequence[float],
        *,
        limit: int,
        min_similarity: float = -1.0,
        groups: Collection[int] | None = None,
    ) -> list[Near]:
        """The user's items of `kind` (`SOURCES`) most similar to `query` (unit length), best
        first, at most `limit` of them and none below `min_similarity`; `groups` keeps it to
        those conversations (messages) or attachments (passages)."""
        return self.search(
            kind,
            conn,
            tenant_id,
            user_id,
            model,
            query,
            limit=limit,
            min_similarity=min_similarity,
            groups=groups,
        ).hits

    def search(
        self,
        kind: str,
        conn: Connection,
        tenant_id: str,
        user_id: str,
        model: str,
        query: Sequence[float],
        *,
        limit: int,
        min_similarity: float = -1.0,
        groups: Collection[int] | None = None,
    ) -> Nearest:
        """`nearest_of`'s hits, and every searched item's similarity to `query` (`Nearest.of`:
        recall weighs the turns it reads around the hits by it too)."""
        np = self._np
        vectors = self._current(conn, (kind, tenant_id, user_id, model))
        if vectors is None or vectors.n == 0:
            return Nearest([])
        q = np.asarray(query, dtype=np.float32)
        b, n = vectors.buffer, vectors.n
        if q.shape[0] != b.matrix.shape[1]:
            return Nearest([])  # a question embedded by another model's size: not comparable
        scores = b.matrix[:n] @ q
        if groups is not None:
            wanted = np.fromiter(groups, dtype=np.int64)
            scores = np.where(np.isin(b.groups[:n], wanted), scores, -2.0)
        take = min(limit, vectors.n)
        if take <= 0:
            return Nearest([], b.items[:n], scores)
        best = np.argpartition(-scores, take - 1)[:take] if take < vectors.n else np.arange(take)
        best = best[np.argsort(-scores[best], kind="stable")]
        hits = [
            Near(int(b.items[i]), int(b.groups[i]), int(b.seqs[i]), float(scores[i]))
            for i in best
            if scores[i] >= min_similarity and scores[i] > -2.0
        ]
        # Rows below n are never written again (appends go after them), so a view is safe.
        return Nearest(hits, b.items[:n], scores)

    def forget(self, tenant_id: str, user_id: str | None = None) -> None:
        """Drop what is kept of a user (or a whole tenant), e.g. once erased: not needed for
        correctness (the next search would notice), but the memory goes at once."""
        with self._lock:
            for key in [k for k in self._users if k[1] == tenant_id and user_id in (None, k[2])]:
                self._bytes -= self._users.pop(key).nbytes

    def _current(self, conn: Connection, key: Key) -> _Vectors | None:
        kind, tenant_id, user_id, model = key
        repo = SOURCES[kind](conn)
        with self._lock:
            kept = self._users.get(key)
            if kept is not None:
                self._users.move_to_end(key)
        at = self._clock()
        new: Sequence[StoredVector] | None = None  # (read once, in this snapshot)
        if kept is not None and at - kept.verified_at < self.verify_seconds:
            last_pk = repo.newest(tenant_id, user_id, model)
            if last_pk == kept.last_pk:
                return kept
            if last_pk > kept.last_pk:  # (else the newest was deleted: counted below)
                new = repo.load(tenant_id, user_id, model, after_pk=kept.last_pk)
                if not self._held(kept, new):  # (else an item embedded again: counted below)
                    appended = self._appended(kept, new, kept.count + len(new), last_pk)
                    return self._keep(key, appended)
        count, last_pk = repo.stats(tenant_id, user_id, model)
        if count == 0:
            if kept is not None:
                self.forget_key(key)
            return None
        if kept is not None and kept.count == count and kept.last_pk == last_pk:
            return self._keep(key, replace(kept, verified_at=at))
        if kept is not None and last_pk > kept.last_pk:
            if new is None:
                new = repo.load(tenant_id, user_id, model, after_pk=kept.last_pk)
            if kept.count + len(new) == count:
                return self._keep(key, self._appended(kept, new, count, last_pk, at))
        self.loads += 1
        loaded = self._appended(None, repo.load(tenant_id, user_id, model), count, last_pk, at)
        return self._keep(key, loaded)

    def _held(self, kept: _Vectors, rows: Sequence[StoredVector]) -> bool:
        """Whether any of `rows` is of an item `kept` has a vector of: embedded again (a
        memory's text edited), so its old vector is gone from the database."""
        if not rows:
            return False
        items = self._np.fromiter((r.item_pk for r in rows), dtype=self._np.int64, count=len(rows))
        return bool(self._np.isin(items, kept.buffer.items[: kept.n]).any())

    def forget_key(self, key: Key) -> None:
        with self._lock:
            dropped = self._users.pop(key, None)
            if dropped is not None:
                self._bytes -= dropped.nbytes

    def _keep(self, key: Key, vectors: _Vectors) -> _Vectors:
        with self._lock:
            previous = self._users.pop(key, None)
            if previous is not None:
                self._bytes -= previous.nbytes
            if vectors.nbytes <= self.max_bytes:
                self._users[key] = vectors
                self._bytes += vectors.nbytes
                while self._bytes > self.max_bytes and len(self._users) > 1:
                    _, evicted = self._users.popitem(last=False)
                    self._bytes -= evicted.nbytes
        return vectors

    def _appended(
        self,
        kept: _Vectors | None,
        rows: Sequence[StoredVector],
        count: int,
        last_pk: int,
        verified_at: float | None = None,
    ) -> _Vectors:
        """`kept` with `rows` after it, or `rows` alone (verified at `verified_at`, else when
        `kept` was). Rows are appended in place only when no other search extended the same
        buffer past `kept` meanwhile (under the lock); otherwise into a new buffer."""
        if verified_at is None:
            verified_at = kept.verified_at if kept is not None else self._clock()
        np = self._np
        if kept is not None:
            dims = int(kept.buffer.matrix.shape[1])
        else:
            dims = len(rows[0].vector) // 4 if rows else 0
        rows = [r for r in rows if len(r.vector) == dims * 4]  # another size: not comparable
        with self._lock:
            old_n = kept.n if kept is not None else 0
            n = old_n + len(rows)
            buffer = kept.buffer if kept is not None else None
            if buffer is None or buffer.used != old_n or n > buffer.matrix.shape[0]:
                capacity = max(16, n, 2 * (buffer.matrix.shape[0] if buffer is not None else 0))
                fresh = _Buffer(
                    np.empty((capacity, dims), dtype=np.float32),
                    np.empty(capacity, dtype=np.int64),
                    np.empty(capacity, dtype=np.int64),
                    np.empty(capacity, dtype=np.int64),
                )
                if buffer is not None:
                    fresh.matrix[:old_n] = buffer.matrix[:old_n]
                    fresh.items[:old_n] = buffer.items[:old_n]
                    fresh.groups[:old_n] = buffer.groups[:old_n]
                    fresh.seqs[:old_n] = buffer.seqs[:old_n]
                buffer = fresh
            if rows:
                blob = b"".join(r.vector for r in rows)
                buffer.matrix[old_n:n] = np.frombuffer(blob, dtype=DTYPE).reshape(len(rows), dims)
                buffer.items[old_n:n] = [r.item_pk for r in rows]
                buffer.groups[old_n:n] = [r.group_pk for r in rows]
                buffer.seqs[old_n:n] = [r.seq for r in rows]
            buffer.used = n
        return _Vectors(buffer, n, count, last_pk, verified_at)


@dataclass(frozen=True, slots=True)
class Nearest:
    """A vector search's hits, best first, and the similarity of every item it compared
    (`of`)."""

    hits: list[Near]
    items: NDArray[np.int64] | None = None
    scores: NDArray[np.float32] | None = None

    def message_hits(self) -> list[Hit]:
        """The hits as stored messages' (a search of `messages`)."""
        return [Hit(n.item_pk, n.group_pk, n.seq, n.score) for n in self.hits]

    def of(self, pks: Collection[int]) -> dict[int, float]:
        """The similarity to the question of each of `pks` that has a vector here."""
        if self.items is None or self.scores is None or not pks:
            return {}
        import numpy

        rows = numpy.isin(self.items, numpy.fromiter(pks, dtype=numpy.int64, count=len(pks)))
        found = zip(self.items[rows].tolist(), self.scores[rows].tolist(), strict=True)
        return {int(pk): float(score) for pk, score in found if score > -2.0}
