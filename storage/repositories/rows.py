"""Mapping between table rows and the plain records of storage/records.py."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Table

# Python-side names that differ from the column's (`metadata` is reserved on ORM classes).
_RENAMED = {"meta": "metadata"}


def columns(table: Table, record: type[Any]) -> list[ColumnElement[Any]]:
    """The table's columns for each field of `record`, labelled with the field's name."""
    return [table.c[_RENAMED.get(f.name, f.name)].label(f.name) for f in dataclasses.fields(record)]


def utc(when: datetime) -> datetime:
    """Aware UTC (SQLite hands datetimes back naive)."""
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def utc_row(row: Any) -> dict[str, Any]:
    """A row as a dict, datetimes as aware UTC (SQLite hands them back naive)."""
    out = dict(row._mapping)
    for key, value in out.items():
        if isinstance(value, datetime):
            out[key] = utc(value)
    return out
