"""Which words' rows a full-text search ranks (policies/ranking.py)."""

from __future__ import annotations

from policies.ranking import held_by_few, rarest


def test_the_rarest_words_are_chosen_until_their_rows_pass_the_bound() -> None:
    holding = {"zed": 900, "kayak": 30, "glacier": 5, "trip": 400}
    assert rarest(holding, 1_000) == ["glacier", "kayak", "trip"]
    assert rarest(holding, 35) == ["glacier", "kayak"]
    assert rarest(holding, 2_000) == ["glacier", "kayak", "trip", "zed"]


def test_the_rarest_word_is_chosen_however_many_rows_hold_it() -> None:
    assert rarest({"zed": 900, "name": 5_000}, 100) == ["zed"]
    assert rarest({}, 100) == []


def test_words_are_held_by_few_rows_counting_each_word_of_a_row() -> None:
    holding = {"kayak": 30, "glacier": 5}
    assert held_by_few(holding, ["kayak", "glacier"], 35)
    assert not held_by_few(holding, ["kayak", "glacier"], 34)
    assert held_by_few(holding, ["unknown"], 0)
