"""The web inspector, `/ui`: a small server-rendered app for a tenant's operators, readable
with no JavaScript. Its pages read and change what the management API does, through the same
repositories and functions, as the signed-in key's principal (proxy/ui/session.py).

`routers(server)` are the whole of it for the app to register; `TEMPLATES` its templating.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import Router
from litestar.datastructures import ResponseHeader
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.middleware.base import DefineMiddleware
from litestar.middleware.csrf import CSRFMiddleware
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template import TemplateConfig

from proxy.core.config import ServerConfig
from proxy.core.errors import ProxyError
from proxy.ui import activity, memories, pages, session
from storage.errors import StorageError

HERE = Path(__file__).parent


def _when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC")


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True),
        trim_blocks=True,
        lstrip_blocks=True,
        auto_reload=False,  # (templates change with the package, not while it runs)
    )
    env.filters["when"] = _when
    return env


TEMPLATES: TemplateConfig[JinjaTemplateEngine] = TemplateConfig(
    instance=JinjaTemplateEngine.from_environment(_environment())
)


def routers(server: ServerConfig) -> list[Router]:
    """`/ui`: its pages behind the session cookie and CSRF checks, and its stylesheet."""
    session_secret, csrf_secret = session.session_secrets(server)
    pages_router = Router(
        path="/ui",
        route_handlers=[
            session.sign_in_page,
            session.sign_in,
            session.sign_out,
            *pages.ROUTES,
            *memories.ROUTES,
            *activity.ROUTES,
        ],
        dependencies={"principal": Provide(session.provide_ui_principal)},
        middleware=[
            session.session_middleware(session_secret, secure=server.ui_secure_cookies),
            DefineMiddleware(
                CSRFMiddleware,
                config=session.csrf_config(csrf_secret, secure=server.ui_secure_cookies),
            ),
        ],
        guards=[session.refuse_other_origins],
        response_headers=[ResponseHeader(name=k, value=v) for k, v in session.PAGE_HEADERS.items()],
        exception_handlers={
            Exception: session.error_page,
            HTTPException: session.error_page,
            ProxyError: session.error_page,
            StorageError: session.error_page,
            session.NotSignedIn: session.to_sign_in,
        },
        include_in_schema=False,
    )
    static = create_static_files_router(
        path="/ui/static", directories=[HERE / "static"], include_in_schema=False
    )
    return [pages_router, static]
