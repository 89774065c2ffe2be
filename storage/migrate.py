"""Applying migrations: at start-up (`create_app`) and by `memproxy migrate`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str) -> AlembicConfig:
    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would read a '%' in a password as a placeholder.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` up to `revision`. Blocking: call it in a thread."""
    command.upgrade(alembic_config(url), revision)


def current(url: str) -> None:
    command.current(alembic_config(url))
