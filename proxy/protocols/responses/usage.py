"""Usage objects between the two APIs, so that one pricer prices both.

Responses                                   Chat Completions
input_tokens                                prompt_tokens
output_tokens                               completion_tokens
total_tokens                                total_tokens
input_tokens_details.cached_tokens          prompt_tokens_details.cached_tokens
input_tokens_details.cache_write_tokens     cache_creation_input_tokens (what the pricer reads)
output_tokens_details.reasoning_tokens      completion_tokens_details.reasoning_tokens
"""

from __future__ import annotations

from typing import Any


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _detail(usage: dict[str, Any], group: str, name: str) -> int:
    details = usage.get(group)
    return _count(details.get(name)) if isinstance(details, dict) else 0


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses usage object in the Chat Completions shape (None if there is none)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))
    total = _count(usage.get("total_tokens")) or prompt + completion
    chat: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total,
        "prompt_tokens_details": {
            "cached_tokens": _detail(usage, "input_tokens_details", "cached_tokens")
        },
        "completion_tokens_details": {
            "reasoning_tokens": _detail(usage, "output_tokens_details", "reasoning_tokens")
        },
    }
    written = _detail(usage, "input_tokens_details", "cache_write_tokens")
    if written:
        chat["cache_creation_input_tokens"] = written
    return chat


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """A Chat Completions usage object in the Responses shape (None if there is none)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    written = _detail(usage, "prompt_tokens_details", "cache_write_tokens") or _count(
        usage.get("cache_creation_input_tokens")
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": _detail(usage, "prompt_tokens_details", "cached_tokens")
            or _count(usage.get("cache_read_input_tokens")),
            "cache_write_tokens": written,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": _detail(usage, "completion_tokens_details", "reasoning_tokens")
        },
        "total_tokens": _count(usage.get("total_tokens")) or prompt + completion,
    }
