"""Per-tenant rate limits and budgets: which windows a moment falls in, and allow or deny.

Every limit is counted in a fixed UTC window: `rpm` and `tpm` in the calendar minute
(`minute:2026-11-22T02:08`), `budget_usd_day` in the UTC day (`day:2026-11-22`),
`budget_usd_month` in the UTC month (`month:2026-11`). The keys sort in time order within a
kind, so old windows can be found with a string comparison. A limit is reached when what was
used in its window is at least the limit (`used >= limit` denies), and the denial says how many
whole seconds remain until that window ends: the `retry-after` the client is given.

Errors mirror OpenAI's: rate limits are code `rate_limit_exceeded` with type `requests` or
`tokens`; a spent budget is `insufficient_quota` (type and code), like an exhausted quota.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal, Protocol

from policies.pricing import USD_DIGITS

LimitName = Literal["rpm", "tpm", "budget_usd_day", "budget_usd_month"]
WindowKind = Literal["minute", "day", "month"]


class LimitValues(Protocol):
    """A tenant's configured limits; None means no limit of that kind."""

    @property
    def rpm(self) -> int | None: ...
    @property
    def tpm(self) -> int | None: ...
    @property
    def budget_usd_day(self) -> float | None: ...
    @property
    def budget_usd_month(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class WindowUsage:
    """What a tenant used in one window."""

    requests: int = 0
    tokens: int = 0
    cost_usd: float = 0.0

    def __add__(self, other: WindowUsage) -> WindowUsage:
        return WindowUsage(
            self.requests + other.requests,
            self.tokens + other.tokens,
            self.cost_usd + other.cost_usd,
        )

    @property
    def empty(self) -> bool:
        return self.requests == 0 and self.tokens == 0 and self.cost_usd == 0.0


NO_USAGE = WindowUsage()


@dataclass(frozen=True, slots=True)
class Windows:
    """The window keys a moment falls in, and when each window ends (Unix seconds)."""

    minute: str
    day: str
    month: str
    minute_ends: float
    day_ends: float
    month_ends: float

    def key(self, kind: WindowKind) -> str:
        return self.minute if kind == "minute" else self.day if kind == "day" else self.month

    def ends(self, kind: WindowKind) -> float:
        if kind == "minute":
            return self.minute_ends
        return self.day_ends if kind == "day" else self.month_ends

    def began(self, kind: WindowKind) -> datetime:
        """When the current window of `kind` began (UTC)."""
        key = self.key(kind).split(":", 1)[1]
        form = {"minute": "%Y-%m-%dT%H:%M", "day": "%Y-%m-%d", "month": "%Y-%m"}[kind]
        return datetime.strptime(key, form).replace(tzinfo=UTC)


def windows_at(moment: float | datetime) -> Windows:
    """The UTC minute, day and month windows that `moment` (Unix seconds, or aware) is in."""
    at = moment if isinstance(moment, datetime) else datetime.fromtimestamp(moment, UTC)
    at = at.astimezone(UTC)
    minute = at.replace(second=0, microsecond=0)
    day = minute.replace(hour=0, minute=0)
    month = day.replace(day=1)
    next_month = (month + timedelta(days=32)).replace(day=1)
    return Windows(
        minute=f"minute:{minute:%Y-%m-%dT%H:%M}",
        day=f"day:{day:%Y-%m-%d}",
        month=f"month:{month:%Y-%m}",
        minute_ends=(minute + timedelta(minutes=1)).timestamp(),
        day_ends=(day + timedelta(days=1)).timestamp(),
        month_ends=next_month.timestamp(),
    )


# Which window each limit is counted in.
WINDOW_OF: dict[LimitName, WindowKind] = {
    "rpm": "minute",
    "tpm": "minute",
    "budget_usd_day": "day",
    "budget_usd_month": "month",
}
# Checked in this order: the first limit reached is reported, so a spent budget (whose window
# ends last) wins over a rate limit; retrying before its retry-after would be refused anyway.
CHECK_ORDER: tuple[LimitName, ...] = ("budget_usd_month", "budget_usd_day", "rpm", "tpm")


def windows_needed(limits: LimitValues) -> frozenset[WindowKind]:
    """The windows a tenant's limits are counted in; empty when it has no limits."""
    return frozenset(WINDOW_OF[name] for name in CHECK_ORDER if getattr(limits, name) is not None)


@dataclass(frozen=True, slots=True)
class Denial:
    """A limit was reached: the OpenAI-style error and when to retry."""

    limit: LimitName
    type: str
    code: str
    message: str
    retry_after: int  # whole seconds until the limit's window ends, at least 1
    limit_value: float
    used: float


def decide(
    limits: LimitValues, usage: dict[WindowKind, WindowUsage], windows: Windows, now: float
) -> Denial | None:
    """Allow (None) or deny one more request, given what was used in the current windows."""
    for name in CHECK_ORDER:
        limit = getattr(limits, name)
        if limit is None:
            continue
        kind = WINDOW_OF[name]
        used = used_of(name, usage.get(kind, NO_USAGE))
        if used >= limit:
            return _denial(name, limit, used, retry_after(windows.ends(kind), now))
    return None


def used_of(name: LimitName, usage: WindowUsage) -> float:
    """The amount a limit is compared with: requests, tokens or USD. Costs are exact to
    1e-10 USD, their sums floats: rounded back, ten calls of $0.10 spend $1.00, not
    $0.9999999999999999 (which a $1.00 budget would still admit)."""
    if name == "rpm":
        return usage.requests
    return usage.tokens if name == "tpm" else round(usage.cost_usd, USD_DIGITS)


def retry_after(window_ends: float, now: float) -> int:
    """Whole seconds until the window ends, rounded up, at least 1."""
    return max(1, math.ceil(window_ends - now))


def format_wait(seconds: int) -> str:
    """OpenAI's way of writing a wait: `12s`, `1m30s`, `5h2m0s`."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _denial(name: LimitName, limit: float, used: float, wait: int) -> Denial:
    again = f"Please try again in {format_wait(wait)}."
    if name == "rpm" or name == "tpm":
        what = "requests per minute (RPM)" if name == "rpm" else "tokens per minute (TPM)"
        message = f"Rate limit reached for {what}: Limit {limit:g}, Used {used:g}. {again}"
        type_ = "requests" if name == "rpm" else "tokens"
        return Denial(name, type_, "rate_limit_exceeded", message, wait, limit, used)
    period = "daily" if name == "budget_usd_day" else "monthly"
    resets = "at 00:00 UTC" if name == "budget_usd_day" else "on the 1st at 00:00 UTC"
    message = (
        f"You exceeded your {period} budget ({name}): spent ${used:.4f} of ${limit:.2f}. "
        f"The budget resets {resets}. {again}"
    )
    return Denial(name, "insufficient_quota", "insufficient_quota", message, wait, limit, used)
