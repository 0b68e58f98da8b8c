"""A body's long string decoded while the body arrives (requestcontrol/splice.py): the result is
`decode_json_object`'s exactly, or nothing; most of the work is done before the last chunk."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings, strategies as st

from poolkeeper.errors import BadRequest
from poolkeeper.requestcontrol.body import decode_json_object, parse_body
from poolkeeper.requestcontrol.splice import SPLICE_FROM, StringSplice

ENVOY_MESSAGE = 262_144  # Envoy's body messages in `serve` (its 256 KiB connection buffer)


def _fed(body: bytes, cuts: list[int]) -> StringSplice:
    splice = StringSplice()
    edges = [0, *sorted(c for c in cuts if 0 < c < len(body)), len(body)]
    for a, b in itertools.pairwise(edges):
        splice.feed(memoryview(body)[a:b], last=b == len(body))
    return splice


def _envoy_cuts(body: bytes) -> list[int]:
    return list(range(ENVOY_MESSAGE, len(body), ENVOY_MESSAGE))


def _chat(content: str, **extra: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps(body, ensure_ascii=False).encode()


def _expected(body: bytes) -> object:
    try:
        return decode_json_object(body)
    except BadRequest as exc:
        return exc


def test_a_1_mib_prompt_is_decoded_before_its_last_chunk() -> None:
    """The benchmark's shape: the result is the decoder's, and all but the last message's
    part of the prompt was decoded before the last message came."""
    body = _chat("the quick brown fox " * 52_429, max_tokens=1)
    splice = StringSplice()
    cuts = [0, *_envoy_cuts(body), len(body)]
    for a, b in itertools.pairwise(cuts[:-1]):
        splice.feed(body[a:b])
    assert splice.decoded_bytes >= cuts[-2] - 100
    splice.feed(body[cuts[-2] :], last=True)
    payload = splice.payload(body)
    assert payload is not None
    assert payload == json.loads(body)
    assert parse_body("/v1/chat/completions", body, payload) == parse_body(
        "/v1/chat/completions", body
    )


# Each text put at every offset around a cut: the cut falls inside escapes, multi-byte
# characters and backslash runs of both parities.
AWKWARD = ["\n", "\\", '"', "\\\\n", 'a\\"', "ü", "日", "😀", "\t\t", "\u2028", "/"]


@pytest.mark.parametrize("text", AWKWARD)
def test_cuts_inside_escapes_and_characters_give_the_same_result(text: str) -> None:
    """A part never ends inside an escape or a character, so every cut keeps the result."""
    content = "x" * 70_000 + text * 3 + "y" * 70_000
    body = _chat(content)
    at = body.index(json.dumps(text * 3, ensure_ascii=False)[1:-1].encode())
    for cut in range(at - 2, at + 3 * len(json.dumps(text)) + 2):
        assert _fed(body, [cut, cut + 70_000]).payload(body) == json.loads(body), cut


@pytest.mark.parametrize(
    ("inside", "name"),
    [
        (b"\x01", "a control character"),
        (b"\xff", "invalid UTF-8"),
        (b"\xed\xa0\x80", "an encoded surrogate"),
        (b"\\ud800", "a lone surrogate escape"),
        (b"\\x", "a bad escape"),
        (b'"', "a stray quote"),
    ],
)
def test_a_bad_long_string_gives_nothing(inside: bytes, name: str) -> None:
    """Where the body is refused, the splice has no result (the decoder words the error)."""
    body = _chat("x" * 200_000)
    at = body.index(b"x" * 10) + 150_000
    bad = body[:at] + inside + body[at:]
    assert isinstance(_expected(bad), BadRequest), name
    for cuts in ([100_000], [at], [at + 1], _envoy_cuts(bad)):
        assert _fed(bad, cuts).payload(bad) is None


def test_bodies_it_does_not_take_on() -> None:
    # Complete in one chunk, or small: nothing is done.
    big = _chat("x" * 300_000)
    assert _fed(big, []).payload(big) is None
    assert _fed(big, []).decoded_bytes == 0
    small = _chat("x" * (SPLICE_FROM // 2))
    assert _fed(small, [100, 1000]).payload(small) is None
    # No string under the cut (a long token-id array): no result, the decoder decides.
    ids = json.dumps({"model": "m", "prompt": list(range(60_000))}).encode()
    assert _fed(ids, [*_envoy_cuts(ids), SPLICE_FROM + 7]).payload(ids) is None
    # A duplicated model key stays the decoder's to refuse.
    twice = b'{"model": "a", "model": "b", "prompt": "' + b"x" * 300_000 + b'"}'
    assert _fed(twice, [100_000, 200_000]).payload(twice) is None
    # A body that is not the one fed.
    assert _fed(big, [100_000]).payload(big + b" ") is None


def test_the_placeholder_must_stand_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that holds the placeholder's text elsewhere (as a value or a key) is left to
    the decoder."""

    class _Fixed:
        hex = "0" * 32

    monkeypatch.setattr("poolkeeper.requestcontrol.splice.uuid.uuid4", _Fixed)
    placeholder = "pk" + "0" * 32
    for extra in ({"user": placeholder}, {placeholder: 1}):
        body = _chat("x" * 300_000, **extra)
        assert _fed(body, [100_000, 200_000]).payload(body) is None
    body = _chat("x" * 300_000)
    assert _fed(body, [100_000, 200_000]).payload(body) == json.loads(body)


_pieces = st.sampled_from(
    ["word ", "line\n", 'say "hi" ', "ünï ", "日本語 ", "\\", "\t", "😀", "/", "\u0001", "\ud800"]
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_pieces, min_size=1, max_size=6),
    repeat=st.integers(min_value=1_000, max_value=12_000),
    ascii_only=st.booleans(),
    damage=st.one_of(st.none(), st.tuples(st.floats(0, 1), st.integers(0, 255))),
    cuts=st.lists(st.floats(0, 1), min_size=1, max_size=6),
)
def test_any_body_cut_anywhere_decodes_as_the_decoder_says(
    pieces: list[str],
    repeat: int,
    ascii_only: bool,
    damage: tuple[float, int] | None,
    cuts: list[float],
) -> None:
    content = "".join(pieces) * (repeat // len(pieces))
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "n": 1},
        ensure_ascii=ascii_only,
    ).encode("utf-8", "surrogatepass")
    if damage is not None:
        at = int(damage[0] * (len(body) - 1))
        body = body[:at] + bytes([damage[1]]) + body[at + 1 :]
    payload = _fed(body, [int(c * len(body)) for c in cuts]).payload(body)
    if payload is not None:
        assert payload == _expected(body)
