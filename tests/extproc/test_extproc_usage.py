"""SSE and JSON usage extraction, with the stream split at every byte position."""

from __future__ import annotations

import json

import pytest

from poolkeeper.extproc.model_name import rewriter_for
from poolkeeper.extproc.usage import (
    MAX_PENDING_EVENT,
    SseUsageFilter,
    usage_from_json,
    usage_from_object,
)
from poolkeeper.requestcontrol.types import Usage


def _chunk(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CONTENT = [
    _chunk({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}], "usage": None}),
    _chunk({"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}}], "usage": None}),
]
# What a client that did not ask for usage sees: the injected `"usage": null` fields removed.
CONTENT_CLEAN = [
    _chunk({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
    _chunk({"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}}]}),
]
USAGE_CHUNK = _chunk(
    {
        "id": "c1",
        "choices": [],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 2,
            "total_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
)
DONE = b"data: [DONE]\n\n"
STREAM = b"".join([*CONTENT, USAGE_CHUNK, DONE])
EXPECTED = Usage(prompt_tokens=7, completion_tokens=2, cached_tokens=4)


def _run(stream: bytes, cut: int, *, strip: bool) -> tuple[bytes, SseUsageFilter]:
    f = SseUsageFilter(strip_injected_usage=strip)
    out = f.feed(stream[:cut]) + f.feed(stream[cut:]) + f.finish()
    return out, f


@pytest.mark.parametrize("strip", [False, True])
def test_every_split_position_gives_same_usage_and_output(strip: bool) -> None:
    expected_out = b"".join([*CONTENT_CLEAN, DONE]) if strip else STREAM
    for cut in range(len(STREAM) + 1):
        out, f = _run(STREAM, cut, strip=strip)
        assert out == expected_out, cut
        assert f.usage == EXPECTED, cut
        assert f.saw_done


def test_one_byte_pieces() -> None:
    f = SseUsageFilter(strip_injected_usage=True)
    out = b"".join(f.feed(STREAM[i : i + 1]) for i in range(len(STREAM))) + f.finish()
    assert out == b"".join([*CONTENT_CLEAN, DONE])
    assert f.usage == EXPECTED


def test_complete_events_are_forwarded_without_waiting() -> None:
    f = SseUsageFilter(strip_injected_usage=True)
    assert f.feed(CONTENT[0] + CONTENT[1][:5]) == CONTENT_CLEAN[0]
    assert f.feed(CONTENT[1][5:]) == CONTENT_CLEAN[1]


def test_crlf_events_and_multiline_data() -> None:
    event = b'data: {"choices": [],\r\ndata: "usage": {"prompt_tokens": 3}}\r\n\r\n'
    f = SseUsageFilter(strip_injected_usage=True)
    assert f.feed(event + b"data: [DONE]\r\n\r\n") == b"data: [DONE]\r\n\r\n"
    assert f.usage == Usage(prompt_tokens=3, completion_tokens=0)


def test_usage_chunk_with_choices_is_kept_even_when_stripping() -> None:
    event = _chunk(
        {"choices": [{"delta": {}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    )
    f = SseUsageFilter(strip_injected_usage=True)
    assert f.feed(event) == event
    assert f.usage == Usage(1, 1)


def test_unterminated_tail_is_flushed_at_finish() -> None:
    f = SseUsageFilter(strip_injected_usage=False)
    assert f.feed(b"data: partial") == b"data: partial"  # not stripping: passes at once
    assert f.finish() == b""
    g = SseUsageFilter(strip_injected_usage=True)
    assert g.feed(b"data: partial") == b""
    assert g.finish() == b"data: partial"


def test_garbage_passes_through() -> None:
    junk = b'data: {"usage": not json\n\n: comment\n\n'
    f = SseUsageFilter(strip_injected_usage=True)
    assert f.feed(junk) + f.finish() == junk
    assert f.usage is None


def test_usage_from_json_body() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 6}}).encode()
    assert usage_from_json(body) == Usage(5, 6)
    assert usage_from_json(b"not json") is None
    assert usage_from_json(b"[1, 2]") is None
    assert usage_from_json(b'{"usage": null}') is None


def test_injected_null_usage_fields_are_removed_only_when_stripping() -> None:
    chunk = (
        b'data: {"id":"c","choices":[{"delta":{"content":"\\"usage\\": null"}}],"usage":null}\n\n'
    )
    first = b'data: {"usage": null, "id": "c", "choices": []}\n\n'
    f = SseUsageFilter(strip_injected_usage=True)
    out = f.feed(chunk + first)
    assert out == (
        b'data: {"id":"c","choices":[{"delta":{"content":"\\"usage\\": null"}}]}\n\n'
        b'data: {"id": "c", "choices": []}\n\n'
    )
    for event in out.split(b"\n\n")[:-1]:
        json.loads(event[6:])  # still valid JSON
    g = SseUsageFilter(strip_injected_usage=False)
    assert g.feed(chunk) == chunk


# Upstream's fixture (`pkg/epp/handlers/response_test.go@v0.5.1`, `streamingBodyWithUsage`):
# the usage chunk and `[DONE]` on consecutive `data:` lines, no blank line between them.
UPSTREAM_STREAMING_BODY_WITH_USAGE = (
    b'data: {"id":"cmpl-41764c93-f9d2-4f31-be08-3ba04fa25394","object":"text_completion",'
    b'"created":1740002445,"model":"food-review-0","choices":[],'
    b'"usage":{"prompt_tokens":7,"total_tokens":17,"completion_tokens":10}}\n'
    b"data: [DONE]\n\t"
)


@pytest.mark.parametrize("strip", [False, True])
def test_response_test_go_streaming_body_with_usage(strip: bool) -> None:
    for cut in range(len(UPSTREAM_STREAMING_BODY_WITH_USAGE) + 1):
        out, sse = _run(UPSTREAM_STREAMING_BODY_WITH_USAGE, cut, strip=strip)
        assert sse.usage == Usage(prompt_tokens=7, completion_tokens=10), cut
        assert sse.saw_done, cut
        if strip:  # the usage-only chunk goes, the [DONE] line stays
            assert out == b"data: [DONE]\n\t", cut
        else:
            assert out == UPSTREAM_STREAMING_BODY_WITH_USAGE, cut


def test_lines_without_blank_separators_before_a_terminated_event() -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n'
        + USAGE_CHUNK.rstrip(b"\n")
        + b"\n"
        + DONE
    )
    out, sse = _run(stream, len(stream) // 2, strip=True)
    assert sse.usage == EXPECTED
    assert sse.saw_done
    assert out == b'data: {"choices":[{"delta":{"content":"a"}}]}\n' + DONE


def test_multiline_json_data_is_still_one_message() -> None:
    event = (
        b'data: {"choices": [],\ndata: "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n'
    )
    out, sse = _run(event, 5, strip=False)
    assert sse.usage == Usage(prompt_tokens=3, completion_tokens=1)
    assert out == event


def _crlf(event: bytes) -> bytes:
    return event.replace(b"\n\n", b"\r\n\r\n")


# Servers and proxies may mix event endings within one stream. Each event ends at the first
# ending found, whichever kind it is: taking a later one would glue two events together.
MIXED_STREAMS = {
    "lf-then-crlf": CONTENT[0] + _crlf(CONTENT[1]) + _crlf(USAGE_CHUNK) + DONE,
    "crlf-then-lf": _crlf(CONTENT[0]) + CONTENT[1] + USAGE_CHUNK + _crlf(DONE),
    "alternating": CONTENT[0] + _crlf(CONTENT[1]) + USAGE_CHUNK + _crlf(DONE),
}


@pytest.mark.parametrize("name", sorted(MIXED_STREAMS))
def test_mixed_event_endings_split_at_the_first_ending(name: str) -> None:
    stream = MIXED_STREAMS[name]
    for cut in (0, len(stream) // 2, len(stream)):
        out, f = _run(stream, cut, strip=True)
        assert f.usage == EXPECTED, (name, cut)
        assert f.saw_done, (name, cut)
        assert b'"choices": []' not in out, (name, cut)  # the injected chunk never leaks
        assert out.count(b"data: ") == 3, (name, cut)  # two content chunks and [DONE]
        assert f.events == 4, (name, cut)


def test_usage_with_only_completion_tokens() -> None:
    assert usage_from_object({"usage": {"completion_tokens": 5}}) == Usage(0, 5)
    assert usage_from_object({"usage": {"prompt_tokens": 4}}) == Usage(4, 0)
    assert usage_from_object({"usage": {"total_tokens": 4}}) is None


def test_cr_only_line_endings_and_data_without_a_blank() -> None:
    # Bare "\r" ends lines and events too; "data:" need not be followed by a blank.
    events = (
        b'data: {"choices": [],\rdata: "usage": {"prompt_tokens": 3}}\r\r'
        b'data:{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    )
    f = SseUsageFilter(strip_injected_usage=True)
    g = SseUsageFilter(strip_injected_usage=True)
    assert f.feed(events[: events.index(b"\r\r") + 2]) == b""  # injected: dropped
    assert f.usage == Usage(prompt_tokens=3, completion_tokens=0)
    assert g.feed(events) == b""
    assert g.usage == Usage(1, 2)


def test_a_leading_blank_event_is_its_own_event() -> None:
    out, f = _run(b"\n\n" + STREAM, 0, strip=True)
    assert out == b"\n\n" + b"".join([*CONTENT_CLEAN, DONE])
    assert f.usage == EXPECTED
    assert f.events == 5


def test_saw_done_is_false_until_done_arrives() -> None:
    f = SseUsageFilter(strip_injected_usage=False)
    f.feed(CONTENT[0])
    assert f.saw_done is False
    f.feed(DONE)
    assert f.saw_done is True


def test_an_endless_event_is_forwarded_once_it_passes_the_limit() -> None:
    f = SseUsageFilter(strip_injected_usage=True)
    head = b"data: " + b"x" * (MAX_PENDING_EVENT - 6)
    assert len(head) == MAX_PENDING_EVENT
    assert f.feed(head) == b""  # at the limit: still held
    assert f.feed(b"y") == head + b"y"  # past it: forwarded, nothing kept
    assert f.feed(CONTENT[1]) == CONTENT_CLEAN[1]  # and the stream goes on normally
    assert f.finish() == b""
    assert f.finish() == b""  # finishing twice adds nothing


def test_a_client_that_asked_for_usage_keeps_its_null_usage_fields() -> None:
    # Held for the model-name rewrite, but not stripped: the client asked for usage, so the
    # `"usage": null` of every chunk is part of what it asked for.
    chunk = b'data: {"model":"lora-a","choices":[],"usage":null}\n\n'
    f = SseUsageFilter(strip_injected_usage=False, rewrite=rewriter_for("lora-a", "client"))
    assert f.feed(chunk) + f.finish() == b'data: {"model":"client","choices":[],"usage":null}\n\n'
