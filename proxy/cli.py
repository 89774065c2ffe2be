"""The `memproxy` command."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import math
import os
import socket
import sys

from proxy import cli_client
from proxy.core.config import Config, ConfigError
from proxy.core.config_file import load_config

DEFAULT_CONFIG = "config.yaml"


def _path(given: str | None) -> str:
    return given or os.environ.get("MEMPROXY_CONFIG") or DEFAULT_CONFIG


def _load(path: str) -> Config:
    # (imports the app's modules: only here)
    from proxy.background.embeddings import check_embeddings

    try:
        config = load_config(path)
        check_embeddings(config)
        return config
    except ConfigError as exc:
        print(f"memproxy: bad config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _migrate(config: Config) -> None:
    from proxy.app import migrate_database
    from storage.errors import StorageError

    try:
        migrate_database(config)
    except StorageError as exc:
        print(f"memproxy: database: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


# glibc's mallopt parameter: how many heaps ("arenas") threads may allocate from.
M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def _fewer_malloc_arenas() -> None:
    """glibc gives threads that allocate heaps of their own (up to 8 per core) and keeps what
    is freed in each: the worker threads that tokenize and run the embedding model grew RSS
    by some 40 MB over 500 turns, against 16 MB with two (bench/rss.py). An operator's
    MALLOC_ARENA_MAX wins; other C libraries are left alone."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS)
    except (OSError, AttributeError):  # (musl and others: no such library or function)
        return


def _loopback(host: str) -> bool:
    """Whether `host` (what the server binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # (a name: it may resolve to anything)
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="memproxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help="config file (default: $MEMPROXY_CONFIG or config.yaml)")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", type=int, default=8080, help="default: 8080")
    serve.add_argument(
        "--log-level",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="default: info",
    )
    serve.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        default="auto",
        help="default: auto (console on a terminal, JSON otherwise)",
    )
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", help="config file (default: $MEMPROXY_CONFIG or config.yaml)")
    migrate = sub.add_parser("migrate", help="apply database migrations and exit")
    migrate.add_argument("--config", help="config file (default: $MEMPROXY_CONFIG or config.yaml)")
    cli_client.add_commands(sub)  # (against a running server: no config read)
    args = parser.parse_args(argv)
    if args.command in cli_client.COMMANDS:
        raise SystemExit(cli_client.run(args))

    path = _path(args.config)
    config = _load(path)
    if args.command == "check-config":
        print(f"ok: {len(config.tenants)} tenants, upstreams: {', '.join(config.upstreams)}")
        return
    from proxy.app import create_app
    from proxy.core.logs import configure_logging

    if args.command == "migrate":
        configure_logging("warning", "console")  # (waits for the database, on stderr)
        _migrate(config)
        print("ok: database is at the latest schema")
        return

    import uvicorn

    from proxy.core.slow_headers import bounded_headers

    _fewer_malloc_arenas()  # (before the server's threads)
    configure_logging(args.log_level, args.log_format)
    if config.server.metrics_key is None and not _loopback(args.host):
        import structlog

        structlog.get_logger("memproxy.cli").warning(
            "metrics_open",
            host=args.host,
            detail="GET /metrics answers whoever reaches this port, with every tenant's name, "
            "requests and spend: set server.metrics_key, or keep the port off tenants' networks",
        )
    _migrate(config)  # before the server: a database that is not there is one line, not a trace
    app = create_app(config, config_path=path, migrated=True)  # SIGHUP reloads it
    grace = config.server.shutdown_grace_seconds

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            """Tell the app that the grace period begins (uvicorn tells it nothing until the
            connections are closed), so what still waits near its end gets an error."""
            state = getattr(app.state, "memproxy", None)
            if state is not None:
                state.shutdown.start(grace)
            await super().shutdown(sockets)

    settings = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=bounded_headers(config.server.header_timeout_seconds),
        access_log=False,  # memproxy writes its own structured access line
        log_config=None,  # uvicorn's records go through memproxy's handler (one format)
        log_level=args.log_level,
        timeout_graceful_shutdown=math.ceil(grace),
    )
    server = Server(settings)
    with contextlib.suppress(KeyboardInterrupt):  # (as uvicorn.run does)
        server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's exit status for a failed start-up


if __name__ == "__main__":
    main()
