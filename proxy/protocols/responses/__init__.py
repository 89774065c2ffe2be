"""The Responses API adapter's pure pieces: items <-> neutral messages, translation to and
from Chat Completions (whole and streamed), and observing a native Responses reply."""

from proxy.protocols.responses.chat_stream import ChatToResponsesStream, encode_event
from proxy.protocols.responses.from_chat import response_from_chat, response_object
from proxy.protocols.responses.items import (
    OPAQUE,
    ParsedInput,
    is_opaque,
    messages_to_items,
    opaque_message,
    output_to_messages,
    parse_input,
)
from proxy.protocols.responses.observe import ResponsesAssembler, observe_body
from proxy.protocols.responses.to_chat import DROPPED, ChatRequest, chat_request
from proxy.protocols.responses.usage import chat_usage, responses_usage

__all__ = [
    "DROPPED",
    "OPAQUE",
    "ChatRequest",
    "ChatToResponsesStream",
    "ParsedInput",
    "ResponsesAssembler",
    "chat_request",
    "chat_usage",
    "encode_event",
    "is_opaque",
    "messages_to_items",
    "observe_body",
    "opaque_message",
    "output_to_messages",
    "parse_input",
    "response_from_chat",
    "response_object",
    "responses_usage",
]
