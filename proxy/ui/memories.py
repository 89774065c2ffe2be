"""The inspector's memory pages: a user's memories listed and searched, added, edited, pinned
and unpinned, and deleted after a confirmation page. The changes go through the management
API's own functions (proxy/routes/memories.py), checks and embedding jobs included."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from litestar import Request, get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.response import Redirect, Template
from sqlalchemy import Connection

from policies.recall import query_terms
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, NotFound
from proxy.routes import memories as api
from proxy.routes.params import user_param
from proxy.state import AppState
from proxy.ui.pages import PAGE, context, user_of
from storage.records import MemoryRecord
from storage.repositories.memories import Memories

NOTICES = {
    "added": "Memory added.",
    "saved": "Memory saved.",
    "pinned": "Memory pinned: it is attached to every turn of this user.",
    "unpinned": "Memory unpinned.",
    "deleted": "Memory deleted.",
}


def back_to_list(user: str, done: str, memory_id: str | None = None) -> Redirect:
    anchor = f"#{memory_id}" if memory_id else ""
    return Redirect(
        f"/ui/memories?{urlencode({'user': user, 'done': done})}{anchor}", status_code=303
    )


@get("/memories")
async def memories_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    user = user_of(request, principal)
    q = (request.query_params.get("q") or "").strip() or None
    terms = query_terms(q) if q else []
    after_id = request.query_params.get("after")

    def work(conn: Connection) -> list[MemoryRecord]:
        if q is not None and not terms:
            return []  # (only words too common to search by)
        repo = Memories(conn)
        after = repo.get(principal.tenant_id, after_id, user) if after_id else None
        return repo.find(principal.tenant_id, user, limit=PAGE + 1, after=after, terms=terms)

    found = await services.db.read(work)
    return Template(
        "memories.html",
        context=context(
            principal,
            f"Memories of {user}",
            user=user,
            q=q,
            memories=found[:PAGE],
            next_after=found[PAGE - 1].id if len(found) > PAGE else None,
            notice=NOTICES.get(request.query_params.get("done") or ""),
        ),
    )


async def _memory(
    services: AppState, principal: Principal, memory_id: str, user: str
) -> MemoryRecord:
    found = await services.db.read(
        lambda conn: Memories(conn).get(principal.tenant_id, memory_id, user)
    )
    if found is None:
        raise NotFound(f"No memory found with id '{memory_id}'.", code="memory_not_found")
    return found


def _form_user(form: FormMultiDict, principal: Principal) -> str:
    """The user a form names (403 for another than a bound key's)."""
    user = principal.only(user_param(form.get("user")))
    assert user is not None
    return user


def _target(form: FormMultiDict, principal: Principal) -> tuple[str, str]:
    """The memory a form names, and its user."""
    return str(form.get("id") or ""), _form_user(form, principal)


@get("/memory/edit")
async def edit_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    user = user_of(request, principal)
    memory = await _memory(services, principal, request.query_params.get("id") or "", user)
    return Template(
        "memory_edit.html", context=context(principal, f"Edit memory {memory.id}", memory=memory)
    )


@post("/memory/edit", status_code=303)
async def edit(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Redirect | Template:
    form = await request.form()
    memory_id, user = _target(form, principal)
    body = {"text": form.get("text"), "kind": form.get("kind"), "pinned": "pinned" in form}
    try:
        fields = api.memory_fields(body, creating=False)
    except BadRequest as refused:
        memory = await _memory(services, principal, memory_id, user)
        return Template(
            "memory_edit.html",
            context=context(principal, "Edit memory", memory=memory, error=refused.message),
            status_code=400,
        )
    await api.update(services, principal.tenant_id, memory_id, user, fields)
    return back_to_list(user, "saved", memory_id)


@post("/memory/pin", status_code=303)
async def pin(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Redirect:
    form = await request.form()
    memory_id, user = _target(form, principal)
    pinned = form.get("pinned") == "true"
    await api.update(services, principal.tenant_id, memory_id, user, {"pinned": pinned})
    return back_to_list(user, "pinned" if pinned else "unpinned", memory_id)


@post("/memory/new", status_code=303)
async def add(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Redirect:
    form = await request.form()
    user = _form_user(form, principal)
    body = {"text": form.get("text"), "kind": form.get("kind") or "fact"}
    fields = api.memory_fields({**body, "pinned": "pinned" in form}, creating=True)
    created = await api.create(services, principal.tenant_id, user, fields)
    return back_to_list(user, "added", created.id)


@get("/memory/delete")
async def delete_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    user = user_of(request, principal)
    memory = await _memory(services, principal, request.query_params.get("id") or "", user)
    return Template(
        "memory_delete.html",
        context=context(principal, f"Delete memory {memory.id}?", memory=memory),
    )


@post("/memory/delete", status_code=303)
async def delete(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Redirect:
    form = await request.form()
    memory_id, user = _target(form, principal)
    await api.remove(services, principal.tenant_id, memory_id, user)
    return back_to_list(user, "deleted")


ROUTES = [memories_page, edit_page, edit, pin, add, delete_page, delete]
