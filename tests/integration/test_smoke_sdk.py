from __future__ import annotations

import openai

from tests.conftest import KEY
from tests.fakes.openai_upstream import FakeOpenAI


async def test_plain_completion_reaches_upstream_with_its_key(
    proxy_url: str, fake_upstream: tuple[FakeOpenAI, str]
) -> None:
    fake, _ = fake_upstream
    client = openai.AsyncOpenAI(base_url=proxy_url, api_key=KEY, max_retries=0)
    reply = await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"custom_field": 7},
    )
    assert reply.choices[0].message.content == "fake reply to: hello"
    sent = fake.requests[-1]
    assert sent.headers["authorization"] == "Bearer upstream-key"
    assert sent.json()["custom_field"] == 7
    await client.close()
