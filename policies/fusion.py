"""Hybrid recall: full-text hits and vector hits fused into one score per message.

Reciprocal rank fusion (Cormack, Clarke and Buettcher, 2009): each ranking gives a message
`weight / (k + rank)`, and a message's score is the sum over the rankings it appears in. Ranks,
not raw scores, are fused, because BM25 / ts_rank and cosine similarity are on scales that do
not compare. The result is what `policies.recall.rank` takes as its scores (higher is better).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# The usual constant: it damps the difference between the first few ranks of each list.
RRF_K = 60.0


def ranking(scores: Mapping[int, float]) -> list[int]:
    """Keys by score, best first (ties: smaller key first, so the result is deterministic)."""
    return sorted(scores, key=lambda key: (-scores[key], key))


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]],
    weights: Sequence[float] | None = None,
    *,
    k: float = RRF_K,
) -> dict[int, float]:
    """One score per key from several rankings (each best first): the sum of
    `weight / (k + rank)`, rank counted from 1. A key repeated in one ranking counts once, at
    its best rank."""
    if weights is None:
        weights = [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError("one weight per ranking")
    fused: dict[int, float] = {}
    for order, weight in zip(rankings, weights, strict=True):
        seen: set[int] = set()
        for position, key in enumerate(order, start=1):
            if key in seen:
                continue
            seen.add(key)
            fused[key] = fused.get(key, 0.0) + weight / (k + position)
    return fused


def hybrid_scores(
    lexical: Mapping[int, float],
    semantic: Mapping[int, float],
    *,
    semantic_weight: float = 1.0,
    k: float = RRF_K,
) -> dict[int, float]:
    """Full-text scores and cosine similarities (message pk -> score, higher is better)
    fused by rank. Without vector hits the full-text scores come back unchanged, so recall
    with embeddings on but nothing embedded yet ranks exactly as without them."""
    if not semantic or semantic_weight <= 0:
        return dict(lexical)
    if not lexical:
        return reciprocal_rank_fusion([ranking(semantic)], [semantic_weight], k=k)
    return reciprocal_rank_fusion(
        [ranking(lexical), ranking(semantic)], [1.0, semantic_weight], k=k
    )
