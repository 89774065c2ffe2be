"""`/v1/memory/conversations/{id}/attachments`: documents stored with a conversation.

Upload as JSON (`{"content", "title"?, "source"?, "media_type"?}`) or as a multipart form
(a `file` part: text, Markdown, HTML or PDF; optional `title` and `source`); the text is
extracted, cut into passages and indexed for search (and embedded by a background job when
the tenant has embeddings on), and the processing plan draws on it when the conversation
continues. List, get (with the text) and delete. Scope `manage`,
tenant-scoped: another tenant's conversation or attachment is 404 like an unknown one.

Limits: `server.max_attachment_bytes` on what is uploaded (an upload may exceed
`server.max_body_bytes` up to it) and `server.max_attachment_tokens` on its text; both 413.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, Router, delete, get, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.exceptions import ClientException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.openapi.spec import OpenAPIMediaType, RequestBody
from litestar.params import FromPath
from sqlalchemy import Connection

from proxy.background.embedding_items import queue_passages
from proxy.core.auth import Principal
from proxy.core.config import ServerConfig
from proxy.core.errors import BadRequest, NotFound, PayloadTooLarge, UnsupportedMediaType
from proxy.core.json_responses import json_response
from proxy.core.requests import MAX_SOURCE, MAX_TITLE, parse_json_object, refuse_unknown
from proxy.pipeline.documents import HTML, MARKDOWN, PLAIN, extract_text, index_text, media_type_of
from proxy.pipeline.turn import ANONYMOUS, now
from proxy.routes.api_types import (
    Attachment,
    AttachmentList,
    CreateAttachmentRequest,
    Deleted,
)
from proxy.routes.params import limit_param, page
from proxy.routes.reference import api, ref
from proxy.state import AppState
from storage.records import AttachmentRecord, ConversationRecord
from storage.repositories.attachments import Attachments, new_attachment_id
from storage.repositories.conversations import Conversations

PATH = "/v1/memory/conversations/{conversation_id:str}/attachments"
JSON_FIELDS = ("content", "title", "source", "media_type")
FORM_FIELDS = ("file", "title", "source")
JSON_MEDIA_TYPES = (PLAIN, MARKDOWN, HTML)
# Room for a multipart form's framing and a JSON body's quoting around the document itself.
BODY_OVERHEAD = 1_000_000


def body_limit(server: ServerConfig) -> int:
    """The request body size the upload route accepts."""
    return max(server.max_body_bytes, server.max_attachment_bytes + BODY_OVERHEAD)


def attachment_object(
    conversation_id: str, a: AttachmentRecord, chunks: int, *, content: bool = False
) -> dict[str, Any]:
    shown = {
        "id": a.id,
        "object": "memory.attachment",
        "conversation_id": conversation_id,
        "title": a.title,
        "source": a.source,
        "media_type": a.media_type,
        "origin": a.origin,
        "tokens": a.tokens,
        "chunks": chunks,
        "bytes": a.size_bytes,
        "created_at": int(a.created_at.timestamp()),
    }
    if content:
        shown["content"] = a.content
    return shown


@dataclass(slots=True)
class _Upload:
    data: bytes
    media_type: str
    title: str | None
    source: str | None
    param: str  # the field the document came in, for errors about it


def _conversation_not_found(conversation_id: str) -> NotFound:
    return NotFound(
        f"No conversation found with id '{conversation_id}'.", code="conversation_not_found"
    )


def _attachment_not_found(attachment_id: str) -> NotFound:
    return NotFound(f"No attachment found with id '{attachment_id}'.", code="attachment_not_found")


def _conversation(
    conn: Connection, tenant_id: str, conversation_id: str, user: str | None
) -> ConversationRecord:
    """The tenant's conversation (of `user` only, when given: a key or token bound to one)."""
    found = Conversations(conn).get(tenant_id, conversation_id)
    if found is None or (user is not None and found.user_id != user):
        raise _conversation_not_found(conversation_id)
    return found


def _attachment(
    conn: Connection, tenant_id: str, conversation_id: str, attachment_id: str, user: str | None
) -> tuple[ConversationRecord, AttachmentRecord]:
    conversation = _conversation(conn, tenant_id, conversation_id, user)
    found = Attachments(conn).get(tenant_id, attachment_id)
    if found is None or found.conversation_pk != conversation.pk:
        raise _attachment_not_found(attachment_id)
    return conversation, found


def _too_large(server: ServerConfig) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The attachment is larger than this server accepts: at most "
        f"{server.max_attachment_bytes} bytes (server.max_attachment_bytes).",
        code="attachment_too_large",
    )


def _optional_text(body: dict[str, Any], name: str, limit: int) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit or "\x00" in value:
        raise BadRequest(
            f"'{name}' must be a string of at most {limit} characters, without NUL.", param=name
        )
    return value or None


def _file_name(name: str | None) -> str | None:
    """The file part's name as the title when none is sent: what a title may be."""
    if name and (len(name) > MAX_TITLE or "\x00" in name):
        raise BadRequest(
            f"The file's name must be at most {MAX_TITLE} characters, without NUL, to stand in "
            "for the title; send a 'title' field, or a shorter name.",
            param="file",
        )
    return name or None


def _from_json(raw: bytes, server: ServerConfig) -> _Upload:
    body = parse_json_object(raw, JSON_FIELDS)
    content = body.get("content")
    if not isinstance(content, str) or not content.strip():
        raise BadRequest("'content' must be a non-empty string.", param="content")
    media_type = body.get("media_type", PLAIN)
    if not isinstance(media_type, str):
        raise BadRequest("'media_type' must be a string.", param="media_type")
    if media_type not in JSON_MEDIA_TYPES:
        raise UnsupportedMediaType(
            f"Unsupported media_type '{media_type}' for JSON content: use text/plain, "
            "text/markdown or text/html (upload a PDF as multipart/form-data).",
            param="media_type",
        )
    data = content.encode()
    if len(data) > server.max_attachment_bytes:
        raise _too_large(server)
    return _Upload(
        data,
        media_type,
        _optional_text(body, "title", MAX_TITLE),
        _optional_text(body, "source", MAX_SOURCE),
        "content",
    )


async def _from_form(request: Request[Any, Any, Any], server: ServerConfig) -> _Upload:
    try:
        form = await request.form()
    except RequestEntityTooLarge:
        raise _too_large(server) from None
    except ClientException as exc:
        raise BadRequest(f"The multipart form could not be read ({exc.detail}).") from None
    except UnicodeDecodeError:  # (Litestar decodes text fields and does not catch this)
        raise BadRequest("A text field of the multipart form is not valid UTF-8.") from None
    except LookupError as exc:  # (a part's own charset, unknown to Python)
        raise BadRequest(
            f"A text field of the multipart form names an unknown charset ({exc})."
        ) from None
    try:
        fields = {name: form.getall(name) for name in form}
        refuse_unknown(fields, FORM_FIELDS, "form field")
        for name, values in fields.items():
            if len(values) > 1:
                raise BadRequest(f"Send '{name}' once.", param=name)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequest(
                "Send the document as a file part named 'file' (multipart/form-data).",
                param="file",
            )
        texts: dict[str, Any] = {}
        for name in ("title", "source"):
            value = form.get(name)
            if isinstance(value, UploadFile):
                raise BadRequest(f"'{name}' must be a text field, not a file.", param=name)
            texts[name] = value
        title = _optional_text(texts, "title", MAX_TITLE) or _file_name(upload.filename)
        source = _optional_text(texts, "source", MAX_SOURCE)
        media_type = media_type_of(upload.content_type, upload.filename)
        data = await upload.read(server.max_attachment_bytes + 1)
        if len(data) > server.max_attachment_bytes:
            raise _too_large(server)
        if not data:
            raise BadRequest("The uploaded file is empty.", param="file")
        return _Upload(data, media_type, title, source, "file")
    finally:
        for value in form.values():
            if isinstance(value, UploadFile):
                await value.close()


UPLOAD_BODY = RequestBody(
    required=True,
    description="A document as JSON, or a file uploaded as multipart/form-data.",
    content={
        "application/json": OpenAPIMediaType(schema=ref(CreateAttachmentRequest.__name__)),
        "multipart/form-data": OpenAPIMediaType(schema=ref("AttachmentUpload")),
    },
)


@post(
    PATH,
    summary="Upload a document to a conversation",
    status_code=201,
    **api(
        "manage",
        body=UPLOAD_BODY,
        ok=Attachment,
        status=201,
        errors=(400, 401, 403, 404, 413, 415, 429, 503),
    ),
)
async def upload_attachment(
    request: Request[Any, Any, Any],
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    server, tenant, user = services.config.server, principal.tenant_id, principal.user
    # Unknown conversations fail before any upload is read or parsed.
    await services.db.read(lambda conn: _conversation(conn, tenant, conversation_id, user))
    kind = request.content_type[0]
    if kind == "multipart/form-data":
        upload = await _from_form(request, server)
    elif kind == "application/json":
        try:
            raw = await request.body()
        except RequestEntityTooLarge:
            raise _too_large(server) from None
        upload = _from_json(raw, server)
    else:
        raise UnsupportedMediaType(
            f"Unsupported request content type '{kind}': send application/json "
            "({\"content\": ...}) or multipart/form-data with a 'file' part."
        )
    text = await extract_text(
        upload.data, upload.media_type, max_tokens=server.max_attachment_tokens, param=upload.param
    )
    indexed = await index_text(text, max_tokens=server.max_attachment_tokens)

    def work(conn: Connection) -> AttachmentRecord:
        conversation = _conversation(conn, tenant, conversation_id, user)
        created = Attachments(conn).create(
            tenant,
            conversation.user_id,
            conversation.pk,
            new_attachment_id(),
            content=indexed.text,
            chunks=indexed.chunks,
            tokens=indexed.tokens,
            now=now(),
            media_type=upload.media_type,
            origin="upload",
            title=upload.title,
            source=upload.source,
            size_bytes=len(upload.data),
        )
        if services.embeddings.wanted(tenant, created.user_id, "full", ANONYMOUS):
            queue_passages(conn, tenant, created.user_id, created.id, now=now())
        return created

    created = await services.db.write(work)
    services.jobs.wake()
    shown = attachment_object(conversation_id, created, len(indexed.chunks))
    return json_response(shown, status=201)


@get(
    PATH,
    summary="List a conversation's documents, oldest first",
    **api("manage", query=("limit", "after"), ok=AttachmentList),
)
async def list_attachments(
    request: Request[Any, Any, Any],
    conversation_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    limit = limit_param(request)
    after = request.query_params.get("after")
    tenant = principal.tenant_id

    def work(conn: Connection) -> tuple[list[AttachmentRecord], dict[int, int]]:
        conversation = _conversation(conn, tenant, conversation_id, principal.user)
        repo = Attachments(conn)
        after_pk = None
        if after:
            cursor = repo.get(tenant, after)
            if cursor is None or cursor.conversation_pk != conversation.pk:
                raise BadRequest(
                    f"after: no attachment '{after}' in this conversation.", param="after"
                )
            after_pk = cursor.pk
        found = repo.for_conversation(
            tenant, conversation.pk, limit=limit + 1, after_pk=after_pk, with_content=False
        )
        return found, repo.chunk_counts(tenant, [a.pk for a in found])

    found, counts = await services.db.read(work)
    shown = [attachment_object(conversation_id, a, counts.get(a.pk, 0)) for a in found]
    return json_response(page(shown, limit))


@get(
    f"{PATH}/{{attachment_id:str}}",
    summary="Get a document, with its text",
    **api("manage", ok=Attachment),
)
async def get_attachment(
    conversation_id: FromPath[str],
    attachment_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    tenant = principal.tenant_id

    def work(conn: Connection) -> tuple[AttachmentRecord, int]:
        _, found = _attachment(conn, tenant, conversation_id, attachment_id, principal.user)
        return found, Attachments(conn).chunk_counts(tenant, [found.pk]).get(found.pk, 0)

    found, chunks = await services.db.read(work)
    return json_response(attachment_object(conversation_id, found, chunks, content=True))


@delete(
    f"{PATH}/{{attachment_id:str}}",
    summary="Delete a document",
    status_code=200,
    **api("manage", ok=Deleted),
)
async def delete_attachment(
    conversation_id: FromPath[str],
    attachment_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    tenant = principal.tenant_id

    def work(conn: Connection) -> bool:
        _attachment(conn, tenant, conversation_id, attachment_id, principal.user)
        return Attachments(conn).delete(tenant, attachment_id)

    if not await services.db.write(work):
        raise _attachment_not_found(attachment_id)
    return json_response(
        {"id": attachment_id, "object": "memory.attachment.deleted", "deleted": True}
    )


def router(server: ServerConfig) -> Router:
    """The attachment routes, with the upload's own body size limit."""
    return Router(
        path="/",
        route_handlers=[upload_attachment, list_attachments, get_attachment, delete_attachment],
        request_max_body_size=body_limit(server),
    )
