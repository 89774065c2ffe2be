"""What the turn pipeline needs from a wire protocol (Chat Completions, Responses, Anthropic
Messages): the request as a neutral turn, a way to send the assembled messages upstream in the
protocol's own shape, and readers of the reply, whole or streamed.

The pipeline owns no wire format: it sees messages in the stored OpenAI message shape, usage
in the Chat Completions shape, and raw SSE events it hands to the protocol's reader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.core.errors import ProxyError
from proxy.upstream.base import Upstream, UpstreamReply


@dataclass(slots=True)
class NeutralTurn:
    """A request as the pipeline sees it, whatever its wire format."""

    model: str
    # The client's messages in the stored OpenAI message shape, in order.
    messages: list[dict[str, Any]]
    stream: bool
    # The protocol's own user fields, (parameter name, value), most trusted first: identity
    # takes the first that is set when no header names the user.
    user_fields: list[tuple[str, object]] = field(default_factory=list)
    # Room the reply asks for (max tokens), kept free of the proxy's additions.
    reserve_tokens: int = 0
    # memproxy's `attachments` extension as the request carried it (checked by the pipeline).
    attachments: object = None
    # The conversation the protocol itself names (the Responses API's `previous_response_id`
    # or `conversation`), when no X-Memory-Conversation-Id header does.
    conversation_id: str | None = None
    # What the upstream gets before the client's messages that the client did not send in
    # this request and memproxy does not store again (a Responses chain memproxy keeps): counted
    # as the client's own for the context window and the prompt's tokens.
    prefix: list[dict[str, Any]] = field(default_factory=list)
    # Where the prefix goes: after the first `prefix_at` messages (the request's own
    # instructions, which the upstream gets first).
    prefix_at: int = 0
    # False when the prompt holds the conversation's history already (a Responses chain the
    # upstream stores itself, or one memproxy sends again whole): stored history is not
    # attached, and recall leaves the conversation out; memories and documents still go.
    attach_history: bool = True

    @property
    def prompt(self) -> list[dict[str, Any]]:
        """The client's side of the prompt as the upstream gets it, in its order: the messages
        with the prefix in its place (the messages themselves when there is none). The proxy's
        context is placed among these, so a section sits where it did in an earlier request
        whether the client resent the turn it preceded or memproxy did."""
        if not self.prefix:
            return self.messages
        at = self.prefix_at
        return [*self.messages[:at], *self.prefix, *self.messages[at:]]


@dataclass(slots=True)
class WholeReply:
    """A whole reply read: the assistant message (None when there is none to store), usage in
    the Chat Completions shape, and the reply as the client gets it."""

    message: dict[str, Any] | None
    usage: dict[str, Any] | None
    reply: UpstreamReply
    # The protocol's own object for the reply, when the proxy keeps it (a Responses
    # `response`, served later by id).
    native: dict[str, Any] | None = None


class StreamReader(Protocol):
    """Reads a streamed reply one whole SSE event at a time."""

    @property
    def error(self) -> dict[str, Any] | None:
        """The upstream said, in the stream, that it failed."""
        ...

    @property
    def usage(self) -> dict[str, Any] | None:
        """Usage in the Chat Completions shape, once it has arrived."""
        ...

    def read(self, raw: bytes, *, fold: bool = True) -> bytes:
        """Fold one raw event in; return what the client gets for it (b"" for nothing).
        `fold=False`: only the end, an error and the usage are read. Raises NotUnderstood
        for an event it cannot fold in (the pipeline then stops folding)."""
        ...

    @property
    def ended(self) -> bool:
        """The upstream said the reply is complete (its end marker or finish reason)."""
        ...

    @property
    def received_anything(self) -> bool: ...

    def message(self) -> dict[str, Any]:
        """The reply so far as an assistant message, as a client would send it back."""
        ...

    # Where the stream's end begins in what the client gets (e.g. `data: [DONE]`): held back
    # until the exchange is stored, so a client's next request finds it.
    @property
    def end_markers(self) -> tuple[bytes, ...]: ...

    def failed(self, error: ProxyError) -> bytes:
        """The last event(s) of a stream that broke, in the protocol's shape."""
        ...

    def close(self) -> bytes:
        """The upstream's stream ended (whatever it said last): what the client still gets."""
        ...

    def unread(self, raw: bytes) -> bytes:
        """What the client gets of an event `read` could not make sense of (NotUnderstood)."""
        ...

    @property
    def native(self) -> dict[str, Any] | None:
        """The protocol's own object for the reply, when the proxy keeps it (see WholeReply)."""
        ...


class WireProtocol(Protocol):
    """One request's protocol adapter."""

    # For metrics and logs: "chat", "responses", "messages".
    name: str

    async def call(
        self,
        upstream: Upstream,
        messages: list[dict[str, Any]],
        *,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamReply:
        """Send the request upstream in the protocol's shape with `messages` (the turn's
        `prompt`, with what the proxy attached) in place of the client's own."""
        ...

    def stream_reader(self, prompt_tokens: int | None = None) -> StreamReader:
        """A reader for the streamed reply; `prompt_tokens`: the proxy's count of the prompt
        sent (for a protocol whose stream says it before the upstream's usage arrives)."""
        ...

    def keep(
        self, native: dict[str, Any] | None, *, tenant_id: str, user_id: str, request_id: str
    ) -> Any:
        """What to store with the reply of the protocol's own (a `ResponseRecord`), or None."""
        ...

    def whole(self, reply: UpstreamReply) -> WholeReply: ...
