"""Who a request acts as (proxy/core/auth.py, proxy/core/user_tokens.py): keys bound to a user,
signed user tokens and everything that must make a token fail, repeated headers."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from litestar.datastructures import Headers

from proxy.core.auth import KeyRing, Principal
from proxy.core.config import ApiKeyConfig, Config, IdentityConfig, Scope, TenantConfig
from proxy.core.errors import AuthenticationFailed, BadRequest, PermissionDenied, ProxyError

SECRET_A = "tenant-a-secret-" + "a" * 32
SECRET_B = "tenant-b-secret-" + "b" * 32


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@pytest.fixture
def ring(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> KeyRing:
    """Tenants: `a` and `b` (HS256, each its own secret), `rs` (RS256, a public key file, with
    audience and issuer), `jwks` (a JWKS file), `anon` (tokens optional), `hdr` (header mode,
    with a key bound to alice)."""
    pem = tmp_path / "public.pem"
    pem.write_bytes(public_pem(rsa_key))
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig"}]}))
    hs = {"mode": "token", "algorithms": ["HS256"]}
    return KeyRing(
        Config(
            tenants={
                "a": TenantConfig(
                    api_keys=["key-a", ApiKeyConfig(key="key-a-bob", user="bob")],
                    identity=IdentityConfig(**hs, secret=SECRET_A),
                ),
                "b": TenantConfig(
                    api_keys=["key-b"], identity=IdentityConfig(**hs, secret=SECRET_B)
                ),
                "rs": TenantConfig(
                    api_keys=["key-rs"],
                    identity=IdentityConfig(
                        mode="token",
                        algorithms=["RS256"],
                        public_key_file=str(pem),
                        audience="memproxy",
                        issuer="https://app.example",
                        leeway_seconds=0,
                    ),
                ),
                "jwks": TenantConfig(
                    api_keys=["key-jwks"],
                    identity=IdentityConfig(
                        mode="token", algorithms=["RS256"], jwks_file=str(jwks)
                    ),
                ),
                "anon": TenantConfig(
                    api_keys=["key-anon"],
                    identity=IdentityConfig(**hs, secret=SECRET_A + "x", allow_anonymous=True),
                ),
                "hdr": TenantConfig(
                    api_keys=[
                        "key-hdr",
                        ApiKeyConfig(key="key-hdr-alice", scopes=["chat"], user="alice"),
                    ]
                ),
            }
        )
    )


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    found = {"sub": "alice", "exp": now + 300, "iat": now}
    found.update(over)
    return {k: v for k, v in found.items() if v is not None}


def hs(secret: str = SECRET_A, **over: Any) -> str:
    return jwt.encode(claims(**over), secret, algorithm="HS256")


def rs_claims(**over: Any) -> dict[str, Any]:
    return claims(**{"aud": "memproxy", "iss": "https://app.example", **over})


def rs(key: rsa.RSAPrivateKey, headers: dict[str, Any] | None = None, **over: Any) -> str:
    return jwt.encode(rs_claims(**over), key, algorithm="RS256", headers=headers)


def call(
    ring: KeyRing, key: str, token: str | None = None, scope: Scope = "chat", **headers: str
) -> Principal:
    raw = [("authorization", f"Bearer {key}")]
    if token is not None:
        raw.append(("x-memory-user-token", token))
    raw += [(k.replace("_", "-"), v) for k, v in headers.items()]
    return ring.principal_for(Headers([(k.encode(), v.encode()) for k, v in raw]), scope)


def refused(ring: KeyRing, key: str, token: str | None, **headers: str) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        call(ring, key, token, **headers)
    return info.value


def test_a_valid_token_acts_as_its_subject(ring: KeyRing, rsa_key: rsa.RSAPrivateKey) -> None:
    principal = call(ring, "key-a", hs())
    assert (principal.user, principal.bound_by) == ("alice", "token")
    assert call(ring, "key-rs", rs(rsa_key, sub="bob")).user == "bob"
    jwks = rs(rsa_key, headers={"kid": "k1"}, aud=None, iss=None)
    assert call(ring, "key-jwks", jwks).user == "alice"


def b64(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def token_failures(rsa_key: rsa.RSAPrivateKey) -> dict[str, tuple[str, str, str]]:
    """name -> (key, token, what the 401 says)."""
    now = int(time.time())
    unsigned = b".".join(
        [b64(b'{"alg":"none","typ":"JWT"}'), b64(json.dumps(claims()).encode()), b""]
    ).decode()
    # HS/RS confusion: HS256 "signed" with the RSA public key's PEM as the HMAC secret (PyJWT
    # refuses to sign with a PEM, so the signature is made by hand).
    signed = b64(b'{"alg":"HS256","typ":"JWT"}') + b"." + b64(json.dumps(rs_claims()).encode())
    mac = hmac.new(public_pem(rsa_key), signed, hashlib.sha256).digest()
    confused = (signed + b"." + b64(mac)).decode()
    other_rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return {
        "expired": ("key-a", hs(exp=now - 120), "expired"),
        "not yet valid": ("key-a", hs(nbf=now + 120), "not valid yet"),
        "wrong signature": ("key-a", hs("another-secret-" + "z" * 32), "signature"),
        "tampered": ("key-a", hs()[:-4] + "AAAA", "signature"),
        "alg none": ("key-a", unsigned, "algorithm"),
        "hs/rs confusion": ("key-rs", confused, "algorithm"),
        "another tenant's": ("key-a", hs(SECRET_B), "signature"),
        "no sub": ("key-a", hs(sub=None), "'sub'"),
        "no exp": ("key-a", hs(exp=None), "'exp'"),
        "empty sub": ("key-a", hs(sub=""), "'sub'"),
        "sub not a string": ("key-a", hs(sub=7), "not valid"),
        "wrong audience": ("key-rs", rs(rsa_key, aud="another-app"), "audience"),
        "no audience": ("key-rs", rs(rsa_key, aud=None), "'aud'"),
        "wrong issuer": ("key-rs", rs(rsa_key, iss="https://evil.example"), "issuer"),
        "another RSA key": ("key-rs", rs(other_rsa), "signature"),
        "unknown kid": ("key-jwks", rs(rsa_key, {"kid": "k2"}, aud=None, iss=None), "kid"),
        "garbage": ("key-a", "not.a.token", "not valid"),
        "missing": ("key-a", "", "needs a signed user token"),
    }


def test_every_bad_token_is_a_401_saying_why(ring: KeyRing, rsa_key: rsa.RSAPrivateKey) -> None:
    for name, (key, token, why) in token_failures(rsa_key).items():
        error = refused(ring, key, token or None)
        assert isinstance(error, AuthenticationFailed), name
        assert (error.status, error.code) == (401, "invalid_user_token"), name
        assert why in error.message, (name, error.message)
        assert token[:20] not in error.message or not token, name  # (never echoed)


def test_leeway_covers_clock_skew_and_no_more(ring: KeyRing) -> None:
    now = int(time.time())
    assert call(ring, "key-a", hs(exp=now - 10)).user == "alice"  # (30 s leeway)
    assert call(ring, "key-a", hs(nbf=now + 10)).user == "alice"
    assert refused(ring, "key-a", hs(exp=now - 60)).status == 401


def test_token_mode_refuses_the_user_header(ring: KeyRing) -> None:
    error = refused(ring, "key-a", hs(), x_memory_user_id="alice")
    assert isinstance(error, BadRequest)
    assert (error.param, error.code) == ("X-Memory-User-Id", "user_header_not_accepted")


def test_anonymous_only_where_the_tenant_allows_it(ring: KeyRing) -> None:
    assert call(ring, "key-anon").user == "anonymous"
    assert call(ring, "key-anon", hs(SECRET_A + "x", sub="carol")).user == "carol"
    assert refused(ring, "key-anon", hs()).status == 401  # (a bad token is not anonymous)
    assert refused(ring, "key-a", None).status == 401


def test_a_bound_key_acts_only_as_its_user(ring: KeyRing) -> None:
    principal = call(ring, "key-hdr-alice")
    assert (principal.user, principal.bound_by) == ("alice", "key")
    assert call(ring, "key-hdr-alice", x_memory_user_id="alice").user == "alice"
    error = refused(ring, "key-hdr-alice", None, x_memory_user_id="bob")
    assert isinstance(error, PermissionDenied)
    assert (error.status, error.code, error.param) == (403, "user_not_allowed", "X-Memory-User-Id")
    # An unbound key in header mode acts as whoever the request names (the trusted backend).
    assert call(ring, "key-hdr", x_memory_user_id="bob").user is None
    # A bound key in token mode: the token must name its user too.
    assert call(ring, "key-a-bob", hs(sub="bob")).user == "bob"
    assert refused(ring, "key-a-bob", hs(sub="alice")).status == 403


def test_header_mode_refuses_a_user_token(ring: KeyRing) -> None:
    error = refused(ring, "key-hdr", hs())
    assert (error.status, error.code) == (400, "user_token_not_accepted")


@pytest.mark.parametrize(
    "name", ["X-Memory-User-Id", "x-memory-mode", "X-Memory-User-Token", "Idempotency-Key"]
)
def test_a_header_given_twice_is_a_400(ring: KeyRing, name: str) -> None:
    raw = [(b"authorization", b"Bearer key-hdr"), (name.encode(), b"one"), (name.encode(), b"two")]
    with pytest.raises(BadRequest) as info:
        ring.principal_for(Headers(raw), "chat")
    assert (info.value.code, info.value.param) == ("duplicate_header", name.title())


def test_management_calls_of_bound_credentials_see_their_user_only(ring: KeyRing) -> None:
    bound = call(ring, "key-a", hs(), scope="manage")
    assert bound.only(None) == "alice" and bound.only("alice") == "alice"
    with pytest.raises(PermissionDenied):
        bound.only("bob")
    assert bound.sees("alice") and not bound.sees("bob")
    with pytest.raises(PermissionDenied):
        bound.whole_tenant()
    unbound = call(ring, "key-hdr", scope="manage")
    assert unbound.only(None) is None and unbound.only("bob") == "bob" and unbound.sees("bob")
    unbound.whole_tenant()
