"""Identify: who the turn is for, in which conversation, in which memory mode (DESIGN.md, step
2), and the request's context for the stages after it (`TurnRequest`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from litestar import Request

from proxy.core.access import RequestInfo, request_info
from proxy.core.auth import USER_HEADER, Principal
from proxy.core.errors import BadRequest
from proxy.core.requests import check_user_id, header_text
from proxy.pipeline.trace import TraceRecorder
from proxy.pipeline.turn import ANONYMOUS, Mode, now
from proxy.pipeline.wire import NeutralTurn
from proxy.state import AppState
from proxy.upstream.base import Upstream

CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MODES: tuple[Mode, ...] = ("full", "read", "off")


@dataclass(frozen=True, slots=True)
class Identity:
    """memproxy's optional request headers, and the user the protocol's own fields name
    (DESIGN.md, request extensions)."""

    user_id: str
    conversation_id: str | None
    mode: Mode
    idempotency_key: str | None

    @property
    def shared_conversation(self) -> bool:
        """The anonymous user is every client that names none: a conversation found by its
        messages alone (two clients opening with the same template) may be another client's.
        Its documents are kept and attached only for requests that name it; the request's
        own go in all the same."""
        return self.user_id == ANONYMOUS and not self.conversation_id


def identify(
    request: Request[Any, Any, Any],
    principal: Principal,
    user_fields: list[tuple[str, object]],
    conversation_field: str | None = None,
) -> Identity:
    """The identity a request's credentials, headers and its protocol's own fields give (400
    for one that is malformed): the user its key or token is bound to, else the user fields in
    order of trust; and the conversation it names."""
    headers = request.headers
    param = USER_HEADER
    named: object = named_user(request, principal)
    if not named and principal.user is None:
        # The body's fields name the user only when the credentials leave it open; bound,
        # they are forwarded as they are and decide nothing.
        param, named = next(((p, v) for p, v in user_fields if v is not None), ("user", None))
    user = ANONYMOUS if named is None else check_user_id(named, param)
    conversation_id = headers.get("x-memory-conversation-id") or conversation_field
    if conversation_id is not None and not CONVERSATION_ID.fullmatch(conversation_id):
        raise BadRequest(
            "X-Memory-Conversation-Id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
            param="X-Memory-Conversation-Id",
        )
    mode = (headers.get("x-memory-mode") or "full").lower()
    if mode not in MODES:
        raise BadRequest("X-Memory-Mode must be full, read or off.", param="X-Memory-Mode")
    key = headers.get("idempotency-key")
    if key is not None and not 0 < len(key) <= 256:
        raise BadRequest("Idempotency-Key must be 1-256 characters.", param="Idempotency-Key")
    return Identity(user, conversation_id, mode, key)


def named_user(request: Request[Any, Any, Any], principal: Principal) -> str | None:
    """The user the request's credentials are bound to, else the one `X-Memory-User-Id`
    names (`principal_for` has refused a header that names another)."""
    if principal.user is not None:
        return principal.user
    return header_text(request, USER_HEADER)


@dataclass(slots=True)
class TurnRequest:
    """One turn's request as every stage after `identify` sees it."""

    request: Request[Any, Any, Any]
    principal: Principal
    services: AppState
    turn: NeutralTurn
    identity: Identity
    upstream: Upstream
    info: RequestInfo
    started_at: datetime = field(default_factory=now)
    # What the model saw and why, as the stages record it (the tenant's `trace` level).
    trace: TraceRecorder = field(default_factory=TraceRecorder.off)
    # Only what would be sent is wanted (count_tokens): the read stages run, nothing is
    # stored or queued, and no model is called (exchange.TurnExchange.prompt).
    dry_run: bool = False

    @classmethod
    def of(
        cls,
        request: Request[Any, Any, Any],
        principal: Principal,
        services: AppState,
        turn: NeutralTurn,
        *,
        dry_run: bool = False,
    ) -> TurnRequest:
        return cls(
            request,
            principal,
            services,
            turn,
            identify(request, principal, turn.user_fields, turn.conversation_id),
            services.upstream_for(principal),
            request_info(request.scope),
            trace=TraceRecorder(principal.tenant.trace),
            dry_run=dry_run,
        )

    @property
    def request_id(self) -> str:
        return self.info.request_id

    @property
    def tenant_id(self) -> str:
        return self.principal.tenant_id

    @property
    def user_id(self) -> str:
        return self.identity.user_id

    def spill_head(self) -> tuple[str, str, str, datetime]:
        """What a spill entry of this request starts with: tenant, user, request id and when
        the request began."""
        return (self.tenant_id, self.user_id, self.request_id, self.started_at)
