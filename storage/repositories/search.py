"""Full-text search over a user's stored messages, in the database itself.

SQLite: FTS5 with BM25 ranking (`messages_fts`, porter stemming); PostgreSQL: the English
tsvector of `search_text`, stored (`search_vector`, generated) and GIN-indexed, ranked with
`ts_rank`, with each user's word counts (`message_words`). All are kept in sync with the
messages (migrations 0004, 0017 and 0018): an edit or a delete changes what is found at once.

Every search takes the tenant and the user; `conversation_pk` narrows it to one conversation
(what an anonymous user gets). The query is a set of plain terms (letters and digits only),
ORed: any of them may match, and the ranking rewards the rows that hold more of them, and
rarer ones (bm25's idf: SQLite counts over its whole index, PostgreSQL over the user's rows).
Each database's statements are in a module of their own: fts5.py and tsvector.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, TextClause, text

from policies.ranking import held_by_few, rarest
from storage.models import CONVERSATIONS, MESSAGES
from storage.repositories import fts5, tsvector
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


# A named user's search ranks only the rows holding the question's rarest words, as many as
# RANKED_ROWS of theirs together (`rarest`, policies/ranking.py), unless those make fewer hits
# than asked for: a row costs a few microseconds to match and rank, and a user who says a
# name in every turn has thousands of rows holding it.
RANKED_ROWS = 1_000


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
            return self._postgresql(words, tenant_id, user_id, limit, conversation_pk)
        scope = scope_token(tenant_id, user_id)
        if conversation_pk is not None:
            query = fts5.scoped_query(scope, words)
            return self._hits(fts5.RANKED, query, tenant_id, user_id, limit, conversation_pk)
        return self._named(scope, words, tenant_id, user_id, limit)

    def _named(
        self, scope: str, words: Sequence[str], tenant_id: str, user_id: str, limit: int
    ) -> list[Hit]:
        """The SQLite search of a named user: the rows holding the `rarest` of their words
        ranked, RANKED_ROWS of theirs at most, then the whole search if those make fewer hits
        than `limit`; the rows of every user ranked instead of naming the user's scope token
        wherever the index holds RANKED_ROWS of them at most."""
        # Counted as far as one more than RANKED_ROWS: each choice below is the same as with
        # every count exact, but for which word is the rarest when all are counted that far.
        every, own = self._rows_holding(words, scope, RANKED_ROWS + 1)
        if not own:
            return []
        if held_by_few(every, list(own), RANKED_ROWS):
            return self._ranked(list(own), [], None, tenant_id, user_id, limit)
        if min(own.values()) > RANKED_ROWS:
            every, own = self._rows_holding(words, scope)
        chosen = rarest(own, RANKED_ROWS)
        # (Rows that hold them fewer than `limit`: fewer hits than asked for, certainly.)
        if len(chosen) < len(own) and not held_by_few(own, chosen, limit - 1):
            others = [w for w in own if w not in chosen]
            narrow = None if held_by_few(every, chosen, RANKED_ROWS) else scope
            hits = self._ranked(chosen, others, narrow, tenant_id, user_id, limit)
            if len(hits) == limit:
                return hits
        return self._hits(
            fts5.WHOLE, fts5.scoped_query(scope, list(own)), tenant_id, user_id, limit
        )

    def _ranked(
        self,
        words: list[str],
        others: list[str],
        scope: str | None,
        tenant_id: str,
        user_id: str,
        limit: int,
    ) -> list[Hit]:
        """The user's best `limit` rows of those that hold any of `words` (the user's alone,
        with their `scope` token), scored for `others` too where they hold them, as the whole
        search scores them."""
        rare = fts5.words_query(words) if scope is None else fts5.scoped_query(scope, words)
        if not others:
            return self._hits(fts5.RANKED, rare, tenant_id, user_id, limit)
        # A row's score in the first search counts `words` only: the rows holding any of
        # `others` too are scored again with every word (bm25 sums over the query's phrases,
        # each one's idf counted over the whole index, the scope token's weighing nothing:
        # what the whole search gives them). A row holding `words` only that ranks in the best
        # `limit` is in the first, with its whole score: no row scores less there.
        rows = self.conn.execute(
            fts5.RANKED_TWICE,
            {
                "query": rare,
                "also": f"{rare} AND {fts5.words_query(others)}",
                "tenant": tenant_id,
                "user": user_id,
                "conversation": None,
                "limit": limit,
            },
        )
        best: dict[int, Hit] = {}
        for r in rows:  # (a row in both: its score with every word, the higher)
            if r.pk not in best or r.score > best[r.pk].score:
                best[r.pk] = Hit(r.pk, r.conversation_pk, r.seq, float(r.score))
        return sorted(best.values(), key=lambda h: (-h.score, h.pk))[:limit]

    def delete_user(self, tenant_id: str, user_id: str) -> None:
        """PostgreSQL: the user's word counts, once their messages are deleted (their
        triggers already took each message's words away; this leaves nothing, whatever
        wrote the table by other means)."""
        if self.conn.dialect.name == "postgresql":
            self.conn.execute(tsvector.ERASE_WORDS, {"tenant": tenant_id, "user": user_id})

    def _postgresql(
        self,
        words: Sequence[str],
        tenant_id: str,
        user_id: str,
        limit: int,
        conversation_pk: int | None,
    ) -> list[Hit]:
        """The PostgreSQL search: each word's `ts_rank` weighted by its idf over the user's
        rows, the rows holding the `rarest` words ranked first, the others only when those
        are not enough."""
        if conversation_pk is None:
            ranked = self.conn.execute(
                tsvector.FOLDED,
                {
                    "words": " ".join(words),
                    "tenant": tenant_id,
                    "user": user_id,
                    "most": RANKED_ROWS,
                    "limit": limit,
                },
            ).all()
            if not ranked or ranked[0].pk is not None:
                return [Hit(r.pk, r.conversation_pk, r.seq, float(r.score)) for r in ranked]
            # (held by more than RANKED_ROWS rows: narrowed as below)
        counting = tsvector.USER_WORDS if conversation_pk is None else tsvector.CONVERSATION_WORDS
        found = self.conn.execute(
            counting,
            {
                "words": " ".join(words),
                "tenant": tenant_id,
                "user": user_id,
                "conversation": conversation_pk,
            },
        )
        counts = {word: n for word, n in found}
        rows = counts.pop("", 0)
        if rows == 0:  # none stored, or no counts kept (their triggers off): no weights
            holding, weights = counts, dict.fromkeys(counts, 1.0)
        else:
            holding = {w: n for w, n in counts.items() if n > 0}
            rows = max(rows, *holding.values(), 0)  # (a count can only be off by hand)
            weights = {w: tsvector.idf(rows, n) for w, n in holding.items()}
        if not holding:
            return []
        scope: dict[str, Any] = {
            "tenant": tenant_id,
            "user": user_id,
            "conversation": conversation_pk,
            "limit": limit,
        }
        for i, (word, weight) in enumerate(weights.items()):
            scope[f"q{i}"], scope[f"w{i}"] = tsvector.tsquery([word]), weight
        statement = tsvector.ranked(len(weights))
        chosen = rarest(holding, RANKED_ROWS)
        if len(chosen) < len(holding):
            hits = self._scored(statement, {**scope, "match": tsvector.tsquery(chosen)})
            if len(hits) == limit:
                return hits
        return self._scored(statement, {**scope, "match": tsvector.tsquery(list(holding))})

    def _scored(self, statement: TextClause, parameters: dict[str, Any]) -> list[Hit]:
        rows = self.conn.execute(statement, parameters)
        return [Hit(r.pk, r.conversation_pk, r.seq, float(r.score)) for r in rows]

    def _rows_holding(
        self, words: Sequence[str], scope: str, most: int = -1
    ) -> tuple[dict[str, int], dict[str, int]]:
        """How many rows of the index hold each of `words`: every user's (as bm25 counts them
        for each word of every search), and the user's (with their `scope` token); `most` at
        most (-1: all)."""
        rows = self.conn.execute(
            fts5.counting(len(words)),
            {f"w{i}": f'search_text : "{w}"' for i, w in enumerate(words)}
            | {
                f"s{i}": f'search_scope : "{scope}" AND search_text : "{w}"'
                for i, w in enumerate(words)
            }
            | {"most": most},
        )
        every: dict[str, int] = {}
        own: dict[str, int] = {}
        for i, theirs, n in rows:
            if n > 0:
                (own if theirs else every)[words[i]] = n
        return every, own

    def _hits(
        self,
        statement: TextClause,
        query: str,
        tenant_id: str,
        user_id: str,
        limit: int,
        conversation_pk: int | None = None,
    ) -> list[Hit]:
        return self._scored(
            statement,
            {
                "query": query,
                "tenant": tenant_id,
                "user": user_id,
                "conversation": conversation_pk,
                "limit": limit,
            },
        )

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
