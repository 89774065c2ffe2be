"""The web inspector (/ui) and the endpoints it needs, over plain HTTP against the real
server: GET /v1/memory/users, signing in (a manage-scoped key only), the session cookie, CSRF
on every change, and a key bound to a user seeing only that user. The browser's view of the
same pages is tests/integration/test_inspector_browser.py."""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator

import httpx
import pytest

from proxy.core.config import ApiKeyConfig, Config, IdentityConfig, TenantConfig
from tests.conftest import CHAT_ONLY_KEY, KEY, OTHER_TENANT_KEY
from tests.fakes.openai_upstream import FakeOpenAI
from tests.inspector import ALICE_KEY, csrf_token, form, inspector_config, signed_in


@pytest.fixture
def base(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> Iterator[str]:
    """The server's root URL, with a conversation of alice's and bob's and a memory of
    carol's."""
    url = serve_proxy(inspector_config(fake_upstream[1]))
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as api:
        for user in ("alice", "bob"):
            turn = {"model": "m", "messages": [{"role": "user", "content": f"Hi, I am {user}"}]}
            reply = api.post("/chat/completions", json=turn, headers={"X-Memory-User-Id": user})
            assert reply.status_code == 200, reply.text
        memory = api.post("/memory/memories", json={"user": "carol", "text": "Likes tea"})
        assert memory.status_code == 201, memory.text
    yield url.removesuffix("/v1")


def api(base: str, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=base + "/v1", headers={"authorization": f"Bearer {key}"})


def test_users_are_listed_with_counts_searched_and_paged(base: str) -> None:
    with api(base) as client:
        listed = client.get("/memory/users").json()
        assert [
            (u["id"], u["conversations"], u["messages"], u["memories"]) for u in listed["data"]
        ] == [
            ("alice", 1, 2, 0),
            ("bob", 1, 2, 0),
            ("carol", 0, 0, 1),
        ]
        assert all(isinstance(u["last_active_at"], int) for u in listed["data"])
        assert [
            u["id"] for u in client.get("/memory/users", params={"q": "AR"}).json()["data"]
        ] == ["carol"]
        first = client.get("/memory/users", params={"limit": 2}).json()
        assert (first["has_more"], first["last_id"]) == (True, "bob")
        rest = client.get("/memory/users", params={"limit": 2, "after": "bob"}).json()
        assert ([u["id"] for u in rest["data"]], rest["has_more"]) == (["carol"], False)
        refused = client.get("/memory/users", params={"sort": "id"})
        assert refused.status_code == 400  # (unknown query parameters, as everywhere)
    with api(base, OTHER_TENANT_KEY) as other:
        assert other.get("/memory/users").json()["data"] == []
    with api(base, ALICE_KEY) as bound:
        assert [u["id"] for u in bound.get("/memory/users").json()["data"]] == ["alice"]
    with api(base, CHAT_ONLY_KEY) as chat:
        assert chat.get("/memory/users").status_code == 403


def test_signing_in_takes_a_manage_key_and_sets_a_strict_httponly_cookie(base: str) -> None:
    with httpx.Client(base_url=base) as client:
        assert client.get("/ui/").headers["location"] == "/ui/users"
        assert client.get("/ui/users").headers["location"] == "/ui/sign-in"
        page = client.get("/ui/sign-in")
        assert page.status_code == 200 and 'type="password"' in page.text
        token = csrf_token(page)
        wrong = client.post("/ui/sign-in", data={"_csrf_token": token, "key": "nope"})
        assert wrong.status_code == 401 and "Incorrect API key" in wrong.text
        chat = client.post("/ui/sign-in", data={"_csrf_token": token, "key": CHAT_ONLY_KEY})
        assert chat.status_code == 403 and "lacks the &#39;manage&#39; scope" in chat.text
        assert client.get("/ui/users").status_code == 303  # (still not signed in)

        done = client.post("/ui/sign-in", data={"_csrf_token": token, "key": KEY})
        assert (done.status_code, done.headers["location"]) == (303, "/ui/users")
        cookie = done.headers["set-cookie"].lower()
        assert "memproxy_ui=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        assert "secure" not in cookie  # (plain HTTP here: server.ui_secure_cookies is off)
        assert KEY not in done.headers["set-cookie"]  # (the key's digest, encrypted)
        users = client.get("/ui/users")
        assert users.status_code == 200 and "carol" in users.text

        with httpx.Client(base_url=base, cookies={"memproxy_ui": "x" * 40}) as tampered:
            assert tampered.get("/ui/users").status_code == 303
        signed_out = form(client, "/ui/sign-out")
        assert signed_out.status_code == 303
        assert client.get("/ui/users").status_code == 303


def test_a_change_without_the_csrf_token_or_from_another_site_is_refused(base: str) -> None:
    with signed_in(base) as client:
        with api(base) as rest:
            memory = rest.get("/memory/memories", params={"user": "carol"}).json()["data"][0]
        fields = {"id": memory["id"], "user": "carol", "pinned": "true"}

        no_token = client.post("/ui/memory/pin", data=fields)
        bad_token = client.post("/ui/memory/pin", data={**fields, "_csrf_token": "forged"})
        token = csrf_token(client.get("/ui/users"))
        other_site = client.post(
            "/ui/memory/pin",
            data={**fields, "_csrf_token": token},
            headers={"origin": "http://evil.example"},
        )
        assert [r.status_code for r in (no_token, bad_token, other_site)] == [403, 403, 403]
        assert "another site" in other_site.text
        with api(base) as rest:
            assert rest.get(f"/memory/memories/{memory['id']}").json()["pinned"] is False

        pinned = client.post(
            "/ui/memory/pin", data={**fields, "_csrf_token": token}, headers={"origin": base}
        )
        assert pinned.status_code == 303
        with api(base) as rest:
            assert rest.get(f"/memory/memories/{memory['id']}").json()["pinned"] is True


def test_a_form_from_the_inspectors_own_page_behind_a_tls_proxy_is_taken(base: str) -> None:
    """Behind a TLS-terminating proxy the browser's origin (https://, the public host name) is
    not the address memproxy sees; the browser's Sec-Fetch-Site says where the form came
    from, and another site's is refused whatever its Origin claims."""
    public = {"origin": "https://inspector.example.com"}
    with signed_in(base) as client:
        with api(base) as rest:
            memory = rest.get("/memory/memories", params={"user": "carol"}).json()["data"][0]
        fields = {"id": memory["id"], "user": "carol", "pinned": "true"}
        token = csrf_token(client.get("/ui/users"))
        for site in ("cross-site", "same-site"):
            refused = client.post(
                "/ui/memory/pin",
                data={**fields, "_csrf_token": token},
                headers={**public, "sec-fetch-site": site},
            )
            assert refused.status_code == 403 and "another site" in refused.text, site
        taken = client.post(
            "/ui/memory/pin",
            data={**fields, "_csrf_token": token},
            headers={**public, "sec-fetch-site": "same-origin"},
        )
        assert taken.status_code == 303, taken.text
        with api(base) as rest:
            assert rest.get(f"/memory/memories/{memory['id']}").json()["pinned"] is True


def test_a_key_bound_to_a_user_sees_only_that_user(base: str) -> None:
    with signed_in(base, ALICE_KEY) as client:
        users = client.get("/ui/users").text
        assert "alice" in users and "bob" not in users and "carol" not in users
        assert client.get("/ui/conversations").status_code == 200  # (alice's, unasked)
        assert client.get("/ui/memories", params={"user": "carol"}).status_code == 403
        with api(base) as rest:
            bobs = rest.get("/memory/conversations", params={"user": "bob"}).json()["data"][0]["id"]
            carols = rest.get("/memory/memories", params={"user": "carol"}).json()["data"][0]["id"]
        assert client.get("/ui/conversation", params={"id": bobs}).status_code == 404
        with api(base) as rest:
            bob_said = rest.get(f"/memory/conversations/{bobs}/messages").json()["data"][0]["id"]
        assert client.get("/ui/message", params={"id": bob_said}).status_code == 404
        deleting = form(client, "/ui/memory/delete", id=carols, user="carol")
        assert deleting.status_code == 403
        with api(base) as rest:
            assert rest.get(f"/memory/memories/{carols}").status_code == 200


def test_every_page_renders_for_a_signed_in_operator(base: str) -> None:
    with signed_in(base) as client:
        with api(base) as rest:
            conversation = rest.get("/memory/conversations", params={"user": "alice"}).json()
            memory = rest.get("/memory/memories", params={"user": "carol"}).json()["data"][0]
        for path, params in [
            ("/ui/users", {"q": "a"}),
            ("/ui/conversations", {"user": "alice"}),
            ("/ui/conversation", {"id": conversation["data"][0]["id"]}),
            ("/ui/memories", {"user": "carol", "q": "tea"}),
            ("/ui/memory/edit", {"id": memory["id"], "user": "carol"}),
            ("/ui/memory/delete", {"id": memory["id"], "user": "carol"}),
            ("/ui/jobs", {"status": "dead"}),
            ("/ui/usage", {"days": "7"}),
        ]:
            page = client.get(path, params=params)
            assert page.status_code == 200, (path, page.text)
            assert "<h1>" in page.text and "http://" not in page.text.replace(base, "")  # no CDN
            assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
            assert page.headers["cache-control"] == "no-store"
        assert client.get("/ui/static/inspector.css").status_code == 200
        usage = client.get("/ui/usage").text
        for chart in ("Spend per day", "Tokens per day", "Spend per model", "Tokens per model"):
            assert f'<svg viewBox="0 0 720 200" role="img" aria-label="{chart}' in usage, chart
        added = form(client, "/ui/memory/new", "/ui/memories?user=bob", user="bob", text="Bikes")
        assert added.status_code == 303
        assert "Bikes" in client.get(added.headers["location"]).text
        empty = form(client, "/ui/memory/new", "/ui/memories?user=bob", user="bob", text=" ")
        assert empty.status_code == 400 and "&#39;text&#39; must be" in empty.text
        assert client.get("/ui/usage", params={"days": "0"}).status_code == 400
        assert (
            client.get("/ui/memory/edit", params={"id": "mem_nope", "user": "carol"}).status_code
            == 404
        )
        unknown = client.get("/ui/no/such/page")
        assert unknown.status_code == 404 and "text/html" in unknown.headers["content-type"]
        assert "<h1>Not found</h1>" in unknown.text and "/ui/no/such/page" in unknown.text
        assert client.get("/ui/static/inspector.css").status_code == 200


def test_a_message_named_by_a_trace_opens_in_its_conversation(base: str) -> None:
    with api(base) as rest:
        bobs = rest.get("/memory/conversations", params={"user": "bob"}).json()["data"][0]["id"]
        said = rest.get(f"/memory/conversations/{bobs}/messages").json()["data"][1]["id"]
    with signed_in(base) as client:
        found = client.get("/ui/message", params={"id": said})
        assert found.status_code == 303
        assert found.headers["location"] == f"/ui/conversation?id={bobs}#{said}"
        assert f'id="{said}"' in client.get(found.headers["location"]).text
        assert client.get("/ui/message", params={"id": "msg_nope"}).status_code == 404


def test_a_session_holds_on_every_replica_that_shares_the_ui_secret(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> None:
    config = inspector_config(fake_upstream[1])
    shared = config.model_copy(
        update={"server": config.server.model_copy(update={"ui_secret": "s" * 32})}
    )
    one, two = (serve_proxy(shared).removesuffix("/v1") for _ in range(2))
    alone = serve_proxy(config).removesuffix("/v1")  # (a secret of its own, made at start-up)
    with signed_in(one) as client:
        cookies = dict(client.cookies)
    for other, status in [(two, 200), (alone, 303)]:
        with httpx.Client(base_url=other, cookies=cookies) as client:
            assert client.get("/ui/users").status_code == status


def test_behind_tls_the_inspectors_cookies_are_marked_secure(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> None:
    config = inspector_config(fake_upstream[1])
    behind_tls = config.model_copy(
        update={"server": config.server.model_copy(update={"ui_secure_cookies": True})}
    )
    base = serve_proxy(behind_tls).removesuffix("/v1")
    with httpx.Client(base_url=base) as client:
        page = client.get("/ui/sign-in")
        csrf = page.headers["set-cookie"].lower()
        assert "secure" in csrf and "samesite=strict" in csrf
        # (httpx, like a browser, keeps a Secure cookie off plain HTTP: sent by hand here, as
        # the browser would over TLS)
        name, _, value = page.headers["set-cookie"].split(";")[0].partition("=")
        done = client.post(
            "/ui/sign-in",
            data={"_csrf_token": csrf_token(page), "key": KEY},
            headers={"cookie": f"{name}={value}"},
        )
        assert done.status_code == 303, done.text
        session = [c for c in done.headers.get_list("set-cookie") if "memproxy_ui=" in c]
        assert session and all("secure" in c.lower() for c in session)


def test_a_token_mode_tenant_signs_in_with_its_operator_key_only(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Callable[[Config], str]
) -> None:
    config = inspector_config(fake_upstream[1])
    identity = IdentityConfig(mode="token", algorithms=["HS256"], secret="s" * 32)
    keys = [ApiKeyConfig(key="ops-key", scopes=["manage"]), ApiKeyConfig(key="app-key")]
    t3 = TenantConfig(api_keys=keys, upstream="main", identity=identity)  # type: ignore[arg-type]
    base = serve_proxy(config.model_copy(update={"tenants": {**config.tenants, "t3": t3}}))
    base = base.removesuffix("/v1")
    with signed_in(base, "ops-key") as client:  # (manage alone, bound to no one: every user)
        assert client.get("/ui/users").status_code == 200
    with httpx.Client(base_url=base) as client:
        refused = form(client, "/ui/sign-in", "/ui/sign-in", key="app-key")
        assert refused.status_code == 401 and "user token" in refused.text


def test_a_long_conversation_is_read_page_by_page(base: str) -> None:
    said = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i}"}
        for i in range(45)
    ]
    with api(base) as rest:
        created = rest.post("/memory/conversations", json={"user": "dan", "messages": said})
        assert created.status_code == 201, created.text
        conversation = created.json()["id"]
    with signed_in(base) as client:
        first = client.get("/ui/conversation", params={"id": conversation}).text
        assert "message number 39<" in first and "message number 40<" not in first
        later = re.search(r'href="(/ui/conversation\?[^"]+)">Later messages', first)
        assert later is not None
        rest_of_it = client.get(html.unescape(later.group(1))).text
        assert "message number 40<" in rest_of_it and "message number 44<" in rest_of_it
        assert "message number 39<" not in rest_of_it and "Later messages" not in rest_of_it
