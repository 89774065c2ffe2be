"""Which stored memories matter for a text: the user's turn (to attach them) or an exchange (to
show the extraction model the ones it may update). Memories are short, so a word match decides:
each query word a memory contains counts, rarer words (among the candidates) count more, and a
long memory gets less per word; a light stemmer lets "hiking" find "hikes"."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")
_WORD = re.compile(r"[^\W_]+")
_SUFFIXES = ("ingly", "edly", "ing", "ied", "ies", "ed", "es", "ly", "s")
MIN_STEM = 3


def stem(word: str) -> str:
    """`word` without a common English inflection, when enough is left to mean something."""
    word = word.lower()
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= MIN_STEM:
            return word[: -len(suffix)]
    return word


def stems(text: str) -> set[str]:
    return {stem(w) for w in _WORD.findall(text)}


def rank_memories(terms: Sequence[str], candidates: Sequence[tuple[T, str]]) -> list[T]:
    """The candidates (key, text) that share a word with `terms`, best first."""
    wanted = {stem(t) for t in terms}
    if not wanted:
        return []
    words = [stems(text) & wanted for _, text in candidates]
    df = {w: sum(w in found for found in words) for w in wanted}
    n = len(candidates)
    scored: list[tuple[float, int, T]] = []
    for index, ((key, text), found) in enumerate(zip(candidates, words, strict=True)):
        if not found:
            continue
        weight = sum(math.log(1 + n / df[w]) for w in found)
        length = max(1, len(_WORD.findall(text)))
        scored.append((weight / math.sqrt(length), -index, key))
    scored.sort(reverse=True)
    return [key for _, _, key in scored]
