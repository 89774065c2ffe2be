"""Text from uploaded documents: the media type from content type or file name, plain text and
Markdown as they are, HTML's visible text, PDF pages' text, and clear errors otherwise."""

from __future__ import annotations

import pytest

from proxy.core.errors import BadRequest, PayloadTooLarge, Unprocessable, UnsupportedMediaType
from proxy.pipeline.documents import extract_text, index_text, media_type_of
from tests.fakes.pdf import encrypted, pdf_with_pages


async def extract(data: bytes, media_type: str, max_tokens: int = 10_000) -> str:
    return await extract_text(data, media_type, max_tokens=max_tokens, param="file")


@pytest.mark.parametrize(
    ("content_type", "filename", "expected"),
    [
        ("text/plain; charset=utf-8", "notes.txt", "text/plain"),
        ("text/markdown", None, "text/markdown"),
        ("text/x-markdown", "a.bin", "text/markdown"),
        ("TEXT/HTML", None, "text/html"),
        ("application/pdf", "scan.PDF", "application/pdf"),
        ("application/octet-stream", "paper.pdf", "application/pdf"),
        (None, "README.md", "text/markdown"),
        ("text/plain", "README.markdown", "text/markdown"),  # what some browsers send
        ("", "page.htm", "text/html"),
    ],
)
def test_media_type_comes_from_the_content_type_or_the_file_name(
    content_type: str | None, filename: str | None, expected: str
) -> None:
    assert media_type_of(content_type, filename) == expected


@pytest.mark.parametrize(
    ("content_type", "filename"),
    [
        ("image/png", "photo.png"),
        ("application/octet-stream", "archive.zip"),
        (None, None),
        ("application/vnd.ms-excel", "sheet.pdf"),  # a declared type is not overridden
    ],
)
def test_other_types_are_415(content_type: str | None, filename: str | None) -> None:
    with pytest.raises(UnsupportedMediaType) as raised:
        media_type_of(content_type, filename)
    assert raised.value.status == 415
    assert "text/plain, text/markdown, text/html or application/pdf" in raised.value.message


async def test_text_and_markdown_are_kept_as_they_are() -> None:
    markdown = "# Title\n\n* one\n* two\n\n```py\nx  =  1\n```\n"
    assert await extract(markdown.encode(), "text/markdown") == markdown
    assert await extract("\ufeffcafé".encode(), "text/plain") == "café"  # BOM dropped


async def test_undecodable_text_is_a_clear_400() -> None:
    with pytest.raises(BadRequest) as raised:
        await extract(b"ok \xff\xfe bytes", "text/plain")
    assert (raised.value.code, raised.value.param) == ("invalid_encoding", "file")
    assert "offset 3" in raised.value.message


async def test_html_becomes_its_visible_text() -> None:
    html = b"""<!doctype html><html><head><title>T</title><style>p{color:red}</style>
    <script>alert("no")</script></head><body>
    <h1>Harbour  guide</h1><p>Boats leave at <b>dawn</b>.<br>Ferries later.</p>
    <ul><li>Kiosk</li><li>Lighthouse</li></ul><noscript>enable js</noscript>
    <table><tr><td>Mon</td><td>9:00</td></tr></table></body></html>"""
    assert await extract(html, "text/html") == (
        "Harbour guide\n\nBoats leave at dawn.\nFerries later.\n\nKiosk\n\nLighthouse\n\nMon 9:00"
    )
    latin1 = '<meta charset="iso-8859-1"><p>caf\xe9</p>'.encode("latin-1")
    assert await extract(latin1, "text/html") == "caf\xe9"
    assert await extract(b"no markup here", "text/html") == "no markup here"


async def test_unclosed_blocks_nested_deep_are_read_whole() -> None:
    """Unclosed blocks 50,000 deep: editing a tree of them (as an earlier reading did) walked
    each tag's descendants, minutes for 200 KB; the parser's events are read as they come."""
    html = b"<div>" + b"<p>x" * 50_000 + b"<script>hidden()</script><p>end"
    assert await extract(html, "text/html") == "\n\n".join(["x"] * 50_000 + ["end"])


async def test_markup_the_standard_parser_chokes_on_is_read() -> None:
    """What made the standard library's parser fail (a marked section it asserts on: a 500)
    or rescan the rest of the text for each tag (unclosed `<a` and comments: 4.7 s for 80 KB,
    hours for the largest upload) is read; a dropped element left unclosed hides no more
    than its parent."""
    assert await extract(b"<p>hi</p><![ x", "text/html") == "hi"
    unclosed = b"<p>one</p>" + b"<a" * 200_000 + b"<p>two"
    assert await extract(unclosed, "text/html") == "one\n\ntwo"
    comment = b"<p>one</p>" + b"<!-- x >" * 100_000 + b"<p>two"  # (open to the end, as HTML says)
    assert await extract(comment, "text/html") == "one"
    dropped = b"<div><object><param></div><p>after</p>"
    assert await extract(dropped, "text/html") == "after"


async def test_pdf_pages_become_text() -> None:
    pdf = pdf_with_pages("The harbour opens at dawn.\nBoats leave first.", "", "Page three.")
    assert await extract(pdf, "application/pdf") == (
        "The harbour opens at dawn.\nBoats leave first.\n\nPage three."
    )
    # an encrypted PDF that opens without a password is read like any other
    assert await extract(encrypted(pdf, ""), "application/pdf") == await extract(
        pdf, "application/pdf"
    )


async def test_pdfs_without_text_broken_or_locked_are_clear_errors() -> None:
    with pytest.raises(Unprocessable, match="no extractable text") as no_text:
        await extract(pdf_with_pages("", ""), "application/pdf")
    assert no_text.value.status == 422
    with pytest.raises(BadRequest, match="not a readable PDF"):
        await extract(b"%PDF-1.4 this is not really a pdf", "application/pdf")
    with pytest.raises(BadRequest, match="not a readable PDF"):
        await extract(pdf_with_pages("text")[:200], "application/pdf")
    with pytest.raises(Unprocessable, match="encrypted") as locked:
        await extract(encrypted(pdf_with_pages("secret"), "pw"), "application/pdf")
    assert locked.value.code == "encrypted_pdf"


async def test_blank_documents_are_422() -> None:
    for data, media_type in ((b" \n ", "text/plain"), (b"<p> </p><script>x</script>", "text/html")):
        with pytest.raises(Unprocessable, match="no text"):
            await extract(data, media_type)


async def test_text_far_over_the_token_limit_is_413_before_counting() -> None:
    with pytest.raises(PayloadTooLarge, match="max_attachment_tokens"):
        await extract(b"word " * 1_000, "text/plain", max_tokens=10)
    pages = ["many words on this page " * 20] * 5
    with pytest.raises(PayloadTooLarge):
        await extract(pdf_with_pages(*pages), "application/pdf", max_tokens=20)


async def test_index_text_counts_and_chunks_and_enforces_the_limit() -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "the quick brown fox " * 40 for i in range(30))
    indexed = await index_text(text, max_tokens=100_000)  # large: counted in a thread
    assert indexed.text == text
    assert len(indexed.chunks) > 1
    assert abs(indexed.tokens - sum(t for _, t in indexed.chunks)) < len(indexed.chunks) * 2
    with pytest.raises(PayloadTooLarge, match=f"{indexed.tokens} tokens"):
        await index_text(text, max_tokens=indexed.tokens - 1)
