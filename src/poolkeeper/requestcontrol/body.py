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

Speed: a body goes through `orjson` first (about half the standard library's time: 0.41 against
0.92 ms for a 1 MiB prompt), and its result is kept only where it is certain to be the standard
library's own, so the rules above hold unchanged: no `\\u` escape anywhere (so no lone surrogate
and no escaped `model` key), `"model"` spelled at most once (so no duplicate), no float of 2**63
or more (orjson's reading of an integer beyond 64 bits, which the standard library keeps exact),
nesting at most `_FAST_DEPTH` deep. Anything else, and every body orjson refuses, takes the
standard library's path, which also words the error.
"""

from __future__ import annotations

import json
import math
import re
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, AnyStr

from poolkeeper.errors import BadRequest
from poolkeeper.tokens import chat_prompt_text, count_tokens, message_text

_fast_loads: Callable[[bytes | memoryview], Any] | None
try:
    import orjson

    _fast_loads = orjson.loads
except ImportError:  # a platform without its wheel: the standard library alone
    _fast_loads = None

MAX_INT_DIGITS = 4300  # CPython's default int/str conversion limit (quadratic cost beyond)
MAX_TOKENS_LIMIT = 2**31 - 1
_MODEL_REPR_LIMIT = 120  # how much of a bad model value an error message quotes

# A `\uD800`..`\uDFFF` escape: only when one occurs can the decoded text hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)  # "I" on every usual ABI
# Below this many characters `str.count` is quicker than hopping (see `_occurrences`); beyond
# this many hops, a text dense in the needle's first character is counted after all.
_HOP_FROM = 16_384
_MAX_HOPS = 256
# orjson's result is used only up to this nesting; deeper, the standard library decides (it
# refuses near its recursion limit, orjson at 1,024).
_FAST_DEPTH = 200
_EXACT_INTS_BELOW = 2.0**63  # orjson reads longer integers as floats
_BOM = b"\xef\xbb\xbf"


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


# --- JSON decoding with guards ---------------------------------------------------------------


class _TopLevelDuplicates:
    """object_pairs_hook that remembers whether the most recently built object repeated `model`.

    The decoder builds inner objects first, so after decoding the flag describes the top level.
    """

    __slots__ = ("model_repeated",)

    def __init__(self) -> None:
        self.model_repeated = False

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        self.model_repeated = len(obj) != len(pairs) and sum(k == "model" for k, _ in pairs) > 1
        return obj


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _parse_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json_object(body: bytes) -> dict[str, Any]:
    """Strictly decode a JSON object from UTF-8 bytes (see the module docstring for the rules)."""
    fast = _fast_decode(body)
    if isinstance(fast, dict):
        return fast
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]  # a UTF-8 byte order mark is tolerated, as most JSON servers do
    # Floats are rare in request bodies, so checking each one costs little. Integers are left
    # to the interpreter's digit limit unless that limit is switched off or raised.
    hooks: dict[str, Any] = {"parse_constant": _reject_constant, "parse_float": _parse_float}
    if not 0 < sys.get_int_max_str_digits() <= MAX_INT_DIGITS:
        hooks["parse_int"] = _parse_int
    # A second `model` key needs the literal spelled twice, or a \u escape spelling it; only
    # then is the (slower) per-object hook needed.
    duplicates = _TopLevelDuplicates()
    escapes = _occurrences(text, "\\u", enough=1) > 0
    if escapes or _occurrences(text, '"model"', enough=2) > 1:
        hooks["object_pairs_hook"] = duplicates
    try:
        value = json.loads(text, **hooks)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"invalid JSON body: {exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})"
        ) from None
    except RecursionError:
        raise BadRequest("invalid JSON body: nested too deeply") from None
    except ValueError as exc:
        message = str(exc)
        if "integer string conversion" in message:  # the interpreter's digit limit
            message = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        raise BadRequest(f"invalid JSON body: {message}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"request body must be a JSON object, not {_json_type(value)}")
    if duplicates.model_repeated:
        raise BadRequest("request body has more than one 'model' key")
    if escapes and _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise BadRequest("request body contains a lone UTF-16 surrogate escape")
    return value


def _fast_decode(body: bytes) -> Any:
    """orjson's decoding of `body` where it is the standard library's too, else None."""
    if _fast_loads is None:
        return None
    data = memoryview(body)[len(_BOM) :] if body.startswith(_BOM) else body
    if _occurrences(body, b"\\u", enough=1) or _occurrences(body, b'"model"', enough=2) > 1:
        return None
    try:
        value = _fast_loads(data)
    except ValueError:  # orjson.JSONDecodeError
        return None
    return None if _differs_from_stdlib(value) else value


def _differs_from_stdlib(value: Any) -> bool:
    """Whether orjson's `value` may not be what the standard library makes of the same text: a
    float of 2**63 or more (an integer beyond 64 bits), or nesting beyond `_FAST_DEPTH`."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if type(item) is dict:
            children: Any = item.values()
        elif type(item) is list:
            children = item
        else:
            if type(item) is float and abs(item) >= _EXACT_INTS_BELOW:
                return True
            continue
        if depth >= _FAST_DEPTH:
            return True
        kinds = set(map(type, children))  # one C-speed pass: long token-id arrays are common
        if float in kinds and any(
            type(x) is float and abs(x) >= _EXACT_INTS_BELOW for x in children
        ):
            return True
        if dict in kinds or list in kinds:
            stack.extend((x, depth + 1) for x in children if type(x) in (dict, list))
    return False


def _occurrences(text: AnyStr, needle: AnyStr, *, enough: int) -> int:
    """`text.count(needle)`, or any number from `enough` up when there are that many.

    `str.count` and `in` with a needle of several characters scan a large text at about a
    nanosecond a character (1 ms for a 1 MiB prompt, for each of the checks above), while
    finding one character is a `memchr`. So in a large text this hops from one occurrence
    of the needle's first character (a quote, a backslash: few in a prompt) to the next; a
    text with many of them is counted the slow way after `_MAX_HOPS` hops."""
    if len(text) < _HOP_FROM:
        return text.count(needle)
    first, size, find, found = needle[:1], len(needle), text.find, 0
    at = find(first)
    for _ in range(_MAX_HOPS):
        if at < 0:
            return found
        if text.startswith(needle, at):
            found += 1
            if found >= enough:
                return found
            at = find(first, at + size)  # non-overlapping, as str.count counts
        else:
            at = find(first, at + 1)
    return text.count(needle)


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in a decoded document cannot be encoded as UTF-8."""
    stack: list[Any] = [value]  # iterative: the document may be nested close to the limit
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# --- fields ----------------------------------------------------------------------------------


def _model(payload: Mapping[str, Any]) -> str:
    if "model" not in payload:
        raise BadRequest("request body has no 'model' field")
    model = payload["model"]
    if model is None:
        raise BadRequest("'model' must be a string, not null")
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, not {_json_type(model)}")
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
        raise BadRequest(f"'stream' must be a boolean, not {_json_type(stream)}")
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
            raise BadRequest(f"'{name}' must be an integer, not {_json_type(value)}")
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
        return _text_and_tokens(chat_prompt_text(_messages(payload)))
    if kind is ApiKind.COMPLETIONS:
        return _prompt_value("prompt", payload.get("prompt"))
    if kind is ApiKind.EMBEDDINGS:
        return _prompt_value("input", payload.get("input"))
    return _text_and_tokens(chat_prompt_text(_responses_messages(payload)))


def _text_and_tokens(text: str) -> tuple[str, int]:
    return text, count_tokens(text)


def _messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        if messages is None:
            raise BadRequest("chat request body has no 'messages' array")
        raise BadRequest(f"'messages' must be an array, not {_json_type(messages)}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{index}]' must be an object, not {_json_type(message)}")
    return messages


def _responses_messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
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
        raise BadRequest(f"'input' must be a string or an array, not {_json_type(items)}")
    return messages


def _prompt_value(name: str, value: Any) -> tuple[str, int]:
    """A completions `prompt` / embeddings `input`: str, [str], [int] or [[int]]."""
    if value is None:
        return "", 0
    if isinstance(value, str):
        return _text_and_tokens(value)
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be a string or an array, not {_json_type(value)}")
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
                f"not {_json_type(item)}"
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
