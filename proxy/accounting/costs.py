"""What a chat completion used and cost: from the upstream's usage (or our own count when it
reports none), priced, as response headers and as the exchange record's fields."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from policies.pricing import ZERO, PriceBook, Usage, format_usd, parse_usage
from policies.tokens import (
    build_encodings,
    count_messages,
    count_text,
    encodings_built,
    message_text,
)

# Texts longer than this are tokenized in a worker thread, off the event loop.
TOKENIZE_INLINE_CHARS = 16_000

COST_HEADERS = (
    "x-usage-prompt-tokens",
    "x-usage-completion-tokens",
    "x-usage-estimated",
    "x-cost-usd",
    "x-cost-upstream-usd",
    "x-cost-memory-usd",
    "x-cost-final",
)


@dataclass(slots=True)
class Bill:
    """Usage and cost of one exchange. `upstream_usd` is None when the model has no price;
    `final` is False while a stream is still running (the prompt side only). `memory_usd` is
    what the proxy's own model calls cost before the headers went out: for the headers only,
    since each such call is recorded as it happens (proxy/accounting/charges.py). As in the
    record and the usage report, a call of a model without a price adds nothing to it (the record
    lists it in `cost.parts` with `cost_usd` null)."""

    usage: Usage
    upstream_usd: Decimal | None
    memory_usd: Decimal = ZERO
    final: bool = True
    # The upstream's own usage object, kept in the record as it came (details included).
    reported: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def total_usd(self) -> Decimal | None:
        if self.upstream_usd is None:
            return None
        return self.upstream_usd + self.memory_usd

    def headers(self) -> dict[str, str]:
        headers = {
            "x-usage-prompt-tokens": str(self.usage.prompt_tokens),
            "x-usage-completion-tokens": str(self.usage.completion_tokens),
            "x-cost-usd": format_usd(self.total_usd),
            "x-cost-upstream-usd": format_usd(self.upstream_usd),
            "x-cost-memory-usd": format_usd(self.memory_usd),
            "x-cost-final": "true" if self.final else "false",
        }
        if self.usage.estimated:
            headers["x-usage-estimated"] = "true"
        return headers

    def fields(self) -> dict[str, Any]:
        """The exchange record's usage and cost columns."""
        usage = self.usage
        return {
            "usage": self.reported if self.reported is not None else usage.as_openai(),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
            "reasoning_tokens": usage.reasoning_tokens,
            "usage_estimated": usage.estimated,
            "cost_upstream_usd": None if self.upstream_usd is None else float(self.upstream_usd),
        }


# The record's usage and cost columns of an exchange that never got as far as a bill.
NO_BILL_FIELDS: dict[str, Any] = {
    "usage": None,
    "prompt_tokens": None,
    "completion_tokens": None,
    "cached_tokens": None,
    "reasoning_tokens": None,
    "usage_estimated": False,
    "cost_upstream_usd": None,
}


def nothing_billed() -> Bill:
    """An upstream error: no tokens, nothing to pay, whatever the model's price."""
    return Bill(Usage(0, 0), ZERO)


async def ready_to_count(model: str) -> None:
    """Build the tokenizers counting for `model` uses, the first time, in a worker thread:
    building one takes about a second, which the event loop must not wait through."""
    if not encodings_built(model):
        await asyncio.to_thread(build_encodings, model)


async def count_prompt(messages: list[dict[str, Any]], model: str) -> int:
    """Prompt tokens of `messages` with tiktoken; long prompts in a worker thread."""
    await ready_to_count(model)
    if sum(len(message_text(m)) for m in messages) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(count_messages, messages, model)
    return count_messages(messages, model)


async def count_reply(reply: dict[str, Any] | None, model: str) -> int:
    """Completion tokens of a reply: its text, without the chat format's framing."""
    text = message_text(reply) if reply else ""
    await ready_to_count(model)
    if len(text) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(count_text, text, model)
    return count_text(text, model)


async def usage_or_estimate(
    model: str,
    reported: Any,
    prompt: list[dict[str, Any]],
    reply: dict[str, Any] | None,
    *,
    prompt_tokens: int | None = None,
) -> Usage:
    """The usage a model reported, or, when it reported none, our count of the prompt
    (`prompt_tokens` if already counted) and the reply, marked estimated: a call is charged
    either way."""
    usage = parse_usage(reported)
    if usage is not None:
        return usage
    if prompt_tokens is None:
        prompt_tokens = await count_prompt(prompt, model)
    return Usage(prompt_tokens, await count_reply(reply, model), estimated=True)


class Pricer:
    """Turns usage into a `Bill` with the tenant-wide price book."""

    def __init__(self, prices: PriceBook) -> None:
        self.prices = prices

    def bill(self, model: str, usage: Usage, *, final: bool = True) -> Bill:
        return Bill(usage, self.prices.cost(model, usage), final=final)

    def prompt_side(self, model: str, prompt_tokens: int) -> Bill:
        """A stream's bill as its headers go out: the prompt, counted by us."""
        return self.bill(model, Usage(prompt_tokens, 0, estimated=True), final=False)

    async def final(
        self,
        model: str,
        reported: Any,
        *,
        prompt_tokens: int | None,
        prompt: list[dict[str, Any]],
        reply: dict[str, Any] | None,
    ) -> Bill:
        """The bill from the upstream's usage, or, when it reported none, from our count of
        the prompt (`prompt_tokens` if already counted) and the reply."""
        usage = await usage_or_estimate(model, reported, prompt, reply, prompt_tokens=prompt_tokens)
        bill = self.bill(model, usage)
        if not usage.estimated:
            bill.reported = reported
        return bill
