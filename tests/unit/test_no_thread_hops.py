"""Litestar runs a plain function (a hook, a dependency, a handler) in a worker thread unless
told otherwise: a thread hand-off on every request (about half a millisecond of p50 for the
`before_request` hook, bench/overhead.py). Nothing of memproxy's request path is."""

from __future__ import annotations

import inspect

from litestar.handlers import HTTPRouteHandler

from proxy.app import create_app
from proxy.core.config import Config


def test_no_hook_dependency_or_handler_runs_in_a_worker_thread() -> None:
    app = create_app(Config())
    handlers = [
        handler
        for route in app.routes
        for handler in getattr(route, "route_handlers", [])
        if isinstance(handler, HTTPRouteHandler)
    ]
    assert len(handlers) > 20
    threaded = []
    for handler in handlers:
        name = handler.handler_name
        hook = handler.resolve_before_request()  # (a plain function comes wrapped)
        if hook is not None and not inspect.iscoroutinefunction(hook):
            threaded.append(f"{name}: before_request {getattr(hook, 'func', hook).__name__}")
        if handler.has_sync_callable and handler.sync_to_thread is not False:
            threaded.append(f"{name}: the handler")
        for key, provide in handler.resolve_dependencies().items():
            if provide.has_sync_callable and provide.sync_to_thread:
                threaded.append(f"{name}: dependency {key}")
    assert threaded == []
