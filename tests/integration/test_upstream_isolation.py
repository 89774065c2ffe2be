"""One httpx client serves every tenant's upstream calls: nothing may carry over between them."""

from __future__ import annotations

import httpx

from tests.conftest import KEY, OTHER_TENANT_KEY
from tests.fakes.openai_upstream import FakeOpenAI, Reply, chat_reply

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_cookie_an_upstream_sets_never_rides_on_a_later_request(
    proxy_url: str, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    fake, _ = fake_upstream
    scripted = chat_reply(BODY)
    fake.script.append(Reply(body=scripted.body, headers={"set-cookie": "lb=tenant-one; Path=/"}))
    async with httpx.AsyncClient(base_url=proxy_url) as client:
        first = await client.post(
            "/chat/completions", json=BODY, headers={"authorization": f"Bearer {KEY}"}
        )
        assert first.status_code == 200
        assert "set-cookie" not in first.headers  # not relayed to the client either
        second = await client.post(
            "/chat/completions", json=BODY, headers={"authorization": f"Bearer {OTHER_TENANT_KEY}"}
        )
        assert second.status_code == 200
    assert [r.headers.get("cookie") for r in fake.requests] == [None, None]
