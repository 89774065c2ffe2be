"""Storage errors: what callers may catch. Never HTTP errors; the proxy maps them.

StorageError
├── StorageUnavailable   the database cannot be reached or refused the operation
├── NotFoundError        no such row for this tenant (foreign ids look exactly the same)
└── ConflictError        the row exists already (e.g. a client-chosen id taken)
"""

from __future__ import annotations


class StorageError(Exception):
    pass


class StorageUnavailable(StorageError):
    pass


class NotFoundError(StorageError):
    pass


class ConflictError(StorageError):
    pass


class StaleConversation(StorageError):
    pass
