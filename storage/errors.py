"""Storage errors: what callers may catch. Never HTTP errors; the proxy maps them.

StorageError
├── StorageUnavailable   the database cannot be reached or refused the operation
│   └── StorageTimeout   the database did not answer in time
├── ConflictError        the row exists already (e.g. a client-chosen id taken)
├── StaleConversation    a conversation changed since it was read; read it again
├── BrokenChain          a stored response's `previous_response_id` chain cannot be followed
└── UnknownCursor        a page's `after` names nothing in the list

The last two describe the caller's request, not the database: callers catch them (left
uncaught, the edge would answer them as storage failures).
"""

from __future__ import annotations


class StorageError(Exception):
    pass


class StorageUnavailable(StorageError):
    pass


class StorageTimeout(StorageUnavailable):
    pass


class ConflictError(StorageError):
    pass


class StaleConversation(StorageError):
    pass


class BrokenChain(StorageError):
    """A response's chain names an earlier response that is not there (deleted, stored with
    `store: false`, another user's, gone with retention) or is longer than was allowed;
    `missing` is the id that could not be followed (None: too long)."""

    def __init__(self, message: str, missing: str | None) -> None:
        super().__init__(message)
        self.missing = missing


class UnknownCursor(StorageError):
    """A page's `after` is not the id of an entry of the list."""
