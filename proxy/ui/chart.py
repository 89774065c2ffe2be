"""Bar charts as inline SVG, drawn on the server: the usage page needs no JavaScript."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT = 720, 200
LEFT, RIGHT, BOTTOM, TOP = 110, 40, 36, 16


def bar_chart(
    title: str, bars: Sequence[tuple[str, float]], *, unit: str = "", digits: int = 0
) -> str:
    """A `<figure>` with a bar per (label, value), labelled for screen readers by its title
    and, bar by bar, by `<title>` elements; an empty series says so in words."""
    heading = escape(title)
    if not bars:
        return f"<figure><figcaption>{heading}: nothing in this period.</figcaption></figure>"
    top = max(value for _, value in bars) or 1.0
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - BOTTOM - TOP
    step = inner_w / len(bars)
    width = min(48.0, max(2.0, step * 0.7))
    shown = f"{{:,.{digits}f}}"
    parts = [
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{heading}">',
        f'<line class="axis" x1="{LEFT}" y1="{TOP + inner_h}" x2="{WIDTH - RIGHT}" '
        f'y2="{TOP + inner_h}"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">'
        f"{escape(shown.format(top))}{escape(unit)}</text>",
        f'<text x="{LEFT - 6}" y="{TOP + inner_h}" text-anchor="end">0</text>',
    ]
    label_every = -(-len(bars) // 7)  # at most seven labels under the axis
    for i, (label, value) in enumerate(bars):
        h = inner_h * value / top
        x = LEFT + i * step + (step - width) / 2
        said = f"{label}: {shown.format(value)}{unit}"
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{TOP + inner_h - h:.1f}" width="{width:.1f}" '
            f'height="{h:.1f}"><title>{escape(said)}</title></rect>'
        )
        if i % label_every == 0:
            parts.append(
                f'<text x="{x + width / 2:.1f}" y="{HEIGHT - BOTTOM + 16}" '
                f'text-anchor="middle">{escape(label[-16:])}</text>'
            )
    parts.append("</svg>")
    return f"<figure>{''.join(parts)}<figcaption>{heading}</figcaption></figure>"
