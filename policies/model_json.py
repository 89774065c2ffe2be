"""The proxy's own model calls that answer in JSON (intent, extraction, the attachments'
planner): the request asking for one object, reading the objects they answer with, and
clipping what goes into their prompts."""

from __future__ import annotations

import json
from typing import Any


def json_request(model: str, system: str, user: str, max_tokens: int) -> dict[str, Any]:
    """A chat completion body asking `model` for one JSON object, deterministically."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "response_format": {"type": "json_object"},
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def json_object(content: Any) -> dict[str, Any] | None:
    """`content` as a JSON object, or None if it is not one. Some models wrap JSON in a
    Markdown fence even when asked not to; the fence is taken off."""
    if not isinstance(content, str):
        return None
    stripped = content.strip()
    if stripped.startswith("```"):
        stripped = stripped.split("\n", 1)[1] if "\n" in stripped else ""
        stripped = stripped.rsplit("```", 1)[0]
    try:
        data = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def clamp01(value: Any, default: float = 0.5) -> float:
    """A number from 0 to 1 (a model's confidence), `default` when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return default
    try:
        number = float(value)
    except ValueError:
        return default
    except OverflowError:  # an integer too large for a float: far out of range either way
        number = 1.0 if isinstance(value, int) and value > 0 else 0.0
    if number != number:  # NaN
        return default
    return round(min(1.0, max(0.0, number)), 4)


def text_of(content: Any) -> str:
    """A message content's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
