"""Recall by meaning out of the box, through the real server with its default embeddings (the
local all-MiniLM-L6-v2): a question finds what it shares no word with; what was stored before
embeddings were on is caught up, its progress in /metrics; and without the model memproxy
still starts, recalls by keywords, and says so in /readyz and /metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.background import local_model
from proxy.core.config import Config, MemorySettings, ServerConfig, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.integration.test_recall import recall_section
from tests.polling import eventually

FACT = "My employer is Globex Corporation."
QUESTION = "Where do I work?"  # not one word in common with FACT


def config(url: str, *, db: str | None = None, **memory: Any) -> Config:
    built = make_config(
        UpstreamConfig(kind="openai", base_url=url, api_key="k"),
        database_url=db,
        memory=MemorySettings(**memory),
    )
    # Count the backlog often (the catch-up's progress shows in /metrics).
    return built.model_copy(update={"server": ServerConfig(maintenance_seconds=0.05)})


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


def client(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=30)


async def say(http: httpx.AsyncClient, text: str, conversation: str, mode: str = "full") -> None:
    response = await http.post(
        "/chat/completions",
        json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]},
        headers={
            "X-Memory-User-Id": "alice",
            "X-Memory-Conversation-Id": conversation,
            "X-Memory-Mode": mode,
        },
    )
    assert response.status_code == 200, response.text


async def embedded(http: httpx.AsyncClient) -> int:
    """How many messages the embedding jobs have embedded (their results, summed)."""
    listed = (await http.get("/memory/jobs", params={"kind": "embed_messages"})).json()
    return sum(j["result"]["embedded"] for j in listed["data"] if j["status"] == "done")


def metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


async def test_a_question_finds_what_it_means_by_default(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    base = serve_proxy(config(fake_upstream[1]))  # memory.embeddings: not said, so local
    async with client(base) as http:
        await say(http, FACT, "work")
        await eventually(lambda: embedded(http), "the exchange embedded")
        await say(http, QUESTION, "new", mode="read")
        section = recall_section(fake.chat_requests[-1])
        assert section is not None and "Globex" in section
        # No embeddings call reached the upstream: the model runs in memproxy.
        assert not [r for r in fake.requests if r.path.endswith("/embeddings")]
        ready = (await http.get(base.removesuffix("/v1") + "/readyz")).json()
        assert ready["embeddings"] == "ok"


async def test_by_keywords_alone_the_same_question_finds_nothing(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    base = serve_proxy(config(fake_upstream[1], embeddings="off"))
    async with client(base) as http:
        await say(http, FACT, "work")
        await say(http, QUESTION, "new", mode="read")
        assert recall_section(fake.chat_requests[-1]) is None


async def test_what_was_stored_before_is_caught_up(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI, tmp_path: Path
) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'upgrade.db'}"
    # Before the upgrade: embeddings off, three exchanges stored (six messages), no vectors.
    before = serve_proxy(config(fake_upstream[1], db=db, embeddings="off"))
    async with client(before) as http:
        for n in range(3):
            await say(http, FACT if n == 0 else f"Note number {n} about lunch.", f"c{n}")
    # After: the default, on the same database.
    after = serve_proxy(config(fake_upstream[1], db=db))
    async with client(after) as http:

        async def all_six() -> bool:
            return await embedded(http) == 6

        await eventually(all_six, "the catch-up")
        listed = (await http.get("/memory/jobs", params={"kind": "embed_messages"})).json()
        assert all(j["status"] == "done" for j in listed["data"])
        assert len(listed["data"]) == 3  # one catch-up job per conversation

        async def drained() -> bool:
            text = (await http.get(after.removesuffix("/v1") + "/metrics")).text
            return metric(text, 'memproxy_embedding_backlog{tenant="t1"}') == 0

        await eventually(drained, "the backlog metric back to 0")
        await say(http, QUESTION, "new", mode="read")
        section = recall_section(fake.chat_requests[-1])
        assert section is not None and "Globex" in section


@pytest.fixture
def no_model(tmp_path: Path) -> Iterator[None]:
    """The model file gone (as a platform without its files would be)."""
    local_model.forget()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "model_file", lambda: tmp_path / "missing.onnx")
        yield
    local_model.forget()


async def test_without_the_model_memproxy_starts_and_recalls_by_keywords(
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: Any,
    fake: FakeOpenAI,
    no_model: None,
) -> None:
    base = serve_proxy(config(fake_upstream[1]))
    root = base.removesuffix("/v1")
    async with client(base) as http:
        ready = await http.get(root + "/readyz")
        assert ready.status_code == 200  # still ready: recall goes on by keywords
        assert ready.json()["embeddings"].startswith("unavailable: the model file cannot be read")
        metrics = (await http.get(root + "/metrics")).text
        assert metric(metrics, "memproxy_local_embeddings_up") == 0
        await say(http, FACT, "work")
        await say(http, "Which corporation employs me?", "new", mode="read")
        section = recall_section(fake.chat_requests[-1])  # a shared word: found by keywords
        assert section is not None and "Globex" in section
        listed = (await http.get("/memory/jobs", params={"kind": "embed_messages"})).json()
        assert listed["data"] == []  # nothing queued for a model that is not there


@pytest.fixture
def unloadable_model(tmp_path: Path) -> Iterator[None]:
    """A model file that passes the start-up check (the expected checksum) but that
    onnxruntime refuses: found out only when the first embedding loads it."""
    junk = tmp_path / "model.onnx"
    junk.write_bytes(b"not a model")
    local_model.forget()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "model_file", lambda: junk)
        patch.setattr(local_model, "MODEL_SHA256", local_model._sha256(junk))
        yield
    local_model.forget()


async def test_a_model_that_fails_to_load_on_first_use_is_reported(
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: Any,
    fake: FakeOpenAI,
    unloadable_model: None,
) -> None:
    base = serve_proxy(config(fake_upstream[1]))
    root = base.removesuffix("/v1")
    async with client(base) as http:
        # Ready without loading the model (that waits for the first embedding).
        ready = await http.get(root + "/readyz")
        assert ready.status_code == 200 and ready.json()["embeddings"] == "ok"
        assert metric((await http.get(root + "/metrics")).text, "memproxy_local_embeddings_up") == 1
        await say(http, FACT, "work")  # answered all the same; its question loads the model

        async def reported() -> str:
            embeddings: str = (await http.get(root + "/readyz")).json()["embeddings"]
            return embeddings if embeddings != "ok" else ""

        status = await eventually(reported, "the failed load in /readyz")
        assert status.startswith("unavailable: onnxruntime could not load")
        assert (await http.get(root + "/readyz")).status_code == 200  # reported, not judged
        assert metric((await http.get(root + "/metrics")).text, "memproxy_local_embeddings_up") == 0
        await say(http, "Which corporation employs me?", "new", mode="read")
        section = recall_section(fake.chat_requests[-1])  # by keywords, as without the model
        assert section is not None and "Globex" in section
