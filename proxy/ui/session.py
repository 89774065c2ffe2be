"""Signing in to the inspector, and who each of its pages is for.

A `manage`-scoped key signs in once; the session cookie then holds the key's SHA-256 digest
(never the key), encrypted and authenticated with a key derived from `server.ui_secret`,
HttpOnly and SameSite=Strict, for `SESSION_HOURS`. Each page looks the digest up again in the
current keys, so a key removed from the config (and reloaded) ends its sessions at once, and
the key's principal (a key bound to a user sees only that user) applies to every page as it
does to the management API. Every change is a form post carrying Litestar's CSRF token
(double submit: a cookie and a form field, HMAC-signed); a post naming another origin is
refused as well.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any
from urllib.parse import urlsplit

import structlog
from litestar import Request, Response, get, post
from litestar.config.csrf import CSRFConfig
from litestar.connection import ASGIConnection
from litestar.datastructures import Headers
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException, PermissionDeniedException
from litestar.handlers import BaseRouteHandler
from litestar.middleware.base import DefineMiddleware
from litestar.middleware.session.base import SessionMiddleware
from litestar.middleware.session.client_side import ClientSideSessionBackend, CookieBackendConfig
from litestar.response import Redirect, Template
from litestar.types import ASGIApp

from proxy.core.auth import Principal, key_digest
from proxy.core.config import ServerConfig
from proxy.core.errors import AuthenticationFailed, ProxyError
from proxy.state import AppState
from storage.errors import StorageError

log = structlog.get_logger("memproxy.ui")

SESSION_COOKIE = "memproxy_ui"
CSRF_COOKIE = "memproxy_csrf"
SESSION_HOURS = 12
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Every page: nothing but memproxy's own files, never in another site's frame, never cached
# (they show a tenant's data), and no address sent elsewhere.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


class NotSignedIn(Exception):
    """No session, or its key is no longer one that may sign in: to the sign-in page."""


def session_secrets(server: ServerConfig) -> tuple[bytes, str]:
    """The session cookie's encryption key and the CSRF tokens' HMAC secret, both derived from
    `server.ui_secret`; without one, made now (and a warning: sessions end on restart and do
    not cross replicas)."""
    if server.ui_secret is None:
        log.warning(
            "ui_secret_unset",
            detail="server.ui_secret is not set: the inspector's sessions end when this "
            "process restarts and do not cross replicas",
        )
        root = secrets.token_bytes(32)
    else:
        root = server.ui_secret.encode()
    session = hashlib.sha256(b"memproxy-ui-session\x00" + root).digest()
    csrf = hashlib.sha256(b"memproxy-ui-csrf\x00" + root).hexdigest()
    return session, csrf


class SessionCookies(SessionMiddleware[ClientSideSessionBackend]):
    """Litestar's cookie sessions, their backend made when the app is (Litestar copies the
    routers it registers, and a backend's cipher cannot be copied)."""

    def __init__(self, app: ASGIApp, config: CookieBackendConfig) -> None:
        super().__init__(app, ClientSideSessionBackend(config))


def session_middleware(secret: bytes, *, secure: bool) -> DefineMiddleware:
    config = CookieBackendConfig(
        secret=secret,
        key=SESSION_COOKIE,
        max_age=SESSION_HOURS * 3600,
        path="/ui",
        httponly=True,
        secure=secure,
        samesite="strict",
    )
    return DefineMiddleware(SessionCookies, config=config)


def csrf_config(secret: str, *, secure: bool) -> CSRFConfig:
    return CSRFConfig(
        secret=secret,
        cookie_name=CSRF_COOKIE,
        cookie_path="/ui",
        cookie_httponly=True,  # (the token travels in each form's hidden field)
        cookie_secure=secure,
        cookie_samesite="strict",
        header_name="x-csrftoken",
    )


def refuse_other_origins(request: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """A guard: a change sent from another site's page is refused (the CSRF token stops it
    too; this says why). The browser's own `Sec-Fetch-Site` decides when it is sent (every
    current browser does, and no page can set it): only `same-origin` (or `none`, the user's
    own navigation) passes. This holds behind a TLS-terminating proxy, where the address
    memproxy sees (`http://`, often another host name) is not the one the browser used.
    Without it, the `Origin` (or `Referer`) must name the address memproxy sees."""
    if request.scope.get("method") in SAFE_METHODS:
        return
    fetched_from = request.headers.get("sec-fetch-site")
    if fetched_from is not None:
        if fetched_from not in ("same-origin", "none"):
            raise PermissionDeniedException("This form was sent from another site.")
        return
    claimed = request.headers.get("origin") or request.headers.get("referer")
    if claimed is None:
        return  # (old browsers and some privacy settings send neither; the token still holds)
    origin = urlsplit(claimed)
    if (origin.scheme, origin.netloc) != (request.url.scheme, request.url.netloc):
        raise PermissionDeniedException("This form was sent from another site.")


async def provide_ui_principal(
    request: Request[Any, Any, Any], services: NamedDependency[AppState]
) -> Principal:
    """The signed-in key's principal, looked up again now (`NotSignedIn` if it is gone)."""
    digest = request.session.get("key") if request.session else None
    if not isinstance(digest, str):
        raise NotSignedIn
    try:
        principal = services.keys.identify(services.keys.by_digest(digest, "manage"), Headers())
    except ProxyError:
        request.clear_session()
        raise NotSignedIn from None
    await services.memory.settle(principal.tenant_id)  # (as the management API: reads whole)
    return principal


@get("/sign-in", name="ui_sign_in")
async def sign_in_page(request: Request[Any, Any, Any]) -> Template:
    return Template("sign_in.html", context={"title": "Sign in"})


@post("/sign-in", status_code=303)
async def sign_in(
    request: Request[Any, Any, Any], services: NamedDependency[AppState]
) -> Response[Any]:
    form = await request.form()
    key = str(form.get("key") or "").strip()
    digest = key_digest(key)
    try:
        if not key:
            raise AuthenticationFailed("Enter an API key.")
        principal = services.keys.identify(services.keys.by_digest(digest, "manage"), Headers())
    except ProxyError as refused:
        log.info("ui_sign_in_refused", status=refused.status, code=refused.code)
        context = {"title": "Sign in", "error": refused.message}
        return Template("sign_in.html", context=context, status_code=refused.status)
    request.set_session({"key": digest})
    log.info("ui_signed_in", tenant=principal.tenant_id, user=principal.user)
    return Redirect("/ui/users", status_code=303)


@post("/sign-out", status_code=303)
async def sign_out(request: Request[Any, Any, Any]) -> Redirect:
    request.clear_session()
    return Redirect("/ui/sign-in", status_code=303)


def to_sign_in(request: Request[Any, Any, Any], _: NotSignedIn) -> Response[Any]:
    return Redirect("/ui/sign-in", status_code=303)


def error_page(request: Request[Any, Any, Any], error: Exception) -> Response[Any]:
    """An error as a page of the inspector (the API's errors are JSON)."""
    if isinstance(error, StorageError):
        log.error("storage_unavailable", error=str(error))
        status, message = 503, "The database is not answering; try again shortly."
    elif isinstance(error, ProxyError):
        status, message = error.status, error.message
    elif isinstance(error, HTTPException):
        status, message = error.status_code, error.detail
    else:
        log.exception("ui_error", exc_info=error)
        status, message = 500, "Something went wrong; the server's log says what."
    titles = {
        400: "Cannot do that",
        403: "Not allowed",
        404: "Not found",
        409: "Cannot do that",
        503: "Unavailable",
    }
    context = {"title": titles.get(status, "Error"), "message": message}
    return Template("error.html", context=context, status_code=status)
