"""Fusion of full-text and vector hits into one score per message (policies/fusion.py)."""

from __future__ import annotations

import pytest

from policies.fusion import AGREEMENT, hybrid_scores, normalised_similarities


def test_without_vector_hits_the_full_text_scores_are_unchanged() -> None:
    lexical = {1: 7.5, 2: 3.0}
    assert hybrid_scores(lexical, {}) == lexical
    assert hybrid_scores(lexical, {3: 0.9}, semantic_weight=0) == lexical


def test_each_score_is_put_on_the_scale_of_its_own_best_hit() -> None:
    # BM25 in the tens, cosine below one: each is a share of its own list's range.
    fused = hybrid_scores({1: 40.0, 2: 10.0}, {3: 0.8, 4: 0.6, 5: 0.4})
    assert fused[1] == pytest.approx(1.0)
    assert fused[2] == pytest.approx(0.25)  # the full-text spread is kept
    assert fused[3] == pytest.approx(1.0)
    assert fused[4] == pytest.approx(0.5)
    assert fused[5] == pytest.approx(0.0)  # the weakest vector hit, and nothing else


def test_found_by_both_is_the_better_score_plus_a_share_of_the_other() -> None:
    fused = hybrid_scores({1: 40.0, 2: 10.0}, {2: 0.9, 3: 0.5, 1: 0.7})
    assert fused[2] == pytest.approx(1.0 + AGREEMENT * 0.25)
    assert fused[1] == pytest.approx(1.0 + AGREEMENT * 0.5)
    assert fused[3] == pytest.approx(0.0)
    assert sorted(fused, key=fused.__getitem__, reverse=True) == [1, 2, 3]


def test_the_vector_weight_scales_the_similarities() -> None:
    fused = hybrid_scores({1: 4.0}, {2: 0.9, 3: 0.5}, semantic_weight=0.5)
    assert fused == {1: pytest.approx(1.0), 2: pytest.approx(0.5), 3: pytest.approx(0.0)}


def test_equal_similarities_all_count_whole() -> None:
    assert normalised_similarities({7: 0.4, 8: 0.4}, 0.8) == {7: 0.8, 8: 0.8}
    assert normalised_similarities({}, 1.0) == {}
    # Vector hits alone (a question with no searchable word) rank by similarity.
    assert hybrid_scores({}, {5: 0.2, 6: 0.7}) == {5: 0.0, 6: pytest.approx(1.0)}
