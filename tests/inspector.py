"""What the web inspector's tests share: a server whose tenant has a key of every kind, and a
browser-like client that signs in with a form and its CSRF token."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from proxy.core.config import ApiKeyConfig, Config, UpstreamConfig
from tests.conftest import CHAT_ONLY_KEY, KEY, make_config

ALICE_KEY = "alice-manage-key"  # manage scope, bound to alice
_TOKEN = re.compile(r'name="_csrf_token" value="([^"]+)"')


def inspector_config(upstream_url: str) -> Config:
    """make_config's tenants, t1 with a manage key bound to alice as well, and its traces
    whole (`trace: full`: the added context's text too)."""
    upstream = UpstreamConfig(kind="openai", base_url=upstream_url, api_key="k")
    config = make_config(upstream, trace="full")
    t1 = config.tenants["t1"]
    bound = ApiKeyConfig(key=ALICE_KEY, scopes=["manage"], user="alice")
    t1 = t1.model_copy(
        update={"api_keys": [KEY, ApiKeyConfig(key=CHAT_ONLY_KEY, scopes=["chat"]), bound]}
    )
    return config.model_copy(update={"tenants": {**config.tenants, "t1": t1}})


def csrf_token(page: httpx.Response) -> str:
    found = _TOKEN.search(page.text)
    assert found, page.text
    return found.group(1)


def form(client: httpx.Client, path: str, page: str = "/ui/users", **fields: Any) -> httpx.Response:
    """A form posted as the browser would post it from `page`: with that page's token."""
    token = csrf_token(client.get(page))
    return client.post(path, data={"_csrf_token": token, **fields})


@contextmanager
def signed_in(base: str, key: str = KEY) -> Iterator[httpx.Client]:
    """A client signed in to the inspector at `base` (the server's root URL) with `key`."""
    with httpx.Client(base_url=base, timeout=30) as client:
        response = form(client, "/ui/sign-in", "/ui/sign-in", key=key)
        assert response.status_code == 303, response.text
        yield client
