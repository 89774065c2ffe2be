"""The strict fake Responses upstream (tests/fakes/openai_responses.py), driven by the official
SDK over real HTTP on 127.0.0.1: it must behave like OpenAI where tests rely on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_responses import FakeResponses
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread
from tests.openapi_check import assert_openai_shape
from tests.responses_check import check_stream

TOOL: Any = {"type": "function", "name": "lookup", "parameters": {}, "strict": None}


@pytest.fixture
def fake() -> Iterator[tuple[FakeResponses, openai.OpenAI]]:
    app = FakeResponses()
    with (
        ServerThread(app) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="k") as client,
    ):
        yield app, client


def test_a_response_is_created_retrieved_listed_and_deleted(
    fake: tuple[FakeResponses, openai.OpenAI],
) -> None:
    app, client = fake
    raw_response = client.responses.with_raw_response.create(
        model="gpt-4o", instructions="Be brief.", input="hi there"
    )
    assert_openai_shape("Response", raw_response.http_response.json())
    response = raw_response.parse()
    assert response.output_text.startswith('fake response to: "hi there" (1 input items')
    assert "instructions: yes" in response.output_text
    assert client.responses.retrieve(response.id).id == response.id
    raw = client.responses.input_items.with_raw_response.list(response.id).http_response.json()
    assert_openai_shape("ResponseItemList", raw)
    assert raw["data"][0]["content"] == [{"type": "input_text", "text": "hi there"}]
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    assert app.responses_requests[0]["input"] == "hi there"


def test_a_chain_of_three_sees_every_earlier_item_but_not_old_instructions(
    fake: tuple[FakeResponses, openai.OpenAI],
) -> None:
    _, client = fake
    first = client.responses.create(model="gpt-4o", instructions="Be brief.", input="one")
    second = client.responses.create(model="gpt-4o", previous_response_id=first.id, input="two")
    third = client.responses.create(model="gpt-4o", previous_response_id=second.id, input="three")
    assert third.output_text.startswith(
        'fake response to: "three" (5 input items, 4 from previous responses, 0 system'
    )
    assert "instructions: no" in third.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="gpt-4o", previous_response_id="resp_nope", input="x")
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.param == "previous_response_id"


def test_store_false_is_not_kept(fake: tuple[FakeResponses, openai.OpenAI]) -> None:
    _, client = fake
    response = client.responses.create(model="gpt-4o", input="secret", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="gpt-4o", previous_response_id=response.id, input="x")


def test_a_function_call_round_trip(fake: tuple[FakeResponses, openai.OpenAI]) -> None:
    _, client = fake
    first = client.responses.create(model="gpt-4o", input="please lookup the sky", tools=[TOOL])
    call = first.output[0]
    assert call.type == "function_call" and call.name == "lookup"
    second = client.responses.create(
        model="gpt-4o",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "blue"}],
        tools=[TOOL],
    )
    assert second.output_text.startswith(f'fake response to the output of {call.call_id}: "blue"')
    forced = client.responses.create(
        model="gpt-4o", input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "lookup"}
    )
    assert forced.output[0].type == "function_call"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model="gpt-4o", input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]
        )
    assert "No tool call found" in refused.value.message


def test_streams_are_the_event_sequence_the_sdk_consumes(
    fake: tuple[FakeResponses, openai.OpenAI],
) -> None:
    _, client = fake
    with client.responses.stream(model="gpt-4o", input="stream me") as stream:
        final = stream.get_final_response()
    assert final.output_text.startswith('fake response to: "stream me"')
    with client.responses.stream(model="gpt-4o", input="lookup", tools=[TOOL]) as stream:
        called = stream.get_final_response()
    assert called.output[0].type == "function_call"
    with httpx.Client() as http:
        body = {"model": "gpt-4o", "input": "raw", "stream": True}
        raw = http.post(app_url(client) + "/responses", json=body).content
    check_stream(raw)


def app_url(client: openai.OpenAI) -> str:
    return str(client.base_url).rstrip("/")


@pytest.mark.parametrize(
    "body",
    [
        {"model": "gpt-4o", "input": 5},
        {"model": "gpt-4o", "input": [{"type": "message", "role": "robot", "content": "x"}]},
        {"model": "gpt-4o", "input": "x", "tools": [{"type": "function", "name": "f"}]},
        {"model": "gpt-4o", "input": "x", "temperature": "hot"},
        {"input": "x"},
    ],
)
def test_a_body_the_spec_refuses_is_a_400_in_openais_shape(
    fake: tuple[FakeResponses, openai.OpenAI], body: dict[str, Any]
) -> None:
    _, client = fake
    with httpx.Client() as http:
        response = http.post(app_url(client) + "/responses", json=body)
    assert response.status_code == 400
    assert_openai_shape("ErrorResponse", response.json())
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_chat_fake_has_no_responses_api() -> None:
    with (
        ServerThread(FakeOpenAI()) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gpt-4o", input="hi")
        assert (
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
            .choices[0]
            .message.content
            == "fake reply to: hi"
        )
