"""The prompt of an OpenAI request body, field by field: its text for prefix-cache hashing and
its token count.

Chat `messages` (checked: an array of objects), the Responses API's `instructions` + `input`
as chat messages, a completions `prompt` or embeddings `input` (a string, strings, token ids or
arrays of them; token ids become 4 characters each, so a shared id prefix is a shared text
prefix). A malformed field is a `BadRequest` naming it. `body.py` picks the field per API.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from poolkeeper.errors import BadRequest
from poolkeeper.requestcontrol.body_json import json_type
from poolkeeper.tokens import count_tokens, message_text

_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)  # "I" on every usual ABI


def text_and_tokens(text: str) -> tuple[str, int]:
    return text, count_tokens(text)


def chat_messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        if messages is None:
            raise BadRequest("chat request body has no 'messages' array")
        raise BadRequest(f"'messages' must be an array, not {json_type(messages)}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{index}]' must be an object, not {json_type(message)}")
    return messages


def responses_messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Responses API `instructions` + `input` (a string or a list of items) as chat messages."""
    messages: list[Mapping[str, Any]] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = payload.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, str):
                messages.append({"role": "user", "content": item})
            elif isinstance(item, dict):
                # Messages carry role/content; tool outputs and other items carry `output`.
                role = item.get("role") or item.get("type") or "user"
                content = item.get("content", item.get("output"))
                messages.append({"role": str(role), "content": content})
    elif items is not None:
        raise BadRequest(f"'input' must be a string or an array, not {json_type(items)}")
    return messages


def prompt_value(name: str, value: Any) -> tuple[str, int]:
    """A completions `prompt` / embeddings `input`: str, [str], [int] or [[int]]."""
    if value is None:
        return "", 0
    if isinstance(value, str):
        return text_and_tokens(value)
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be a string or an array, not {json_type(value)}")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return _token_ids_text(value), len(value)
    texts: list[str] = []
    tokens = 0
    for index, item in enumerate(value):
        if isinstance(item, str):
            texts.append(item)
            tokens += count_tokens(item)
        elif isinstance(item, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in item
        ):
            texts.append(_token_ids_text(item))
            tokens += len(item)
        elif isinstance(item, dict):
            text = message_text(item.get("content", item.get("text")))
            texts.append(text)
            tokens += count_tokens(text)
        else:
            raise BadRequest(
                f"'{name}[{index}]' must be a string or an array of token ids, "
                f"not {json_type(item)}"
            )
    return "\n".join(texts), tokens


def _token_ids_text(ids: Sequence[int]) -> str:
    """Token ids as text for prefix hashing: 4 characters per id (its 32-bit little-endian bytes
    read as Latin-1), so tokens == len(text) / 4 and a shared id prefix is a shared text prefix.
    """
    try:
        packed = array(_UINT32, ids)
    except OverflowError:  # negative or over 32 bits: not a real token id, but must not fail
        packed = array(_UINT32, (token & 0xFFFFFFFF for token in ids))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes().decode("latin-1")
