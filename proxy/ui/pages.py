"""The inspector's reading pages: the tenant's users, a user's conversations, and one
conversation as a timeline of turns, each with what its exchange record says."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Redirect, Template
from sqlalchemy import Connection

from policies.public_ids import MESSAGE, PublicIds
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, NotFound
from proxy.routes.conversations import conversation_or_404
from proxy.routes.params import user_param
from proxy.routes.traces import find_message, trace_object
from proxy.routes.usage import exchange_object
from proxy.routes.users import find_users
from proxy.state import AppState
from storage.records import AttachmentRecord, ConversationRecord, ExchangeRecord, MessageRecord
from storage.repositories.attachments import Attachments
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.traces import TraceRecord, Traces

PAGE = 50
MESSAGES_PAGE = 40  # (a page of turns, each with its trace: about 20 turns)


def context(principal: Principal, title: str, **values: Any) -> dict[str, Any]:
    """What every page's template gets: its title and who is signed in."""
    return {"title": title, "signed_in": principal, **values}


def user_of(request: Request[Any, Any, Any], principal: Principal) -> str:
    """The page's `?user=`, or the user a bound key acts as (403 for another one)."""
    named = request.query_params.get("user")
    user = principal.only(None if not named else user_param(named))
    if user is None:
        raise BadRequest("Choose a user first.", param="user")
    return user


@get("/")
async def home() -> Redirect:
    return Redirect("/ui/users", status_code=303)


@get("/users")
async def users_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    q = request.query_params.get("q") or None
    after = request.query_params.get("after") or None
    found = await find_users(services, principal, q=q, after=after, limit=PAGE + 1)
    return Template(
        "users.html",
        context=context(
            principal,
            "Users",
            users=found[:PAGE],
            q=q,
            next_after=found[PAGE - 1].user_id if len(found) > PAGE else None,
        ),
    )


@get("/conversations")
async def conversations_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    user = user_of(request, principal)
    after = request.query_params.get("after")

    def work(conn: Connection) -> list[ConversationRecord]:
        repo = Conversations(conn)
        cursor = repo.get(principal.tenant_id, after) if after else None
        if cursor is not None and cursor.user_id != user:
            cursor = None
        return repo.list(principal.tenant_id, user, after=cursor, limit=PAGE + 1)

    found = await services.db.read(work)
    return Template(
        "conversations.html",
        context=context(
            principal,
            f"Conversations of {user}",
            user=user,
            conversations=found[:PAGE],
            next_after=found[PAGE - 1].id if len(found) > PAGE else None,
        ),
    )


@dataclass
class Shown:
    """A stored message as the timeline shows it."""

    public_id: str
    seq: int
    role: str
    status: str
    text: str
    created_at: Any
    exchange_id: str | None


@dataclass
class Turn:
    messages: list[Shown] = field(default_factory=list)
    exchange: dict[str, Any] | None = None


def message_text(m: MessageRecord) -> str:
    """A message's text: its content's text parts, other parts by their type, tool calls by
    name and arguments."""
    content = m.content
    if isinstance(content, list):
        pieces = [
            part.get("text", "")
            if part.get("type") in ("text", "input_text")
            else f"[{part.get('type')}]"
            for part in content
            if isinstance(part, dict)
        ]
        content = "\n".join(pieces)
    lines = [content] if isinstance(content, str) and content else []
    for call in m.tool_calls or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        lines.append(f"→ {function.get('name')}({function.get('arguments', '')})")
    if m.tool_call_id:
        lines.insert(0, f"(reply to {m.tool_call_id})")
    return "\n".join(lines) or json.dumps(m.content)


def exchange_view(ids: PublicIds, x: ExchangeRecord, trace: TraceRecord | None) -> dict[str, Any]:
    """What the timeline shows of an exchange: the management API's exchange record
    (`exchange_object`) and its trace (`trace_object`) when one was recorded, with the
    intent's detail and what was attached in words."""
    attached = x.attached or {}
    parts = [
        f"{name.replace('_', ' ')}: {value:g}"
        for name, value in attached.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]
    return {
        **exchange_object(x),
        "intent_detail": x.intent_detail or {},
        "attached_text": " · ".join(parts) or "nothing",
        "trace": None if trace is None else trace_object(ids, x, trace),
    }


def turns_of(messages: list[Shown]) -> list[Turn]:
    """Messages grouped into turns: each user message opens one."""
    turns: list[Turn] = []
    for m in messages:
        if not turns or (m.role == "user" and turns[-1].messages):
            turns.append(Turn())
        turns[-1].messages.append(m)
    return turns


# A conversation's page as read: the conversation, its messages, their exchanges (with their
# traces, when recorded) and its attachments.
_Loaded = tuple[
    ConversationRecord,
    list[MessageRecord],
    dict[str, tuple[ExchangeRecord, TraceRecord | None]],
    list[AttachmentRecord],
]


@get("/conversation")
async def conversation_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    conversation_id = request.query_params.get("id") or ""
    after = request.query_params.get("after")
    after_seq = int(after) if after and after.isdigit() else 0

    def work(conn: Connection) -> _Loaded:
        found = conversation_or_404(conn, principal.tenant_id, conversation_id, user=principal.user)
        rows = Conversations(conn).messages(
            principal.tenant_id, found.pk, after_seq=after_seq, limit=MESSAGES_PAGE + 1
        )
        exchanges, traces = Exchanges(conn), Traces(conn)
        records = {}
        for rid in dict.fromkeys(m.exchange_id for m in rows[:MESSAGES_PAGE] if m.exchange_id):
            record = exchanges.get(principal.tenant_id, rid)
            if record is not None:
                records[rid] = (record, traces.get(principal.tenant_id, rid))
        attachments = Attachments(conn).for_conversation(
            principal.tenant_id, found.pk, limit=PAGE, with_content=False
        )
        return found, rows, records, attachments

    found, rows, records, attachments = await services.db.read(work)
    shown = [
        Shown(
            services.ids.format(MESSAGE, m.pk),
            m.seq,
            m.role,
            m.status,
            message_text(m),
            m.created_at,
            m.exchange_id,
        )
        for m in rows[:MESSAGES_PAGE]
    ]
    turns = turns_of(shown)
    for turn in turns:
        rid = next((m.exchange_id for m in turn.messages if m.exchange_id in records), None)
        if rid is not None:
            turn.exchange = exchange_view(services.ids, *records[rid])
    return Template(
        "conversation.html",
        context=context(
            principal,
            f"Conversation {found.id}",
            conversation=found,
            turns=turns,
            attachments=attachments,
            next_after=rows[MESSAGES_PAGE - 1].seq if len(rows) > MESSAGES_PAGE else None,
        ),
    )


@get("/message")
async def message_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Redirect:
    """A stored message (a trace names them by id): its place in its conversation's page."""
    message_id = request.query_params.get("id") or ""
    message, conversation_id = await find_message(services, principal, message_id)
    query = {"id": conversation_id}
    if message.seq > MESSAGES_PAGE:
        query["after"] = str(message.seq - 1)
    return Redirect(f"/ui/conversation?{urlencode(query)}#{message_id}", status_code=303)


@get("/{unknown:path}")
async def unknown_page(unknown: FromPath[str]) -> None:
    """Any other path under /ui: the inspector's own "Not found" page, not the API's JSON."""
    raise NotFound(f"There is no page /ui{unknown}.", code="not_found")


ROUTES = [home, users_page, conversations_page, conversation_page, message_page, unknown_page]
