"""Reciprocal rank fusion of full-text and vector hits (policies/fusion.py)."""

from __future__ import annotations

import pytest

from policies.fusion import RRF_K, hybrid_scores, ranking, reciprocal_rank_fusion


def test_each_ranking_gives_weight_over_k_plus_rank() -> None:
    fused = reciprocal_rank_fusion([[10, 20], [20, 30]], k=60)
    assert fused[10] == pytest.approx(1 / 61)
    assert fused[20] == pytest.approx(1 / 62 + 1 / 61)
    assert fused[30] == pytest.approx(1 / 62)
    assert ranking(fused) == [20, 10, 30]  # found by both beats first in one


def test_weights_scale_a_ranking_and_repeats_count_once() -> None:
    fused = reciprocal_rank_fusion([[1, 1, 2], [2]], [1.0, 3.0], k=0)
    assert fused == {1: pytest.approx(1.0), 2: pytest.approx(1 / 3 + 3.0)}
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([[1]], [1.0, 2.0])


def test_ranking_orders_by_score_then_key() -> None:
    assert ranking({3: 0.5, 1: 0.5, 2: 0.9}) == [2, 1, 3]


def test_without_vector_hits_the_full_text_scores_are_unchanged() -> None:
    lexical = {1: 7.5, 2: 3.0}
    assert hybrid_scores(lexical, {}) == lexical
    assert hybrid_scores(lexical, {3: 0.9}, semantic_weight=0) == lexical


def test_hybrid_scores_fuse_ranks_not_raw_scores() -> None:
    # BM25 in the tens, cosine below one: only the order within each list matters.
    fused = hybrid_scores({1: 40.0, 2: 12.0}, {2: 0.91, 3: 0.88})
    assert ranking(fused) == [2, 1, 3]
    assert fused[1] == pytest.approx(1 / (RRF_K + 1))
    assert fused[3] == pytest.approx(1 / (RRF_K + 2))
    # Vector hits alone (a question with no searchable word) rank by similarity.
    assert ranking(hybrid_scores({}, {5: 0.2, 6: 0.7})) == [6, 5]
