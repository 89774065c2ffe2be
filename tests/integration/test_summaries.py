"""History summaries through the real server: a thin client's conversation outgrows its history
window; a job asks the summary model (its own fake upstream, scripted) for a summary of the
turns that aged out; later requests attach it instead of nothing, and it is extended with only
the turns that aged out since; a summary is made once and then read back; a failing or slow
summariser leaves plain truncation, recorded, and never fails the chat."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from policies.summaries import HEADER, JOB_KIND
from proxy.core.config import (
    Config,
    ContextSettings,
    PriceConfig,
    ServerConfig,
    SummarySettings,
    TenantConfig,
    UpstreamConfig,
)
from proxy.pipeline.summaries import MAX_MESSAGES
from tests.conftest import KEY
from tests.fakes.openai_upstream import FakeOpenAI, Reply, error_reply, model_said
from tests.fakes.server import ServerThread
from tests.polling import eventually

SUMMARY_MODEL = "summary-model"
PRICES = {SUMMARY_MODEL: PriceConfig(input_per_mtok=1, output_per_mtok=2)}
QUICK_JOBS = ServerConfig(jobs_poll_seconds=0.05, job_retry_seconds=0.05, job_max_attempts=2)
# Four messages of history go with each request, so from the fourth turn on turns age out.
CONTEXT = ContextSettings(max_history_messages=4, min_recent_messages=2, recall=False)


def said(content: str, *, delay: float = 0.0) -> Reply:
    """A chat completion from the summary model whose content is `content`."""
    return model_said(content, model=SUMMARY_MODEL, delay=delay)


@pytest.fixture
def summary_model() -> Iterator[tuple[FakeOpenAI, str]]:
    app = FakeOpenAI()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"
        app.release.set()


def config(main_url: str, summary_url: str, **summaries: Any) -> Config:
    settings = SummarySettings(mode="llm", model=SUMMARY_MODEL, upstream="summarizer", **summaries)
    return Config(
        server=QUICK_JOBS,
        upstreams={
            "main": UpstreamConfig(kind="openai", base_url=main_url, api_key="k"),
            "summarizer": UpstreamConfig(kind="openai", base_url=summary_url, api_key="k"),
        },
        pricing=PRICES,
        tenants={
            "t1": TenantConfig(api_keys=[KEY], upstream="main", context=CONTEXT, summaries=settings)
        },
    )


class Client:
    """A thin client: sends only its newest message, naming the conversation."""

    def __init__(self, base_url: str, upstream: FakeOpenAI, conversation: str = "long") -> None:
        self.upstream, self.conversation = upstream, conversation
        self.http = httpx.AsyncClient(
            base_url=base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=30
        )

    async def turn(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """One turn: the exchange's request id, and the messages the upstream got."""
        response = await self.http.post(
            "/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]},
            headers={
                "X-Memory-User-Id": "alice",
                "X-Memory-Conversation-Id": self.conversation,
            },
        )
        assert response.status_code == 200, response.text
        sent: list[dict[str, Any]] = self.upstream.chat_requests[-1]["messages"]
        return response.headers["x-request-id"], sent

    async def get(self, path: str, **params: Any) -> Any:
        response = await self.http.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()

    async def metrics(self) -> str:
        url = str(self.http.base_url).removesuffix("/").removesuffix("/v1") + "/metrics"
        return (await self.http.get(url)).text

    async def summary_record(self, request_id: str) -> Any:
        return (await self.get(f"/memory/exchanges/{request_id}"))["attached"].get("summary")

    async def job(self, through: int, *, until: tuple[str, ...] = ("done",)) -> dict[str, Any]:
        """The summary job that covers through `through`, once it has ended."""

        async def ended() -> dict[str, Any] | None:
            jobs = (await self.get("/memory/jobs", kind=JOB_KIND))["data"]
            found = [j for j in jobs if j["subject"].endswith(f":{through}")]
            return found[0] if found and found[0]["status"] in until else None

        return await eventually(ended)


def sections(sent: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in sent if m["role"] == "system" and HEADER in m["content"]]


@pytest.fixture
async def start(
    fake_upstream: tuple[FakeOpenAI, str],
    summary_model: tuple[FakeOpenAI, str],
    serve_proxy: Callable[[Config], str],
) -> AsyncIterator[Callable[..., Client]]:
    """A proxy with these summary settings, and a thin client of it."""
    opened: list[Client] = []

    def open_(**summaries: Any) -> Client:
        base_url = serve_proxy(config(fake_upstream[1], summary_model[1], **summaries))
        opened.append(Client(base_url, fake_upstream[0]))
        return opened[-1]

    yield open_
    for one in opened:
        await one.http.aclose()


@pytest.fixture
def client(start: Callable[..., Client]) -> Client:
    return start()


async def four_turns(client: Client) -> tuple[str, list[dict[str, Any]]]:
    """Turns 1-4: the fourth is the first with turns aged out (seq 1-4), and queues a job."""
    for n in (1, 2, 3):
        await client.turn(f"turn {n}")
    return await client.turn("turn 4")


TRUNCATED_AT_FIVE = ["turn 3", "fake reply to: turn 3", "turn 4", "fake reply to: turn 4", "turn 5"]


async def test_a_long_conversation_is_summarised_once_and_extended_with_only_new_turns(
    client: Client, summary_model: tuple[FakeOpenAI, str]
) -> None:
    model = summary_model[0]
    model.script = [said("SUMMARY ONE: the user counts."), said("SUMMARY TWO: still counting.")]
    for n in (1, 2, 3):
        request_id, sent = await client.turn(f"turn {n}")
        assert await client.summary_record(request_id) is None  # it all fits
    # Turn 4: turns 1 and 2 (seq 1-4) age out; there is no summary yet, so plain truncation,
    # and a job is queued for everything stored (through seq 6, the reply to turn 3).
    fourth, sent = await client.turn("turn 4")
    assert [m["content"] for m in sent] == [
        "turn 2",
        "fake reply to: turn 2",
        "turn 3",
        "fake reply to: turn 3",
        "turn 4",
    ]
    assert await client.summary_record(fourth) == {
        "used": False,
        "reason": "none yet",
        "cache": "miss",
        "queued_through": 6,
    }
    job = await client.job(6)
    assert job["result"]["through_seq"] == 6 and job["result"]["calls"] == 1
    (asked,) = model.chat_requests
    assert asked["model"] == SUMMARY_MODEL
    shown = asked["messages"][1]["content"]
    assert "(none yet" in shown
    assert "user:\n> turn 1\nassistant:\n> fake reply to: turn 1" in shown
    assert "assistant:\n> fake reply to: turn 3" in shown and "turn 4" not in shown
    # Its cost is the memory cost of the exchange that queued it: 1000 x $1/M + 100 x $2/M.
    record = await client.get(f"/memory/exchanges/{fourth}")
    (part,) = record["cost"]["parts"]
    assert (part["kind"], part["model"], part["cost_usd"]) == ("summary", SUMMARY_MODEL, 0.0012)

    # Turn 5: the summary reaches what aged out (through seq 4) and goes with the request,
    # read from the cache: no summariser call, no new job.
    fifth, sent = await client.turn("turn 5")
    (section,) = sections(sent)
    assert "> SUMMARY ONE: the user counts." in section
    assert [m["content"] for m in sent] == [
        "turn 3",
        "fake reply to: turn 3",
        "turn 4",
        "fake reply to: turn 4",
        section,
        "turn 5",
    ]
    summary = await client.summary_record(fifth)
    assert summary["used"] is True and summary["through_seq"] == 6 and summary["cache"] == "hit"
    assert "queued_through" not in summary
    assert len(model.chat_requests) == 1

    # Turn 6: still reached (aged out through seq 6), but its lead is spent: extended.
    sixth, sent = await client.turn("turn 6")
    assert "> SUMMARY ONE" in sections(sent)[0]
    summary = await client.summary_record(sixth)
    assert (summary["used"], summary["queued_through"]) == (True, 10)
    await client.job(10)
    second = model.chat_requests[1]["messages"][1]["content"]
    # The previous summary and only the turns after it (seq 7-10).
    assert "Summary so far:\n> SUMMARY ONE: the user counts." in second
    assert "user:\n> turn 4\n" in second and "assistant:\n> fake reply to: turn 5" in second
    assert "turn 3" not in second and "turn 6" not in second

    seventh, sent = await client.turn("turn 7")
    assert "> SUMMARY TWO: still counting." in sections(sent)[0]
    assert (await client.summary_record(seventh))["through_seq"] == 10

    metrics = await client.metrics()
    assert 'memproxy_summary_cache_total{kind="history",outcome="hit",tenant="t1"} 3.0' in metrics
    assert 'memproxy_summary_cache_total{kind="history",outcome="miss",tenant="t1"} 1.0' in metrics


async def test_a_failing_summariser_leaves_plain_truncation_recorded_and_the_job_dead_lettered(
    client: Client, summary_model: tuple[FakeOpenAI, str]
) -> None:
    model = summary_model[0]
    model.script = [error_reply(500, "summariser down")] * 4  # (turn 5 queues a job too)
    fourth, _ = await four_turns(client)
    job = await client.job(6, until=("dead",))
    assert job["attempts"] == 2 and "500" in job["last_error"]
    # Tried, retried, then dead-lettered; the failed calls cost nothing.
    assert len(model.chat_requests) == 2
    assert (await client.get(f"/memory/exchanges/{fourth}"))["cost"]["parts"] == []
    # The chat goes on with plain truncation, and the record says there is no summary.
    fifth, sent = await client.turn("turn 5")
    assert [m["content"] for m in sent] == TRUNCATED_AT_FIVE
    summary = await client.summary_record(fifth)
    assert (summary["used"], summary["reason"]) == (False, "none yet")


async def test_a_summariser_that_never_answers_times_out_and_never_holds_up_the_chat(
    start: Callable[..., Client], summary_model: tuple[FakeOpenAI, str]
) -> None:
    model = summary_model[0]
    client = start(timeout_seconds=0.2)
    model.script = [Reply(hold=True)] * 4  # (turn 5 queues a job too)
    await four_turns(client)
    # The summary call is waiting; the next turn is answered meanwhile, truncated.
    _, sent = await client.turn("turn 5")
    assert [m["content"] for m in sent] == TRUNCATED_AT_FIVE
    job = await client.job(6, until=("dead",))
    assert "did not answer within 0.2 s" in job["last_error"]


async def test_a_summary_claims_only_the_turns_its_model_read_and_the_next_job_reads_on(
    client: Client, summary_model: tuple[FakeOpenAI, str]
) -> None:
    """A job reads at most MAX_MESSAGES stored messages: when more aged out, its summary
    covers as far as it read, not as far as it was queued for, and the rest is read next."""
    model = summary_model[0]
    model.script = [said(f"SUMMARY PART {n}") for n in range(1, 9)]
    imported = [
        {"role": "user" if n % 2 else "assistant", "content": f"m{n}"}
        for n in range(1, MAX_MESSAGES + 201)
    ]
    created = await client.http.post(
        "/memory/conversations", json={"id": "long", "user": "alice", "messages": imported}
    )
    assert created.status_code == 201, created.text
    first, _ = await client.turn("next")
    queued = (await client.summary_record(first))["queued_through"]
    assert queued > MAX_MESSAGES + 100
    job = await client.job(queued)

    def read() -> str:
        return "\n".join(r["messages"][1]["content"] for r in model.chat_requests)

    covered = job["result"]["through_seq"]
    assert covered == MAX_MESSAGES and f"assistant:\n> m{MAX_MESSAGES}\n" in read()
    assert f"m{MAX_MESSAGES + 1}" not in read()
    # The next turn's job reads on from there.
    second, _ = await client.turn("and next")
    later = (await client.summary_record(second))["queued_through"]
    assert (await client.job(later))["result"]["through_seq"] == later
    assert f"user:\n> m{MAX_MESSAGES + 1}\n" in read() and f"m{MAX_MESSAGES + 200}" in read()
