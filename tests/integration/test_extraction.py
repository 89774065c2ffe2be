"""Memory extraction through the real server: a chat completion of a named user queues a job
with its stored reply; the job asks the memory model (its own fake upstream, scripted) and
applies exactly the decisions it may; a reply it cannot use is recorded and dead-lettered; a
job cut off by a crash runs again after a restart; erasing the user while the model thinks
leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from proxy.core.config import (
    Config,
    MemorySettings,
    PriceConfig,
    ServerConfig,
    TenantConfig,
    UpstreamConfig,
)
from tests.conftest import KEY, OTHER_TENANT_KEY
from tests.fakes.openai_upstream import FakeOpenAI, Reply, model_said
from tests.fakes.server import ServerThread
from tests.inspector import form, signed_in
from tests.polling import eventually
from tests.processes import kill, spawn, stop, wait_ready

MEMORY_MODEL = "memory-model"
# $1 per million input tokens, $2 per million output tokens for the memory model.
PRICES = {MEMORY_MODEL: PriceConfig(input_per_mtok=1, output_per_mtok=2)}
QUICK_JOBS = ServerConfig(jobs_poll_seconds=0.05, job_retry_seconds=0.05, job_max_attempts=2)
ALICE = {"X-Memory-User-Id": "alice"}


@pytest.fixture
def memory_model() -> Iterator[tuple[FakeOpenAI, str]]:
    """The memory model's own fake OpenAI API."""
    app = FakeOpenAI()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"
        app.release.set()  # answer what is still held, so the server can stop


def config(main_url: str, memory_url: str) -> Config:
    return Config(
        server=QUICK_JOBS,
        upstreams={
            "main": UpstreamConfig(kind="openai", base_url=main_url, api_key="k"),
            "memory": UpstreamConfig(kind="openai", base_url=memory_url, api_key="k"),
        },
        pricing=PRICES,
        tenants={
            "t1": TenantConfig(
                api_keys=[KEY],
                upstream="main",
                # (Embeddings off: these pin extraction, and its jobs alone; embedding what
                # extraction writes is tests/integration/test_hybrid_memories_and_passages.py's.)
                memory=MemorySettings(
                    extract="llm", model=MEMORY_MODEL, upstream="memory", embeddings="off"
                ),
            ),
            "t2": TenantConfig(
                api_keys=[OTHER_TENANT_KEY],
                upstream="main",
                memory=MemorySettings(embeddings="off"),
            ),
        },
    )


def decisions(*items: Any, usage: bool = True) -> Reply:
    return said(json.dumps({"memories": list(items)}), usage=usage)


def said(content: str, *, usage: bool = True) -> Reply:
    """A chat completion from the memory model whose content is `content`."""
    return model_said(content, model=MEMORY_MODEL, usage=(1000, 100) if usage else None)


class Proxy:
    def __init__(self, base_url: str, key: str = KEY) -> None:
        self.sdk = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        self.http = httpx.AsyncClient(
            base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=30
        )

    async def chat(self, text: str, headers: dict[str, str] | None = None) -> str:
        """One turn in a new conversation; the exchange's request id."""
        raw = await self.sdk.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": text}],
            extra_headers=headers if headers is not None else ALICE,
        )
        return raw.headers["x-request-id"]

    async def get(self, path: str, **params: Any) -> Any:
        response = await self.http.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()

    async def jobs(self, **params: Any) -> list[dict[str, Any]]:
        page: list[dict[str, Any]] = (await self.get("/memory/jobs", **params))["data"]
        return page

    async def job_of(
        self, request_id: str, *, until: tuple[str, ...] = ("done", "dead")
    ) -> dict[str, Any]:
        """The exchange's extraction job, once it has ended (done or dead)."""

        async def ended() -> dict[str, Any] | None:
            # (Its embedding jobs have the exchange for their subject too.)
            found = await self.jobs(subject=request_id, kind="extract_memories")
            return found[0] if found and found[0]["status"] in until else None

        return await eventually(ended)

    async def memories(self, user: str = "alice") -> list[dict[str, Any]]:
        page: list[dict[str, Any]] = (await self.get("/memory/memories", user=user, limit=100))[
            "data"
        ]
        return sorted(page, key=lambda m: m["text"])

    async def close(self) -> None:
        await self.sdk.close()
        await self.http.aclose()


@pytest.fixture
async def proxies(
    fake_upstream: tuple[FakeOpenAI, str],
    memory_model: tuple[FakeOpenAI, str],
    serve_proxy: Callable[[Config], str],
) -> AsyncIterator[Callable[[str], Proxy]]:
    base_url = serve_proxy(config(fake_upstream[1], memory_model[1]))
    opened: list[Proxy] = []

    def open_(key: str = KEY) -> Proxy:
        opened.append(Proxy(base_url, key))
        return opened[-1]

    yield open_
    for proxy in opened:
        await proxy.close()


async def test_the_memory_models_decisions_are_applied_exactly(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    model, proxy = memory_model[0], proxies()
    model.script = [
        decisions(
            {
                "action": "add",
                "kind": "preference",
                "text": "The user is vegetarian.",
                "confidence": 0.9,
            },
            {"action": "add", "kind": "fact", "text": "The user lives in Lisbon."},
        )
    ]
    first = await proxy.chat("I'm vegetarian and I live in Lisbon. Any dinner ideas?")
    job = await proxy.job_of(first)
    assert job["status"] == "done"
    remembered = await proxy.memories()
    assert [
        (m["kind"], m["text"], m["confidence"], m["source_exchange_id"]) for m in remembered
    ] == [
        ("preference", "The user is vegetarian.", 0.9, first),
        ("fact", "The user lives in Lisbon.", None, first),
    ]
    # The model saw the exchange: the user's turn and the reply it got.
    (asked,) = model.chat_requests
    assert asked["model"] == MEMORY_MODEL
    assert asked["response_format"] == {"type": "json_object"}
    shown = asked["messages"][1]["content"]
    assert "user:\n> I'm vegetarian and I live in Lisbon. Any dinner ideas?" in shown
    assert "assistant:\n> fake reply to: I'm vegetarian" in shown
    # Its cost is the exchange's memory cost: 1000 x $1/M + 100 x $2/M.
    record = await proxy.get(f"/memory/exchanges/{first}")
    (part,) = record["cost"]["parts"]
    assert (part["kind"], part["model"], part["cost_usd"]) == ("extraction", MEMORY_MODEL, 0.0012)

    # A pinned memory of the user's own, which extraction must leave alone.
    pinned = await proxy.http.post(
        "/memory/memories", json={"user": "alice", "text": "Call me Al.", "pinned": True}
    )
    assert pinned.status_code == 201
    veg, lisbon = (m["id"] for m in remembered)
    model.script = [
        decisions(
            {"action": "update", "id": lisbon, "text": "The user lives in Porto."},
            {"action": "delete", "id": veg},
            {"action": "add", "kind": "preference", "text": "The user eats fish."},
            {"action": "delete", "id": pinned.json()["id"]},
            {"action": "delete", "id": "mem_made_up"},
        )
    ]
    second = await proxy.chat("I moved to Porto, and I eat fish now. Dinner ideas?")
    job = await proxy.job_of(second)
    assert [m["text"] for m in await proxy.memories()] == [
        "Call me Al.",
        "The user eats fish.",
        "The user lives in Porto.",
    ]
    assert [d["action"] for d in job["result"]["applied"]] == ["update", "delete", "add"]
    assert [r["reason"] for r in job["result"]["rejected"]] == [
        "pinned memories are not changed by extraction",
        "no such memory among those shown",
    ]
    # The second time, the model was shown the existing memories by id.
    shown = model.chat_requests[1]["messages"][1]["content"]
    assert f"id={lisbon} kind=fact\n> The user lives in Lisbon." in shown
    assert "(pinned)\n> Call me Al." in shown


async def test_a_reply_that_cannot_be_used_is_recorded_and_dead_lettered(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    model, proxy = memory_model[0], proxies()
    model.script = [said("Sure! The user likes tea."), said('{"memories": "tea"}')]
    request_id = await proxy.chat("I like tea.")
    job = await proxy.job_of(request_id, until=("dead",))
    assert (job["attempts"], job["last_error"]) == (2, "the reply has no `memories` list")
    assert [(e["error"], e["output"]) for e in job["result"]["errors"]] == [
        ("the reply is not a JSON object", "Sure! The user likes tea."),
        ("the reply has no `memories` list", '{"memories": "tea"}'),
    ]
    assert [j["id"] for j in await proxy.jobs(status="dead")] == [job["id"]]
    assert await proxy.memories() == []
    # Both attempts cost something, and both are charged.
    record = await proxy.get(f"/memory/exchanges/{request_id}")
    assert [p["kind"] for p in record["cost"]["parts"]] == ["extraction", "extraction"]


async def test_only_stored_exchanges_of_named_users_of_extracting_tenants_are_extracted(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    proxy, other = proxies(), proxies(OTHER_TENANT_KEY)
    memory_model[0].script = [decisions()]  # nothing to remember
    await proxy.chat("I am nobody in particular.", headers={})  # anonymous
    await proxy.chat("I read, I do not write.", headers={**ALICE, "X-Memory-Mode": "read"})
    await proxy.chat("Nothing stored.", headers={**ALICE, "X-Memory-Mode": "off"})
    await other.chat("My tenant does not extract.")
    assert await proxy.jobs() == []
    assert await other.jobs() == []
    stored = await proxy.chat("This one counts.")
    assert [j["subject"] for j in await proxy.jobs()] == [stored]
    assert await other.jobs() == []  # another tenant does not see it
    missing = await other.http.get(f"/memory/jobs/{(await proxy.jobs())[0]['id']}")
    assert missing.status_code == 404
    job = await proxy.job_of(stored)
    assert job["result"] == {"model": MEMORY_MODEL, "applied": [], "rejected": []}
    assert len(memory_model[0].chat_requests) == 1


async def test_erasing_the_user_while_the_model_thinks_leaves_nothing(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    model, proxy = memory_model[0], proxies()
    held = decisions({"action": "add", "text": "The user is called Alice."})
    held.hold = True
    model.script = [held]
    await proxy.chat("My name is Alice.")
    await eventually(lambda: asyncio.sleep(0, result=model.chat_requests))
    erased = await proxy.http.delete("/memory/users/alice")
    assert erased.json()["deleted"]["jobs"] == 1
    model.release.set()

    async def dropped() -> bool:
        text = (
            await proxy.http.get(str(proxy.http.base_url).removesuffix("/v1/") + "/metrics")
        ).text
        return 'memproxy_jobs_total{kind="extract_memories",outcome="dropped"} 1.0' in text

    await eventually(dropped)
    assert await proxy.memories() == []


async def test_job_ids_and_filters_are_checked(proxies: Callable[..., Proxy]) -> None:
    proxy = proxies()
    for path, params, status in [
        ("/memory/jobs/job_999", {}, 404),
        ("/memory/jobs/job_99999999999999999999999", {}, 404),
        ("/memory/jobs/job_1%27%20OR%201=1", {}, 404),
        ("/memory/jobs", {"after": "job_1' OR 1=1"}, 400),
        ("/memory/jobs", {"status": "finished"}, 400),
        ("/memory/jobs", {"after": "abc"}, 400),
        ("/memory/jobs", {"limit": "0"}, 400),
    ]:
        response = await proxy.http.get(path, params=params)
        assert response.status_code == status, (path, params, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_job_cut_off_by_a_crash_runs_again_after_a_restart(
    fake_upstream: tuple[FakeOpenAI, str],
    memory_model: tuple[FakeOpenAI, str],
    tmp_path: Path,
) -> None:
    model = memory_model[0]
    first_try = decisions({"action": "add", "text": "The user is called Alice."})
    first_try.hold = True  # the model is still thinking when the server dies
    model.script = [first_try, decisions({"action": "add", "text": "The user is called Alice."})]
    settings = config(fake_upstream[1], memory_model[1]).model_dump(mode="json", exclude_none=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(settings))
    server = spawn("first", path, tmp_path)
    try:
        wait_ready(server)
        proxy = Proxy(server.url)
        request_id = await proxy.chat("My name is Alice.")
        await eventually(lambda: asyncio.sleep(0, result=model.chat_requests))
        (running,) = await proxy.jobs()
        assert running["status"] == "running"
        await proxy.close()
    finally:
        kill(server)
    server = spawn("second", path, tmp_path)
    try:
        wait_ready(server)
        proxy = Proxy(server.url)
        job = await proxy.job_of(request_id)
        assert (job["status"], job["attempts"]) == ("done", 2)
        assert [m["text"] for m in await proxy.memories()] == ["The user is called Alice."]
        assert len(model.chat_requests) == 2
        await proxy.close()
    finally:
        stop(server)


async def test_a_memory_model_slower_than_its_timeout_fails_the_job_with_the_reason(
    fake_upstream: tuple[FakeOpenAI, str],
    memory_model: tuple[FakeOpenAI, str],
    serve_proxy: Callable[[Config], str],
) -> None:
    """`memory.timeout_seconds` bounds each call (not the job's lease, minutes long)."""
    model = memory_model[0]
    slow = decisions({"action": "add", "text": "The user is called Alice."})
    slow.hold = True  # answered only once the test ends
    model.script = [slow, slow]
    settings = config(fake_upstream[1], memory_model[1])
    tenant = settings.tenants["t1"]
    memory = tenant.memory.model_copy(update={"timeout_seconds": 0.2})
    tenants = {**settings.tenants, "t1": tenant.model_copy(update={"memory": memory})}
    proxy = Proxy(serve_proxy(settings.model_copy(update={"tenants": tenants})))
    try:
        request_id = await proxy.chat("My name is Alice.")
        job = await proxy.job_of(request_id, until=("dead",))
        assert job["attempts"] == 2
        assert job["last_error"] == "the memory model did not answer within 0.2 s"
        assert await proxy.memories() == []
    finally:
        await proxy.close()


@pytest.mark.parametrize(
    "edit",
    [{"text": "The user lives in Berlin."}, {"kind": "event"}, {"confidence": 0.1}],
    ids=["text", "kind", "confidence"],
)
async def test_a_memory_the_user_edits_while_the_model_thinks_keeps_the_users_edit(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str], edit: dict[str, Any]
) -> None:
    model, proxy = memory_model[0], proxies()
    created = await proxy.http.post(
        "/memory/memories", json={"user": "alice", "text": "The user lives in Lisbon."}
    )
    memory_id = created.json()["id"]
    held = decisions(
        {"action": "update", "id": memory_id, "text": "The user lives in Porto.", "confidence": 1}
    )
    held.hold = True
    model.script = [held]
    request_id = await proxy.chat("I moved from Lisbon to Porto.")
    await eventually(lambda: asyncio.sleep(0, result=model.chat_requests))
    assert memory_id in model.chat_requests[0]["messages"][1]["content"]  # it was shown
    edited = await proxy.http.patch(f"/memory/memories/{memory_id}", json=edit)
    assert edited.status_code == 200
    model.release.set()
    job = await proxy.job_of(request_id)
    assert job["result"]["applied"] == []
    assert [r["reason"] for r in job["result"]["rejected"]] == ["the memory was edited meanwhile"]
    (kept,) = await proxy.memories()
    assert kept == edited.json()


async def test_two_jobs_of_one_user_deciding_together_store_a_memory_once(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    """Each job's model saw no such memory, so each says add; the second one written finds it
    stored by the first."""
    model, proxy = memory_model[0], proxies()
    vegetarian = {"action": "add", "kind": "preference", "text": "The user is vegetarian."}
    first, second = (
        decisions(vegetarian),
        decisions({**vegetarian, "text": "the user is vegetarian"}),
    )
    first.hold = second.hold = True
    model.script = [first, second]
    a = await proxy.chat("I'm vegetarian. Dinner ideas?")
    await eventually(lambda: asyncio.sleep(0, result=len(model.chat_requests) == 1))
    b = await proxy.chat("As a vegetarian, what should I cook tomorrow?")
    await eventually(lambda: asyncio.sleep(0, result=len(model.chat_requests) == 2))
    model.release.set()
    jobs = [await proxy.job_of(a), await proxy.job_of(b)]
    # Whichever job wrote first (both are released at once) stored it; the other found it.
    (kept,) = await proxy.memories()
    assert kept["text"] in ("The user is vegetarian.", "the user is vegetarian")
    outcomes = sorted((len(j["result"]["applied"]), len(j["result"]["rejected"])) for j in jobs)
    assert outcomes == [(0, 1), (1, 0)]
    (refused,) = [r for j in jobs for r in j["result"]["rejected"]]
    assert refused["reason"] == "already remembered"


async def test_extraction_reads_the_turn_and_reply_not_a_whole_resent_history(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    """A client that resends its history to a conversation the proxy does not know stores
    all of it with the exchange; the memory model is asked about the new turn alone."""
    model, proxy = memory_model[0], proxies()
    model.script = [decisions()]
    history: list[dict[str, str]] = []
    for n in range(50):
        history.append({"role": "user", "content": f"old question {n}"})
        history.append({"role": "assistant", "content": f"old answer {n}"})
    history.append({"role": "user", "content": "I am vegetarian."})
    raw = await proxy.sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=history,  # type: ignore[arg-type]
        extra_headers=ALICE,
    )
    await proxy.job_of(raw.headers["x-request-id"])
    shown = model.chat_requests[0]["messages"][1]["content"]
    exchange = shown.split("Exchange:\n", 1)[1]
    assert exchange.splitlines() == [
        "assistant:",
        "> old answer 49",
        "user:",
        "> I am vegetarian.",
        "assistant:",
        "> fake reply to: I am vegetarian.",
    ]


async def test_the_memories_shown_are_chosen_by_the_turn_before_a_long_reply(
    proxies: Callable[..., Proxy],
    memory_model: tuple[FakeOpenAI, str],
    fake_upstream: tuple[FakeOpenAI, str],
) -> None:
    model, proxy = memory_model[0], proxies()
    lisbon = await proxy.http.post(
        "/memory/memories", json={"user": "alice", "text": "The user lives in Lisbon."}
    )
    assert lisbon.status_code == 201
    for n in range(25):  # newer, so that Lisbon is not among the newest 20 shown either
        made = await proxy.http.post(
            "/memory/memories", json={"user": "alice", "text": f"The user owns gadget {n}."}
        )
        assert made.status_code == 201
    # A reply of more distinct words than the search takes (24), before the turn's.
    long_reply = (
        "Sourdough bread needs flour, water, salt and a lively starter; knead gently, rest "
        "overnight in the fridge, shape carefully, score deeply, bake hot inside a covered "
        "cast iron pot, then uncover until the crust turns deep golden brown and crackly."
    )
    fake_upstream[0].script = [model_said(long_reply)]
    model.script = [decisions(), decisions()]
    conversation = {**ALICE, "X-Memory-Conversation-Id": "bread-1"}
    await proxy.job_of(await proxy.chat("How do I bake bread?", headers=conversation))
    moved = await proxy.chat("I moved from Lisbon to Porto last week.", headers=conversation)
    await proxy.job_of(moved)
    shown = model.chat_requests[1]["messages"][1]["content"]
    assert "user:\n> I moved from Lisbon to Porto last week." in shown
    assert "The user lives in Lisbon." in shown


async def test_a_memory_model_that_reports_no_usage_is_charged_by_our_count(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    model, proxy = memory_model[0], proxies()
    model.script = [decisions({"action": "add", "text": "The user is called Alice."}, usage=False)]
    request_id = await proxy.chat("My name is Alice.")
    await proxy.job_of(request_id)
    record = await proxy.get(f"/memory/exchanges/{request_id}")
    (part,) = record["cost"]["parts"]
    assert (part["kind"], part["model"], part["estimated"]) == ("extraction", MEMORY_MODEL, True)
    # tiktoken's count of what was asked (the exchange, framed) and of the answer.
    assert part["prompt_tokens"] > 20 and part["completion_tokens"] > 5
    assert part["cost_usd"] > 0


async def test_a_dead_job_retried_runs_again_with_its_attempts_back(
    proxies: Callable[..., Proxy], memory_model: tuple[FakeOpenAI, str]
) -> None:
    model, proxy = memory_model[0], proxies()
    model.script = [said("Sure!"), said("Sure!")]
    request_id = await proxy.chat("I like tea.")
    job = await proxy.job_of(request_id, until=("dead",))
    model.script = [decisions({"action": "add", "text": "The user likes tea."})]

    response = await proxy.http.post(f"/memory/jobs/{job['id']}/retry")
    assert response.status_code == 200, response.text
    assert (response.json()["status"], response.json()["attempts"]) == ("queued", 0)
    done = await proxy.job_of(request_id, until=("done",))
    assert (done["id"], done["attempts"]) == (job["id"], 1)
    assert [m["text"] for m in await proxy.memories()] == ["The user likes tea."]

    # The inspector's jobs page lists the dead letters with a button that does the same.
    model.script = [said("Sure!"), said("Sure!")]
    request_id = await proxy.chat("I like coffee.")
    job = await proxy.job_of(request_id, until=("dead",))
    model.script = [decisions({"action": "add", "text": "The user likes coffee."})]
    root = str(proxy.http.base_url).removesuffix("/v1/")
    with signed_in(root) as ui:
        dead = ui.get("/ui/jobs", params={"status": "dead"}).text
        assert job["id"] in dead and "Retry" in dead
        retried = form(ui, "/ui/jobs/retry", "/ui/jobs?status=dead", id=job["id"])
        assert retried.status_code == 303, retried.text
        assert f"Job {job['id']} queued again." in ui.get(retried.headers["location"]).text
    await proxy.job_of(request_id, until=("done",))

    # Only a dead job runs again; another tenant's, or one that is not there, is not found.
    again = await proxy.http.post(f"/memory/jobs/{job['id']}/retry")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "job_not_dead")
    other = proxies(OTHER_TENANT_KEY)
    assert (await other.http.post(f"/memory/jobs/{job['id']}/retry")).status_code == 404
    assert (await proxy.http.post("/memory/jobs/job_nope/retry")).status_code == 404
