"""Litestar dependency providers."""

from __future__ import annotations

from typing import Any, cast

from litestar import Request
from litestar.di import NamedDependency

from proxy.core.access import request_info
from proxy.core.auth import Principal
from proxy.core.config import Scope
from proxy.core.requests import refuse_unknown
from proxy.state import AppState


def provide_services(request: Request[Any, Any, Any]) -> AppState:
    return cast(AppState, request.app.state.memproxy)


async def provide_principal(
    request: Request[Any, Any, Any], services: NamedDependency[AppState]
) -> Principal:
    """The caller, authenticated for the scope the route declares in `opt["scope"]`, with the
    user it may act as (proxy/core/auth.py).

    A management call first waits for the tenant's reply writes still in flight, so what it
    reads or changes is whole (see ConversationMemory.reply_after_response).

    Taking `services` as a dependency orders the two: Litestar resolves independent
    dependencies concurrently in an anyio task group, two tasks per request for nothing.
    """
    info = request_info(request.scope)
    scope: Scope = request.route_handler.opt.get("scope", "chat")
    # (Anthropic's route takes the key in `x-api-key` too.)
    x_api_key = bool(request.route_handler.opt.get("x_api_key"))
    principal = services.keys.principal_for(request.headers, scope, x_api_key=x_api_key)
    info.tenant = principal.tenant_id
    if scope == "manage":
        if request.scope.get("query_string"):
            known = request.route_handler.opt.get("query", ())
            refuse_unknown(request.query_params, known, "query parameter")
        await services.memory.settle(principal.tenant_id)
    return principal
