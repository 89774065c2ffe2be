"""Prices, usage parsing and the cost arithmetic, checked against figures written out by hand."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from policies.pricing import Price, PriceBook, Usage, cost, format_usd, parse_usage
from proxy.accounting.catalog import ModelCatalog

OVERRIDE = Price.per_million(0.5, 1.5, 0.25)


def no_map(model: str) -> dict[str, Any] | None:
    return None


def test_known_model_is_priced_from_litellms_map() -> None:
    catalog = ModelCatalog.load()
    book = PriceBook({}, catalog.info)
    # gpt-4o-mini in the bundled map: $0.15 / $0.60 per million tokens.
    assert book.price("gpt-4o-mini") == Price(
        input=Decimal("1.5e-7"), output=Decimal("6e-7"), cached_input=Decimal("7.5e-8")
    )
    assert book.cost("gpt-4o-mini", Usage(1000, 200)) == Decimal("0.00027")


def test_provider_prefixed_model_finds_its_price() -> None:
    book = PriceBook({}, ModelCatalog.load().info)
    assert book.price("openai/gpt-4o-mini") == book.price("gpt-4o-mini")


def test_override_wins_over_the_map() -> None:
    book = PriceBook({"gpt-4o-mini": OVERRIDE}, ModelCatalog.load().info)
    # 12 input tokens at $0.50/M and 34 output tokens at $1.50/M.
    assert book.cost("gpt-4o-mini", Usage(12, 34)) == Decimal("0.000057")


def test_an_override_is_found_with_a_provider_prefix_too() -> None:
    book = PriceBook(
        {"gpt-4o-mini": OVERRIDE, "my-local-model": OVERRIDE}, ModelCatalog.load().info
    )
    for model in ("openai/gpt-4o-mini", "openrouter/openai/gpt-4o-mini"):  # not the map's
        assert book.cost(model, Usage(12, 34)) == Decimal("0.000057"), model
    assert book.price("hosted_vllm/my-local-model") == OVERRIDE  # a model the map lacks
    # A name's own override comes first.
    exact = PriceBook(
        {"openai/gpt-4o-mini": Price.per_million(1, 1, None), "gpt-4o-mini": OVERRIDE}, no_map
    )
    assert exact.cost("openai/gpt-4o-mini", Usage(1_000_000, 0)) == 1


def test_a_long_prompt_is_billed_at_the_models_long_context_rates() -> None:
    """gemini-2.5-pro in the bundled map: $1.25 / $10 per million tokens (cached $0.125), and
    $2.50 / $15 (cached $0.25) for the whole call once the prompt is over 200k tokens."""
    book = PriceBook({}, ModelCatalog.load().info)
    at_threshold = Usage(200_000, 1000, cached_tokens=100_000)
    # 100,000 plain and 100,000 cached input tokens, 1,000 output.
    assert book.cost("gemini-2.5-pro", at_threshold) == Decimal("0.1475")
    above = Usage(200_001, 1000, cached_tokens=100_000)
    assert book.cost("gemini-2.5-pro", above) == Decimal("0.2900025")


def test_each_tier_keeps_the_rates_it_does_not_name_from_the_one_below() -> None:
    entry = {
        "input_cost_per_token": 1e-6,
        "output_cost_per_token": 2e-6,
        "cache_read_input_token_cost": 1e-7,
        "input_cost_per_token_above_128k_tokens": 3e-6,
        "cache_read_input_token_cost_above_128k_tokens": 3e-7,
        "output_cost_per_token_above_1000000_tokens": 9e-6,
        "input_cost_per_token_above_128k_tokens_priority": 1.0,  # another service tier's
    }
    price = Price.from_model_map(entry)
    assert price is not None
    assert [t for t, _ in price.above] == [128_000, 1_000_000]
    assert cost(Usage(128_000, 10), price) == Decimal("0.12802")  # not above: the plain rates
    assert cost(Usage(128_001, 10, cached_tokens=1), price) == Decimal("0.3840203")
    # Above both: the million's output rate, and the 128k tier's input rates.
    assert cost(Usage(1_000_001, 10), price) == Decimal("3.000093")


def test_unknown_model_is_unpriced_never_zero() -> None:
    book = PriceBook({}, ModelCatalog.load().info)
    assert book.price("my-own-finetune-xyz") is None
    assert book.cost("my-own-finetune-xyz", Usage(100, 100)) is None
    assert format_usd(None) == "unknown"


def test_free_model_costs_zero_because_its_price_is_zero() -> None:
    book = PriceBook({"local": Price.per_million(0, 0, None)}, no_map)
    assert book.cost("local", Usage(100, 100)) == 0
    assert format_usd(Decimal(0)) == "0"


def test_cached_tokens_are_billed_at_the_cached_rate() -> None:
    # 1000 prompt tokens of which 800 cached: 200 x 0.5 + 800 x 0.25, plus 10 x 1.5 output.
    usage = Usage(prompt_tokens=1000, completion_tokens=10, cached_tokens=800)
    assert cost(usage, OVERRIDE) == Decimal("0.000315")


def test_cached_tokens_without_a_cached_rate_pay_the_input_rate() -> None:
    price = Price.per_million(0.5, 1.5, None)
    usage = Usage(prompt_tokens=1000, completion_tokens=0, cached_tokens=800)
    assert cost(usage, price) == Decimal("0.0005")


def test_reasoning_tokens_use_their_own_rate_when_the_model_has_one() -> None:
    price = Price(input=Decimal("1e-6"), output=Decimal("2e-6"), reasoning=Decimal("4e-6"))
    # completion_tokens includes the 30 reasoning tokens: 70 x 2e-6 + 30 x 4e-6.
    usage = Usage(prompt_tokens=0, completion_tokens=100, reasoning_tokens=30)
    assert cost(usage, price) == Decimal("0.00026")
    # Without a reasoning rate they are plain output tokens.
    assert cost(usage, Price(input=Decimal("1e-6"), output=Decimal("2e-6"))) == Decimal("0.0002")


def test_cache_writes_use_the_cache_write_rate() -> None:
    price = Price(input=Decimal("3e-6"), output=Decimal("15e-6"), cache_write=Decimal("3.75e-6"))
    usage = Usage(prompt_tokens=1000, completion_tokens=0, cache_write_tokens=1000)
    assert cost(usage, price) == Decimal("0.00375")


def test_details_larger_than_their_totals_are_clamped() -> None:
    usage = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=50, reasoning_tokens=50)
    # All 10 prompt tokens cached (0.25/M), all 5 completion tokens reasoning (plain 1.5/M).
    assert cost(usage, OVERRIDE) == Decimal("0.000010")


def test_parse_openai_usage_with_details() -> None:
    usage = parse_usage(
        {
            "prompt_tokens": 100,
            "completion_tokens": 20,
            "total_tokens": 120,
            "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 8},
        }
    )
    assert usage == Usage(100, 20, cached_tokens=64, reasoning_tokens=8)
    assert usage is not None and usage.total_tokens == 120


def test_parse_litellm_anthropic_cache_fields() -> None:
    usage = parse_usage(
        {
            "prompt_tokens": 50,
            "completion_tokens": 5,
            "cache_read_input_tokens": 30,
            "cache_creation_input_tokens": 10,
        }
    )
    assert usage == Usage(50, 5, cached_tokens=30, cache_write_tokens=10)


@pytest.mark.parametrize(
    "raw",
    [None, "12", [], {}, {"total_tokens": 5}, {"prompt_tokens": "many"}],
)
def test_unusable_usage_is_none(raw: Any) -> None:
    assert parse_usage(raw) is None


def test_negative_and_bogus_counts_count_as_zero() -> None:
    assert parse_usage({"prompt_tokens": -5, "completion_tokens": True}) == Usage(0, 0)


def test_format_usd_is_plain_decimal() -> None:
    assert format_usd(Decimal("1.5e-7") * 3) == "0.00000045"
    assert format_usd(Decimal("12.50")) == "12.5"
    assert format_usd(Decimal("1e-12")) == "0"  # below the precision costs are kept to


def test_price_book_remembers_lookups() -> None:
    calls: list[str] = []

    def model_map(model: str) -> dict[str, Any] | None:
        calls.append(model)
        return {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}

    book = PriceBook({}, model_map)
    assert book.price("m") == book.price("m")
    assert calls == ["m"]


def test_map_entry_without_token_prices_is_unpriced() -> None:
    assert Price.from_model_map({"max_tokens": 1000}) is None
    assert Price.from_model_map({"input_cost_per_token": 1e-6, "output_cost_per_token": -1}) is None
