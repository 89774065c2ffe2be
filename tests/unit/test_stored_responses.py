"""The Responses API objects memproxy keeps itself: ids as OpenAI makes them, and a request's
`input` listed as OpenAI lists a response's input items."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from policies.tokens import TOKENS_PER_MESSAGE, TOKENS_PER_REPLY, count_response_input, count_text
from proxy.protocols.responses.stored import input_item_list, new_response_id, response_record


def test_response_ids_look_like_openais() -> None:
    assert re.fullmatch(r"resp_[0-9a-f]{48}", new_response_id())
    assert new_response_id() != new_response_id()


def test_a_string_input_is_one_user_message() -> None:
    (item,) = input_item_list("hello")
    assert re.fullmatch(r"msg_[0-9a-f]{48}", item.pop("id"))
    assert item == {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "hello"}],
        "status": "completed",
    }


def test_items_keep_their_ids_order_and_unknown_fields_and_the_request_is_not_changed() -> None:
    given: list[Any] = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}], "id": "msg_9"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "item_reference", "id": "msg_0"},
        "not an item",
    ]
    before = repr(given)
    listed = input_item_list(given)
    assert repr(given) == before
    assert [item["id"][:3] for item in listed] == ["rs_", "msg", "fc_", "msg"]
    assert listed[0] == given[0]  # (opaque: kept as it came)
    assert listed[1]["content"] == [
        {"type": "output_text", "text": "a", "annotations": [], "logprobs": []}
    ]
    assert listed[2]["status"] == "completed" and "status" not in listed[3]
    assert input_item_list(None) == input_item_list(5) == []


def test_input_tokens_count_instructions_and_each_item_as_a_message() -> None:
    items = input_item_list(
        [
            {"role": "user", "content": "What is the weather?"},
            {"type": "function_call", "call_id": "c", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "Sunny"},
            {"type": "reasoning", "summary": []},
        ]
    )
    texts = ["Be brief.", "What is the weather?", "weather\n{}", "Sunny", ""]
    expected = sum(TOKENS_PER_MESSAGE + count_text(t, "gpt-4o") for t in texts) + TOKENS_PER_REPLY
    assert count_response_input("Be brief.", items, "gpt-4o") == expected


def test_a_record_reads_its_id_model_status_and_chain_from_the_response() -> None:
    at = datetime(2026, 11, 1, tzinfo=UTC)
    body = {
        "id": "resp_2",
        "object": "response",
        "model": "gpt-4o-mini",
        "status": "incomplete",
        "previous_response_id": "resp_1",
        "output": [],
    }
    record = response_record(
        body,
        "hi",
        tenant_id="t1",
        user_id="alice",
        conversation_id="c1",
        request_id="req_1",
        store=True,
        created_at=at,
    )
    assert (record.id, record.model, record.status, record.previous_response_id) == (
        "resp_2",
        "gpt-4o-mini",
        "incomplete",
        "resp_1",
    )
    assert record.response is body and record.input_items[0]["role"] == "user"
