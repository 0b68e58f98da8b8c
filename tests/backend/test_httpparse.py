"""The response parser of the lean scrape client: exact bodies for valid responses however the
bytes are split, and only precise `HttpResponseError`s (no crash, no hang) for anything else."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from poolkeeper.backend.httpparse import HttpResponseError, ResponseParser


def feed_all(parser: ResponseParser, pieces: list[bytes], eof: bool = True) -> bool:
    for piece in pieces:
        if parser.feed(piece):
            return True
    if eof:
        parser.feed_eof()
    return parser.done


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


@st.composite
def valid_response(draw: st.DrawFn) -> tuple[bytes, bytes]:
    body = draw(st.binary(max_size=3000))
    extra = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["X-A", "Server", "Content-Type", "Date", "connection"]),
                st.text("abcdefgh /;=-", max_size=20),
            ),
            max_size=8,
        )
    )
    heads = "".join(f"{name}: {value}\r\n" for name, value in extra if name != "connection")
    framing = draw(st.sampled_from(["length", "chunked"]))
    if framing == "length":
        raw = b"HTTP/1.1 200 OK\r\n" + heads.encode() + b"Content-Length: %d\r\n\r\n" % len(body)
        return raw + body, body
    sizes = draw(st.lists(st.integers(1, 700), max_size=10))
    chunks, at = [], 0
    for size in sizes:
        if at >= len(body):
            break
        piece = body[at : at + size]
        ext = draw(st.sampled_from(["", ";a=b", " ;x"]))
        chunks.append(b"%x%s\r\n" % (len(piece), ext.encode()) + piece + b"\r\n")
        at += size
    if at < len(body):
        chunks.append(b"%x\r\n" % (len(body) - at) + body[at:] + b"\r\n")
    trailer = draw(st.sampled_from([b"", b"X-T: 1\r\n"]))
    raw = b"HTTP/1.1 200 OK\r\n" + heads.encode() + b"Transfer-Encoding: chunked\r\n\r\n"
    return raw + b"".join(chunks) + b"0\r\n" + trailer + b"\r\n", body


@settings(max_examples=400)
@given(valid_response(), st.lists(st.integers(0, 10_000), max_size=12))
def test_valid_responses_parse_exactly_however_split(
    response: tuple[bytes, bytes], cuts: list[int]
) -> None:
    raw, body = response
    parser = ResponseParser(max_body=1 << 20)
    assert feed_all(parser, split(raw, cuts), eof=False)
    assert (parser.status, parser.body, parser.keep_alive) == (200, body, True)


@settings(max_examples=1500)
@given(
    st.one_of(
        st.binary(max_size=400),
        valid_response().map(lambda r: r[0]),
        st.tuples(valid_response(), st.binary(max_size=40), st.integers(0, 4000)).map(
            lambda t: t[0][0][: t[2]] + t[1] + t[0][0][t[2] :]  # corrupted: bytes inserted
        ),
    ),
    st.lists(st.integers(0, 10_000), max_size=8),
)
def test_any_bytes_end_in_a_response_or_a_precise_error(data: bytes, cuts: list[int]) -> None:
    parser = ResponseParser(max_body=2000, max_header_bytes=1000, max_headers=20)
    try:
        feed_all(parser, split(data, cuts))
    except HttpResponseError as exc:
        message = str(exc)
    else:
        message = ""
        assert parser.done
    assert message or parser.done
    assert len(parser.body) <= 2000


def test_close_delimited_body_ends_at_eof_and_is_not_reusable() -> None:
    parser = ResponseParser(max_body=100)
    assert not feed_all(parser, [b"HTTP/1.0 200 OK\r\n\r\nabc", b"def"], eof=False)
    parser.feed_eof()
    assert (parser.body, parser.keep_alive) == (b"abcdef", False)


def test_a_close_delimited_body_cut_by_a_reset_is_an_error() -> None:
    """Only a clean close ends a body without a length: a reset may have cut it anywhere (it
    was accepted as the whole page)."""
    parser = ResponseParser(max_body=100)
    assert not feed_all(parser, [b"HTTP/1.0 200 OK\r\n\r\nabc"], eof=False)
    with pytest.raises(HttpResponseError) as caught:
        parser.feed_eof("Connection reset by peer")
    assert str(caught.value) == (
        "connection lost after 3 bytes of a body delimited by the connection's close: "
        "Connection reset by peer"
    )
    assert not parser.done


@pytest.mark.parametrize(
    ("head", "line"),
    [
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi", b"HTTP/1.1 200 OK\n"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\nhi", b"Content-Length: 2\n"),
        (b"HTTP/1.1 200 OK\r\nX: 1\r\nY: 2\n\n", b"Y: 2\n"),
    ],
)
def test_a_bare_lf_line_ending_is_named_however_split(head: bytes, line: bytes) -> None:
    """The head ends at CRLF CRLF: a bare-LF response was refused as "closed in the response
    head" (or timed out on a kept-alive connection). The error now names the line."""
    for cut in range(len(head) + 1):
        parser = ResponseParser(max_body=100)
        with pytest.raises(HttpResponseError) as caught:
            feed_all(parser, [head[:cut], head[cut:]])
        assert str(caught.value) == (
            f"bare LF line ending (no CR) in the response head, line {line!r}"
        ), cut


@settings(max_examples=300)
@given(valid_response(), st.integers(0, 10_000), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_bare_lf_in_a_valid_head_is_named(
    response: tuple[bytes, bytes], at: int, cuts: list[int]
) -> None:
    raw = response[0]
    head_end = raw.index(b"\r\n\r\n") + 2  # a CR of the head's lines, the last one's too
    crs = [i for i in range(head_end) if raw[i : i + 2] == b"\r\n"]
    drop = crs[at % len(crs)]
    broken = raw[:drop] + raw[drop + 1 :]
    parser = ResponseParser(max_body=1 << 20)
    with pytest.raises(HttpResponseError, match=r"^bare LF line ending"):
        feed_all(parser, split(broken, cuts))


def test_bytes_after_the_response_make_the_connection_unusable() -> None:
    parser = ResponseParser(max_body=100)
    assert parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabEXTRA")
    assert (parser.body, parser.keep_alive) == (b"ab", False)


def test_non_200_ends_at_the_head_with_its_location() -> None:
    parser = ResponseParser(max_body=100)
    assert parser.feed(b"HTTP/1.1 301 Moved Permanently\r\nLocation: https://x/m\r\n\r\n")
    assert (parser.status, parser.reason, parser.location) == (
        301,
        "Moved Permanently",
        "https://x/m",
    )
    assert not parser.keep_alive


@pytest.mark.parametrize(
    ("connection", "version", "reusable"),
    [("", "1.1", True), ("close", "1.1", False), ("", "1.0", False), ("keep-alive", "1.0", True)],
)
def test_keep_alive_follows_version_and_connection_header(
    connection: str, version: str, reusable: bool
) -> None:
    head = f"HTTP/{version} 200 OK\r\nContent-Length: 0\r\n"
    head += f"Connection: {connection}\r\n" if connection else ""
    parser = ResponseParser(max_body=10)
    assert parser.feed(head.encode() + b"\r\n")
    assert parser.keep_alive is reusable
