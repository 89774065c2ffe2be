"""SQLite's full-text search statements (FTS5 over `messages_fts`: migration 0004), for
storage/repositories/search.py: the FTS5 queries of a question's words, and what ranks and
counts the rows holding them."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from sqlalchemy import TextClause, text

# The query names the user's scope token, so only their postings are read and ranked; the
# best are then checked against the real tenant and user (and conversation, for anonymous).
# Both ranking statements order by the score column, not by bm25 again: SQLite computes an
# ORDER BY expression apart from a column's, and bm25 is most of a search's time (the same
# order: the score is bm25 negated, and equal ones keep the order they came in).
WHOLE = text(
    "SELECT m.pk, m.conversation_pk, m.seq, f.score FROM ("
    "SELECT rowid AS pk, -bm25(messages_fts, 1.0, 0.0) AS score FROM messages_fts "
    "WHERE messages_fts MATCH :query ORDER BY score DESC LIMIT :limit"
    ") f JOIN messages m ON m.pk = f.pk "
    "WHERE m.tenant_id = :tenant AND m.user_id = :user AND m.status = 'complete' "
    "ORDER BY f.score DESC"
)
# Most of a search's time on SQLite is bm25: for every matching row, and, for each phrase of
# the query, over every row of the index holding it (its idf): the user's scope token too, in
# every row of theirs. A named user's search ranks only the rows holding the question's
# rarest words, as many as RANKED_ROWS of theirs (`rarest`, policies/ranking.py); where the
# whole index holds that many of them at most, without the scope token (`RANKED`: every
# user's rows ranked, the user's kept by the join, before the limit): `MessageSearch._named`.
_RANKED = (
    "SELECT m.pk, m.conversation_pk, m.seq, -bm25(messages_fts, 1.0, 0.0) AS score "
    "FROM messages_fts JOIN messages m ON m.pk = messages_fts.rowid "
    "WHERE messages_fts MATCH {query} AND m.tenant_id = :tenant AND m.user_id = :user "
    "AND m.status = 'complete' "
    "AND (CAST(:conversation AS INTEGER) IS NULL OR m.conversation_pk = :conversation) "
    "ORDER BY score DESC, m.pk LIMIT :limit"
)
RANKED = text(_RANKED.format(query=":query"))
# Two searches' best in one statement, the second's rows scored with more words
# (`MessageSearch._ranked`).
RANKED_TWICE = text(
    f"SELECT * FROM ({_RANKED.format(query=':query')}) "
    f"UNION ALL SELECT * FROM ({_RANKED.format(query=':also')})"
)


@lru_cache(maxsize=64)
def counting(words: int) -> TextClause:
    """The statement counting the rows that hold each of `words` words (`:w0`... each one's
    FTS5 query) and the user's that do (`:s0`...), `:most` of each at most (-1: all): rows
    of (word, the user's, count). Counting a word reads its postings one by one: a word said
    in every turn is read as far as `:most` only."""
    return text(
        " UNION ALL ".join(
            f"SELECT {i} AS i, {own} AS own, count(*) AS n FROM (SELECT 1 FROM messages_fts "
            f"WHERE messages_fts MATCH :{kind}{i} LIMIT :most)"
            for i in range(words)
            for own, kind in ((0, "w"), (1, "s"))
        )
    )


def scoped_query(scope: str, words: Sequence[str]) -> str:
    """An FTS5 query for the rows of one user (`scope_token`) that hold any of `words`."""
    return f'search_scope : "{scope}" AND {words_query(words)}'


def words_query(words: Sequence[str]) -> str:
    """An FTS5 query for the rows (of every user) that hold any of `words`."""
    either = " OR ".join(f'"{w}"' for w in words)
    return f"search_text : ({either})"
