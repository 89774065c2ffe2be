"""The inspector's session and CSRF secrets: from `server.ui_secret`, the same on every
replica; without it, made per process, with a warning that says what that costs."""

from __future__ import annotations

from structlog.testing import capture_logs

from proxy.core.config import ServerConfig
from proxy.ui.session import session_secrets


def test_a_configured_secret_gives_every_replica_the_same_keys_and_no_warning() -> None:
    server = ServerConfig(ui_secret="a-long-enough-shared-secret")
    with capture_logs() as logs:
        one, two = session_secrets(server), session_secrets(server)
    assert one == two and len(one[0]) == 32 and one[1] != one[0].hex()
    assert logs == []


def test_without_one_each_process_makes_its_own_and_says_sessions_will_not_last() -> None:
    with capture_logs() as logs:
        one, two = session_secrets(ServerConfig()), session_secrets(ServerConfig())
    assert one != two
    assert [entry["event"] for entry in logs] == ["ui_secret_unset"] * 2
    assert "end when this process restarts" in logs[0]["detail"]
