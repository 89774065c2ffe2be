"""User ids in paths: `/v1/memory/users/{user_id}` for every user id, "/" and "%" included.

A user id is any string of up to 256 characters (OpenAI's `user`), so "team/alice" is one. A
client sends it percent-encoded (`/v1/memory/users/team%2Falice`), but the ASGI server decodes
the path before Litestar routes it, and the "/" that comes back splits the id in two: the
erasure answered 404 for such a user, and the export of "team/export" was that of "team".

`keep_user_ids_whole` goes before Litestar's router (which has no hook of its own there): it
rebuilds the path of those routes from the raw one the server got (`raw_path`, which uvicorn,
hypercorn and granian all give), with the user id's "%" and "/" still encoded, so the id stays
one path segment; `user_in_path` decodes the path parameter back to the id.
"""

from __future__ import annotations

from urllib.parse import unquote

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

PREFIX = "/v1/memory/users/"
_RAW_PREFIX = PREFIX.encode()


def routed_path(path: str, raw_path: bytes | None, root_path: str = "") -> str:
    """The path to route for a request to `path` (as the server decoded it), sent as
    `raw_path` (with `root_path` before it, as uvicorn gives it): for the users routes, the
    user id segment decoded but for "%" and "/"; any other path as it is."""
    raw = (raw_path or b"").partition(b"?")[0]  # (some servers and test clients keep it)
    root = root_path.encode()
    if root and raw.startswith(root):
        raw = raw[len(root) :]
    if not raw.startswith(_RAW_PREFIX):
        return path
    segment, slash, rest = raw[len(_RAW_PREFIX) :].decode("latin-1").partition("/")
    user = unquote(segment).replace("%", "%25").replace("/", "%2F")
    return f"{root_path}{PREFIX}{user}{slash}{unquote(rest)}"


def user_in_path(value: str) -> str:
    """The user id a users route's path parameter stands for (`routed_path` left it encoded)."""
    return unquote(value)


def keep_user_ids_whole(app: ASGIApp) -> ASGIApp:
    """`app` (Litestar's handler, before routing) given `routed_path`'s path."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            scope["path"] = routed_path(
                scope["path"], scope.get("raw_path"), scope.get("root_path", "")
            )
        await app(scope, receive, send)

    return route
