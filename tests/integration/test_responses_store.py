"""`GET`/`DELETE /v1/responses/{id}`, `/input_items`, `/input_tokens`, `/cancel` and
`/compact` on the real server: answered from memproxy's own store on an upstream it translates
(`echo` here), scoped by tenant and named user, in OpenAI's shapes (the official SDK reads
them); passed through untouched on an upstream with native Responses. Records are put in the
store through the repository, as the Responses adapter saves them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import Connection

from policies.tokens import count_response_input
from proxy.core.config import Config, UpstreamConfig
from proxy.protocols.responses.stored import input_item_list, new_response_id
from storage.database import Database
from storage.records import ResponseRecord
from storage.repositories.responses import Responses
from tests.conftest import CHAT_ONLY_KEY, DEFAULT_DATABASE, KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply
from tests.openapi_check import assert_openai_shape
from tests.storage.test_responses import T0

MODEL = "gpt-4o-mini"
ERROR_FIELDS = {"message", "type", "param", "code"}


def a_response(
    response_id: str,
    *,
    user: str = "alice",
    tenant: str = "t1",
    previous: str | None = None,
    store: bool = True,
    said: str = "hello",
    answer: str = "hi there",
) -> ResponseRecord:
    """A stored response as the adapter would save it: the Response the client got, and the
    request's input as the listed items."""
    output = {
        "type": "message",
        "id": "msg_" + response_id.removeprefix("resp_"),
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": answer, "annotations": []}],
    }
    body = {
        "id": response_id,
        "object": "response",
        "created_at": int(T0.timestamp()),
        "status": "completed",
        "model": MODEL,
        "output": [output],
        "previous_response_id": previous,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "store": store,
        "usage": {
            "input_tokens": 5,
            "output_tokens": 3,
            "total_tokens": 8,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
    return ResponseRecord(
        tenant_id=tenant,
        id=response_id,
        user_id=user,
        conversation_id="conv_1",
        request_id="req_" + response_id,
        model=MODEL,
        previous_response_id=previous,
        store=store,
        status="completed",
        response=body,
        input_items=input_item_list(said),
        created_at=T0,
    )


async def save(
    *records: ResponseRecord, url: str = f"sqlite+aiosqlite:///{DEFAULT_DATABASE}"
) -> None:
    def work(conn: Connection) -> None:
        for record in records:
            Responses(conn).save(record)

    db = Database(url)
    try:
        await db.write(work)
    finally:
        await db.dispose()


@pytest.fixture
def translated(serve_proxy: Callable[[Config], str]) -> str:
    """memproxy for tenants t1 and t2 on the echo upstream (translated Responses)."""
    return serve_proxy(make_config(UpstreamConfig(kind="echo")))


def http_for(base: str, key: str = KEY, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {key}", **headers})


@pytest.fixture
async def sdk(translated: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=translated, api_key=KEY, max_retries=0) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    return dict(error)


async def test_a_stored_response_is_retrieved_as_its_client_got_it(
    translated: str, sdk: openai.AsyncOpenAI
) -> None:
    stored = a_response(new_response_id())
    await save(stored)
    got = await sdk.responses.retrieve(stored.id)
    assert (got.id, got.output_text, got.status) == (stored.id, "hi there", "completed")
    async with http_for(translated, CHAT_ONLY_KEY) as http:  # (scope chat is enough)
        raw = await http.get(f"/responses/{stored.id}")
    assert raw.status_code == 200 and raw.json() == stored.response


@pytest.mark.parametrize(
    ("who", "headers"),
    [
        ("another tenant", {"authorization": f"Bearer {OTHER_TENANT_KEY}"}),
        ("another user", {"x-memory-user-id": "bob"}),
        ("unknown", {}),
        ("store false", {}),
    ],
)
async def test_a_response_the_caller_may_not_see_is_a_404_in_openais_shape(
    translated: str, who: str, headers: dict[str, str]
) -> None:
    response_id = new_response_id()
    if who != "unknown":
        await save(a_response(response_id, store=who != "store false"))
    async with http_for(translated, **headers) as http:
        for method, path in [
            ("GET", f"/responses/{response_id}"),
            ("GET", f"/responses/{response_id}/input_items"),
            ("DELETE", f"/responses/{response_id}"),
        ]:
            response = await http.request(method, path)
            assert_openai_shape("ErrorResponse", response.json())
            error = error_of(response, 404)
            assert error["type"] == "invalid_request_error"
            assert error["message"] == f"Response with id '{response_id}' not found."
    async with http_for(translated, **{"x-memory-user-id": "alice"}) as http:
        named = await http.get(f"/responses/{response_id}")
    assert named.status_code == (200 if who in ("another tenant", "another user") else 404)


async def test_a_deleted_response_is_gone(translated: str, sdk: openai.AsyncOpenAI) -> None:
    first, kept = a_response(new_response_id()), a_response(new_response_id())
    await save(first, kept)
    async with http_for(translated, **{"x-memory-user-id": "alice"}) as http:
        deleted = await http.delete(f"/responses/{first.id}")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
        error_of(await http.get(f"/responses/{first.id}"), 404)
        error_of(await http.delete(f"/responses/{first.id}"), 404)
    await sdk.responses.delete(kept.id)  # (the SDK's own call)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(kept.id)


async def test_input_items_page_as_openai_lists_them(
    translated: str, sdk: openai.AsyncOpenAI
) -> None:
    given: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "One"}]},
        {"role": "assistant", "content": "Two"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ]
    stored = replace(a_response(new_response_id()), input_items=input_item_list(given))
    await save(stored)
    ids = [item["id"] for item in stored.input_items]
    assert [i.split("_")[0] for i in ids] == ["msg", "msg", "msg", "fc", "fco"]

    # The SDK pages through them (after=<last id>), newest first by default.
    listed = [item.id async for item in sdk.responses.input_items.list(stored.id, limit=2)]
    assert listed == ids[::-1]
    ascending = await sdk.responses.input_items.list(stored.id, order="asc", limit=3)
    assert [item.id for item in ascending.data] == ids[:3] and ascending.has_more
    async with http_for(translated) as http:
        page = (await http.get(f"/responses/{stored.id}/input_items")).json()
        assert page == {
            "object": "list",
            "data": stored.input_items[::-1],
            "first_id": ids[-1],
            "last_id": ids[0],
            "has_more": False,
        }
        assert_openai_shape("ResponseItemList", page)
        # The easy form as OpenAI lists it: typed, text parts, a status.
        assert page["data"][-1]["content"] == [{"type": "input_text", "text": "Be brief."}]
        assert page["data"][-3]["content"] == [
            {"type": "output_text", "text": "Two", "annotations": [], "logprobs": []}
        ]
        assert {item["status"] for item in page["data"]} == {"completed"}
        last = await http.get(f"/responses/{stored.id}/input_items", params={"after": ids[0]})
        assert last.json()["data"] == [] and last.json()["first_id"] is None
        for params, param in [
            ({"limit": "0"}, "limit"),
            ({"limit": "101"}, "limit"),
            ({"order": "newest"}, "order"),
            ({"after": "msg_elsewhere"}, "after"),
        ]:
            response = await http.get(f"/responses/{stored.id}/input_items", params=params)
            assert error_of(response, 400)["param"] == param


async def test_input_tokens_are_counted_with_the_stored_chain(
    translated: str, sdk: openai.AsyncOpenAI
) -> None:
    first = a_response(new_response_id(), said="My name is Ada.", answer="Hello Ada.")
    second = a_response(new_response_id(), previous=first.id, said="And yours?", answer="Echo.")
    await save(first, second)

    alone = await sdk.responses.input_tokens.count(
        model=MODEL, input="What is my name?", instructions="Answer in one word."
    )
    assert alone.object == "response.input_tokens"
    assert alone.input_tokens == count_response_input(
        "Answer in one word.", input_item_list("What is my name?"), MODEL
    )
    chained = await sdk.responses.input_tokens.count(
        model=MODEL, input="What is my name?", previous_response_id=second.id
    )
    earlier = [
        item
        for stored in (first, second)
        for item in [*stored.input_items, *stored.response["output"]]
    ]
    assert chained.input_tokens == count_response_input(
        None, [*earlier, *input_item_list("What is my name?")], MODEL
    )
    async with http_for(translated, **{"x-memory-user-id": "bob"}) as http:
        raw = await http.post("/responses/input_tokens", json={"input": "hi"})
        assert_openai_shape("TokenCountsResource", raw.json())
        theirs = await http.post(
            "/responses/input_tokens", json={"input": "hi", "previous_response_id": second.id}
        )
        assert error_of(theirs, 400)["param"] == "previous_response_id"
        bad = await http.post("/responses/input_tokens", json={"input": 5})
        assert error_of(bad, 400)["param"] == "input"


async def test_cancel_and_compact_on_a_translated_upstream_say_why_not(
    translated: str, sdk: openai.AsyncOpenAI
) -> None:
    stored = a_response(new_response_id())
    await save(stored)
    async with http_for(translated) as http:
        for path in (f"/responses/{stored.id}/cancel", "/responses/compact"):
            error = error_of(await http.post(path, json={"model": MODEL}), 400)
            assert error["code"] == "unsupported_with_translation"
            assert "responses: translate" in error["message"]
    with pytest.raises(openai.BadRequestError):
        await sdk.responses.cancel(stored.id)


async def test_an_erased_users_responses_are_gone(translated: str) -> None:
    mine, theirs = a_response(new_response_id()), a_response(new_response_id(), user="bob")
    await save(mine, replace(mine, store=False, id=new_response_id()), theirs)
    async with http_for(translated) as http:
        erased = await http.delete("/memory/users/alice")
        assert erased.status_code == 200
        assert erased.json()["deleted"]["responses"] == 2
        error_of(await http.get(f"/responses/{mine.id}"), 404)
        assert (await http.get(f"/responses/{theirs.id}")).status_code == 200


async def test_a_native_upstream_gets_every_one_of_these_requests_untouched(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> None:
    """The upstream keeps its responses: memproxy's store is not asked, even for an id it
    holds."""
    fake, upstream_url = fake_upstream
    base = serve_proxy(
        make_config(UpstreamConfig(kind="openai", base_url=upstream_url, api_key="upstream-key"))
    )
    held = a_response(new_response_id())
    await save(held)
    sent = [
        ("GET", f"/responses/{held.id}", {"include[]": "message.output_text.logprobs"}),
        ("DELETE", f"/responses/{held.id}", {}),
        ("GET", f"/responses/{held.id}/input_items", {"limit": "3", "order": "asc"}),
        ("POST", "/responses/input_tokens", {}),
        ("POST", f"/responses/{held.id}/cancel", {}),
        ("POST", "/responses/compact", {}),
    ]
    # (The fake is a chat-only server: each of these gets a scripted answer naming its path.)
    fake.script = [Reply(body={"path": "/v1" + path}) for _, path, _ in sent]
    async with http_for(base) as http:
        for method, path, params in sent:
            body = {"model": MODEL, "input": "hi"} if method == "POST" else None
            reply = await http.request(method, path, params=params, json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["path"] == "/v1" + path  # (the fake's echo of what it got)
    assert [(r.method, r.path) for r in fake.requests] == [
        (method, "/v1" + path) for method, path, _ in sent
    ]
    assert fake.requests[0].query == "include%5B%5D=message.output_text.logprobs"
    assert fake.requests[0].headers["authorization"] == "Bearer upstream-key"


async def test_an_openai_upstream_set_to_translate_is_served_from_the_store(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> None:
    fake, upstream_url = fake_upstream
    base = serve_proxy(
        make_config(
            UpstreamConfig(
                kind="openai", base_url=upstream_url, api_key="k", responses="translate"
            ),
        )
    )
    held = a_response(new_response_id())
    await save(held)
    async with http_for(base) as http:
        assert (await http.get(f"/responses/{held.id}")).json() == held.response
    assert fake.requests == []


async def test_the_store_serves_postgresql_too(
    database_url: str, serve_proxy: Callable[[Config], str]
) -> None:
    base = serve_proxy(make_config(UpstreamConfig(kind="echo"), database_url=database_url))
    first = a_response(new_response_id())
    second = a_response(new_response_id(), previous=first.id)
    await save(first, second, url=database_url)
    async with http_for(base) as http:
        assert (await http.get(f"/responses/{second.id}")).json() == second.response
        tokens = await http.post(
            "/responses/input_tokens", json={"input": "x", "previous_response_id": second.id}
        )
        assert tokens.status_code == 200 and tokens.json()["input_tokens"] > 0
        assert (await http.delete(f"/responses/{first.id}")).status_code == 200
        broken = await http.post(
            "/responses/input_tokens", json={"input": "x", "previous_response_id": second.id}
        )
        assert first.id in error_of(broken, 400)["message"]
