"""Cutting a document into passages for search and for the processing plan.

A passage is at most `max_tokens` tiktoken tokens and never empty. The text is split at the
largest boundary that fits: paragraphs (blank lines), then sentences, then words, then
characters; the pieces are packed back together greedily, in order, so a passage holds as many
whole paragraphs (or sentences) as fit. Deterministic: the same text gives the same passages.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from policies.tokens import count_text

DEFAULT_CHUNK_TOKENS = 256

_PARAGRAPHS = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_SENTENCES = re.compile(r"(?<=[.!?;:])\s+|\n+")
_WORDS = re.compile(r"\s+")
# What goes between pieces put back together, by the boundary they were split at.
_PARAGRAPH, _SENTENCE = "\n\n", " "
# Where a cut by characters looks for its end: bounds the work on a huge unbroken "word".
_MAX_CHARS_PER_TOKEN = 32


def chunk_text(text: str, max_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[str]:
    """The passages of `text`, in order (none for a blank text)."""
    return [passage for passage, _ in counted_chunks(text, max_tokens)]


def counted_chunks(text: str, max_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[tuple[str, int]]:
    """The passages of `text` with their token counts (what storing them needs)."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    packer = _Packer(max_tokens)
    for paragraph in _PARAGRAPHS.split(text.strip()):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        tokens = count_text(paragraph)
        if tokens <= max_tokens:
            packer.add(paragraph, tokens, _PARAGRAPH)
            continue
        packer.flush()  # an oversized paragraph's sentences make passages of their own
        for sentence, sentence_tokens in _sentences(paragraph, max_tokens):
            packer.add(sentence, sentence_tokens, _SENTENCE)
        packer.flush()
    packer.flush()
    return packer.done


def _sentences(paragraph: str, max_tokens: int) -> Iterator[tuple[str, int]]:
    """The sentences of an oversized paragraph, each cut further when it alone is too long."""
    for sentence in _SENTENCES.split(paragraph):
        sentence = sentence.strip()
        if not sentence:
            continue
        tokens = count_text(sentence)
        if tokens <= max_tokens:
            yield sentence, tokens
        else:
            yield from _hard_split(sentence, max_tokens)


def _hard_split(sentence: str, max_tokens: int) -> Iterator[tuple[str, int]]:
    """Words packed greedily; a word longer than the limit is cut by characters."""
    packer = _Packer(max_tokens)
    for word in _WORDS.split(sentence):
        if not word:
            continue
        tokens = count_text(word)
        if tokens <= max_tokens:
            packer.add(word, tokens, " ")
            continue
        packer.flush()
        for piece in _cut_characters(word, max_tokens):
            packer.add(piece, count_text(piece), " ")
        packer.flush()
    packer.flush()
    yield from packer.done


def _cut_characters(word: str, max_tokens: int) -> Iterator[str]:
    """The longest prefixes that fit, one after another (binary search on the length, within a
    window no real token run exceeds; a single character always goes whole)."""
    rest = word
    while rest:
        low, high = 1, min(len(rest), max_tokens * _MAX_CHARS_PER_TOKEN)
        while low < high:  # the longest prefix of at most max_tokens tokens
            middle = (low + high + 1) // 2
            if count_text(rest[:middle]) <= max_tokens:
                low = middle
            else:
                high = middle - 1
        yield rest[:low]
        rest = rest[low:]


class _Packer:
    """Puts pieces together in order while the estimate (the pieces' counts and their
    separators) fits, and checks each passage's real count when it is closed: joining text can
    tokenize differently from its parts, so a passage that came out too long gives back its
    last pieces to the next."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.pieces: list[tuple[str, int, str]] = []
        self.estimate = 0
        self.done: list[tuple[str, int]] = []

    def add(self, piece: str, tokens: int, separator: str) -> None:
        cost = tokens + (1 if self.pieces else 0)
        if self.pieces and self.estimate + cost > self.max_tokens:
            self.flush()
            cost = tokens
        self.pieces.append((piece, tokens, separator))
        self.estimate += cost

    def flush(self) -> None:
        pending = self.pieces
        self.pieces, self.estimate = [], 0
        while pending:
            taken = len(pending)
            while True:
                passage = _join(pending[:taken])
                tokens = count_text(passage) if taken > 1 else pending[0][1]
                if tokens <= self.max_tokens or taken == 1:
                    break
                taken -= 1
            self.done.append((passage, tokens))
            pending = pending[taken:]


def _join(pieces: list[tuple[str, int, str]]) -> str:
    out = [pieces[0][0]]
    for piece, _, separator in pieces[1:]:
        out.append(separator)
        out.append(piece)
    return "".join(out)
