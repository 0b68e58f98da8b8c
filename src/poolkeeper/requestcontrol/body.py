"""Parsing of OpenAI request bodies: the model, the prompt text and the knobs routing needs.

Pure and synchronous. `parse_body(path, body)` decodes the JSON once, with guards against the
inputs that break naive parsers (reliability checklist A6 and E5), and returns a `ParsedRequest`.
Every failure is a `BadRequest` with a precise message; nothing here raises anything else.

Decisions (documented in docs/configuration.md, "Request handling"):
- Invalid UTF-8, lone surrogates (`"\\ud800"`), NaN/Infinity literals and floats that overflow
  to infinity are rejected: re-serialising them would produce invalid JSON or text that
  downstream hashing cannot encode. So are integers longer than 4300 digits (CPython's own
  limit; converting longer ones costs quadratic time).
- Nesting deeper than Python's recursion limit is rejected (the decoder's RecursionError).
- A duplicate top-level `model` key is rejected rather than resolved, so the gateway and the model
  server can never disagree about which model was asked for.
- `max_completion_tokens` wins over `max_tokens` (it is the newer OpenAI name); the Responses API
  uses `max_output_tokens`.

The JSON decoding and its guards live in `body_json.py` (with why orjson goes first), the
prompt's fields in `body_prompt.py`; this module reads what routing needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from poolkeeper.errors import BadRequest
from poolkeeper.requestcontrol.body_json import decode_json_object, json_type
from poolkeeper.requestcontrol.body_prompt import (
    chat_messages,
    prompt_value,
    responses_messages,
    text_and_tokens,
)
from poolkeeper.tokens import chat_prompt_text

MAX_TOKENS_LIMIT = 2**31 - 1
_MODEL_REPR_LIMIT = 120  # how much of a bad model value an error message quotes


class ApiKind(StrEnum):
    """Which OpenAI API a request targets, from the path suffix."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat/completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


@dataclass(slots=True)
class ParsedRequest:
    """What routing needs to know about one request body. Read-only by convention: not
    `frozen`, whose `__init__` costs 2-3x (an `object.__setattr__` per field), per request."""

    api: ApiKind
    model: str
    prompt: str  # text for prefix-cache hashing (chat rendered by poolkeeper.tokens)
    prompt_tokens: int
    stream: bool
    max_tokens: int | None
    include_usage: bool  # the client asked for stream_options.include_usage
    payload: dict[str, Any]  # the decoded body (not copied: treat as read-only)


def api_kind(path: str) -> ApiKind:
    """The API a path targets; tolerates a missing `/v1` prefix and a query string."""
    clean = path.split("?", 1)[0].rstrip("/")
    if clean.endswith("/chat/completions"):
        return ApiKind.CHAT_COMPLETIONS
    if clean.endswith("/completions"):
        return ApiKind.COMPLETIONS
    if clean.endswith("/embeddings"):
        return ApiKind.EMBEDDINGS
    if clean.endswith("/responses"):
        return ApiKind.RESPONSES
    return ApiKind.OTHER


def parse_body(path: str, body: bytes) -> ParsedRequest:
    """Decode and interpret one request body. Raises BadRequest with a precise message."""
    if _blank(body):
        raise BadRequest('request body is empty: expected a JSON object with a "model" field')
    payload = decode_json_object(body)
    model = _model(payload)
    kind = api_kind(path)
    prompt, prompt_tokens = _prompt(kind, payload)
    return ParsedRequest(
        api=kind,
        model=model,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        stream=_stream(payload),
        max_tokens=_max_tokens(kind, payload),
        include_usage=_include_usage(payload),
        payload=payload,
    )


def _blank(body: bytes) -> bool:
    """Whether `body` is empty or only whitespace. `strip` copies a body with whitespace at
    either end (1 MiB with a trailing newline), so it runs only when the first byte is one."""
    return not body or (body[:1].isspace() and not body.strip())


def parse_model(body: bytes) -> str:
    """Only the `model` of a body, with the same guards as `parse_body` (raises BadRequest):
    what body-based routing needs (`extproc/bbr.py`)."""
    return _model(decode_json_object(body))


def _model(payload: Mapping[str, Any]) -> str:
    if "model" not in payload:
        raise BadRequest("request body has no 'model' field")
    model = payload["model"]
    if model is None:
        raise BadRequest("'model' must be a string, not null")
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, not {json_type(model)}")
    if not model.strip():
        raise BadRequest("'model' must not be empty")
    return model


def quote_model(model: str) -> str:
    """A model name for an error message: quoted, and cut short if very long."""
    if len(model) > _MODEL_REPR_LIMIT:
        return repr(model[:_MODEL_REPR_LIMIT]) + "..."
    return repr(model)


def _stream(payload: Mapping[str, Any]) -> bool:
    stream = payload.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, not {json_type(stream)}")
    return stream


def _include_usage(payload: Mapping[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _max_tokens(kind: ApiKind, payload: Mapping[str, Any]) -> int | None:
    names = (
        ("max_output_tokens",)
        if kind is ApiKind.RESPONSES
        else ("max_completion_tokens", "max_tokens")
    )
    for name in names:
        value = payload.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{name}' must be an integer, not {json_type(value)}")
        if not 0 <= value <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"'{name}' must be between 0 and {MAX_TOKENS_LIMIT}")
        return value
    return None


def _prompt(kind: ApiKind, payload: Mapping[str, Any]) -> tuple[str, int]:
    """(prompt text, prompt tokens) for the API kind; OTHER guesses from the fields present."""
    if kind is ApiKind.OTHER:
        if "messages" in payload:
            kind = ApiKind.CHAT_COMPLETIONS
        elif "prompt" in payload:
            kind = ApiKind.COMPLETIONS
        elif "input" in payload:
            kind = ApiKind.EMBEDDINGS
        else:
            return "", 0
    if kind is ApiKind.CHAT_COMPLETIONS:
        return text_and_tokens(chat_prompt_text(chat_messages(payload)))
    if kind is ApiKind.COMPLETIONS:
        return prompt_value("prompt", payload.get("prompt"))
    if kind is ApiKind.EMBEDDINGS:
        return prompt_value("input", payload.get("input"))
    return text_and_tokens(chat_prompt_text(responses_messages(payload)))
