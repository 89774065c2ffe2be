"""schemathesis against the OpenAPI document the server serves: every operation, with cases
generated from its documented parameters and bodies (and, by its negative mode, ones that
break them), never gets a 5xx. A fixed seed and a few examples per operation keep it short
and the same every run; bench/schemathesis_run.py runs thousands of cases through the CLI
(the figures are in docs/operations/security-testing.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from proxy.app import create_app
from proxy.core.config import UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.server import ServerThread

pytestmark = pytest.mark.fuzz
EXAMPLES = 6  # per operation and mode


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """memproxy on the offline echo upstream, with a database of its own for the module."""
    database = Path(tmp_path_factory.mktemp("fuzz")) / "fuzz.db"
    config = make_config(
        UpstreamConfig(kind="echo"), database_url=f"sqlite+aiosqlite:///{database}"
    )
    with ServerThread(create_app(config)) as server:
        yield server.url


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(served: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{served}/schema/openapi.json")
    failures: list[str] = []
    cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            derandomize=True,  # the same cases every run
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case: schemathesis.Case) -> None:
            nonlocal cases
            cases += 1
            response = case.call(headers={"authorization": f"Bearer {KEY}"}, timeout=30)
            if response.status_code >= 500:  # (collected: every operation is tried)
                failures.append(f"{response.status_code} {case.as_curl_command()}")

        try:
            call()
        except Unsatisfiable:  # (nothing to break in an operation without parameters)
            assert mode is GenerationMode.NEGATIVE, operation.label
    assert cases > 50
    assert failures == []
