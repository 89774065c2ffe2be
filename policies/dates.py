"""The time a question is about, when it names one: "in May 2023", "on 1 February, 2023",
"summer 2021", "in July", "last year", "yesterday". With embeddings on, recall favours the
hits said then (`favour_period`).

Only what is unambiguous is read: a month without its year holds in any year; a bare day
number is not a date; "may" is a month only beside a day or a year, or after "in", "of",
"during", "since", "until", "early", "late", "mid"; "three years ago" is left alone (when a
thing happened, not when it was told). Relative times are taken from `now`, the time of asking.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

MONTHS = {
    name: number
    for number, names in enumerate(
        (
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sep", "sept"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ),
        1,
    )
    for name in names
}
SEASONS = {"spring": (3, 3), "summer": (6, 3), "autumn": (9, 3), "fall": (9, 3), "winter": (12, 3)}
# What a hit said in the period the question names adds to its score (a share of it). Measured
# on LoCoMo's tuning conversations (0.5-2 alike; without it, one or two questions fewer at each
# budget, three at 2,000 before turns were weighed by meaning).
PERIOD_BOOST = 1.0
# Earliest and latest year read as a year (a bare number outside is a count, not a date).
YEARS = (1900, 2100)

_MONTH = "|".join(sorted(MONTHS, key=len, reverse=True))
_YEAR = r"(?:19|20)\d\d"
_DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?"
_DAY_MONTH_YEAR = re.compile(rf"\b({_DAY})\s+(?:of\s+)?({_MONTH})\.?,?\s+({_YEAR})\b")
_MONTH_DAY_YEAR = re.compile(rf"\b({_MONTH})\.?\s+({_DAY}),?\s+({_YEAR})\b")
_MONTH_YEAR = re.compile(rf"\b({_MONTH})\.?,?\s+(?:of\s+)?({_YEAR})\b")
_SEASON_YEAR = re.compile(rf"\b({'|'.join(SEASONS)})\s+(?:of\s+)?({_YEAR})\b")
_MONTH_ALONE = re.compile(rf"\b(?:(?:in|of|during|since|until|early|late|mid)\s+|mid-)({_MONTH})\b")
_YEAR_ALONE = re.compile(rf"\b(?:in|of|during|since|until|year)\s+({_YEAR})\b")
_LAST = re.compile(r"\b(yesterday|last\s+(?:week|weekend|month|year)|this\s+(?:month|year))\b")


@dataclass(frozen=True, slots=True)
class Period:
    """From `start` until before `end` (UTC); with `month` set, that month in any year (a
    month named without its year), `start` and `end` unused."""

    start: datetime
    end: datetime
    month: int | None = None
    relative: bool = False  # said relative to the time of asking ("last week")

    def holds(self, when: datetime) -> bool:
        if self.month is not None:
            return when.month == self.month
        return self.start <= when < self.end


def _month_span(year: int, month: int, months: int = 1) -> tuple[datetime, datetime]:
    start = datetime(year, month, 1, tzinfo=UTC)
    month += months
    year, month = year + (month - 1) // 12, (month - 1) % 12 + 1
    return start, datetime(year, month, 1, tzinfo=UTC)


def _day(year: str, month: str, day: str) -> Period | None:
    try:
        start = datetime(int(year), MONTHS[month], int(day.rstrip("stndrh")), tzinfo=UTC)
    except ValueError:
        return None  # the 31st of a shorter month
    return Period(start, start + timedelta(days=1))


def asked_period(text: str, now: datetime) -> Period | None:
    """The first time `text` names (a day, a month, a season, a year, or one said relative to
    `now`), or None."""
    lowered = " ".join(text.lower().split())
    found: list[tuple[int, Period]] = []
    for pattern, read in _READERS:
        for match in pattern.finditer(lowered):
            period = read(match, now)
            if period is not None:
                found.append((match.start(), period))
                break
    if not found:
        return None
    # A date named outright anchors a relative one ("the weekend before 10 April, 2023").
    found = [f for f in found if not f[1].relative] or found
    # The most precise reading of the earliest date named: "1 May, 2023" over "May 2023".
    first = min(position for position, _ in found)
    near = [p for position, p in found if position <= first + 12]
    return min(near, key=lambda p: (p.month is not None, p.end - p.start))


_Reader = Callable[[re.Match[str], datetime], "Period | None"]
# What each way of naming a time means, most precise first.
_READERS: tuple[tuple[re.Pattern[str], _Reader], ...] = (
    (_DAY_MONTH_YEAR, lambda m, now: _day(m[3], m[2], m[1])),
    (_MONTH_DAY_YEAR, lambda m, now: _day(m[3], m[1], m[2])),
    (_MONTH_YEAR, lambda m, now: Period(*_month_span(int(m[2]), MONTHS[m[1]]))),
    (_SEASON_YEAR, lambda m, now: Period(*_month_span(int(m[2]), *SEASONS[m[1]]))),
    (_MONTH_ALONE, lambda m, now: Period(now, now, MONTHS[m[1]])),
    (_YEAR_ALONE, lambda m, now: _year(int(m[1]))),
    (_LAST, lambda m, now: replace(_relative(m[1], now), relative=True)),
)


def _year(year: int) -> Period | None:
    if not YEARS[0] <= year <= YEARS[1]:
        return None
    return Period(datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC))


def _relative(said: str, now: datetime) -> Period:
    said = " ".join(said.split())
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if said == "yesterday":
        return Period(today - timedelta(days=1), today)
    if said in ("last week", "last weekend"):
        return Period(today - timedelta(days=today.weekday() + 7), today)
    if said == "last month":
        end = today.replace(day=1)
        return Period((end - timedelta(days=1)).replace(day=1), end)
    if said == "this month":
        return Period(today.replace(day=1), today + timedelta(days=1))
    if said == "last year":
        return _year(now.year - 1) or Period(now, now)
    return _year(now.year) or Period(now, now)  # this year


def favour_period(
    scores: Mapping[int, float], said: Mapping[int, datetime], period: Period | None
) -> dict[int, float]:
    """`scores` (pk -> score) with those of the messages said in `period` (`said`: pk -> when)
    `PERIOD_BOOST` higher."""
    if period is None:
        return dict(scores)
    return {
        pk: score * (1 + PERIOD_BOOST) if pk in said and period.holds(said[pk]) else score
        for pk, score in scores.items()
    }
