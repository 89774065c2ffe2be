"""Which stored memories matter for a text: the user's turn (to attach them) or an exchange (to
show the extraction model the ones it may update). Memories are short, so a word match decides:
each query word a memory contains counts, rarer words (among the candidates) count more, and a
long memory gets less per word; a light stemmer lets "hiking" find "hikes". With embeddings, a
memory near the turn in meaning counts too, its similarity fused with the word score."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

from policies.fusion import hybrid_scores

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


def _word_scores(terms: Sequence[str], texts: Sequence[str]) -> dict[int, float]:
    """The score of each text (by index) that shares a word with `terms`."""
    wanted = {stem(t) for t in terms}
    if not wanted:
        return {}
    words = [stems(text) & wanted for text in texts]
    df = {w: sum(w in found for found in words) for w in wanted}
    n = len(texts)
    scores: dict[int, float] = {}
    for index, (text, found) in enumerate(zip(texts, words, strict=True)):
        if not found:
            continue
        weight = sum(math.log(1 + n / df[w]) for w in found)
        length = max(1, len(_WORD.findall(text)))
        scores[index] = weight / math.sqrt(length)
    return scores


def rank_memories(terms: Sequence[str], candidates: Sequence[tuple[T, str]]) -> list[T]:
    """The candidates (key, text) that share a word with `terms`, best first (the earlier
    candidate first among equals)."""
    scores = _word_scores(terms, [text for _, text in candidates])
    order = sorted(scores, key=lambda index: (-scores[index], index))
    return [candidates[index][0] for index in order]


def rank_by_words_and_meaning(
    terms: Sequence[str],
    candidates: Sequence[tuple[int, str]],
    similarity: Mapping[int, float],
    *,
    weight: float,
) -> list[int]:
    """The candidates (pk, text) that share a word with `terms` or are near the question in
    meaning (`similarity`: pk -> cosine, of those that count as near), best first: the word
    score and the similarity fused as recall fuses them (policies/fusion.py), the earlier
    candidate first among equals. Without similarities, exactly `rank_memories`."""
    near = {pk: score for pk, score in similarity.items() if pk in {c[0] for c in candidates}}
    if not near:
        return rank_memories(terms, candidates)
    words = _word_scores(terms, [text for _, text in candidates])
    fused = hybrid_scores(
        {candidates[index][0]: score for index, score in words.items()},
        near,
        semantic_weight=weight,
    )
    place = {pk: index for index, (pk, _) in enumerate(candidates)}
    return sorted(fused, key=lambda pk: (-fused[pk], place[pk]))
