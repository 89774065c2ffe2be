"""`tenants.<name>.api_keys` and `.identity`: who a key is and where a tenant's users come from
(docs/concepts/trust-model.md).

Part of the configuration's models (`proxy.core.config`), kept apart for its length.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):  # (one per module of the models: ruff sees pydantic's own base)
    model_config = ConfigDict(extra="forbid", frozen=True)


Scope = Literal["chat", "manage"]
# User ids no route takes: path segments every URL client rewrites (RFC 3986 section 5.2.4;
# "%2E" too, by the WHATWG URL standard), so a user so named could never be reached at
# /v1/memory/users/{user_id}.
DOT_SEGMENTS = frozenset({".", ".."})
MAX_USER_ID = 256  # characters, as OpenAI's `user`


def user_id_problem(value: object, *, stored_before: bool = False) -> str | None:
    """Why `value` is not a user id every route takes, or None: a non-empty string of at most
    MAX_USER_ID characters, without NUL, and not `.` or `..` (unless `stored_before`: a route
    that only finds or erases what is stored takes those, for users named so before they were
    refused). The one rule for headers, bodies, URLs, bound keys and tokens' `sub`."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_USER_ID:
        return f"must be a non-empty string of at most {MAX_USER_ID} characters"
    if "\x00" in value:
        return "must not contain the NUL character"
    if value in DOT_SEGMENTS and not stored_before:
        return (
            "cannot be '.' or '..': URL clients rewrite those path segments, so the user's "
            "export and erasure could not be reached"
        )
    return None


class ApiKeyConfig(_Strict):
    key: str = Field(min_length=1)
    scopes: list[Scope] = ["chat", "manage"]
    # The one user this key acts as (docs/concepts/trust-model.md); null: any user the
    # request names.
    user: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("user")
    @classmethod
    def _a_user_id(cls, user: str | None) -> str | None:
        """What every route takes as a user id."""
        if user is not None and (problem := user_id_problem(user)):
            raise ValueError(f"a user id {problem}")
        return user


# The algorithms a user token may be signed with ("none" is never one of them).
HMAC_ALGORITHMS = ("HS256", "HS384", "HS512")
TokenAlgorithm = Literal[
    "HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256",
    "ES384", "ES512", "EdDSA",
]  # fmt: skip


class IdentityConfig(_Strict):
    """Who a request may act as (docs/concepts/trust-model.md). `header`: the user the request names
    (`X-Memory-User-Id`, else the body's), for a trusted backend that sets it. `token`: the
    `sub` of a JWT in `X-Memory-User-Token`, signed with this tenant's own key material."""

    mode: Literal["header", "token"] = "header"
    algorithms: list[TokenAlgorithm] = []
    # Exactly one, in token mode: an HMAC secret (HS*), or a public key (PEM) or a JWKS
    # document (JSON), read from a file, for the others.
    secret: str | None = Field(None, min_length=32)
    public_key_file: str | None = Field(None, min_length=1)
    jwks_file: str | None = Field(None, min_length=1)
    audience: str | None = Field(None, min_length=1)
    issuer: str | None = Field(None, min_length=1)
    leeway_seconds: float = Field(30.0, ge=0, le=300)
    # A request without a token acts as `anonymous` rather than being refused (401).
    allow_anonymous: bool = False

    @model_validator(mode="after")
    def _complete(self) -> IdentityConfig:
        material = [n for n in ("secret", "public_key_file", "jwks_file") if getattr(self, n)]
        if self.mode == "header":
            extra = (
                material
                + [n for n in ("audience", "issuer") if getattr(self, n) is not None]
                + (["algorithms"] if self.algorithms else [])
            )
            if extra or self.allow_anonymous:
                raise ValueError(
                    f"{(extra or ['allow_anonymous'])[0]} is a setting of mode: token "
                    "(mode is header)"
                )
            return self
        if not self.algorithms:
            raise ValueError("mode: token needs algorithms (e.g. [HS256] or [RS256])")
        if len(material) != 1:
            raise ValueError(
                "mode: token needs exactly one of secret, public_key_file or jwks_file"
            )
        hmac = [a for a in self.algorithms if a in HMAC_ALGORITHMS]
        if hmac and (len(hmac) != len(self.algorithms) or not self.secret):
            # One key read as both an HMAC secret and a public key lets a public key sign.
            raise ValueError(
                "HS* algorithms go with a secret alone, the others with public_key_file or "
                "jwks_file alone"
            )
        if not hmac and self.secret:
            raise ValueError("a secret signs HS256, HS384 or HS512 tokens only")
        return self
