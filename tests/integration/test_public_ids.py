"""Message and job ids are opaque: they do not count the rows of every tenant (`msg_18`,
`job_10` told any client how much all tenants had stored), and the ids given before still
name the same rows."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx

from proxy.core.config import MemorySettings, UpstreamConfig
from tests.conftest import KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.polling import until

OPAQUE = re.compile(r"(msg|job)_[b-df-hj-np-tv-xz]{15}")


def test_message_and_job_ids_are_opaque_and_old_ids_still_work(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[..., str]
) -> None:
    fake, url = fake_upstream
    fake.embed = lambda text: [1.0, 0.0, 0.0]  # (the embedding job's, for a job to look at)
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="k")
    config = make_config(upstream, memory=MemorySettings(embeddings="upstream"))
    base = serve_proxy(config).removesuffix("/v1")
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as client:
        said = [{"role": "user", "content": f"note {i}"} for i in range(4)]
        created = client.post("/v1/memory/conversations", json={"id": "c", "user": "alice"})
        assert created.status_code == 201
        added = client.post("/v1/memory/conversations/c/messages", json={"messages": said})
        assert added.status_code == 201, added.text
        listed = client.get("/v1/memory/conversations/c/messages").json()["data"]
        ids = [m["id"] for m in listed]
        assert all(OPAQUE.fullmatch(i) for i in ids), ids
        assert len(set(ids)) == 4

        def after(cursor: str) -> list[str]:
            page = client.get("/v1/memory/conversations/c/messages", params={"after": cursor})
            assert page.status_code == 200, page.text
            return [m["content"] for m in page.json()["data"]]

        # The new id as a cursor, and the decimal id the same message had before (the first
        # row of a fresh database).
        assert after(ids[0]) == after("msg_1") == ["note 1", "note 2", "note 3"]
        assert client.get("/v1/memory/conversations/c/messages?after=msg_zzzzzzzzzzzzzzz").is_error

        def jobs() -> list[dict[str, Any]]:
            return list(client.get("/v1/memory/jobs").json()["data"])

        until(lambda: bool(jobs()), "an embedding job")
        [job] = jobs()[:1]
        assert OPAQUE.fullmatch(job["id"]), job["id"]
        # Its subject names the conversation by its id and start, not by its row's key
        # (`range:1:1-4` before).
        assert re.fullmatch(r"range:c@[0-9]{16}:[0-9]+-[0-9]+", job["subject"]), job["subject"]
        assert client.get(f"/v1/memory/jobs/{job['id']}").json()["id"] == job["id"]
        old = client.get("/v1/memory/jobs/job_1")  # (the first job of a fresh database)
        assert old.status_code == 200 and old.json()["id"] == job["id"]
        exported = client.get("/v1/memory/users/alice/export").json()
        assert [m["id"] for m in exported["conversations"][0]["messages"]] == ids
        assert exported["jobs"][0]["id"] == job["id"]
    # Another tenant's key finds neither, in either form.
    with httpx.Client(
        base_url=base, headers={"authorization": f"Bearer {OTHER_TENANT_KEY}"}
    ) as other:
        for path in (f"/v1/memory/jobs/{job['id']}", "/v1/memory/jobs/job_1"):
            assert other.get(path).status_code == 404
