"""Who is calling, and as which user (docs/concepts/trust-model.md): the one place that decides.

A key names its tenant and scopes, and may be bound to one user. A tenant's `identity.mode`
says where its users come from: `header` trusts the user the request names (a backend that
sets `X-Memory-User-Id` itself); `token` takes it from a signed JWT (`X-Memory-User-Token`,
proxy/core/user_tokens.py) and refuses the header; there an operator's manage-only key needs
no token (`operator_key`). The result is a `Principal` whose `user`,
when set, is the only user the request may act as, everywhere: the turn pipeline
(proxy/pipeline/identify.py), the Responses API's stored responses and the management API.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, replace
from typing import Literal

from litestar.datastructures import Headers

from proxy.core.config import Config, Scope, TenantConfig
from proxy.core.config_file import tenant_keys
from proxy.core.errors import AuthenticationFailed, BadRequest, PermissionDenied
from proxy.core.requests import header_value
from proxy.core.user_tokens import InvalidUserToken, UserTokens

USER_HEADER = "X-Memory-User-Id"
TOKEN_HEADER = "X-Memory-User-Token"
ANONYMOUS = "anonymous"
# Headers that say who and what a request is: given twice, a gateway that appends its own
# value rather than replacing the client's would be bypassed (the first one won).
_SINGLE = ("idempotency-key", "authorization")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant a key belongs to, what the key may do, and the one user the
    request may act as (`user`; None: any user it names, in header mode with a key bound to
    none) and what bound it (`bound_by`)."""

    tenant_id: str
    tenant: TenantConfig
    scopes: frozenset[Scope]
    user: str | None = None
    bound_by: Literal["key", "token"] | None = None

    def only(self, named: str | None, param: str = "user") -> str | None:
        """The user a management call is about: the one it names (any, or none for all), or
        for bound credentials their own user, and a 403 when it names another."""
        if self.user is None:
            return named
        if named is not None and named != self.user:
            raise not_allowed(self, named, param)
        return self.user

    def sees(self, user_id: str) -> bool:
        """Whether the request may see or change `user_id`'s data (another's is not found)."""
        return self.user is None or user_id == self.user

    def whole_tenant(self) -> None:
        """403 for bound credentials: what follows is about every user of the tenant."""
        if self.user is not None:
            raise PermissionDenied(
                f"This request acts as user '{self.user}' only; this endpoint covers every "
                "user of the tenant.",
                code="user_bound",
            )


def not_allowed(principal: Principal, named: str, param: str) -> PermissionDenied:
    what = "API key is bound to" if principal.bound_by == "key" else "user token names"
    return PermissionDenied(
        f"This {what} user '{principal.user}'; it cannot act as '{named}'.",
        param=param,
        code="user_not_allowed",
    )


class KeyRing:
    """Resolves bearer keys, and the user each request acts as. Keys are held only as SHA-256
    digests."""

    def __init__(self, config: Config) -> None:
        self._tenants = config.tenants
        # Bucketed by a digest prefix; the full digest is then compared in constant time, so
        # response timing says nothing about how much of a guessed key was right.
        self._buckets: dict[str, list[tuple[str, str, frozenset[Scope], str | None]]] = {}
        for digest, (tenant_id, scopes, user) in tenant_keys(config).items():
            self._buckets.setdefault(digest[:8], []).append((digest, tenant_id, scopes, user))
        self._tokens = {
            name: UserTokens(name, tenant.identity)
            for name, tenant in config.tenants.items()
            if tenant.identity.mode == "token"
        }

    def authenticate(self, authorization: str | None, scope: Scope) -> Principal:
        """The key's tenant, scopes and bound user (401 unknown key, 403 scope)."""
        if not authorization:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        kind, _, key = authorization.partition(" ")
        key = key.strip()
        if kind.lower() != "bearer" or not key:
            raise AuthenticationFailed("Malformed Authorization header; expected 'Bearer <key>'.")
        return self.by_digest(key_digest(key), scope)

    def by_digest(self, digest: str, scope: Scope) -> Principal:
        """The key whose SHA-256 digest (hex) this is, as `authenticate` (401 unknown key, 403
        scope): the web inspector's session holds the digest, not the key."""
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
        _, tenant_id, scopes, user = match
        if scope not in scopes:
            raise PermissionDenied(f"This API key lacks the '{scope}' scope needed here.")
        return Principal(tenant_id, self._tenants[tenant_id], scopes, user, "key" if user else None)

    def principal_for(
        self, headers: Headers, scope: Scope, *, x_api_key: bool = False
    ) -> Principal:
        """Who a request is and which user it acts as, from its headers: the key, then the
        tenant's identity mode (see the module's docstring). `x_api_key`: the route takes the
        key in `x-api-key` too (Anthropic's)."""
        refuse_repeated(headers)
        authorization = headers.get("authorization")
        if x_api_key:
            authorization = bearer_or_api_key(authorization, headers.get("x-api-key"))
        return self.identify(self.authenticate(authorization, scope), headers)

    def identify(self, principal: Principal, headers: Headers) -> Principal:
        """The user a key's request acts as, by its tenant's identity mode (see the module's
        docstring)."""
        tokens = self._tokens.get(principal.tenant_id)
        named = header_value(headers, USER_HEADER)
        if tokens is None:
            if headers.get(TOKEN_HEADER) is not None:
                raise BadRequest(
                    f"This tenant does not take {TOKEN_HEADER} (its identity mode is header).",
                    param=TOKEN_HEADER,
                    code="user_token_not_accepted",
                )
            if named is not None and principal.user is not None and named != principal.user:
                raise not_allowed(principal, named, USER_HEADER)
            return principal
        if named is not None:
            raise BadRequest(
                f"This tenant takes its users from signed tokens ({TOKEN_HEADER}); "
                f"{USER_HEADER} is not accepted.",
                param=USER_HEADER,
                code="user_header_not_accepted",
            )
        token = headers.get(TOKEN_HEADER)
        if not token:
            if operator_key(principal):
                return principal  # the tenant's own operators: every user, by name
            if not tokens.settings.allow_anonymous:
                raise InvalidUserToken(
                    f"This tenant needs a signed user token in {TOKEN_HEADER}.",
                    param=TOKEN_HEADER,
                )
            user = ANONYMOUS
        else:
            user = tokens.user(token)
        if principal.user is not None and user != principal.user:
            raise not_allowed(principal, user, TOKEN_HEADER)
        return replace(principal, user=user, bound_by="token")


def key_digest(key: str) -> str:
    """A presented key's SHA-256 digest, in hex: always hashed (a `sha256:<hex>` string is a
    config's way to hold a key, never a key a caller may present)."""
    return hashlib.sha256(key.encode()).hexdigest()


def operator_key(principal: Principal) -> bool:
    """A key that may manage a token-mode tenant without a user token: `manage` alone (no
    `chat`: such a key has no business in an app) and bound to no user. It covers every user
    of the tenant, as a header-mode backend's key does: the inspector's and your backend's
    tenant-wide views (usage, jobs, limits). With a token it acts as that user alone."""
    return "chat" not in principal.scopes and principal.user is None


def refuse_repeated(headers: Headers) -> None:
    """400 for a request carrying an `X-Memory-*` header (or Idempotency-Key, Authorization)
    more than once."""
    seen: set[str] = set()
    for key, _ in headers.items():
        lower = key.lower()
        if not (lower.startswith("x-memory-") or lower in _SINGLE):
            continue
        if lower in seen:
            name = "-".join(part.capitalize() for part in lower.split("-"))  # X-Memory-User-Id
            raise BadRequest(
                f"The {name} header is given more than once; send it once.",
                param=name,
                code="duplicate_header",
            )
        seen.add(lower)


def bearer_or_api_key(authorization: str | None, api_key: str | None) -> str | None:
    """The credentials a request presents as an `Authorization` value: the header itself, or
    an `x-api-key` header (Anthropic's SDKs send the key there) as a bearer key."""
    if authorization or not api_key:
        return authorization
    return f"Bearer {api_key.strip()}"
