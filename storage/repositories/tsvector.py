"""PostgreSQL's full-text search statements (the stored English tsvector of `search_text`,
`search_vector`, and each user's word counts, `message_words`: migrations 0017 and 0018), for
storage/repositories/search.py, as fts5.py holds SQLite's: counting the question's words,
ranking the rows holding them, and the weights and queries they take."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from sqlalchemy import TextClause, text

# PostgreSQL ranks a row by each of the question's words apart, weighted by bm25's idf over
# the user's own rows (their counts: `message_words`, migration 0018), since `ts_rank` knows
# nothing of how many rows hold a word: `ts_rank` of one word is its term frequency,
# saturating. The sum is divided by what `ts_rank`'s length normalisation (its option 1)
# divides by, once per row, with the row's distinct words (`length`, kept in the tsvector) for
# its words (which `ts_rank` counts again on every call). The stored tsvector (migration 0017)
# is ranked, not the text parsed again; ties go to the newer message: the same hits every time.
USER_WORDS = text(
    "SELECT l.word, coalesce(w.messages, 0) AS messages "
    "FROM unnest(tsvector_to_array(to_tsvector('english', :words))) AS l(word) "
    "LEFT JOIN message_words w "
    "ON w.tenant_id = :tenant AND w.user_id = :user AND w.word = l.word "
    "UNION ALL SELECT '', messages FROM message_words "
    "WHERE tenant_id = :tenant AND user_id = :user AND word = ''"
)
_LOG2_LENGTH = "(ln(CAST(length(m.search_vector) AS FLOAT8) + 1) / ln(2.0))"
# A search within one conversation (the anonymous user's, who has no counts kept) counts the
# conversation's rows instead, when it searches.
CONVERSATION_WORDS = text(
    "SELECT l.word, (SELECT count(*) FROM messages m "
    "WHERE m.conversation_pk = :conversation AND m.tenant_id = :tenant "
    "AND m.user_id = :user AND m.search_text IS NOT NULL "
    "AND tsvector_to_array(m.search_vector) @> ARRAY[l.word]) AS messages "
    "FROM unnest(tsvector_to_array(to_tsvector('english', :words))) AS l(word) "
    "UNION ALL SELECT '', count(*) FROM messages WHERE conversation_pk = :conversation "
    "AND tenant_id = :tenant AND user_id = :user AND search_text IS NOT NULL"
)
ERASE_WORDS = text("DELETE FROM message_words WHERE tenant_id = :tenant AND user_id = :user")
# A named user's words counted (`USER_WORDS`) and their rows ranked in one statement (one
# round trip rather than two), for a search that needs no narrowing (`rarest`): the weights
# as `MessageSearch._postgresql` computes them (each word's idf over the user's rows, or 1
# where no rows are counted), each word's `ts_rank` weighted and summed in the words' order,
# as `ranked` sums them. A search whose words are held by more than `:most` rows
# together ranks nothing here and answers one row of NULLs instead: the caller then narrows
# it as before.
FOLDED = text(
    """
WITH listed AS (
  SELECT l.word, l.i, coalesce(w.messages, 0) AS n
  FROM unnest(tsvector_to_array(to_tsvector('english', :words))) WITH ORDINALITY AS l(word, i)
  LEFT JOIN message_words w ON w.tenant_id = :tenant AND w.user_id = :user AND w.word = l.word
), total AS (
  SELECT coalesce((SELECT messages FROM message_words
    WHERE tenant_id = :tenant AND user_id = :user AND word = ''), 0) AS n
), holding AS (
  SELECT l.word, l.i, l.n FROM listed l, total t WHERE t.n = 0 OR l.n > 0
), weighted AS (
  SELECT h.i,
    CASE WHEN t.n = 0 THEN CAST(1 AS FLOAT8) ELSE greatest(CAST(1e-6 AS FLOAT8), ln(
      (CAST(greatest(t.n, (SELECT max(n) FROM holding)) - h.n AS FLOAT8) + CAST(0.5 AS FLOAT8))
      / (CAST(h.n AS FLOAT8) + CAST(0.5 AS FLOAT8)))) END AS weight,
    CAST('''' || replace(replace(h.word, '\\', '\\\\'), '''', '''''') || '''' AS tsquery) AS q
  FROM holding h, total t
), gate AS (
  SELECT count(*) AS words, (SELECT coalesce(sum(n), 0) FROM holding) AS held,
    CAST(string_agg(CAST(q AS TEXT), ' | ' ORDER BY i) AS tsquery) AS match
  FROM weighted
)
(SELECT m.pk, m.conversation_pk, m.seq,
  (SELECT sum(w.weight * ts_rank(m.search_vector, w.q) ORDER BY w.i) FROM weighted w)
  / """
    + _LOG2_LENGTH
    + """ AS score
FROM messages m, gate g
WHERE g.words > 0 AND (g.words = 1 OR g.held <= :most)
  AND m.tenant_id = :tenant AND m.user_id = :user AND m.status = 'complete'
  AND m.search_vector @@ g.match
ORDER BY score DESC, m.pk DESC LIMIT :limit)
UNION ALL
SELECT NULL, NULL, NULL, NULL FROM gate WHERE words > 1 AND held > :most
"""
)


@lru_cache(maxsize=64)
def ranked(words: int) -> TextClause:
    """The PostgreSQL search for a question of `words` words (`:q0`... each one's tsquery,
    `:w0`... its weight), ranking the rows that match `:match`."""
    score = " + ".join(
        f"CAST(:w{i} AS FLOAT8) * ts_rank(m.search_vector, CAST(:q{i} AS tsquery))"
        for i in range(words)
    )
    return text(
        f"SELECT m.pk, m.conversation_pk, m.seq, ({score}) / {_LOG2_LENGTH} AS score "
        "FROM messages m "
        "WHERE m.tenant_id = :tenant AND m.user_id = :user AND m.status = 'complete' "
        "AND m.search_vector @@ CAST(:match AS tsquery) "
        "AND (CAST(:conversation AS BIGINT) IS NULL OR m.conversation_pk = :conversation) "
        "ORDER BY score DESC, m.pk DESC LIMIT :limit"
    )


def tsquery(lexemes: Sequence[str]) -> str:
    """A tsquery matching any of `lexemes` (already the English configuration's)."""
    return " | ".join("'" + w.replace("\\", "\\\\").replace("'", "''") + "'" for w in lexemes)


def idf(rows: int, holding: int) -> float:
    """FTS5's bm25 idf of a word `holding` of `rows` rows hold."""
    return max(1e-6, math.log((rows - holding + 0.5) / (holding + 0.5)))
