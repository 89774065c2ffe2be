"""The fence: how every stored string is shown to a model.

Whatever a user, a client or a document wrote (a stored turn, a memory, an attachment's title
or text, a summary, a tool result) reaches the proxy's own prompts and the recall sections only
through `fence`: each of its lines starts with `> `, so it reads as a quotation, and nothing in
it can begin a line of the prompt's own (a heading, a `[document ...]` descriptor, a
`role:` line, an end marker). Lines are split on every break a model may read as one (`\\r`,
form feed, `\\u2028`...), not only `\\n`. What the proxy writes around the fence (labels,
counts, dates) is its own; an id the client chose is data too, and goes inside.

`unfence` reads a fenced block back (the echo upstream answers the proxy's prompts with it).
"""

from __future__ import annotations

MARK = "> "


def fence(text: str, *, lead: str = "", flat: bool = False) -> str:
    """`text` quoted: every line starts with `> ` (an empty one is `>`). `lead` (the proxy's
    own words, e.g. `user: `) opens the first line inside the quote; `flat` collapses all
    whitespace so the text takes one line. NUL characters are dropped (no database keeps
    them)."""
    text = text.replace("\x00", "")
    if flat:
        return (MARK + lead + " ".join(text.split())).rstrip()
    # str.splitlines breaks on \n \r \v \f \x1c \x1d \x1e \x85 \u2028 \u2029.
    lines = (lead + text).splitlines() or [""]
    return "\n".join((MARK + line).rstrip() if line.strip() else MARK.rstrip() for line in lines)


def unfence(block: str) -> str:
    """The text of a fenced block: its quoted lines without their `> ` (other lines skipped)."""
    lines = []
    for line in block.split("\n"):
        if line.startswith(MARK):
            lines.append(line[len(MARK) :])
        elif line == MARK.rstrip():
            lines.append("")
    return "\n".join(lines)
