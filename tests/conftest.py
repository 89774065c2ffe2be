"""Shared fixtures: real servers on 127.0.0.1, never the network."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.app import create_app
from proxy.core.config import (
    Config,
    DatabaseConfig,
    MemorySettings,
    TenantConfig,
    UpstreamConfig,
)
from proxy.core.logs import configure_logging
from proxy.core.offline import prepare_offline_environment
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread

prepare_offline_environment()
# Access lines from the servers under test would drown pytest's output; failures show logs.
configure_logging("warning", "console")

# PostgreSQL for the session and a fresh database per test: postgres_url, database_url.
pytest_plugins = ["tests.postgres"]

# The default database (DatabaseConfig's), relative to the working directory.
DEFAULT_DATABASE = DatabaseConfig().url.removeprefix("sqlite+aiosqlite:///")
KEY = "test-key"
CHAT_ONLY_KEY = "chat-only-key"
OTHER_TENANT_KEY = "other-key"


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests talk to 127.0.0.1 only; anything else fails loudly."""
    real_connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> Any:
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise RuntimeError(f"test tried to reach the network: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sqlite_template: str) -> None:
    """Each test runs in its own directory, so the default SQLite file (`./memproxy.db`) is
    private to it. The file is there already, migrated (a copy of the session's template):
    migrating it at every server start took a quarter of a second, a minute of the suite.
    Servers started on an empty database: `database_url`, and tests of their own."""
    shutil.copyfile(sqlite_template, tmp_path / DEFAULT_DATABASE)
    monkeypatch.chdir(tmp_path)


def make_config(
    upstream: UpstreamConfig, *, database_url: str | None = None, **tenant: Any
) -> Config:
    """Tenant `t1` (keys: all scopes and chat-only) and tenant `t2`, both on `upstream`.
    The database is `./memproxy.db` in the test's own directory unless `database_url` says.

    Both recall by words alone (`memory.embeddings: off`) unless the test passes its own
    `memory` settings: the default local model is tested where recall by meaning is
    (tests/integration/test_local_embeddings.py, and every server started from config.yaml);
    elsewhere its background jobs would only add vectors and jobs, at their own pace, to what
    the tests count."""
    tenant.setdefault("memory", MemorySettings(embeddings="off"))
    return Config(
        database=DatabaseConfig(url=database_url) if database_url else DatabaseConfig(),
        upstreams={"main": upstream, "echo": UpstreamConfig(kind="echo")},
        tenants={
            "t1": TenantConfig(
                api_keys=[KEY, {"key": CHAT_ONLY_KEY, "scopes": ["chat"]}],
                upstream="main",
                **tenant,
            ),
            "t2": TenantConfig(
                api_keys=[OTHER_TENANT_KEY],
                upstream="main",
                memory=MemorySettings(embeddings="off"),
            ),
        },
    )


@pytest.fixture
def fake_upstream() -> Iterator[tuple[FakeOpenAI, str]]:
    """A fake OpenAI API on a real port: (app, base_url ending in /v1)."""
    app = FakeOpenAI()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"


@pytest.fixture
def serve_proxy() -> Iterator[Callable[[Config], str]]:
    """Start memproxy for a config; returns its base URL (ending in /v1)."""
    servers: list[ServerThread] = []

    def start(config: Config) -> str:
        server = ServerThread(create_app(config)).start()
        servers.append(server)
        return server.url + "/v1"

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def proxy_url(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]) -> str:
    """memproxy in front of the fake upstream."""
    _, upstream_url = fake_upstream
    return serve_proxy(
        make_config(UpstreamConfig(kind="openai", base_url=upstream_url, api_key="upstream-key"))
    )
