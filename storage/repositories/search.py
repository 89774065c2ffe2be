"""Full-text search over a user's stored messages, in the database itself.

SQLite: FTS5 with BM25 ranking (`messages_fts`, porter stemming); PostgreSQL: the English
tsvector of `search_text`, stored (`search_vector`, generated) and GIN-indexed, ranked with
`ts_rank`. Both are kept in sync with the messages (migrations 0004 and 0017): an edit or a
delete changes what is found at once.

Every search takes the tenant and the user; `conversation_pk` narrows it to one conversation
(what an anonymous user gets). The query is a set of plain terms (letters and digits only),
ORed: any of them may match, and the ranking rewards the rows that hold more of them (and, on
SQLite, rarer ones: `ts_rank` knows nothing of how many rows hold a word).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, TextClause, text

from storage.models import CONVERSATIONS, MESSAGES
from storage.repositories.digests import tenant_digest
from storage.repositories.rows import utc

M = MESSAGES
C = CONVERSATIONS
SEARCHED_ROLES = ("user", "assistant")
_TERM = re.compile(r"^\w+$")


def scope_token(tenant_id: str, user_id: str) -> str:
    """The token that names a tenant's user in the search index (64 bits of a hash: results
    are checked against the real tenant and user too, so a collision could only hide hits)."""
    return "u" + tenant_digest(tenant_id, user_id, size=8)


def searchable_text(role: str, content: Any) -> str | None:
    """What search indexes of a message: the text of a user or assistant message."""
    if role not in SEARCHED_ROLES:
        return None
    if isinstance(content, str):
        found = content
    elif isinstance(content, list):
        found = " ".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    else:
        found = ""
    return found or None


@dataclass(frozen=True, slots=True)
class Hit:
    pk: int
    conversation_pk: int
    seq: int
    score: float  # higher is better; comparable within one search only


@dataclass(frozen=True, slots=True)
class Found:
    """A stored message around a hit, with what recall needs to rank and render it."""

    pk: int
    conversation_pk: int
    conversation_id: str
    seq: int
    role: str
    text: str
    tokens: int
    created_at: datetime


# The query names the user's scope token, so only their postings are read and ranked; the
# best are then checked against the real tenant and user (and conversation, for anonymous).
_SQLITE = text(
    "SELECT m.pk, m.conversation_pk, m.seq, f.score FROM ("
    "SELECT rowid AS pk, -bm25(messages_fts, 1.0, 0.0) AS score FROM messages_fts "
    "WHERE messages_fts MATCH :query ORDER BY bm25(messages_fts, 1.0, 0.0) LIMIT :limit"
    ") f JOIN messages m ON m.pk = f.pk "
    "WHERE m.tenant_id = :tenant AND m.user_id = :user AND m.status = 'complete' "
    "ORDER BY f.score DESC"
)
# Most of a search's time on SQLite is bm25 computed for every matching row, and a word in a
# large share of the index (a name the user says in every turn) makes most rows match while
# adding little to any row's score. Such a word's rows are left out of the ranking when that
# provably changes nothing (`_ranked_without_frequent`): a word is frequent in more than
# FREQUENT_SHARE of the index's rows and at least FREQUENT_ROWS of them (below that, ranking
# its rows costs little). On LoCoMo ten times over (27,600 messages), a third less search time.
FREQUENT_SHARE = 0.1
FREQUENT_ROWS = 1_000
# FTS5's bm25 (k1 = 1.2): a word adds less than (k1 + 1) times its idf to a row's score.
_BM25_MOST_PER_IDF = 2.2
_INDEXED_ROWS_AT_MOST = text("SELECT coalesce(max(pk), 0) FROM messages")
_SQLITE_IN_CONVERSATION = text(
    "SELECT m.pk, m.conversation_pk, m.seq, -bm25(messages_fts, 1.0, 0.0) AS score "
    "FROM messages_fts JOIN messages m ON m.pk = messages_fts.rowid "
    "WHERE messages_fts MATCH :query AND m.tenant_id = :tenant AND m.user_id = :user "
    "AND m.status = 'complete' AND m.conversation_pk = :conversation "
    "ORDER BY bm25(messages_fts, 1.0, 0.0) LIMIT :limit"
)
# The stored tsvector (migration 0017): ranking a row does not parse its text again. `ts_rank`
# (term frequency), not `ts_rank_cd` (cover density): about 0.4 against 10 us a row (a name in
# most turns makes a thousand rows match), and within a question of it on LoCoMo's tuning
# conversations (README, Recall). Ties go to the newer message: the same hits every time.
_POSTGRESQL = text(
    "SELECT m.pk, m.conversation_pk, m.seq, ts_rank(m.search_vector, q) AS score "
    "FROM messages m, to_tsquery('english', :query) q "
    "WHERE m.tenant_id = :tenant AND m.user_id = :user AND m.status = 'complete' "
    "AND m.search_vector @@ q "
    "AND (CAST(:conversation AS BIGINT) IS NULL OR m.conversation_pk = :conversation) "
    "ORDER BY score DESC, m.pk DESC LIMIT :limit"
)
# The hits' neighbours: one statement for every range of seq (conversation pk, first seq, last
# seq), each range an index range on (conversation, seq). SQLite reads the ranges from a JSON
# array; PostgreSQL from three arrays, whose length its planner knows (it planned a JSON
# array's elements as a hundred rows, and scanned the user's whole table for them).
_AROUND_COLUMNS = (
    "SELECT m.pk, m.conversation_pk, c.id AS conversation_id, m.seq, m.role, "
    "m.search_text AS text, m.tokens, m.created_at "
)
_AROUND_WHERE = (
    "JOIN conversations c ON c.pk = m.conversation_pk "
    "WHERE m.tenant_id = :tenant AND m.user_id = :user AND m.status = 'complete' "
    "AND m.search_text IS NOT NULL AND m.tokens <= :max_tokens "
    "ORDER BY m.conversation_pk, m.seq"
)
_AROUND_SQLITE = text(
    _AROUND_COLUMNS + "FROM json_each(:ranges) r JOIN messages m "
    "ON m.conversation_pk = json_extract(r.value, '$[0]') "
    "AND m.seq BETWEEN json_extract(r.value, '$[1]') AND json_extract(r.value, '$[2]') "
    + _AROUND_WHERE
).columns(created_at=M.c.created_at.type)
_AROUND_POSTGRESQL = text(
    _AROUND_COLUMNS + "FROM unnest(CAST(:conversations AS BIGINT[]), CAST(:firsts AS INTEGER[]), "
    "CAST(:lasts AS INTEGER[])) AS r(conversation_pk, first_seq, last_seq) JOIN messages m "
    "ON m.conversation_pk = r.conversation_pk AND m.seq BETWEEN r.first_seq AND r.last_seq "
    + _AROUND_WHERE
).columns(created_at=M.c.created_at.type)


class MessageSearch:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def search(
        self,
        tenant_id: str,
        user_id: str,
        terms: Sequence[str],
        *,
        limit: int = 50,
        conversation_pk: int | None = None,
    ) -> list[Hit]:
        """The user's messages that match any of `terms`, best first."""
        words = [t for t in terms if _TERM.match(t)]
        if not words:
            return []
        if self.conn.dialect.name == "postgresql":
            return self._hits(
                _POSTGRESQL, " | ".join(words), tenant_id, user_id, limit, conversation_pk
            )
        scope = scope_token(tenant_id, user_id)
        if conversation_pk is not None:
            query = _sqlite_query(scope, words)
            return self._hits(
                _SQLITE_IN_CONVERSATION, query, tenant_id, user_id, limit, conversation_pk
            )
        found = self._ranked_without_frequent(scope, words, tenant_id, user_id, limit)
        if found is not None:
            return found
        return self._hits(_SQLITE, _sqlite_query(scope, words), tenant_id, user_id, limit)

    def _ranked_without_frequent(
        self, scope: str, words: Sequence[str], tenant_id: str, user_id: str, limit: int
    ) -> list[Hit] | None:
        """The SQLite search ranking only the rows that hold a word that is not frequent
        (`FREQUENT_SHARE`), the frequent words still scored where they occur: the same hits,
        and faster, when the last of them scores more than a row holding only frequent words
        could (bm25's bound, from the words' idf); None when that is not so, or there is no
        word of each kind, and the whole search is needed."""
        if len(words) < 2:
            return None  # (no word of each kind: not worth counting)
        holding = self._rows_holding(words)
        indexed = self.conn.execute(_INDEXED_ROWS_AT_MOST).scalar_one()
        cut = max(FREQUENT_ROWS, FREQUENT_SHARE * indexed)
        frequent = [w for w in words if holding[w] > cut]
        rare = [w for w in words if 0 < holding[w] <= cut]
        if not frequent or not rare:
            return None
        scored = " OR ".join(f'search_text : "{w}"' for w in frequent)
        query = f'{_sqlite_query(scope, rare)} AND ({scored} OR search_scope : "{scope}")'
        hits = self._hits(_SQLITE, query, tenant_id, user_id, limit)
        # An upper bound of what bm25 computes: more rows than it counts, fewer holding a word.
        ceiling = sum(_BM25_MOST_PER_IDF * _idf(indexed, holding[w]) for w in frequent)
        if len(hits) == limit and hits[-1].score > ceiling:
            return hits
        return None

    def _rows_holding(self, words: Sequence[str]) -> dict[str, int]:
        """How many rows of the index (every user's) hold each of `words`, as bm25 counts
        them (as it does for each word of every search)."""
        statement = text(
            " UNION ALL ".join(
                f"SELECT {i} AS i, count(*) AS n FROM messages_fts WHERE messages_fts MATCH :w{i}"
                for i in range(len(words))
            )
        )
        rows = self.conn.execute(
            statement,
            {f"w{i}": f'search_text : "{w}"' for i, w in enumerate(words)},
        )
        return {words[i]: n for i, n in rows}

    def _hits(
        self,
        statement: TextClause,
        query: str,
        tenant_id: str,
        user_id: str,
        limit: int,
        conversation_pk: int | None = None,
    ) -> list[Hit]:
        rows = self.conn.execute(
            statement,
            {
                "query": query,
                "tenant": tenant_id,
                "user": user_id,
                "conversation": conversation_pk,
                "limit": limit,
            },
        )
        return [Hit(r.pk, r.conversation_pk, r.seq, float(r.score)) for r in rows]

    def around(
        self,
        tenant_id: str,
        user_id: str,
        hits: Sequence[Hit],
        radius: int = 1,
        *,
        further_after: int = 1,
        max_tokens: int = 2**31 - 1,
        wide: Sequence[Hit] = (),
        wide_radius: int = 0,
    ) -> list[Found]:
        """The hits' messages and their neighbours (`radius` messages either side and
        `further_after` more after, same conversation; the `wide` hits' `wide_radius` either
        side), in conversation order; none larger than `max_tokens`."""
        if not hits and not wide:
            return []
        # Ranges of seq per conversation, merged: each an index range on (conversation, seq).
        ranges: list[tuple[int, int, int]] = []
        for conversation, first, last in sorted(
            [(h.conversation_pk, h.seq - radius, h.seq + radius + further_after) for h in hits]
            + [(h.conversation_pk, h.seq - wide_radius, h.seq + wide_radius) for h in wide]
        ):
            if ranges and ranges[-1][0] == conversation and first <= ranges[-1][2] + 1:
                ranges[-1] = (conversation, ranges[-1][1], max(last, ranges[-1][2]))
            else:
                ranges.append((conversation, first, last))
        scope = {"tenant": tenant_id, "user": user_id, "max_tokens": max_tokens}
        if self.conn.dialect.name == "postgresql":
            conversations, firsts, lasts = zip(*ranges, strict=True)
            rows = self.conn.execute(
                _AROUND_POSTGRESQL,
                {**scope, "conversations": conversations, "firsts": firsts, "lasts": lasts},
            )
        else:
            rows = self.conn.execute(_AROUND_SQLITE, {**scope, "ranges": json.dumps(ranges)})
        return [
            Found(pk, conversation_pk, conversation_id, seq, role, found, tokens, utc(created_at))
            for pk, conversation_pk, conversation_id, seq, role, found, tokens, created_at in rows
        ]


def _sqlite_query(scope: str, words: Sequence[str]) -> str:
    """An FTS5 query for the rows of one user (`scope_token`) that hold any of `words`."""
    either = " OR ".join(f'"{w}"' for w in words)
    return f'search_scope : "{scope}" AND search_text : ({either})'


def _idf(rows: int, holding: int) -> float:
    """FTS5's bm25 idf of a word `holding` of `rows` rows hold."""
    return max(1e-6, math.log((rows - holding + 0.5) / (holding + 0.5)))
