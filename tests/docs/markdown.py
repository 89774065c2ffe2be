"""Reading the documentation's Markdown: fenced code blocks with the HTML comment before them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    mark: str  # the HTML comment right before the block ("" when none), e.g. "not run"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        indent = len(match["indent"])
        body = "\n".join(line[indent:] for line in match["body"].splitlines()) + "\n"
        mark = _comment_before(text[: match.start()])
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(path, line, match["lang"], body, mark))
    return found


def _comment_before(text: str) -> str:
    """The text of an HTML comment that ends right before a block (blank lines allowed)."""
    text = text.rstrip()
    if not text.endswith("-->"):
        return ""
    return text[text.rfind("<!--") + 4 : -3].strip()


def pages() -> list[Path]:
    """README.md and every page of the documentation site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
