"""Signed user tokens (`identity: {mode: token}`): a JWT in `X-Memory-User-Token` whose `sub`
is the user a request acts as (docs/concepts/trust-model.md).

The application's backend signs a short-lived token for its signed-in user; the browser or app
sends it beside the tenant's key. Each tenant verifies with its own key material, so a token
made for one tenant is refused by every other. PyJWT does the cryptography; this module pins
what it is asked: the tenant's algorithms only (never `none`, and never an HMAC algorithm
with a public key), `exp` and `sub` required, `nbf` and `iat` honoured with the leeway, and
`aud`/`iss` when the tenant sets them. PyJWT is imported by the first tenant that verifies
tokens (9 MB that a process without one never holds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.core.config import ConfigError
from proxy.core.config_identity import IdentityConfig, user_id_problem
from proxy.core.errors import AuthenticationFailed

if TYPE_CHECKING:
    import jwt

REQUIRED_CLAIMS = ("exp", "sub")


class InvalidUserToken(AuthenticationFailed):
    """401: the user token is missing, malformed, unverifiable, expired or not yet valid."""

    code = "invalid_user_token"


class UserTokens:
    """One tenant's verifier; built from its `identity:` settings (reading any key file),
    a `ConfigError` naming the key when they cannot be used."""

    def __init__(self, tenant: str, settings: IdentityConfig) -> None:
        import jwt

        self.settings = settings
        self._where = f"tenants.{tenant}.identity"
        self._key: Any = None
        self._jwks: jwt.PyJWKSet | None = None
        if settings.secret is not None:
            self._key = settings.secret
        elif settings.public_key_file is not None:
            self._key = self._public_key(self._read("public_key_file", settings.public_key_file))
        elif settings.jwks_file is not None:
            raw = self._read("jwks_file", settings.jwks_file)
            try:
                self._jwks = jwt.PyJWKSet.from_dict(json.loads(raw))
            except (ValueError, jwt.PyJWKError) as exc:
                raise ConfigError(f"{self._where}.jwks_file: not a usable JWKS ({exc})") from None

    def _read(self, name: str, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise ConfigError(
                f"{self._where}.{name}: cannot read {path} ({exc.strerror})"
            ) from None

    def _public_key(self, pem: str) -> Any:
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        try:
            return load_pem_public_key(pem.encode())
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{self._where}.public_key_file: not a PEM public key ({exc})"
            ) from None

    def user(self, token: str) -> str:
        """The user `token` names, verified; `InvalidUserToken` (401) saying why not."""
        import jwt

        settings = self.settings
        try:
            key = self._key if self._jwks is None else self._jwk(token)
            claims = jwt.decode(
                token,
                key,
                algorithms=list(settings.algorithms),
                audience=settings.audience,
                issuer=settings.issuer,
                leeway=settings.leeway_seconds,
                options={"require": list(REQUIRED_CLAIMS)},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidUserToken("The user token has expired.") from None
        except jwt.ImmatureSignatureError:
            raise InvalidUserToken("The user token is not valid yet (nbf or iat).") from None
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidUserToken(f"The user token has no '{exc.claim}' claim.") from None
        except jwt.InvalidAudienceError:
            raise InvalidUserToken("The user token is for another audience (aud).") from None
        except jwt.InvalidIssuerError:
            raise InvalidUserToken("The user token is from another issuer (iss).") from None
        except jwt.InvalidAlgorithmError:
            allowed = ", ".join(settings.algorithms)
            raise InvalidUserToken(
                f"The user token's algorithm is not one this tenant accepts ({allowed})."
            ) from None
        except jwt.InvalidSignatureError:
            raise InvalidUserToken(
                "The user token's signature does not verify with this tenant's key."
            ) from None
        except jwt.PyJWTError as exc:  # (malformed, undecodable, a key that does not fit)
            raise InvalidUserToken(f"The user token is not valid ({exc}).") from None
        return check_subject(claims["sub"])

    def _jwk(self, token: str) -> Any:
        """The JWKS key the token's header names (`kid`); the only one when there is one."""
        import jwt

        assert self._jwks is not None
        kid = jwt.get_unverified_header(token).get("kid")
        keys = self._jwks.keys
        if kid is None and len(keys) == 1:
            return keys[0].key
        for jwk in keys:
            if jwk.key_id is not None and jwk.key_id == kid:
                return jwk.key
        raise InvalidUserToken("The user token's key (kid) is not in this tenant's JWKS.")


def check_subject(sub: Any) -> str:
    """`sub` as a user id (as `X-Memory-User-Id` would have to be)."""
    problem = user_id_problem(sub)
    if problem:
        raise InvalidUserToken(f"The user token's 'sub' {problem}.")
    return sub  # type: ignore[no-any-return]
