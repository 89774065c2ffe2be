"""Limit windows and decisions (policies/limits.py): plain data in, plain data out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from policies.limits import (
    WindowKind,
    WindowUsage,
    decide,
    format_wait,
    retry_after,
    windows_at,
    windows_needed,
)


@dataclass(frozen=True)
class L:
    rpm: int | None = None
    tpm: int | None = None
    budget_usd_day: float | None = None
    budget_usd_month: float | None = None


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def ts(text: str) -> float:
    return at(text).timestamp()


def test_window_keys_name_the_utc_minute_day_and_month() -> None:
    w = windows_at(at("2026-11-22T02:08:59.999"))
    assert (w.minute, w.day, w.month) == (
        "minute:2026-11-22T02:08",
        "day:2026-11-22",
        "month:2026-11",
    )
    assert w.minute_ends == ts("2026-11-22T02:09:00")
    assert w.day_ends == ts("2026-11-23T00:00:00")
    assert w.month_ends == ts("2026-12-01T00:00:00")


def test_a_minute_starts_exactly_on_its_first_second() -> None:
    before, on = windows_at(at("2026-11-22T02:08:59.999999")), windows_at(at("2026-11-22T02:09:00"))
    assert before.minute == "minute:2026-11-22T02:08"
    assert on.minute == "minute:2026-11-22T02:09"


def test_windows_of_another_time_zone_are_utc() -> None:
    local = datetime.fromisoformat("2026-11-22T01:30:00+05:00")  # 2026-11-21T20:30 UTC
    assert windows_at(local).day == "day:2026-11-21"


def test_unix_seconds_and_datetimes_give_the_same_windows() -> None:
    moment = at("2026-03-31T23:59:30")
    assert windows_at(moment.timestamp()) == windows_at(moment)


@pytest.mark.parametrize(
    ("moment", "day", "month", "month_ends"),
    [
        ("2026-12-31T23:59:59", "day:2026-12-31", "month:2026-12", "2027-01-01T00:00:00"),
        ("2027-01-01T00:00:00", "day:2027-01-01", "month:2027-01", "2027-02-01T00:00:00"),
        ("2028-02-29T12:00:00", "day:2028-02-29", "month:2028-02", "2028-03-01T00:00:00"),
        ("2026-01-31T23:59:59", "day:2026-01-31", "month:2026-01", "2026-02-01T00:00:00"),
    ],
)
def test_month_and_year_rollover(moment: str, day: str, month: str, month_ends: str) -> None:
    w = windows_at(at(moment))
    assert (w.day, w.month, w.month_ends) == (day, month, ts(month_ends))


def test_minute_keys_sort_in_time_order() -> None:
    keys = [
        windows_at(at(t)).minute
        for t in ("2026-09-30T23:59", "2026-10-01T00:00", "2026-10-01T09:05", "2026-10-01T10:00")
    ]
    assert keys == sorted(keys)


def test_windows_needed_follow_the_configured_limits() -> None:
    assert windows_needed(L()) == frozenset()
    assert windows_needed(L(rpm=1)) == {"minute"}
    assert windows_needed(L(tpm=1, budget_usd_month=3.0)) == {"minute", "month"}
    assert windows_needed(L(budget_usd_day=0.0)) == {"day"}


NOW = ts("2026-11-22T02:08:48")  # 12 s before the minute ends
WINDOWS = windows_at(NOW)


def usage(**by_kind: WindowUsage) -> dict[WindowKind, WindowUsage]:
    return by_kind  # type: ignore[return-value]


def test_no_limits_always_allow() -> None:
    assert decide(L(), usage(minute=WindowUsage(10**9, 10**9, 1e9)), WINDOWS, NOW) is None


def test_rpm_allows_below_the_limit_and_denies_at_it() -> None:
    assert decide(L(rpm=10), usage(minute=WindowUsage(requests=9)), WINDOWS, NOW) is None
    denial = decide(L(rpm=10), usage(minute=WindowUsage(requests=10)), WINDOWS, NOW)
    assert denial is not None
    assert (denial.limit, denial.type, denial.code, denial.retry_after) == (
        "rpm",
        "requests",
        "rate_limit_exceeded",
        12,
    )
    assert (
        denial.message
        == "Rate limit reached for requests per minute (RPM): Limit 10, Used 10. Please try again in 12s."
    )


def test_tpm_denies_once_the_tokens_reach_the_limit() -> None:
    assert (
        decide(L(tpm=1000), usage(minute=WindowUsage(requests=50, tokens=999)), WINDOWS, NOW)
        is None
    )
    denial = decide(L(tpm=1000), usage(minute=WindowUsage(requests=1, tokens=1200)), WINDOWS, NOW)
    assert denial is not None
    assert (denial.limit, denial.type, denial.code, denial.used) == (
        "tpm",
        "tokens",
        "rate_limit_exceeded",
        1200,
    )
    assert (
        denial.message
        == "Rate limit reached for tokens per minute (TPM): Limit 1000, Used 1200. Please try again in 12s."
    )


def test_daily_budget_is_insufficient_quota_until_utc_midnight() -> None:
    limits = L(budget_usd_day=5.0)
    assert decide(limits, usage(day=WindowUsage(cost_usd=4.9999)), WINDOWS, NOW) is None
    denial = decide(limits, usage(day=WindowUsage(cost_usd=5.0)), WINDOWS, NOW)
    assert denial is not None
    assert (denial.type, denial.code) == ("insufficient_quota", "insufficient_quota")
    assert denial.retry_after == int(ts("2026-11-23T00:00:00") - NOW)  # 21h51m12s
    assert denial.message == (
        "You exceeded your daily budget (budget_usd_day): spent $5.0000 of $5.00. "
        "The budget resets at 00:00 UTC. Please try again in 21h51m12s."
    )


def test_a_budget_spent_exactly_in_many_calls_is_reached() -> None:
    spent = WindowUsage()
    for _ in range(10):  # ten calls of $0.10: their float sum is 0.9999999999999999
        spent = spent + WindowUsage(requests=1, cost_usd=0.1)
    denial = decide(L(budget_usd_day=1.0), usage(day=spent), WINDOWS, NOW)
    assert denial is not None and denial.used == 1.0


def test_monthly_budget_waits_for_the_first_of_next_month() -> None:
    denial = decide(
        L(budget_usd_month=100.0), usage(month=WindowUsage(cost_usd=100.5)), WINDOWS, NOW
    )
    assert denial is not None
    assert denial.limit == "budget_usd_month"
    assert denial.retry_after == int(ts("2026-12-01T00:00:00") - NOW)
    assert "monthly budget" in denial.message


def test_a_zero_budget_refuses_everything() -> None:
    denial = decide(L(budget_usd_day=0.0), {}, WINDOWS, NOW)
    assert denial is not None and denial.limit == "budget_usd_day"


def test_the_limit_whose_window_ends_last_is_reported() -> None:
    everything = usage(
        minute=WindowUsage(10, 10_000, 0.0),
        day=WindowUsage(cost_usd=9.0),
        month=WindowUsage(cost_usd=9.0),
    )
    limits = L(rpm=10, tpm=100, budget_usd_day=1.0, budget_usd_month=5.0)
    denial = decide(limits, everything, WINDOWS, NOW)
    assert denial is not None and denial.limit == "budget_usd_month"
    denial = decide(L(rpm=10, tpm=100, budget_usd_day=1.0), everything, WINDOWS, NOW)
    assert denial is not None and denial.limit == "budget_usd_day"
    denial = decide(L(rpm=10, tpm=100), everything, WINDOWS, NOW)
    assert denial is not None and denial.limit == "rpm"


def test_usage_of_other_windows_does_not_count() -> None:
    # Requests counted in the day window say nothing about this minute.
    assert decide(L(rpm=1), usage(day=WindowUsage(requests=5)), WINDOWS, NOW) is None


@pytest.mark.parametrize(
    ("ends", "now", "seconds"),
    [(60.0, 48.0, 12), (60.0, 48.2, 12), (60.0, 59.999, 1), (60.0, 60.0, 1), (60.0, 0.0, 60)],
)
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(
    ends: float, now: float, seconds: int
) -> None:
    assert retry_after(ends, now) == seconds


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(1, "1s"), (59, "59s"), (60, "1m0s"), (90, "1m30s"), (3600, "1h0m0s"), (78672, "21h51m12s")],
)
def test_waits_are_written_like_openai(seconds: int, text: str) -> None:
    assert format_wait(seconds) == text


def test_usage_adds_up() -> None:
    assert WindowUsage(1, 2, 0.5) + WindowUsage(3, 4, 0.25) == WindowUsage(4, 6, 0.75)
    assert WindowUsage().empty and not WindowUsage(tokens=1).empty
