"""Request body parsing: every OpenAI API shape, and every way a body can be bad."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from poolkeeper.errors import BadRequest
from poolkeeper.requestcontrol import body_json as body_module
from poolkeeper.requestcontrol.body import ApiKind, ParsedRequest, api_kind, parse_body, quote_model
from poolkeeper.requestcontrol.body_json import (
    _HOP_FROM,
    MAX_INT_DIGITS,
    _occurrences,
    decode_json_object,
)
from poolkeeper.tokens import chat_prompt_text, count_tokens


def _body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", ApiKind.CHAT_COMPLETIONS),
        ("/chat/completions", ApiKind.CHAT_COMPLETIONS),
        ("/v1/chat/completions?x=1", ApiKind.CHAT_COMPLETIONS),
        ("/v1/chat/completions/", ApiKind.CHAT_COMPLETIONS),
        ("/v1/completions", ApiKind.COMPLETIONS),
        ("/completions", ApiKind.COMPLETIONS),
        ("/v1/embeddings", ApiKind.EMBEDDINGS),
        ("/embeddings", ApiKind.EMBEDDINGS),
        ("/v1/responses", ApiKind.RESPONSES),
        ("/responses", ApiKind.RESPONSES),
        ("/v1/models", ApiKind.OTHER),
        ("/", ApiKind.OTHER),
    ],
)
def test_api_kind_from_path(path: str, kind: ApiKind) -> None:
    assert api_kind(path) is kind


def test_chat_completions() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"text": "there"}]},
    ]
    parsed = parse_body(
        "/v1/chat/completions",
        _body({"model": "m", "messages": messages, "stream": True, "max_tokens": 7}),
    )
    expected = chat_prompt_text(messages)
    assert parsed.api is ApiKind.CHAT_COMPLETIONS
    assert parsed.model == "m"
    assert parsed.prompt == expected
    assert "hello there" in parsed.prompt
    assert parsed.prompt_tokens == count_tokens(expected)
    assert parsed.stream is True
    assert parsed.max_tokens == 7
    assert parsed.include_usage is False
    assert parsed.payload["messages"] == messages


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = {"model": "m", "messages": [], "max_tokens": 5, "max_completion_tokens": 9}
    assert parse_body("/v1/chat/completions", _body(body)).max_tokens == 9
    body = {"model": "m", "messages": [], "max_completion_tokens": 3}
    assert parse_body("/v1/chat/completions", _body(body)).max_tokens == 3
    body = {"model": "m", "messages": [], "max_completion_tokens": None, "max_tokens": 4}
    assert parse_body("/v1/chat/completions", _body(body)).max_tokens == 4


def test_stream_options_include_usage() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    assert parse_body("/v1/chat/completions", _body(body)).include_usage is True
    body["stream_options"] = {"include_usage": False}
    assert parse_body("/v1/chat/completions", _body(body)).include_usage is False
    body["stream_options"] = "yes"
    assert parse_body("/v1/chat/completions", _body(body)).include_usage is False


@pytest.mark.parametrize(
    ("prompt", "text", "tokens"),
    [
        ("abcdefgh", "abcdefgh", 2),
        ("", "", 0),
        (["abcd", "efghi"], "abcd\nefghi", 1 + 2),
        ([1, 2, 3], None, 3),
        ([[1, 2], [3]], None, 3),
        (None, "", 0),
    ],
)
def test_completions_prompt_shapes(prompt: Any, text: str | None, tokens: int) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 10}
    if prompt is not None:
        body["prompt"] = prompt
    parsed = parse_body("/v1/completions", _body(body))
    assert parsed.api is ApiKind.COMPLETIONS
    assert parsed.prompt_tokens == tokens
    if text is not None:
        assert parsed.prompt == text
    assert parsed.max_tokens == 10
    assert parsed.stream is False


def test_token_id_prompts_hash_by_prefix() -> None:
    """Token-id prompts become 4 characters per id, so a shared id prefix is a text prefix."""
    a = parse_body("/v1/completions", _body({"model": "m", "prompt": [5, 70000, 9, 1]}))
    b = parse_body("/v1/completions", _body({"model": "m", "prompt": [5, 70000, 9, 2]}))
    assert len(a.prompt) == 16
    assert a.prompt[:12] == b.prompt[:12]
    assert a.prompt != b.prompt
    assert count_tokens(a.prompt) == a.prompt_tokens


@pytest.mark.parametrize(
    ("value", "tokens"),
    [("some text!", 3), (["ab", "cd"], 2), ([7, 8], 2), ([[1], [2, 3]], 3)],
)
def test_embeddings_input(value: Any, tokens: int) -> None:
    parsed = parse_body("/v1/embeddings", _body({"model": "e", "input": value}))
    assert parsed.api is ApiKind.EMBEDDINGS
    assert parsed.prompt_tokens == tokens
    assert parsed.max_tokens is None


def test_responses_input_and_instructions() -> None:
    body = {
        "model": "r",
        "instructions": "you are terse",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "question"}]},
            {"type": "function_call_output", "output": "42"},
        ],
        "max_output_tokens": 11,
        "max_tokens": 99,
        "stream": True,
    }
    parsed = parse_body("/v1/responses", _body(body))
    assert parsed.api is ApiKind.RESPONSES
    assert parsed.prompt.startswith("<|im_start|>system\nyou are terse<|im_end|>\n")
    assert "question" in parsed.prompt
    assert "42" in parsed.prompt
    assert parsed.max_tokens == 11
    assert parsed.stream is True
    plain = parse_body("/v1/responses", _body({"model": "r", "input": "hi"}))
    assert plain.prompt == chat_prompt_text([{"role": "user", "content": "hi"}])


def test_unknown_path_guesses_shape_from_fields() -> None:
    chat = parse_body("/custom", _body({"model": "m", "messages": [{"content": "abcd"}]}))
    assert "abcd" in chat.prompt
    completion = parse_body("/custom", _body({"model": "m", "prompt": "abcdefgh"}))
    assert completion.prompt_tokens == 2
    bare = parse_body("/v1/tokenize", _body({"model": "m"}))
    assert (bare.prompt, bare.prompt_tokens) == ("", 0)


def test_utf8_bom_and_unicode_text_accepted() -> None:
    body = "\ufeff" + json.dumps({"model": "m", "prompt": "héllo 😀"}, ensure_ascii=True)
    parsed = parse_body("/v1/completions", body.encode())
    assert parsed.prompt == "héllo 😀"  # the escaped surrogate pair decodes to one character


_LONG_MODEL = "x" * 1000

_BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("empty", b"", 'request body is empty: expected a JSON object with a "model" field'),
    ("whitespace", b"  \n", "request body is empty"),
    ("truncated", b'{"model": "m"', "invalid JSON body: Expecting ',' delimiter"),
    ("trailing garbage", b'{"model": "m"} x', "invalid JSON body: Extra data"),
    ("array", b'[{"model": "m"}]', "must be a JSON object, not an array"),
    ("string", b'"m"', "must be a JSON object, not a string"),
    ("null", b"null", "must be a JSON object, not null"),
    ("no model", b'{"prompt": "x"}', "has no 'model' field"),
    ("null model", b'{"model": null}', "'model' must be a string, not null"),
    ("object model", b'{"model": {"a": 1}}', "'model' must be a string, not an object"),
    ("number model", b'{"model": 3}', "'model' must be a string, not a number"),
    ("bool model", b'{"model": true}', "'model' must be a string, not a boolean"),
    ("empty model", b'{"model": ""}', "'model' must not be empty"),
    ("blank model", b'{"model": "  "}', "'model' must not be empty"),
    ("duplicate model", b'{"model": "a", "model": "b"}', "more than one 'model' key"),
    ("escaped duplicate", b'{"model": "a", "mod\\u0065l": "b"}', "more than one 'model' key"),
    ("invalid utf-8", b'{"model": "\xff"}', "not valid UTF-8 (byte 11)"),
    ("lone surrogate", b'{"model": "m", "prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    ("surrogate in key", b'{"model": "m", "\\udfff": 1}', "lone UTF-16 surrogate"),
    ("NaN", b'{"model": "m", "temperature": NaN}', "NaN is not valid JSON"),
    ("Infinity", b'{"model": "m", "temperature": -Infinity}', "-Infinity is not valid JSON"),
    ("float overflow", b'{"model": "m", "top_p": 1e999999}', "out of range"),
    (
        "huge int",
        b'{"model": "m", "seed": ' + b"9" * 5000 + b"}",
        "an integer has more than 4300 digits",
    ),
    ("nesting bomb", b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeply"),
    ("stream string", b'{"model": "m", "stream": "true"}', "'stream' must be a boolean"),
    ("max_tokens float", b'{"model": "m", "max_tokens": 1.5}', "'max_tokens' must be an integer"),
    ("max_tokens bool", b'{"model": "m", "max_tokens": true}', "'max_tokens' must be an integer"),
    ("max_tokens negative", b'{"model": "m", "max_tokens": -1}', "between 0 and"),
    ("max_tokens huge", b'{"model": "m", "max_tokens": 99999999999}', "between 0 and"),
    (
        "max_completion_tokens str",
        b'{"model": "m", "max_completion_tokens": "5"}',
        "'max_completion_tokens' must be an integer, not a string",
    ),
]


@pytest.mark.parametrize(
    ("body", "message"), [(b, m) for _, b, m in _BAD_BODIES], ids=[n for n, _, _ in _BAD_BODIES]
)
def test_bad_bodies_are_400_with_precise_messages(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_body("/v1/completions", body)
    assert message in info.value.message
    assert info.value.http_status == 400
    assert info.value.openai_body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/chat/completions", {"model": "m"}, "no 'messages' array"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "'messages' must be an array"),
        ("/v1/chat/completions", {"model": "m", "messages": [1]}, "'messages[0]' must be an obj"),
        ("/v1/completions", {"model": "m", "prompt": 5}, "'prompt' must be a string or an array"),
        ("/v1/completions", {"model": "m", "prompt": [None]}, "'prompt[0]' must be a string"),
        ("/v1/embeddings", {"model": "m", "input": {"a": 1}}, "'input' must be a string or an"),
        ("/v1/responses", {"model": "m", "input": 3}, "'input' must be a string or an array"),
        ("/v1/responses", {"model": "m", "max_output_tokens": "x"}, "'max_output_tokens' must"),
    ],
)
def test_bad_shapes_per_api(path: str, body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_body(path, _body(body))


def test_duplicate_model_inside_nested_object_is_fine() -> None:
    body = b'{"messages": [{"model": "a", "model": "b", "content": "x"}], "model": "m"}'
    assert parse_body("/v1/chat/completions", body).model == "m"


def test_duplicate_other_top_level_keys_last_wins() -> None:
    assert decode_json_object(b'{"model": "m", "a": 1, "a": 2}')["a"] == 2


def test_int_digit_limit_boundary() -> None:
    assert MAX_INT_DIGITS == 4300
    ok = b'{"model": "m", "seed": -' + b"9" * MAX_INT_DIGITS + b"}"
    assert decode_json_object(ok)["seed"] == -int("9" * MAX_INT_DIGITS)
    with pytest.raises(BadRequest):
        decode_json_object(b'{"model": "m", "seed": ' + b"9" * (MAX_INT_DIGITS + 1) + b"}")


def test_json_bomb_is_rejected_quickly() -> None:
    """Bound the CPU of the worst nesting bomb loosely (a guard against quadratic blowups)."""
    bomb = b'{"model": "m", "x": ' + b"[" * 1_000_000 + b"}"
    started = time.process_time()
    with pytest.raises(BadRequest):
        parse_body("/v1/chat/completions", bomb)
    assert time.process_time() - started < 2.0


def test_quote_model_cuts_long_names() -> None:
    assert quote_model("abc") == "'abc'"
    quoted = quote_model(_LONG_MODEL)
    assert len(quoted) < 200
    assert quoted.endswith("...")


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def _outcome(path: str, raw: bytes) -> ParsedRequest | BadRequest:
    try:
        return parse_body(path, raw)
    except BadRequest as exc:
        return exc


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["/v1/chat/completions", "/v1/completions", "/x"]))
def test_arbitrary_bytes_never_escape_as_anything_but_bad_request(raw: bytes, path: str) -> None:
    outcome = _outcome(path, raw)  # any other exception fails the test
    if isinstance(outcome, BadRequest):
        assert outcome.message


_KEYS = ["model", "messages", "prompt", "input", "stream", "max_tokens", "stream_options", "x"]
_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _JSON_VALUES), st.sampled_from(_PATHS))
def test_arbitrary_json_objects_parse_or_fail_cleanly(obj: dict[str, Any], path: str) -> None:
    outcome = _outcome(path, json.dumps(obj).encode())
    if isinstance(outcome, BadRequest):
        assert outcome.message
        return
    assert outcome.model == obj["model"]
    assert outcome.prompt_tokens >= 0
    assert isinstance(outcome.stream, bool)


def test_long_digit_runs_inside_strings_are_fine() -> None:
    """The huge-number guard must not reject text that merely contains digits."""
    body = {"model": "m", "prompt": "pi is 3." + "1" * 60 + " e.g. 1e400", "seed": 7}
    parsed = parse_body("/v1/completions", json.dumps(body).encode())
    assert parsed.prompt == body["prompt"]
    assert parsed.payload["seed"] == 7


@pytest.mark.parametrize(
    ("number", "accepted"),
    [(b"1e308", True), (b"1e309", False), (b"-1E+400", False), (b"1.5e-400", True), (b"2.5", True)],
)
def test_float_range(number: bytes, accepted: bool) -> None:
    body = b'{"model": "m", "temperature": ' + number + b"}"
    if accepted:
        assert decode_json_object(body)["temperature"] == float(number)
    else:
        with pytest.raises(BadRequest, match="out of range"):
            decode_json_object(body)


def test_out_of_range_token_ids_still_hash() -> None:
    parsed = parse_body("/v1/completions", b'{"model": "m", "prompt": [-1, 99999999999, 5]}')
    assert parsed.prompt_tokens == 3
    assert len(parsed.prompt) == 12
    same = parse_body("/v1/completions", b'{"model": "m", "prompt": [-1, 99999999999, 6]}')
    assert same.prompt[:8] == parsed.prompt[:8]
    assert same.prompt != parsed.prompt


def test_int_limit_holds_even_when_the_interpreter_limit_is_off() -> None:
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(BadRequest, match="more than 4300 digits"):
            decode_json_object(b'{"model": "m", "seed": ' + b"7" * 20_000 + b"}")
        assert decode_json_object(b'{"model": "m", "seed": 12}')["seed"] == 12
    finally:
        sys.set_int_max_str_digits(previous)


_LARGE = "a long prompt " * 2000  # over the size where the checks hop between characters


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"model": "a", "x": "' + _LARGE.encode() + b'", "model": "b"}', "more than one 'model'"),
        (b'{"model": "a", "x": "' + _LARGE.encode() + b'", "\\u006dodel": "b"}', "one 'model'"),
        (b'{"model": "a", "x": "' + _LARGE.encode() + b'\\ud800"}', "lone UTF-16 surrogate"),
        (
            b'{"model": "a", "x": "' + b'\\"' * 400 + _LARGE.encode() + b'", "model": "b"}',
            "more than one 'model'",
        ),
    ],
    ids=["duplicate", "escaped duplicate", "surrogate", "many quotes first"],
)
def test_large_bodies_are_checked_as_small_ones(body: bytes, message: str) -> None:
    """The duplicate-model and surrogate checks find what they look for in a large body too,
    however many quotes and backslashes come before it."""
    with pytest.raises(BadRequest, match=message):
        parse_body("/v1/chat/completions", body)


@given(
    st.text(alphabet='"\\umodel x', max_size=40),
    st.sampled_from(['"model"', "\\u"]),
    st.integers(min_value=1, max_value=3),
)
def test_occurrences_counts_as_str_count_does(piece: str, needle: str, enough: int) -> None:
    text = piece * (_HOP_FROM // max(1, len(piece)) + 1) if piece else "x" * _HOP_FROM
    counted = _occurrences(text, needle, enough=enough)
    assert min(counted, enough) == min(text.count(needle), enough)


# --- the orjson path gives the standard library's answer -------------------------------------


def _decoded(raw: bytes) -> str:
    """What decode_json_object makes of `raw`, spelled exactly (types included: 1 vs 1.0)."""
    try:
        return repr(decode_json_object(raw))
    except BadRequest as exc:
        return f"BadRequest: {exc.message}"


def _both_ways(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    fast = _decoded(raw)
    with monkeypatch.context() as patch:
        patch.setattr(body_module, "_fast_loads", None)
        return fast, _decoded(raw)


_TRICKY = [
    b'{"model":"m","n":123456789012345678901234567890}',  # beyond 64 bits: exact only in stdlib
    b'{"model":"m","n":-9223372036854775809,"u":18446744073709551615}',
    b'{"model":"m","f":1e400}', b'{"model":"m","f":-1e309}', b'{"model":"m","f":NaN}',
    b'{"model":"m","f":Infinity}', b'{"model":"m","f":1E5,"g":-0.0,"h":-0,"i":1e20}',
    b'{"model":"a","model":"b"}', b'{"model":"a","\\u006dodel":"b"}', b'{"model":"\\ud800"}',
    b'{"model":"m","x":"\\ud83d\\ude00"}', b'\xef\xbb\xbf{"model":"m"}', b'{"model":"\xff"}',
    b'{"model":"m","x":' + b"[" * 300 + b"]" * 300 + b"}",
    b'{"model":"m","x":' + b"[" * 1100 + b"]" * 1100 + b"}",
    b'{"model":"m","x":"a\x01b"}', b'{"model":"m",}', b'{"model":"m"} x', b" \n{\"model\":\"m\"}\t",
    b'{"model":"m","prompt":[' + b",".join(b"%d" % i for i in range(5000)) + b"]}",
    b'{"model":"m","prompt":[1,2,99999999999999999999999]}', b"[1]", b"12345678901234567890123",
    b'{"model":"m","x":{"y":{"model":"z"}}}', b'{"model":"m","x":01}', b'{"model":"m","x":.5}',
]  # fmt: skip


@pytest.mark.parametrize("raw", _TRICKY, ids=range(len(_TRICKY)))
def test_the_fast_decoder_answers_as_the_standard_library(
    raw: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, stdlib = _both_ways(raw, monkeypatch)
    assert fast == stdlib


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_the_fast_decoder_answers_as_the_standard_library_on_any_document(value: Any) -> None:
    # Raw UTF-8 as well as \u escapes: the fast path gives up on any escape, so only the raw
    # form puts orjson's reading of non-ASCII text to the test.
    for ensure_ascii in (True, False):
        raw = json.dumps({"model": "m", "v": value}, ensure_ascii=ensure_ascii).encode()
        with pytest.MonkeyPatch.context() as patch:
            fast = _decoded(raw)
            patch.setattr(body_module, "_fast_loads", None)
            assert fast == _decoded(raw)


def test_plain_bodies_take_the_fast_decoder() -> None:
    """The guard conditions leave ordinary requests (a long prompt, token ids) to orjson."""
    if body_module._fast_loads is None:
        pytest.skip("orjson is not installed")
    prompt = {"model": "m", "messages": [{"role": "user", "content": "hello, world " * 5000}]}
    assert body_module._fast_decode(_body(prompt)) == prompt
    ids = {"model": "m", "prompt": list(range(3000)), "max_tokens": 5}
    assert body_module._fast_decode(_body(ids)) == ids


# --- 1 MiB bodies: what the fast path must not change --------------------------------------

_MIB_TEXT = ("the quick brown fox " * 52_429)[: 1 << 20]
_MIB = _body({"model": "m", "messages": [{"role": "user", "content": _MIB_TEXT}]})


@pytest.mark.parametrize("blank", [b"", b" ", b"\n", b" \t\r\n\x0b\x0c" * 200_000])
def test_blank_bodies_of_any_size_are_empty(blank: bytes) -> None:
    with pytest.raises(BadRequest, match="request body is empty"):
        parse_body("/v1/chat/completions", blank)


@pytest.mark.parametrize("pad", [(b"", b"\n"), (b"\r\n ", b""), (b"\t", b" \n")])
def test_a_large_body_with_whitespace_around_it_parses(pad: tuple[bytes, bytes]) -> None:
    parsed = parse_body("/v1/chat/completions", pad[0] + _MIB + pad[1])
    assert parsed.model == "m"
    assert parsed.prompt == chat_prompt_text([{"role": "user", "content": _MIB_TEXT}])
    assert parsed.prompt_tokens == count_tokens(parsed.prompt)


@pytest.mark.parametrize("at", [0, 1, 12, 40, 300_000, len(_MIB) - 3, len(_MIB) - 1])
def test_malformed_json_anywhere_in_a_large_body_is_placed_precisely(at: int) -> None:
    """A stray byte at any offset of a 1 MiB body: the error names the standard library's
    position for it (what the fast path must not change)."""
    broken = _MIB[:at] + b"\x01" + _MIB[at + 1 :]
    with pytest.raises(BadRequest) as info:
        parse_body("/v1/chat/completions", broken)
    with pytest.raises(json.JSONDecodeError) as std:
        json.loads(broken.decode())
    assert info.value.message.startswith("invalid JSON body: ")
    assert f"(char {std.value.pos})" in info.value.message


@pytest.mark.parametrize("at", [100, 500_000, len(_MIB) - 10])
def test_invalid_utf8_inside_a_large_prompt_names_its_byte(at: int) -> None:
    broken = _MIB[:at] + b"\xc3\x28" + _MIB[at + 2 :]
    with pytest.raises(BadRequest, match=rf"not valid UTF-8 \(byte {at}\)"):
        parse_body("/v1/chat/completions", broken)


def test_a_large_prompt_with_escaped_quotes_and_the_model_after_it() -> None:
    content = ('he said "model" and \\"left\\" ' * 40_000)[: 1 << 20]
    raw = (
        b'{"messages": [{"role": "user", "content": '
        + json.dumps(content).encode()
        + b'}], "max_tokens": 3, "model": "late"}'
    )
    parsed = parse_body("/v1/chat/completions", raw)
    assert parsed.model == "late"
    assert parsed.max_tokens == 3
    assert parsed.prompt == chat_prompt_text([{"role": "user", "content": content}])
    with pytest.raises(BadRequest, match="more than one 'model'"):
        parse_body("/v1/chat/completions", raw[:-1] + b', "model": "again"}')
