"""Serve any ASGI app with uvicorn on 127.0.0.1 in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


class ServerThread:
    """`with ServerThread(app) as server: server.url` -> a live HTTP server on a free port, or
    on `sock`, a listening socket the test made (e.g. with small buffers)."""

    def __init__(
        self, app: Any, *, port: int = 0, sock: socket.socket | None = None, **uvicorn_options: Any
    ) -> None:
        options = {"log_level": "warning", "access_log": False, "lifespan": "auto"}
        options.update(uvicorn_options)
        self.config = uvicorn.Config(app, host="127.0.0.1", port=port, **options)
        self.server = uvicorn.Server(self.config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = port
        self.sock = sock
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve([self.sock] if self.sock else None))
        except BaseException as exc:  # reported to the test thread in start()
            self.error = exc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if self.error or not self._thread.is_alive():
                raise RuntimeError(f"server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start within 30 s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
