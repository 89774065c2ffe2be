"""API keys -> tenant and scopes."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from proxy.core.config import Config, Scope, TenantConfig
from proxy.core.config_file import tenant_keys
from proxy.core.errors import AuthenticationFailed, PermissionDenied


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant a key belongs to, and what the key may do."""

    tenant_id: str
    tenant: TenantConfig
    scopes: frozenset[Scope]


class KeyRing:
    """Resolves bearer keys. Keys are held only as SHA-256 digests."""

    def __init__(self, config: Config) -> None:
        self._tenants = config.tenants
        # Bucketed by a digest prefix; the full digest is then compared in constant time, so
        # response timing says nothing about how much of a guessed key was right.
        self._buckets: dict[str, list[tuple[str, str, frozenset[Scope]]]] = {}
        for digest, (tenant_id, scopes) in tenant_keys(config).items():
            self._buckets.setdefault(digest[:8], []).append((digest, tenant_id, scopes))

    def authenticate(self, authorization: str | None, scope: Scope) -> Principal:
        if not authorization:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        kind, _, key = authorization.partition(" ")
        key = key.strip()
        if kind.lower() != "bearer" or not key:
            raise AuthenticationFailed("Malformed Authorization header; expected 'Bearer <key>'.")
        digest = hashlib.sha256(key.encode()).hexdigest()
        match = next(
            (
                entry
                for entry in self._buckets.get(digest[:8], ())
                if hmac.compare_digest(entry[0], digest)
            ),
            None,
        )
        if match is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        _, tenant_id, scopes = match
        if scope not in scopes:
            raise PermissionDenied(f"This API key lacks the '{scope}' scope needed here.")
        return Principal(tenant_id, self._tenants[tenant_id], scopes)


def bearer_or_api_key(authorization: str | None, api_key: str | None) -> str | None:
    """The credentials a request presents as an `Authorization` value: the header itself, or
    an `x-api-key` header (Anthropic's SDKs send the key there) as a bearer key."""
    if authorization or not api_key:
        return authorization
    return f"Bearer {api_key.strip()}"
