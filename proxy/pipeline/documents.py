"""Documents as text: what an uploaded file says, and its passages for search.

Plain text and Markdown are kept as they are (UTF-8); HTML becomes its visible text
(libxml2's HTML parser through lxml, events only, in linear time whatever the markup; its
encoding found by BeautifulSoup's UnicodeDammit; scripts and styles dropped, blocks on lines of
their own); PDF becomes the text
of its pages (pypdf). Parsing a large PDF or HTML file, and tokenizing a large text, is CPU
work: it runs in a worker thread, off the event loop. The parsers are imported by the first
file that needs one (about 30 MB that a process with no documents never holds).
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import cast

from policies.chunks import counted_chunks
from policies.tokens import count_text
from proxy.accounting.costs import TOKENIZE_INLINE_CHARS, ready_to_count
from proxy.core.errors import BadRequest, PayloadTooLarge, Unprocessable, UnsupportedMediaType

PLAIN, MARKDOWN, HTML, PDF = "text/plain", "text/markdown", "text/html", "application/pdf"
MEDIA_TYPES = (PLAIN, MARKDOWN, HTML, PDF)
_ALIASES = {
    "text/x-markdown": MARKDOWN,
    "application/xhtml+xml": HTML,
    "application/x-pdf": PDF,
}
_EXTENSIONS = {
    ".txt": PLAIN,
    ".text": PLAIN,
    ".md": MARKDOWN,
    ".markdown": MARKDOWN,
    ".html": HTML,
    ".htm": HTML,
    ".pdf": PDF,
}
# Content types that say nothing about the file: its name's extension decides.
_GENERIC = frozenset({"", "application/octet-stream", "binary/octet-stream"})
# Texts are parsed in a worker thread from this size on (bytes): below it, a few milliseconds
# at most (HTML nested as deep as it goes: 16 KB of `<p>` in about 2.5 ms).
_PARSE_INLINE_BYTES = 16_000
# Extraction stops once the text is this many characters per allowed token: a text that long
# is over the token limit in any realistic tokenization, and counting it would be wasted work.
_CHARS_PER_TOKEN_CEILING = 16

_HTML_DROPPED = ("script", "style", "noscript", "template", "head", "svg", "iframe", "object")
_HTML_BLOCKS = (
    *("address", "article", "aside", "blockquote", "caption", "dd", "details", "div", "dl"),
    *("dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4"),
    *("h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p", "pre", "section"),
    *("summary", "table", "tbody", "thead", "tfoot", "tr", "ul"),
)
_SPACES = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\n{3,}")


@dataclass(frozen=True, slots=True)
class IndexedText:
    """A document's text with its token count and its passages ((text, tokens), in order)."""

    text: str
    tokens: int
    chunks: list[tuple[str, int]]


def media_type_of(content_type: str | None, filename: str | None = None) -> str:
    """The supported media type of an upload, from its content type, else its file name's
    extension; UnsupportedMediaType naming what is supported otherwise."""
    declared = (content_type or "").split(";", 1)[0].strip().lower()
    declared = _ALIASES.get(declared, declared)
    if declared in MEDIA_TYPES and not (declared == PLAIN and _by_extension(filename)):
        return declared
    by_name = _by_extension(filename)
    if by_name and (declared in _GENERIC or declared == PLAIN):
        return by_name
    what = f"'{declared}'" if declared not in _GENERIC else f"file '{filename or ''}'"
    raise UnsupportedMediaType(
        f"Unsupported attachment type {what}: send text/plain, text/markdown, text/html or "
        "application/pdf (or a .txt, .md, .html or .pdf file).",
        param="file",
    )


def _by_extension(filename: str | None) -> str | None:
    return _EXTENSIONS.get(PurePosixPath(filename or "").suffix.lower())


async def extract_text(data: bytes, media_type: str, *, max_tokens: int, param: str) -> str:
    """The text of a document of `media_type` (one of MEDIA_TYPES). 400 for bytes that are not
    what they claim to be, 422 for a document with no text, 413 for a text far over
    `max_tokens` (the exact count is the caller's)."""
    max_chars = max_tokens * _CHARS_PER_TOKEN_CEILING
    if media_type == PDF:
        text = await asyncio.to_thread(_pdf_text, data, max_chars)
    elif media_type == HTML:
        text = await _maybe_in_thread(_html_text, data)
    else:
        text = _utf8(data, param)
    text = text.replace("\x00", "")  # (an extraction's artefact, and no database stores one)
    if len(text) > max_chars:
        raise _too_many_tokens(max_tokens)
    if not text.strip():
        raise Unprocessable("The attachment contains no text.", param=param, code="no_text")
    return text


async def index_text(text: str, *, max_tokens: int) -> IndexedText:
    """Count a document's tokens (413 over `max_tokens`) and cut it into passages; large
    texts in a worker thread."""

    def work() -> IndexedText:
        tokens = count_text(text)
        if tokens > max_tokens:
            raise _too_many_tokens(max_tokens, tokens)
        return IndexedText(text, tokens, counted_chunks(text))

    await ready_to_count("")
    if len(text) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(work)
    return work()


def _too_many_tokens(limit: int, tokens: int | None = None) -> PayloadTooLarge:
    found = f" ({tokens} tokens)" if tokens is not None else ""
    return PayloadTooLarge(
        f"The attachment's text is too long{found}: at most {limit} tokens are accepted "
        "(server.max_attachment_tokens).",
        code="attachment_too_large",
    )


async def _maybe_in_thread(parse: Callable[[bytes], str], data: bytes) -> str:
    if len(data) > _PARSE_INLINE_BYTES:
        return await asyncio.to_thread(parse, data)
    return parse(data)


def _utf8(data: bytes, param: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"The attachment is not UTF-8 text (undecodable byte at offset {exc.start}); "
            "send UTF-8, or a PDF or HTML file.",
            param=param,
            code="invalid_encoding",
        ) from None


def _html_text(data: bytes) -> str:
    """The visible text of an HTML document, blocks separated by blank lines."""
    from bs4 import UnicodeDammit
    from lxml import etree

    markup: str | None
    try:
        markup = data.decode("utf-8-sig")
    except UnicodeDecodeError:  # its <meta charset>, else a guess
        markup = UnicodeDammit(data, is_html=True).unicode_markup
    if markup is None:
        raise BadRequest("The file's text encoding cannot be told.", param="file")
    if "<" not in markup:
        return _tidy(markup)  # no markup at all
    reader = _VisibleText()
    # (The stubs' target protocol lists every event; lxml sends a target only those it has.)
    target = cast("etree.ParserTarget[None]", reader)
    parser = etree.HTMLParser(target=target, recover=True, huge_tree=True, no_network=True)
    try:
        parser.feed(markup)
        parser.close()
    except etree.LxmlError as exc:  # (recover=True mends nearly everything)
        raise BadRequest(f"The file is not readable HTML ({exc}).", param="file") from None
    return _tidy("".join(reader.parts))


class _VisibleText:
    """HTML's visible text, from the parser's events as they come (a parser target: no tree
    is built, so nothing walks a tag's descendants; editing BeautifulSoup's tree took 20 s for
    80 KB of unclosed `<p>`, and the standard library's parser rescans to the end of the text
    for each unclosed `<a`: 4.7 s for 80 KB)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._hidden = 0  # inside this many dropped tags (scripts, styles, the head)

    def start(self, tag: str, attrib: dict[str, str]) -> None:
        if tag in _HTML_DROPPED:
            self._hidden += 1
        elif tag == "br":
            self.parts.append("\n")
        elif tag in _HTML_BLOCKS:
            self.parts.append("\n\n")

    def end(self, tag: str) -> None:
        if tag in _HTML_DROPPED:
            self._hidden = max(0, self._hidden - 1)
        elif tag in _HTML_BLOCKS:
            self.parts.append("\n\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")  # cells of a row on one line

    def data(self, data: str) -> None:
        if not self._hidden:
            self.parts.append(data)

    def close(self) -> None:
        pass


def _pdf_text(data: bytes, max_chars: int) -> str:
    """The text of a PDF's pages, a blank line between pages."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise FileNotDecryptedError("a password is needed")
        pages: list[str] = []
        size = 0
        for page in reader.pages:
            text = _tidy(page.extract_text() or "")
            pages.append(text)
            size += len(text)
            if size > max_chars:
                break  # the caller answers 413
    except (FileNotDecryptedError, DependencyError):
        raise Unprocessable(
            "The PDF is encrypted; upload a copy without a password.",
            param="file",
            code="encrypted_pdf",
        ) from None
    except PyPdfError as exc:
        raise BadRequest(f"The file is not a readable PDF ({exc}).", param="file") from None
    except Exception as exc:  # pypdf may fail on broken files with any error (its own docs)
        raise BadRequest(
            f"The file is not a readable PDF ({type(exc).__name__}).", param="file"
        ) from None
    text = "\n\n".join(p for p in pages if p)
    if not text:
        raise Unprocessable(
            "The PDF has no extractable text (scanned pages need OCR first).",
            param="file",
            code="no_text",
        )
    return text


def _tidy(text: str) -> str:
    """Runs of spaces as one, lines stripped, at most one blank line in a row."""
    lines = (_SPACES.sub(" ", line).strip() for line in text.replace("\r", "\n").split("\n"))
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
