"""Waiting in tests for what another thread or process does (a reply stored after its response,
a background job, a log line): poll until it shows, bounded by a number of attempts (a generous
bound only turns a hang into a failure; no test asserts how long anything took)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
PAUSE = 0.02


async def eventually(
    check: Callable[[], Awaitable[T]], what: str = "the background work", attempts: int = 3000
) -> T:
    """`await check()` until it returns something truthy, and return that."""
    for _ in range(attempts):
        if found := await check():
            return found
        await asyncio.sleep(PAUSE)
    raise AssertionError(f"never happened: {what}")


def until(check: Callable[[], T], what: str, attempts: int = 3000) -> T:
    """`check()` until it returns something truthy, and return that (outside an event loop)."""
    for _ in range(attempts):
        if found := check():
            return found
        time.sleep(PAUSE)
    raise AssertionError(f"never happened: {what}")
