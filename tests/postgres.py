"""A real, throwaway PostgreSQL server for the test session, and a fresh database per test.

Test databases are migrated once per session and kind, into a template each test's database
is copied from (a file copy, or `CREATE DATABASE ... TEMPLATE`): the same schema as migrating
every database, in a fraction of the time. `database_url` is empty, so the tests that use it
also see each kind migrated as the server starts.

The server is started once (`initdb` into a temporary directory, `pg_ctl start`), listens on
127.0.0.1 with trust authentication and a private socket directory, runs without fsync (the
data is thrown away), and is stopped and deleted when the session ends. PostgreSQL refuses to
run as root, so as root every server command runs as the `postgres` user (`runuser`).

Without PostgreSQL binaries the PostgreSQL tests are skipped, except under `CI=true`, where
they fail: CI must not go green by testing only SQLite.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import asyncpg
import pytest

from storage import migrate

# Where Debian/Ubuntu put the server binaries; PATH is tried first.
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
SERVER_USER = "postgres"
SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
}
_database_names = itertools.count(1)


class PostgresUnavailable(Exception):
    """This machine cannot run a PostgreSQL server for the tests."""


class PostgresCommandFailed(Exception):
    """A server tool (initdb, pg_ctl, psql) exited with an error; the message has its output."""


def find_bin_dir() -> Path:
    on_path = shutil.which("pg_ctl")
    candidates = [Path(on_path).parent] if on_path else []
    # Newest major version first: /usr/lib/postgresql/15/bin before .../9.6/bin.
    installed = Path("/").glob(PG_BIN_GLOB.lstrip("/"))
    candidates += sorted(installed, key=lambda p: _version(p.parent.name), reverse=True)
    for candidate in candidates:
        if all((candidate / tool).is_file() for tool in ("initdb", "pg_ctl", "psql")):
            return candidate
    raise PostgresUnavailable("PostgreSQL binaries (initdb, pg_ctl, psql) not found")


def _version(name: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in name.split("."))
    except ValueError:
        return ()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PostgresServer:
    """One PostgreSQL cluster in a temporary directory, reachable at 127.0.0.1:`port`."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="memproxy-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam(SERVER_USER)
            except KeyError as exc:
                self.remove()
                raise PostgresUnavailable(
                    f"running as root and there is no {SERVER_USER!r} user to run PostgreSQL"
                ) from exc
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as_user = ["runuser", "-u", SERVER_USER, "--"]

    def start(self, attempts: int = 3) -> None:
        self._run(
            "initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
            "--locale=C", "--no-sync",
        )  # fmt: skip
        for attempt in range(1, attempts + 1):
            # The port is free now but could be taken before the server binds it: retry.
            self.port = free_port()
            try:
                self._launch()
                return
            except PostgresCommandFailed:
                if attempt == attempts:
                    raise

    def _launch(self) -> None:
        # pg_ctl hands these to a shell.
        options = [f"-p {self.port}", f"-k {shlex.quote(str(self.root))}", "-h 127.0.0.1"]
        options += [f"-c {key}={value}" for key, value in SETTINGS.items()]
        self._run(
            "pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w",
            "-t", "30", "-o", " ".join(options),
        )  # fmt: skip

    def pause(self) -> None:
        """Stop the server (an outage: connections are cut), keeping its data. `fast`, not
        `immediate`: with the tests' `synchronous_commit=off` an immediate stop would lose
        the last commits."""
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w")

    def resume(self) -> None:
        """Start it again, on the same port, after `pause`."""
        self._launch()

    def freeze(self) -> None:
        """Stop every process of the server where it stands (SIGSTOP to the postmaster and its
        children, backends included): connections stay open and nothing answers, a database
        hung rather than gone."""
        for pid in self._processes():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let it go on after `freeze`."""
        for pid in self._processes():
            os.kill(pid, signal.SIGCONT)

    def _processes(self) -> list[int]:
        """The postmaster and its children (each of which is a session of its own, so not
        reached through the postmaster's process group)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(stat.parent.name))
        return [postmaster, *children]

    def stop(self) -> None:
        """Stop the server (immediately: its data is about to be deleted) and delete it all."""
        try:
            if (self.data / "postmaster.pid").exists():
                with contextlib.suppress(OSError):
                    self.thaw()  # (a frozen server would not hear the stop)
                self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
        finally:
            self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def sql(self, *statements: str) -> None:
        """Run statements one by one (each in its own transaction) as the superuser."""
        commands = [arg for statement in statements for arg in ("-c", statement)]
        self._run(
            "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(self.port),
            "-U", "postgres", "-d", "postgres", *commands, as_server=False,
        )  # fmt: skip

    def create_database(self, template: str | None = None) -> str:
        """A new database, empty or a copy of `template`; returns its name."""
        name = f"test_{os.getpid()}_{next(_database_names)}"
        copy = f' TEMPLATE "{template}"' if template else ""
        self.sql(f'CREATE DATABASE "{name}"{copy}')
        return name

    def drop_database(self, name: str) -> None:
        # FORCE: a test that failed half-way may have left connections open.
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _run(self, tool: str, *args: str, as_server: bool = True) -> None:
        command = [*(self._as_user if as_server else []), str(self.bin_dir / tool), *args]
        # The server user may not be allowed into the caller's working directory.
        result = subprocess.run(
            command, cwd=self.root, capture_output=True, text=True, timeout=60, check=False
        )
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise PostgresCommandFailed(
                f"{' '.join(command)} exited {result.returncode}:\n"
                f"{result.stdout}{result.stderr}{log}"
            )


def unavailable(reason: str) -> NoReturn:
    """Skip the PostgreSQL tests here; fail them in CI, which must test both databases."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL is required in CI: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable: {reason}")


def _running() -> Iterator[PostgresServer]:
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


# A PostgreSQL server for the whole session, started on first use; and one of a test's own,
# to stop and start again.
postgres_server = pytest.fixture(scope="session", name="postgres_server")(_running)
own_postgres = pytest.fixture(name="own_postgres")(_running)


def start_server() -> PostgresServer:
    # Skip or fail outside the `except` blocks, so the report is the reason alone.
    try:
        server = PostgresServer(find_bin_dir())
    except PostgresUnavailable as exc:
        missing = str(exc)
    else:
        missing = ""
    if missing:
        unavailable(missing)
    try:
        server.start()
        return server
    except PostgresCommandFailed as exc:
        broken = str(exc)
        with contextlib.suppress(PostgresCommandFailed):
            server.stop()
    # The binaries are there but the server would not start: a broken set-up, not a skip.
    pytest.fail(f"PostgreSQL did not start: {broken}", pytrace=False)


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """`postgresql+asyncpg://` URL of a database on the session's server, shared by the session."""
    return postgres_server.url(postgres_server.create_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def database_kind(request: pytest.FixtureRequest) -> str:
    """Runs a test once on SQLite and once on PostgreSQL."""
    kind: str = request.param
    return kind


@contextlib.contextmanager
def fresh_database(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, template: str | None = None
) -> Iterator[str]:
    """The URL of a new database of `kind`, empty or a copy of `template` (a SQLite file's path,
    or the name of a PostgreSQL database nobody is connected to); PostgreSQL's is dropped after."""
    if kind == "sqlite":
        path = tmp_path / "test.db"
        for n in itertools.count(2):  # a test may ask for more than one
            if not path.exists():
                break
            path = tmp_path / f"test-{n}.db"
        if template is not None:
            shutil.copyfile(template, path)
        yield f"sqlite+aiosqlite:///{path}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = server.create_database(template)
    yield server.url(name)
    with contextlib.suppress(PostgresCommandFailed):
        server.drop_database(name)


def upgrade_in_thread(url: str) -> None:
    # migrate.upgrade runs an event loop of its own: keep it off the caller's thread.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(migrate.upgrade, url).result()


# The session fixture holding each kind's migrated template, built on first use.
TEMPLATES = {"sqlite": "sqlite_template", "postgresql": "postgres_template"}


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("schema") / "template.db"
    upgrade_in_thread(f"sqlite+aiosqlite:///{path}")
    return str(path)


@pytest.fixture(scope="session")
def postgres_template(postgres_server: PostgresServer) -> str:
    name = postgres_server.create_database()
    upgrade_in_thread(postgres_server.url(name))
    return name


@pytest.fixture
def database_url(
    database_kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[str]:
    """A new, empty database of each kind: a SQLite file, or a PostgreSQL database (the
    server migrates it as it starts)."""
    with fresh_database(database_kind, request, tmp_path) as url:
        yield url


async def lock_waits(url: str, wait_event: str | None = None) -> int:
    """How many sessions of the database at `url` wait for a lock (of `wait_event`'s kind, e.g.
    'advisory', if given). Asked on a connection of its own: a transaction sees one snapshot
    of `pg_stat_activity` until it ends."""
    conn = await asyncpg.connect(url.replace("+asyncpg", "", 1))
    try:
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND ($1::text IS NULL OR wait_event = $1)"
        )
        return int(await conn.fetchval(query, wait_event))
    finally:
        await conn.close()
