"""Strict JSON decoding of a request body: the guards against inputs that break naive parsers.

Pure and synchronous; every failure is a `BadRequest` with a precise message
(`decode_json_object`). The rules, and why, are `body.py`'s docstring's "Decisions".

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
from collections.abc import Callable
from typing import Any, AnyStr

from poolkeeper.errors import BadRequest

_fast_loads: Callable[[bytes | memoryview], Any] | None
try:
    import orjson

    _fast_loads = orjson.loads
except ImportError:  # a platform without its wheel: the standard library alone
    _fast_loads = None

MAX_INT_DIGITS = 4300  # CPython's default int/str conversion limit (quadratic cost beyond)

# A `\uD800`..`\uDFFF` escape: only when one occurs can the decoded text hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Below this many characters `str.count` is quicker than hopping (see `_occurrences`); beyond
# this many hops, a text dense in the needle's first character is counted after all.
_HOP_FROM = 16_384
_MAX_HOPS = 256
# orjson's result is used only up to this nesting; deeper, the standard library decides (it
# refuses near its recursion limit, orjson at 1,024).
_FAST_DEPTH = 200
_EXACT_INTS_BELOW = 2.0**63  # orjson reads longer integers as floats
_BOM = b"\xef\xbb\xbf"


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
        raise BadRequest(f"request body must be a JSON object, not {json_type(value)}")
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


def json_type(value: Any) -> str:
    """How an error message names the JSON type of `value`."""
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
