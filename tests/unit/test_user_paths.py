"""`routed_path`: a users route's user id stays one segment, and decodes back to itself."""

from __future__ import annotations

from urllib.parse import quote, unquote

import pytest

from proxy.core.user_paths import PREFIX, routed_path, user_in_path


@pytest.mark.parametrize(
    "user", ["alice", "team/alice", "50%2Fx", "a%", "/", "..", "é 👋?#&", "x/export"]
)
@pytest.mark.parametrize("suffix", ["", "/export"])
def test_a_user_id_is_one_segment_that_decodes_to_itself(user: str, suffix: str) -> None:
    raw = f"/v1/memory/users/{quote(user, safe='')}{suffix}"
    path = routed_path(unquote(raw), raw.encode())
    assert path.startswith(PREFIX)
    segment, slash, rest = path.removeprefix(PREFIX).partition("/")
    assert (user_in_path(segment), slash + rest) == (user, suffix)


def test_the_root_path_is_kept_and_other_paths_are_left_as_the_server_decoded_them() -> None:
    raw = b"/api/v1/memory/users/team%2Falice/export"
    assert routed_path("/api/v1/memory/users/team/alice/export", raw, "/api") == (
        "/api/v1/memory/users/team%2Falice/export"
    )
    assert routed_path("/v1/memory/conversations/a/b", b"/v1/memory/conversations/a%2Fb") == (
        "/v1/memory/conversations/a/b"
    )
    assert routed_path("/v1/memory/users/x", None) == "/v1/memory/users/x"
    # A raw path that still holds the query (Litestar's test client sends one so).
    assert routed_path("/v1/memory/users/a/b/export", b"/v1/memory/users/a%2Fb/export?x=1") == (
        "/v1/memory/users/a%2Fb/export"
    )
