"""What a model call cost: token prices, usage as providers report it, and the arithmetic.

Prices come from two places: the tenant-wide `pricing:` overrides of config.yaml (per million
tokens, for self-hosted and custom models) and litellm's bundled model map (per token). A model
found in neither has no price, and its cost is `None` ("unknown"), never 0.

Money is `Decimal` throughout, so a cost is the exact product of tokens and prices (rounded to
1e-10 USD), and `format_usd` writes it without float noise or exponents.

Usage follows OpenAI's convention, which litellm also follows: `prompt_tokens` includes cached
(cache-read) and cache-write tokens, `completion_tokens` includes reasoning tokens. Cached
tokens are billed at the cached rate when the model has one, reasoning tokens at the reasoning
rate when the model has one; everything else at the plain input and output rates. A model
whose map entry has prices "above N tokens" (`input_cost_per_token_above_200k_tokens`, long
context on Gemini 2.5 Pro, GPT-5.4) bills a call whose prompt has more than N tokens at those,
wholly (its output and cached tokens too), as the provider and litellm do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

MILLION = Decimal(1_000_000)
# The precision costs are kept to, in USD: a ten-thousandth of a millionth of a dollar.
USD_QUANTUM = Decimal("1e-10")
USD_DIGITS = 10  # the same, for sums of costs as floats: rounded back to it
ZERO = Decimal(0)
# A long-context rate of litellm's model map: `input_cost_per_token_above_200k_tokens`.
_TIERED = re.compile(r"(?:input|output)_cost_per_token_above_(\d+)(k?)_tokens")
_TIER_RATES = {
    "input": "input_cost_per_token",
    "output": "output_cost_per_token",
    "cached_input": "cache_read_input_token_cost",
    "cache_write": "cache_creation_input_token_cost",
}


def _usd(value: Any) -> Decimal | None:
    """A price from config or the model map as an exact decimal (floats via their repr)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        price = Decimal(str(value))
    except ArithmeticError:
        return None
    return price if price.is_finite() and price >= 0 else None


@dataclass(frozen=True, slots=True)
class Price:
    """USD per token. `None` for an optional rate means "billed at the plain rate"."""

    input: Decimal
    output: Decimal
    cached_input: Decimal | None = None
    cache_write: Decimal | None = None
    reasoning: Decimal | None = None
    # (N, the price of a call whose prompt has more than N tokens), N ascending.
    above: tuple[tuple[int, Price], ...] = ()

    def for_prompt(self, prompt_tokens: int) -> Price:
        """The price of a call with this many prompt tokens: the highest tier it is above."""
        price = self
        for threshold, tier in self.above:
            if prompt_tokens > threshold:
                price = tier
        return price

    @classmethod
    def per_million(
        cls, input_per_mtok: float, output_per_mtok: float, cached_input_per_mtok: float | None
    ) -> Price:
        """A price as config.yaml writes it (USD per million tokens)."""
        cached = _usd(cached_input_per_mtok)
        return cls(
            input=(_usd(input_per_mtok) or ZERO) / MILLION,
            output=(_usd(output_per_mtok) or ZERO) / MILLION,
            cached_input=None if cached is None else cached / MILLION,
        )

    @classmethod
    def from_model_map(cls, entry: Mapping[str, Any]) -> Price | None:
        """A price from one entry of litellm's model map, or None if it has no token prices."""
        input_price = _usd(entry.get("input_cost_per_token"))
        output_price = _usd(entry.get("output_cost_per_token"))
        if input_price is None or output_price is None:
            return None
        base = cls(
            input=input_price,
            output=output_price,
            cached_input=_usd(entry.get("cache_read_input_token_cost")),
            cache_write=_usd(entry.get("cache_creation_input_token_cost")),
            reasoning=_usd(entry.get("output_cost_per_reasoning_token")),
        )
        thresholds = {
            (int(m[1]) * (1000 if m[2] else 1), f"{m[1]}{m[2]}")
            for m in map(_TIERED.fullmatch, entry)
            if m is not None
        }
        tiers: list[tuple[int, Price]] = []
        price = base
        for threshold, written in sorted(thresholds):
            # Each tier's rates, and what it leaves out as in the tier below (as litellm).
            rates: dict[str, Any] = {
                field: rate
                for field, key in _TIER_RATES.items()
                if (rate := _usd(entry.get(f"{key}_above_{written}_tokens"))) is not None
            }
            price = replace(price, **rates)
            tiers.append((threshold, price))
        return replace(base, above=tuple(tiers))


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one model call. `estimated`: counted by us because the provider said nothing."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_openai(self) -> dict[str, Any]:
        """The usage object in OpenAI's shape (for records of estimated usage)."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _detail(usage: Mapping[str, Any], group: str, name: str) -> int:
    details = usage.get(group)
    return _count(details.get(name)) if isinstance(details, Mapping) else 0


def parse_usage(usage: Any) -> Usage | None:
    """Usage as an OpenAI-compatible provider reports it (litellm's Anthropic fields too), or
    None when there is no usable usage object."""
    if not isinstance(usage, Mapping):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) and not isinstance(completion, int):
        return None
    return Usage(
        prompt_tokens=_count(prompt),
        completion_tokens=_count(completion),
        cached_tokens=_detail(usage, "prompt_tokens_details", "cached_tokens")
        or _count(usage.get("cache_read_input_tokens")),
        cache_write_tokens=_count(usage.get("cache_creation_input_tokens")),
        reasoning_tokens=_detail(usage, "completion_tokens_details", "reasoning_tokens"),
    )


def cost(usage: Usage, price: Price) -> Decimal:
    """USD for `usage` at `price` (its tier for the usage's prompt)."""
    price = price.for_prompt(usage.prompt_tokens)
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    written = min(usage.cache_write_tokens, usage.prompt_tokens - cached)
    plain_input = usage.prompt_tokens - cached - written
    reasoning = min(usage.reasoning_tokens, usage.completion_tokens)
    plain_output = usage.completion_tokens - reasoning
    total = (
        plain_input * price.input
        + cached * (price.input if price.cached_input is None else price.cached_input)
        + written * (price.input if price.cache_write is None else price.cache_write)
        + plain_output * price.output
        + reasoning * (price.output if price.reasoning is None else price.reasoning)
    )
    return total.quantize(USD_QUANTUM).normalize() if total else ZERO


def format_usd(amount: Decimal | None) -> str:
    """A cost for a header or a report: plain decimal notation, `unknown` for no price."""
    if amount is None:
        return "unknown"
    if not amount:
        return "0"
    return format(amount.quantize(USD_QUANTUM).normalize(), "f")


def names_of(model: str) -> list[str]:
    """The names a model's facts are found by: its own, then without its provider prefix
    (`openai/gpt-4o-mini`), then its last part (`openrouter/openai/gpt-4o-mini`)."""
    if "/" not in model:
        return [model]
    return list(dict.fromkeys([model, model.split("/", 1)[1], model.rsplit("/", 1)[1]]))


class PriceBook:
    """Prices by model name: config overrides first, then the model map.

    `model_map` returns the map's entry for a name (or None); lookups are remembered, so after
    the first request for a model its price is one dictionary read."""

    def __init__(
        self,
        overrides: Mapping[str, Price],
        model_map: Callable[[str], Mapping[str, Any] | None],
    ) -> None:
        self._overrides = dict(overrides)
        self._model_map = model_map
        self._known: dict[str, Price | None] = {}

    def price(self, model: str) -> Price | None:
        try:
            return self._known[model]
        except KeyError:
            pass
        found = next(
            (p for n in names_of(model) if (p := self._overrides.get(n)) is not None), None
        )
        if found is None:
            entry = self._model_map(model)
            found = Price.from_model_map(entry) if entry else None
        if len(self._known) < 10_000:  # model names come from clients: keep the memo bounded
            self._known[model] = found
        return found

    def cost(self, model: str, usage: Usage) -> Decimal | None:
        """USD for `usage` of `model`, or None when the model has no price."""
        price = self.price(model)
        return None if price is None else cost(usage, price)
