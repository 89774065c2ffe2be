"""The end of a graceful shutdown: what still waits on an upstream when the grace period is
nearly over is answered with an error, not a dropped connection.

On SIGTERM uvicorn stops accepting connections and lets those in flight run for
`server.shutdown_grace_seconds`, then cancels them: a stream just stops, a request waiting for
its answer loses its connection. The CLI's server calls `ShutdownDeadline.start` as it begins
to shut down; `CUT_BEFORE` seconds before the grace ends (at most half of it), every wait
guarded by `guard` (an upstream's answer, a stream's next chunk) raises `ShuttingDown`, which
the client gets as a 503 or a stream's last error event, while there is still time to send it
and to store what the reply had so far.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import TypeVar

from proxy.core.errors import ProxyError

T = TypeVar("T")
CUT_BEFORE = 1.0


class ShuttingDown(ProxyError):
    status, type, code = 503, "server_error", "server_shutting_down"

    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down and could not finish this reply; send it again."
        )


class ShutdownDeadline:
    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.passed = False

    def start(self, grace_seconds: float) -> None:
        """Shutdown has begun: cut the guarded waits shortly before `grace_seconds` from now."""
        if self._timer is None and not self.passed:
            delay = max(0.0, grace_seconds - min(CUT_BEFORE, grace_seconds / 2))
            self._timer = asyncio.get_running_loop().call_later(delay, self._cut_off)

    def _cut_off(self) -> None:
        self.passed = True
        for task in self._waiting:
            self._cut.add(task)
            task.cancel("memproxy: shutdown grace period ending")

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`'s result, or `ShuttingDown` once the deadline has passed."""
        if self.passed:
            if isinstance(awaitable, Coroutine):
                awaitable.close()  # (never started)
            raise ShuttingDown()
        task = asyncio.current_task()
        assert task is not None  # (a coroutine runs in a task)
        self._waiting.add(task)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if task not in self._cut or task.uncancel() > 0:
                raise  # cancelled for another reason (the client left) too
            raise ShuttingDown() from None
        finally:
            self._waiting.discard(task)
            self._cut.discard(task)
