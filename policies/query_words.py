"""Which of a question's words a text holds, as recall ranks its hits: each word's stem at
the start of a word of the text, with up to four more letters after it ("hiking" for
"hikes")."""

from __future__ import annotations

import re
from collections.abc import Iterable

from policies.memories import stem

# How much of a text recall reads to search for it, or to recognise it as already present.
READ_CHARS = 4_000
# A word of a text, as the pattern's word boundaries see one (see WordStems).
_WORD_RUN = re.compile(r"\w+")
_NOT_A_WORD = re.compile(r"\W")
MORE_LETTERS = 4  # letters a word may have after a query word's stem ("hiking" for "hikes")


class WordStems:
    r"""The stems of the query's words, found in a text by looking each of its words up: what
    the pattern `\b(stem|...)\w{0,4}\b` (longest stem first) finds, without compiling a
    pattern for every question. Each word's answer is kept: the texts ranked together share
    most of their words."""

    __slots__ = ("_longest", "_prefixes", "_seen", "_shortest", "_stems")

    def __init__(self, stems: set[str]) -> None:
        self._stems = stems
        self._longest = max(map(len, stems))
        # A word that does not begin as some stem does cannot hold one: most words are
        # dismissed by this one look-up.
        self._shortest = min(map(len, stems))
        self._prefixes = {s[: self._shortest] for s in stems}
        self._seen: dict[str, str | None] = {}

    def held(self, text: str) -> set[str]:
        found: set[str] = set()
        seen = self._seen
        for word in _WORD_RUN.findall(text):
            if word in seen:
                hit = seen[word]
            else:
                hit = seen[word] = self._stem_of(word)
            if hit is not None:
                found.add(hit)
        return found

    def _stem_of(self, word: str) -> str | None:
        """The longest stem `word` starts with, at most MORE_LETTERS letters shorter."""
        if word[: self._shortest] not in self._prefixes:
            return None  # (a word shorter than every stem too)
        for end in range(min(len(word), self._longest), len(word) - MORE_LETTERS - 1, -1):
            if end > 0 and word[:end] in self._stems:
                return word[:end]
        return None


def words_pattern(terms: Iterable[str]) -> WordStems | re.Pattern[str] | None:
    """What finds the query's words in a text (`held`): each one's stem at the start of a word,
    with up to four more letters after it ("hiking" for "hikes")."""
    found = sorted({stem(t) for t in terms}, key=len, reverse=True)
    if not found:
        return None
    if all(f and not _NOT_A_WORD.search(f) for f in found):
        return WordStems(set(found))
    # (a stem that is not all word characters: the pattern itself)
    return re.compile(r"\b(" + "|".join(map(re.escape, found)) + r")\w{0,4}\b")


def held(pattern: WordStems | re.Pattern[str] | None, text: str) -> set[str]:
    """The stems of the query's words that `text` holds (`pattern` from `words_pattern`)."""
    if pattern is None:
        return set()
    if isinstance(pattern, WordStems):
        return pattern.held(text[:READ_CHARS].lower())
    return {m.group(1) for m in pattern.finditer(text[:READ_CHARS].lower())}
