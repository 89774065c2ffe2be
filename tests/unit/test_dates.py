"""The time a question names, and the hits said then (policies/dates.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from policies.dates import PERIOD_BOOST, Period, asked_period, favour_period

NOW = datetime(2026, 3, 18, 15, 30, tzinfo=UTC)  # a Wednesday


def day(year: int, month: int, d: int) -> datetime:
    return datetime(year, month, d, tzinfo=UTC)


@pytest.mark.parametrize(
    ("question", "start", "end"),
    [
        ("What did Gina find for her store on 1 February, 2023?", day(2023, 2, 1), day(2023, 2, 2)),
        ("Who did Maria have dinner with on May 3, 2023?", day(2023, 5, 3), day(2023, 5, 4)),
        ("What did I say on the 3rd of June 2023?", day(2023, 6, 3), day(2023, 6, 4)),
        ("What setback did Melanie face in October 2023?", day(2023, 10, 1), day(2023, 11, 1)),
        ("What happened in December 2023?", day(2023, 12, 1), day(2024, 1, 1)),
        ("What state did Joanna visit in summer 2021?", day(2021, 6, 1), day(2021, 9, 1)),
        ("What did we do in winter 2022?", day(2022, 12, 1), day(2023, 3, 1)),
        ("How many times has Melanie gone to the beach in 2023?", day(2023, 1, 1), day(2024, 1, 1)),
        ("Where did I travel last year?", day(2025, 1, 1), day(2026, 1, 1)),
        ("What did I cook yesterday?", day(2026, 3, 17), day(2026, 3, 18)),
        ("What did I read last month?", day(2026, 2, 1), day(2026, 3, 1)),
        ("What did we talk about last week?", day(2026, 3, 9), day(2026, 3, 18)),
    ],
)
def test_a_named_day_month_season_year_or_relative_time_is_read(
    question: str, start: datetime, end: datetime
) -> None:
    period = asked_period(question, NOW)
    assert period is not None
    assert (period.start, period.end, period.month) == (start, end, None)


def test_a_month_without_its_year_holds_in_any_year() -> None:
    period = asked_period("When did Melanie go camping in June?", NOW)
    assert period is not None and period.month == 6
    assert period.holds(day(2019, 6, 30)) and period.holds(day(2023, 6, 1))
    assert not period.holds(day(2023, 7, 1))
    assert asked_period("Where did we go mid-May?", NOW) == Period(NOW, NOW, 5)


def test_a_date_named_outright_wins_over_a_relative_one() -> None:
    # "last weekend" is relative to 10 April 2023 here, not to the time of asking.
    period = asked_period("What did Maria do last weekend before April 10, 2023?", NOW)
    assert period == Period(day(2023, 4, 10), day(2023, 4, 11))


def test_the_most_precise_reading_of_one_date_is_taken() -> None:
    assert asked_period("on 16 June, 2023", NOW) == Period(day(2023, 6, 16), day(2023, 6, 17))
    # Of two dates, the first named.
    period = asked_period("What did I do on 3 May 2023, and on 9 May 2023?", NOW)
    assert period == Period(day(2023, 5, 3), day(2023, 5, 4))


@pytest.mark.parametrize(
    "question",
    [
        "What may I have said about my sister?",  # the verb
        "May I ask where we left the car?",
        "Where did Caroline move from 4 years ago?",  # when it happened, not when it was told
        "What did I score, 31 out of 40?",
        "Which of my 2000 photos did I like?",
        "What is the capital of France?",
    ],
)
def test_what_is_not_a_time_is_not_read_as_one(question: str) -> None:
    assert asked_period(question, NOW) is None


def test_a_day_that_does_not_exist_leaves_its_month() -> None:
    period = asked_period("What happened on 31 February, 2023?", NOW)
    assert period == Period(day(2023, 2, 1), day(2023, 3, 1))


def test_the_hits_said_in_the_period_count_more() -> None:
    scores = {1: 4.0, 2: 2.0, 3: 1.0}
    said = {1: day(2023, 4, 2), 2: day(2023, 5, 9), 3: day(2023, 5, 31)}
    favoured = favour_period(scores, said, Period(day(2023, 5, 1), day(2023, 6, 1)))
    assert favoured == {1: 4.0, 2: 2.0 * (1 + PERIOD_BOOST), 3: 1.0 * (1 + PERIOD_BOOST)}
    # No period named, or a hit whose time is unknown: unchanged.
    assert favour_period(scores, said, None) == scores
    assert favour_period(scores, {}, Period(day(2023, 5, 1), day(2023, 6, 1))) == scores
