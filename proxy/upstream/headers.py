"""Which upstream response headers reach the client, and under what name."""

from __future__ import annotations

from collections.abc import Iterable

# Hop-by-hop headers (RFC 9110 7.6.1) and those that describe a body we re-frame or decode.
_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "content-type",  # set by the response we build
        "server",
        "date",
        "set-cookie",
        "alt-svc",
    }
)
_RENAME = {"x-request-id": "x-upstream-request-id"}


def passthrough_headers(raw: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Upstream headers as the client should see them (names lower-cased)."""
    items = list(raw)
    # Headers named in `Connection` are hop-by-hop too (RFC 9110 7.6.1).
    nominated = {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
    }
    out: dict[str, str] = {}
    for name, value in items:
        lname = name.lower()
        if lname in _DROP or lname in nominated:
            continue
        out[_RENAME.get(lname, lname)] = value
    return out
