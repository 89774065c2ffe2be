"""Applying migrations: at start-up (`create_app`, `memproxy serve`) and by `memproxy migrate`."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.util.exc import CommandError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from storage.errors import StorageError, StorageUnavailable

MIGRATIONS = Path(__file__).parent / "migrations"
# Pauses between tries of a database that cannot be reached yet: doubling, at most this.
FIRST_PAUSE = 0.5
MAX_PAUSE = 5.0
# How long one try may wait for the database's answer (asyncpg's own default is 60 s, which
# a host that takes the connection and says nothing would hold whatever the wait): at most
# this, and no longer than what is left of the wait (at least MIN_TRY).
TRY_SECONDS = 10.0
MIN_TRY = 1.0
# SQLSTATEs of a server that is there but not taking connections yet: the connection
# exception class (08...) and "the database system is starting up" (57P03).
_NOT_YET = ("08", "57P03")
# PostgreSQL: how long a migration waits for a lock on a table in use (a long transaction
# holding it) before it gives up, and how often it tries again. While it waits, every query
# of that table queues behind it: a cluster upgraded beside a long transaction would stall
# all its requests for as long as that transaction lasts, instead of these few seconds each
# time. Its pauses between tries are the ones above. "lock_not_available" is 55P03.
LOCK_TIMEOUT_SECONDS = 5.0
LOCK_ATTEMPTS = 10
_BUSY = "55P03"

Waiting = Callable[[int, float, str], None]

# Search structures the models do not describe (made by hand in migrations 0004, 0008, 0017
# and 0018; `search_vector` and `message_words` are on PostgreSQL only): autogenerate leaves
# them alone.
UNMODELLED = (
    "messages_fts",
    "message_words",
    "ix_messages_search",
    "attachment_chunks_fts",
    "ix_attachment_chunks_search",
    "search_vector",
)


def modelled(name: str | None) -> bool:
    """Whether a table, column or index of this name is described by storage/models/."""
    return not (name or "").startswith(UNMODELLED)


def include_object(
    obj: object, name: str | None, kind: str, reflected: bool, compare_to: object
) -> bool:
    """Alembic's `include_object` hook (migrations/env.py): only what the models describe is
    compared with them."""
    return modelled(name)


def alembic_config(url: str, connect_timeout: float = TRY_SECONDS) -> AlembicConfig:
    """Alembic's configuration for `url`; migrations/env.py gives the driver `connect_timeout`
    seconds to connect, and a PostgreSQL migration `LOCK_TIMEOUT_SECONDS` for each lock."""
    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would read a '%' in a password as a placeholder.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["connect_timeout"] = connect_timeout
    config.attributes["lock_timeout"] = LOCK_TIMEOUT_SECONDS
    return config


def upgrade(
    url: str,
    revision: str = "head",
    *,
    wait_seconds: float = 0.0,
    on_wait: Waiting | None = None,
    on_busy: Waiting | None = None,
) -> None:
    """Bring the database at `url` up to `revision`. Blocking: call it in a thread.

    A database that cannot be reached yet (no answer on its port, its host not resolvable
    yet, a server still starting) is tried again, pausing longer each time, for
    `wait_seconds`; `on_wait(attempt, pause, reason)` is told before each pause. A
    PostgreSQL migration that waited `LOCK_TIMEOUT_SECONDS` for a table in use is rolled
    back whole and tried again, `LOCK_ATTEMPTS` times in all (`on_busy`, likewise). Then,
    and at once for any other refusal (a wrong password, no such database, a schema newer
    than this code), a `StorageError` says why in one line, with the URL's password hidden."""
    deadline = time.monotonic() + wait_seconds
    pause = FIRST_PAUSE
    attempt = busy = 0
    while True:
        attempt += 1
        connect_timeout = min(TRY_SECONDS, max(MIN_TRY, deadline - time.monotonic()))
        try:
            command.upgrade(alembic_config(url, connect_timeout), revision)
            return
        except (DBAPIError, OSError) as exc:
            reason = _reason(exc, connect_timeout)
            left = deadline - time.monotonic()
            if _busy(exc):
                busy += 1
                if busy >= LOCK_ATTEMPTS:
                    raise StorageUnavailable(
                        f"{shown_url(url)}: {reason} (tried {busy} times, each waiting "
                        f"{LOCK_TIMEOUT_SECONDS:g} s): a transaction holds a table the "
                        "migration changes (see pg_stat_activity)"
                    ) from exc
                told, tries = on_busy, busy
            else:
                tries = attempt - busy  # (each kind of wait counts its own)
                if not _unreachable(exc) or left <= 0:
                    tried = f" (tried {tries} times)" if tries > 1 else ""
                    raise StorageUnavailable(f"{shown_url(url)}: {reason}{tried}") from exc
                told, pause = on_wait, min(pause, left)
            if told is not None:
                told(tries, pause, reason)
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE)
        except CommandError as exc:  # e.g. a revision this code does not know
            raise StorageError(f"{shown_url(url)}: {exc}") from exc


def current(url: str) -> None:
    command.current(alembic_config(url))


def shown_url(url: str) -> str:
    """`url` with its password masked, fit for logs and error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url.partition("://")[0] + "://..."


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what caused it, outermost first."""
    found = [exc]
    while (cause := found[-1].__cause__ or found[-1].__context__) is not None:
        if cause in found:
            break
        found.append(cause)
    return found


def _reason(exc: BaseException, connect_timeout: float) -> str:
    """The driver's own words: the innermost error's first line (a timeout has none)."""
    chain = _chain(exc)
    if any(isinstance(link, TimeoutError) for link in chain):
        return f"no answer within {connect_timeout:g} s"
    innermost = chain[-1]
    text = str(innermost).strip().splitlines()
    return text[0] if text else type(innermost).__name__


def _busy(exc: BaseException) -> bool:
    """Whether `exc` is a migration's wait for a lock running out (`LOCK_TIMEOUT_SECONDS`)."""
    return any(getattr(link, "sqlstate", None) == _BUSY for link in _chain(exc))


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` means the database is not there (yet), rather than that it refused."""
    for link in _chain(exc):
        if isinstance(link, OSError):  # refused, reset, timed out, name not resolved
            return True
        sqlstate = getattr(link, "sqlstate", None)
        if isinstance(sqlstate, str) and sqlstate.startswith(_NOT_YET):
            return True
    return False
