"""Hashes that name something of a tenant without storing it: search index scope tokens (a
user, an attachment) and the user of an erasure record.

blake2b of the tenant id and the value, NUL-separated. The digest size is part of blake2b's
parameters, so digests of different sizes of the same input are unrelated.
"""

from __future__ import annotations

import hashlib


def tenant_digest(tenant_id: str, value: str, *, size: int) -> str:
    """The hex digest of `size` bytes naming `value` within the tenant."""
    return hashlib.blake2b(f"{tenant_id}\x00{value}".encode(), digest_size=size).hexdigest()
