"""Storage errors: what callers may catch. Never HTTP errors; the proxy maps them.

StorageError
├── StorageUnavailable   the database cannot be reached or refused the operation
│   └── StorageTimeout   the database did not answer in time
├── ConflictError        the row exists already (e.g. a client-chosen id taken)
└── StaleConversation    a conversation changed since it was read; read it again
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
