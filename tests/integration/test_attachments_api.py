"""`/v1/memory/conversations/{id}/attachments` through the real server: JSON and multipart
uploads of text, Markdown, HTML and PDF; list, get, delete; size and type limits; tenants and
scopes."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from proxy.core.config import ServerConfig, UpstreamConfig
from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.pdf import pdf_with_pages

MAX_BYTES = 200_000
MAX_TOKENS = 20_000
MAX_BODY = 50_000  # smaller than an upload may be
HARBOUR = (
    "The harbour opens at dawn.\n\nFishing boats leave first; the ferries follow at nine.\n\n"
    "Tickets are sold at the kiosk beside the lighthouse."
)


@pytest.fixture
def base(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any) -> str:
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    config = make_config(upstream)
    server = ServerConfig(
        max_body_bytes=MAX_BODY, max_attachment_bytes=MAX_BYTES, max_attachment_tokens=MAX_TOKENS
    )
    url: str = serve_proxy(config.model_copy(update={"server": server}))
    return url


def client(base: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base + "/memory/conversations", headers={"authorization": f"Bearer {key}"}
    )


@pytest.fixture
async def api(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with client(base, KEY) as http:
        response = await http.post("", json={"id": "c1", "user": "alice"})
        assert response.status_code == 201, response.text
        yield http


async def upload_json(api: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await api.post("/c1/attachments", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def upload_file(
    api: httpx.AsyncClient,
    name: str,
    data: bytes,
    content_type: str | None = None,
    **fields: str,
) -> httpx.Response:
    file = (name, data, content_type) if content_type else (name, data)
    return await api.post("/c1/attachments", files={"file": file}, data=fields)


async def upload_raw(
    api: httpx.AsyncClient, filename: bytes, title: bytes | None = None
) -> httpx.Response:
    """A multipart upload written byte for byte (a file part, then the title if given)."""
    body = b'--B\r\nContent-Disposition: form-data; name="file"; filename="' + filename
    body += b'"\r\nContent-Type: text/plain\r\n\r\ntext\r\n'
    if title is not None:
        body += b'--B\r\nContent-Disposition: form-data; name="title"\r\n\r\n' + title + b"\r\n"
    headers = {"content-type": "multipart/form-data; boundary=B"}
    return await api.post("/c1/attachments", content=body + b"--B--\r\n", headers=headers)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_json_text_is_stored_chunked_and_read_back(api: httpx.AsyncClient) -> None:
    created = await upload_json(api, content=HARBOUR, title="Harbour", source="notes://harbour")
    assert created["id"].startswith("att_")
    assert {k: v for k, v in created.items() if k not in ("id", "created_at", "tokens")} == {
        "object": "memory.attachment",
        "conversation_id": "c1",
        "title": "Harbour",
        "source": "notes://harbour",
        "media_type": "text/plain",
        "origin": "upload",
        "chunks": 1,
        "bytes": len(HARBOUR.encode()),
    }
    assert 20 < created["tokens"] < 60
    assert "content" not in created
    got = (await api.get(f"/c1/attachments/{created['id']}")).json()
    assert got == {**created, "content": HARBOUR}


async def test_markdown_and_html_as_json(api: httpx.AsyncClient) -> None:
    markdown = "# Ferries\n\n* nine o'clock\n* noon"
    stored = await upload_json(api, content=markdown, media_type="text/markdown")
    got = (await api.get(f"/c1/attachments/{stored['id']}")).json()
    assert (got["media_type"], got["content"]) == ("text/markdown", markdown)
    html = "<h1>Ferries</h1><script>x()</script><p>Leave at <b>nine</b>.</p>"
    stored = await upload_json(api, content=html, media_type="text/html")
    got = (await api.get(f"/c1/attachments/{stored['id']}")).json()
    assert (got["media_type"], got["content"]) == ("text/html", "Ferries\n\nLeave at nine.")


async def test_multipart_uploads_of_every_kind(api: httpx.AsyncClient) -> None:
    pdf = pdf_with_pages("The harbour opens at dawn.", "Tickets at the kiosk.")
    uploads = [
        ("notes.txt", HARBOUR.encode(), "text/plain", "text/plain", HARBOUR),
        ("guide.md", b"# Guide\n\nWalk *east*.", None, "text/markdown", "# Guide\n\nWalk *east*."),
        ("page.html", b"<p>One</p><p>Two</p>", "text/html", "text/html", "One\n\nTwo"),
        (
            "paper.pdf",
            pdf,
            "application/pdf",
            "application/pdf",
            "The harbour opens at dawn.\n\nTickets at the kiosk.",
        ),
        ("scan.pdf", pdf, "application/octet-stream", "application/pdf", None),
    ]
    for name, data, content_type, media_type, text in uploads:
        response = await upload_file(api, name, data, content_type)
        assert response.status_code == 201, (name, response.text)
        created = response.json()
        assert (created["media_type"], created["title"], created["bytes"]) == (
            media_type,
            name,
            len(data),
        )
        if text is not None:
            got = (await api.get(f"/c1/attachments/{created['id']}")).json()
            assert got["content"] == text
    titled = await upload_file(api, "x.txt", b"text", "text/plain", title="Named", source="s3://b")
    assert (titled.json()["title"], titled.json()["source"]) == ("Named", "s3://b")


async def test_an_upload_may_exceed_max_body_bytes_up_to_its_own_limit(
    api: httpx.AsyncClient,
) -> None:
    text = ("All work and no play makes a dull day. " * 2_000)[: MAX_BODY + 10_000]
    assert len(text) > MAX_BODY
    response = await upload_file(api, "long.txt", text.encode(), "text/plain")
    assert response.status_code == 201, response.text
    assert response.json()["chunks"] > 10
    as_json = await api.post("/c1/attachments", json={"content": text})
    assert as_json.status_code == 201, as_json.text
    # other routes keep the server-wide limit
    error = error_of(await api.post("", json={"user": "x", "title": "t" * MAX_BODY}), 413)
    assert "max_body_bytes" in error["message"]


async def test_oversized_uploads_are_413(api: httpx.AsyncClient) -> None:
    over = b"a" * (MAX_BYTES + 1)
    for response in (
        await upload_file(api, "big.txt", over, "text/plain"),
        await api.post("/c1/attachments", json={"content": over.decode()}),
        # far over: refused while the body is read, before any parsing
        await upload_file(api, "huge.txt", b"a" * (MAX_BYTES + 2_000_000), "text/plain"),
        await api.post("/c1/attachments", json={"content": "a" * (MAX_BYTES + 2_000_000)}),
    ):
        error = error_of(response, 413)
        assert error["code"] == "attachment_too_large"
        assert "max_attachment_bytes" in error["message"]
    tokens = error_of(await upload_json_raw(api, content="word " * (MAX_TOKENS + 5)), 413)
    assert "max_attachment_tokens" in tokens["message"]
    assert (await api.get("/c1/attachments")).json()["data"] == []


async def upload_json_raw(api: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await api.post("/c1/attachments", json=body)


async def test_unsupported_types_are_415(api: httpx.AsyncClient) -> None:
    for response in (
        await upload_file(api, "photo.png", b"\x89PNG....", "image/png"),
        await upload_file(api, "archive.zip", b"PK..", "application/octet-stream"),
        await upload_json_raw(api, content="x", media_type="application/pdf"),
        await api.post(
            "/c1/attachments", content=b"plain body", headers={"content-type": "text/plain"}
        ),
    ):
        error = error_of(response, 415)
        assert error["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"content": ""}, "content"),
        ({"content": 5}, "content"),
        ({"title": "no content"}, "content"),
        ({"content": "ok", "colour": "red"}, "colour"),
        ({"content": "ok", "title": 5}, "title"),
        ({"content": "ok", "title": "t" * 600}, "title"),
        ({"content": "ok", "source": ["a"]}, "source"),
        ({"content": "ok", "media_type": 1}, "media_type"),
    ],
)
async def test_bad_json_bodies_are_400_naming_the_field(
    api: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    assert error_of(await upload_json_raw(api, **body), 400)["param"] == param


async def test_bad_uploads_are_clear_errors(api: httpx.AsyncClient) -> None:
    not_utf8 = await upload_file(api, "latin.txt", "caf\xe9".encode("latin-1"), "text/plain")
    assert error_of(not_utf8, 400)["code"] == "invalid_encoding"
    broken = await upload_file(api, "broken.pdf", b"%PDF-1.4 nothing", "application/pdf")
    assert "not a readable PDF" in error_of(broken, 400)["message"]
    no_text = await upload_file(api, "scan.pdf", pdf_with_pages(""), "application/pdf")
    assert "no extractable text" in error_of(no_text, 422)["message"]
    empty = await upload_file(api, "empty.txt", b"", "text/plain")
    assert error_of(empty, 400)["param"] == "file"
    extra = await upload_file(api, "a.txt", b"text", "text/plain", colour="red")
    assert error_of(extra, 400)["param"] == "colour"
    no_file = await api.post("/c1/attachments", files={"title": (None, b"only a title")})
    assert error_of(no_file, 400)["param"] == "file"
    # A file name that cannot be a title (the title it stands in for when none is given);
    # raw, as httpx would escape the NUL.
    for name in (b"a\x00b.txt", b"n" * 513):
        bad_name = await upload_raw(api, name)
        assert error_of(bad_name, 400)["param"] == "file"
    named = await upload_raw(api, b"a\x00b.txt", title=b"Notes")
    assert named.status_code == 201 and named.json()["title"] == "Notes"  # (the name unused)
    await api.delete(f"/c1/attachments/{named.json()['id']}")
    not_json = await api.post(
        "/c1/attachments", content=b"{nope", headers={"content-type": "application/json"}
    )
    error_of(not_json, 400)
    assert (await api.get("/c1/attachments")).json()["data"] == []


# Litestar's form parser leaves the file part it read before a text field it cannot decode
# unclosed (an in-memory SpooledTemporaryFile, closed when collected): not ours to close.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_text_fields_not_utf8_or_of_an_unknown_charset_are_400(
    api: httpx.AsyncClient,
) -> None:
    for title in (b"\xff\xfe", b"\xed\xa0\x80"):  # (the second: a lone surrogate)
        files = {"file": ("a.txt", b"x"), "title": (None, title)}
        bad_title = await api.post("/c1/attachments", files=files)
        assert "not valid UTF-8" in error_of(bad_title, 400)["message"]
    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nx'
    part += b'\r\n--B\r\nContent-Disposition: form-data; name="title"\r\n'
    part += b"Content-Type: text/plain; charset=bogus\r\n\r\nt\r\n--B--\r\n"
    multipart = {"content-type": "multipart/form-data; boundary=B"}
    bogus = await api.post("/c1/attachments", content=part, headers=multipart)
    assert "charset" in error_of(bogus, 400)["message"]
    assert (await api.get("/c1/attachments")).json()["data"] == []
    gc.collect()  # (the parts left unclosed warn now, within this test)


async def test_list_pages_oldest_first_and_delete_removes(api: httpx.AsyncClient) -> None:
    ids = [(await upload_json(api, content=f"Document {i}."))["id"] for i in range(5)]
    first = (await api.get("/c1/attachments", params={"limit": 2})).json()
    assert first["object"] == "list" and first["has_more"] is True
    assert [a["id"] for a in first["data"]] == ids[:2]
    assert (first["first_id"], first["last_id"]) == (ids[0], ids[1])
    assert all("content" not in a and a["chunks"] == 1 for a in first["data"])
    rest = (await api.get("/c1/attachments", params={"after": first["last_id"]})).json()
    assert [a["id"] for a in rest["data"]] == ids[2:] and rest["has_more"] is False
    bad_cursor = await api.get("/c1/attachments", params={"after": "att_nope"})
    assert error_of(bad_cursor, 400)["param"] == "after"

    deleted = await api.delete(f"/c1/attachments/{ids[0]}")
    assert deleted.json() == {"id": ids[0], "object": "memory.attachment.deleted", "deleted": True}
    assert error_of(await api.get(f"/c1/attachments/{ids[0]}"), 404)["code"] == (
        "attachment_not_found"
    )
    assert error_of(await api.delete(f"/c1/attachments/{ids[0]}"), 404)
    listed = (await api.get("/c1/attachments")).json()["data"]
    assert [a["id"] for a in listed] == ids[1:]


async def test_attachments_belong_to_their_conversation_and_go_with_it(
    api: httpx.AsyncClient,
) -> None:
    created = await upload_json(api, content=HARBOUR)
    assert (await api.post("", json={"id": "c2", "user": "alice"})).status_code == 201
    # reachable only under its own conversation
    assert error_of(await api.get(f"/c2/attachments/{created['id']}"), 404)
    assert error_of(await api.delete(f"/c2/attachments/{created['id']}"), 404)
    missing = error_of(await upload_json_raw_to(api, "nope", content="x"), 404)
    assert missing["code"] == "conversation_not_found"
    assert (await api.delete("/c1")).status_code == 200
    assert (await api.post("", json={"id": "c1", "user": "alice"})).status_code == 201
    assert (await api.get("/c1/attachments")).json()["data"] == []
    assert error_of(await api.get(f"/c1/attachments/{created['id']}"), 404)


async def upload_json_raw_to(
    api: httpx.AsyncClient, conversation: str, **body: Any
) -> httpx.Response:
    return await api.post(f"/{conversation}/attachments", json=body)


async def test_other_tenants_get_404_and_chat_keys_403(api: httpx.AsyncClient, base: str) -> None:
    created = await upload_json(api, content=HARBOUR)
    path = f"/c1/attachments/{created['id']}"
    async with client(base, OTHER_TENANT_KEY) as other:
        for method, url in (("GET", path), ("DELETE", path), ("GET", "/c1/attachments")):
            error = error_of(await other.request(method, url), 404)
            assert error["code"] == "conversation_not_found"
        refused = await other.post("/c1/attachments", json={"content": "theirs"})
        assert error_of(refused, 404)["code"] == "conversation_not_found"
        # the same conversation id in the other tenant holds only its own attachments
        assert (await other.post("", json={"id": "c1", "user": "alice"})).status_code == 201
        assert (await other.get("/c1/attachments")).json()["data"] == []
        assert error_of(await other.get(path), 404)["code"] == "attachment_not_found"
    async with client(base, CHAT_ONLY_KEY) as chat_only:
        for method, url in (("GET", "/c1/attachments"), ("GET", path), ("DELETE", path)):
            assert error_of(await chat_only.request(method, url), 403)
        upload = await chat_only.post("/c1/attachments", files={"file": ("a.txt", b"text")})
        assert error_of(upload, 403)
    assert (await api.get(path)).status_code == 200


async def test_erasing_the_user_counts_and_removes_attachments(
    api: httpx.AsyncClient, base: str
) -> None:
    created = await upload_json(api, content=HARBOUR)
    await upload_json(api, content="Another document.")
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as root:
        erased = (await root.delete("/memory/users/alice")).json()
    assert erased["deleted"]["attachments"] == 2
    assert error_of(await api.get(f"/c1/attachments/{created['id']}"), 404)
