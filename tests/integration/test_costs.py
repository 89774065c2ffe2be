"""Usage and cost through the real server, with the official SDK and a fake upstream that
reports usage: the headers, the exchange records, the usage report and the metrics.

Expected costs are written out by hand from the literal prices in the test's config, never
computed with the code under test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.config import Config, Limits, PriceConfig, ServerConfig, UpstreamConfig
from tests.conftest import KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply, error_reply, sse

ServeProxy = Callable[[Config], str]
PRICED = "priced-model"
# $0.50 per million input tokens, $0.25 cached, $1.50 output.
PRICES = {PRICED: PriceConfig(input_per_mtok=0.5, output_per_mtok=1.5, cached_input_per_mtok=0.25)}
HELLO: list[Any] = [{"role": "user", "content": "hello"}]


def priced_config(upstream_url: str, **server: Any) -> Config:
    config = make_config(UpstreamConfig(kind="openai", base_url=upstream_url, api_key="k"))
    return config.model_copy(update={"pricing": PRICES, "server": ServerConfig(**server)})


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


@pytest.fixture
def base_url(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy) -> str:
    return serve_proxy(priced_config(fake_upstream[1]))


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture
async def manage(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as c:
        yield c


def completion(usage: dict[str, Any] | None, model: str = PRICED) -> Reply:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi there", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return Reply(body=body)


def stream(usage: dict[str, Any] | None, words: tuple[str, ...] = ("hi", " there")) -> Reply:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": PRICED}

    def chunk(choices: list[Any], **extra: Any) -> bytes:
        return sse({**head, "choices": choices, **extra})

    chunks = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}])]
    chunks += [chunk([{"index": 0, "delta": {"content": w}}]) for w in words]
    chunks.append(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    if usage is not None:
        chunks.append(chunk([], usage=usage))
    chunks.append(b"data: [DONE]\n\n")
    return Reply(chunks=chunks)


async def exchange(manage: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    response = await manage.get(f"/memory/exchanges/{request_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


# --- headers ---------------------------------------------------------------------------------


async def test_headers_carry_usage_and_the_cost_at_the_configured_price(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    fake.script.append(completion({"prompt_tokens": 1200, "completion_tokens": 345}))
    raw = await client.chat.completions.with_raw_response.create(model=PRICED, messages=HELLO)
    # 1200 x 0.50/M + 345 x 1.50/M = 0.0006 + 0.0005175
    assert raw.headers["x-usage-prompt-tokens"] == "1200"
    assert raw.headers["x-usage-completion-tokens"] == "345"
    assert raw.headers["x-cost-upstream-usd"] == "0.0011175"
    assert raw.headers["x-cost-memory-usd"] == "0"
    assert raw.headers["x-cost-usd"] == "0.0011175"
    assert raw.headers["x-cost-final"] == "true"
    assert "x-usage-estimated" not in raw.headers
    assert raw.parse().usage is not None

    record = await exchange(manage, raw.headers["x-request-id"])
    assert record["final"] is True
    assert record["usage"]["prompt_tokens"] == 1200
    assert record["usage"]["completion_tokens"] == 345
    assert record["usage"]["estimated"] is False
    assert record["cost"] == {
        "priced": True,
        "usd": 0.0011175,
        "upstream_usd": 0.0011175,
        "memory_usd": 0.0,
        "parts": [],
    }
    timings = record["timings"]
    assert timings["latency_ms"] >= timings["upstream_ms"] > 0
    assert timings["overhead_ms"] > 0


async def test_cached_tokens_are_billed_at_the_cached_price(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    usage = {
        "prompt_tokens": 1200,
        "completion_tokens": 345,
        "prompt_tokens_details": {"cached_tokens": 1000},
    }
    fake.script.append(completion(usage))
    raw = await client.chat.completions.with_raw_response.create(model=PRICED, messages=HELLO)
    # 200 x 0.50/M + 1000 x 0.25/M + 345 x 1.50/M = 0.0001 + 0.00025 + 0.0005175
    assert raw.headers["x-cost-usd"] == "0.0008675"
    record = await exchange(manage, raw.headers["x-request-id"])
    assert record["usage"]["cached_tokens"] == 1000
    assert record["usage"]["reported"] == usage


async def test_a_model_without_a_price_costs_unknown_never_zero(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    fake.script.append(completion({"prompt_tokens": 10, "completion_tokens": 5}, "no-such-model"))
    raw = await client.chat.completions.with_raw_response.create(
        model="no-such-model-anywhere", messages=HELLO
    )
    assert raw.headers["x-cost-usd"] == "unknown"
    assert raw.headers["x-cost-upstream-usd"] == "unknown"
    assert raw.headers["x-usage-prompt-tokens"] == "10"
    record = await exchange(manage, raw.headers["x-request-id"])
    assert record["cost"]["priced"] is False
    assert record["cost"]["usd"] is None


async def test_a_model_from_litellms_map_is_priced_without_config(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    fake.script.append(completion({"prompt_tokens": 1000, "completion_tokens": 1000}))
    raw = await client.chat.completions.with_raw_response.create(model="gpt-4o", messages=HELLO)
    # gpt-4o in the bundled map: $2.50 / $10 per million: 0.0025 + 0.01.
    assert raw.headers["x-cost-usd"] == "0.0125"


async def test_usage_missing_from_the_upstream_is_counted_and_marked_estimated(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    fake.script.append(completion(None))
    raw = await client.chat.completions.with_raw_response.create(model=PRICED, messages=HELLO)
    assert raw.headers["x-usage-estimated"] == "true"
    # "hello" is one token, plus 3 for the message and 3 for the reply's priming (the chat
    # format's framing); "hi there" is two tokens.
    assert raw.headers["x-usage-prompt-tokens"] == "7"
    assert raw.headers["x-usage-completion-tokens"] == "2"
    # 7 x 0.50/M + 2 x 1.50/M
    assert raw.headers["x-cost-usd"] == "0.0000065"
    record = await exchange(manage, raw.headers["x-request-id"])
    assert record["usage"]["estimated"] is True


async def test_an_unreachable_upstream_and_a_refused_call_say_they_cost_nothing(
    serve_proxy: ServeProxy,
) -> None:
    config = priced_config("http://127.0.0.1:9/v1")  # nothing listens on the discard port
    config = config.model_copy(
        update={
            "tenants": {
                **config.tenants,
                "t1": config.tenants["t1"].model_copy(update={"limits": Limits(rpm=1)}),
            }
        }
    )
    base_url = serve_proxy(config)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as unreachable:
            await client.chat.completions.create(model=PRICED, messages=HELLO)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model=PRICED, messages=HELLO)
    for caught, status in ((unreachable, 502), (refused, 429)):
        assert caught.value.status_code == status
        headers = caught.value.response.headers
        assert (headers["x-cost-usd"], headers["x-usage-prompt-tokens"]) == ("0", "0")


async def test_an_upstream_error_is_billed_nothing(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    fake.script.append(error_reply(400, "bad thing"))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=PRICED, messages=HELLO)
    headers = caught.value.response.headers
    assert headers["x-cost-usd"] == "0"
    record = await exchange(manage, headers["x-request-id"])
    assert (record["status"], record["cost"]["usd"]) == ("error", 0.0)


@pytest.mark.parametrize("mode", ["full", "read", "off"])
async def test_cost_headers_in_every_memory_mode(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient, mode: str
) -> None:
    fake.script.append(completion({"prompt_tokens": 2000, "completion_tokens": 0}))
    raw = await client.chat.completions.with_raw_response.create(
        model=PRICED, messages=HELLO, extra_headers={"X-Memory-Mode": mode}
    )
    assert raw.headers["x-cost-usd"] == "0.001"
    # Mode off records the exchange a moment later, in a batch; the report waits for it.
    record = await exchange(manage, raw.headers["x-request-id"])
    assert (record["mode"], record["cost"]["usd"]) == (mode, 0.001)


# --- streams ---------------------------------------------------------------------------------


async def test_a_stream_carries_the_prompt_side_and_its_record_the_final_usage(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    usage = {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}
    fake.script.append(stream(usage))
    async with client.chat.completions.with_streaming_response.create(
        model=PRICED, messages=HELLO, stream=True
    ) as response:
        headers = response.headers
        chunks = [chunk async for chunk in await response.parse()]
    assert headers["x-cost-final"] == "false"
    assert headers["x-usage-completion-tokens"] == "0"
    # Counted by the proxy: "hello" (1 token) and the chat format's framing (6); 7 x 0.50/M.
    assert headers["x-usage-prompt-tokens"] == "7"
    assert headers["x-cost-usd"] == "0.0000035"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi there"

    record = await exchange(manage, headers["x-request-id"])
    assert record["final"] is True
    assert record["usage"]["prompt_tokens"] == 1000
    assert record["usage"]["completion_tokens"] == 200
    assert record["usage"]["reported"] == usage
    # 1000 x 0.50/M + 200 x 1.50/M
    assert record["cost"]["usd"] == 0.0008
    assert record["timings"]["ttft_ms"] > 0


async def test_the_usage_chunk_reaches_only_clients_that_asked_for_it(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    plain = await client.chat.completions.create(model=PRICED, messages=HELLO, stream=True)
    plain_chunks = [c async for c in plain]
    asked = await client.chat.completions.create(
        model=PRICED, messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    asked_chunks = [c async for c in asked]

    # The proxy asked the upstream for usage both times, keeping the client's other options.
    assert [r["stream_options"] for r in fake.chat_requests] == [{"include_usage": True}] * 2
    assert all(c.usage is None for c in plain_chunks)
    assert all(c.choices for c in plain_chunks)
    usage_chunks = [c for c in asked_chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert asked_chunks[-1] is usage_chunks[0]
    # Both records have the upstream's usage, not an estimate.
    for request in (plain, asked):
        request_id = request.response.headers["x-request-id"]
        record = await exchange(manage, request_id)
        assert record["usage"]["estimated"] is False
        assert record["usage"]["completion_tokens"] == usage_chunks[0].usage.completion_tokens


async def test_the_usage_chunk_is_dropped_wherever_network_reads_split_it(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    scripted = stream(usage)
    assert scripted.chunks is not None
    # One byte stream cut into awkward pieces: events split mid-line and several per read.
    whole = b"".join(scripted.chunks)
    scripted.chunks = [whole[i : i + 37] for i in range(0, len(whole), 37)]
    fake.script.append(scripted)
    response = await client.chat.completions.create(model=PRICED, messages=HELLO, stream=True)
    chunks = [c async for c in response]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hi there"
    assert all(c.usage is None for c in chunks)
    record = await exchange(manage, response.response.headers["x-request-id"])
    assert record["usage"]["reported"] == usage


async def test_a_stream_without_usage_is_estimated(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    fake.script.append(stream(None))
    response = await client.chat.completions.create(model=PRICED, messages=HELLO, stream=True)
    assert [c async for c in response]
    record = await exchange(manage, response.response.headers["x-request-id"])
    assert record["usage"]["estimated"] is True
    assert record["usage"]["completion_tokens"] == 2  # "hi there"


async def test_an_upstream_that_rejects_stream_options_is_not_sent_them(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    config = make_config(
        UpstreamConfig(kind="openai", base_url=upstream_url, api_key="k", stream_usage=False)
    )
    base_url = serve_proxy(config)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0) as client:
        response = await client.chat.completions.create(model=PRICED, messages=HELLO, stream=True)
        assert [c async for c in response]
    assert "stream_options" not in fake.chat_requests[0]


# --- the usage report ------------------------------------------------------------------------


async def test_usage_report_totals_equal_the_sum_of_the_exchanges(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, manage: httpx.AsyncClient
) -> None:
    calls = [
        ("alice", PRICED, 1000, 100),  # 0.0005 + 0.00015
        ("alice", PRICED, 3000, 0),  # 0.0015
        ("bob", PRICED, 0, 1000),  # 0.0015
        ("bob", "unpriced-thing", 50, 50),  # unknown
    ]
    ids = []
    for user, model, prompt, completion_tokens in calls:
        fake.script.append(
            completion({"prompt_tokens": prompt, "completion_tokens": completion_tokens}, model)
        )
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=HELLO, extra_headers={"X-Memory-User-Id": user}
        )
        ids.append(raw.headers["x-request-id"])
    records = [await exchange(manage, i) for i in ids]

    report = (await manage.get("/memory/usage")).json()
    total = report["total"]
    assert total["requests"] == 4
    assert total["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in records) == 4050
    assert total["completion_tokens"] == 1150
    assert total["cost_usd"] == pytest.approx(sum(r["cost"]["usd"] or 0 for r in records))
    assert total["cost_usd"] == pytest.approx(0.00365)
    assert total["unpriced_requests"] == 1

    by_user = (await manage.get("/memory/usage", params={"group_by": "user"})).json()
    rows = {row["user"]: row for row in by_user["data"]}
    assert rows["alice"]["cost_usd"] == pytest.approx(0.00215)
    assert rows["bob"]["cost_usd"] == pytest.approx(0.0015)
    assert rows["bob"]["unpriced_requests"] == 1
    assert by_user["total"] == total

    by_model = (await manage.get("/memory/usage", params={"group_by": "model"})).json()
    assert {row["model"]: row["requests"] for row in by_model["data"]} == {
        PRICED: 3,
        "unpriced-thing": 1,
    }
    by_day = (await manage.get("/memory/usage", params={"group_by": "day"})).json()
    assert len(by_day["data"]) == 1 and by_day["data"][0]["requests"] == 4
    assert by_day["data"][0]["day"] == report["to"][:10]
    by_intent = (await manage.get("/memory/usage", params={"group_by": "intent"})).json()
    assert by_intent["data"][0]["requests"] == 4

    only_bob = (await manage.get("/memory/usage", params={"user": "bob"})).json()
    assert only_bob["total"]["requests"] == 2
    before = (await manage.get("/memory/usage", params={"to": "2020-01-01"})).json()
    assert before["total"]["requests"] == 0


async def test_usage_report_and_exchanges_are_tenant_scoped(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, base_url: str
) -> None:
    raw = await client.chat.completions.with_raw_response.create(model=PRICED, messages=HELLO)
    headers = {"authorization": f"Bearer {OTHER_TENANT_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as other:
        response = await other.get(f"/memory/exchanges/{raw.headers['x-request-id']}")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "exchange_not_found"
        report = (await other.get("/memory/usage")).json()
        assert report["total"]["requests"] == 0


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"group_by": "colour"}, "group_by"),
        ({"from": "yesterday"}, "from"),
        ({"from": "2026-02-01", "to": "2026-01-01"}, "from"),
        ({"from": "\u00b2"}, "from"),  # a digit to str.isdigit(), not to int()
        ({"to": "\u0661\u0662"}, "to"),
        ({"to": "0001-01-15"}, "to"),  # the default 30 days before it are before year 1
        ({"user": ""}, "user"),
        ({"model": "gpt-4o-mini"}, "model"),  # a filter it does not have is not ignored
    ],
)
async def test_usage_report_rejects_bad_queries(
    manage: httpx.AsyncClient, params: dict[str, str], param: str
) -> None:
    response = await manage.get("/memory/usage", params=params)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_usage_report_reads_an_iso_basic_date_as_a_date(manage: httpx.AsyncClient) -> None:
    report = await manage.get("/memory/usage", params={"from": "20261101", "to": "1795000000"})
    assert report.status_code == 200, report.text
    # Eight digits are ISO 8601's basic date, not unix seconds in 1970; more are seconds.
    assert (report.json()["from"], report.json()["to"]) == (
        "2026-11-01T00:00:00+00:00",
        "2026-11-18T11:06:40+00:00",
    )


async def test_unknown_exchange_is_404(manage: httpx.AsyncClient) -> None:
    for request_id in ("req_nope", "x" * 500, "'; DROP TABLE exchanges; --"):
        response = await manage.get(f"/memory/exchanges/{request_id}")
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "invalid_request_error"


# --- metrics and browsers --------------------------------------------------------------------


async def test_metrics_count_requests_tokens_and_cost(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, base_url: str
) -> None:
    fake.script.append(completion({"prompt_tokens": 1000, "completion_tokens": 100}))
    await client.chat.completions.create(model=PRICED, messages=HELLO)
    fake.script.append(error_reply(429, "slow down"))
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model=PRICED, messages=HELLO)
    response = await client.chat.completions.create(model=PRICED, messages=HELLO, stream=True)
    assert [c async for c in response]

    async with httpx.AsyncClient() as plain:
        text = (await plain.get(base_url.removesuffix("/v1") + "/metrics")).text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    chat = {"tenant": "t1", "model": PRICED}
    assert value("memproxy_chat_requests_total", **chat, status="200") == 2
    assert value("memproxy_chat_requests_total", **chat, status="429") == 1
    # The fake's stream reports 4 prompt tokens ("hello" + 3) and 4 completion tokens
    # ("fake reply to: hello"); the 429 reply used none.
    assert value("memproxy_tokens_total", **chat, kind="prompt") == 1004
    assert value("memproxy_tokens_total", **chat, kind="completion") == 104
    # 1000 x 0.50/M + 100 x 1.50/M, and 4 x 0.50/M + 4 x 1.50/M
    assert value("memproxy_cost_usd_total", **chat, part="upstream") == pytest.approx(0.000658)
    assert value("memproxy_chat_time_to_first_token_seconds_count", **chat) == 1
    assert value("memproxy_chat_latency_seconds_count", **chat) == 3
    assert value("memproxy_overhead_seconds_count", tenant="t1") == 3
    assert value("memproxy_chat_in_flight") == 0


async def test_cost_headers_are_exposed_to_browsers(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    config = priced_config(fake_upstream[1], cors_origins=["https://app.example"])
    base_url = serve_proxy(config)
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.post(
            "/chat/completions",
            json={"model": PRICED, "messages": HELLO},
            headers={"authorization": f"Bearer {KEY}", "origin": "https://app.example"},
        )
    exposed = response.headers["access-control-expose-headers"].lower()
    for name in ("x-cost-usd", "x-cost-final", "x-usage-prompt-tokens", "x-memory-status"):
        assert name in exposed
    assert json.loads(response.text)["object"] == "chat.completion"


async def test_metrics_can_ask_for_a_key_of_their_own(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base_url = serve_proxy(priced_config(fake_upstream[1], metrics_key="scrape-me"))
    metrics_url = base_url.removesuffix("/v1") + "/metrics"
    async with httpx.AsyncClient() as http:
        for headers in ({}, {"authorization": f"Bearer {KEY}"}):
            refused = await http.get(metrics_url, headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        allowed = await http.get(metrics_url, headers={"authorization": "Bearer scrape-me"})
    assert allowed.status_code == 200
    assert "memproxy_chat_in_flight" in allowed.text
