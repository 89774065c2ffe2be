"""Per-tenant limits and budgets through the real server and the official SDK: a refused request
is a 429 in OpenAI's shape with `retry-after` and never reaches the upstream; and two
`memproxy serve` processes on one PostgreSQL database enforce one shared limit, overshooting it
by no more than docs/concepts/costs-and-limits.md allows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest

from proxy.core.config import Config, Limits, PriceConfig, UpstreamConfig
from storage import migrate
from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread
from tests.postgres import fresh_database
from tests.processes import Replica, spawn, stop, wait_ready

HELLO: list[Any] = [{"role": "user", "content": "hello"}]
ServeProxy = Callable[[Config], str]


def sdk(base_url: str, key: str = KEY) -> openai.AsyncOpenAI:
    # The SDK retries a 429 by itself; these tests want to see each one.
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


def upstream(url: str) -> UpstreamConfig:
    return UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")


async def wait_for_a_fresh_minute(needed: float = 20.0) -> None:
    """rpm counts calendar minutes: start where the whole test fits in one."""
    left = 60.0 - (time.time() % 60.0)
    if left < needed:
        await asyncio.sleep(left + 0.05)


def assert_rate_limited(exc: openai.RateLimitError, type_: str, code: str) -> int:
    """OpenAI's 429: status, error shape and a whole-second `retry-after`; returns the latter."""
    assert exc.status_code == 429
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        type_,
        code,
        None,
    )
    retry_after = int(exc.response.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def message(exc: openai.APIStatusError) -> str:
    text: str = exc.response.json()["error"]["message"]
    return text


async def test_over_rpm_is_a_429_with_retry_after_and_the_upstream_is_never_called(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, url = fake_upstream
    base = serve_proxy(make_config(upstream(url), limits=Limits(rpm=2)))
    await wait_for_a_fresh_minute()
    async with sdk(base) as client:
        for _ in range(2):
            await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
        assert len(fake.chat_requests) == 2
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
        retry_after = assert_rate_limited(caught.value, "requests", "rate_limit_exceeded")
        assert retry_after <= 60  # the rest of this minute
        assert message(caught.value).startswith(
            "Rate limit reached for requests per minute (RPM): Limit 2, Used 2."
        )
        with pytest.raises(openai.RateLimitError):  # a stream is refused the same way
            await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, stream=True)
    assert len(fake.chat_requests) == 2  # neither refused request reached the model
    async with sdk(base, OTHER_TENANT_KEY) as other:  # another tenant's limits are its own
        await other.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    assert len(fake.chat_requests) == 3


async def test_passthrough_endpoints_count_toward_rpm(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, url = fake_upstream
    base = serve_proxy(make_config(upstream(url), limits=Limits(rpm=1)))
    await wait_for_a_fresh_minute()
    async with sdk(base) as client:
        await client.embeddings.create(model="text-embedding-3-small", input="hi")
        with pytest.raises(openai.RateLimitError) as caught:
            await client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert_rate_limited(caught.value, "requests", "rate_limit_exceeded")
    assert len(fake.requests) == 1


async def test_over_tpm_is_a_429_once_finished_calls_used_the_tokens(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, url = fake_upstream
    base = serve_proxy(make_config(upstream(url), limits=Limits(tpm=10)))
    await wait_for_a_fresh_minute()
    async with sdk(base) as client:
        first = await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
        assert first.usage is not None and first.usage.total_tokens >= 5
        used = first.usage.total_tokens
        if used < 10:
            second = await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
            assert second.usage is not None
            used += second.usage.total_tokens
        calls = len(fake.chat_requests)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    assert_rate_limited(caught.value, "tokens", "rate_limit_exceeded")
    assert f"Limit 10, Used {used}." in message(caught.value)
    assert len(fake.chat_requests) == calls


async def test_a_tenant_over_budget_gets_429_and_the_upstream_is_never_called(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, url = fake_upstream
    # "hello" costs 4 prompt + 4 completion tokens at the fake: $4e-6 + $8e-6 = $1.2e-5.
    config = make_config(upstream(url), limits=Limits(budget_usd_day=0.00001)).model_copy(
        update={"pricing": {"priced-model": PriceConfig(input_per_mtok=1.0, output_per_mtok=2.0)}}
    )
    base = serve_proxy(config)
    async with sdk(base) as client:
        for _ in range(3):  # a model with no price does not count toward a budget
            await client.chat.completions.create(model="unpriced-model-x", messages=HELLO)
        raw = await client.chat.completions.with_raw_response.create(
            model="priced-model", messages=HELLO
        )
        assert raw.headers["x-cost-usd"] != "unknown"
        assert len(fake.chat_requests) == 4
        for model in ("priced-model", "unpriced-model-x"):
            with pytest.raises(openai.RateLimitError) as caught:
                await client.chat.completions.create(model=model, messages=HELLO)
            assert_rate_limited(caught.value, "insufficient_quota", "insufficient_quota")
            assert "daily budget" in message(caught.value)
    assert len(fake.chat_requests) == 4


async def test_limits_endpoint_shows_the_limits_and_their_use(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    _, url = fake_upstream
    base = serve_proxy(make_config(upstream(url), limits=Limits(rpm=5, budget_usd_month=2.5)))
    await wait_for_a_fresh_minute()
    async with sdk(base) as client:
        await client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    async with httpx.AsyncClient(base_url=base) as http:
        got = await http.get("/memory/limits", headers={"authorization": f"Bearer {KEY}"})
        chat_only = await http.get(
            "/memory/limits", headers={"authorization": f"Bearer {CHAT_ONLY_KEY}"}
        )
        other = await http.get(
            "/memory/limits", headers={"authorization": f"Bearer {OTHER_TENANT_KEY}"}
        )
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["object"] == "memory.limits"
    assert body["limits"] == {
        "rpm": 5,
        "tpm": None,
        "budget_usd_day": None,
        "budget_usd_month": 2.5,
    }
    now = datetime.now(UTC)
    rpm = body["usage"]["rpm"]
    assert (rpm["limit"], rpm["used"], rpm["remaining"]) == (5, 1, 4)
    assert rpm["window"] == f"minute:{now:%Y-%m-%dT%H:%M}"
    assert rpm["resets_at"] > now.timestamp()
    month = body["usage"]["budget_usd_month"]
    assert (month["limit"], month["window"]) == (2.5, f"month:{now:%Y-%m}")
    assert set(body["usage"]) == {"rpm", "budget_usd_month"}
    assert body["sync_interval_seconds"] == 1.0
    assert chat_only.status_code == 403
    assert other.status_code == 200 and other.json()["usage"] == {}


# -- two replicas on one PostgreSQL database -----------------------------------------------------

SYNC_SECONDS = 0.2
SHARED_RPM = 10


@dataclass
class Replicas:
    a: Replica
    b: Replica
    fake: FakeOpenAI


@pytest.fixture(scope="module")
def replicas(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    """Two `memproxy serve` processes on one PostgreSQL database, sharing counts every 0.2 s,
    in front of one fake upstream. Each test uses a tenant of its own."""
    workdir = tmp_path_factory.mktemp("replicas")
    fake = FakeOpenAI()
    with (
        ServerThread(fake) as upstream_server,
        fresh_database("postgresql", request, workdir) as url,
    ):
        # Migrated once before either starts, so the two do not race to create the tables.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(migrate.upgrade, url).result()
        tenants = "".join(
            f"  {name}: {{api_keys: [{name}-key], limits: {{rpm: {SHARED_RPM}}}}}\n"
            for name in ("handover", "burst", "flood")
        )
        config = workdir / "config.yaml"
        config.write_text(
            f"server: {{limits_sync_seconds: {SYNC_SECONDS}}}\n"
            f'database: {{url: "{url}"}}\n'
            "upstreams:\n"
            f"  fake: {{kind: openai, base_url: {upstream_server.url}/v1, api_key: k}}\n"
            "defaults: {upstream: fake}\n"
            f"tenants:\n{tenants}"
        )
        started = [spawn("a", config, workdir), spawn("b", config, workdir)]
        try:
            for replica in started:
                wait_ready(replica)
            yield Replicas(started[0], started[1], fake)
        finally:
            for replica in started:
                stop(replica)


@pytest.fixture
async def clients(
    replicas: Replicas,
) -> AsyncIterator[Callable[[Replica, str], openai.AsyncOpenAI]]:
    made: list[openai.AsyncOpenAI] = []

    def client(replica: Replica, tenant: str) -> openai.AsyncOpenAI:
        made.append(sdk(replica.url, f"{tenant}-key"))
        return made[-1]

    yield client
    for c in made:
        await c.close()


async def ask(client: openai.AsyncOpenAI, tenant: str) -> bool:
    """One chat completion; True if admitted, False if refused with 429."""
    try:
        await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": f"{tenant} call"}]
        )
    except openai.RateLimitError as exc:
        assert_rate_limited(exc, "requests", "rate_limit_exceeded")
        return False
    return True


def reached_upstream(fake: FakeOpenAI, tenant: str) -> int:
    return sum(1 for r in fake.chat_requests if r["messages"][-1]["content"] == f"{tenant} call")


async def rpm_used(replica: Replica, tenant: str) -> int:
    async with httpx.AsyncClient() as http:
        got = await http.get(
            replica.url + "/memory/limits", headers={"authorization": f"Bearer {tenant}-key"}
        )
    assert got.status_code == 200, got.text
    used: int = got.json()["usage"]["rpm"]["used"]
    return used


async def until_both_see(replicas: Replicas, tenant: str, count: int) -> None:
    """Poll each replica's own view until it shows `count` requests: both have reconciled."""
    for replica in (replicas.a, replicas.b):
        for _ in range(500):
            if await rpm_used(replica, tenant) == count:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail(f"replica {replica.name} never showed {count}:\n{replica.tail()}")


async def test_a_limit_used_up_on_one_replica_is_refused_by_the_other(
    replicas: Replicas, clients: Callable[[Replica, str], openai.AsyncOpenAI]
) -> None:
    tenant = "handover"
    await wait_for_a_fresh_minute()
    a, b = clients(replicas.a, tenant), clients(replicas.b, tenant)
    assert [await ask(a, tenant) for _ in range(SHARED_RPM)] == [True] * SHARED_RPM
    assert not await ask(a, tenant)  # A counts its own requests exactly
    await until_both_see(replicas, tenant, SHARED_RPM)
    assert not await ask(b, tenant)
    assert reached_upstream(replicas.fake, tenant) == SHARED_RPM


async def test_a_burst_alternating_between_replicas_stays_within_the_documented_overshoot(
    replicas: Replicas, clients: Callable[[Replica, str], openai.AsyncOpenAI]
) -> None:
    """In rounds: each replica gets ROUND requests (A, B, A, B...), then both reconcile. A
    replica admits only what it does not know to be over the limit, and at a round's start
    both know every earlier request; so the overshoot is at most what the other replica
    admitted since the last reconcile: at most ROUND (N - 1 = 1 other replica)."""
    tenant, round_size = "burst", 3
    await wait_for_a_fresh_minute()
    a, b = clients(replicas.a, tenant), clients(replicas.b, tenant)
    admitted = 0
    while True:
        results = []
        for _ in range(round_size):
            results += [await ask(a, tenant), await ask(b, tenant)]
        admitted += sum(results)
        await until_both_see(replicas, tenant, admitted)
        if not any(results):
            break
    assert SHARED_RPM <= admitted <= SHARED_RPM + round_size
    assert reached_upstream(replicas.fake, tenant) == admitted


async def test_a_concurrent_flood_on_both_replicas_is_capped_at_one_limit_per_replica(
    replicas: Replicas, clients: Callable[[Replica, str], openai.AsyncOpenAI]
) -> None:
    """Without time to reconcile, each replica still counts its own requests exactly: at most
    N x limit in one window, whatever the timing (the worst case docs/concepts/costs-and-limits.md states)."""
    tenant = "flood"
    await wait_for_a_fresh_minute()
    a, b = clients(replicas.a, tenant), clients(replicas.b, tenant)
    results = await asyncio.gather(*(ask(c, tenant) for _ in range(2 * SHARED_RPM) for c in (a, b)))
    admitted = sum(results)
    assert SHARED_RPM <= admitted <= 2 * SHARED_RPM
    assert reached_upstream(replicas.fake, tenant) == admitted
    await until_both_see(replicas, tenant, admitted)  # and no count was lost
