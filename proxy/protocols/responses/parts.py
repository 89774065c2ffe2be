"""Content parts between the Responses API and Chat Completions.

    Responses                              Chat Completions (the stored shape)
    input_text / output_text {text}        text {text}   (annotations and logprobs dropped)
    input_image {image_url, detail}        image_url {image_url: {url, detail}}
    input_file {file_id|file_data, ...}    file {file: {file_id|file_data, filename}}
    refusal {refusal}                      refusal {refusal}

A part with no chat equivalent (an `input_image` known only by `file_id`, an `input_file` by
`file_url`, any type this module does not know) is kept as it came, in the Responses shape, so
that nothing the client sent is lost on its way to storage and back.
"""

from __future__ import annotations

from typing import Any

TEXT_TYPES = frozenset({"input_text", "output_text", "text"})
# Fields of an `input_file` that a chat `file` part carries too.
_FILE_FIELDS = ("file_id", "file_data", "filename")


class Malformed(ValueError):
    """An item or part that is not what the Responses API accepts, at `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def chat_part(part: Any, where: str) -> dict[str, Any]:
    """One Responses content part as a chat content part (or as it came, see the module)."""
    if not isinstance(part, dict):
        raise Malformed(f"Invalid type for '{where}': expected an object.", where)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise Malformed(f"Missing required parameter: '{where}.type'.", f"{where}.type")
    if kind in TEXT_TYPES:
        text = part.get("text")
        if not isinstance(text, str):
            raise Malformed(f"Invalid type for '{where}.text': expected a string.", f"{where}.text")
        return {"type": "text", "text": text}
    if kind == "refusal":
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise Malformed(
                f"Invalid type for '{where}.refusal': expected a string.", f"{where}.refusal"
            )
        return {"type": "refusal", "refusal": refusal}
    if kind == "input_image":
        url, file_id = part.get("image_url"), part.get("file_id")
        if not isinstance(url, str) and not isinstance(file_id, str):
            raise Malformed(f"'{where}' needs an image_url or a file_id.", f"{where}.image_url")
        if isinstance(url, str) and file_id is None:
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            return {"type": "image_url", "image_url": image}
        return dict(part)
    if kind == "input_file" and part.get("file_url") is None:
        file = {k: part[k] for k in _FILE_FIELDS if isinstance(part.get(k), str)}
        if file and set(part) <= {"type", *_FILE_FIELDS}:
            return {"type": "file", "file": file}
    return dict(part)


def chat_parts(parts: list[Any], where: str) -> list[dict[str, Any]]:
    return [chat_part(part, f"{where}[{j}]") for j, part in enumerate(parts)]


def responses_part(part: Any, *, assistant: bool = False) -> Any:
    """One chat content part as a Responses input part (the inverse of `chat_part`)."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind == "text":
        return {"type": "output_text" if assistant else "input_text", "text": part.get("text")}
    if kind == "image_url":
        image = part.get("image_url")
        image = image if isinstance(image, dict) else {"url": image}
        return {
            "type": "input_image",
            "image_url": image.get("url"),
            "detail": image.get("detail") or "auto",
        }
    if kind == "file" and isinstance(part.get("file"), dict):
        return {"type": "input_file", **part["file"]}
    return dict(part)  # refusal, and parts kept in the Responses shape


def responses_parts(parts: list[Any], *, assistant: bool = False) -> list[Any]:
    return [responses_part(part, assistant=assistant) for part in parts]


def is_chat_part(part: Any) -> bool:
    """Whether a stored part is one the Chat Completions API takes (else it is a Responses
    part kept as it came)."""
    return isinstance(part, dict) and part.get("type") in (
        "text",
        "image_url",
        "file",
        "refusal",
        "input_audio",
    )
