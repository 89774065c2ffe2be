"""Attachments and earlier tool results on the request path, through the real server and the
official SDK: inline documents reach the upstream as planned (whole, their relevant passages,
a summary focused on the question, or not at all), are stored with the conversation in mode
`full`, and the budget rule holds; the planner and the summariser (their own fake upstream,
scripted) are optional, cached, charged, and degrade to the rule or to leaving a document out
when they fail."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from policies.tokens import count_message
from proxy.core.config import (
    AttachmentSettings,
    Config,
    ContextSettings,
    IntentSettings,
    PriceConfig,
    SummarySettings,
    TenantConfig,
    UpstreamConfig,
)
from tests.conftest import KEY, OTHER_TENANT_KEY
from tests.fakes.openai_upstream import FakeOpenAI, Reply, error_reply, model_said
from tests.fakes.server import ServerThread
from tests.polling import eventually

HELPER_MODEL = "helper-model"
PRICES = {HELPER_MODEL: PriceConfig(input_per_mtok=1, output_per_mtok=2)}
ALICE = {"X-Memory-User-Id": "alice"}
FILLER = (
    "The quarterly report covers regional sales figures, staffing changes in the northern "
    "office, and a long discussion of the new cafeteria menu, which nobody asked about."
)
SECRET = "The launch code for the rocket is PINEAPPLE-42, kept in the blue safe."
BIG = "\n\n".join([FILLER] * 30 + [SECRET] + [FILLER] * 30)


@pytest.fixture
def helper_model() -> Iterator[tuple[FakeOpenAI, str]]:
    """The planner's and summariser's own fake OpenAI API."""
    app = FakeOpenAI()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"
        app.release.set()  # (held replies)


def config(main_url: str, helper_url: str, **settings: Any) -> Config:
    context = settings.pop("context", ContextSettings(token_budget=1000))
    return Config(
        upstreams={
            "main": UpstreamConfig(kind="openai", base_url=main_url, api_key="k"),
            "helper": UpstreamConfig(kind="openai", base_url=helper_url, api_key="k"),
        },
        pricing=PRICES,
        tenants={
            "t1": TenantConfig(
                api_keys=[KEY],
                upstream="main",
                context=context,
                attachments=settings.pop(
                    "attachments", AttachmentSettings(upstream="helper", planner_model=HELPER_MODEL)
                ),
                **settings,
            ),
            "t2": TenantConfig(api_keys=[OTHER_TENANT_KEY], upstream="main"),
        },
    )


def said(content: str) -> Reply:
    return model_said(content, model=HELPER_MODEL)


class Proxy:
    def __init__(self, base_url: str, fake: FakeOpenAI) -> None:
        self.fake = fake
        self.sdk = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)
        self.http = httpx.AsyncClient(base_url=base_url, headers={"authorization": f"Bearer {KEY}"})

    async def ask(
        self, text: str, attachments: list[Any] | None = None, **headers: str
    ) -> tuple[httpx.Headers, str]:
        """One turn; the response headers and the proxy's context section as sent."""
        extra: dict[str, Any] = {"attachments": attachments} if attachments is not None else {}
        raw = await self.sdk.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": text}],
            extra_headers={**ALICE, **headers},
            extra_body=extra,
        )
        sent = self.fake.chat_requests[-1]
        assert "attachments" not in sent  # never forwarded
        system = [m["content"] for m in sent["messages"] if m["role"] == "system"]
        return raw.headers, "\n".join(system)

    async def record(self, headers: httpx.Headers) -> dict[str, Any]:
        response = await self.http.get(f"/memory/exchanges/{headers['x-request-id']}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def close(self) -> None:
        await self.sdk.close()
        await self.http.aclose()


@pytest.fixture
async def start(
    fake_upstream: tuple[FakeOpenAI, str],
    helper_model: tuple[FakeOpenAI, str],
    serve_proxy: Callable[[Config], str],
) -> AsyncIterator[Callable[..., Proxy]]:
    opened: list[Proxy] = []

    def open_(**settings: Any) -> Proxy:
        base = serve_proxy(config(fake_upstream[1], helper_model[1], **settings))
        opened.append(Proxy(base, fake_upstream[0]))
        return opened[-1]

    yield open_
    for proxy in opened:
        await proxy.close()


def budget_holds(headers: httpx.Headers, system: str, budget: int = 1000) -> None:
    added = int(headers["x-memory-context-tokens"])
    assert added <= budget
    assert count_message({"role": "system", "content": system}) <= added


async def test_a_small_document_goes_whole_and_stays_with_the_conversation(
    start: Callable[..., Proxy],
) -> None:
    proxy = start()
    doc = {"content": "Our wifi password is hunter2.", "title": "house notes"}
    headers, system = await proxy.ask("what is the wifi password?", [doc])
    assert headers["x-memory-attachments"] == "1"
    assert "> Our wifi password is hunter2." in system
    assert "[document, " in system and "whole]\n> title: house notes\n" in system
    budget_holds(headers, system)
    record = await proxy.record(headers)
    (item,) = record["attached"]["attachments"]["items"]
    assert (item["kind"], item["strategy"], item["original_tokens"]) == (
        "attachment",
        "include_full",
        item["included_tokens"],
    )
    # Stored with the conversation: the next turn (which does not send it) still has it.
    conversation = headers["x-memory-conversation-id"]
    headers, system = await proxy.ask(
        "and the password again?", **{"X-Memory-Conversation-Id": conversation}
    )
    assert "hunter2" in system and headers["x-memory-attachments"] == "1"
    # Sending it again does not store it twice.
    headers, system = await proxy.ask("thanks", [doc], **{"X-Memory-Conversation-Id": conversation})
    assert system.count("hunter2") == 1


async def test_a_document_larger_than_the_budget_gives_its_relevant_passage(
    start: Callable[..., Proxy],
) -> None:
    proxy = start()
    headers, system = await proxy.ask("what is the launch code for the rocket?", [{"content": BIG}])
    assert "PINEAPPLE-42" in system
    # Its passage (a few paragraphs around the code), not the irrelevant bulk of 60.
    assert system.count("cafeteria") <= 10
    budget_holds(headers, system)
    record = await proxy.record(headers)
    (item,) = record["attached"]["attachments"]["items"]
    assert item["strategy"] == "relevant_passages"
    assert item["included_tokens"] < item["original_tokens"]
    assert record["attached"]["attachments"]["planner"] == "rule"


async def test_in_mode_read_a_document_is_used_but_not_stored(start: Callable[..., Proxy]) -> None:
    proxy = start()
    headers, system = await proxy.ask(
        "what is the wifi password?",
        [{"content": "The wifi password is swordfish."}],
        **{"X-Memory-Mode": "read"},
    )
    assert "swordfish" in system and headers["x-memory-attachments"] == "1"
    headers, system = await proxy.ask("what is the wifi password?", **{"X-Memory-Mode": "read"})
    assert "swordfish" not in system and headers["x-memory-attachments"] == "0"


@pytest.mark.parametrize(
    ("attachments", "param"),
    [
        ("not a list", "attachments"),
        ([{"title": "no content"}], "attachments[0].content"),
        ([{"content": 42}], "attachments[0].content"),
        ([{"content": "ok"}, {"attachment_id": 7}], "attachments[1].attachment_id"),
        ([{"content": "ok", "colour": "red"}], "attachments[0].colour"),
        ([{"content": "   "}], "attachments[0].content"),
        ([{"attachment_id": "att_nope"}], "attachments[0].attachment_id"),
        ([{"content": "ok", "title": "t" * 513}], "attachments[0].title"),  # (as stored)
        ([{"content": "ok", "source": "s" * 2049}], "attachments[0].source"),
    ],
)
async def test_bad_attachments_are_400_naming_the_field_and_store_nothing(
    start: Callable[..., Proxy], attachments: Any, param: str
) -> None:
    proxy = start()
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.ask("hello", attachments)
    error = caught.value.response.json()["error"]
    assert error["param"] == param
    listed = (await proxy.http.get("/memory/conversations", params={"user": "alice"})).json()
    assert listed["data"] == []
    assert proxy.fake.chat_requests == []


async def test_another_users_attachment_cannot_be_used(start: Callable[..., Proxy]) -> None:
    proxy = start()
    headers, _ = await proxy.ask(
        "note this", [{"content": "Bob's bank PIN is 0000."}], **{"X-Memory-User-Id": "bob"}
    )
    record = await proxy.record(headers)
    conversation = record["conversation_id"]
    listed = await proxy.http.get(f"/memory/conversations/{conversation}/attachments")
    if listed.status_code == 404:  # (the management endpoint is another change's)
        pytest.skip("GET /v1/memory/conversations/{id}/attachments is not served yet")
    attachment_id = listed.json()["data"][0]["id"]
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.ask("what is the PIN?", [{"attachment_id": attachment_id}])
    assert caught.value.response.json()["error"]["code"] == "attachment_not_found"
    # Bob may use his own by id, in another conversation.
    _, system = await proxy.ask(
        "what is my PIN?", [{"attachment_id": attachment_id}], **{"X-Memory-User-Id": "bob"}
    )
    assert "0000" in system


async def test_a_summary_is_made_once_then_served_from_the_cache(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str]
) -> None:
    helper = helper_model[0]
    proxy = start(summaries=SummarySettings(mode="llm", model=HELPER_MODEL))
    helper.script = [said("A dull quarterly report; it mentions a rocket launch code.")]
    question = "what's the gist?"  # no word of it in the document: summarised
    headers, system = await proxy.ask(
        question, [{"content": BIG, "title": "report"}], **{"X-Memory-Mode": "read"}
    )
    assert "> A dull quarterly report" in system
    assert "a summary focused on the question" in system
    (asked,) = helper.chat_requests
    assert question in asked["messages"][1]["content"]
    # 1000 x $1/M + 100 x $2/M, in the response and in the record.
    assert headers["x-cost-memory-usd"] == "0.0012"
    record = await proxy.record(headers)
    (item,) = record["attached"]["attachments"]["items"]
    assert (item["strategy"], item["cache"]) == ("summarize", "miss")
    assert [p["kind"] for p in record["cost"]["parts"]] == ["summary"]
    budget_holds(headers, system)
    # The same document and question again: no summariser call.
    headers, system = await proxy.ask(
        question, [{"content": BIG, "title": "report"}], **{"X-Memory-Mode": "read"}
    )
    assert "> A dull quarterly report" in system
    assert len(helper.chat_requests) == 1
    (item,) = (await proxy.record(headers))["attached"]["attachments"]["items"]
    assert item["cache"] == "hit"
    assert headers["x-cost-memory-usd"] == "0"


async def test_a_summary_made_while_its_user_is_erased_is_used_but_not_stored_after(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str]
) -> None:
    """The erasure answers while the summariser is still at work on the user's document: the
    summary still serves the request it was made for, but the cache does not keep it (it is
    the user's, made from their document and their question's words)."""
    helper = helper_model[0]
    proxy = start(summaries=SummarySettings(mode="llm", model=HELPER_MODEL))
    helper.script = [replace(said("A dull report with a launch code."), hold=True)]
    asking = asyncio.create_task(
        proxy.ask("what's the gist?", [{"content": BIG}], **{"X-Memory-Mode": "read"})
    )

    async def asked() -> bool:
        return len(helper.chat_requests) == 1

    await eventually(asked, "the summariser is asked")
    assert (await proxy.http.delete("/memory/users/alice")).status_code == 200
    helper.release.set()
    _, system = await asking
    assert "> A dull report with a launch code." in system
    exported = (await proxy.http.get("/memory/users/alice/export")).json()
    assert exported["summaries"] == [] and exported["exchanges"] == []


async def test_a_failing_summariser_leaves_the_document_out_and_the_chat_answers(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str]
) -> None:
    helper = helper_model[0]
    proxy = start(summaries=SummarySettings(mode="llm", model=HELPER_MODEL))
    helper.script = [error_reply(500, "the summariser is down")]
    headers, system = await proxy.ask("give me the gist", [{"content": BIG}])
    assert headers["x-memory-attachments"] == "0"
    assert "cafeteria" not in system
    (item,) = (await proxy.record(headers))["attached"]["attachments"]["items"]
    assert (item["strategy"], item["cache"]) == ("exclude", "failed")


async def test_the_planners_plan_is_followed_and_a_bad_one_gives_way_to_the_rule(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str]
) -> None:
    helper = helper_model[0]
    proxy = start(
        attachments=AttachmentSettings(upstream="helper", planner="llm", planner_model=HELPER_MODEL)
    )
    docs = [{"content": BIG, "title": "report"}, {"content": "Lunch is at noon.", "title": "memo"}]
    helper.script = [
        said(
            json.dumps(
                {
                    "plan": [
                        {"key": "inline:0", "strategy": "exclude", "priority": 2},
                        {"key": "inline:1", "strategy": "include_full", "priority": 1},
                    ]
                }
            )
        )
    ]
    headers, system = await proxy.ask("what is the launch code?", docs, **{"X-Memory-Mode": "read"})
    assert "Lunch is at noon." in system and "PINEAPPLE" not in system
    attached = (await proxy.record(headers))["attached"]["attachments"]
    assert attached["planner"] == "llm"
    assert [i["strategy"] for i in attached["items"]] == ["exclude", "include_full"]
    shown = helper.chat_requests[0]["messages"][1]["content"]
    assert 'key="inline:0" kind=attachment tokens=' in shown and "> title: report" in shown
    # A plan that names a document that is not there: the rule decides.
    helper.script = [
        said(json.dumps({"plan": [{"key": "ghost", "strategy": "exclude", "priority": 1}]}))
    ]
    headers, system = await proxy.ask("what is the launch code?", docs, **{"X-Memory-Mode": "read"})
    assert "PINEAPPLE-42" in system
    attached = (await proxy.record(headers))["attached"]["attachments"]
    assert attached["planner"] == "rule (bad plan)"
    budget_holds(headers, system)


async def test_an_earlier_tool_result_is_there_for_a_follow_up(start: Callable[..., Proxy]) -> None:
    proxy = start(
        context=ContextSettings(token_budget=1000, max_history_messages=2, min_recent_messages=0)
    )
    call = {"id": "call_w", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    history: list[Any] = [
        {"role": "user", "content": "check the weather in Oslo"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call_w",
            "content": "Oslo: 3 degrees, light snow, wind 20 km/h.",
        },
        {"role": "assistant", "content": "It is cold in Oslo."},
        {"role": "user", "content": "thanks, and what about my dentist appointment?"},
        {"role": "assistant", "content": "It is on Tuesday."},
    ]
    create = await proxy.http.post(
        "/memory/conversations", json={"id": "trip", "user": "alice", "messages": history}
    )
    assert create.status_code == 201, create.text
    headers, system = await proxy.ask(
        "how strong was the wind in Oslo?", **{"X-Memory-Conversation-Id": "trip"}
    )
    assert "wind 20 km/h" in system
    (item,) = (await proxy.record(headers))["attached"]["attachments"]["items"]
    assert (item["artifact"], item["kind"]) == ("tool:call_w", "tool_result")


@pytest.mark.parametrize("failure", ["error", "no answer"])
async def test_a_failing_or_silent_planner_gives_way_to_the_rule(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str], failure: str
) -> None:
    helper = helper_model[0]
    proxy = start(
        attachments=AttachmentSettings(
            upstream="helper", planner="llm", planner_model=HELPER_MODEL, timeout_ms=300
        )
    )
    helper.script = [
        error_reply(503, "planner overloaded") if failure == "error" else Reply(hold=True)
    ]
    docs = [{"content": BIG, "title": "report"}, {"content": "Lunch is at noon.", "title": "memo"}]
    headers, system = await proxy.ask("what is the launch code?", docs, **{"X-Memory-Mode": "read"})
    assert len(helper.chat_requests) == 1  # it was asked
    assert "PINEAPPLE-42" in system  # the rule's choice: the relevant passage
    attached = (await proxy.record(headers))["attached"]["attachments"]
    assert attached["planner"] == "rule (the planner failed)"
    assert headers["x-cost-memory-usd"] == "0"
    budget_holds(headers, system)


async def test_the_budget_holds_when_a_tool_unit_straddles_the_newest_messages(
    start: Callable[..., Proxy],
) -> None:
    # The newest two stored messages are tool replies; the large call they answer is kept
    # with them over any budget, so the document gets only what that leaves.
    proxy = start(context=ContextSettings(token_budget=1000, min_recent_messages=2))
    calls = [
        {"id": f"call_{n}", "type": "function", "function": {"name": "f", "arguments": args}}
        for n, args in (("a", json.dumps({"q": "lorem ipsum " * 220})), ("b", "{}"))
    ]
    history: list[Any] = [
        {"role": "user", "content": "look both up"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_a", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_b", "content": "ok"},
    ]
    create = await proxy.http.post(
        "/memory/conversations", json={"id": "tools", "user": "alice", "messages": history}
    )
    assert create.status_code == 201, create.text
    headers, system = await proxy.ask(
        "what does the quarterly report say about the cafeteria and the launch code?",
        [{"content": BIG}],
        **{"X-Memory-Conversation-Id": "tools"},
    )
    kept = sum(count_message(m) for m in history[1:])
    assert 400 < kept < 600
    assert int(headers["x-memory-history-messages"]) >= 3
    assert kept < int(headers["x-memory-context-tokens"]) <= 1000
    assert "PINEAPPLE-42" in system  # what room is left still holds the relevant passage


async def test_a_requests_own_document_goes_in_however_many_the_conversation_has(
    start: Callable[..., Proxy],
) -> None:
    proxy = start()
    await proxy.http.post("/memory/conversations", json={"id": "many", "user": "alice"})
    for n in range(55):
        uploaded = await proxy.http.post(
            "/memory/conversations/many/attachments",
            json={"content": f"Old note {n}: nothing to see here.", "title": f"old {n}"},
        )
        assert uploaded.status_code == 201, uploaded.text
    headers, system = await proxy.ask(
        "what is the wifi password?",
        [{"content": "The wifi password is swordfish.", "title": "new"}],
        **{"X-Memory-Conversation-Id": "many"},
    )
    assert "swordfish" in system
    budget_holds(headers, system)


async def test_in_mode_off_and_without_memory_only_the_requests_own_documents_go(
    start: Callable[..., Proxy],
) -> None:
    proxy = start(intent=IntentSettings(policies={"chitchat": {"memory": False}}))
    headers, _ = await proxy.ask("keep this", [{"content": "The gate code is 1234.", "title": "g"}])
    conversation = headers["x-memory-conversation-id"]
    listed = await proxy.http.get(f"/memory/conversations/{conversation}/attachments")
    stored_id = listed.json()["data"][0]["id"]
    off = {"X-Memory-Mode": "off", "X-Memory-Conversation-Id": conversation}
    # Mode off: the conversation's document is not attached, the request's own are.
    _, system = await proxy.ask("what is the gate code?", **off)
    assert "1234" not in system
    _, system = await proxy.ask("what is the gate code?", [{"attachment_id": stored_id}], **off)
    assert "1234" in system
    _, system = await proxy.ask("what is the door code?", [{"content": "Door: 99."}], **off)
    assert "Door: 99." in system
    # An intent policy with memory: false (small talk) attaches the request's own only.
    chat = {"X-Memory-Conversation-Id": conversation}
    _, system = await proxy.ask("hello there!", [{"content": "Cat: Tom."}], **chat)
    assert "Cat: Tom." in system and "1234" not in system


async def test_deleting_a_document_deletes_its_summaries(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str]
) -> None:
    helper = helper_model[0]
    proxy = start(summaries=SummarySettings(mode="llm", model=HELPER_MODEL))
    helper.script = [said("First summary."), said("Second summary.")]
    await proxy.http.post("/memory/conversations", json={"id": "docs", "user": "alice"})

    async def upload_and_ask() -> dict[str, Any]:
        uploaded = await proxy.http.post(
            "/memory/conversations/docs/attachments", json={"content": BIG, "title": "report"}
        )
        headers, _ = await proxy.ask(
            "what's the gist?", **{"X-Memory-Conversation-Id": "docs", "X-Memory-Mode": "read"}
        )
        (item,) = (await proxy.record(headers))["attached"]["attachments"]["items"]
        deleted = await proxy.http.delete(
            f"/memory/conversations/docs/attachments/{uploaded.json()['id']}"
        )
        assert deleted.status_code == 200
        return item

    assert (await upload_and_ask())["cache"] == "miss"
    # The same text uploaded again after the delete: its old summary is gone with it.
    assert (await upload_and_ask())["cache"] == "miss"
    assert len(helper.chat_requests) == 2


async def test_a_stored_document_larger_than_the_budget_gives_its_passage_and_its_summary(
    start: Callable[..., Proxy], helper_model: tuple[FakeOpenAI, str]
) -> None:
    helper = helper_model[0]
    proxy = start(summaries=SummarySettings(mode="llm", model=HELPER_MODEL))
    await proxy.http.post("/memory/conversations", json={"id": "big", "user": "alice"})
    uploaded = await proxy.http.post(
        "/memory/conversations/big/attachments", json={"content": BIG, "title": "report"}
    )
    assert uploaded.status_code == 201, uploaded.text
    chunks = uploaded.json()["chunks"]
    assert uploaded.json()["tokens"] > 1000 and chunks > 3
    read = {"X-Memory-Conversation-Id": "big", "X-Memory-Mode": "read"}
    headers, system = await proxy.ask("what is the launch code for the rocket?", **read)
    assert "PINEAPPLE-42" in system and f" of {chunks} passages]" in system
    budget_holds(headers, system)
    # Summarised, it is summarised from its whole text (read for the summary).
    helper.script = [said("A report.")]
    headers, system = await proxy.ask("what's the gist?", **read)
    assert "> A report." in system
    (asked,) = helper.chat_requests
    assert "PINEAPPLE-42" in asked["messages"][1]["content"]
    assert asked["messages"][1]["content"].count("cafeteria") == 60


OPENING = [
    {"role": "system", "content": "You are the help desk of Example Corp."},
    {"role": "user", "content": "Please review the attached file."},
]


async def test_one_anonymous_client_never_gets_anothers_documents(
    proxy_url: str, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    """Two clients naming no user (both `anonymous`) of an app whose first turn is a template.
    A's first reply fails, its turn stored; B sends the same opening, which matches A's
    conversation by its messages. A's document must not reach B's prompt, nor B's A's."""
    fake = fake_upstream[0]
    fake.script.append(error_reply(500, "upstream down"))
    async with httpx.AsyncClient(
        base_url=proxy_url, headers={"authorization": f"Bearer {KEY}"}
    ) as api:
        a = await api.post(
            "/chat/completions",
            json={
                "model": "gpt-4o-mini",
                "messages": OPENING,
                "attachments": [{"content": "Payroll: Alice earns 91234 dollars.", "title": "pay"}],
            },
        )
        assert a.status_code == 500, a.text
        b = await api.post(
            "/chat/completions",
            json={
                "model": "gpt-4o-mini",
                "messages": OPENING,
                "attachments": [{"content": "Bob's notes: the code is 5521.", "title": "notes"}],
            },
        )
        assert b.status_code == 200, b.text
        assert "91234" not in str(fake.chat_requests[-1]["messages"])
        assert "5521" in str(fake.chat_requests[-1]["messages"])  # its own, all the same
        assert b.headers["x-memory-attachments"] == "1"
        # A named conversation of the anonymous user keeps its documents, as any user's.
        named = {"X-Memory-Conversation-Id": "anon-chat"}
        first = await api.post(
            "/chat/completions",
            headers=named,
            json={
                "model": "gpt-4o-mini",
                "messages": [{"role": "user", "content": "Read this."}],
                "attachments": [{"content": "The ferry leaves at 9.", "title": "ferry"}],
            },
        )
        assert first.status_code == 200, first.text
        later = await api.post(
            "/chat/completions",
            headers=named,
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "When?"}]},
        )
        assert later.status_code == 200, later.text
        assert "The ferry leaves at 9." in str(fake.chat_requests[-1]["messages"])
