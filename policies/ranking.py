"""Which rows of a user's a full-text search ranks: pure decisions from word counts.

Ranking a row costs a few microseconds (SQLite's bm25, PostgreSQL's `ts_rank`), and a user
who says a name in every turn has thousands of rows holding it. A search ranks the rows
holding the question's rarest words, as many as a bound together (`rarest`), the other words
scored only where those rows hold them; the rows of the other words alone are ranked only
when those make fewer hits than asked for (storage/repositories/search.py).
"""

from __future__ import annotations

from collections.abc import Mapping


def rarest(holding: Mapping[str, int], most: int) -> list[str]:
    """The rarest of the words (`holding`: how many rows hold each) held by `most` rows
    together at most (the rarest one, however many hold it), rarest first."""
    chosen: list[str] = []
    total = 0
    for word, n in sorted(holding.items(), key=lambda item: item[1]):
        total += n
        if chosen and total > most:
            break
        chosen.append(word)
    return chosen


def held_by_few(holding: Mapping[str, int], words: list[str], most: int) -> bool:
    """Whether `words` are held by `most` rows together at most (counting a row once for each
    of its words: more than it is ranked)."""
    return sum(holding.get(w, 0) for w in words) <= most
