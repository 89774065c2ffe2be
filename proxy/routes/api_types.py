"""The shapes of the HTTP API, for its OpenAPI document only.

The handlers parse bodies themselves (their own checks and error messages, unknown fields
refused by name) and build replies as plain dicts; these structs describe the same fields so
that `/docs` can show them. `tests/integration/test_api_reference.py` keeps the two from drifting:
every route's body, query and path parameters must be in the document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Timestamp = Annotated[int, Meta(description="Unix seconds.")]
UserId = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=256,
        pattern=r"^(?!\.\.?$)",
        description="The end user (not `.` or `..`, which URL clients rewrite).",
    ),
]


class ErrorObject(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct, kw_only=True):
    """OpenAI's error envelope; every error of the API has this shape (upstream errors pass
    through with the upstream's own status and body)."""

    error: ErrorObject


class ToolCallFunction(Struct, kw_only=True):
    name: str
    arguments: Annotated[str, Meta(description="The arguments, as a JSON text.")]


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Struct, kw_only=True):
    """A chat message in OpenAI's shape, as stored and imported."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: (
        Annotated[str, Meta(description="Text.")]
        | Annotated[list[dict[str, Any]], Meta(description="Content parts (text, image_url...).")]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ImportedMessage(ChatMessage, kw_only=True):
    created_at: (
        Annotated[str, Meta(description="When it was said (ISO 8601); now when left out.")] | None
    ) = None


class InlineAttachment(Struct, kw_only=True):
    """A document for this turn: `content` (with an optional `title` and `source`), or the
    `attachment_id` of one stored with the conversation. Removed before forwarding."""

    content: str | None = None
    title: Annotated[str, Meta(max_length=512)] | None = None
    source: Annotated[str, Meta(max_length=2048)] | None = None
    attachment_id: str | None = None


class ChatCompletionExtensions(Struct, kw_only=True):
    """What memproxy adds to OpenAI's chat completion request (all optional)."""

    attachments: Annotated[list[InlineAttachment], Meta(max_length=20)] | None = None


class CreateConversationRequest(Struct, kw_only=True):
    user: UserId
    id: (
        Annotated[
            str,
            Meta(
                pattern=r"^[A-Za-z0-9._:-]{1,128}$",
                description="Chosen by the caller; a new id when left out.",
            ),
        ]
        | None
    ) = None
    title: Annotated[str, Meta(max_length=512)] | None = None
    messages: (
        Annotated[list[ImportedMessage], Meta(min_length=1, description="History imported as is.")]
        | None
    ) = None


class UpdateConversationRequest(Struct, kw_only=True):
    title: Annotated[str, Meta(max_length=512)] | None = None
    archived: bool | None = None
    metadata: dict[str, Any] | None = None


class AppendMessagesRequest(Struct, kw_only=True):
    messages: Annotated[list[ImportedMessage], Meta(min_length=1)]


class CreateMemoryRequest(Struct, kw_only=True):
    user: UserId
    text: Annotated[str, Meta(min_length=1, max_length=4000)]
    kind: Annotated[str, Meta(max_length=32, description="fact, preference, or any name.")] = "fact"
    pinned: Annotated[bool, Meta(description="Attached to every turn of the user.")] = False
    confidence: Annotated[float, Meta(ge=0, le=1)] | None = None


class UpdateMemoryRequest(Struct, kw_only=True):
    text: Annotated[str, Meta(min_length=1, max_length=4000)] | None = None
    kind: Annotated[str, Meta(max_length=32)] | None = None
    pinned: bool | None = None
    confidence: Annotated[float, Meta(ge=0, le=1)] | None = None


class CreateAttachmentRequest(Struct, kw_only=True):
    """A document as JSON (or upload it as multipart/form-data: `file`, `title`, `source`)."""

    content: Annotated[str, Meta(min_length=1)]
    title: Annotated[str, Meta(max_length=512)] | None = None
    source: Annotated[str, Meta(max_length=2048)] | None = None
    media_type: Literal["text/plain", "text/markdown", "text/html"] | None = None


class AttachmentUpload(Struct, kw_only=True):
    file: Annotated[bytes, Meta(description="The document: text, Markdown, HTML or PDF.")]
    title: Annotated[str, Meta(max_length=512)] | None = None
    source: Annotated[str, Meta(max_length=2048)] | None = None


class Conversation(Struct, kw_only=True):
    id: str
    object: Literal["memory.conversation"]
    user: str
    title: str | None
    archived: bool
    message_count: int
    created_at: Timestamp
    updated_at: Timestamp
    metadata: dict[str, Any] | None


class StoredMessage(Struct, kw_only=True):
    id: str
    object: Literal["memory.message"]
    conversation_id: str
    seq: int
    role: str
    content: str | list[dict[str, Any]] | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    status: str
    tokens: int
    exchange_id: str | None
    request_id: Annotated[
        str | None,
        Meta(
            description="The exchange that stored it (its trace: /v1/memory/exchanges/{id}/trace)."
        ),
    ] = None
    created_at: Timestamp
    metadata: dict[str, Any] | None


class MemoryTrace(Struct, kw_only=True):
    """What the model saw and why, for one exchange (docs/reference/trace.md)."""

    id: str
    object: Literal["memory.exchange.trace"]
    level: Annotated[str, Meta(description="full or summary: the tenant's `trace` setting.")]
    truncated: Annotated[
        bool | list[str], Meta(description="False, or what was cut to keep it within its size.")
    ]
    bytes: int
    user: str
    conversation_id: str | None
    model: str | None
    mode: Annotated[str, Meta(description="The memory mode: full, read or off.")]
    status: str
    created_at: Timestamp
    budget: dict[str, Any]
    context: dict[str, Any]
    sections: dict[str, Any]
    recall: dict[str, Any] | None
    intent: dict[str, Any] | None
    timings: dict[str, Any]
    degraded: list[dict[str, Any]]
    usage: dict[str, Any] | None
    cost: dict[str, Any]


class Memory(Struct, kw_only=True):
    id: str
    object: Literal["memory.memory"]
    user: str
    kind: str
    text: str
    pinned: bool
    confidence: float | None
    source_exchange_id: str | None
    access_count: int
    created_at: Timestamp
    updated_at: Timestamp
    last_used_at: Timestamp | None


class Attachment(Struct, kw_only=True):
    id: str
    object: Literal["memory.attachment"]
    conversation_id: str
    title: str | None
    source: str | None
    media_type: str
    origin: str
    tokens: int
    chunks: int
    bytes: int | None
    created_at: Timestamp
    content: Annotated[str, Meta(description="Only when one document is read.")] | None = None


class Job(Struct, kw_only=True):
    id: str
    object: Literal["memory.job"]
    kind: str
    subject: str | None
    user: str | None
    status: str
    attempts: int
    run_after: Timestamp
    last_error: str | None
    result: dict[str, Any] | None
    created_at: Timestamp
    updated_at: Timestamp


class _Page(Struct, kw_only=True):
    object: Literal["list"]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ConversationList(_Page, kw_only=True):
    data: list[Conversation]


class MessageList(_Page, kw_only=True):
    data: list[StoredMessage]


class MemoryList(_Page, kw_only=True):
    data: list[Memory]


class AttachmentList(_Page, kw_only=True):
    data: list[Attachment]


class JobList(_Page, kw_only=True):
    data: list[Job]


class Deleted(Struct, kw_only=True):
    id: str
    object: str
    deleted: Literal[True]


class User(Struct, kw_only=True):
    id: str
    object: Literal["memory.user"]
    conversations: int
    messages: int
    memories: int
    last_active_at: Timestamp


class UserList(_Page, kw_only=True):
    data: list[User]


class UserDeleted(Struct, kw_only=True):
    object: Literal["memory.user.deleted"]
    user: str
    deleted: Annotated[dict[str, int], Meta(description="How many of each kind went.")]


class ExportedConversation(Conversation, kw_only=True):
    messages: list[StoredMessage]
    attachments: list[Attachment]


class UserExportDocument(Struct, kw_only=True):
    object: Literal["memory.user.export"]
    user: str
    exported_at: Timestamp
    conversations: list[ExportedConversation]
    memories: list[Memory]
    exchanges: list[dict[str, Any]]
    traces: Annotated[list[dict[str, Any]], Meta(description="Each exchange's trace, as recorded.")]
    summaries: list[dict[str, Any]]
    jobs: list[Job]
    vectors: int


# Request bodies: Litestar generates components only for the types of handler signatures and
# responses, so these (and what they reference) are generated with msgspec.
REQUEST_BODIES: tuple[type[Struct], ...] = (
    ChatCompletionExtensions,
    CreateConversationRequest,
    UpdateConversationRequest,
    AppendMessagesRequest,
    CreateMemoryRequest,
    UpdateMemoryRequest,
    CreateAttachmentRequest,
    AttachmentUpload,
)
