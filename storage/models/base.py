"""The declarative base and the key type every table uses."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Integer,
)
from sqlalchemy.orm import DeclarativeBase

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY. Its tables are
# AUTOINCREMENT (migration 0012): a deleted row's key is never given to another, as on
# PostgreSQL, since what still holds it (a turn, a job, a spilled exchange) must not name a row
# that may be another user's.
PK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        datetime: DateTime(timezone=True),
    }
