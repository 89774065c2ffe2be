from __future__ import annotations

import hashlib

import pytest

from proxy.core.auth import KeyRing
from proxy.core.config import Config, TenantConfig
from proxy.core.errors import AuthenticationFailed, PermissionDenied


def ring() -> KeyRing:
    stored = "sha256:" + hashlib.sha256(b"hashed-key").hexdigest()
    return KeyRing(
        Config(
            tenants={
                "a": TenantConfig(api_keys=["key-a", {"key": "chat-a", "scopes": ["chat"]}]),
                "b": TenantConfig(api_keys=[stored]),
            }
        )
    )


def test_bearer_key_names_tenant_and_scopes() -> None:
    principal = ring().authenticate("Bearer key-a", "manage")
    assert principal.tenant_id == "a"
    assert principal.scopes == {"chat", "manage"}
    assert ring().authenticate("bearer hashed-key", "chat").tenant_id == "b"


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Basic key-a", "key-a", "Bearer key-b", "Bearer KEY-A"],
)
def test_missing_malformed_or_unknown_keys_are_401(header: str | None) -> None:
    with pytest.raises(AuthenticationFailed) as info:
        ring().authenticate(header, "chat")
    assert info.value.status == 401
    assert info.value.code == "invalid_api_key"


def test_key_without_the_scope_is_403() -> None:
    assert ring().authenticate("Bearer chat-a", "chat").tenant_id == "a"
    with pytest.raises(PermissionDenied) as info:
        ring().authenticate("Bearer chat-a", "manage")
    assert info.value.status == 403


def test_error_messages_never_echo_the_key() -> None:
    with pytest.raises(AuthenticationFailed) as info:
        ring().authenticate("Bearer sk-very-secret-guess", "chat")
    assert "sk-very-secret-guess" not in info.value.message
