"""Hybrid recall: full-text hits and vector hits fused into one score per message.

BM25 / ts_rank and cosine similarity are on scales that do not compare, so each is first put
on the scale of its own best hit: a full-text score as a share of the best one, a similarity
as its place between the weakest and the strongest vector hit of this search (times the
vector weight). A message's fused score is the better of the two, plus `AGREEMENT` of the
other: found by both is worth more than by either alone.

This keeps the full-text scores' own spread, which `policies.recall.rank` builds on (the best
hits reach wider windows, a hit's neighbours are worth a share of it). Reciprocal rank fusion
was measured first and lost evidence on LoCoMo: ranks flatten a strong full-text hit and the
tenth weak one to nearly the same score, so the neighbour and window rules stopped telling
them apart (docs/concepts/recall.md).
"""

from __future__ import annotations

from collections.abc import Mapping

# What the weaker of a message's two normalised scores adds to the stronger.
AGREEMENT = 0.2


def normalised_similarities(semantic: Mapping[int, float], weight: float) -> dict[int, float]:
    """Cosine similarities as their place between the weakest (0) and the strongest
    (`weight`) of them; all `weight` when they are equal."""
    if not semantic:
        return {}
    low, high = min(semantic.values()), max(semantic.values())
    if high <= low:
        return {key: weight for key in semantic}
    return {key: weight * (value - low) / (high - low) for key, value in semantic.items()}


def hybrid_scores(
    lexical: Mapping[int, float],
    semantic: Mapping[int, float],
    *,
    semantic_weight: float = 1.0,
) -> dict[int, float]:
    """Full-text scores and cosine similarities (message pk -> score, higher is better) as
    one score each. Without vector hits the full-text scores come back unchanged, so recall
    with embeddings on but nothing embedded yet ranks exactly as without them."""
    if not semantic or semantic_weight <= 0:
        return dict(lexical)
    top = max(lexical.values(), default=0.0) or 1.0
    words = {key: value / top for key, value in lexical.items()}
    meaning = normalised_similarities(semantic, semantic_weight)
    fused: dict[int, float] = {}
    for key in words.keys() | meaning.keys():
        a, b = words.get(key, 0.0), meaning.get(key, 0.0)
        fused[key] = max(a, b) + AGREEMENT * min(a, b)
    return fused
