"""`/v1/memory/memories` through the real server: create, list, search, correct, pin, delete,
tenant- and user-scoped; pinned memories reach the model on every turn of their user."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from proxy.core.config import ContextSettings, UpstreamConfig
from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI


@pytest.fixture
def base(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any) -> str:
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    url: str = serve_proxy(make_config(upstream))
    return url


@pytest.fixture
async def api(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as c:
        yield c


async def create(api: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await api.post("/memory/memories", json={"user": "alice", **body})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def test_create_read_correct_pin_and_delete(api: httpx.AsyncClient) -> None:
    memory = await create(api, text="Prefers metric units", kind="preference")
    assert memory["id"].startswith("mem_")
    assert (memory["object"], memory["user"], memory["pinned"]) == ("memory.memory", "alice", False)
    got = (await api.get(f"/memory/memories/{memory['id']}")).json()
    assert got == memory
    fixed = await api.patch(
        f"/memory/memories/{memory['id']}", json={"text": "Prefers imperial units", "pinned": True}
    )
    assert fixed.status_code == 200
    assert (fixed.json()["text"], fixed.json()["pinned"]) == ("Prefers imperial units", True)
    deleted = await api.delete(f"/memory/memories/{memory['id']}")
    assert deleted.json() == {
        "id": memory["id"],
        "object": "memory.memory.deleted",
        "deleted": True,
    }
    assert (await api.get(f"/memory/memories/{memory['id']}")).status_code == 404


async def test_a_memory_asked_for_as_another_users_is_not_found_and_not_touched(
    api: httpx.AsyncClient,
) -> None:
    memory = await create(api, text="Prefers metric units")
    path = f"/memory/memories/{memory['id']}"
    as_bob, as_alice = {"user": "bob"}, {"user": "alice"}
    for response in (
        await api.get(path, params=as_bob),
        await api.patch(path, params=as_bob, json={"text": "Prefers imperial units"}),
        await api.delete(path, params=as_bob),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "memory_not_found"
    assert (await api.get(path, params=as_alice)).json() == memory  # untouched
    assert (await api.patch(path, params=as_alice, json={"pinned": True})).json()["pinned"]
    assert (await api.delete(path, params=as_alice)).json()["deleted"] is True
    assert (await api.get(path, params={"user": ""})).status_code == 400


async def test_list_filters_by_user_pin_and_search_and_pages(api: httpx.AsyncClient) -> None:
    for text in ("Has a beagle named Biscuit", "Lives in Lisbon", "Works as a nurse"):
        await create(api, text=text)
    await create(api, text="Allergic to peanuts", pinned=True)
    await create(api, text="Has a cat", user="bob")
    listed = (await api.get("/memory/memories", params={"user": "alice", "limit": 2})).json()
    assert listed["object"] == "list" and listed["has_more"] is True
    assert [m["text"] for m in listed["data"]] == ["Allergic to peanuts", "Works as a nurse"]
    rest = await api.get("/memory/memories", params={"user": "alice", "after": listed["last_id"]})
    assert [m["text"] for m in rest.json()["data"]] == [
        "Lives in Lisbon",
        "Has a beagle named Biscuit",
    ]
    pinned = await api.get("/memory/memories", params={"user": "alice", "pinned": "true"})
    assert [m["text"] for m in pinned.json()["data"]] == ["Allergic to peanuts"]
    found = await api.get(
        "/memory/memories", params={"user": "alice", "q": "where does she live? lisbon"}
    )
    assert [m["text"] for m in found.json()["data"]] == ["Lives in Lisbon"]
    odd = await api.get("/memory/memories", params={"user": "alice", "q": "100%_beagle"})
    assert odd.status_code == 200  # LIKE wildcards in a query are plain characters
    # A query of common words only finds nothing (a search box typed "what"); an empty one
    # is a mistake.
    common = await api.get("/memory/memories", params={"user": "alice", "q": "what is the"})
    assert common.status_code == 200 and common.json()["data"] == []
    empty = await api.get("/memory/memories", params={"user": "alice", "q": " "})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "q"


async def test_other_tenants_and_chat_keys_see_nothing(api: httpx.AsyncClient, base: str) -> None:
    memory = await create(api, text="Secret thing")
    async with httpx.AsyncClient(
        base_url=base, headers={"authorization": f"Bearer {OTHER_TENANT_KEY}"}
    ) as other:
        for method, body in (("GET", None), ("PATCH", {"pinned": True}), ("DELETE", None)):
            response = await other.request(method, f"/memory/memories/{memory['id']}", json=body)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "memory_not_found"
        assert (await other.get("/memory/memories")).json()["data"] == []
    async with httpx.AsyncClient(
        base_url=base, headers={"authorization": f"Bearer {CHAT_ONLY_KEY}"}
    ) as chat_only:
        assert (await chat_only.get("/memory/memories")).status_code == 403


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": ""}, "text"),
        ({"text": 5}, "text"),
        ({"text": "x" * 5000}, "text"),
        ({"text": "ok", "pinned": "yes"}, "pinned"),
        ({"text": "ok", "confidence": 2}, "confidence"),
        ({"text": "ok", "colour": "red"}, "colour"),
        ({"text": "ok", "user": ""}, "user"),
    ],
)
async def test_bad_bodies_are_400_naming_the_field(
    api: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await api.post("/memory/memories", json={"user": "alice", **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_erasing_a_user_erases_their_memories(api: httpx.AsyncClient) -> None:
    await create(api, text="Likes jazz")
    erased = (await api.delete("/memory/users/alice")).json()
    assert erased["deleted"]["memories"] == 1
    assert (await api.get("/memory/memories", params={"user": "alice"})).json()["data"] == []


async def test_pinned_memories_reach_the_model_on_every_turn(
    api: httpx.AsyncClient, base: str, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    fake = fake_upstream[0]
    await create(api, text="Allergic to peanuts", pinned=True)
    await create(api, text="Owns a red bicycle")  # not pinned, and not asked about
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk:
        for user in ("alice", "bob"):
            raw = await sdk.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "suggest a dessert"}],
                extra_headers={"X-Memory-User-Id": user},
            )
            system = [
                m["content"] for m in fake.chat_requests[-1]["messages"] if m["role"] == "system"
            ]
            if user == "alice":
                assert len(system) == 1 and "> - Allergic to peanuts" in system[0]
                assert "red bicycle" not in system[0]
                assert raw.headers["x-memory-memories"] == "1"
            else:
                assert system == []  # bob has no memories


async def test_pinned_instructions_reach_the_model_as_standing_preferences(
    api: httpx.AsyncClient, base: str, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    fake = fake_upstream[0]
    rule = await create(api, text="Answer in metric units", kind="instruction", pinned=True)
    fact = await create(api, text="Allergic to peanuts", pinned=True)
    await create(api, text="Keep answers short", kind="instruction")  # not pinned: reference
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "how far is the moon?"}],
            extra_headers={"X-Memory-User-Id": "alice"},
        )
    (system,) = [m["content"] for m in fake.chat_requests[-1]["messages"] if m["role"] == "system"]
    standing, reference = system.split("Excerpts from earlier conversations", 1)
    assert standing.startswith("The user's standing preferences")
    assert "> - Answer in metric units" in standing and "peanuts" not in standing
    assert "> - Allergic to peanuts" in reference and "metric" not in reference
    assert "Keep answers short" not in system  # not pinned, and not about the turn
    assert raw.headers["x-memory-memories"] == "2"
    exchange = (await api.get(f"/memory/exchanges/{raw.headers['x-request-id']}")).json()
    assert exchange["attached"]["recalled"] == [
        {"memory": rule["id"], "pinned": True},
        {"memory": fact["id"], "pinned": True},
    ]


async def test_other_memories_reach_the_model_when_the_turn_is_about_them(
    api: httpx.AsyncClient, base: str, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    fake = fake_upstream[0]
    pinned = await create(api, text="Allergic to peanuts", pinned=True)
    bike = await create(api, text="Owns a red bicycle, ridden to work every day")
    await create(api, text="Plays the cello in an amateur orchestra")
    await create(api, text="Owns a red bicycle", user="bob")  # another user's
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "my bicycle chain keeps slipping, why?"}],
            extra_headers={"X-Memory-User-Id": "alice"},
        )
    (system,) = [m["content"] for m in fake.chat_requests[-1]["messages"] if m["role"] == "system"]
    assert system.index("Allergic to peanuts") < system.index("[what is known about the user]")
    assert "> - Owns a red bicycle, ridden to work every day" in system
    assert "cello" not in system
    assert raw.headers["x-memory-memories"] == "2"
    exchange = (await api.get(f"/memory/exchanges/{raw.headers['x-request-id']}")).json()
    assert exchange["attached"]["recalled"] == [
        {"memory": pinned["id"], "pinned": True},
        {"memory": bike["id"], "pinned": False},
    ]
    # Attaching them counted as a use of each.
    listed = (await api.get("/memory/memories", params={"user": "alice"})).json()["data"]
    counts = {m["text"]: (m["access_count"], m["last_used_at"] is not None) for m in listed}
    assert counts == {
        "Allergic to peanuts": (1, True),
        "Owns a red bicycle, ridden to work every day": (1, True),
        "Plays the cello in an amateur orchestra": (0, False),
    }


async def test_pinned_memories_go_along_without_recall_and_in_a_tool_loop(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    fake, upstream_url = fake_upstream
    upstream = UpstreamConfig(kind="openai", base_url=upstream_url, api_key="k")
    base = serve_proxy(make_config(upstream, context=ContextSettings(recall=False)))
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers) as api:
        await create(api, text="Allergic to peanuts", pinned=True)
        await create(api, text="Loves peanut butter cookies")  # found only by a search
    call = {"id": "call_1", "type": "function", "function": {"name": "bake", "arguments": "{}"}}
    loop: list[Any] = [
        {"role": "user", "content": "bake me peanut cookies"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "baked"},
    ]
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk:
        for messages in (loop[:1], loop):
            await sdk.chat.completions.create(
                model="gpt-4o-mini", messages=messages, extra_headers={"X-Memory-User-Id": "alice"}
            )
            (system,) = [m for m in fake.chat_requests[-1]["messages"] if m["role"] == "system"]
            # The memories, relevant ones too; no excerpts of stored turns (recall is off).
            assert "> - Allergic to peanuts" in system["content"]
            assert "> - Loves peanut butter cookies" in system["content"]
            assert "> user:" not in system["content"]
