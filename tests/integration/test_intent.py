"""Intent through the real server and the official SDK: the header, what is stored, the LLM
classifier on its own fake upstream (answers, bad answers, no answer at all), its cost, and the
per-label policies.

The concurrency is checked by the order of events: with a classifier that never answers, the
first chunk of a stream reaches the client while the classifier's request is still unanswered.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from policies.intent_keywords import KeywordClassifier
from proxy.core.config import (
    Config,
    IntentPolicy,
    IntentSettings,
    PriceConfig,
    TenantConfig,
    UpstreamConfig,
)
from proxy.pipeline import exchange as turn_exchange
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply, model_said
from tests.fakes.server import ServerThread
from tests.postgres import free_port

ServeProxy = Callable[[Config], str]
INTENT_MODEL = "intent-model"
# $1 per million input tokens, $2 per million output tokens for the classifier's model.
PRICES = {INTENT_MODEL: PriceConfig(input_per_mtok=1, output_per_mtok=2)}


@pytest.fixture
def classifier() -> Iterator[tuple[FakeOpenAI, str]]:
    """A second fake OpenAI API, for the intent classifier alone."""
    app = FakeOpenAI()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"
        app.release.set()  # answer what is still held, so the server can stop


def config(main_url: str, intent_url: str, **intent: Any) -> Config:
    return Config(
        upstreams={
            "main": UpstreamConfig(kind="openai", base_url=main_url, api_key="k"),
            "classifier": UpstreamConfig(kind="openai", base_url=intent_url, api_key="k"),
        },
        pricing=PRICES,
        tenants={
            "t1": TenantConfig(
                api_keys=[KEY],
                upstream="main",
                intent=IntentSettings(model=INTENT_MODEL, upstream="classifier", **intent),
            )
        },
    )


@pytest.fixture
def start(
    fake_upstream: tuple[FakeOpenAI, str],
    classifier: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
) -> Callable[..., str]:
    def run(**intent: Any) -> str:
        return serve_proxy(config(fake_upstream[1], classifier[1], **intent))

    return run


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


@pytest.fixture
def judge(classifier: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return classifier[0]


def clients(base_url: str) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
    headers = {"authorization": f"Bearer {KEY}"}
    return (
        openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0),
        httpx.AsyncClient(base_url=base_url, headers=headers),
    )


@pytest.fixture
async def sessions(
    start: Callable[..., str],
) -> AsyncIterator[Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]]]:
    opened: list[tuple[openai.AsyncOpenAI, httpx.AsyncClient]] = []

    def open_(**intent: Any) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
        pair = clients(start(**intent))
        opened.append(pair)
        return pair

    yield open_
    for sdk, http in opened:
        await sdk.close()
        await http.aclose()


def verdict(label: str, confidence: float = 0.8, usage: bool = True, **extra: Any) -> Reply:
    """The classifier's answer: a chat completion whose content is the JSON object."""
    content = json.dumps({"label": label, "confidence": confidence, **extra})
    return model_said(content, model=INTENT_MODEL, usage=(100, 10) if usage else None)


HISTORY_ANSWERED: list[Any] = [
    {"role": "user", "content": "tell me about peru"},
    {"role": "assistant", "content": "fake reply to: tell me about peru"},
]


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def exchange(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    response = await http.get(f"/memory/exchanges/{request_id}")
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


# --- keyword mode (the default) --------------------------------------------------------------


async def test_keyword_intent_is_in_the_header_the_message_and_the_exchange(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]], judge: FakeOpenAI
) -> None:
    sdk, http = sessions()
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("what is the boiling point of water?")
    )
    label, confidence, method = raw.headers["x-memory-intent"].split(";")
    assert (label, method) == ("question", "keyword")
    assert 0 <= float(confidence) <= 1
    record = await exchange(http, raw.headers["x-request-id"])
    assert record["intent"] == "question"
    conversation = raw.headers["x-memory-conversation-id"]
    messages = (await http.get(f"/memory/conversations/{conversation}/messages")).json()["data"]
    stored = messages[0]["metadata"]["intent"]
    assert (stored["label"], stored["method"]) == ("question", "keyword")
    assert "intent" not in messages[1]["metadata"]  # the reply has none
    assert judge.requests == []  # keyword mode never calls a model


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_in_mode_off_the_intent_is_found_while_the_upstream_works(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
    fake: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    # Nothing sent upstream depends on it in mode off: the request goes out first, and the
    # keyword classifier (and a stream's prompt count, for its headers) runs while the
    # upstream works. The header and the record still say it.
    # Each step notes whether the upstream has the request: it waits a little for it (the
    # request may still be on its way to the upstream's thread), which holds up the proxy, so a
    # step run before the request went out would wait in vain.
    upstream_had: dict[str, int] = {}

    def upstream_requests() -> int:
        for _ in range(100):
            if fake.chat_requests:
                break
            time.sleep(0.02)
        return len(fake.chat_requests)

    keyword = KeywordClassifier.classify

    def classify(self: KeywordClassifier, *args: Any, **kwargs: Any) -> Any:
        upstream_had["classified"] = upstream_requests()
        return keyword(self, *args, **kwargs)

    count = turn_exchange.count_prompt

    async def count_prompt(*args: Any, **kwargs: Any) -> int:
        upstream_had["counted"] = upstream_requests()
        return await count(*args, **kwargs)

    monkeypatch.setattr(KeywordClassifier, "classify", classify)
    monkeypatch.setattr(turn_exchange, "count_prompt", count_prompt)
    _, http = sessions()
    body = {"model": "gpt-4o-mini", "messages": ask("what is the boiling point of water?")}
    async with http.stream(
        "POST",
        "/chat/completions",
        json={**body, "stream": stream},
        headers={"x-memory-mode": "off"},
    ) as response:
        assert response.status_code == 200
        await response.aread()
    assert upstream_had == ({"classified": 1, "counted": 1} if stream else {"classified": 1})
    assert response.headers["x-memory-intent"].startswith("question;")
    assert (await exchange(http, response.headers["x-request-id"]))["intent"] == "question"


async def test_a_follow_up_is_recognised_from_the_stored_history_of_a_thin_client(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
) -> None:
    sdk, _ = sessions()
    thin = {"X-Memory-Conversation-Id": "c1", "X-Memory-User-Id": "alice"}
    await sdk.chat.completions.create(
        model="gpt-4o-mini", messages=ask("suggest three names for a cat"), extra_headers=thin
    )
    # The client sends only its newest message: the earlier turn is in storage.
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("make them shorter"), extra_headers=thin
    )
    assert raw.headers["x-memory-intent"].startswith("follow_up;")


async def test_no_intent_when_the_tenant_turns_it_off(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
) -> None:
    sdk, http = sessions(mode="off")
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("hi")
    )
    assert "x-memory-intent" not in raw.headers
    assert (await exchange(http, raw.headers["x-request-id"]))["intent"] is None


async def test_usage_report_groups_by_intent(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
) -> None:
    sdk, http = sessions()
    for text in ("hello!", "write a haiku about rain", "write a poem about snow"):
        await sdk.chat.completions.create(
            model="gpt-4o-mini", messages=ask(text), extra_headers={"X-Memory-Mode": "off"}
        )
    report = (await http.get("/memory/usage", params={"group_by": "intent"})).json()
    assert {row["intent"]: row["requests"] for row in report["data"]} == {
        "task": 2,
        "chitchat": 1,
    }


# --- the LLM classifier ----------------------------------------------------------------------


async def test_llm_intent_is_in_the_header_and_its_cost_in_the_memory_cost(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]], judge: FakeOpenAI
) -> None:
    sdk, http = sessions(mode="llm", timeout_ms=5000)
    judge.script.append(verdict("task", 0.77, entities={"topic": "rain"}))
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("what would a haiku about rain look like?")
    )
    assert raw.headers["x-memory-intent"] == "task;0.77;llm"
    # 100 x 1/M + 10 x 2/M for the classifier; the main model has no price here.
    assert raw.headers["x-cost-memory-usd"] == "0.00012"

    sent = judge.chat_requests[0]
    assert sent["model"] == INTENT_MODEL
    assert sent["response_format"] == {"type": "json_object"}
    assert "haiku about rain" in sent["messages"][-1]["content"]

    record = await exchange(http, raw.headers["x-request-id"])
    assert record["intent"] == "task"
    assert record["cost"]["memory_usd"] == 0.00012
    (part,) = record["cost"]["parts"]
    assert (part["kind"], part["model"], part["cost_usd"]) == ("intent", INTENT_MODEL, 0.00012)
    conversation = raw.headers["x-memory-conversation-id"]
    messages = (await http.get(f"/memory/conversations/{conversation}/messages")).json()["data"]
    stored = messages[0]["metadata"]["intent"]
    assert (stored["label"], stored["method"], stored["entities"]) == (
        "task",
        "llm",
        {"topic": "rain"},
    )


async def test_an_unpriced_classifier_adds_nothing_and_the_headers_agree_with_the_record(
    fake_upstream: tuple[FakeOpenAI, str],
    classifier: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    judge: FakeOpenAI,
) -> None:
    """A self-hosted classifier with no price: its call is listed, adds nothing, and the
    exchange's cost is the priced upstream call's, in the headers as in the record."""
    settings = config(fake_upstream[1], classifier[1], mode="llm", timeout_ms=5000)
    priced = {"priced-model": PriceConfig(input_per_mtok=1, output_per_mtok=2)}
    sdk, http = clients(serve_proxy(settings.model_copy(update={"pricing": priced})))
    try:
        judge.script.append(verdict("question", 0.9))
        raw = await sdk.chat.completions.with_raw_response.create(
            model="priced-model", messages=ask("what is the capital of France?")
        )
        assert raw.headers["x-memory-intent"] == "question;0.90;llm"
        record = await exchange(http, raw.headers["x-request-id"])
    finally:
        await sdk.close()
        await http.aclose()
    (part,) = record["cost"]["parts"]
    assert (part["kind"], part["cost_usd"]) == ("intent", None)
    upstream = record["cost"]["upstream_usd"]
    assert upstream and record["cost"]["usd"] == upstream and record["cost"]["memory_usd"] == 0
    assert raw.headers["x-cost-memory-usd"] == "0"
    assert raw.headers["x-cost-usd"] == raw.headers["x-cost-upstream-usd"]
    assert float(raw.headers["x-cost-usd"]) == upstream


async def test_a_bad_llm_answer_falls_back_to_keywords_and_is_counted(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]], judge: FakeOpenAI
) -> None:
    sdk, http = sessions(mode="llm", timeout_ms=5000)
    body = verdict("x").body
    body["choices"][0]["message"]["content"] = "I think it is a question."
    judge.script.append(Reply(body=body))
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("what is the boiling point of water?")
    )
    assert raw.headers["x-memory-intent"].endswith(";keyword")
    assert raw.headers["x-memory-intent"].startswith("question;")
    # The call still cost something: it is charged.
    record = await exchange(http, raw.headers["x-request-id"])
    assert record["intent"] == "question"
    assert record["cost"]["memory_usd"] == 0.00012
    metrics = (await http.get(str(http.base_url).removesuffix("/v1/") + "/metrics")).text
    assert 'memproxy_intent_fallbacks_total{reason="bad_reply",tenant="t1"} 1.0' in metrics


async def test_an_llm_error_falls_back_to_keywords(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]], judge: FakeOpenAI
) -> None:
    sdk, _ = sessions(mode="llm", timeout_ms=5000)
    judge.script.append(Reply(status=500, body={"error": {"message": "boom"}}))
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("hello there!")
    )
    assert raw.headers["x-memory-intent"].startswith("chitchat;")
    assert raw.headers["x-memory-intent"].endswith(";keyword")
    assert raw.parse().choices[0].message.content == "fake reply to: hello there!"


async def test_a_classifier_that_never_answers_holds_up_nothing(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
    judge: FakeOpenAI,
    fake: FakeOpenAI,
) -> None:
    sdk, http = sessions(mode="llm", timeout_ms=400)
    judge.script.append(Reply(body={}, hold=True))  # never, as far as this test goes
    async with sdk.chat.completions.with_streaming_response.create(
        model="gpt-4o-mini", messages=ask("write a limerick about a cat"), stream=True
    ) as response:
        chunks = (await response.parse()).__aiter__()
        first = await chunks.__anext__()
        # The first chunk is here while the classifier has not answered (it may not even have
        # the request yet: both start together).
        assert judge.replies_started == 0
        assert first.choices[0].delta.role == "assistant"
        rest = [c async for c in chunks]
        headers = response.headers
    assert headers["x-memory-intent"].startswith("task;") and headers["x-memory-intent"].endswith(
        ";keyword"
    )
    assert "".join(c.choices[0].delta.content or "" for c in rest if c.choices)
    record = await exchange(http, headers["x-request-id"])  # waits out the classifier's timeout
    assert len(judge.requests) == 1  # it was asked, and never answered
    assert (record["status"], record["intent"]) == ("complete", "task")
    assert record["cost"]["parts"] == []
    # A whole (non-stream) reply waits for the classifier only up to its timeout, then says
    # what the keywords said.
    judge.script.append(Reply(body={}, hold=True))
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("write a limerick about a dog")
    )
    assert raw.headers["x-memory-intent"].endswith(";keyword")
    assert judge.replies_started == 0
    assert len(fake.chat_requests) == 2


# --- policies --------------------------------------------------------------------------------


async def test_a_label_policy_can_leave_out_stored_context(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
    fake: FakeOpenAI,
) -> None:
    sdk, http = sessions(policies={"chitchat": IntentPolicy(memory=False)})
    thin = {"X-Memory-Conversation-Id": "c1", "X-Memory-User-Id": "alice"}
    await sdk.chat.completions.create(
        model="gpt-4o-mini", messages=ask("what is the capital of peru?"), extra_headers=thin
    )
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("good morning!"), extra_headers=thin
    )
    assert raw.headers["x-memory-intent"].startswith("chitchat;")
    assert raw.headers["x-memory-history-messages"] == "0"
    assert len(fake.chat_requests[-1]["messages"]) == 1  # no stored history went upstream
    record = await exchange(http, raw.headers["x-request-id"])
    assert record["attached"]["intent_policy"] == {"label": "chitchat", "memory": False}
    # A question in the same conversation gets its history as usual.
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("and its population?"), extra_headers=thin
    )
    assert raw.headers["x-memory-history-messages"] == "4"
    # In mode off (where its label is found while the upstream works) the record says so too.
    raw = await sdk.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask("good night!"), extra_headers={"X-Memory-Mode": "off"}
    )
    assert (await exchange(http, raw.headers["x-request-id"]))["attached"] == {
        "history_messages": 0,
        "context_tokens": 0,
        "dropped_for_window": 0,
        "recalled": [],
        "recall_ms": None,
        "intent_policy": {"label": "chitchat", "memory": False},
    }


async def test_a_tenant_can_wait_for_the_llm_label_before_acting_on_it(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
    judge: FakeOpenAI,
    fake: FakeOpenAI,
) -> None:
    sdk, _ = sessions(
        mode="llm",
        timeout_ms=5000,
        wait_for_llm=True,
        policies={"chitchat": IntentPolicy(memory=False)},
    )
    thin = {"X-Memory-Conversation-Id": "c2", "X-Memory-User-Id": "bob"}
    judge.script.append(verdict("question"))
    await sdk.chat.completions.create(
        model="gpt-4o-mini", messages=ask("tell me about peru"), extra_headers=thin
    )
    # The keywords read a question; the LLM says small talk, and the tenant acts on the LLM's.
    text = "what is the weather like where you are?"
    assert KeywordClassifier().classify(text, HISTORY_ANSWERED).label == "question"
    judge.script.append(verdict("chitchat", 0.9))
    async with sdk.chat.completions.with_streaming_response.create(
        model="gpt-4o-mini", messages=ask(text), extra_headers=thin, stream=True
    ) as response:
        # A stream's headers carry the LLM's label only because the tenant waited for it.
        assert response.headers["x-memory-intent"] == "chitchat;0.90;llm"
        assert [c async for c in await response.parse()]
    assert len(fake.chat_requests[-1]["messages"]) == 1  # the stored history was left out
    # The classifier saw the stored history, so references can resolve.
    assert "tell me about peru" in judge.chat_requests[-1]["messages"][-1]["content"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-Memory-Mode": "read"},
        {"X-Memory-Mode": "off"},
        {"X-Memory-Mode": "off", "Idempotency-Key": "k-1"},
    ],
    ids=["full", "read", "off", "off-with-key"],
)
async def test_an_llm_answer_after_the_stream_updates_the_record(
    sessions: Callable[..., tuple[openai.AsyncOpenAI, httpx.AsyncClient]],
    judge: FakeOpenAI,
    headers: dict[str, str],
) -> None:
    sdk, http = sessions(mode="llm", timeout_ms=10_000)
    judge.script.append(Reply(body=verdict("task", 0.6).body, hold=True))
    response = await sdk.chat.completions.create(
        model="gpt-4o-mini",
        messages=ask("what is a good name for a boat?"),
        stream=True,
        extra_headers=headers,
    )
    assert [c async for c in response]
    header = response.response.headers["x-memory-intent"]
    assert header.startswith("question;") and header.endswith(";keyword")
    assert judge.replies_started == 0  # the stream ended before the classifier answered
    judge.release.set()
    # The record waits for the late answer, then has it and its cost.
    record = await exchange(http, response.response.headers["x-request-id"])
    assert record["intent"] == "task"
    assert [p["kind"] for p in record["cost"]["parts"]] == ["intent"]
    assert record["cost"]["memory_usd"] == 0.00012
    if not headers:  # only full mode stores the user's message
        conversation = response.response.headers["x-memory-conversation-id"]
        listed = await http.get(f"/memory/conversations/{conversation}/messages")
        assert listed.json()["data"][0]["metadata"]["intent"]["method"] == "llm"


@pytest.mark.parametrize("mode", ["full", "off"])
async def test_a_failed_request_still_says_its_intent(serve_proxy: ServeProxy, mode: str) -> None:
    # (In mode off the request goes out before the intent is found: here it never does.)
    gone = UpstreamConfig(kind="openai", base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="k")
    base = serve_proxy(make_config(gone))
    headers = {"authorization": f"Bearer {KEY}", "x-memory-mode": mode}
    async with httpx.AsyncClient(base_url=base, headers=headers) as http:
        response = await http.post(
            "/chat/completions",
            json={"model": "gpt-4o-mini", "messages": ask("what is the capital of peru?")},
        )
    assert response.status_code >= 500
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.headers["x-memory-intent"].startswith("question;")
    assert response.headers["x-cost-usd"] == "0"
