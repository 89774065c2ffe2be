"""The web inspector in a real browser: Debian's Chromium driven by Playwright (never a
downloaded browser), against the real server on 127.0.0.1 with the strict fake upstream.
Each page is photographed into a folder (`INSPECTOR_SCREENSHOTS`, else pytest's tmp dir) and
the photograph checked to be more than a blank page. Without Chromium these tests skip, except
under CI=true, where they fail."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.core.config import Config
from tests.conftest import CHAT_ONLY_KEY, KEY
from tests.fakes.openai_upstream import FakeOpenAI
from tests.inspector import ALICE_KEY, inspector_config

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"The browser tests need {reason} in CI.", pytrace=False)
    pytest.skip(f"no {reason}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        _unavailable(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright (pip install -e '.[dev]')")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("INSPECTOR_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("inspector-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def served(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> Iterator[tuple[str, FakeOpenAI]]:
    """(the server's root URL, the fake upstream): alice with two conversations and a memory,
    bob with a conversation."""
    url = serve_proxy(inspector_config(fake_upstream[1]))
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as api:
        for user, text in [
            ("alice", "I am planning a trip to Lisbon."),
            ("bob", "Hello"),
            ("alice", "Which city was my trip to?"),  # (a new conversation: recalls the first)
        ]:
            turn(api, user, [{"role": "user", "content": text}])
        memory = api.post("/memory/memories", json={"user": "alice", "text": "Likes tea"})
        assert memory.status_code == 201, memory.text
    yield url.removesuffix("/v1"), fake_upstream[0]


def turn(api: httpx.Client, user: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    reply = api.post(
        "/chat/completions",
        json={"model": "gpt-4o-mini", "messages": messages},
        headers={"X-Memory-User-Id": user},
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


@pytest.fixture
def page(browser: Any, served: tuple[str, FakeOpenAI]) -> Iterator[Any]:
    context = browser.new_context(base_url=served[0], viewport={"width": 1200, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    yield opened
    context.close()


def photograph(page: Any, shots: Path, name: str) -> Path:
    """The whole page as a PNG, checked to show more than a blank page."""
    from PIL import Image

    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    with Image.open(path) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 16, f"{path} looks blank"
    return path


def sign_in(page: Any, key: str) -> None:
    page.goto("/ui/sign-in")
    page.get_by_label("API key").fill(key)
    with page.expect_navigation():
        page.keyboard.press("Enter")  # (the form answers the keyboard, as every control here)


def test_an_operator_reads_users_conversations_turns_jobs_and_usage(page: Any, shots: Path) -> None:
    sign_in(page, KEY)
    page.wait_for_url("**/ui/users")
    assert page.get_by_role("heading", level=1).inner_text() == "Users"
    assert page.get_by_role("row", name="alice").is_visible()
    photograph(page, shots, "users")

    page.get_by_role("link", name="alice", exact=True).click()
    page.wait_for_url("**/ui/conversations?user=alice")
    photograph(page, shots, "conversations")
    page.locator("table tbody a").first.click()  # (the newest: the question)
    page.wait_for_url("**/ui/conversation?id=*")
    assert "Which city was my trip to?" in page.locator("ol.timeline").inner_text()
    details = page.locator("details.exchange").first
    trace = details.locator("section.trace")
    assert not trace.is_visible()
    details.locator("summary").click()  # (a <details>: no script needed)
    assert trace.is_visible() and "gpt-4o-mini" in details.inner_text()
    sections = trace.locator("table.sections").inner_text()
    assert "recall" in sections and "memories" in sections
    assert "I am planning a trip to Lisbon." in trace.locator("pre.context").inner_text()
    photograph(page, shots, "conversation")

    # A recalled excerpt links to the message it came from, in its own conversation.
    trace.locator("ul.parts").get_by_role("link", name=re.compile("^msg_")).first.click()
    page.wait_for_url("**/ui/conversation?id=*#msg_*")
    target = page.locator("article.message:target")
    assert "I am planning a trip to Lisbon." in target.inner_text()

    page.get_by_role("navigation").get_by_role("link", name="Jobs").click()
    page.wait_for_url("**/ui/jobs")
    photograph(page, shots, "jobs")
    page.get_by_role("navigation").get_by_role("link", name="Usage").click()
    page.wait_for_url("**/ui/usage")
    assert page.locator("svg[role=img]").count() >= 2
    photograph(page, shots, "usage")


def test_an_edited_pinned_memory_reaches_the_next_turn_and_deleting_asks_first(
    page: Any, served: tuple[str, FakeOpenAI], shots: Path
) -> None:
    base, upstream = served
    sign_in(page, KEY)
    page.goto("/ui/memories?user=alice")
    photograph(page, shots, "memories")
    page.get_by_role("link", name="Edit memory").first.click()
    page.get_by_label("Text").fill("Drinks only green tea, no sugar")
    page.get_by_label("Pinned").check()
    photograph(page, shots, "memory-edit")
    page.get_by_role("button", name="Save").click()
    page.wait_for_url("**/ui/memories?user=alice&done=saved*")
    assert page.get_by_role("status").inner_text() == "Memory saved."
    assert "pinned" in page.locator("li.memory").first.inner_text()

    with httpx.Client(base_url=base + "/v1", headers={"authorization": f"Bearer {KEY}"}) as api:
        turn(api, "alice", [{"role": "user", "content": "What should I order?"}])
    prompt = str(upstream.chat_requests[-1]["messages"])
    assert "Drinks only green tea, no sugar" in prompt
    # ... and its trace says so.
    page.goto("/ui/conversations?user=alice")
    page.locator("table tbody a").first.click()
    page.wait_for_url("**/ui/conversation?id=*")
    page.locator("details.exchange summary").first.click()
    trace = page.locator("section.trace").first
    assert "Drinks only green tea, no sugar" in trace.locator("pre.context").inner_text()
    page.goto("/ui/memories?user=alice")

    page.get_by_role("link", name="Delete memory").first.click()
    page.wait_for_url("**/ui/memory/delete?*")
    assert page.get_by_role("heading", level=1).inner_text().startswith("Delete memory")
    photograph(page, shots, "memory-delete")
    page.get_by_role("button", name="Delete memory").click()
    page.wait_for_url("**/ui/memories?user=alice&done=deleted")
    assert page.locator("li.memory").count() == 0


def test_wrong_keys_chat_keys_and_cross_site_posts_are_refused(
    page: Any, served: tuple[str, FakeOpenAI], shots: Path
) -> None:
    base, _ = served
    sign_in(page, "not-a-key")
    assert "Incorrect API key" in page.get_by_role("alert").inner_text()
    photograph(page, shots, "sign-in-refused")
    sign_in(page, CHAT_ONLY_KEY)
    assert "manage" in page.get_by_role("alert").inner_text()

    sign_in(page, KEY)
    page.wait_for_url("**/ui/users")
    with httpx.Client(base_url=base + "/v1", headers={"authorization": f"Bearer {KEY}"}) as api:
        memory = api.get("/memory/memories", params={"user": "alice"}).json()["data"][0]
    # A page of another origin (the same site: the session cookie goes with its post) posts a
    # form to the inspector; it cannot know the CSRF token.
    other = base.replace("127.0.0.1", "localhost") + "/attack"
    hostile = (
        f'<form method="post" action="{base}/ui/memory/delete">'
        f'<input name="id" value="{memory["id"]}"><input name="user" value="alice">'
        '<button type="submit">Win a prize</button></form>'
    )
    page.route(other, lambda route: route.fulfill(body=hostile, content_type="text/html"))
    page.goto(other)
    page.get_by_role("button", name="Win a prize").click()
    page.wait_for_url("**/ui/memory/delete")
    assert "Not allowed" in page.get_by_role("heading", level=1).inner_text()
    with httpx.Client(base_url=base + "/v1", headers={"authorization": f"Bearer {KEY}"}) as api:
        assert api.get(f"/memory/memories/{memory['id']}").status_code == 200


def test_a_key_bound_to_a_user_sees_only_that_user(page: Any, shots: Path) -> None:
    sign_in(page, ALICE_KEY)
    page.wait_for_url("**/ui/users")
    rows = page.locator("table tbody tr")
    assert rows.count() == 1 and "alice" in rows.first.inner_text()
    assert "user alice" in page.locator("header").inner_text()
    photograph(page, shots, "bound-key")
    page.goto("/ui/memories?user=bob")
    assert "Not allowed" in page.get_by_role("heading", level=1).inner_text()
    photograph(page, shots, "bound-key-refused")
